"""The codec layer: one interface (:class:`Codec`), a registry keyed by wire id, and CPU and
GPU implementations of the same wire formats."""
from . import cpu  # noqa: F401  (registers raw, zstd, deflate)
from .base import MAX_CHUNK, Codec, get_codec, register, registered

__all__ = ["Codec", "get_codec", "register", "registered", "MAX_CHUNK"]
