"""Exploration on a GPU: what the first synchronous ckptzip.save and ckptzip.load of a process
spend their time on (cProfile of saves and loads 1 and 2 of the benchmark GPT's state, fsync'd,
local disk, page cache dropped before each load; torch.save / torch.load beside).

    PYTHONPATH=src python bench/probe_cold.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip  # noqa: E402
from gpt import one_step_state  # noqa: E402
from run_bench import drop_cache  # noqa: E402


def main():
    st = one_step_state()
    os.makedirs("/tmp/d", exist_ok=True)
    for i in range(3):
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        ckptzip.save(st, f"/tmp/d/c{i}.ckz")
        pr.disable()
        print("ckptzip.save", i, round(time.perf_counter() - t, 3), flush=True)
        if i < 2:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(35)
            print(s.getvalue()[:9000])
    for i in range(3):
        drop_cache(f"/tmp/d/c{i}.ckz")
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        back = ckptzip.load(f"/tmp/d/c{i}.ckz", map_location="cuda")
        torch.cuda.synchronize()
        pr.disable()
        print("ckptzip.load", i, round(time.perf_counter() - t, 3), flush=True)
        del back
        if i < 2:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
            print(s.getvalue()[:7000])
    for i in range(2):
        t = time.perf_counter()
        with open(f"/tmp/d/t{i}.pt", "wb") as f:
            torch.save(st, f)
            f.flush()
            os.fsync(f.fileno())
        print("torch.save", i, round(time.perf_counter() - t, 3), flush=True)
    for i in range(2):
        drop_cache(f"/tmp/d/t{i}.pt")
        t = time.perf_counter()
        back = torch.load(f"/tmp/d/t{i}.pt", map_location="cuda", weights_only=True)
        torch.cuda.synchronize()
        print("torch.load", i, round(time.perf_counter() - t, 3), flush=True)
        del back


if __name__ == "__main__":
    main()
