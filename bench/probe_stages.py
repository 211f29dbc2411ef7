"""Exploration on a GPU: host microseconds per stage of ckptzip's GPU decode and encode+pack,
measured with perf_counter wrappers (no profiler), the GPU held by a sleep kernel so that only a
synchronizing call waits. Prints mean us per call and per repetition.

    PYTHONPATH=src python bench/probe_stages.py
"""
import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_common import components, decode_all, encode_all, planned  # noqa: E402

from ckptzip import _triton_bp, engine, transforms  # noqa: E402
from ckptzip.codecs import _capi, gpu as G  # noqa: E402

ACC = collections.defaultdict(float)
CNT = collections.Counter()


def wrap(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            ACC[label] += time.perf_counter() - t
            CNT[label] += 1
    setattr(owner, name, g)


for owner, name in ((engine, "decode_group"), (engine, "copy_segments"), (engine, "encode_group_arrays"),
                    (engine, "gather_gpu"), (engine, "pack"), (_triton_bp, "copy_segments"), (_triton_bp, "encode"),
                    (_triton_bp, "decode"), (G.NvcompCodec, "decode"), (G.NvcompCodec, "encode"),
                    (_capi, "decompress"), (_capi, "compress"), (_capi, "_table"), (_capi, "check_decodes"),
                    (_capi.Batch, "sizes"), (transforms.BytePlane, "decode"), (transforms.BytePlane, "encode")):
    wrap(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")


def main():
    for name, t in components().items():
        plan, units, dst = planned(t, warm=5)
        enc = functools.partial(encode_all, units)
        reps = 10
        for label, fn in (("decode", None), ("encode", enc)):
            packed = enc()
            torch.cuda.synchronize()
            ACC.clear()
            CNT.clear()
            tot = 0.0
            for _ in range(reps):
                torch.cuda._sleep(int(2e8))
                t0 = time.perf_counter()
                decode_all(packed, plan, dst) if fn is None else fn()
                tot += time.perf_counter() - t0
                torch.cuda.synchronize()
            print(f"== {name} {label}: {tot / reps * 1e3:.2f} ms per rep (incl. waits)")
            for k, v in sorted(ACC.items(), key=lambda kv: -kv[1]):
                print(f"   {k:40s} {v / CNT[k] * 1e6:9.0f} us/call {CNT[k] // reps:3d} calls/rep")


if __name__ == "__main__":
    main()
