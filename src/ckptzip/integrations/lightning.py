"""PyTorch Lightning integration: ``Trainer(plugins=[CkptzipCheckpointIO()])`` writes every
checkpoint (``ModelCheckpoint``, ``trainer.save_checkpoint``) with ckptzip and resumes from it.
``AsyncCkptzipCheckpointIO`` returns to training once the snapshot is taken."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

try:
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # the older package name
    from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[no-redef]

from ..api import load, save
from ..asyncsave import SaveHandle, async_save
from ..storage import is_url, local_path


def _plain(obj: Any) -> Any:
    """Lightning checkpoints hold dict subclasses (AttributeDict for hyper-parameters): store them
    as plain dicts, which is how Lightning reads them back."""
    if isinstance(obj, Mapping) and type(obj) not in (dict,) and not hasattr(obj, "move_to_end"):
        return {k: _plain(v) for k, v in obj.items()}
    if type(obj) is dict:
        return {k: _plain(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_plain(v) for v in obj]
    return obj


def _map(map_location: Any) -> Any:
    # Lightning passes torch.load-style callables (storage, location) -> storage: keep devices
    if callable(map_location) and not isinstance(map_location, Mapping):
        return None
    return map_location


def _makedirs(path) -> None:
    p = os.fspath(path)
    if is_url(p):
        import fsspec
        fs, q = fsspec.core.url_to_fs(p)
        fs.makedirs(os.path.dirname(q), exist_ok=True)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(local_path(p))), exist_ok=True)


def _remove(path) -> None:
    p = os.fspath(path)
    if is_url(p):
        import fsspec
        fs, q = fsspec.core.url_to_fs(p)
        if fs.exists(q):
            fs.rm(q)
    elif os.path.exists(local_path(p)):
        os.remove(local_path(p))


class CkptzipCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves and loads with ckptzip (local paths or fsspec URLs).

    ``allow_pickle``: hyper-parameters or callback states that are arbitrary objects need it, on
    save and on load (off by default: loading then never runs pickle). Other keyword arguments go
    to :func:`ckptzip.save` (``codec``, ``portable``, ...)."""

    def __init__(self, allow_pickle: bool = False, **save_kwargs: Any) -> None:
        self.allow_pickle = allow_pickle
        self.save_kwargs = save_kwargs

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        _makedirs(path)
        save(_plain(checkpoint), path, allow_pickle=self.allow_pickle, **self.save_kwargs)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        return load(path, map_location=_map(map_location), allow_pickle=self.allow_pickle,
                    allow_lossy=False)  # a lossy weights-only export cannot resume training

    def remove_checkpoint(self, path) -> None:
        _remove(path)


class AsyncCkptzipCheckpointIO(CkptzipCheckpointIO):
    """Like :class:`CkptzipCheckpointIO`, but ``save_checkpoint`` returns once ckptzip has taken
    its snapshot (on a GPU: the compressed bytes); the write finishes in the background. Errors of
    a background write are raised on the next checkpoint operation or at ``teardown``."""

    def __init__(self, allow_pickle: bool = False, **save_kwargs: Any) -> None:
        super().__init__(allow_pickle, **save_kwargs)
        self._pending: SaveHandle | None = None

    def _wait(self) -> None:
        h, self._pending = self._pending, None
        if h is not None:
            h.wait()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self._wait()
        _makedirs(path)
        self._pending = async_save(_plain(checkpoint), path, allow_pickle=self.allow_pickle, **self.save_kwargs)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        self._wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path) -> None:
        self._wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        self._wait()
