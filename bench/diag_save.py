"""Sync save timing, first vs later saves in one process, vs torch.save (GPU): python bench/diag_save.py"""
import os, sys, time, torch
sys.path.insert(0, "bench")
import ckptzip
from gpt import one_step_state
st = one_step_state()
os.makedirs("/tmp/d", exist_ok=True)
for i in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    ckptzip.save(st, f"/tmp/d/c{i}.ckz"); print("ckptzip.save", i, round(time.perf_counter() - t, 3), flush=True)
for i in range(2):
    t = time.perf_counter()
    with open(f"/tmp/d/t{i}.pt", "wb") as f:
        torch.save(st, f); f.flush(); os.fsync(f.fileno())
    print("torch.save", i, round(time.perf_counter() - t, 3), flush=True)
