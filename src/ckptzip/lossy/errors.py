"""Named errors of the lossy export (all subclasses of ckptzip's CkptzipError)."""
from __future__ import annotations

from ..errors import CkptzipError


class ExportError(CkptzipError):
    """Base class of every error raised by ckptzip.export (ckptzip.lossy)."""


class NoFloatWeightsError(ExportError):
    """The source holds no floating-point weight tensors to export."""


class SchemeError(ExportError, ValueError):
    """An unknown scheme, or a scheme the tensor's dtype or shape cannot take."""


class NonFiniteWeightError(ExportError, ValueError):
    """A weight tensor holds NaN or Inf (refused by default: nonfinite="refuse")."""


class DestinationError(ExportError):
    """DST equals SRC, or DST exists and force=True was not given."""


class LossyCheckpointError(ExportError):
    """A lossy export was given to a path that needs a lossless (resumable) checkpoint."""


class BudgetError(ExportError, ValueError):
    """A bits-per-weight or loss budget that cannot be met or needs an eval_fn."""
