"""Plain PyTorch training loop with ckptzip checkpoints: save every N steps (in the background),
stop, and resume exactly where it stopped.

    python examples/train_resume.py --dir /tmp/run --steps 200 --stop-at 120   # "crashes" at 120
    python examples/train_resume.py --dir /tmp/run --steps 200                 # resumes, finishes
"""
import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F

import ckptzip


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def batch(step: int):
    g = torch.Generator().manual_seed(step)  # data order depends only on the step
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def run(directory: str, steps: int, every: int = 20, stop_at: int | None = None, device: str = "cpu") -> list[float]:
    model, opt = make()
    model.to(device)
    mgr = ckptzip.CheckpointManager(directory, keep_last=2, async_save=True)
    start = 0
    if mgr.latest() is not None:  # resume: weights, optimizer, step and every RNG
        s = mgr.load(map_location=device)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optimizer"])
        torch.set_rng_state(s["rng"]["torch"])
        np.random.set_state(s["rng"]["numpy"])
        random.setstate(s["rng"]["python"])
        start = s["step"] + 1
    losses = []
    for step in range(start, steps):
        if stop_at is not None and step == stop_at:
            break
        x, y = batch(step)
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)  # uses the torch RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % every == every - 1:
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                    "python": random.getstate()}})
    mgr.wait()
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stop-at", type=int, default=None)
    a = ap.parse_args()
    losses = run(a.dir, a.steps, stop_at=a.stop_at)
    print(f"ran {len(losses)} steps, last loss {losses[-1]:.5f}" if losses else "nothing to do")
