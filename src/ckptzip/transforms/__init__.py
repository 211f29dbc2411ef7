"""The transform layer: one interface (:class:`Transform`), a registry keyed by wire id, and the
implementations (``byteplane``; ``xor`` and ``derived``, which refer to another storage)."""
from .base import RESERVED, Transform, get_transform, register, registered
from .byteplane import BytePlane
from .refs import Delta, Derived, ExpGrid, ExpRef, RefTransform, Xor

__all__ = ["Transform", "BytePlane", "RefTransform", "Xor", "Delta", "Derived", "ExpRef", "ExpGrid", "get_transform", "register", "registered", "RESERVED"]
