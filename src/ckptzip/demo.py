"""``ckptzip demo``: train a tiny model for a few seconds, save it with torch.save and ckptzip,
load both back, and print sizes, ratio and times side by side."""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from . import api


class TinyLM(nn.Module):
    """A small character-level transformer (about 1.4 M parameters)."""

    def __init__(self, vocab: int = 256, d: int = 192, layers: int = 3, ctx: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.ctx = ctx

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.head(self.body(h, mask=mask, is_causal=True))


def _text() -> torch.Tensor:
    import glob
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    data = b"".join(open(p, "rb").read() for p in files) or b"hello world " * 10000
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_demo(seconds: float = 8.0, device: str | None = None, out_dir: str | None = None) -> dict:
    console = Console()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    text = _text()
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0, steps = time.time(), 0
    with console.status(f"training a {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M-parameter "
                        f"model on {device} for {seconds:g} s"):
        while time.time() - t0 < seconds:
            ix = torch.randint(0, text.numel() - model.ctx - 1, (16,))
            seq = torch.stack([text[i:i + model.ctx + 1] for i in ix.tolist()]).long().to(device)
            loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 256), seq[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
    console.print(f"trained {steps} steps, loss {loss.item():.3f}")
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps,
             "rng": torch.get_rng_state()}
    tmp = None if out_dir else tempfile.TemporaryDirectory()
    d = out_dir or tmp.name
    os.makedirs(d, exist_ok=True)
    pt, ckz = os.path.join(d, "demo.pt"), os.path.join(d, "demo.ckz")
    res = {}
    for name, save, load, path in (
        ("torch.save", lambda: _torch_save(state, pt), lambda: torch.load(pt, weights_only=True), pt),
        ("ckptzip", lambda: api.save(state, ckz), lambda: api.load(ckz), ckz),
    ):
        _sync(device)
        t = time.perf_counter()
        save()
        _sync(device)
        ts = time.perf_counter() - t
        t = time.perf_counter()
        back = load()
        _sync(device)
        tl = time.perf_counter() - t
        res[name] = {"bytes": os.path.getsize(path), "save_s": ts, "load_s": tl}
        for k, v in state["model"].items():
            assert torch.equal(v.view(torch.uint8).cpu(), back["model"][k].view(torch.uint8).cpu()), k
    base = res["torch.save"]["bytes"]
    t = Table(title=f"one checkpoint of a {steps}-step model + AdamW state ({device})")
    for c in ("", "bytes", "of torch.save's", "save s", "load s", "bit-exact"):
        t.add_column(c, justify="right")
    for name, r in res.items():
        t.add_row(name, f"{r['bytes']:,}", f"{r['bytes'] / base:.3f}", f"{r['save_s']:.3f}",
                  f"{r['load_s']:.3f}", "yes")
    console.print(t)
    if tmp:
        tmp.cleanup()
        console.print("(the files went to a temporary directory, now removed: --out DIR keeps them)")
    else:
        console.print(f"files: {pt} and {ckz} (next: ckptzip info {ckz})", soft_wrap=True)
    return res


def _torch_save(state, path):
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
