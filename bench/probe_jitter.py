"""Exploration on a GPU: per-repetition wall time vs GPU time (CUDA events) of the planned decode
and encode of 172 MB bf16 / 343 MB fp32, to tell host-side jitter from slow kernels; with a
torch.profiler trace of the slowest decode.

    PYTHONPATH=src python bench/probe_jitter.py
"""
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_common import components, decode_all, encode_all, planned  # noqa: E402


def main():
    for name, t in components().items():
        plan, units, dst = planned(t)
        gc.disable()
        rows_e, rows_d = [], []
        for rep in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            packed = encode_all(units)
            b.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            rows_e.append((time.perf_counter() - t0, t1 - t0, a.elapsed_time(b) / 1e3))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            decode_all(packed, plan, dst)
            b.record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            rows_d.append((time.perf_counter() - t0, t1 - t0, a.elapsed_time(b) / 1e3))
        gc.enable()
        n = dst.numel()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                decode_all(packed, plan, dst)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                encode_all(units)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        for label, rows in (("encode", rows_e), ("decode", rows_d)):
            print(name, label, "wall/host-return/gpu GB/s per rep:")
            print("  " + " ".join(f"{n / w_ / 1e9:.0f}/{n / h / 1e9:.0f}/{n / g / 1e9:.0f}" for w_, h, g in rows), flush=True)


if __name__ == "__main__":
    main()
