"""Exploration on a GPU: host cost of ckptzip's GPU encode+pack and decode, with the GPU held
busy by a sleep kernel queued first, so that the host never waits for work it queued unless it
synchronizes: the host time of a decode (which should not synchronize) is pure launch overhead,
and a blocking call shows up as ~the sleep. cProfile of 10 repetitions, top functions by own time.

    PYTHONPATH=src python bench/probe_sleep.py
"""
import cProfile
import functools
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_common import components, decode_all, encode_all, planned  # noqa: E402

SLEEP = int(2e8)  # ~100 ms of GPU clock cycles


def main():
    for name, t in components().items():
        plan, units, dst = planned(t, warm=5)
        enc = functools.partial(encode_all, units)
        torch.cuda.synchronize()
        packed = enc()
        torch.cuda.synchronize()
        rows = []
        for _ in range(10):  # no profiler: decode host time with the GPU held, then GPU-only time
            torch.cuda._sleep(SLEEP)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            th = decode_all(packed, plan, dst)
            rows.append(((th - t0) * 1e3, None))
        for _ in range(10):  # encode and decode without a sleep: wall and GPU ms
            out = []
            for fn in (enc, lambda: decode_all(packed, plan, dst)):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                out.append(((time.perf_counter() - t0) * 1e3, a.elapsed_time(b)))
            rows.append(tuple(out))
        print(f"== {name}: decode host ms with GPU held:", " ".join(f"{r[0]:.2f}" for r in rows[:10]))
        print(f"== {name}: encode wall/gpu ms:", " ".join(f"{r[0][0]:.2f}/{r[0][1]:.2f}" for r in rows[10:]))
        print(f"== {name}: decode wall/gpu ms:", " ".join(f"{r[1][0]:.2f}/{r[1][1]:.2f}" for r in rows[10:]))
        for label in ("decode", "encode"):
            packed = enc()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            host = []
            for _ in range(10):
                torch.cuda._sleep(SLEEP)
                t0 = time.perf_counter()
                prof.enable()
                if label == "decode":
                    th = decode_all(packed, plan, dst)
                else:
                    enc()
                    th = time.perf_counter()
                prof.disable()
                host.append((th - t0) * 1e3)
                torch.cuda.synchronize()
            print(f"== {name} {label}: host ms per rep (GPU held by a ~100 ms sleep first):",
                  " ".join(f"{h:.2f}" for h in host))
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
                print("\n".join(s.getvalue().splitlines()[6:40]), flush=True)


if __name__ == "__main__":
    main()
