"""Sync save timing, first vs later saves in one process, vs torch.save (GPU): python bench/diag_save.py"""
import os, sys, time, torch
sys.path.insert(0, "bench")
import ckptzip
from gpt import GPT
torch.manual_seed(0)
m = GPT().cuda(); opt = torch.optim.AdamW(m.parameters())
x = torch.randint(0, 256, (4, 128), device="cuda")
with torch.autocast("cuda", torch.bfloat16):
    m(x).float().mean().backward()
opt.step()
sd = m.state_dict()
st = {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "optimizer": opt.state_dict()}
os.makedirs("/tmp/d", exist_ok=True)
for i in range(4):
    torch.cuda.synchronize(); t = time.perf_counter()
    ckptzip.save(st, f"/tmp/d/c{i}.ckz"); print("ckptzip.save", i, round(time.perf_counter() - t, 3), flush=True)
for i in range(2):
    t = time.perf_counter()
    with open(f"/tmp/d/t{i}.pt", "wb") as f:
        torch.save(st, f); f.flush(); os.fsync(f.fileno())
    print("torch.save", i, round(time.perf_counter() - t, 3), flush=True)
