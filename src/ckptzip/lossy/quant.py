"""Weight quantizers of the lossy export: fp8 e4m3 (one scale per row) and intN (N = 2..8,
group-wise along the last dimension, symmetric or asymmetric, with an error-minimizing clipping
search). Plain torch ops: the same code runs on the GPU and on the CPU and writes the same wire
format.

Wire format of one quantized tensor (the dict stored under ``tensors[name]`` of a lossy .ckz)::

    {"q": {"scheme": "int4-g128", "kind": "int", "bits": 4, "group": 128, "sym": False,
           "shape": [rows..., cols], "dtype": "float32", "cols_padded": 128*k,
           "pack": "bits" | "byte", "err": relative RMS error, ...},
     "codes": uint8 tensor, "scales": bfloat16 tensor, "zeros": uint8 tensor or None}

Dequantization is exact float32 arithmetic followed by one rounding to the output dtype:
``(float32(code) - float32(zero)) * float32(scale)``; codes have at most 8 significant bits and
scales are bfloat16 (8 significant bits), so the float32 product is exact and CPU and GPU give
identical bits (and so does compressed-tensors' bf16 math on the same numbers).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from .errors import SchemeError

FP8_MAX = 448.0
DEFAULT_GROUP = 128
DEFAULT_RATIOS = 20  # clipping ratios tried per group, 0.5 .. 1.0
# Code layout per bit width, chosen by measurement with ckptzip.save (CPU zstd; docs/export.md
# has the table): int2/int3/int4 are bit-packed (LSB first; int2 and int4 codes never straddle a
# byte, so a byte-level entropy coder still sees whole codes; for int3 zstd's Huffman coder on one
# code per byte is 16 % larger than the packed bits), int5..int8 one code per byte (the entropy
# coder recovers the unused bits and the skew of the histogram: 1-2 % smaller than packed bits).
PACK_LAYOUT = {2: "bits", 3: "bits", 4: "bits", 5: "byte", 6: "byte", 7: "byte", 8: "byte"}

_SCHEME_RE = re.compile(r"^int([2-8])(?:-g(\d+))?(-sym|-asym)?$")


@dataclass(frozen=True)
class Scheme:
    kind: str            # "int", "fp8" or "bf16"
    bits: int = 16
    group: int = 0       # int: group size along the last dim; fp8: 0 (one scale per row)
    sym: bool = True

    @property
    def name(self) -> str:
        if self.kind != "int":
            return self.kind
        return f"int{self.bits}-g{self.group}" + ("-sym" if self.sym else "")


def parse_scheme(s: str | Scheme) -> Scheme:
    """``"fp8"``, ``"bf16"``, ``"int4"`` (= ``int4-g128``, asymmetric), ``"int4-g32"``,
    ``"int4-g128-sym"`` ..."""
    if isinstance(s, Scheme):
        return s
    s = str(s).strip().lower()
    if s in ("fp8", "fp8-e4m3", "float8"):
        return Scheme("fp8", 8, 0, True)
    if s in ("bf16", "bfloat16"):
        return Scheme("bf16", 16, 0, True)
    m = _SCHEME_RE.match(s)
    if not m:
        raise SchemeError(f"unknown scheme {s!r} (use bf16, fp8, int2..int8 with optional -g32/-g64/-g128 and -sym)")
    group = int(m.group(2) or DEFAULT_GROUP)
    if group not in (32, 64, 128):
        raise SchemeError(f"group size {group} not supported (32, 64 or 128)")
    return Scheme("int", int(m.group(1)), group, m.group(3) == "-sym")


def check_scheme_dtype(name: str, t: torch.Tensor, scheme: Scheme) -> None:
    """Raise SchemeError when ``t`` cannot take ``scheme``."""
    if not t.is_floating_point():
        raise SchemeError(f"tensor {name!r} has dtype {str(t.dtype).replace('torch.', '')}: "
                          f"scheme {scheme.name} needs a floating-point tensor")
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        raise SchemeError(f"tensor {name!r} is already {str(t.dtype).replace('torch.', '')}: "
                          f"scheme {scheme.name} cannot requantize fp8 weights")
    if scheme.kind == "bf16" and t.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise SchemeError(f"tensor {name!r} has dtype {str(t.dtype).replace('torch.', '')}: "
                          f"scheme bf16 would lose range or precision; keep it or use fp8/intN")
    if t.ndim < 2:
        raise SchemeError(f"tensor {name!r} has {t.ndim} dims: scheme {scheme.name} needs a matrix")


# -- bf16 scale rounding -------------------------------------------------------------------
def round_up_bf16(s: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16 >= s (s >= 0, float32), so that amax / scale never exceeds the code range."""
    b = s.to(torch.bfloat16)
    low = b.float() < s
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(low, up, b)


# -- bit packing -------------------------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits) LSB first: 8 codes -> ``bits`` bytes. Code i occupies bits
    [i*bits, (i+1)*bits) of the little-endian bit stream (int4: low nibble first)."""
    flat = codes.reshape(-1).to(torch.int64)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    g = flat.view(-1, 8)
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    word = (g << shifts).sum(1)  # 8*bits <= 64 bits
    bshift = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    return ((word[:, None] >> bshift) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: the first ``n`` codes as uint8."""
    b = packed.reshape(-1, bits).to(torch.int64)
    bshift = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << bshift).sum(1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n].to(torch.uint8)


# -- quantization ------------------------------------------------------------------------------
def _as_rows(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, w.shape[-1]).float()


def _groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    rows, cols = x.shape
    pad = (-cols) % group
    if pad:  # pad by repeating the last column: the group's range and error stay those of real values
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], 1)
    return x.view(rows, -1, group), cols + pad


def _int_range(bits: int, sym: bool) -> tuple[int, int]:
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if sym else (0, (1 << bits) - 1)


def _int_params(xg: torch.Tensor, bits: int, sym: bool, ratios: torch.Tensor, cols: int | None = None):
    """Per-group (scale bf16, zero uint8-range float) minimizing the squared error over the clipping
    ratios. Vectorized over groups; the Python loop runs over the ratios only.

    Each ratio costs six passes over one reused buffer (no full-size temporaries):
    ``clamp(round(x / s) + z, lo, hi) - z`` is computed as ``clamp(round(x / s), lo - z, hi - z)``
    (the same integers, exactly), so the squared error is the same float as the textbook
    ``((q - z) * s - x) ** 2``, and the argmin over the ratios (first minimum wins) is unchanged."""
    g = xg.shape[-1]
    mask = None  # padded elements (copies of the last column) do not count in the error
    if cols is not None and cols < xg.shape[-2] * g:
        mask = (torch.arange(xg.shape[-2] * g, device=xg.device) < cols).float().view(1, -1, g)
    lo, hi = _int_range(bits, sym)
    if sym:
        amax = xg.abs().amax(-1)
        span = amax / max(hi, 1)
    else:
        mn = xg.amin(-1).clamp(max=0)
        mx = xg.amax(-1).clamp(min=0)
        span = (mx - mn) / hi
    # the scales and zeros of every ratio at once, (ratios, rows, groups): few small ops per tensor
    rs = ratios.to(span.dtype).view(-1, *([1] * span.ndim))
    s_all = round_up_bf16(span[None] * rs)
    s_all = torch.where(s_all == 0, torch.ones_like(s_all), s_all).float()
    z_all = torch.zeros_like(s_all) if sym else torch.round(-mn[None] * rs / s_all).clamp(lo, hi)
    err_all = torch.empty_like(s_all)
    negx = -xg
    # on a GPU, ratios in blocks of up to 2**26 elements (few launches per tensor, bounded
    # temporaries); on the CPU one ratio at a time in one reused buffer (cache-sized passes: 1.6x
    # faster there than blocks)
    step = max(1, min(s_all.shape[0], (1 << 26) // max(xg.numel(), 1))) if xg.is_cuda else 1
    whole = torch.empty((step, *xg.shape), dtype=xg.dtype, device=xg.device)
    for a in range(0, s_all.shape[0], step):
        b = min(s_all.shape[0], a + step)
        s3 = s_all[a:b][..., None]
        buf = torch.div(xg[None], s3, out=whole[:b - a])
        buf.round_()
        if sym:
            buf.clamp_(lo, hi)
        else:
            z3 = z_all[a:b][..., None]
            buf.clamp_(lo - z3, hi - z3)  # = clamp(round(x / s) + z, lo, hi) - z
        # (q - z) * s - x, one fused pass: the product (an integer of <= 8 bits times a bf16) is exact
        torch.addcmul(negx[None], buf, s3, out=buf)
        buf.square_()
        if mask is not None:
            buf.mul_(mask)
        torch.sum(buf, -1, out=err_all[a:b])
    best = err_all.argmin(0, keepdim=True)  # the first minimum: the earliest ratio wins ties
    best_s = s_all.gather(0, best)[0]
    best_z = z_all.gather(0, best)[0]
    return best_s, best_z, lo, hi


def quantize(w: torch.Tensor, scheme: str | Scheme, *, search: bool = True,
             ratios: int = DEFAULT_RATIOS, name: str = "weight") -> dict[str, Any]:
    """Quantize one weight matrix (ndim >= 2; the last dim is the group / row dim).
    ``search=False`` is plain round-to-nearest from min/max (the clipping ratio 1.0 only)."""
    return _quantize(w, scheme, search=search, ratios=ratios, name=name)[0]


def _quantize(w: torch.Tensor, scheme: str | Scheme, *, search: bool = True, ratios: int = DEFAULT_RATIOS,
              name: str = "weight", params: tuple | None = None, pack: bool = True
              ) -> tuple[dict[str, Any], float, tuple | None]:
    """quantize() plus ``estimate_bits`` of the entry (taken from the codes before packing) and the
    intN parameters ``(scales, zeros)`` of the entry (else None). ``params`` (from an earlier call
    on the same tensor and scheme, same ``search`` and ``ratios``) skips the clipping search: the
    entry is the same, bit for bit. ``pack=False`` (only the err, bits and params are wanted): the
    intN codes are not bit-packed and the entry's ``codes`` is None."""
    sc = parse_scheme(scheme)
    check_scheme_dtype(name, w, sc)
    if sc.kind == "int" and w.shape[-1] < sc.group:  # a row shorter than the group: smaller groups, less padding
        sc = Scheme("int", sc.bits, next(g for g in (32, 64, 128) if g >= w.shape[-1] or g == sc.group), sc.sym)
    shape = list(w.shape)
    q: dict[str, Any] = {"scheme": sc.name, "kind": sc.kind, "bits": sc.bits, "group": sc.group,
                         "sym": sc.sym, "shape": shape, "dtype": str(w.dtype).replace("torch.", "")}
    prm = None
    if sc.kind == "bf16":
        codes = w.detach().to(torch.bfloat16).contiguous()
        q.update(pack="none", cols_padded=shape[-1])
        entry = {"q": q, "codes": codes, "scales": None, "zeros": None}
        bits_est = estimate_bits(entry)
        deq = dequantize(entry, dtype=torch.float32)
    elif sc.kind == "fp8":
        x = _as_rows(w)
        amax = x.abs().amax(1)
        s = round_up_bf16(amax / FP8_MAX)
        s = torch.where(s == 0, torch.ones_like(s), s)
        c = (x / s.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        q.update(pack="byte", cols_padded=shape[-1])
        entry = {"q": q, "codes": c.view(torch.uint8).contiguous(), "scales": s.contiguous(), "zeros": None}
        bits_est = estimate_bits(entry)
        deq = dequantize(entry, dtype=torch.float32)
    else:
        x = _as_rows(w)
        rows = x.shape[0]
        xg, cp = _groups(x, sc.group)
        if params is None:
            rs = torch.linspace(0.5, 1.0, ratios, device=x.device) if search else torch.ones(1, device=x.device)
            s, z, lo, hi = _int_params(xg, sc.bits, sc.sym, rs, x.shape[1])
        else:  # the search's scales are bf16 values and its zeros integers in 0..255: both stored exactly
            lo, hi = _int_range(sc.bits, sc.sym)
            s = params[0].float().reshape(xg.shape[:-1])
            z = torch.zeros_like(s) if params[1] is None else params[1].float().reshape(xg.shape[:-1])
        qv = (torch.round(xg / s[..., None]) + z[..., None]).clamp(lo, hi)
        codes = (qv - lo).to(torch.uint8).reshape(rows, cp)  # unsigned: sym codes offset by 2**(bits-1)
        layout = PACK_LAYOUT[sc.bits]
        q.update(pack=layout, cols_padded=cp)
        entry = {"q": q, "codes": None if not pack else pack_bits(codes, sc.bits) if layout == "bits" else codes.contiguous(),
                 "scales": s.to(torch.bfloat16).contiguous(),
                 "zeros": None if sc.sym else z.to(torch.uint8).contiguous()}
        prm = (entry["scales"], entry["zeros"])
        bits_est = _side_bits(entry, codes, 1 << sc.bits)  # = estimate_bits(entry)
        deq = _dequant_int(codes.float().view(rows, -1, sc.group), entry, dtype=torch.float32)
    ref = w.detach().float()
    num, den = torch.stack([(deq - ref).square().sum(), ref.square().sum()]).tolist()  # one host sync
    q["err"] = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))
    return entry, bits_est, prm


def unpack_codes(entry: dict[str, Any]) -> torch.Tensor:
    """The unsigned codes of an intN entry as uint8 of shape (rows, cols_padded); fp8 codes as
    float8_e4m3fn of shape (rows, cols)."""
    q = entry["q"]
    rows = math.prod(q["shape"][:-1])
    if q["kind"] == "fp8":
        return entry["codes"].view(torch.float8_e4m3fn).reshape(rows, q["shape"][-1])
    if q["kind"] != "int":
        return entry["codes"]
    cp = int(q["cols_padded"])
    if q["pack"] == "bits":
        return unpack_bits(entry["codes"], int(q["bits"]), rows * cp).reshape(rows, cp)
    return entry["codes"].reshape(rows, cp)


def signed_codes(entry: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """intN codes and zero points in the signed convention of compressed-tensors
    (code - 2**(bits-1)), as int8 of shape (rows, cols) and (rows, groups)."""
    q = entry["q"]
    off = 1 << (int(q["bits"]) - 1)
    c = unpack_codes(entry)[:, :q["shape"][-1]].to(torch.int16) - off
    z = None if entry["zeros"] is None else (entry["zeros"].to(torch.int16) - off).to(torch.int8)
    return c.to(torch.int8), z


def dequantize(entry: dict[str, Any], dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str | None = None) -> torch.Tensor:
    """Dequantized tensor of the original shape: float32 math, one rounding to ``dtype``."""
    q = entry["q"]
    shape = [int(v) for v in q["shape"]]
    if device is not None:
        entry = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
    if q["kind"] == "bf16":
        return entry["codes"].to(dtype).reshape(shape)
    rows = math.prod(shape[:-1])
    if q["kind"] == "fp8":
        c = unpack_codes(entry).float()
        out = c * entry["scales"].float().reshape(rows, 1)
        return out.to(dtype).reshape(shape)
    return _dequant_int(unpack_codes(entry).float().view(rows, -1, int(q["group"])), entry, dtype)


def _dequant_int(c: torch.Tensor, entry: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """intN dequantization from the unsigned codes as float32 of shape (rows, groups, group)."""
    q = entry["q"]
    shape = [int(v) for v in q["shape"]]
    rows, cols, bits = c.shape[0], shape[-1], int(q["bits"])
    s = entry["scales"].float().reshape(rows, -1, 1)
    if q["sym"]:
        z = torch.full((), float(1 << (bits - 1)), device=c.device)
    else:
        z = entry["zeros"].float().reshape(rows, -1, 1)
    out = ((c - z) * s).reshape(rows, -1)[:, :cols]
    return out.to(dtype).reshape(shape)


# -- size estimate (order-0 entropy), used to plan before anything is written ---------------
def _entropy_t(v: torch.Tensor, nsym: int) -> torch.Tensor:
    """Order-0 entropy (bits) of ``v`` as a 0-d float64 tensor on its device (no host sync)."""
    v = v.reshape(-1)
    h = torch.bincount(v if v.dtype == torch.uint8 else v.to(torch.int64), minlength=nsym).double()
    p = h / v.numel()
    return -(p * torch.where(h > 0, p, torch.ones_like(p)).log2()).sum() * v.numel()


def _entropies(*parts: tuple[torch.Tensor, int]) -> list[float]:
    """The order-0 entropy bits of each ``(tensor, symbols)`` part, fetched in one host sync."""
    vals = [_entropy_t(v, k) if v.numel() else None for v, k in parts]
    got = iter(torch.stack([x for x in vals if x is not None]).tolist() if any(x is not None for x in vals) else [])
    return [0.0 if x is None else next(got) for x in vals]


def _entropy_bits(v: torch.Tensor, nsym: int) -> float:
    return _entropies((v, nsym))[0]


def estimate_bits(entry: dict[str, Any]) -> float:
    """Order-0 entropy bound (bits) of codes + scales + zeros, each byte plane of the scales coded
    separately (as ckptzip's byteplane transform does)."""
    q = entry["q"]
    if q["kind"] == "bf16":
        b = entry["codes"].reshape(-1).view(torch.uint8).view(-1, 2)
        lo, hi = _entropies((b[:, 0], 256), (b[:, 1], 256))
        return lo + hi
    if q["kind"] == "fp8":
        return _side_bits(entry, entry["codes"], 256)
    return _side_bits(entry, unpack_codes(entry), 1 << int(q["bits"]))


def _side_bits(entry: dict[str, Any], codes: torch.Tensor, nsym: int) -> float:
    """The order-0 entropy bits of the ``codes`` (``nsym`` symbols) plus those of the scales (per
    byte plane) and zeros of an fp8 / intN entry, summed in this order; one host sync."""
    sb = entry["scales"].reshape(-1).view(torch.uint8).view(-1, 2)
    parts = [(codes, nsym), (sb[:, 0], 256), (sb[:, 1], 256)]
    if entry["zeros"] is not None:
        parts.append((entry["zeros"], 256))
    e = _entropies(*parts)
    total = e[0] + (e[1] + e[2])
    if entry["zeros"] is not None:
        total += e[3]
    return total
