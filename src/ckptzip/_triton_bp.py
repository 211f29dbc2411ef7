"""Triton kernels for the byteplane transform on CUDA tensors: one read and one write per byte,
no temporaries. Same wire format as the torch implementation in transforms.py (which CPU tensors
and machines without Triton use); tests check the two agree."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_U = {2: (torch.int16, tl.uint16), 4: (torch.int32, tl.uint32), 8: (torch.int64, tl.uint64)}
TILE = 2048


@triton.jit
def _enc(src, dst, n, block, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr, TILE: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < n
    u = tl.load(src + idx, mask=mask).to(UT, bitcast=True)
    r = (u << 1) | (u >> (BITS - 1))
    b = idx // block
    j = idx - b * block
    m = tl.minimum(block, n - b * block)
    base = b * block * W + j
    for k in tl.static_range(W):
        tl.store(dst + base + k * m, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _dec(src, dst, n, block, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr, TILE: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < n
    b = idx // block
    j = idx - b * block
    m = tl.minimum(block, n - b * block)
    base = b * block * W + j
    r = tl.zeros([TILE], dtype=UT)
    for k in tl.static_range(W):
        byte = tl.load(src + base + k * m, mask=mask).to(UT)
        r = r | (byte << (8 * k))
    u = (r >> 1) | (r << (BITS - 1))
    tl.store(dst + idx, u, mask=mask)


def encode(src: torch.Tensor, width: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    it, ut = _U[width]
    n = src.numel() // width
    out = torch.empty_like(src) if out is None else out
    if n:
        _enc[(triton.cdiv(n, TILE),)](src.view(it), out, n, block, W=width, BITS=8 * width, UT=ut, TILE=TILE)
    return out


def decode(src: torch.Tensor, dst: torch.Tensor, width: int, block: int) -> None:
    it, ut = _U[width]
    n = src.numel() // width
    if n:
        d = dst.view(it)
        _dec[(triton.cdiv(n, TILE),)](src, d, n, block, W=width, BITS=8 * width, UT=ut, TILE=TILE)
