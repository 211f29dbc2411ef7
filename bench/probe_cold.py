"""Exploration on a GPU: what the first synchronous ckptzip.save of a process spends its time on
(cProfile of save 1 and save 2 of the benchmark GPT's state, fsync'd, local disk).

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
    for i in range(2):
        t = time.perf_counter()
        with open(f"/tmp/d/t{i}.pt", "wb") as f:
            torch.save(st, f)
            f.flush()
            os.fsync(f.fileno())
        print("torch.save", i, round(time.perf_counter() - t, 3), flush=True)


if __name__ == "__main__":
    main()
