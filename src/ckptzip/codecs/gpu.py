"""nvCOMP (GPU) implementations — filled in by the GPU engine."""
from __future__ import annotations

from ..errors import GPURequiredError


def require_gpu(wire_id: str) -> None:
    raise GPURequiredError(f"codec {wire_id!r} needs a CUDA GPU with nvCOMP")
