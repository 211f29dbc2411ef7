"""``CheckpointManager``: numbered checkpoints in one directory (local or an fsspec URL), each
visible only once complete, with rotation and crash-safe resume.

Layout: ``step-000001000.ckz`` (the checkpoint) and ``step-000001000.commit`` (the commit marker,
written last: a small JSON with the file's size). The step is written in ASCII decimal,
zero-padded to at least 9 digits. A checkpoint without its marker is incomplete and ignored;
rotation removes the marker first, then the file; ``latest()`` is the newest committed step, so
after a crash a resumed run continues from the last complete checkpoint.

A damaged directory never breaks the manager: every marker is validated strictly (see
:meth:`CheckpointManager.entries`) and one that fails is skipped by ``steps()``, ``latest()``,
``load()`` and rotation, and reported by ``entries()`` / ``problems()``. Several processes may
rotate one directory: files that someone else already removed are not an error. Temporary files
left by a killed local save (``.step-*.ckz.*.tmp`` and ``.step-*.commit.*.tmp``, the naming of
:func:`ckptzip.storage.atomic_write`) are removed by the next save once older than
``stale_temp_s``.
"""
from __future__ import annotations

import json
import os
import re
import time
from typing import Any, NamedTuple

from .api import load, save
from .asyncsave import SaveHandle, async_save
from .storage import atomic_write, is_url, local_path

_MARKER = re.compile(r"step-([0-9]{9,})\.commit", re.ASCII)
_CKZ = re.compile(r"step-([0-9]{9,})\.ckz", re.ASCII)
# atomic_write's temp files (tempfile.mkstemp: 8 of [a-z0-9_]) and its ".old" links
_TEMP = re.compile(r"\.step-[0-9]{9,}\.(?:ckz|commit)\.[a-z0-9_]+\.tmp(?:\.old)?", re.ASCII)
_MARKER_MAX = 64 * 1024  # bytes: a marker is ~70 bytes; a bigger one is damaged, not read whole
STALE_TEMP_S = 3600.0


def _fs(directory: str):
    import fsspec
    if is_url(directory):
        return fsspec.core.url_to_fs(directory)
    return fsspec.filesystem("file"), os.path.abspath(local_path(directory))


def _ckz_name(step: int) -> str:
    return f"step-{step:09d}.ckz"


def _marker_name(step: int) -> str:
    return f"step-{step:09d}.commit"


class CheckpointEntry(NamedTuple):
    """One checkpoint of a managed directory, as :meth:`CheckpointManager.entries` sees it.

    ``step``: the step (None when a file's name cannot be parsed). ``status``: ``"committed"``
    (loadable: listed by ``steps()``), ``"uncommitted"`` (a ``.ckz`` without a marker: a save in
    progress, or one that was interrupted) or ``"damaged"`` (the marker fails validation).
    ``reason``: why, for the last two (None when committed). ``name``: the file the entry is
    about (the marker's name, or the ``.ckz``'s when there is no marker). ``bytes``: the size of
    the ``.ckz`` file in bytes (None when it does not exist).
    """
    step: int | None
    status: str
    reason: str | None
    name: str
    bytes: int | None


class CheckpointManager:
    """Save, list, rotate and load numbered checkpoints in ``directory``.

    ``directory``: a local path or an fsspec URL (``s3://bucket/run``); created if missing when
    ``create=True`` (the default). Checkpoint ``step`` is ``<directory>/step-<step:09d>.ckz``
    (e.g. ``step-000001000.ckz``; wider for steps of 10 digits or more) and is *committed* once
    its marker ``step-<step:09d>.commit`` is written after it (see :meth:`entries`).

    ``keep_last`` (int >= 0 or None; default 3): after each save, keep the ``keep_last`` newest
    committed checkpoints and remove the older ones (None: keep all; 0: keep only those that
    ``keep_every`` protects). ``keep_every`` (int >= 1 or None; default None): additionally keep,
    forever, every checkpoint whose step is a multiple of it. Rotation counts committed
    checkpoints only; damaged and uncommitted entries are neither counted nor removed.

    ``async_save`` (default False): :meth:`save` snapshots the state and returns a
    :class:`SaveHandle` at once; the file and then its marker are written in the background
    (see :func:`ckptzip.async_save`: one save in flight at a time; a pending save completes at
    interpreter exit; its error is raised by ``wait()`` or the next ``save``).

    ``stale_temp_s`` (seconds, or None to never clean; default 3600): temporary files of a local
    save that was killed (``.step-*.ckz.*.tmp``, ``.step-*.commit.*.tmp`` and ``*.tmp.old``)
    whose last modification is older than this are removed before each save (listing and
    loading never delete anything; :meth:`clean_stale_temp` cleans on demand). A save still writing touches its temp file continuously; only a save
    paused for longer than this (e.g. a stopped process) could lose its temp file, and it then
    fails loudly at the rename instead of committing.

    Other keyword arguments (``codec``, ``level``, ``chunk_size``, ...) go to every
    :func:`ckptzip.save` / :func:`ckptzip.async_save`.
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3,
                 keep_every: int | None = None, async_save: bool = False, create: bool = True,
                 stale_temp_s: float | None = STALE_TEMP_S, **save_kwargs: Any) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 0):
            raise ValueError("keep_last must be None or an int >= 0")
        if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int)
                                       or keep_every < 1):
            raise ValueError("keep_every must be None or an int >= 1")
        self.directory = os.fspath(directory)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.use_async = async_save
        self.stale_temp_s = stale_temp_s
        self.save_kwargs = save_kwargs
        self.fs, self.root = _fs(self.directory)
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        self._pending: SaveHandle | None = None

    # -- names ------------------------------------------------------------------------------
    def _join(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives: ``<directory>/step-<step:09d>.ckz`` (a local
        path or a URL). The file need not exist."""
        name = _ckz_name(step)
        return f"{self.directory.rstrip('/')}/{name}" if is_url(self.directory) else self._join(name)

    def _marker(self, step: int) -> str:
        return self._join(_marker_name(step))

    # -- save -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, **kwargs: Any):
        """Save ``state`` as checkpoint ``step`` (an int >= 0; saving an existing step replaces
        it). Keyword arguments override the manager's save options for this call.

        Synchronous (the default): returns the save summary ``{"raw_bytes", "stored_bytes",
        "path"}`` once the file and its marker are written and old checkpoints rotated out.
        With ``async_save=True``: returns a :class:`SaveHandle` as soon as the state is
        snapshotted; its ``wait()`` returns the summary once the checkpoint is committed. Either
        way, first waits for this manager's previous save and raises its error if it failed.
        The checkpoint is committed before rotation runs; files that rotation finds already
        removed (another process rotating the same directory) are skipped."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError("step must be a non-negative int")
        self.wait()
        self.clean_stale_temp()
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
            handle._start(finish, "ckptzip-commit")  # completed at interpreter exit, too
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
        """Wait for this manager's save in flight (if any); its error, if it failed, is raised
        here (once). Returns None; a no-op for synchronous managers."""
        h, self._pending = self._pending, None
        if h is not None:
            h.wait()

    # -- listing and loading ----------------------------------------------------------------
    def _listing(self) -> dict[str, dict]:
        try:
            found = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {os.path.basename(e["name"].rstrip("/")): e for e in found}

    def _check_marker(self, step: int, entry: dict, listing: dict) -> str | None:
        """Why the marker of ``step`` is invalid, or None when the checkpoint is committed."""
        if entry.get("type") != "file":
            return f"marker is not a regular file ({entry.get('type')})"
        if (entry.get("size") or 0) > _MARKER_MAX:
            return f"marker is {entry.get('size')} bytes (at most {_MARKER_MAX})"
        try:
            with self.fs.open(self._marker(step), "rb") as f:
                raw = f.read(_MARKER_MAX + 1)
        except FileNotFoundError:
            return "marker vanished while listing (removed by another process?)"
        except OSError as e:
            return f"marker unreadable: {e}"
        if len(raw) > _MARKER_MAX:
            return f"marker is over {_MARKER_MAX} bytes"
        try:
            info = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            return f"marker is not UTF-8 JSON: {e}"
        if not isinstance(info, dict):
            return f"marker is JSON {type(info).__name__}, not an object"
        s, name, size = info.get("step"), info.get("file"), info.get("bytes")
        if isinstance(s, bool) or not isinstance(s, int) or s != step:
            return f"marker's step {s!r} does not match its name (step {step})"
        if name != _ckz_name(step):
            return f"marker's file {name!r} is not {_ckz_name(step)!r}"
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            return f"marker's bytes {size!r} is not an int >= 0"
        ckz = listing.get(_ckz_name(step))
        if ckz is None:
            return f"checkpoint file {_ckz_name(step)} is missing"
        if ckz.get("type") != "file":
            return f"{_ckz_name(step)} is not a regular file ({ckz.get('type')})"
        if ckz.get("size") != size:
            return f"{_ckz_name(step)} is {ckz.get('size')} bytes, the marker says {size}"
        return None

    def entries(self) -> list[CheckpointEntry]:
        """Every checkpoint-like entry of the directory, ordered by step (unparsable names
        last), each a :class:`CheckpointEntry` ``(step, status, reason, name, bytes)``.

        A checkpoint is ``"committed"`` when its marker's name is ``step-<digits>.commit`` in
        canonical form (ASCII digits only, zero-padded to exactly 9 or unpadded beyond), the
        marker is a regular file of at most 64 KiB holding a UTF-8 JSON object whose ``"step"``
        is an int equal to the name's step, ``"file"`` is ``step-<step:09d>.ckz`` and ``"bytes"``
        an int >= 0, and that ``.ckz`` is a regular file of exactly that many bytes. A marker
        that fails any check is ``"damaged"`` (with the reason), as is a file named like a
        marker or checkpoint in any other way (e.g. non-ASCII digits); a well-named ``.ckz``
        without a marker is ``"uncommitted"``. Never raises for damaged contents (only for
        an unreadable directory)."""
        listing = self._listing()
        out: list[CheckpointEntry] = []
        marked: set[int] = set()
        for name, e in listing.items():
            m = _MARKER.fullmatch(name)
            if m:
                step = int(m.group(1))
                ckz = listing.get(_ckz_name(step))
                size = ckz.get("size") if ckz else None
                if name != _marker_name(step):
                    out.append(CheckpointEntry(step, "damaged", f"non-canonical marker name (expected "
                                               f"{_marker_name(step)})", name, None))
                    continue
                marked.add(step)
                why = self._check_marker(step, e, listing)
                out.append(CheckpointEntry(step, "damaged" if why else "committed", why, name, size))
            elif name.startswith("step-") and name.endswith((".commit", ".ckz")) and not _CKZ.fullmatch(name):
                out.append(CheckpointEntry(None, "damaged", "name is not step-<ASCII digits>"
                                           ".commit/.ckz", name, None))
        for name, e in listing.items():
            m = _CKZ.fullmatch(name)
            if m and name == _ckz_name(int(m.group(1))) and int(m.group(1)) not in marked:
                out.append(CheckpointEntry(int(m.group(1)), "uncommitted", "no commit marker (a save "
                                           "in progress, or one that was interrupted)", name, e.get("size")))
            elif m and name != _ckz_name(int(m.group(1))):
                out.append(CheckpointEntry(int(m.group(1)), "damaged", "non-canonical checkpoint "
                                           f"name (expected {_ckz_name(int(m.group(1)))})", name, None))
        out.sort(key=lambda x: (x.step is None, x.step or 0, x.name))
        return out

    def problems(self) -> list[CheckpointEntry]:
        """The entries that are not committed (damaged or uncommitted), as :meth:`entries`."""
        return [e for e in self.entries() if e.status != "committed"]

    def steps(self) -> list[int]:
        """Committed steps (ints), oldest first. Damaged and uncommitted entries are skipped
        (:meth:`entries` says why)."""
        return [e.step for e in self.entries() if e.status == "committed"]

    def latest(self) -> int | None:
        """The newest committed step, or None when there is none."""
        s = self.steps()
        return s[-1] if s else None

    def load(self, step: int | None = None, **kwargs: Any) -> Any:
        """Load checkpoint ``step`` (default None: the latest committed); keyword arguments go
        to :func:`ckptzip.load` (``map_location``, ``allow_pickle``, ...). Raises
        ``FileNotFoundError`` when there is no committed checkpoint (for that step)."""
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
        elif step not in self.steps():
            raise FileNotFoundError(f"no committed checkpoint for step {step} in {self.directory}")
        return load(self.path(step), **kwargs)

    # -- cleanup and rotation ---------------------------------------------------------------
    def clean_stale_temp(self, max_age_s: float | None = None) -> list[str]:
        """Remove temporary files of killed local saves (``.step-*.ckz.*.tmp``,
        ``.step-*.commit.*.tmp``, ``*.tmp.old``) last modified more than ``max_age_s`` seconds
        ago (default: the manager's ``stale_temp_s``; None there: do nothing). Returns the
        names removed. Object stores have no temp files: a no-op for URLs. Files that vanish
        meanwhile (another process cleaning) are skipped."""
        age = self.stale_temp_s if max_age_s is None else max_age_s
        if age is None or is_url(self.directory):
            return []
        removed = []
        now = time.time()
        try:
            it = list(os.scandir(self.root))
        except OSError:
            return []
        for d in it:
            if not _TEMP.fullmatch(d.name):
                continue
            try:
                st = d.stat(follow_symlinks=False)
                if now - st.st_mtime > age and not d.is_dir(follow_symlinks=False):
                    os.unlink(d.path)
                    removed.append(d.name)
            except FileNotFoundError:
                continue
        return removed

    def _rotate(self) -> None:
        steps = self.steps()
        keep = set(steps if self.keep_last is None else steps[-self.keep_last:] if self.keep_last else [])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                # uncommit first: a half-deleted checkpoint is never listed. Another process
                # rotating the same directory may have removed either file already.
                for p in (self._marker(s), self._join(_ckz_name(s))):
                    try:
                        self.fs.rm(p)
                    except FileNotFoundError:
                        pass
