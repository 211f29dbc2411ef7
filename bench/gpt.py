"""A GPT-2-small-class model trained on real text (Python sources found on the machine), used by
the benchmarks to get realistic weights and AdamW state."""
from __future__ import annotations

import glob
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 512) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus(limit: int = 64 << 20) -> torch.Tensor:
    """Bytes of Python sources on this machine (real text), up to ``limit`` bytes."""
    roots = [os.path.dirname(os.__file__)] + sys.path
    data, total = [], 0
    for root in roots:
        for p in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            try:
                with open(p, "rb") as f:
                    b = f.read()
            except OSError:
                continue
            data.append(b)
            total += len(b)
            if total >= limit:
                return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)


def train(steps: int, device: str = "cuda", batch: int = 16, ctx: int = 512, log=print, **model_kw):
    """Train for ``steps`` AdamW steps under bf16 autocast; returns (model, optimizer, losses)."""
    torch.manual_seed(0)
    text = corpus().to(device)
    model = GPT(ctx=ctx, **model_kw).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator(device="cpu").manual_seed(1)
    losses, t0 = [], time.time()
    for step in range(steps):
        ix = torch.randint(0, text.numel() - ctx - 1, (batch,), generator=g).to(device)
        off = torch.arange(ctx + 1, device=device)
        seq = text[ix[:, None] + off].long()
        lr = 6e-4 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, steps))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item() if step % 50 == 0 or step == steps - 1 else float("nan"))
        if step % 200 == 0 or step == steps - 1:
            log(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    return model, opt, losses


def checkpoint(model, opt) -> dict:
    """The benchmark state dict: fp32 master weights, a bf16 copy, and the AdamW state."""
    sd = model.state_dict()
    return {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()},
            "optimizer": opt.state_dict()}


def components(state: dict) -> dict[str, list[torch.Tensor]]:
    """Tensors of the checkpoint grouped as bf16 weights / fp32 weights / Adam m / Adam v."""
    st = state["optimizer"]["state"].values()
    return {"bf16 weights": list(state["model_bf16"].values()),
            "fp32 weights": list(state["model"].values()),
            "adam m": [s["exp_avg"] for s in st],
            "adam v": [s["exp_avg_sq"] for s in st]}


def one_step_state(device: str = "cuda") -> dict:
    """The benchmark GPT after one AdamW step (fp32 weights, a bf16 copy, Adam m and v): the
    tensor layout of a real checkpoint without training time, for timing probes."""
    torch.manual_seed(0)
    m = GPT().to(device)
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randint(0, 256, (4, 128), device=device)
    with torch.autocast(device, torch.bfloat16):
        m(x).float().mean().backward()
    opt.step()
    sd = m.state_dict()
    return {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "optimizer": opt.state_dict()}
