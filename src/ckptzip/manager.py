"""``CheckpointManager``: numbered checkpoints in one directory (local or an fsspec URL), each
visible only once complete, with rotation and crash-safe resume.

Layout: ``step-000001000.ckz`` (the checkpoint) and ``step-000001000.commit`` (the commit marker,
written last: a small JSON with the file's size). A checkpoint without its marker is incomplete and
ignored; rotation removes the marker first, then the file; ``latest()`` is the newest committed
step, so after a crash a resumed run continues from the last complete checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

from .api import load, save
from .asyncsave import SaveHandle, async_save
from .storage import atomic_write, is_url, local_path

_NAME = re.compile(r"^step-(\d{9,})\.commit$")


def _fs(directory: str):
    import fsspec
    if is_url(directory):
        return fsspec.core.url_to_fs(directory)
    return fsspec.filesystem("file"), os.path.abspath(local_path(directory))


class CheckpointManager:
    """Save, list, rotate and load numbered checkpoints.

    ``keep_last``: how many of the newest committed checkpoints to keep (None: all).
    ``keep_every``: also keep every checkpoint whose step is a multiple of this.
    ``async_save``: save in the background (``save`` returns a :class:`SaveHandle`).
    Other keyword arguments go to :func:`ckptzip.save`.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3,
                 keep_every: int | None = None, async_save: bool = False, create: bool = True,
                 **save_kwargs: Any) -> None:
        self.directory = os.fspath(directory)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.use_async = async_save
        self.save_kwargs = save_kwargs
        self.fs, self.root = _fs(self.directory)
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        self._pending: SaveHandle | None = None

    # -- names ------------------------------------------------------------------------------
    def _join(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives (a local path or a URL)."""
        name = f"step-{step:09d}.ckz"
        return f"{self.directory.rstrip('/')}/{name}" if is_url(self.directory) else self._join(name)

    def _marker(self, step: int) -> str:
        return self._join(f"step-{step:09d}.commit")

    # -- save -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, **kwargs: Any):
        """Save ``state`` as checkpoint ``step``; returns the save summary, or a handle whose
        ``wait()`` returns it when ``async_save=True``. The commit marker is written after the
        file is complete, then old checkpoints are rotated out."""
        if not isinstance(step, int) or step < 0:
            raise ValueError("step must be a non-negative int")
        self.wait()
        opts = {**self.save_kwargs, **kwargs}
        path = self.path(step)
        if self.use_async:
            inner = async_save(state, path, **opts)
            handle = SaveHandle()
            handle.path, handle.stall_s = path, inner.stall_s

            def finish():
                res = inner.wait()
                self._commit(step, res)
                return res
            threading.Thread(target=handle._run, args=(finish,), name="ckptzip-commit").start()
            self._pending = handle
            return handle
        res = save(state, path, **opts)
        self._commit(step, res)
        return res

    def _commit(self, step: int, res: dict) -> None:
        marker = json.dumps({"step": step, "file": os.path.basename(res["path"]),
                             "bytes": res["stored_bytes"]}).encode()
        if is_url(self.directory):  # an object store PUT is atomic: the marker appears whole
            with self.fs.open(self._marker(step), "wb") as f:
                f.write(marker)
        else:
            with atomic_write(self._marker(step)) as f:
                f.write(marker)
        self._rotate()

    def wait(self) -> None:
        """Wait for the save in flight (if any); its error, if it failed, is raised here."""
        h, self._pending = self._pending, None
        if h is not None:
            h.wait()

    # -- listing and loading ----------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first (a marker whose file is missing or short is ignored)."""
        out = []
        try:
            names = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        sizes = {os.path.basename(e["name"].rstrip("/")): e.get("size") for e in names}
        for name in sizes:
            m = _NAME.match(name)
            if not m:
                continue
            step = int(m.group(1))
            try:
                with self.fs.open(self._marker(step), "r") as f:
                    info = json.loads(f.read())
            except (OSError, ValueError):
                continue
            if sizes.get(f"step-{step:09d}.ckz") == info.get("bytes"):
                out.append(step)
        return sorted(out)

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def load(self, step: int | None = None, **kwargs: Any) -> Any:
        """Load checkpoint ``step`` (default: the latest committed); keyword arguments go to
        :func:`ckptzip.load` (``map_location``, ``allow_pickle``)."""
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        elif step not in self.steps():
            raise FileNotFoundError(f"no committed checkpoint for step {step} in {self.directory}")
        return load(self.path(step), **kwargs)

    # -- rotation ---------------------------------------------------------------------------
    def _rotate(self) -> None:
        steps = self.steps()
        keep = set(steps if self.keep_last is None else steps[-self.keep_last:] if self.keep_last else [])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                self.fs.rm(self._marker(s))  # uncommit first: a half-deleted checkpoint is never listed
                try:
                    self.fs.rm(self._join(f"step-{s:09d}.ckz"))
                except FileNotFoundError:
                    pass
