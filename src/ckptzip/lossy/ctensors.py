"""format="compressed-tensors": a directory with model.safetensors and config.json holding a
``quantization_config`` that the ``compressed-tensors`` package (vLLM, transformers) reads.

Names and packing follow compressed-tensors 0.20.0 (compressors/pack_quantized, naive_quantized):
  * intN, group strategy -> format "pack-quantized": ``<module>.weight_packed`` (int32, codes
    ``q + 2**(N-1)`` packed densely LSB first, 32 codes per N words, per row, padded with 0 then
    truncated to ceil(cols*N/32) words), ``<module>.weight_scale`` (rows, groups) bf16,
    ``<module>.weight_shape`` (int64 [rows, cols]) and, asymmetric only,
    ``<module>.weight_zero_point`` packed the same way along dim 0.
  * fp8 e4m3, channel strategy -> format "float-quantized": ``<module>.weight`` (float8_e4m3fn) and
    ``<module>.weight_scale`` (rows, 1) bf16.
  * everything else (kept tensors, bf16 scheme, tensors compressed-tensors cannot describe: a
    name not ending in ``.weight``, ndim != 2, cols not a multiple of the group) is stored dense
    (dequantized to ``dtype`` when it was quantized) and its module is listed in ``ignore``.
compressed-tensors dequantizes ``(q - zp) * scale`` in the scale's dtype (bf16): the product of
an integer of at most 8 bits and a bf16 is exact in float32, so its result is bit-identical to
ckptzip's float32-then-round dequantization.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Any

import torch

from ..torchfile import write_safetensors
from .errors import DestinationError
from .quant import pack_bits, signed_codes


def pack_int32(codes_signed: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 (packed_dim=1) for a 2-D int8 tensor."""
    rows, cols = codes_signed.shape
    u = (codes_signed.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    cp = math.ceil(cols / 32) * 32
    if cp > cols:
        u = torch.cat([u, u.new_zeros(rows, cp - cols)], 1)
    b = pack_bits(u, bits).view(rows, cp * bits // 8)  # rows pack independently: cp*bits is a multiple of 32
    words = b.view(torch.int32)
    return words[:, :math.ceil(cols * bits / 32)].contiguous()


def _args(q: dict[str, Any]) -> dict[str, Any]:
    if q["kind"] == "fp8":
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    return {"num_bits": int(q["bits"]), "type": "int", "symmetric": bool(q["sym"]), "strategy": "group",
            "group_size": int(q["group"]), "dynamic": False}


def write_compressed_tensors(dst: str, entries: dict[str, dict], kept: dict[str, torch.Tensor],
                             report: dict[str, Any], *, force: bool, dtype: torch.dtype) -> int:
    from .quant import dequantize
    if os.path.exists(dst):
        if not force:
            raise DestinationError(f"destination {dst!r} exists; pass force=True (--force) to overwrite")
        shutil.rmtree(dst) if os.path.isdir(dst) else os.remove(dst)
    tmp = dst.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, Any]] = {}
    ignore: list[str] = []
    dense: list[str] = []
    for n, e in entries.items():
        q = e["q"]
        shape = [int(v) for v in q["shape"]]
        ok = (n.endswith(".weight") and len(shape) == 2 and q["kind"] in ("int", "fp8")
              and (q["kind"] == "fp8" or shape[1] % int(q["group"]) == 0))
        if not ok:
            out[n] = dequantize(e, dtype=dtype)
            dense.append(n)
            if n.endswith(".weight"):
                ignore.append(n[:-len(".weight")])
            continue
        mod = n[:-len(".weight")]
        key = json.dumps(_args(q), sort_keys=True)
        g = groups.setdefault(key, {"targets": [], "weights": _args(q),
                                    "format": "float-quantized" if q["kind"] == "fp8" else "pack-quantized"})
        g["targets"].append(mod)
        if q["kind"] == "fp8":
            out[f"{mod}.weight"] = e["codes"].view(torch.float8_e4m3fn).reshape(shape)
            out[f"{mod}.weight_scale"] = e["scales"].reshape(shape[0], 1)
        else:
            bits = int(q["bits"])
            c, z = signed_codes(e)
            out[f"{mod}.weight_packed"] = pack_int32(c, bits)
            out[f"{mod}.weight_scale"] = e["scales"].reshape(shape[0], -1)
            out[f"{mod}.weight_shape"] = torch.tensor(shape, dtype=torch.int64)
            if z is not None:
                out[f"{mod}.weight_zero_point"] = pack_int32(z.reshape(shape[0], -1).t().contiguous(), bits).t().contiguous()
    for n, t in kept.items():
        out[n] = t
    formats = {g["format"] for g in groups.values()}
    qc = {"quant_method": "compressed-tensors",
          "format": formats.pop() if len(formats) == 1 else ("mixed-precision" if formats else "dense"),
          "quantization_status": "compressed",
          "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
          "ignore": sorted(set(ignore)), "kv_cache_scheme": None}
    write_safetensors(out, os.path.join(tmp, "model.safetensors"), {"format": "pt", "producer": "ckptzip.export"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"quantization_config": qc}, f, indent=1)
    report["compressed_tensors"] = {"dense": dense, "groups": len(groups)}
    os.replace(tmp, dst)
    return sum(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
