"""``ckptzip.lightning``: kept as the public import path of the Lightning plugins, which live in
:mod:`ckptzip.integrations.lightning`."""
from .integrations.lightning import AsyncCkptzipCheckpointIO, CkptzipCheckpointIO  # noqa: F401

__all__ = ["CkptzipCheckpointIO", "AsyncCkptzipCheckpointIO"]
