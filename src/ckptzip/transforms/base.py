"""The transform interface and its registry.

A *transform* is a reversible, size-preserving rearrangement of a storage's bytes applied before
the codec (array -> bytes in zarr v3's terms; codecs are bytes -> bytes). Like a codec it has a
*wire id* and a *wire config* (``get_config`` / ``from_config`` round-trip through the manifest),
and one implementation works on CPU and CUDA tensors alike, producing the same bytes.

To add a transform: subclass :class:`Transform`, set ``wire_id``, implement the methods below,
decorate the class with :func:`register`, import its module in ``transforms/__init__.py``, add
it to docs/format.md (a new id needs a format minor version) and to the conformance suite
(tests/test_conformance.py).
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from ..errors import UnknownCodecError

#: transform ids a format version reserves for later ones (a reader names them in its error); the
#: ids v1.0 reserved (``delta``, ``xor``, ``derived``) are defined by v1.1
RESERVED: tuple[str, ...] = ()


class Transform(abc.ABC):
    """One reversible transform of a flat ``uint8`` storage; same wire format on every device."""

    wire_id: ClassVar[str]

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The wire config: ``{"id": wire_id, **parameters a decoder needs}``."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "Transform":
        """The transform a wire config describes; raises :class:`UnknownCodecError` for options
        it does not know."""

    @abc.abstractmethod
    def accepts(self, nbytes: int) -> bool:
        """Whether a storage of ``nbytes`` bytes can be transformed."""

    @abc.abstractmethod
    def encode(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The transformed bytes of ``src`` in ``out`` (or a new tensor); ``src`` is never modified."""

    @abc.abstractmethod
    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Inverse of :meth:`encode`, written into the preallocated ``dst`` (same size)."""


_REGISTRY: dict[str, type[Transform]] = {}


def register(cls: type[Transform]) -> type[Transform]:
    """Class decorator: make ``cls`` the implementation of its wire id."""
    _REGISTRY[cls.wire_id] = cls
    return cls


def registered() -> list[str]:
    """Wire ids of every registered transform."""
    return sorted(_REGISTRY)


def get_transform(config: Any) -> Transform:
    """The transform a wire config (from a manifest) describes."""
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise UnknownCodecError(f"malformed transform config {str(config)[:200]}")
    tid = config["id"]
    cls = _REGISTRY.get(tid)
    if cls is not None:
        return cls.from_config(config)
    if tid in RESERVED:
        raise UnknownCodecError(f"transform {tid!r} is reserved by format v1 and not supported by "
                                f"this version of ckptzip")
    raise UnknownCodecError(f"unknown transform {tid!r}")
