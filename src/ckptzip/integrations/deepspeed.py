"""DeepSpeed integration: a ``CheckpointEngine`` that writes every file of
``engine.save_checkpoint`` (model states, ZeRO optimizer states) with ckptzip and reads them back in
``engine.load_checkpoint``.

DeepSpeed (checked against 0.19.8) has no registry for custom checkpoint engines: it builds one in
``DeepSpeedEngine._configure_checkpointing`` from the config (torch, fast/decoupled writer,
datastates) and every save and load goes through the ``engine.checkpoint_engine`` attribute. So
:func:`enable` replaces that attribute after ``deepspeed.initialize``::

    engine, optimizer, _, _ = deepspeed.initialize(...)
    ckptzip.integrations.deepspeed.enable(engine)          # or enable(engine, async_save=True)
    engine.save_checkpoint(save_dir)                         # files keep DeepSpeed's names (*.pt)
    engine.load_checkpoint(save_dir)                         # content is .ckz

No pickle by default. DeepSpeed's ZeRO optimizer file holds a few DeepSpeed objects
(``LossScaler`` / ``DynamicLossScaler``, ``ZeroStageEnum``, ``fragment_address``); they are stored
as plain data and rebuilt on load from an allow-list of classes (:data:`SAFE_CLASSES`, extendable
with ``safe_classes=``), never by unpickling. Any other object (say an ``argparse.Namespace`` in
``client_state``) is refused with the key paths that hold it, unless the engine is created with
``allow_pickle=True`` (then it is pickled on save and unpickled on load).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import importlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
except ImportError as e:  # pragma: no cover - exercised only without deepspeed
    raise ImportError("ckptzip.integrations.deepspeed needs DeepSpeed "
                      "(DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)") from e

from .. import async_save, load, save
from ..errors import UnsupportedObjectError

ENGINE_NAME = "CkptzipCheckpointEngine"

#: DeepSpeed classes rebuilt on load without pickle: ``"module:QualName"``. Instances are
#: stored as their ``__dict__`` (plain objects), their fields (dataclasses) or their value (enums).
SAFE_CLASSES = frozenset({
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.utils.tensor_fragment:fragment_address",
})

#: the key of the dict that stands for an allow-listed object in the stored tree
MARK = "__ckptzip_deepspeed_object__"

_PLAIN = (type(None), bool, str, bytes, bytearray, torch.Size, torch.dtype, torch.device)


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    mod, _, qual = name.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise UnsupportedObjectError(f"{name} is not a class")
    return obj


class _Packer:
    """Object tree -> tree ckptzip stores without pickle (allow-listed objects become marked dicts);
    collects the key paths of objects that would need pickle."""

    def __init__(self, safe: frozenset[str], allow_pickle: bool) -> None:
        self.safe, self.allow_pickle, self.bad = safe, allow_pickle, []

    def pack(self, obj: Any, path: str) -> Any:
        t = type(obj)
        if isinstance(obj, torch.Tensor) or t in _PLAIN or t is int or t is float:
            return obj
        if isinstance(obj, (np.ndarray, np.generic)):
            return obj
        if t in (dict, collections.OrderedDict):
            return t((k, self.pack(v, f"{path}.{k}" if path else str(k))) for k, v in obj.items())
        if t is list or t is tuple:
            return t(self.pack(v, f"{path}[{i}]") for i, v in enumerate(obj))
        name = _name(t)
        if name in self.safe:
            if isinstance(obj, enum.Enum):
                state: Any = {"value": self.pack(obj.value, f"{path}.value")}
            elif dataclasses.is_dataclass(obj):
                state = {f.name: self.pack(getattr(obj, f.name), f"{path}.{f.name}")
                         for f in dataclasses.fields(obj)}
            else:
                state = {k: self.pack(v, f"{path}.{k}") for k, v in vars(obj).items()}
            return {MARK: name, "state": state}
        if not self.allow_pickle:
            self.bad.append(f"{path or '<root>'} ({t.__module__}.{t.__qualname__})")
        return obj


def _unpack(obj: Any, safe: frozenset[str]) -> Any:
    t = type(obj)
    if t in (dict, collections.OrderedDict):
        if MARK in obj and len(obj) == 2 and "state" in obj:
            name = obj[MARK]
            if name not in safe:
                raise UnsupportedObjectError(
                    f"checkpoint holds an object of class {name!r}, which is not in the allow-list "
                    f"(add it with safe_classes=... if you trust it)")
            cls = _resolve(name)
            state = _unpack(obj["state"], safe)
            if issubclass(cls, enum.Enum):
                return cls(state["value"])
            if dataclasses.is_dataclass(cls):
                return cls(**state)
            inst = cls.__new__(cls)
            inst.__dict__.update(state)
            return inst
        return t((k, _unpack(v, safe)) for k, v in obj.items())
    if t is list or t is tuple:
        return t(_unpack(v, safe) for v in obj)
    return obj


def _map(map_location: Any) -> Any:
    # DeepSpeed passes torch.load-style callables (``lambda storage, loc: storage``): keep devices
    if callable(map_location) and not isinstance(map_location, Mapping):
        return None
    return map_location


class CkptzipCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` backed by :func:`ckptzip.save` / :func:`ckptzip.load`.

    ``allow_pickle``: store objects outside ckptzip's types and the allow-list with pickle (and
    unpickle them on load). ``safe_classes``: more ``"module:QualName"`` classes to store as plain
    data (see :data:`SAFE_CLASSES`). ``async_save``: ``save`` returns once ckptzip has taken its
    snapshot and writes in the background; ``commit`` (called by DeepSpeed before it writes the
    ``latest`` file) waits for every pending write, so ``latest`` never names an unfinished
    checkpoint. Other keyword arguments go to ckptzip's save (``codec``, ``portable``, ``level``...).
    """

    def __init__(self, config_params: Any = None, *, allow_pickle: bool = False,
                 safe_classes: tuple[str, ...] | frozenset[str] = (), async_save: bool = False,
                 **save_kwargs: Any) -> None:
        super().__init__(config_params)
        self.name = ENGINE_NAME
        self.allow_pickle = allow_pickle
        self.safe_classes = frozenset(SAFE_CLASSES) | frozenset(safe_classes)
        self.async_save = async_save
        self.save_kwargs = save_kwargs
        self._pending: list[Any] = []

    # -- the CheckpointEngine interface -------------------------------------------------------
    def create(self, info: Any) -> None:
        """Start of ``save_checkpoint(tag)``: nothing to prepare (earlier async writes keep going)."""

    def save(self, state_dict: Any, path: str) -> None:
        obj = self._packed(state_dict, os.fspath(path))
        if self.async_save:
            self._pending.append(async_save(obj, path, allow_pickle=self.allow_pickle, **self.save_kwargs))
        else:
            save(obj, path, allow_pickle=self.allow_pickle, **self.save_kwargs)

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()  # a file may be read back in the same run it was written
        obj = load(path, map_location=_map(map_location), allow_pickle=self.allow_pickle,
                   allow_lossy=False)  # a lossy weights-only export cannot resume training
        return _unpack(obj, self.safe_classes)

    def commit(self, info: Any) -> bool:
        """All files of the tag are written (waits for async writes; raises if one failed)."""
        self.wait()
        return True

    def preserves_storage_sharing(self) -> bool:
        # like torch.save, ckptzip stores each storage once and views as views: DeepSpeed then
        # clones views of big flat buffers before save so only the needed bytes are written
        return True

    def cleanup(self) -> None:
        self.wait()

    # -- ckptzip additions --------------------------------------------------------------------
    def _packed(self, obj: Any, what: str) -> Any:
        """``obj`` as ckptzip stores it (allow-listed objects as marked dicts), or
        UnsupportedObjectError naming the key paths of the objects that would need pickle."""
        packer = _Packer(self.safe_classes, self.allow_pickle)
        out = packer.pack(obj, "")
        if packer.bad:
            raise UnsupportedObjectError(
                f"cannot save {what} with ckptzip without pickle: "
                + ", ".join(packer.bad[:20]) + (" ..." if len(packer.bad) > 20 else "")
                + "; convert these values, or create the engine with allow_pickle=True "
                  "(enable(engine, allow_pickle=True)), or add their class to safe_classes")
        return out

    def wait(self) -> None:
        """Block until every async write has finished; re-raise the first failure."""
        pending, self._pending = self._pending, []
        err = None
        for h in pending:
            try:
                h.wait()
            except BaseException as e:  # noqa: BLE001 - finish the others, then raise
                err = err or e
        if err is not None:
            raise err


def enable(engine: Any, **opts: Any) -> CkptzipCheckpointEngine:
    """Make a ``DeepSpeedEngine`` (after ``deepspeed.initialize``) save and load with ckptzip.

    Replaces ``engine.checkpoint_engine`` (DeepSpeed reads it on every save and load; the ZeRO
    optimizers hold no reference of their own in 0.19.8). The writer decisions DeepSpeed took with
    its own engine (which ranks write the model file) are kept: the ckptzip engine, like DeepSpeed's
    torch engine, lets data-parallel rank 0 write it. ``opts`` go to :class:`CkptzipCheckpointEngine`.
    Returns the new checkpoint engine."""
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and old.is_decoupled():
        old.cleanup()
    ce = CkptzipCheckpointEngine(getattr(engine, "_config", None), **opts)
    engine.checkpoint_engine = ce
    _check_client_state_first(engine, ce)
    return ce


def _check_client_state_first(engine: Any, ce: CkptzipCheckpointEngine) -> None:
    """Make ``engine.save_checkpoint`` check ``client_state`` on every rank before DeepSpeed
    starts. Only data-parallel rank 0 writes it (in the model file), so a value that needs pickle
    was refused there alone: the other ranks wrote their optimizer files and waited at DeepSpeed's
    next barrier for a rank that had raised. Every rank passes ``client_state``, so every rank
    now raises the same error before anything is written."""
    save_checkpoint = getattr(engine, "save_checkpoint", None)
    if save_checkpoint is None:  # (not a DeepSpeedEngine: nothing to check)
        return
    if getattr(save_checkpoint, "_ckptzip_checked", None) is save_checkpoint:  # (enable called again:
        save_checkpoint = save_checkpoint.__wrapped__  # our own wrapper, not another's that copied it)

    @functools.wraps(save_checkpoint)
    def checked(save_dir: Any, tag: Any = None, client_state: Any = None, *args: Any, **kwargs: Any) -> Any:
        if client_state and not ce.allow_pickle:
            ce._packed(client_state, "client_state")
        return save_checkpoint(save_dir, tag, {} if client_state is None else client_state, *args, **kwargs)
    checked._ckptzip_checked = checked  # type: ignore[attr-defined]
    engine.save_checkpoint = checked


__all__ = ["CkptzipCheckpointEngine", "enable", "SAFE_CLASSES", "MARK", "ENGINE_NAME"]
