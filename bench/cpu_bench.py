"""CPU benchmark (issue: core): a small model trained for real (model + AdamW state), saved with
torch.save and ckptzip on this machine's CPU; bytes and compress/decompress MB/s.

    PYTHONPATH=src python bench/cpu_bench.py --steps 300
"""
import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import ckptzip
from ckptzip.demo import TinyLM, _text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    text = _text()
    model = TinyLM(d=256, layers=4, ctx=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.time()
    for step in range(a.steps):
        ix = torch.randint(0, text.numel() - 65, (16,))
        seq = torch.stack([text[i:i + 65] for i in ix.tolist()]).long()
        loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_s = time.time() - t0
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": a.steps}
    raw = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        t.numel() * t.element_size() for s in opt.state_dict()["state"].values() for t in s.values()
        if isinstance(t, torch.Tensor))
    res = {"params": sum(p.numel() for p in model.parameters()), "steps": a.steps, "final_loss": loss.item(),
           "train_s": train_s, "tensor_bytes": raw, "cpu_cores": os.cpu_count(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as d:
        pt, ckz = os.path.join(d, "s.pt"), os.path.join(d, "s.ckz")
        best = {}
        for _ in range(a.reps):
            for name, fn in (("torch.save", lambda: torch.save(state, pt)),
                             ("ckptzip.save", lambda: ckptzip.save(state, ckz, fsync=False)),
                             ("torch.load", lambda: torch.load(pt, weights_only=True)),
                             ("ckptzip.load", lambda: ckptzip.load(ckz))):
                t = time.perf_counter()
                fn()
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        res["torch.save_bytes"] = os.path.getsize(pt)
        res["ckptzip_bytes"] = os.path.getsize(ckz)
        res["ratio_vs_torch_save"] = res["ckptzip_bytes"] / res["torch.save_bytes"]
        res["seconds"] = best
        res["ckptzip_compress_MBps"] = raw / best["ckptzip.save"] / 1e6
        res["ckptzip_decompress_MBps"] = raw / best["ckptzip.load"] / 1e6
        back = ckptzip.load(ckz)
        assert all(torch.equal(back["model"][k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in state["model"].items())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
