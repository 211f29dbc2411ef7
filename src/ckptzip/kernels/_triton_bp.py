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


from ..transforms.refs import EXP_HALF, EXP_PRED, NAN16  # noqa: E402
from . import (DELTA, DERIVED, EXPGRID, EXPREF, HASH_MIN, HIDELTA, PARTIAL, PARTIAL16, PLAIN,  # noqa: E402
               PLAIN16, XOR)  # (the kernels' MODE constexpr)
#: ``expref``'s masks (transforms/refs.py), as constants a kernel may read
_EXP_HALF = tl.constexpr(EXP_HALF)
_PRED = tl.constexpr(EXP_PRED)
_NAN_BF16 = tl.constexpr(NAN16["bfloat16"])  # ``derived``'s NaN


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
    elif MODE == 6:  # hidelta (32-bit words; transforms/refs.py np_hidelta)
        hb = tl.load(ref + idx, mask=mask).to(UT, bitcast=True) >> 16
        hx = d >> 16
        dd = ((hx & 0x7FFF) - (hb & 0x7FFF)) & 0x7FFF
        f = dd ^ ((dd >> 14) * 0x3FFF)
        y = (((hx ^ hb) >> 15) << 31) | ((f & 0x3FFF) << 17) | ((f >> 14) << 16) | (d & 0xFFFF)
        d = (y >> 1) | (y << 31)
    if MODE == 8:  # byteplane rotate 16: the top half rotated, the sign beside its mantissa bits
        r = ((((d >> 15) & 0xFFFE) | (d >> 31)) << 16) | (d & 0xFFFF)
    else:
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
    if MODE == 8:
        d = ((((r >> 17) & 0x7FFF) | (((r >> 16) & 1) << 15)) << 16) | (r & 0xFFFF)
    else:
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
    elif MODE == 6:  # hidelta: reads the top half of the reference word only
        hb = tl.load(ref + idx, mask=mask).to(UT, bitcast=True) >> 16
        f = ((r >> 17) & 0x3FFF) | (((r >> 16) & 1) << 14)
        dd = f ^ ((f >> 14) * 0x3FFF)
        d = ((((hb + dd) & 0x7FFF) | (((r >> 31) ^ (hb >> 15)) << 15)) << 16) | (r & 0xFFFF)
    tl.store(dst + idx, d, mask=mask)


@triton.jit
def _dec_part(src, dst, n, block, TILE: tl.constexpr):
    """Words from planes 0, 2 and 3 of ``byteplane`` width 4 (each block of the stream: those
    three planes; plane 1 is taken as zeros), rotation undone: bits 15..31 of each word are
    exact, which is what ``hidelta`` reads of its reference."""
    idx = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = idx < n
    b = idx // block
    j = idx - b * block
    m = tl.minimum(block, n - b * block)
    base = b * block * 3 + j
    r = tl.load(src + base, mask=mask).to(tl.uint32)
    r = r | (tl.load(src + base + m, mask=mask).to(tl.uint32) << 16)
    r = r | (tl.load(src + base + 2 * m, mask=mask).to(tl.uint32) << 24)
    tl.store(dst + idx, (r >> 1) | (r << 31), mask=mask)


def decode_part(src: torch.Tensor, dst: torch.Tensor, block: int) -> None:
    """:func:`_dec_part` of ``src`` (whole blocks of 3 planes each, flat uint8) into ``dst``
    (flat uint8, 4/3 of its size, word-aligned)."""
    n = src.numel() // 3
    if n:
        _dec_part[(triton.cdiv(n, TILE),)](src, dst.view(torch.int32), n, block, TILE=TILE)


def _launch(kernel, src: torch.Tensor, ref: torch.Tensor, dst: torch.Tensor, n: int, width: int, block: int,
            mode: int) -> None:
    if n:
        kernel[(triton.cdiv(n, TILE),)](src, ref, dst, n, block, W=width, BITS=8 * width, UT=_U[width][1],
                                        TILE=TILE, MODE=mode)


def encode(src: torch.Tensor, width: int, block: int, out: torch.Tensor | None = None,
           rot16: bool = False) -> torch.Tensor:
    """Byte planes of ``src``; ``rot16``: ``byteplane``'s ``rotate`` 16 (32-bit words)."""
    out = torch.empty_like(src) if out is None else out
    if src.numel() >= width:  # (an empty slice need not be word-aligned: no views of it)
        words = src.view(_U[width][0])
        _launch(_enc, words, words, out, src.numel() // width, width, block, PLAIN16 if rot16 else PLAIN)
    return out


def decode(src: torch.Tensor, dst: torch.Tensor, width: int, block: int, rot16: bool = False) -> None:
    if src.numel() >= width:
        d = dst.view(_U[width][0])
        _launch(_dec, src, d, d, src.numel() // width, width, block, PLAIN16 if rot16 else PLAIN)


def _check_mode(mode: int, width: int) -> None:
    if mode not in (XOR, DELTA, EXPREF, HIDELTA) or (mode in (EXPREF, HIDELTA) and width != 4):
        raise ValueError(f"no fused kernel for mode {mode} at width {width}")


def encode_ref(src: torch.Tensor, ref: torch.Tensor, out: torch.Tensor, width: int, block: int, mode: int) -> None:
    """``byteplane(width, block)`` of the residual of ``src`` against ``ref`` (``mode`` XOR,
    DELTA, or EXPREF for 32-bit words) into ``out``, in one pass. All flat uint8 CUDA tensors of
    one size, word-aligned."""
    _check_mode(mode, width)
    if src.numel() >= width:
        it = _U[width][0]
        _launch(_enc, src.view(it), ref.view(it), out, src.numel() // width, width, block, mode)


def decode_ref(src: torch.Tensor, ref: torch.Tensor, dst: torch.Tensor, width: int, block: int, mode: int) -> None:
    """Inverse of :func:`encode_ref`: ``dst`` = the words of planes ``src`` with the residual
    against ``ref`` undone; ``ref`` may be ``dst`` for XOR and DELTA (each word is read before
    it is written)."""
    _check_mode(mode, width)
    if src.numel() >= width:
        it = _U[width][0]
        _launch(_dec, src, ref.view(it), dst.view(it), src.numel() // width, width, block, mode)


@triton.jit
def _segment(table, nseg, ntiles, TILE: tl.constexpr):
    """This program's segment g of a multi-segment table (see ``_dec_multi``): g, its byte
    offsets soff, doff, roff, its word count n, and the program's word indices with their mask."""
    pid = tl.program_id(0)
    g = tl.load(table + 8 * nseg + pid)
    idx = tl.load(table + 8 * nseg + ntiles + pid) + tl.arange(0, TILE).to(tl.int64)
    n = tl.load(table + 3 * nseg + g)
    return (g, tl.load(table + g), tl.load(table + nseg + g), tl.load(table + 2 * nseg + g), n, idx,
            idx < n)


@triton.jit
def _planes_at(table, nseg, g, n, idx, W: tl.constexpr):
    """Where word ``idx``'s first byte plane byte is in a segment's planes, and the stride from
    one plane to the next (``block`` words per block, the last block shorter)."""
    block = tl.load(table + 4 * nseg + g)
    b = idx // block
    j = idx - b * block
    return b * block * W + j, tl.minimum(block, n - b * block)


@triton.jit
def _against_ref(d, base, table, nseg, g, roff, idx, mask, BITS: tl.constexpr, UT: tl.constexpr,
                 MODE: tl.constexpr, DECODE: tl.constexpr):
    """``d`` (words) with segment g's reference transform applied (encode) or undone (DECODE):
    MODE 1 xor, 2 delta's folded difference, 3 expref, 4 derived (bfloat16 rounding of float32
    reference words, NaN to 0x7FC0), 5 expgrid (row + column terms)."""
    rp = (base + roff).to(tl.pointer_type(UT))
    if MODE == 1:
        d = d ^ tl.load(rp + idx, mask=mask)
    elif MODE == 2:
        if DECODE:
            top = d >> (BITS - 1)
            d = tl.load(rp + idx, mask=mask) + (d ^ ((top << (BITS - 1)) - top))
        else:
            d = d - tl.load(rp + idx, mask=mask)
            top = d >> (BITS - 1)
            d = d ^ ((top << (BITS - 1)) - top)
    elif MODE == 4:
        u = tl.load((base + roff).to(tl.pointer_type(tl.uint32)) + idx, mask=mask)
        c = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
        d = d ^ tl.where((u & 0x7FFFFFFF) > 0x7F800000, _NAN_BF16, c).to(UT)
    elif MODE == 6:  # hidelta (32-bit words): as in _enc / _dec
        hb = tl.load(rp + idx, mask=mask) >> 16
        if DECODE:
            y = (d << 1) | (d >> 31)
            f = ((y >> 17) & 0x3FFF) | (((y >> 16) & 1) << 14)
            dd = f ^ ((f >> 14) * 0x3FFF)
            d = ((((hb + dd) & 0x7FFF) | (((y >> 31) ^ (hb >> 15)) << 15)) << 16) | (y & 0xFFFF)
        else:
            hx = d >> 16
            dd = ((hx & 0x7FFF) - (hb & 0x7FFF)) & 0x7FFF
            f = dd ^ ((dd >> 14) * 0x3FFF)
            y = (((hx ^ hb) >> 15) << 31) | ((f & 0x3FFF) << 17) | ((f >> 14) << 16) | (d & 0xFFFF)
            d = (y >> 1) | (y << 31)
    elif MODE == 3 or MODE == 5:
        if MODE == 3:
            p = (tl.load(rp + idx, mask=mask) >> 2) & _PRED
        else:
            gw = tl.load(table + 7 * nseg + g) + idx
            cols = tl.load(table + 6 * nseg + g)
            i = gw // cols
            rr = tl.load((base + roff).to(tl.pointer_type(tl.int32)) + i, mask=mask)
            cc = tl.load((base + tl.load(table + 5 * nseg + g)).to(tl.pointer_type(tl.int32)) + (gw - i * cols),
                         mask=mask)
            p = (((rr + cc) >> 8) & 0xFF).to(UT) << 22
        xe = (d >> 1) & _EXP_HALF
        if DECODE:
            d = (d ^ (xe << 1)) | (((xe + p) & _EXP_HALF) << 1)
        else:
            d = (d ^ (xe << 1)) | (((xe - p) & _EXP_HALF) << 1)
    return d


@triton.jit(do_not_specialize=["nseg", "ntiles"])  # new counts must not mean new compiles
def _dec_multi(base, table, nseg, ntiles, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr,
               TILE: tl.constexpr, MODE: tl.constexpr, PLANES: tl.constexpr):
    """``_dec`` over many segments in one launch. Segment g: its source at byte ``soff`` of
    ``base`` (byte planes of blocks of ``block`` words, or the residual words themselves where not
    PLANES), its destination and reference at byte offsets ``doff`` and ``roff`` from ``base``
    (any allocation on the device), ``n`` words: the columns of ``table`` (8 rows of ``nseg``:
    soff, doff, roff, n, block, coff, cols, w0), followed by each program's segment and first
    word (2 rows of ``ntiles``). MODE DERIVED (16-bit words): the residual XOR the bfloat16
    rounding of the float32 reference words. MODE EXPGRID: ``expgrid``'s prediction of word
    ``w0 + k`` of a ``cols``-column matrix from int32 row terms at ``roff`` and column terms at
    ``coff``."""
    g, soff, doff, roff, n, idx, mask = _segment(table, nseg, ntiles, TILE)
    if PLANES and MODE == 7:  # PARTIAL: planes 0, 2, 3 of each block (32-bit words), plane 1 as zeros
        at, m = _planes_at(table, nseg, g, n, idx, 3)
        r = tl.load(base + soff + at, mask=mask).to(UT)
        r = r | (tl.load(base + soff + at + m, mask=mask).to(UT) << 16)
        r = r | (tl.load(base + soff + at + 2 * m, mask=mask).to(UT) << 24)
        d = (r >> 1) | (r << (BITS - 1))
    elif PLANES and MODE == 9:  # PARTIAL16: planes 2, 3 of each block (rotate 16), the low half zero
        at, m = _planes_at(table, nseg, g, n, idx, 2)
        r = tl.load(base + soff + at, mask=mask).to(UT) << 16
        r = r | (tl.load(base + soff + at + m, mask=mask).to(UT) << 24)
        d = (((r >> 17) & 0x7FFF) | (((r >> 16) & 1) << 15)) << 16
    elif PLANES:
        at, m = _planes_at(table, nseg, g, n, idx, W)
        r = tl.zeros([TILE], dtype=UT)
        for k in tl.static_range(W):
            byte = tl.load(base + soff + at + k * m, mask=mask).to(UT)
            r = r | (byte << (8 * k))
        if MODE == 8:
            d = ((((r >> 17) & 0x7FFF) | (((r >> 16) & 1) << 15)) << 16) | (r & 0xFFFF)
        else:
            d = (r >> 1) | (r << (BITS - 1))
    else:
        d = tl.load((base + soff).to(tl.pointer_type(UT)) + idx, mask=mask)
    d = _against_ref(d, base, table, nseg, g, roff, idx, mask, BITS, UT, MODE, True)
    tl.store((base + doff).to(tl.pointer_type(UT)) + idx, d, mask=mask)


@triton.jit(do_not_specialize=["nseg", "ntiles"])
def _enc_multi(base, table, nseg, ntiles, W: tl.constexpr, BITS: tl.constexpr, UT: tl.constexpr,
               TILE: tl.constexpr, MODE: tl.constexpr, PLANES: tl.constexpr):
    """Inverse of ``_dec_multi`` (same table): the words of segment g (at byte ``doff`` of
    ``base``), their residual against the reference (MODE as ``_dec_multi``), into byte planes
    (or words where not PLANES) at byte ``soff`` of ``base``."""
    g, soff, doff, roff, n, idx, mask = _segment(table, nseg, ntiles, TILE)
    d = tl.load((base + doff).to(tl.pointer_type(UT)) + idx, mask=mask)
    d = _against_ref(d, base, table, nseg, g, roff, idx, mask, BITS, UT, MODE, False)
    if PLANES:
        at, m = _planes_at(table, nseg, g, n, idx, W)
        if MODE == 8:
            r = ((((d >> 15) & 0xFFFE) | (d >> 31)) << 16) | (d & 0xFFFF)
        else:
            r = (d << 1) | (d >> (BITS - 1))
        for k in tl.static_range(W):
            tl.store(base + soff + at + k * m, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        tl.store((base + soff).to(tl.pointer_type(UT)) + idx, d, mask=mask)


def _multi(kernel, base: torch.Tensor, cols_in, width: int, mode: int, planes: bool) -> None:
    if mode not in (PLAIN, XOR, DELTA, EXPREF, DERIVED, EXPGRID, HIDELTA, PARTIAL, PLAIN16, PARTIAL16) \
            or (mode in (EXPREF, EXPGRID, HIDELTA, PARTIAL, PLAIN16, PARTIAL16) and width != 4) \
            or (mode == DERIVED and width != 2) or (mode in (PLAIN, PARTIAL, PLAIN16, PARTIAL16) and not planes) \
            or (mode in (PARTIAL, PARTIAL16) and kernel is not _dec_multi):
        raise ValueError(f"no multi-segment kernel for mode {mode} at width {width}")
    nwords = np.asarray(cols_in[3], dtype=np.int64)
    keep = nwords > 0
    if not keep.any():
        return
    cols = [np.asarray(c, dtype=np.int64)[keep] for c in cols_in]
    tiles = -(-cols[3] // TILE)
    seg = np.repeat(np.arange(len(tiles), dtype=np.int64), tiles)
    first = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    table = np.concatenate([*cols, seg, first * TILE])
    t = torch.from_numpy(table).to(base.device, non_blocking=True)
    kernel[(len(seg),)](base, t, len(tiles), len(seg), W=width, BITS=8 * width, UT=_U[width][1],
                        TILE=TILE, MODE=mode, PLANES=planes)


def encode_multi(base: torch.Tensor, soffs, doffs, roffs, nwords, blocks, coffs, cols, w0s, width: int,
                 mode: int, planes: bool) -> None:
    """Apply one kind of chain to many segments in one launch (see ``_enc_multi``); the
    arguments are :func:`decode_multi`'s, ``soffs`` where the planes go, ``doffs`` the words."""
    _multi(_enc_multi, base, (soffs, doffs, roffs, nwords, blocks, coffs, cols, w0s), width, mode, planes)


def decode_multi(base: torch.Tensor, soffs, doffs, roffs, nwords, blocks, coffs, cols, w0s, width: int,
                 mode: int, planes: bool) -> None:
    """Undo one kind of transform for many segments in one launch (see ``_dec_multi``): offsets
    in bytes from ``base``'s first byte (a CUDA tensor; the other allocations on its device),
    ``nwords`` words of ``width`` bytes each; every destination and reference address a multiple
    of its word size. ``mode``: PLAIN (planes only), XOR, DELTA, EXPREF, EXPGRID (32-bit words;
    ``coffs``, ``cols``, ``w0s``: EXPGRID's column terms, matrix width and first word, zeros for
    the others) or DERIVED (16-bit words against float32 references); ``planes``: whether the
    sources are byte planes."""
    _multi(_dec_multi, base, (soffs, doffs, roffs, nwords, blocks, coffs, cols, w0s), width, mode, planes)


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


# -- XXH3-64 of chunks on the GPU (the file format's chunk checksum) ------------------------------
# XXH3_64bits (seed 0, default secret) for inputs of more than 240 bytes ("hashLong"): 1 KiB
# blocks of 16 stripes of 64 bytes accumulated into 8 lanes, the lanes scrambled after each
# block, the last partial block and the last 64 bytes, then the lanes merged. Shorter inputs use
# other formulas; callers hash those on the host. The 8 lanes are kept as their even and odd
# halves (each stripe word feeds its own lane and its pair's).
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_XXH_INIT = (0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
             0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1)
_XXH_CONST = (0xFFFFFFFF, 0x9E3779B1, 0x9E3779B185EBCA87, 0x165667919E3779F9)


def _u64(xs) -> np.ndarray:
    return np.array([x - (1 << 64) if x >= 1 << 63 else x for x in xs], dtype=np.int64)


def _secret_words(at: int, n: int) -> list[int]:
    return [int.from_bytes(XXH3_SECRET[at + 8 * i:at + 8 * i + 8], "little") for i in range(n)]


#: int64 bit patterns: 16 x 8 stripe keys, 8 scramble keys, 8 last-stripe keys, 8 merge keys,
#: 8 initial lanes, 4 constants
_XXH_TABLE = _u64([w for s in range(16) for w in _secret_words(8 * s, 8)] + _secret_words(128, 8)
                  + _secret_words(121, 8) + _secret_words(11, 8) + list(_XXH_INIT) + list(_XXH_CONST))
_XXH_DEV: dict = {}


@triton.jit
def _fold(a, b, M32):
    """The low 64 bits of a x b XOR its high 64 bits (uint64 vectors), from 32-bit limbs."""
    a0 = a & M32
    a1 = a >> 32
    b0 = b & M32
    b1 = b >> 32
    p00 = a0 * b0
    p01 = a0 * b1
    p10 = a1 * b0
    mid = (p00 >> 32) + (p01 & M32) + (p10 & M32)
    lo = (p00 & M32) | (mid << 32)
    hi = a1 * b1 + (p01 >> 32) + (p10 >> 32) + (mid >> 32)
    return lo ^ hi


@triton.jit
def _xxh3_long(buf, offs, lens, out, tab):
    """XXH3-64 of chunk c (``lens[c]`` > 240 bytes at ``buf + offs[c]``, 8-byte aligned) into
    ``out[c]`` (int64 bit pattern); one program per chunk."""
    c = tl.program_id(0)
    off = tl.load(offs + c)
    n = tl.load(lens + c)
    p8 = buf + off
    p64 = p8.to(tl.pointer_type(tl.uint64))
    s = tl.arange(0, 16)[:, None]
    e = tl.arange(0, 4)[None, :]
    ke = tl.load(tab + s * 8 + 2 * e).to(tl.uint64, bitcast=True)  # [16, 4] keys of the even lanes
    ko = tl.load(tab + s * 8 + 2 * e + 1).to(tl.uint64, bitcast=True)
    v = tl.arange(0, 4)
    se = tl.load(tab + 128 + 2 * v).to(tl.uint64, bitcast=True)
    so = tl.load(tab + 129 + 2 * v).to(tl.uint64, bitcast=True)
    acc_e = tl.load(tab + 152 + 2 * v).to(tl.uint64, bitcast=True)
    acc_o = tl.load(tab + 153 + 2 * v).to(tl.uint64, bitcast=True)
    M32 = tl.load(tab + 160).to(tl.uint64, bitcast=True)
    P32_1 = tl.load(tab + 161).to(tl.uint64, bitcast=True)
    nb = (n - 1) // 1024
    blk = nb * 0
    while blk < nb:  # (a while loop: Triton's interpreter, which the CPU tests use, needs it)
        w = blk * 128 + s * 8 + 2 * e
        de = tl.load(p64 + w)
        do = tl.load(p64 + w + 1)
        ue = de ^ ke
        uo = do ^ ko
        acc_e += tl.sum((ue & M32) * (ue >> 32), axis=0) + tl.sum(do, axis=0)
        acc_o += tl.sum((uo & M32) * (uo >> 32), axis=0) + tl.sum(de, axis=0)
        acc_e = ((acc_e ^ (acc_e >> 47)) ^ se) * P32_1
        acc_o = ((acc_o ^ (acc_o >> 47)) ^ so) * P32_1
        blk += 1
    ns = ((n - 1) - 1024 * nb) // 64
    m = s < ns
    w = nb * 128 + s * 8 + 2 * e
    de = tl.load(p64 + w, mask=m, other=0)
    do = tl.load(p64 + w + 1, mask=m, other=0)
    ue = de ^ ke
    uo = do ^ ko
    acc_e += tl.sum(tl.where(m, (ue & M32) * (ue >> 32), 0), axis=0) + tl.sum(do, axis=0)
    acc_o += tl.sum(tl.where(m, (uo & M32) * (uo >> 32), 0), axis=0) + tl.sum(de, axis=0)
    j = tl.arange(0, 8)[None, :]
    at = n - 64 + 16 * v[:, None] + j  # the last 64 bytes (any alignment), word 2v and 2v + 1
    sh = (8 * j).to(tl.uint64)
    we = tl.sum(tl.load(p8 + at).to(tl.uint64) << sh, axis=1)
    wo = tl.sum(tl.load(p8 + at + 8).to(tl.uint64) << sh, axis=1)
    ue = we ^ tl.load(tab + 136 + 2 * v).to(tl.uint64, bitcast=True)
    uo = wo ^ tl.load(tab + 137 + 2 * v).to(tl.uint64, bitcast=True)
    acc_e += (ue & M32) * (ue >> 32) + wo
    acc_o += (uo & M32) * (uo >> 32) + we
    a = acc_e ^ tl.load(tab + 144 + 2 * v).to(tl.uint64, bitcast=True)
    b = acc_o ^ tl.load(tab + 145 + 2 * v).to(tl.uint64, bitcast=True)
    r = n.to(tl.uint64) * tl.load(tab + 162).to(tl.uint64, bitcast=True) + tl.sum(_fold(a, b, M32), axis=0)
    r ^= r >> 37
    r *= tl.load(tab + 163).to(tl.uint64, bitcast=True)
    r ^= r >> 32
    tl.store(out + c, r.to(tl.int64, bitcast=True))


def xxh3_chunks(buf: torch.Tensor, offs: np.ndarray, lens: np.ndarray) -> torch.Tensor:
    """XXH3-64 of chunks ``buf[offs[i]:+lens[i]]`` (a flat uint8 CUDA tensor; every length over
    240 bytes, every ``buf.data_ptr() + offs[i]`` a multiple of 8) as an int64 tensor on the
    device (bit patterns), queued on the current stream."""
    if not len(offs):
        return torch.empty(0, dtype=torch.int64, device=buf.device)
    if (np.asarray(lens) < HASH_MIN).any() or ((np.asarray(offs) + buf.data_ptr()) % 8).any():
        raise ValueError("xxh3_chunks: chunks must be over 240 bytes and 8-byte aligned")
    tab = _XXH_DEV.get(buf.device)
    if tab is None:
        tab = _XXH_DEV[buf.device] = torch.from_numpy(_XXH_TABLE).to(buf.device)
    t = torch.from_numpy(np.stack([np.asarray(offs, dtype=np.int64), np.asarray(lens, dtype=np.int64)])).to(
        buf.device, non_blocking=True)
    out = torch.empty(len(offs), dtype=torch.int64, device=buf.device)
    _xxh3_long[(len(offs),)](buf, t[0], t[1], out, tab)
    return out
