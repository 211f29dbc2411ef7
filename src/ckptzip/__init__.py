"""ckptzip: lossless, GPU-accelerated compression of PyTorch checkpoints."""
__version__ = "0.1.0"

from .errors import (BaseCheckpointError, ChecksumError, CkptzipError, CodecError, CorruptFileError,  # noqa: E402
                     GPURequiredError, NotARegularFileError, NotCkptzipFileError, PickleNotAllowedError,
                     ResourceLimitError, TensorNotFoundError,
                     TruncatedFileError, UnknownCodecError, UnsupportedObjectError,
                     UnsupportedVersionError)
from .api import CheckpointReader, base_chain, load, open, save  # noqa: E402,A004
from .asyncsave import SaveHandle, async_save  # noqa: E402
from .manager import CheckpointManager  # noqa: E402
from .lossy import export  # noqa: E402  (ckptzip.lossy holds the rest: load_lossy, is_lossy, ...)

__all__ = [
    "save", "load", "open", "CheckpointReader", "base_chain", "BaseCheckpointError", "async_save", "SaveHandle",
    "CheckpointManager", "export",
    "CkptzipError", "CorruptFileError", "TruncatedFileError", "ChecksumError",
    "UnsupportedVersionError", "UnknownCodecError", "CodecError", "GPURequiredError",
    "PickleNotAllowedError", "UnsupportedObjectError", "TensorNotFoundError", "ResourceLimitError",
    "NotARegularFileError", "NotCkptzipFileError",
]
