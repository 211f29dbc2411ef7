"""Named exceptions. Every failure ckptzip reports derives from :class:`CkptzipError`."""
from __future__ import annotations


class CkptzipError(Exception):
    """Root of every error ckptzip raises on purpose."""


class CorruptFileError(CkptzipError):
    """The file is not a valid .ckz file: bad magic, malformed manifest, sizes or offsets that lie."""


class NotCkptzipFileError(CorruptFileError):
    """The file does not start with ckptzip's magic: another format (a torch.save or safetensors
    file, which ``ckptzip compress`` converts) or no checkpoint at all."""


class TruncatedFileError(CorruptFileError):
    """The file ends before a structure it declares (header, footer, manifest or a chunk)."""


class ChecksumError(CorruptFileError):
    """A chunk's or the manifest's stored checksum does not match its bytes."""


class UnsupportedVersionError(CkptzipError):
    """The file's format version is newer (or other) than this reader understands."""


class UnknownCodecError(CkptzipError):
    """A codec or transform id (or a config of it) that no registered implementation knows."""


class CodecError(CkptzipError):
    """A codec failed to encode or decode a chunk (e.g. a corrupt compressed stream)."""


class GPURequiredError(CkptzipError):
    """The file (or the requested codec) needs a CUDA GPU with nvCOMP, and none is usable here."""


class PickleNotAllowedError(CkptzipError):
    """The file holds pickled objects and ``allow_pickle=True`` was not given."""


class UnsupportedObjectError(CkptzipError, TypeError):
    """``save`` met an object it cannot store without pickle (pass ``allow_pickle=True``)."""


class ResourceLimitError(CorruptFileError):
    """The file declares more decoded bytes than the reader's ``max_bytes`` limit allows (see
    *Resource bounds* in docs/format.md). Pass a larger ``max_bytes`` to ``load``/``open`` if you
    trust the file."""


class NotARegularFileError(CkptzipError):
    """The checkpoint path names a directory, FIFO, socket or device, not a regular file."""


class BaseCheckpointError(CkptzipError):
    """An incremental checkpoint's base (format 1.1 ``bases``) is missing, was altered or replaced
    (its manifest hash or size differs from the record), or the chain of bases is too deep or
    inconsistent. The message names the base as recorded and where it was looked for; pass
    ``base_dir=`` or ``base_path=`` to ``load``/``open`` for a moved base."""


class TensorNotFoundError(CkptzipError, KeyError):
    """The lazy reader was asked for a key that the checkpoint does not hold."""


__all__ = [
    "CkptzipError",
    "CorruptFileError",
    "TruncatedFileError",
    "ChecksumError",
    "UnsupportedVersionError",
    "UnknownCodecError",
    "CodecError",
    "GPURequiredError",
    "PickleNotAllowedError",
    "UnsupportedObjectError",
    "TensorNotFoundError",
    "ResourceLimitError",
    "NotARegularFileError",
    "BaseCheckpointError",
]
