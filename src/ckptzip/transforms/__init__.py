"""The transform layer: one interface (:class:`Transform`), a registry keyed by wire id, and the
implementations (``byteplane`` today)."""
from .base import RESERVED, Transform, get_transform, register, registered
from .byteplane import BytePlane

__all__ = ["Transform", "BytePlane", "get_transform", "register", "registered", "RESERVED"]
