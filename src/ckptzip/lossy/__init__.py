"""Opt-in lossy export: weights-only artifacts (quantized, entropy-coded) from any checkpoint
ckptzip reads. Resume checkpoints stay lossless; see docs/export.md.

    report = ckptzip.export("run/step_2000.ckz", "model-int4.ckz", scheme="int4")
    weights = ckptzip.lossy.load_lossy("model-int4.ckz")        # {name: bf16 tensor}
    ckptzip.lossy.ensure_lossless(path)                          # resume paths: refuse lossy files
"""
from .core import (FORMAT, META_LOSSY, META_SCHEME, ensure_lossless, export, is_lossy,
                   load_codes, load_lossy)
from .errors import (BudgetError, DestinationError, ExportError, LossyCheckpointError, NoFloatWeightsError,
                     NonFiniteWeightError, SchemeError)
from .quant import Scheme, dequantize, parse_scheme, quantize, signed_codes, unpack_codes

__all__ = ["export", "load_lossy", "load_codes", "is_lossy", "ensure_lossless",
           "quantize", "dequantize", "unpack_codes", "signed_codes", "parse_scheme", "Scheme",
           "FORMAT", "META_LOSSY", "META_SCHEME",
           "ExportError", "NoFloatWeightsError", "SchemeError", "NonFiniteWeightError", "DestinationError",
           "LossyCheckpointError", "BudgetError"]
