"""The codec interface and the registry.

A *codec* turns a batch of byte chunks into a batch of compressed chunks and back. Its *wire id*
("zstd", "ans", ...) and its *wire config* (the parameters a decoder needs) name a bitstream
format; several implementations of one wire format may be registered (``"cpu"`` and ``"cuda"``),
and any of them must decode what any other wrote. Encoding and decoding work on one flat ``uint8``
torch tensor carved by offset/size tables, so CPU and GPU implementations share one signature.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..errors import GPURequiredError, UnknownCodecError

#: Largest uncompressed chunk any reader accepts (ANS's own limit is 16 MiB).
MAX_CHUNK = 16 * 1024 * 1024


class Codec(abc.ABC):
    """One implementation of one wire format.

    Subclasses set ``wire_id``, ``device`` (``"cpu"`` or ``"cuda"``) and ``max_chunk``, accept their
    wire config as keyword arguments and implement :meth:`encode` and :meth:`decode`.
    """

    wire_id: ClassVar[str]
    device: ClassVar[str] = "cpu"
    max_chunk: ClassVar[int] = MAX_CHUNK
    #: config keys that the decoder needs and that therefore go into the manifest
    config_keys: ClassVar[tuple[str, ...]] = ()
    #: the decoder's work is bounded by the declared output size whatever the input, so a chunk
    #: may be decoded before its checksum is verified (GPU loads queue the decode and verify the
    #: checksums they compute on the GPU afterwards). False: chunks are verified on the host
    #: first (nvCOMP's Zstd decoder never returned on a chunk with one flipped bit, measured on
    #: an H100)
    decodes_unverified: ClassVar[bool] = False
    #: the decoder returns on every input, also one forged with valid checksums. False (nvCOMP
    #: 6.0's Zstd: 2 of 3 forged chunks never returned on an H100): readers decode this wire
    #: format with another implementation unless the caller forces this device
    #: (``decode_device``)
    safe_on_forged: ClassVar[bool] = True

    def __init__(self, **config: Any) -> None:
        unknown = set(config) - set(self.config_keys) - set(self.local_keys())
        if unknown:
            raise UnknownCodecError(f"codec {self.wire_id!r} has no option(s) {sorted(unknown)}")
        self.config = config

    @classmethod
    def local_keys(cls) -> tuple[str, ...]:
        """Options that only steer this implementation (threads, level...) and are not stored."""
        return ()

    def get_config(self) -> dict[str, Any]:
        """The wire config: ``{"id": wire_id, **params needed to decode}``."""
        cfg = {"id": self.wire_id}
        cfg.update({k: self.config[k] for k in self.config_keys if k in self.config})
        return cfg

    @abc.abstractmethod
    def encode(self, src: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]
               ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Compress ``src[offsets[i]:offsets[i]+sizes[i]]`` for every i.

        Returns ``(dst, dst_offsets, dst_sizes)``: one ``uint8`` tensor on this codec's device that
        holds every compressed chunk. ``src`` is never modified.
        """

    @abc.abstractmethod
    def decode(self, src: torch.Tensor, src_offsets: Sequence[int], src_sizes: Sequence[int],
               dst: torch.Tensor, dst_offsets: Sequence[int], dst_sizes: Sequence[int]) -> None:
        """Decompress each compressed chunk into the preallocated ``dst`` slice of exactly
        ``dst_sizes[i]`` bytes; raise :class:`~ckptzip.CodecError` if a chunk does not decode to
        exactly that many bytes."""


_REGISTRY: dict[str, dict[str, type[Codec]]] = {}

#: JSON type of every codec parameter any implementation accepts (wire or local). A parameter
#: must be named here, be one of its class's keys and have this type (bool is not an int), or
#: the config is refused before any codec is constructed.
PARAM_TYPES: dict[str, type] = {"level": int, "data_type": str, "algorithm_type": int,
                                "max_sub_chunk_count": int, "planes": int, "algorithm": int}


def _type_ok(value: Any, want: type) -> bool:
    if want is int:
        return type(value) is int and -(1 << 31) <= value < (1 << 31)
    return type(value) is want and len(value) <= 64


def check_params(wire_id: str, params: dict[str, Any], allowed: set[str]) -> None:
    """Refuse parameters that ``allowed`` does not name or whose JSON type is wrong."""
    unknown = sorted(k for k in params if k not in allowed or k not in PARAM_TYPES)
    if unknown:
        raise UnknownCodecError(f"codec {wire_id!r} has no option(s) {[str(k)[:40] for k in unknown]}")
    for k, v in params.items():
        if not _type_ok(v, PARAM_TYPES[k]):
            raise UnknownCodecError(f"codec {wire_id!r}: option {k!r} must be a "
                                    f"{PARAM_TYPES[k].__name__}, got {type(v).__name__}")


def wire_keys(wire_id: str) -> set[str] | None:
    """The wire config keys some implementation of ``wire_id`` reads from a file, or None for an
    unknown id."""
    _load_optional()
    impls = _REGISTRY.get(wire_id)
    if not impls:
        return None
    return {k for cls in impls.values() for k in cls.config_keys}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` an implementation of its wire id on its device."""
    _REGISTRY.setdefault(cls.wire_id, {})[cls.device] = cls
    return cls


def registered() -> dict[str, list[str]]:
    """``{wire_id: [devices]}`` of every registered implementation."""
    _load_optional()
    return {k: sorted(v) for k, v in sorted(_REGISTRY.items())}


def _load_optional() -> None:
    from . import gpu  # noqa: F401  (registers the nvCOMP implementations; imports nvcomp lazily)


def get_codec(config: dict[str, Any] | str, device: str = "cpu", **local: Any) -> Codec:
    """An implementation of ``config`` (a wire config dict or a bare wire id) for ``device``.

    ``device`` is ``"cpu"`` or ``"cuda"``. A wire format with only a GPU implementation raises
    :class:`GPURequiredError` when asked for on the CPU or when no usable GPU is present.
    """
    _load_optional()
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise UnknownCodecError(f"malformed codec config {config!r}")
    wire_id = config["id"]
    impls = _REGISTRY.get(wire_id)
    if not impls:
        raise UnknownCodecError(f"unknown codec {wire_id!r}; known: {sorted(_REGISTRY)}")
    params = {k: v for k, v in config.items() if k != "id"}
    if device not in ("cpu", "cuda"):
        raise UnknownCodecError(f"no codec implementations for device {device!r}")
    cls = impls.get(device)
    if cls is None:
        if device == "cpu":
            raise GPURequiredError(
                f"codec {wire_id!r} needs a CUDA GPU with nvCOMP to encode or decode (install the "
                f"'cu13' or 'cu12' extra); to read such a file here, make a CPU-readable copy on a "
                f"GPU machine with `ckptzip convert IN OUT --codec zstd`, or save with a CPU codec "
                f"(zstd, deflate, raw) or portable=True")
        cls = impls["cpu"]  # a CPU implementation serves any device (data is staged through host)
    # names and types are checked before the class sees them (a parameter named ``self`` or a
    # level of "x" must not reach a constructor)
    check_params(wire_id, {**params, **local}, set(cls.config_keys) | set(cls.local_keys()))
    if cls.device == "cuda":
        from .gpu import require_gpu
        require_gpu(wire_id)
    return cls(**params, **local)
