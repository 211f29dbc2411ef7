"""``CheckpointManager``: numbered checkpoints in one directory (local or an fsspec URL), each
visible only once complete, with rotation and crash-safe resume.

Layout: ``step-000001000.ckz`` (the checkpoint) and ``step-000001000.commit`` (the commit marker,
written last: a small JSON with the file's size). The step is written in ASCII decimal,
zero-padded to at least 9 digits. A checkpoint without its marker is incomplete and ignored;
rotation removes the marker first, then the file; ``latest()`` is the newest committed step, so
after a crash a resumed run continues from the last complete checkpoint.

Distributed mode (``distributed=True``): every rank calls ``save(step, state)``; checkpoint
``step`` is the directory ``step-000001000/`` written through :class:`ckptzip.dcp.Writer` (one
file per rank, JSON metadata, the DCP ``COMMIT`` marker written last by the coordinator), then
the coordinator writes ``step-000001000.commit`` (``{"step", "dir", "metadata_sha256"}``, tying it
to that directory's ``COMMIT``). Such a checkpoint is committed only when both markers agree and
every rank file the metadata names is present with its size. Layout: docs/dcp.md.

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
import shutil
import time
from typing import Any, NamedTuple

from .api import base_chain, load, save
from .api import open as open_checkpoint
from .asyncsave import SaveHandle, async_save
from .storage import atomic_write, is_url, local_path

#: metadata key of an incremental manager's deltas: the number of saves since the full checkpoint
DELTA_INDEX = "ckptzip.delta_index"
_MARKER = re.compile(r"step-([0-9]{9,})\.commit", re.ASCII)
_CKZ = re.compile(r"step-([0-9]{9,})\.ckz", re.ASCII)
_DIR = re.compile(r"step-([0-9]{9,})", re.ASCII)
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


def _dir_name(step: int) -> str:
    return f"step-{step:09d}"


def _dist_rank(process_group=None) -> int | None:
    """This process's rank in ``process_group`` (the default group) or None without one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group)
    return None


class CheckpointEntry(NamedTuple):
    """One checkpoint of a managed directory, as :meth:`CheckpointManager.entries` sees it.

    ``step``: the step (None when a file's name cannot be parsed). ``status``: ``"committed"``
    (loadable: listed by ``steps()``), ``"uncommitted"`` (a ``.ckz`` without a marker: a save in
    progress, or one that was interrupted) or ``"damaged"`` (the marker fails validation).
    ``reason``: why, for the last two (None when committed). ``name``: the file the entry is
    about: the checkpoint's (``step-<step:09d>.ckz``, or its directory for a distributed one)
    when committed or uncommitted, the marker's when the marker is damaged. ``bytes``: the size of
    the ``.ckz`` file in bytes (None when it does not exist; for a distributed checkpoint the
    total of its rank files when committed, else None). ``kind``: ``"file"`` (a ``.ckz``) or
    ``"dcp"`` (a distributed checkpoint directory ``step-<step:09d>/``).
    """
    step: int | None
    status: str
    reason: str | None
    name: str
    bytes: int | None
    kind: str = "file"


def _marker_base(info: dict, step: int) -> int | None:
    """The base step a distributed checkpoint's marker records (an int >= 0 other than ``step``,
    with an int ``delta_index`` >= 1), or None when it records none or an invalid one."""
    b, k = info.get("base"), info.get("delta_index")
    return b if type(b) is int and 0 <= b != step and type(k) is int and k >= 1 else None


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

    ``distributed`` (default False): distributed mode. Every rank of the process group
    (``process_group``, default None: the default group) calls :meth:`save` with its own (e.g.
    FSDP2 / DTensor) state; checkpoint ``step`` is the directory ``step-<step:09d>/`` written by
    ``torch.distributed.checkpoint.save`` through :class:`ckptzip.dcp.Writer` (with
    ``async_save=True``: ``dcp.async_save``, the writer's staging compressing each rank's shards
    before the call returns); the coordinator (rank 0 of the group) then writes the manager's
    marker ``step-<step:09d>.commit`` and alone rotates. Load with ``load(step, state=...)``.
    Not automatic: a manager is in file mode unless ``distributed=True``, even under
    torch.distributed (file mode in a multi-rank job is the usual "rank 0 saves" pattern).

    ``incremental`` (default False; local directories): every save after a full (standalone)
    checkpoint is stored as a delta against that full checkpoint (format 1.1,
    ``ckptzip.save(..., base=)``), and every ``full_every``-th save (int >= 1, default 10; 1:
    every save full) is full again. Deltas refer to the last *full* checkpoint, not to the
    previous delta: loading any checkpoint reads at most two files, and rotating a delta out
    never breaks another (a chain of deltas would shrink each file a little more but make a load
    decode the whole chain). Rotation never removes a checkpoint that a kept one needs as its
    base; :meth:`base_of` names it; ``ckptzip ls`` shows it. In distributed mode each rank's file
    is a delta against the same rank's file of the full checkpoint (:class:`ckptzip.dcp.Writer`
    ``base=``); every rank decides from the saves this manager made (never from the directory,
    which ranks may see at different moments), so the first save of a process is full, and the
    coordinator's marker records the base (``"base"``, ``"delta_index"``).

    Other keyword arguments (``codec``, ``level``, ``chunk_size``, ...) go to every
    :func:`ckptzip.save` / :func:`ckptzip.async_save` (to :class:`ckptzip.dcp.Writer` in
    distributed mode); synchronous saves, too, reuse the choices sampled for the same layout
    (``reuse_plan=True`` unless given).
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int | None = 3,
                 keep_every: int | None = None, async_save: bool = False, create: bool = True,
                 stale_temp_s: float | None = STALE_TEMP_S, distributed: bool = False,
                 process_group: Any = None, incremental: bool = False, full_every: int = 10,
                 **save_kwargs: Any) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 0):
            raise ValueError("keep_last must be None or an int >= 0")
        if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int)
                                       or keep_every < 1):
            raise ValueError("keep_every must be None or an int >= 1")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError("full_every must be an int >= 1")
        self.directory = os.fspath(directory)
        if incremental and is_url(self.directory):
            raise ValueError("incremental checkpoints need a local directory")
        self.incremental, self.full_every = bool(incremental), full_every
        self.keep_last, self.keep_every = keep_last, keep_every
        self.use_async = async_save
        self.stale_temp_s = stale_temp_s
        self.save_kwargs = save_kwargs
        self.fs, self.root = _fs(self.directory)
        if create:
            self.fs.makedirs(self.root, exist_ok=True)
        self._pending: SaveHandle | None = None
        self.distributed = bool(distributed)
        self.process_group = process_group
        self._writer = None  # distributed async mode: one Writer (its staging arena is pooled)
        self._dcp_full: tuple[int, int] | None = None  # distributed incremental: (full step, deltas since)

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

    def dir_path(self, step: int) -> str:
        """Where the distributed checkpoint of ``step`` lives: ``<directory>/step-<step:09d>``."""
        name = _dir_name(step)
        return f"{self.directory.rstrip('/')}/{name}" if is_url(self.directory) else self._join(name)

    def _is_coordinator(self) -> bool:
        r = _dist_rank(self.process_group)
        return r is None or r == 0

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
        if self.distributed:
            return self._save_dcp(step, state, opts, bool(kwargs))
        path = self.path(step)
        if self.incremental and "base" not in opts:
            opts["base"], k = self._base_for(step)
            if opts["base"] is not None:
                opts["metadata"] = {**(opts.get("metadata") or {}), DELTA_INDEX: str(k)}
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
        res = save(state, path, **{"reuse_plan": True, **opts})  # (as async saves do)
        self._commit(step, res)
        return res

    def _save_dcp(self, step: int, state: Any, opts: dict, overridden: bool):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from .dcp import COMMIT_NAME, Writer, commit_marker
        path = self.dir_path(step)
        coord = self._is_coordinator()
        if coord:  # saving a step again: un-commit it first
            try:
                self.fs.rm(self._marker(step))
            except FileNotFoundError:
                pass
        if "base" in opts:
            raise ValueError("CheckpointManager(distributed=True) takes no base=: use incremental=True (the "
                             "manager records each delta's base so that rotation keeps it)")
        extra: dict[str, int] = {}
        if self.incremental:
            full = self._dcp_full
            # a base removed meanwhile: a full save. (Its DCP COMMIT, written before any rank's
            # save of it returned, not the manager marker, which the coordinator may still be
            # writing in an async save: every rank must see the same answer.)
            if (full is not None and full[0] != step and full[1] + 1 < self.full_every
                    and self.fs.exists(f"{self._join(_dir_name(full[0]))}/{COMMIT_NAME}")):
                opts["base"] = self.dir_path(full[0])
                extra = {"base": full[0], "delta_index": full[1] + 1}
        # every rank forgets the base until this save is known to have succeeded (DCP's outcome is
        # the same on every rank): a failed save makes the next one full, on every rank alike
        self._dcp_full = None

        def commit() -> dict:
            if self.incremental:  # the next save's base: this one if full, else the same full one
                self._dcp_full = (extra["base"], extra["delta_index"]) if extra else (step, 0)
            if coord:
                self._write_marker(step, {"step": step, "dir": _dir_name(step),
                                          "metadata_sha256": commit_marker(self.dir_path(step))["metadata_sha256"],
                                          **extra})
                self._rotate()
            return {"path": path}

        if self.use_async:
            if overridden:
                writer = Writer(path, process_group=self.process_group, **opts)
            else:  # one writer for every save: its staging arena is reused
                if self._writer is None:
                    self._writer = Writer(path, process_group=self.process_group, **opts)
                writer = self._writer
                writer.base = opts.get("base")
                writer.reset(path)  # staging happens before DCP applies checkpoint_id
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=self.process_group)
            fut = getattr(fut, "upload_completion", fut)
            handle = SaveHandle()
            handle.path, handle.stall_s = path, time.perf_counter() - t0

            def finish():
                fut.result()
                return commit()
            handle._start(finish, "ckptzip-commit")
            self._pending = handle
            return handle
        dcp.save(state, checkpoint_id=path, storage_writer=Writer(path, process_group=self.process_group, **opts),
                 process_group=self.process_group)
        res = commit()
        if dist.is_available() and dist.is_initialized():
            dist.barrier(self.process_group)  # every rank sees the step committed when save returns
        return res

    def base_of(self, step: int) -> int | None:
        """The step of the checkpoint that checkpoint ``step`` is stored against, or None for a
        full one (or a file that cannot be read). A distributed checkpoint: the base its
        manager marker records."""
        if not self.fs.exists(self.path(step)) and self.fs.isdir(self._join(_dir_name(step))):
            return self._dcp_base(step)
        try:
            with open_checkpoint(self.path(step)) as r:
                rec = r.base
        except Exception:  # noqa: BLE001  (listing never fails on a damaged file)
            return None
        if rec is None:
            return None
        m = _CKZ.fullmatch(os.path.basename(str(rec.get("file", ""))))
        return int(m.group(1)) if m else None

    def _base_for(self, step: int) -> tuple[str | None, int]:
        """(base path, delta index) of an incremental save of ``step``: against the full
        checkpoint the newest committed checkpoint before it is (or refers to), as delta number
        ``k`` since that full one; ``(None, 0)`` (a full save) once ``k`` would reach
        ``full_every``. The index is recorded in each delta's metadata
        (``ckptzip.delta_index``), so rotation removing older deltas does not reset the count."""
        older = [s for s in self.steps() if s < step]
        if not older:
            return None, 0
        s = older[-1]
        with open_checkpoint(self.path(s)) as r:
            if r.base is None:
                k, full = 1, s
            else:
                idx = r.metadata.get(DELTA_INDEX, "")
                m = _CKZ.fullmatch(os.path.basename(str(r.base.get("file", ""))))
                if not idx.isdigit() or not idx.isascii() or m is None:
                    return None, 0  # not written by this manager's incremental mode: start anew
                k, full = int(idx) + 1, int(m.group(1))
        if k >= self.full_every or full not in older:
            return None, 0
        return self.path(full), k

    def _dcp_base(self, step: int) -> int | None:
        """The base step a committed distributed checkpoint's marker records, or None."""
        try:
            with self.fs.open(self._marker(step), "rb") as f:
                info = json.loads(f.read(_MARKER_MAX + 1).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return _marker_base(info, step) if isinstance(info, dict) else None

    def _write_marker(self, step: int, doc: dict) -> None:
        marker = json.dumps(doc).encode()
        if is_url(self.directory):  # an object store PUT is atomic: the marker appears whole
            with self.fs.open(self._marker(step), "wb") as f:
                f.write(marker)
        else:
            with atomic_write(self._marker(step)) as f:
                f.write(marker)

    def _commit(self, step: int, res: dict) -> None:
        self._write_marker(step, {"step": step, "file": os.path.basename(res["path"]),
                                  "bytes": res["stored_bytes"]})
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

    def _check_marker(self, step: int, entry: dict, listing: dict, seen: dict | None = None) -> str | None:
        """Why the marker of ``step`` is invalid, or None when the checkpoint is committed.
        ``seen``: receives a distributed checkpoint's metadata, read while checking it."""
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
        if "dir" in info:
            return self._check_dcp(step, info, listing, seen)
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

    def _check_dcp(self, step: int, info: dict, listing: dict, seen: dict | None = None) -> str | None:
        """Why the distributed checkpoint ``step`` (its manager marker ``info``) is not
        committed, or None; its metadata goes into ``seen`` (by step) when it is."""
        from .dcp import COMMIT_NAME, NO_BYTES_LIMIT, DCPMetadataError, commit_marker, read_metadata
        if info["dir"] != _dir_name(step):
            return f"marker's dir {info['dir']!r} is not {_dir_name(step)!r}"
        if not {"step", "dir", "metadata_sha256"} <= set(info) <= {"step", "dir", "metadata_sha256", "base",
                                                                    "delta_index"} \
                or type(info["metadata_sha256"]) is not str or ("base" in info) != ("delta_index" in info):
            return ("marker of a distributed checkpoint must hold step, dir and metadata_sha256 (str), and "
                    "base with delta_index or neither")
        if "base" in info and _marker_base(info, step) is None:
            return "marker's base must be another step (int >= 0) and its delta_index an int >= 1"
        d = listing.get(_dir_name(step))
        if d is None:
            return f"checkpoint directory {_dir_name(step)}/ is missing"
        if d.get("type") != "directory":
            return f"{_dir_name(step)} is not a directory ({d.get('type')})"
        here = self.dir_path(step)

        def rel(e: BaseException) -> str:  # reasons name the step directory, not an absolute path
            return str(e).replace(here, _dir_name(step))

        try:
            sha = commit_marker(here)["metadata_sha256"]
        except DCPMetadataError as e:  # missing or malformed
            return f"{_dir_name(step)}/{COMMIT_NAME}: {rel(e)}"
        except OSError as e:
            return f"{_dir_name(step)}/{COMMIT_NAME} unreadable: {rel(e)}"
        if sha != info["metadata_sha256"]:
            return f"{_dir_name(step)}/{COMMIT_NAME} belongs to another save than the marker"
        try:
            md = read_metadata(here, check_files=True, max_bytes=NO_BYTES_LIMIT)  # (a listing allocates nothing)
        except DCPMetadataError as e:
            return rel(e)
        except OSError as e:
            return f"unreadable: {rel(e)}"
        if seen is not None:
            seen[step] = md
        return None

    def _dcp_bytes(self, step: int, md: Any = None) -> int | None:
        """The stored bytes of a distributed checkpoint's files, from its metadata (``md``, read
        here where not given)."""
        if md is None:
            from .dcp import NO_BYTES_LIMIT, read_metadata
            try:
                md = read_metadata(self.dir_path(step), check_files=False, max_bytes=NO_BYTES_LIMIT)
            except Exception:
                return None
        return sum({s.file: s.file_bytes for s in md.storage_data.values()}.values())

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
        seen: dict = {}  # distributed checkpoints' metadata, read once per step
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
                why = self._check_marker(step, e, listing, seen)
                if _dir_name(step) in listing and _ckz_name(step) not in listing:
                    size = None if why else self._dcp_bytes(step, seen.get(step))
                    out.append(CheckpointEntry(step, "damaged" if why else "committed", why,
                                               name if why else _dir_name(step), size, "dcp"))
                    continue
                out.append(CheckpointEntry(step, "damaged" if why else "committed", why,
                                           name if why else _ckz_name(step), size))
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
            m = _DIR.fullmatch(name)
            if m and e.get("type") == "directory" and name == _dir_name(int(m.group(1))) and \
                    int(m.group(1)) not in marked:
                out.append(CheckpointEntry(int(m.group(1)), "uncommitted", "distributed checkpoint without the "
                                           "manager's commit marker (a save in progress, or one that was "
                                           "interrupted)", name, None, "dcp"))
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

    def load(self, step: int | None = None, *, state: Any = None, **kwargs: Any) -> Any:
        """Load checkpoint ``step`` (default None: the latest committed). Raises
        ``FileNotFoundError`` when there is no committed checkpoint (for that step).

        A file checkpoint: keyword arguments go to :func:`ckptzip.load` (``map_location``,
        ``allow_pickle``, ...); returns the object (``state`` must be None).

        A distributed checkpoint (directory): with ``state`` (a state dict, e.g. from
        ``get_state_dict``, possibly sharded differently than at save time), every rank calls
        ``load(step, state=state)``: ``torch.distributed.checkpoint.load`` fills ``state`` in
        place through :class:`ckptzip.dcp.Reader` and ``state`` is returned. Keyword arguments:
        ``planner`` (a DCP ``LoadPlanner``), ``allow_pickle`` and ``cache_bytes`` (to the
        Reader). Without ``state``: the whole unsharded state is read in this process (no process
        group needed, as :func:`ckptzip.dcp.consolidate`) and returned as a nested dict."""
        entries = {e.step: e for e in self.entries() if e.status == "committed"}
        if step is None:
            if not entries:
                raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
            step = max(entries)
        elif step not in entries:
            raise FileNotFoundError(f"no committed checkpoint for step {step} in {self.directory}")
        if entries[step].kind == "dcp":
            return self._load_dcp(step, state, **kwargs)
        if state is not None:
            raise TypeError(f"step {step} is a single-file checkpoint: load it without state=")
        return load(self.path(step), allow_lossy=False, **kwargs)  # never resume from a lossy export

    def _load_dcp(self, step: int, state: Any, planner: Any = None, **reader_kwargs: Any) -> Any:
        from .dcp import Reader, read_full
        path = self.dir_path(step)
        if state is None:
            return read_full(path, **reader_kwargs)
        reader = Reader(path, **reader_kwargs)
        import torch.distributed.checkpoint as dcp
        dcp.load(state, checkpoint_id=path, storage_reader=reader, planner=planner,
                 process_group=self.process_group)
        return state

    # -- cleanup and rotation ---------------------------------------------------------------
    def clean_stale_temp(self, max_age_s: float | None = None) -> list[str]:
        """Remove temporary files of killed local saves (``.step-*.ckz.*.tmp``,
        ``.step-*.commit.*.tmp``, ``*.tmp.old``) last modified more than ``max_age_s`` seconds
        ago (default: the manager's ``stale_temp_s``; None there: do nothing). Distributed mode
        (coordinator only): also the directories of killed distributed saves, i.e. uncommitted
        ``step-N/`` directories older than a committed step whose newest file is that old (a
        directory being written is never newer than a committed step). Returns the names
        removed. Object stores have no temp files: a no-op for URLs. Files that vanish meanwhile
        (another process cleaning) are skipped."""
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
        if self.distributed and self._is_coordinator():
            removed += self._clean_killed_dirs(age, now)
        return removed

    def _clean_killed_dirs(self, age: float, now: float) -> list[str]:
        entries = self.entries()
        committed = [e.step for e in entries if e.status == "committed"]
        if not committed:
            return []
        removed = []
        for e in entries:
            if e.kind != "dcp" or e.status != "uncommitted" or e.step >= max(committed):
                continue
            d = os.path.join(self.root, e.name)
            try:
                newest = max([os.lstat(d).st_mtime] + [f.stat(follow_symlinks=False).st_mtime
                                                        for f in os.scandir(d)])
                if now - newest > age:
                    shutil.rmtree(d)
                    removed.append(e.name)
            except FileNotFoundError:
                continue
        return removed

    def _rotate(self) -> None:
        if self.distributed and not self._is_coordinator():
            return
        steps = self.steps()
        keep = set(steps if self.keep_last is None else steps[-self.keep_last:] if self.keep_last else [])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        if self.distributed:  # never remove a base that a kept checkpoint or the next save needs
            keep |= {b for b in (self._dcp_base(s) for s in list(keep)) if b is not None}
            if self._dcp_full is not None:
                keep.add(self._dcp_full[0])
        else:
            for s in list(keep):
                try:
                    chain = base_chain(self.path(s))
                except Exception:  # noqa: BLE001  (a damaged chain: that checkpoint is lost anyway)
                    chain = []
                for b in chain:
                    m = _CKZ.fullmatch(os.path.basename(b))
                    if m:
                        keep.add(int(m.group(1)))
        for s in steps:
            if s not in keep:
                # uncommit first: a half-deleted checkpoint is never listed. Another process
                # rotating the same directory may have removed either file already.
                d = self._join(_dir_name(s))
                for p in (self._marker(s), self._join(_ckz_name(s))):
                    try:
                        self.fs.rm(p)
                    except FileNotFoundError:
                        pass
                if self.fs.isdir(d):  # distributed: its DCP marker next, then the rest
                    from .dcp import COMMIT_NAME
                    for p in (f"{d}/{COMMIT_NAME}", d):
                        try:
                            self.fs.rm(p, recursive=p == d)
                        except FileNotFoundError:
                            pass
