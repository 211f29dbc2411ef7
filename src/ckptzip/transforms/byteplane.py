"""The ``byteplane`` transform. One implementation serves CPU tensors (numpy), CUDA tensors
(Triton kernels) and either without Triton (torch ops); all produce the same bytes.

``byteplane`` (wire config ``{"id": "byteplane", "width": w, "block": b}``): the storage is read as
little-endian words of ``w`` bytes (2, 4 or 8). Each word is rotated left by one bit, which moves
the sign bit beside the mantissa so that the exponent fills the top byte. The words are cut into
blocks of ``b`` words (the last block may be shorter); each block is written as ``w`` planes,
plane ``k`` holding byte ``k`` (least significant first) of every word of the block. Blocks are
self-contained, so any run of blocks can be decoded alone (random access, bounded GPU windows).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import native
from ..codecs.base import MAX_CHUNK
from ..errors import CorruptFileError, UnknownCodecError
from ..kernels import launch, rot16_ready, triton_kernels
from .base import Transform, register

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
#: source bytes per step of the torch path (whole blocks; a block may be larger)
_TORCH_PIECE = 16 << 20


@register
class BytePlane(Transform):
    wire_id = "byteplane"

    def __init__(self, width: int, block: int, rotate: int | None = None) -> None:
        if width not in _INT or not isinstance(block, int) or not 1 <= block <= MAX_CHUNK:
            raise UnknownCodecError(f"byteplane: unsupported width={width!r} block={block!r}")
        if rotate is not None and (rotate != 16 or width != 4):
            raise UnknownCodecError(f"byteplane: unsupported rotate={rotate!r} at width {width}")
        self.width, self.block, self.rotate = width, block, rotate

    def get_config(self) -> dict[str, Any]:
        cfg = {"id": self.wire_id, "width": self.width, "block": self.block}
        if self.rotate is not None:
            cfg["rotate"] = self.rotate
        return cfg

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BytePlane":
        if set(config) - {"id", "width", "block", "rotate"}:
            raise UnknownCodecError(f"byteplane: unknown options in {str(config)[:200]}")
        width, block, rotate = config.get("width"), config.get("block"), config.get("rotate")
        # JSON integers only: 2.0 == 2 and True == 1 in Python, but neither is a valid value
        if type(width) is not int or type(block) is not int or ("rotate" in config and type(rotate) is not int):
            raise CorruptFileError(f"byteplane: width, block and rotate must be integers, got "
                                   f"{type(width).__name__}, {type(block).__name__} and {type(rotate).__name__}")
        return cls(width, block, rotate)

    @property
    def minor(self) -> int:
        """The format minor version a file that uses this config needs (``rotate``: 1.3)."""
        return 3 if self.rotate is not None else 0

    def accepts(self, nbytes: int) -> bool:
        return nbytes % self.width == 0

    def segments(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, size) of every plane of every block in the transformed stream."""
        w, b = self.width, self.block
        n = nbytes // w
        out, off = [], 0
        for start in range(0, n, b):
            m = min(b, n - start)
            for _ in range(w):
                out.append((off, m))
                off += m
        return out

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The planes, in ``out`` or a new uint8 tensor on ``src``'s device; ``src`` is never
        modified."""
        w, b = self.width, self.block
        if src.is_cuda and triton_kernels() is not None and (self.rotate is None or rot16_ready()):
            return triton_kernels().encode(src, w, b, out, self.rotate == 16)
        out = torch.empty_like(src) if out is None else out
        if src.device.type == "cpu" and out.device.type == "cpu":
            if self.rotate == 16:  # the whole-word rotation's code, on words turned so that it yields ours
                src = _pre16(src)
            _np_encode(src.numpy(), out.numpy(), w, b)  # numpy transposes bytes ~8x faster
            return out
        return self._torch_encode(src, out)

    def _torch_encode(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Torch ops (a GPU save before the kernels are compiled), in pieces of whole blocks of at
        most ``_TORCH_PIECE`` bytes, so that the temporaries of the rotation stay small (a whole
        256 MiB window at once would need two more windows of GPU memory)."""
        w, b = self.width, self.block
        step = max(1, _TORCH_PIECE // (b * w)) * b * w
        for a in range(0, src.numel(), step):
            piece = src[a:a + step]
            self._torch_encode_piece(_pre16(piece) if self.rotate == 16 else piece, out[a:a + step])
        return out

    def _torch_encode_piece(self, src: torch.Tensor, out: torch.Tensor) -> None:
        w, b = self.width, self.block
        n = src.numel() // w
        bits = 8 * w
        v = src.view(_INT[w])
        rot = v << 1
        sign = v >> (bits - 1)
        rot |= sign.bitwise_and_(1)
        del sign
        rb = rot.view(torch.uint8).view(n, w)
        full = n // b * b
        if full:
            nb = full // b
            out[: full * w].view(nb, w, b).copy_(rb[:full].view(nb, b, w).permute(0, 2, 1))
        if n > full:
            out[full * w:].view(w, n - full).copy_(rb[full:].t())

    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Inverse of :meth:`encode`, written into the preallocated uint8 ``dst``."""
        w, b = self.width, self.block
        tk = triton_kernels(start=False) if src.is_cuda and dst.is_cuda else None
        if tk is not None and (self.rotate is None or rot16_ready()):
            return tk.decode(src, dst, w, b, self.rotate == 16)
        if src.device.type == "cpu" and dst.device.type == "cpu":
            _np_decode(src.numpy(), dst.numpy(), w, b)
        else:
            self._torch_decode(src, dst)
        if self.rotate == 16:
            _post16(dst)

    def _torch_decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        w, b = self.width, self.block
        n = src.numel() // w
        bits = 8 * w
        full = n // b * b
        dv = dst.view(n, w)
        if full:
            nb = full // b
            dv[:full].view(nb, b, w).copy_(src[: full * w].view(nb, w, b).permute(0, 2, 1))
        if n > full:
            dv[full:].copy_(src[full * w:].view(w, n - full).t())
        v = dst.view(_INT[w])
        maxpos = (1 << (bits - 1)) - 1
        hi = v << (bits - 1)
        v.bitwise_right_shift_(1).bitwise_and_(maxpos).bitwise_or_(hi)


def _pre16(src: torch.Tensor) -> torch.Tensor:
    """Words ``q`` (a new tensor) whose whole-word rotation is ``rotate`` 16's transformed word
    of ``src`` (flat uint8, whole 32-bit words): ``q = rotr32(t)``,
    ``t = ((x >> 15) & 0xFFFE | x >> 31) << 16 | (x & 0xFFFF)``."""
    if src.device.type == "cpu":
        x = src.numpy().view(np.uint32)
        t = ((((x >> 15) & 0xFFFE) | (x >> 31)) << 16) | (x & 0xFFFF)
        return torch.from_numpy(((t >> 1) | (t << 31)).view(np.uint8))
    out = torch.empty_like(src)
    for a in range(0, src.numel(), _TORCH_PIECE):  # (the int64 temporaries stay small)
        x = src[a:a + _TORCH_PIECE].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        t = ((((x >> 15) & 0xFFFE) | (x >> 31)) << 16) | (x & 0xFFFF)
        q = (t >> 1) | ((t & 1) << 31)
        out[a:a + _TORCH_PIECE].view(torch.int32).copy_(torch.where(q >= 1 << 31, q - (1 << 32), q))
    return out


def _post16(dst: torch.Tensor) -> None:
    """Undo :func:`_pre16` in place on words the whole-word decode left in ``dst``."""
    if dst.device.type == "cpu":
        q = dst.numpy().view(np.uint32)
        t = (q << 1) | (q >> 31)
        q[:] = ((((t >> 17) & 0x7FFF) | (((t >> 16) & 1) << 15)) << 16) | (t & 0xFFFF)
        return
    for a in range(0, dst.numel(), _TORCH_PIECE):
        d = dst[a:a + _TORCH_PIECE].view(torch.int32)
        q = d.to(torch.int64) & 0xFFFFFFFF
        t = ((q << 1) & 0xFFFFFFFF) | (q >> 31)
        x = ((((t >> 17) & 0x7FFF) | (((t >> 16) & 1) << 15)) << 16) | (t & 0xFFFF)
        d.copy_(torch.where(x >= 1 << 31, x - (1 << 32), x))


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: words per step of the CPU loops: a step's temporaries stay in the L2 cache
_STEP = 1 << 16


def _np_steps(n: int, w: int, b: int) -> list[tuple[int, int, int, int]]:
    """(word start, word end, block start word, block words) of every step, steps inside blocks."""
    out = []
    for start in range(0, n, b):
        m = min(b, n - start)
        for s in range(start, start + m, _STEP):
            out.append((s, min(start + m, s + _STEP), start, m))
    return out


def _np_run(fn, steps: list, nbytes: int) -> None:
    """Run ``fn(steps)`` over the steps, split between threads for large inputs (numpy releases
    the GIL in its loops)."""
    from ..codecs import cpu
    k = min(cpu.cpu_threads(), len(steps)) if nbytes >= cpu.PARALLEL_BYTES else 1
    if k <= 1:
        fn(steps)
        return
    parts = [steps[i * len(steps) // k:(i + 1) * len(steps) // k] for i in range(k)]
    cpu.pmap(lambda i: fn(parts[i]), k)


def _native_run(fn, nbytes: int, w: int, *args) -> None:
    """``fn(*args, w0, w1)`` (a :mod:`ckptzip._bpnative` function, which releases the GIL) over the
    words, split between the CPU pool's threads for large inputs."""
    from ..codecs import cpu
    n = nbytes // w
    k = min(cpu.cpu_threads(), n) if nbytes >= cpu.PARALLEL_BYTES else 1
    if k <= 1:
        fn(*args, 0, n)
        return
    cuts = [i * n // k for i in range(k + 1)]
    cpu.pmap(lambda i: fn(*args, cuts[i], cuts[i + 1]), k)


def _np_encode(src: np.ndarray, out: np.ndarray, w: int, b: int) -> None:
    if native.lib is not None:  # one pass in C
        return _native_run(native.lib.encode, src.size, w, src, out, w, b)
    _numpy_encode(src, out, w, b)


def _np_decode(src: np.ndarray, dst: np.ndarray, w: int, b: int) -> None:
    if native.lib is not None:
        return _native_run(native.lib.decode, src.size, w, src, dst, w, b)
    _numpy_decode(src, dst, w, b)


def _numpy_encode(src: np.ndarray, out: np.ndarray, w: int, b: int) -> None:
    """CPU byteplane encode (same wire format as the torch and Triton versions): per step of
    words, rotate into a cache-resident temporary, then narrow each byte into its plane (shifts
    and casts vectorize; a strided byte gather does not)."""
    n = src.size // w
    u = src.view(_UINT[w])
    ut = _UINT[w]

    def run(steps) -> None:
        t = np.empty(_STEP, ut)
        r = np.empty(_STEP, ut)
        for s, e, start, m in steps:
            x, tt, rr = u[s:e], t[:e - s], r[:e - s]
            np.left_shift(x, 1, out=tt)
            np.right_shift(x, 8 * w - 1, out=rr)
            tt |= rr
            planes = out[start * w:(start + m) * w].reshape(w, m)
            for k in range(w):
                if k:
                    np.right_shift(tt, 8, out=tt)
                np.copyto(planes[k, s - start:e - start], tt, casting="unsafe")
    _np_run(run, _np_steps(n, w, b), src.size)


def _words(planes: np.ndarray, a: int, z: int, w: int, tt: np.ndarray, qq: np.ndarray, out: np.ndarray) -> None:
    """Words ``a:z`` of one step gathered from its ``w`` planes, rotation undone, into ``out``
    (``tt`` / ``qq``: scratch of the step's length; ``out`` may be ``qq``)."""
    np.copyto(tt, planes[w - 1, a:z], casting="unsafe")
    for k in range(w - 2, -1, -1):
        np.left_shift(tt, 8, out=tt)
        np.copyto(qq, planes[k, a:z], casting="unsafe")
        tt |= qq
    np.right_shift(tt, 1, out=out)
    np.left_shift(tt, 8 * w - 1, out=tt)
    out |= tt


def _numpy_decode(src: np.ndarray, dst: np.ndarray, w: int, b: int) -> None:
    n = src.size // w
    ut = _UINT[w]
    d = dst.view(ut)

    def run(steps) -> None:
        t = np.empty(_STEP, ut)
        q = np.empty(_STEP, ut)
        for s, e, start, m in steps:
            planes = src[start * w:(start + m) * w].reshape(w, m)
            _words(planes, s - start, e - start, w, t[:e - s], q[:e - s], d[s:e])
    _np_run(run, _np_steps(n, w, b), src.size)


def np_decode_onto(src: np.ndarray, dst: np.ndarray, ref: np.ndarray, w: int, b: int, fold: str) -> None:
    """``byteplane`` decode of ``src`` (words of ``w`` bytes, blocks of ``b`` words) combined with
    ``ref`` into ``dst``, step by step of cache-resident words (no storage-sized temporary, one
    pass over ``dst``; ``ref`` may be ``dst``): ``fold="delta"`` adds the sign-folded residual
    (format 1.1 ``delta``), ``"xor"`` XORs it."""
    if native.lib is not None:
        return _native_run(native.lib.decode_onto, src.size, w, src, dst, ref, w, b, 2 if fold == "delta" else 1)
    n = src.size // w
    ut = _UINT[w]
    d, r = dst.view(ut), ref.view(ut)
    top = 8 * w - 1
    delta = fold == "delta"
    mask = ut((1 << top) - 1)

    def run(steps) -> None:
        t = np.empty(_STEP, ut)
        q = np.empty(_STEP, ut)
        for s, e, start, m in steps:
            tt, qq = t[:e - s], q[:e - s]
            planes = src[start * w:(start + m) * w].reshape(w, m)
            _words(planes, s - start, e - start, w, tt, qq, qq)  # the residual words
            if delta:  # unfold: the low bits inverted where the top bit is set
                np.right_shift(qq, top, out=tt)
                tt *= mask
                qq ^= tt
                np.add(r[s:e], qq, out=d[s:e])
            else:
                np.bitwise_xor(r[s:e], qq, out=d[s:e])
    _np_run(run, _np_steps(n, w, b), src.size)


class PlaneSubset:
    """Some byte planes of a ``byteplane`` width-4 storage, read without the others (not a wire
    transform: a reader's partial decode of a base storage for ``hidelta``, format 1.3). The
    stream holds, per block, ``planes`` of its words (2 and 3 with ``rotate`` 16, else 0, 2 and
    3), ``width`` bytes per word; :meth:`decode` writes whole 4-byte words, the other planes
    taken as zeros and the rotation undone, so the top half of each word is exact (what
    ``hidelta`` reads). ``Job.dst`` maps stream bytes to destination bytes."""

    def __init__(self, block: int, rotate: int | None = None) -> None:
        self.block, self.rotate = block, rotate
        self.planes = (2, 3) if rotate == 16 else (0, 2, 3)
        self.width = len(self.planes)

    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.numel() // self.width
        if not n:
            return
        tk = triton_kernels(start=False) if src.is_cuda and dst.is_cuda else None
        if (tk is not None and dst.data_ptr() % 4 == 0 and self.rotate is None
                and launch("decode_part", tk.decode_part, src, dst, self.block)):
            return
        self._decode(src, dst, src.device.type != "cpu" or dst.device.type != "cpu")

    def _decode(self, src: torch.Tensor, dst: torch.Tensor, torch_ops: bool) -> None:
        """Block by block, with numpy or (``torch_ops``: a GPU without the Triton kernels) torch."""
        k, b = self.width, self.block
        n = src.numel() // k
        for s in range(0, n, b):
            m = min(b, n - s)
            p = src[k * s:k * (s + m)]
            if not torch_ops:
                pn = p.numpy()
                r = np.zeros(m, np.uint32)
                for i, plane in enumerate(self.planes):
                    r |= pn[i * m:(i + 1) * m].astype(np.uint32) << (8 * plane)
                if self.rotate == 16:
                    r = (((r >> 17) & 0x7FFF) | (((r >> 16) & 1) << 15)) << 16
                else:
                    r = (r >> 1) | (r << 31)
                dst[4 * s:4 * (s + m)].numpy().view(np.uint32)[:] = r
            else:
                p = p.to(dst.device).to(torch.int64)
                r = torch.zeros(m, dtype=torch.int64, device=dst.device)
                for i, plane in enumerate(self.planes):
                    r |= p[i * m:(i + 1) * m] << (8 * plane)
                if self.rotate == 16:
                    r = (((r >> 17) & 0x7FFF) | (((r >> 16) & 1) << 15)) << 16
                else:
                    r = (r >> 1) | ((r & 1) << 31)
                w = torch.where(r >= 1 << 31, r - (1 << 32), r).to(torch.int32)
                dst[4 * s:4 * (s + m)].copy_(w.view(torch.uint8))


def plane_rows(rows: np.ndarray, tf: BytePlane, nbytes: int, planes: tuple[int, ...]) -> np.ndarray | None:
    """The chunk rows of a ``byteplane`` storage (``rows``: its chunk table slice, in order)
    that hold ``planes`` of every block, in stream order; None where a chunk spans two planes
    (the format lets writers cut chunks anywhere: the reader then decodes every plane). A
    storage has a few chunks per plane: plain integer arithmetic (numpy's per-call cost was
    30 times more, per storage of an incremental load)."""
    w, b = tf.width, tf.block
    n = nbytes // w
    if not n or not len(rows):
        return None
    raw = rows["raw"]
    key = (w, b, nbytes, tuple(planes), raw.tobytes())  # (storages of one shape share a chunk layout)
    keep = _PLANE_ROWS.get(key)
    if keep is None:
        keep = _plane_rows(raw.tolist(), w, b, n, planes)
        if len(_PLANE_ROWS) > 4096:
            _PLANE_ROWS.clear()
        _PLANE_ROWS[key] = keep
    return None if keep is False else rows[keep]


_PLANE_ROWS: dict = {}


def _plane_rows(raws: list, w: int, b: int, n: int, planes: tuple[int, ...]) -> list | bool:
    keep, pos, span = [], 0, b * w
    for k, r in enumerate(raws):
        blk, at = divmod(pos, span)
        m = min(b, n - blk * b)
        blk1, at1 = divmod(pos + r - 1, span)
        if blk1 != blk or at1 // m != at // m:
            return False
        if at // m in planes:
            keep.append(k)
        pos += r
    return keep
