"""Transforms against a *reference* storage (format 1.1): ``xor`` (a storage of a base checkpoint)
and ``derived`` (a cast of another storage of the same file).

Both turn a storage into a *residual* that is all zero where the storage equals its prediction:

* ``xor`` (``{"id": "xor", "ref": {"base": 0, "storage": j}}``): residual = storage XOR storage
  ``j`` of base checkpoint 0 (same byte count). Slowly changing weights share sign, exponent and
  upper mantissa bits with their base, so after ``byteplane`` the high planes are nearly zero.
* ``derived`` (``{"id": "derived", "ref": {"storage": k}, "from": "float32", "to": "bfloat16"}``):
  residual = storage XOR cast(storage ``k``), the cast defined bit-exactly below (the same on CPU
  and GPU, whatever torch's own cast does with NaN payloads). A bf16 copy of fp32 master weights
  is then all zeros; positions where the copy differs (other rounding, NaN payloads) are simply
  nonzero residual words: the exceptions cost what they compress to.

A reference transform is unbound when parsed (``get_transform``); :meth:`RefTransform.bind`
gives it the reference bytes (the whole reference storage as flat ``uint8``), and every
``encode``/``decode`` call names the byte offset ``start`` of its slice within the storage, so
windows of a storage are transformed independently. ``decode`` may write into the tensor that
holds the reference (``xor`` decodes in place into a destination pre-filled with the base).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import native
from ..errors import CorruptFileError, UnknownCodecError
from ..kernels import (DELTA, DERIVED, EXPGRID, EXPREF, HIDELTA, MULTI_MAX, PLAIN, PLAIN16, XOR, enabled, launch,
                       rot16_ready, triton_kernels)
from .base import Transform, register
from .byteplane import BytePlane

CASTS = {("float32", "bfloat16"), ("float32", "float16")}
#: the NaN a ``derived`` cast predicts (sign and payload of the source are not kept)
NAN16 = {"bfloat16": 0x7FC0, "float16": 0x7E00}


def _int(x: Any, what: str) -> int:
    if type(x) is not int or x < 0:
        raise CorruptFileError(f"{what} must be a non-negative integer, got {str(x)[:40]!r}")
    return x


def aligned(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t`` (flat uint8), or an aligned copy where its start is not ``w``-byte aligned (a slice
    of a decode group's stream may start anywhere; torch views it as words only when aligned)."""
    return t if t.data_ptr() % w == 0 else t.clone()


def words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (flat uint8) viewed as the widest integer words its size and alignment allow."""
    n, off = t.numel(), t.storage_offset()
    for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if n % w == 0 and off % w == 0 and t.data_ptr() % w == 0:
            return t.view(dt)
    return t


def _xor(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    wa, wb, wo = words(a), words(b), words(out)
    if out.device.type == "cpu" and a.device.type == "cpu" and b.device.type == "cpu":
        if wa.dtype == wb.dtype == wo.dtype:
            np.bitwise_xor(wa.numpy(), wb.numpy(), out=wo.numpy())
        else:
            np.bitwise_xor(a.numpy(), b.numpy(), out=out.numpy())
        return out
    if wa.dtype == wb.dtype == wo.dtype:
        torch.bitwise_xor(wa, wb, out=wo)
    else:
        torch.bitwise_xor(a, b, out=out)
    return out


def cast16(src: torch.Tensor, to: str) -> torch.Tensor:
    """The ``derived`` prediction: float32 words (``src`` flat uint8, a multiple of 4 bytes) cast
    to 16-bit words (int16 tensor) as format 1.1 defines it: bfloat16 by round-to-nearest-even of
    the bit pattern (``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``), float16 by IEEE 754
    roundTiesToEven; every NaN becomes :data:`NAN16`."""
    if src.device.type == "cpu":
        return torch.from_numpy(_np_cast16(src.numpy(), to))
    f = src.view(torch.float32)
    # torch's casts round to nearest even (c10::BFloat16 computes exactly the bit formula above
    # for every non-NaN value, overflow to infinity included); NaNs are set to NAN16 here
    r = f.to(torch.bfloat16 if to == "bfloat16" else torch.float16).view(torch.int16)
    return r.masked_fill_(torch.isnan(f), NAN16[to])


def _np_cast16(src: np.ndarray, to: str) -> np.ndarray:
    """:func:`cast16` for host arrays. bfloat16: in one pass in C (``_bpnative.cast_bf16``; the
    numpy formula below made six passes, 0.53 s for the 86 M float32 words of the GPU
    benchmark's model on a 2-core VM, where a load of the whole 1.2 GB state took 0.7 s), else by
    the formula in numpy, which tests compare it with."""
    if to == "bfloat16" and native.lib is not None:
        out = np.empty(src.size // 4, dtype=np.uint16)
        native.lib.cast_bf16(np.ascontiguousarray(src).reshape(-1).view(np.uint8), out)
        return out.view(np.int16)
    if to == "bfloat16":
        u = src.view(np.uint32)
        r = (u >> 16) & 1
        r += 0x7FFF
        r += u  # wraps only for NaN patterns, which are replaced below
        r >>= 16
        out = r.astype(np.uint16)
    else:
        # torch's CPU cast (IEEE roundTiesToEven, vectorized; numpy's is ~10x slower)
        out = torch.from_numpy(src).view(torch.float32).to(torch.float16).numpy().view(np.uint16)
    nan = (src.view(np.uint32) & 0x7FFFFFFF) > 0x7F800000
    out[nan] = NAN16[to]
    return out.view(np.int16)


def _cast_xor(src: torch.Tensor, other: torch.Tensor, out: torch.Tensor, to: str) -> bool:
    """``out = cast16(src, to) ^ other`` (flat uint8 tensors; ``other`` is ``out`` or apart from
    it) in one C pass over host tensors, without the prediction's own array: True, or False
    where it is not done so (float16, no C extension, a device tensor) and the caller makes the
    prediction."""
    if (to != "bfloat16" or native.lib is None or src.device.type != "cpu" or other.device.type != "cpu"
            or out.device.type != "cpu"):
        return False
    native.lib.cast_bf16(src.numpy(), out.numpy(), other.numpy())
    return True


class RefTransform(Transform):
    """A transform against a reference storage (see the module docstring)."""

    needs_ref = True
    #: reference bytes per storage byte (2 for a float32 -> 16-bit cast)
    factor = 1
    #: the reference is a storage of the same file (``derived``, ``expref``), not of a base
    local = False
    #: the reference is a storage of a base checkpoint (``xor``, ``delta``)
    against_base = False
    #: bytes per word: a window of the storage must start and end on a multiple of this
    word = 1
    #: the format minor version a file that uses this transform needs
    minor = 1
    #: :meth:`decode` may run with ``src`` and ``dst`` the same tensor (word by word, its
    #: reference elsewhere): a CPU load then undoes the planes straight into the destination
    in_place = False

    def __init__(self) -> None:
        self.ref: torch.Tensor | None = None

    def bind(self, ref: torch.Tensor) -> "RefTransform":
        """A copy of this transform that uses ``ref`` (flat uint8: the whole reference storage).
        (A shallow copy: a reference transform's other fields are immutable config values.)"""
        t = object.__new__(type(self))  # (copy.copy's reduce protocol cost ~10 us: 300 binds a save)
        t.__dict__.update(self.__dict__)
        t.ref = ref
        return t

    def base_slice(self, start: int, n: int) -> torch.Tensor:
        """The bound reference's elements ``start:start+n`` (in this transform's units), as bytes
        of the reference storage."""
        return self._slice(start, n)

    def c_step(self, start: int, n: int) -> tuple | None:
        """This transform over bytes ``start:start+n`` of its storage as a step of the C
        extension (``_bpnative``'s ``encode`` pre step, ``planes_fused_many`` post step,
        ``top_entropy`` step: ``("grid", r, c, g0)`` or ``("ref", words)``), or None where C has
        no such step (the caller then applies the transform in Python)."""
        return None

    def _slice(self, start: int, n: int) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError(f"{self.wire_id}: transform used before bind()")
        return self.ref[start * self.factor:(start + n) * self.factor]

    def decode_scratch(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        """:meth:`decode` where ``src`` is scratch the caller no longer needs (it may be
        overwritten: ``delta`` unfolds it in place instead of copying it)."""
        self.decode(src, dst, start)

    def ref_nbytes(self, nbytes: int) -> int:
        """Bytes the reference storage must have for a storage of ``nbytes``."""
        return nbytes * self.factor

    def layout_key(self) -> str:
        """What a plan made with this transform depends on (the planner's cache key): the config,
        except data fitted to one save (``expgrid``'s predictions)."""
        return repr(self.get_config())


class _AgainstBase(RefTransform):
    """A reference transform whose config is ``{"id", "ref": {"base": b, "storage": j}}``."""
    against_base = True

    def __init__(self, base: int, storage: int) -> None:
        super().__init__()
        self.base, self.storage = base, storage

    def get_config(self) -> dict[str, Any]:
        return {"id": self.wire_id, "ref": {"base": self.base, "storage": self.storage}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "_AgainstBase":
        ref = config.get("ref")
        if set(config) - {"id", "ref"} or not isinstance(ref, dict) or set(ref) - {"base", "storage"}:
            raise UnknownCodecError(f"{cls.wire_id}: unknown options in {str(config)[:200]}")
        return cls(_int(ref.get("base"), f"{cls.wire_id} ref.base"),
                   _int(ref.get("storage"), f"{cls.wire_id} ref.storage"))


@register
class Xor(_AgainstBase):
    wire_id = "xor"

    def accepts(self, nbytes: int) -> bool:
        return True

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        out = torch.empty_like(src) if out is None else out
        if not src.numel():
            return out
        return _xor(src, self._slice(start, src.numel()).to(src.device), out)

    def decode(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        if not src.numel():
            return
        ref = self._slice(start, src.numel())
        _xor(src.to(dst.device), ref if ref.device == dst.device else ref.to(dst.device), dst)


@register
class Derived(RefTransform):
    wire_id = "derived"
    factor = 2
    local = True
    word = 2

    def __init__(self, storage: int, src: str = "float32", to: str = "bfloat16") -> None:
        super().__init__()
        if (src, to) not in CASTS:
            raise UnknownCodecError(f"derived: unsupported cast {src!r} -> {to!r}")
        self.storage, self.src, self.to = storage, src, to

    def get_config(self) -> dict[str, Any]:
        return {"id": self.wire_id, "ref": {"storage": self.storage}, "from": self.src, "to": self.to}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Derived":
        ref = config.get("ref")
        if set(config) - {"id", "ref", "from", "to"} or not isinstance(ref, dict) or set(ref) - {"storage"}:
            raise UnknownCodecError(f"derived: unknown options in {str(config)[:200]}")
        src, to = config.get("from"), config.get("to")
        if not isinstance(src, str) or not isinstance(to, str):
            raise CorruptFileError("derived: from and to must be dtype names")
        return cls(_int(ref.get("storage"), "derived ref.storage"), src, to)

    def accepts(self, nbytes: int) -> bool:
        return nbytes % 2 == 0

    def predict(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        src = self._slice(start, n)
        return cast16(src if src.device == device else src.to(device), self.to).view(torch.uint8)

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        out = torch.empty_like(src) if out is None else out
        if not src.numel():
            return out
        if _cast_xor(self._slice(start, src.numel()), src, out, self.to):
            return out
        return _xor(src, self.predict(start, src.numel(), src.device), out)

    def decode(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        if not src.numel():
            return
        if _cast_xor(self._slice(start, src.numel()), src, dst, self.to):
            return
        _xor(src.to(dst.device), self.predict(start, src.numel(), dst.device), dst)


_SINT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@register
class Delta(RefTransform):
    """``delta`` (``{"id": "delta", "ref": {"base": 0, "storage": j}, "width": w}``): the storage
    and storage ``j`` of the base are read as little-endian words of ``w`` bytes (2, 4 or 8);
    ``d = x - base (mod 2^8w)``, and the residual word is ``d XOR ((d >> (8w-1)) * (2^(8w-1)-1))``:
    ``d`` with its low ``8w-1`` bits inverted when its top bit is set. For slowly changing floats
    ``d`` is a small signed integer; the inversion turns ``-k`` into ``k-1`` with the sign on top,
    so after ``byteplane`` (which rotates the sign to bit 0) the high planes are nearly all zero.
    Measured on a CPU-trained GPT 50 steps apart it stores fp32 weights in 0.66 of raw against
    0.69 for ``xor``, bf16 0.33 against 0.38, Adam v 0.77 against 0.79."""
    wire_id = "delta"
    against_base = True

    def __init__(self, base: int, storage: int, width: int) -> None:
        super().__init__()
        if width not in _SINT:
            raise UnknownCodecError(f"delta: unsupported width {width!r}")
        self.base, self.storage, self.width = base, storage, width

    def get_config(self) -> dict[str, Any]:
        return {"id": self.wire_id, "ref": {"base": self.base, "storage": self.storage}, "width": self.width}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Delta":
        ref = config.get("ref")
        if set(config) - {"id", "ref", "width"} or not isinstance(ref, dict) or set(ref) - {"base", "storage"}:
            raise UnknownCodecError(f"delta: unknown options in {str(config)[:200]}")
        if type(config.get("width")) is not int:
            raise CorruptFileError("delta: width must be an integer")
        return cls(_int(ref.get("base"), "delta ref.base"), _int(ref.get("storage"), "delta ref.storage"),
                   config["width"])

    @property
    def word(self) -> int:  # type: ignore[override]
        return self.width

    def accepts(self, nbytes: int) -> bool:
        return nbytes % self.width == 0

    def _fold(self, d):
        """The residual of a difference word (an involution: it also maps residual -> difference)."""
        bits = 8 * self.width
        if isinstance(d, np.ndarray):
            m = d >> (bits - 1)
            m *= (1 << (bits - 1)) - 1
            d ^= m
            return d
        return d.bitwise_xor_((d >> (bits - 1)).bitwise_and_((1 << (bits - 1)) - 1))

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        out = torch.empty_like(src) if out is None else out
        if not src.numel():
            return out
        ref = self._slice(start, src.numel())
        ref = ref if ref.device == src.device else ref.to(src.device)
        if src.device.type == "cpu" and out.device.type == "cpu":
            u = _UINT[self.width]
            o = out.numpy().view(u)
            np.subtract(src.numpy().view(u), ref.numpy().view(u), out=o)
            self._fold(o)
            return out
        o = out.view(_SINT[self.width])
        src, ref = aligned(src, self.width), aligned(ref, self.width)
        torch.sub(src.view(_SINT[self.width]), ref.view(_SINT[self.width]), out=o)
        self._fold(o)
        return out

    def decode(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        self._decode(src, dst, start, False)

    def decode_scratch(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        self._decode(src, dst, start, True)

    def _decode(self, src: torch.Tensor, dst: torch.Tensor, start: int, scratch: bool) -> None:
        if not src.numel():
            return
        ref = self._slice(start, src.numel())
        ref = ref if ref.device == dst.device else ref.to(dst.device)
        moved = src.device != dst.device
        src = src.to(dst.device) if moved else src
        if dst.device.type == "cpu":
            u = _UINT[self.width]
            d = src.numpy().view(u)
            d = self._fold(d if scratch or moved else d.copy())
            np.add(ref.numpy().view(u), d, out=dst.numpy().view(u))
            return
        d = self._fold(aligned(src, self.width).view(_SINT[self.width]).clone())
        torch.add(aligned(ref, self.width).view(_SINT[self.width]), d, out=dst.view(_SINT[self.width]))


#: tests set this to run the torch (CUDA) code paths of expref/expgrid on CPU tensors
_TORCH_ON_CPU = False
#: the binary32 exponent field shifted right by one (bits 22..29), and the prediction ``f >> 1``
#: at the same place (bits 22..28: bits 24..30 of the reference word shifted right by two)
EXP_HALF, EXP_PRED = 0x3FC00000, 0x1FC00000


def np_hidelta(x: np.ndarray, b: np.ndarray, out: np.ndarray, decode: bool) -> None:
    """``hidelta``'s residual of words ``x`` against ``b`` (``decode``: the words from residual
    ``x``), all uint32 arrays of one length; ``out`` may be ``x`` or ``b``. Only ``b >> 16`` is
    read."""
    hb = b >> 16
    if not decode:
        hx = x >> 16
        d = ((hx & 0x7FFF) - (hb & 0x7FFF)) & 0x7FFF
        f = d ^ ((d >> 14) * 0x3FFF)
        y = (((hx ^ hb) >> 15) << 31) | ((f & 0x3FFF) << 17) | ((f >> 14) << 16) | (x & 0xFFFF)
        out[...] = (y >> 1) | (y << 31)
        return
    y = (x << 1) | (x >> 31)
    f = ((y >> 17) & 0x3FFF) | (((y >> 16) & 1) << 14)
    d = f ^ ((f >> 14) * 0x3FFF)
    out[...] = ((((hb + d) & 0x7FFF) | (((y >> 31) ^ (hb >> 15)) << 15)) << 16) | (y & 0xFFFF)


_M32 = 0xFFFFFFFF
#: words per call of :func:`torch_hidelta` (its int64 temporaries: 16 MiB each)
_HIDELTA_PIECE = 2 << 20


def torch_hidelta(x: torch.Tensor, b: torch.Tensor, out: torch.Tensor, decode: bool) -> None:
    """:func:`np_hidelta` with torch ops (int32 tensors of one device; the arithmetic runs on
    int64 copies: torch has no unsigned 32-bit shifts). The path without Triton kernels."""
    x64 = x.to(torch.int64) & _M32
    hb = (b.to(torch.int64) & _M32) >> 16
    if not decode:
        hx = x64 >> 16
        d = ((hx & 0x7FFF) - (hb & 0x7FFF)) & 0x7FFF
        f = d ^ ((d >> 14) * 0x3FFF)
        y = (((hx ^ hb) >> 15) << 31) | ((f & 0x3FFF) << 17) | ((f >> 14) << 16) | (x64 & 0xFFFF)
        r = (y >> 1) | ((y & 1) << 31)
    else:
        y = ((x64 << 1) & _M32) | (x64 >> 31)
        f = ((y >> 17) & 0x3FFF) | (((y >> 16) & 1) << 14)
        d = f ^ ((f >> 14) * 0x3FFF)
        r = ((((hb + d) & 0x7FFF) | (((y >> 31) ^ (hb >> 15)) << 15)) << 16) | (y & 0xFFFF)
    out.copy_(torch.where(r >= 1 << 31, r - (1 << 32), r).to(torch.int32))


@register
class HiDelta(_AgainstBase):
    """``hidelta`` (1.3; ``{"id": "hidelta", "ref": {"base": 0, "storage": j}}``): a ``delta`` of
    float32 words that reads only the top half (sign, exponent, 7 mantissa bits) of each
    reference word, so that a reader decodes a base storage stored with ``byteplane`` from two
    of its four planes (planes 2 and 3 with ``rotate`` 16; planes 0, 2 and 3 with the whole-word
    rotation): 0.32 or 0.57 instead of 0.82 of the raw bytes of fp32 weights. The top halves'
    magnitudes (15 bits) are stored as their sign-folded difference ``f``, the sign as the
    storage's XOR the reference's, the low halves (16 mantissa bits) as they are:
    ``y = s << 31 | (f & 0x3FFF) << 17 | (f >> 14) << 16 | (x & 0xFFFF)``, and the residual word is
    ``y`` rotated right by one bit, so that after ``byteplane`` planes 2 and 3 hold the small
    difference, its sign and the sign agreement, planes 0 and 1 the low mantissa bits
    (docs/format.md)."""
    wire_id = "hidelta"
    word = 4
    minor = 3

    def accepts(self, nbytes: int) -> bool:
        return nbytes % 4 == 0

    def _run(self, src: torch.Tensor, dst: torch.Tensor, start: int, decode: bool) -> None:
        if not src.numel():
            return
        ref = self._slice(start, src.numel())
        ref = ref if ref.device == dst.device else ref.to(dst.device)
        src = src if src.device == dst.device else src.to(dst.device)
        if dst.device.type == "cpu" and not _TORCH_ON_CPU:
            np_hidelta(src.numpy().view(np.uint32), ref.numpy().view(np.uint32), dst.numpy().view(np.uint32), decode)
            return
        src, ref = aligned(src, 4), aligned(ref, 4)
        o = dst if dst.data_ptr() % 4 == 0 else torch.empty_like(dst)
        x, r, w = src.view(torch.int32), ref.view(torch.int32), o.view(torch.int32)
        for a in range(0, x.numel(), _HIDELTA_PIECE):  # (int64 temporaries of one piece at a time)
            z = a + _HIDELTA_PIECE
            torch_hidelta(x[a:z], r[a:z], w[a:z], decode)
        if o is not dst:
            dst.copy_(o)

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        out = torch.empty_like(src) if out is None else out
        self._run(src, out, start, False)
        return out

    def decode(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        self._run(src, dst, start, True)


class _ExpPredictor(RefTransform):
    """A transform that adds ``-1`` (encode) or ``+1`` (decode) x a prediction to the exponent
    field of float32 words, in windows of whole words (``_apply``)."""
    word = 4
    minor = 2
    in_place = True  # (the exponent field of each word, from a prediction held elsewhere)

    def _apply(self, src: torch.Tensor, out: torch.Tensor, start: int, sign: int) -> None:
        raise NotImplementedError

    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        out = torch.empty_like(src) if out is None else out
        if src.numel():
            self._apply(src, out, start, -1)
        return out

    def decode(self, src: torch.Tensor, dst: torch.Tensor, start: int = 0) -> None:
        if src.numel():
            self._apply(src, dst, start, 1)


@register
class ExpRef(_ExpPredictor):
    """``expref`` (format 1.2; ``{"id": "expref", "ref": {"storage": k}}``): float32 words whose
    exponent is predicted from storage ``k`` of the same file, element by element: the exponent
    field ``e`` (bits 23..30) of each word becomes ``(e - (f >> 1)) mod 256``, ``f`` the exponent
    field of the reference word; sign and mantissa are kept. Adam's first moment ``m`` against
    its second moment ``v``: ``|m|`` is of the order of ``sqrt(v)``, so the residual exponents
    spread less than ``m``'s own (measured on a CPU-trained GPT after 50 steps: 2.77 -> 2.49
    bits per element in 64K-element order-0 chunks). Arithmetic runs on the field shifted right
    by one bit, so 32-bit signed integers never overflow."""
    wire_id = "expref"
    local = True
    #: kept where the sampled stored size shrinks by this share (the exponent is one of four bytes)
    margin = 0.002

    def __init__(self, storage: int) -> None:
        super().__init__()
        self.storage = storage

    def get_config(self) -> dict[str, Any]:
        return {"id": self.wire_id, "ref": {"storage": self.storage}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ExpRef":
        ref = config.get("ref")
        if set(config) - {"id", "ref"} or not isinstance(ref, dict) or set(ref) - {"storage"}:
            raise UnknownCodecError(f"expref: unknown options in {str(config)[:200]}")
        return cls(_int(ref.get("storage"), "expref ref.storage"))

    def accepts(self, nbytes: int) -> bool:
        return nbytes % 4 == 0

    def c_step(self, start: int, n: int) -> tuple | None:
        if start % 4 or self.factor != 1 or self.ref is None or self.ref.device.type != "cpu":
            return None
        return ("ref", self.base_slice(start, n).numpy())

    def _apply(self, src: torch.Tensor, out: torch.Tensor, start: int, sign: int) -> None:
        """``out`` = ``src`` with its half-shifted exponent field plus ``sign`` x the prediction."""
        if start % 4 or src.numel() % 4:
            raise CorruptFileError("expref: a window must hold whole float32 words")
        ref = aligned(self._slice(start, src.numel()), 4)
        ref = ref if ref.device == out.device else ref.to(out.device)
        src = aligned(src if src.device == out.device else src.to(out.device), 4)
        if out.device.type == "cpu" and not _TORCH_ON_CPU:
            x, r, o = (t.numpy().view(np.uint32) for t in (src, ref, out))
            if native.lib is not None:  # one pass in C
                native.lib.exp_ref(x, o, r, sign)
                return
            q = r >> 1
            q &= np.uint32(0x3F800000)  # (f >> 1) << 23
            _np_exp_add23(x, o, q, sign)
            return
        x, r, o = src.view(torch.int32), ref.view(torch.int32), out.view(torch.int32)
        _torch_exp_add22(x, o, (r >> 2).bitwise_and_(EXP_PRED), sign)



def _b64_array(s: Any, n: int, dtype, what: str) -> np.ndarray:
    """``n`` little-endian values of ``dtype`` from the base64 string ``s`` (exactly that many)."""
    import base64
    import binascii
    size = n * np.dtype(dtype).itemsize
    if not isinstance(s, str) or len(s) != 4 * ((size + 2) // 3):
        raise CorruptFileError(f"expgrid: {what} must be base64 of {n} values")
    try:
        raw = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptFileError(f"expgrid: {what} is not base64") from None
    if len(raw) != size or base64.b64encode(raw).decode() != s:  # canonical: zero trailing bits
        raise CorruptFileError(f"expgrid: {what} must be canonical base64 of {n} values")
    return np.frombuffer(raw, dtype=dtype)


#: rows x columns of one expgrid prediction pass (bounds temporaries whatever the tensor's size)
GRID_BLOCK = 1 << 24
#: a CPU fit takes each row's mean from at least this many columns and each column's from at
#: least this many rows (evenly strided)
FIT_SAMPLES = 256
#: CPU fits are spread over the calling thread and the pool's in tasks of at least this many bytes
FIT_TASK = 1 << 20


def _torch_exp_add22(x: torch.Tensor, o: torch.Tensor, p: torch.Tensor, sign: int) -> None:
    """``o`` = ``x`` (int32 words) with the exponent field plus ``sign`` x the prediction ``p``
    (at bits 22..29, the field shifted right by one) mod 256. Torch's int32 arithmetic is signed:
    working on the half-shifted field keeps every sum and difference inside int32 (numpy's
    uint32 path, :func:`_np_exp_add23`, adds at bit 23 and puts bit 31 back instead)."""
    xe = (x >> 1).bitwise_and_(EXP_HALF)
    torch.bitwise_xor(x, xe << 1, out=o)
    xe.add_(p, alpha=sign).bitwise_and_(EXP_HALF).bitwise_left_shift_(1)
    o.bitwise_or_(xe)


def _torch_exp_add(x: torch.Tensor, o: torch.Tensor, p: torch.Tensor, sign: int) -> None:
    """:func:`_np_exp_add` with torch ops (int32 tensors; ``p`` is overwritten)."""
    _torch_exp_add22(x, o, p.bitwise_right_shift_(8).bitwise_and_(0xFF).bitwise_left_shift_(22), sign)


def _np_exp_add23(x: np.ndarray, o: np.ndarray, q: np.ndarray, sign: int) -> None:
    """``o`` = ``x`` (uint32 words) with ``sign`` x ``q`` (uint32 multiples of 2^23 below 2^31,
    of ``x``'s shape) added and bit 31 kept: the exponent field plus ``q >> 23`` mod 256 (a
    multiple of 2^23 leaves the mantissa alone; a carry or borrow out of bit 30 lands in bit 31,
    which is put back). ``o`` may alias ``x``."""
    s = x & np.uint32(0x80000000)
    if sign > 0:
        np.add(x, q, out=o)
    else:
        np.subtract(x, q, out=o)
    o &= np.uint32(0x7FFFFFFF)
    o |= s


def _np_exp_add(x: np.ndarray, o: np.ndarray, p: np.ndarray, sign: int) -> None:
    """``o`` = ``x`` (uint32 words) with the exponent field plus ``sign`` x ``(p >> 8) & 0xFF``
    mod 256 (``p``: int32 of ``x``'s shape, overwritten); ``o`` may alias ``x``."""
    q = np.right_shift(p, 8, out=p)
    q &= 0xFF
    q = q.view(np.uint32)  # 0..255 as int32 and as uint32 are the same bits
    q <<= 23
    _np_exp_add23(x, o, q, sign)


@register
class ExpGrid(_ExpPredictor):
    """``expgrid`` (format 1.2; ``{"id": "expgrid", "rows": R, "cols": C, "r": base64 R x uint16,
    "c": base64 C x int16}``): a float32 storage read as an R x C matrix (row-major), each word's
    exponent field ``e`` replaced by ``(e - p) mod 256`` with the prediction
    ``p = ((r[i] + c[j]) >> 8) mod 256`` for the word in row ``i``, column ``j`` (``r`` and ``c``
    are exponents in 8.8 fixed point: row means, and column means after the row means, with the
    rounding half folded into ``r``). Adam's v of a linear layer is an average of squared
    gradients whose scale is a product of a row factor and a column factor, so its exponent is
    nearly a row term plus a column term (measured on a CPU-trained GPT, exponent bits per element
    in 64K-element order-0 chunks: 2.61 -> 1.64 after 50 steps, 2.28 -> 1.57 after 300). Not a
    reference transform (it needs no other storage) but, like one, only first in a chain."""
    wire_id = "expgrid"
    needs_ref = False
    margin = 0.002

    def __init__(self, rows: int, cols: int, r: np.ndarray, c: np.ndarray) -> None:
        super().__init__()
        self.rows, self.cols = rows, cols
        self.r = np.ascontiguousarray(r, dtype="<u2")
        self.c = np.ascontiguousarray(c, dtype="<i2")
        self._dev: dict = {}

    def get_config(self) -> dict[str, Any]:
        import base64
        return {"id": self.wire_id, "rows": self.rows, "cols": self.cols,
                "r": base64.b64encode(self.r.tobytes()).decode(), "c": base64.b64encode(self.c.tobytes()).decode()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ExpGrid":
        if set(config) - {"id", "rows", "cols", "r", "c"}:
            raise UnknownCodecError(f"expgrid: unknown options in {str(config)[:200]}")
        rows, cols = config.get("rows"), config.get("cols")
        if type(rows) is not int or type(cols) is not int or rows < 1 or cols < 1 or rows * cols > (1 << 48):
            raise CorruptFileError("expgrid: rows and cols must be positive integers")
        return cls(rows, cols, _b64_array(config.get("r"), rows, "<u2", "r"),
                   _b64_array(config.get("c"), cols, "<i2", "c"))

    def bind(self, ref: torch.Tensor | None) -> "ExpGrid":
        return self  # no reference: the prediction is in the config

    def layout_key(self) -> str:
        return f"expgrid {self.rows}x{self.cols}"

    @property
    def fixed_nbytes(self) -> int:
        return 4 * self.rows * self.cols

    def accepts(self, nbytes: int) -> bool:
        return nbytes == self.fixed_nbytes

    @classmethod
    def fit(cls, data: torch.Tensor, rows: int, cols: int) -> "ExpGrid":
        """The prediction for ``data`` (flat uint8, float32 words, ``rows x cols``): row means of
        the exponent field, then column means of what the rows leave, in blocks of rows."""
        return cls.fit_many([(data, rows, cols)])[0]

    @classmethod
    def fit_many(cls, items: list) -> list["ExpGrid"]:
        """:meth:`fit` for ``[(data, rows, cols)]``, with one device-to-host copy per device."""
        fitted: list = [None] * len(items)
        lib = native.lib
        cpu_items = [k for k, (data, _r, _c) in enumerate(items) if data.device.type == "cpu"]
        if lib is not None and cpu_items:  # one pass each in C, the storages spread over the CPU pool

            def one(k: int) -> None:
                data, rows, cols = items[k]
                rm, cm = np.empty(rows, dtype=np.float64), np.empty(cols, dtype=np.float64)
                lib.exp_fit(data.numpy(), rm, cm, rows, cols, max(1, cols // FIT_SAMPLES), max(1, rows // FIT_SAMPLES))
                fitted[k] = (torch.from_numpy(rm), torch.from_numpy(cm))
            # (the calling thread takes its share: behind other pool work, such as the planner's
            # estimates, the fits queued for the pool's threads while it waited)
            from ..codecs.cpu import pmap_balanced
            pmap_balanced(lambda i: one(cpu_items[i]), [items[k][0].numel() for k in cpu_items], FIT_TASK)
        for slot, (data, rows, cols) in enumerate(items):
            if fitted[slot] is not None:
                continue
            if data.device.type == "cpu":  # numpy: torch's CPU ops stall on loaded cores
                # row means from every k-th column, column means from every k-th row (at least
                # FIT_SAMPLES of each): a quarter of the passes of a full fit, as good a predictor
                u = data.numpy().view(np.uint32).reshape(rows, cols)
                e = ((u[:, ::max(1, cols // FIT_SAMPLES)] >> 23) & 0xFF).astype(np.float32)
                rm = e.mean(1, dtype=np.float64)
                ks = max(1, rows // FIT_SAMPLES)
                e = ((u[::ks] >> 23) & 0xFF).astype(np.float32)
                e -= rm[::ks, None].astype(np.float32)
                fitted[slot] = (torch.from_numpy(rm), torch.from_numpy(e.mean(0, dtype=np.float64)))
                continue
            w = data.view(torch.int32)
            rm = torch.empty(rows, dtype=torch.float64, device=data.device)
            cs = torch.zeros(cols, dtype=torch.float64, device=data.device)
            step = max(1, GRID_BLOCK // cols)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                e = ((w[a * cols:b * cols] >> 23) & 0xFF).view(b - a, cols).to(torch.float32)
                m = e.mean(1)
                rm[a:b] = m
                cs += (e - m[:, None]).sum(0, dtype=torch.float64)
            fitted[slot] = (rm, cs / rows)
        flat = [t for pair in fitted for t in pair]
        by_dev: dict = {}
        for k, t in enumerate(flat):
            by_dev.setdefault(t.device, []).append(k)
        host: list = [None] * len(flat)
        for dev, ks in by_dev.items():  # one copy (and sync) per device
            parts = torch.cat([flat[k] for k in ks]).cpu().numpy() if dev.type != "cpu" else None
            pos = 0
            for k in ks:
                n = flat[k].numel()
                host[k] = parts[pos:pos + n] if parts is not None else flat[k].numpy()
                pos += n
        out = []
        for (data, rows, cols), k in zip(items, range(0, len(host), 2)):
            r = np.clip(np.round(host[k] * 256) + 128, 0, 65535).astype("<u2")
            c = np.clip(np.round(host[k + 1] * 256), -32768, 32767).astype("<i2")
            out.append(cls(rows, cols, r, c))
        return out

    def _pred(self, device: torch.device, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``i0:i1`` of ``r`` and all of ``c`` as int32 tensors on ``device`` (cached)."""
        # per CUDA stream: the copy below is ordered only on the stream it was queued on
        key = (str(device), torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else str(device)
        if key not in self._dev:
            # one asynchronous copy (from pageable memory CUDA stages it at once, without waiting
            # for the device: a blocking copy here waited for every queued decode, per storage)
            both = torch.from_numpy(np.concatenate([self.r.astype(np.int32), self.c.astype(np.int32)]))
            both = both.to(device, non_blocking=True)
            self._dev[key] = (both[:self.rows], both[self.rows:])
        r, c = self._dev[key]
        return r[i0:i1], c

    def cpu_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """The row and column terms as int32 arrays (what the C inverse takes), made once."""
        if "np" not in self._dev:
            self._dev["np"] = (self.r.astype(np.int32), self.c.astype(np.int32))
        return self._dev["np"]

    def c_step(self, start: int, n: int) -> tuple | None:
        if start % 4:
            return None
        return ("grid", *self.cpu_terms(), start // 4)

    def _apply(self, src: torch.Tensor, out: torch.Tensor, start: int, sign: int) -> None:
        """``out`` = ``src`` with its half-shifted exponent field plus ``sign`` x the prediction,
        row segment by row segment (a partial first row, whole rows, a partial last row)."""
        if start % 4 or src.numel() % 4:
            raise CorruptFileError("expgrid: a window must hold whole float32 words")
        src = aligned(src if src.device == out.device else src.to(out.device), 4)
        cpu = out.device.type == "cpu" and not _TORCH_ON_CPU  # numpy: torch's CPU ops stall on loaded cores
        if cpu:
            x, o = src.numpy().view(np.uint32), out.numpy().view(np.uint32)
            rr, cc = self.cpu_terms()
            if native.lib is not None:  # one pass in C
                native.lib.exp_grid(x, o, rr, cc, start // 4, sign)
                return
        else:
            x, o = src.view(torch.int32), out.view(torch.int32)
        w0, n, L = start // 4, src.numel() // 4, self.cols
        pos = 0
        while pos < n:
            i, j = divmod(w0 + pos, L)
            if j == 0 and n - pos >= L:  # whole rows
                k = min((n - pos) // L, max(1, GRID_BLOCK // L))
                seg, shape, rows, cols = slice(pos, pos + k * L), (k, L), slice(i, i + k), slice(0, L)
            else:  # part of row i
                m = min(L - j, n - pos)
                seg, shape, rows, cols = slice(pos, pos + m), (m,), slice(i, i + 1), slice(j, j + m)
            if cpu:
                p = np.add(rr[rows].reshape(-1, 1) if len(shape) == 2 else rr[rows], cc[cols])
                _np_exp_add(x[seg].reshape(shape), o[seg].reshape(shape), p, sign)
            else:
                r, c = self._pred(out.device, rows.start, rows.stop)
                p = r[:, None] + c[None, cols] if len(shape) == 2 else r + c[cols]
                _torch_exp_add(x[seg].view(shape), o[seg].view(shape), p, sign)
            pos = seg.stop



def planes_after_ref(tf: Transform | None, ref: RefTransform | None) -> bool:
    """Whether a storage's chain is a bound ``xor`` / ``delta`` then ``byteplane`` of the same word
    width: the pair the fused paths (CUDA kernels, the CPU's cache-blocked numpy pass) undo or
    apply in one pass."""
    return (isinstance(tf, BytePlane) and tf.rotate is None and isinstance(ref, (Xor, Delta)) and ref.ref is not None
            and (not isinstance(ref, Delta) or ref.width == tf.width))


def _chain(bp: BytePlane | None, ref: RefTransform | None) -> tuple[int, int] | None:
    """``(mode, word width)`` of the byteplane kernels for ``ref`` then ``bp`` (either may be
    None; ``expgrid`` is classified by :func:`multi_segment` itself): planes alone, planes after a
    bound ``xor`` / ``delta``, a bound ``delta`` on words (no planes), a bound ``expref`` on
    32-bit words, a bound float32 -> bfloat16 ``derived``; None for every other chain. The one classification both the fused one-storage
    kernels (:func:`fused_planes`) and the multi-segment ones (:func:`multi_segment`) use."""
    if ref is None:
        if bp is not None and bp.rotate == 16:  # (its kernels compile after the warm-up's)
            return (PLAIN16, 4) if rot16_ready() else None
        return (PLAIN, bp.width) if bp is not None else None
    if ref.ref is None or (bp is not None and bp.rotate is not None):
        return None  # (the reference kernels write the whole-word rotation)
    if bp is not None and planes_after_ref(bp, ref):
        return (DELTA if isinstance(ref, Delta) else XOR), bp.width
    if bp is None and isinstance(ref, Delta) and ref.width in (2, 4, 8):
        return DELTA, ref.width  # (words without planes: small storages' deltas; multi-segment only)
    if isinstance(ref, ExpRef) and (bp is None or bp.width == 4):
        return EXPREF, 4
    if isinstance(ref, HiDelta) and bp is not None and bp.width == 4:
        return HIDELTA, 4
    if isinstance(ref, Derived) and ref.src == "float32" and ref.to == "bfloat16" and (bp is None or bp.width == 2):
        return DERIVED, 2
    return None


def fused_planes(tf: Transform | None, ref: RefTransform | None, at: int, words: torch.Tensor,
                 start: bool = True) -> tuple | None:
    """``(kernels, reference slice, width, block, mode)`` when ``byteplane`` after a bound
    ``xor`` / ``delta`` (or ``expref`` on 32-bit planes) runs as one CUDA kernel on ``words``
    (the kernels' ``mode``: :data:`ckptzip.kernels.XOR`, ``DELTA``, ``EXPREF``; the data to encode, or the
    destination to decode into, at byte ``at`` of its storage), through
    :func:`ckptzip.kernels._triton_bp.encode_ref` / ``decode_ref`` (same bytes as the two steps):
    Triton ready (``start``: see :func:`ckptzip.kernels.triton_kernels`), ``words`` and the
    reference slice on one GPU, word-aligned, whole words; else None."""
    if not isinstance(tf, BytePlane) or ref is None:
        return None
    kind = _chain(tf, ref)
    if kind is None or kind[0] not in (XOR, DELTA, EXPREF, HIDELTA):
        return None
    mode, w = kind
    refb = ref.base_slice(at, words.numel())
    if not all(t.is_cuda and t.device == words.device and t.data_ptr() % w == 0 and t.numel() % w == 0
               for t in (words, refb)):
        return None
    k = triton_kernels(start=start) if enabled("fused") else None
    return (_Fused(k), refb, w, tf.block, mode) if k is not None else None


def multi_segment(tf: Transform | None, ref: RefTransform | None, at: int, n: int, addr: int,
                  device: torch.device, large_alone: bool = False) -> tuple[int, ...] | None:
    """How :func:`ckptzip.kernels._triton_bp.encode_multi` / ``decode_multi`` apply or undo this
    chain for bytes ``at`` to ``at + n`` of a storage whose words are at address ``addr`` (CUDA
    ``device``), as ``(mode, width, planes, block, reference address, column terms' address,
    columns, first word)``: byte planes alone, planes after ``xor`` / ``delta`` (as
    :func:`fused_planes`), ``expref`` or ``expgrid`` with or without planes, or a float32 ->
    bfloat16 ``derived`` with or without planes; None for every other chain (handled storage
    by storage), where a word would be misaligned, and (``large_alone``: saves) for storages of
    :data:`MULTI_MAX` bytes or more that a one-storage kernel handles (planes alone or after
    xor / delta / expref)."""
    bp = tf if isinstance(tf, BytePlane) else None
    if tf is not None and bp is None:
        return None
    if (large_alone and n >= MULTI_MAX and bp is not None
            and (ref is None or isinstance(ref, (Xor, Delta, ExpRef, HiDelta)))):
        return None  # a one-storage kernel exists, and is faster on large storages
    if isinstance(ref, ExpGrid):
        if (bp is not None and (bp.width != 4 or bp.rotate is not None)) or n % 4 or at % 4 or addr % 4:
            return None
        r, c = ref._pred(device, 0, ref.rows)
        return (EXPGRID, 4, bp is not None, bp.block if bp is not None else 0, r.data_ptr(), c.data_ptr(),
                ref.cols, at // 4)
    if ref is not None and (ref.ref is None or not ref.ref.is_cuda or ref.ref.device != device):
        return None
    kind = _chain(bp, ref)
    if kind is None:
        return None
    mode, w = kind
    if n % w or addr % w:
        return None
    rptr = ref.base_slice(at, n).data_ptr() if ref is not None else 0
    if rptr % (4 if mode == DERIVED else w):
        return None
    return mode, w, bp is not None, bp.block if bp is not None else 0, rptr, 0, 0, 0


class _Fused:
    """The fused kernels (family "fused" of :func:`ckptzip.kernels.launch`): a call that fails
    before it launches returns False, and the caller runs the two steps."""

    def __init__(self, k) -> None:
        self._k = k

    def encode_ref(self, *args) -> bool:
        return launch("fused", self._k.encode_ref, *args)

    def decode_ref(self, *args) -> bool:
        return launch("fused", self._k.decode_ref, *args)
