"""Exploration on a GPU: per-repetition wall time vs GPU time (CUDA events) of the planned decode
and encode of 172 MB bf16 / 343 MB fp32, to tell host-side jitter from slow kernels; with a
torch.profiler trace of the slowest decode.

    PYTHONPATH=src python bench/probe_jitter.py
"""
import gc
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import ref_of  # noqa: E402

from ckptzip.engine import Job, decode_group, encode_group_arrays, gather_gpu, gpu_window, units_of  # noqa: E402
from ckptzip.codecs import _capi  # noqa: E402
from ckptzip.planner import Planner  # noqa: E402


def decode_all(packed, plan, dst):
    pos = 0
    with _capi.deferred_checks():
        for u, buf, rows, soffs in packed:
            n = u.data.numel()
            decode_group(buf, soffs, rows, [(Job(rows, plan.transform, plan.codec, dst), 0, len(rows), pos, pos + n)],
                         "cuda")
            pos += n
        torch.cuda.synchronize()


def main():
    torch.manual_seed(0)
    w = torch.randn(86 << 20, device="cuda") * 0.02
    for name, t in (("bf16", w.bfloat16()), ("fp32", w)):
        ref = ref_of(t)
        win = gpu_window()
        plan = Planner("auto", "auto", 1 << 20, None, "cuda", False).plan_all([ref], win)[0]
        units = units_of(0, ref.data, plan, win)
        dst = torch.empty_like(ref.data)
        gc.disable()
        rows_e, rows_d = [], []
        for rep in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a.record()
            packed = []
            for u in units:
                enc = encode_group_arrays([u])
                buf, rel = gather_gpu(enc)
                packed.append((u, buf, rel, rel["offset"].astype(np.int64)))
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
        n = ref.data.numel()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                decode_all(packed, plan, dst)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                for u in units:
                    enc = encode_group_arrays([u])
                    gather_gpu(enc)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
        for label, rows in (("encode", rows_e), ("decode", rows_d)):
            print(name, label, "wall/host-return/gpu GB/s per rep:")
            print("  " + " ".join(f"{n / w_ / 1e9:.0f}/{n / h / 1e9:.0f}/{n / g / 1e9:.0f}" for w_, h, g in rows), flush=True)


if __name__ == "__main__":
    main()
