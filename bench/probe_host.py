"""Exploration on a GPU: what the host does during ckptzip's GPU encode/decode of one component.
(1) gpu_throughput.measure on 343 MB fp32 and 172 MB bf16 (synthetic weights, the size of the
benchmark GPT's components); (2) a timeline with a sync after every stage (host vs GPU time per
stage); (3) cProfile of the encode+pack and decode loops (no extra syncs); (4) the same measure
with nvCOMP's scratch memory from torch's caching allocator and with ExecutionPolicy.LATENCY.

    PYTHONPATH=src python bench/probe_host.py   (writes $OUT/probe_host.json)
"""
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import measure  # noqa: E402

from ckptzip import engine  # noqa: E402
from ckptzip.codecs import gpu as G  # noqa: E402

OUT = os.environ.get("OUT", ".")
res: dict = {}


def data():
    torch.manual_seed(0)
    w = torch.randn(86 << 20, device="cuda") * 0.02
    return {"fp32": w, "bf16": w.bfloat16()}


def timeline(t):
    """Per stage: host ms until the call returns, and ms until the GPU is done (sync after)."""
    stages: dict = {}

    def wrap(mod, name, label):
        orig = getattr(mod, name)

        def f(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = orig(*a, **k)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            s = stages.setdefault(label, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += (t1 - t0) * 1e3
            s[2] += (t2 - t0) * 1e3
            return r
        setattr(mod, name, f)
        return orig

    saved = []
    saved.append((G.NvcompCodec, "encode", wrap(G.NvcompCodec, "encode", "nvcomp encode")))
    saved.append((G.NvcompCodec, "decode", wrap(G.NvcompCodec, "decode", "nvcomp decode")))
    saved.append((engine, "copy_segments", wrap(engine, "copy_segments", "copy_segments")))
    from ckptzip.transforms import BytePlane
    saved.append((BytePlane, "encode", wrap(BytePlane, "encode", "transform encode")))
    saved.append((BytePlane, "decode", wrap(BytePlane, "decode", "transform decode")))
    try:
        measure(t, reps=2)
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)
    return {k: {"calls": v[0], "host_ms": round(v[1] / 2, 3), "until_done_ms": round(v[2] / 2, 3)} for k, v in stages.items()}


def profile(t):
    pr = cProfile.Profile()
    measure(t, reps=1)
    pr.enable()
    measure(t, reps=3)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


class _TorchBuf:
    """nvCOMP scratch memory from torch's caching allocator."""
    __slots__ = ("t", "ptr")

    def __init__(self, n):
        self.t = torch.empty(max(int(n), 1), dtype=torch.uint8, device="cuda")
        self.ptr = self.t.data_ptr()


def main():
    d = data()
    for k, t in d.items():
        measure(t, reps=1)  # warm up (compile, plans)
        res[f"base {k}"] = {kk: v for kk, v in measure(t).items() if kk in ("compress_GBps", "decompress_GBps", "ratio", "choice")}
        res[f"timeline {k}"] = timeline(t)
        res[f"profile {k}"] = profile(t)
    from nvidia import nvcomp as nv
    nv.set_device_allocator(lambda n, s: _TorchBuf(n))
    G._make_codec.cache_clear()
    for k, t in d.items():
        measure(t, reps=1)
        res[f"torch alloc {k}"] = {kk: v for kk, v in measure(t).items() if kk in ("compress_GBps", "decompress_GBps")}
    orig = G._make_codec

    @functools.lru_cache(maxsize=64)
    def latency(algorithm, device, stream, opts):
        return nv.Codec(algorithm=algorithm, device_id=device, cuda_stream=stream,
                        bitstream_kind=nv.BitstreamKind.RAW, execution_policy=nv.ExecutionPolicy.LATENCY, **dict(opts))
    G._make_codec = latency
    try:
        for k, t in d.items():
            measure(t, reps=1)
            res[f"torch alloc + LATENCY {k}"] = {kk: v for kk, v in measure(t).items() if kk in ("compress_GBps", "decompress_GBps")}
    except Exception as e:
        res["LATENCY"] = repr(e)
    G._make_codec = orig


if __name__ == "__main__":
    try:
        main()
    finally:
        with open(os.path.join(OUT, "probe_host.json"), "w") as f:
            json.dump(res, f, indent=1)
        for k, v in res.items():
            print(k, v if isinstance(v, str) else json.dumps(v))
