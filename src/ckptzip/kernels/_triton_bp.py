"""Triton kernels for the byteplane transform on CUDA tensors: one read and one write per byte,
no temporaries. Same wire format as the torch implementation in transforms/byteplane.py (which CPU tensors
and machines without Triton use); tests check the two agree."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

_U = {2: (torch.int16, tl.uint16), 4: (torch.int32, tl.uint32), 8: (torch.int64, tl.uint64)}
TILE = 2048


from . import DELTA, EXPREF, PLAIN, XOR  # noqa: E402  (the kernels' MODE constexpr)
#: ``expref`` (transforms/refs.py): the binary32 exponent field shifted right by one (bits
#: 22..29) and the prediction ``f >> 1`` at the same place (bits 24..30 of the reference >> 2)
_EXP_HALF = tl.constexpr(0x3FC00000)
_PRED = tl.constexpr(0x1FC00000)


@triton.jit
def _enc(src, ref, dst, n, block, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr, TILE: tl.constexpr,
         MODE: tl.constexpr):
    """Byte planes of ``src`` (MODE 0), or of its residual against ``ref``: ``xor`` (1),
    ``delta``'s folded difference (2), or ``expref``'s exponent residual (3, 32-bit words)."""
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < n
    d = tl.load(src + idx, mask=mask).to(UT, bitcast=True)
    if MODE == 1:
        d = d ^ tl.load(ref + idx, mask=mask).to(UT, bitcast=True)
    elif MODE == 2:
        d = d - tl.load(ref + idx, mask=mask).to(UT, bitcast=True)
        top = d >> (BITS - 1)
        d = d ^ ((top << (BITS - 1)) - top)  # the low bits inverted where the top bit is set
    elif MODE == 3:
        p = (tl.load(ref + idx, mask=mask).to(UT, bitcast=True) >> 2) & _PRED
        xe = (d >> 1) & _EXP_HALF
        d = (d ^ (xe << 1)) | (((xe - p) & _EXP_HALF) << 1)
    r = (d << 1) | (d >> (BITS - 1))
    b = idx // block
    j = idx - b * block
    m = tl.minimum(block, n - b * block)
    base = b * block * W + j
    for k in tl.static_range(W):
        tl.store(dst + base + k * m, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _dec(src, ref, dst, n, block, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr, TILE: tl.constexpr,
         MODE: tl.constexpr):
    """Inverse of ``_enc``: the words from their planes, then (MODE 1, 2) ``xor`` / ``delta``
    against ``ref`` undone (``ref`` may be ``dst`` itself: each word is read before it is
    written, by the same program)."""
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
    d = (r >> 1) | (r << (BITS - 1))
    if MODE == 1:
        d = d ^ tl.load(ref + idx, mask=mask).to(UT, bitcast=True)
    elif MODE == 2:
        top = d >> (BITS - 1)
        d = tl.load(ref + idx, mask=mask).to(UT, bitcast=True) + (d ^ ((top << (BITS - 1)) - top))
    elif MODE == 3:
        p = (tl.load(ref + idx, mask=mask).to(UT, bitcast=True) >> 2) & _PRED
        xe = (d >> 1) & _EXP_HALF
        d = (d ^ (xe << 1)) | (((xe + p) & _EXP_HALF) << 1)
    tl.store(dst + idx, d, mask=mask)


def _launch(kernel, src: torch.Tensor, ref: torch.Tensor, dst: torch.Tensor, n: int, width: int, block: int,
            mode: int) -> None:
    if n:
        kernel[(triton.cdiv(n, TILE),)](src, ref, dst, n, block, W=width, BITS=8 * width, UT=_U[width][1],
                                        TILE=TILE, MODE=mode)


def encode(src: torch.Tensor, width: int, block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(src) if out is None else out
    if src.numel() >= width:  # (an empty slice need not be word-aligned: no views of it)
        words = src.view(_U[width][0])
        _launch(_enc, words, words, out, src.numel() // width, width, block, PLAIN)
    return out


def decode(src: torch.Tensor, dst: torch.Tensor, width: int, block: int) -> None:
    if src.numel() >= width:
        d = dst.view(_U[width][0])
        _launch(_dec, src, d, d, src.numel() // width, width, block, PLAIN)


def encode_ref(src: torch.Tensor, ref: torch.Tensor, out: torch.Tensor, width: int, block: int, mode: int) -> None:
    """``byteplane(width, block)`` of the residual of ``src`` against ``ref`` (``mode`` XOR,
    DELTA, or EXPREF for 32-bit words) into ``out``, in one pass. All flat uint8 CUDA tensors of
    one size, word-aligned."""
    if mode not in (XOR, DELTA, EXPREF) or (mode == EXPREF and width != 4):
        raise ValueError(f"no fused kernel for mode {mode} at width {width}")
    if src.numel() >= width:
        it = _U[width][0]
        _launch(_enc, src.view(it), ref.view(it), out, src.numel() // width, width, block, mode)


def decode_ref(src: torch.Tensor, ref: torch.Tensor, dst: torch.Tensor, width: int, block: int, mode: int) -> None:
    """Inverse of :func:`encode_ref`: ``dst`` = the words of planes ``src`` with the residual
    against ``ref`` undone; ``ref`` may be ``dst`` for XOR and DELTA (each word is read before
    it is written)."""
    if mode not in (XOR, DELTA, EXPREF) or (mode == EXPREF and width != 4):
        raise ValueError(f"no fused kernel for mode {mode} at width {width}")
    if src.numel() >= width:
        it = _U[width][0]
        _launch(_dec, src, ref.view(it), dst.view(it), src.numel() // width, width, block, mode)


SEG_TILE = 1 << 18


@triton.jit(do_not_specialize=["nseg"])  # a new segment count must not mean a new compile
def _copy_tiles(src, dst, table, nseg, BLOCK: tl.constexpr, TILE: tl.constexpr, FAST: tl.constexpr):
    """Program (g, t) copies tile t (TILE bytes) of segment g: dst[d:d+n] = src[s:s+n] and zeros
    in dst[d+n:d+z], where (s, d, n, z) is column g of ``table`` (4 rows of ``nseg``). Tiles whose
    offsets are 16-byte aligned (and z a multiple of 4) move 4-byte words, unmasked 16-byte
    vectors for all full blocks; the others move bytes."""
    g = tl.program_id(0)  # segments on the axis without CUDA's 65535 limit
    t = tl.program_id(1).to(tl.int64) * TILE
    z = tl.load(table + 3 * nseg + g)
    if t >= z:
        return
    s = tl.load(table + g) + t
    d = tl.load(table + nseg + g) + t
    n = tl.minimum(tl.maximum(tl.load(table + 2 * nseg + g) - t, 0), TILE)
    z = tl.minimum(z - t, TILE)
    if FAST and (s % 16 == 0) & (d % 16 == 0) & (z % 4 == 0):
        src32 = (src + s).to(tl.pointer_type(tl.int32))
        dst32 = (dst + d).to(tl.pointer_type(tl.int32))
        src32 = tl.multiple_of(src32, 16)
        dst32 = tl.multiple_of(dst32, 16)
        nw = n // 4
        zw = z // 4
        nfull = nw // BLOCK
        for i in range(0, nfull):
            w = i * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst32 + w, tl.load(src32 + w))
        k = tl.arange(0, 4)
        tail = tl.load(src + s + nw * 4 + k, mask=k < n - nw * 4, other=0).to(tl.int32)
        part = tl.sum(tail << (8 * k), axis=0)  # the last partial word, zero-padded
        for j in range(nfull * BLOCK, zw, BLOCK):
            w = j + tl.arange(0, BLOCK)
            v = tl.load(src32 + w, mask=w < nw, other=0)
            v = tl.where(w == nw, part, v)
            tl.store(dst32 + w, v, mask=w < zw)
    else:
        for i in range(0, z, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            tl.store(dst + d + offs, tl.load(src + s + offs, mask=offs < n, other=0), mask=offs < z)


def copy_segments(src: torch.Tensor, soffs, dst: torch.Tensor, doffs, lens, ends=None) -> None:
    """dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]] for all i, and zeros up to ``ends[i]``
    bytes (default: ``lens``), in one launch over a (segments, tiles) grid: the host only
    uploads the segment table (an asynchronous copy, without a synchronization). ``soffs`` may point outside
    ``src`` into other allocations on the same device (offsets relative to ``src``'s first byte),
    which lets one launch gather from several tensors."""
    ends = lens if ends is None else ends
    if not len(lens):
        return
    table = np.stack([soffs, doffs, lens, ends]).astype(np.int64, copy=False)
    t = torch.from_numpy(table).to(src.device, non_blocking=True)  # staged by CUDA at once, no device wait
    fast = src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
    grid = (len(lens), max(1, -(-int(ends.max()) // SEG_TILE)))
    _copy_tiles[grid](src, dst, t, len(lens), BLOCK=2048, TILE=SEG_TILE, FAST=fast)
