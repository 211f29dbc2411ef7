"""Exploration on a GPU: A/B of the nvCOMP call path on the planned encode+pack and decode of
343 MB fp32 / 172 MB bf16 synthetic weights, variants interleaved round by round in one process
(drift and clock changes hit all alike), the GPU kept at full clocks by a busy kernel before each
timed section (as in a training loop). Variants: ANS through nvCOMP's C API (ctypes, the
engine's choice) or through the Python binding. (The fourth session also A/B'd copy_ for segments
of 1 MiB and more against the one-launch Triton copy; the engine keeps only the latter.) Earlier A/Bs (segment copies, allocator,
header-checked decode) and their results: docs/benchmarks.md.

    PYTHONPATH=src python bench/probe_ab.py
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import ref_of  # noqa: E402

from ckptzip.codecs import gpu as G  # noqa: E402
from probe_common import components, decode_all, encode_all, planned  # noqa: E402

_A = None


def spin(ms=15):
    """Keep the GPU busy ~ms so that its clocks are up, then wait for it."""
    global _A
    if _A is None:
        _A = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e3 < ms:
        _A @ _A
        torch.cuda.synchronize()


def one(plan, units, dst):
    spin()
    t0 = time.perf_counter()
    packed = encode_all(units)
    torch.cuda.synchronize()
    te = time.perf_counter() - t0
    spin()
    t0 = time.perf_counter()
    decode_all(packed, plan, dst)
    return te, time.perf_counter() - t0


def main():
    G._nvcomp()
    variants = ["capi", "binding"]
    for name, t in components().items():
        plan, units, dst = planned(t)
        ref = ref_of(t)
        times = {v: ([], []) for v in variants}
        for rnd in range(16):
            for v in variants:
                plan.codec.__dict__.pop("_c", None)
                if v == "binding":
                    plan.codec.__dict__["_c"] = None
                te, td = one(plan, units, dst)
                if rnd:
                    times[v][0].append(te)
                    times[v][1].append(td)
        n = ref.data.numel()
        assert torch.equal(dst, ref.data)
        for v, (e, d) in times.items():
            print(json.dumps({"data": name, "path": v,
                              "c_med": round(n / statistics.median(e) / 1e9, 1), "c_best": round(n / min(e) / 1e9, 1),
                              "d_med": round(n / statistics.median(d) / 1e9, 1), "d_best": round(n / min(d) / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
