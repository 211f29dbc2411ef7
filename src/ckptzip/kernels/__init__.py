"""GPU kernels (Triton) shared by the transforms and the engine's segment copies.

:func:`triton_kernels` returns the kernel module, or None where Triton cannot run (no CUDA, no
Triton, or ``CKPTZIP_NO_TRITON=1``); every caller then uses its torch / numpy path, which
produces the same bytes.
"""
from __future__ import annotations

import os

_TRITON: object = False


def triton_kernels():
    """The Triton kernel module (byteplane encode/decode, segment copies), or None."""
    global _TRITON
    if _TRITON is False:
        try:
            if os.environ.get("CKPTZIP_NO_TRITON") == "1":
                raise ImportError
            from . import _triton_bp
            _TRITON = _triton_bp
        except Exception:
            _TRITON = None
    return _TRITON
