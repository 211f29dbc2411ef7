"""Triton kernels for the byteplane transform on CUDA tensors: one read and one write per byte,
no temporaries. Same wire format as the torch implementation in transforms.py (which CPU tensors
and machines without Triton use); tests check the two agree."""
from __future__ import annotations

import numpy as np
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


SEG_TILE = 16384


@triton.jit
def _copy_tiles(src, dst, t_src, t_dst, t_len, t_end, BLOCK: tl.constexpr, TILE: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.load(t_src + pid)
    d = tl.load(t_dst + pid)
    n = tl.load(t_len + pid)
    z = tl.load(t_end + pid)
    for i in tl.static_range(0, TILE, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(dst + d + offs, tl.load(src + s + offs, mask=offs < n, other=0), mask=offs < z)


def copy_segments(src: torch.Tensor, soffs, dst: torch.Tensor, doffs, lens, ends=None) -> None:
    """dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]] for all i, and zeros up to ``ends[i]``
    bytes (default: ``lens``), in one launch: segments are cut into tiles of SEG_TILE bytes, one
    program per tile (numpy int64 arrays in, on the host; the tile table goes up pinned, without
    a synchronization)."""
    ends = lens if ends is None else ends
    ntiles = np.maximum((ends + SEG_TILE - 1) // SEG_TILE, 1)
    seg = np.repeat(np.arange(len(lens)), ntiles)
    first = np.repeat(np.cumsum(ntiles) - ntiles, ntiles)
    k = (np.arange(len(seg)) - first) * SEG_TILE
    table = np.stack([soffs[seg] + k, doffs[seg] + k, np.clip(lens[seg] - k, 0, SEG_TILE),
                      np.clip(ends[seg] - k, 0, SEG_TILE)])
    t = torch.from_numpy(table).pin_memory().to(src.device, non_blocking=True)
    _copy_tiles[(len(seg),)](src, dst, t[0], t[1], t[2], t[3], BLOCK=4096, TILE=SEG_TILE)
