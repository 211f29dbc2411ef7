"""``async_save``: the training step waits only for a consistent snapshot; writing happens in the
background.

On a GPU the snapshot *is* the compression: every group of storages is compressed by nvCOMP and
its compressed chunks are packed into one GPU buffer per group; then the caller's tensors are free
to change. The device-to-host copy (into a pooled, page-locked host arena on a side stream),
checksums, the file write, fsync and the atomic rename (or the object store upload) run in a
background thread while training goes on. The compressed snapshot may hold at most
``gpu_snapshot_bytes`` of GPU memory; groups beyond it are copied to the host during the call.
Without a GPU the snapshot is a copy of the raw bytes into the arena and compression runs in the
background. The arena is reused by the next save and grows only when a checkpoint needs more than
it holds, so its size is bounded by the largest snapshot. One save is in flight at a time: a new
``async_save`` first waits for the previous one.

Pending saves are never dropped at exit. When the script ends, or dies of an uncaught exception,
before ``wait()``, the interpreter waits for every pending save to complete before it shuts down
(a hook that runs before ``concurrent.futures`` stops accepting work, which the writer needs).
If the script exits while a save is still running, one line on stderr says what it is waiting
for. A save that failed and whose error nobody saw (through ``SaveHandle.wait()`` or a later
``async_save``) is reported at exit on stderr with its traceback, and the exit status becomes 1.
Only ``os._exit``, a signal that kills the process, or a crash can still lose a pending save.
Local files are written atomically, so in that case the previous file at the path stays intact.
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours: see below)
import os
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import torch

from .codecs.gpu import release_scratch
from .kernels import HASH_MIN, enabled, launch, triton_kernels
from .pipeline import prepare, write
from .engine import DEFAULT_CHUNK, PINNED, encode_group_arrays, free_gpu_bytes, gather_gpu, pinned_empty


class Arena:
    """Page-locked (when CUDA is present) host memory handed out in slices, reused across saves."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pos = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def reset(self, reserve: int = 0) -> None:
        """Start a new snapshot; make sure ``reserve`` bytes fit without growing mid-snapshot."""
        self._pos = 0
        if reserve > self.capacity:
            self._buf = None  # drop the old buffer before pinning the new one
            self._buf = pinned_empty(reserve)

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            start = (self._pos + 63) // 64 * 64
            if self._buf is None or start + n > self._buf.numel():
                # grow: slices already handed out keep the old buffer alive until the save ends
                need = max(start + n, 2 * self.capacity, 1 << 20)
                self._buf = pinned_empty(need)
                start = 0
            self._pos = start + n
            return self._buf[start:start + n]


ARENA = Arena()
_LAST: "SaveHandle | None" = None
_LAST_LOCK = threading.Lock()

# Handles whose outcome still matters at exit: running, or failed with nobody told yet.
_PENDING: "set[SaveHandle]" = set()
_PENDING_LOCK = threading.Lock()
_EXIT_FAILED = False


class SaveHandle:
    """The future of one background save (from :func:`async_save` or an asynchronous
    :meth:`CheckpointManager.save <ckptzip.CheckpointManager.save>`).

    Attributes: ``path`` (str: where the checkpoint is written), ``stall_s`` (float, seconds: how
    long the call that started the save blocked the caller, i.e. the snapshot time).

    ``wait(timeout=None)`` blocks until the save is complete and returns its summary
    ``{"raw_bytes": int, "stored_bytes": int, "path": str}`` (bytes), or raises the exception the
    background write met (the original exception, e.g. ``OSError`` for a full disk). ``timeout``
    is in seconds (None: no limit); on expiry it raises ``TimeoutError`` and the save goes on.
    ``wait()`` may be called any number of times. ``done()`` polls without blocking.

    A save is never dropped silently: if it fails and ``wait()`` is never called, the error is
    raised by the next :func:`async_save` instead, or reported on stderr at interpreter exit
    (with exit status 1). At exit, a save still running is waited for.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._reported = False  # the error was raised to somebody (wait() or the next async_save)
        self.stall_s = 0.0
        self.path: str | None = None

    def done(self) -> bool:
        """True once the save has completed or failed (never blocks)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the save ends (``timeout`` in seconds, None: no limit); return its
        summary or raise its error. Raises ``TimeoutError`` if ``timeout`` expires first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} still being written")
        if self._error is not None:
            self._mark_reported()
            raise self._error
        return self._result

    def _mark_reported(self) -> None:
        self._reported = True
        with _PENDING_LOCK:
            _PENDING.discard(self)

    def _start(self, fn, name: str) -> None:
        """Run ``fn`` in a new (non-daemon) thread; the exit hook waits for it."""
        with _PENDING_LOCK:
            _PENDING.add(self)
        try:
            threading.Thread(target=self._run, args=(fn,), name=name).start()
        except BaseException:
            with _PENDING_LOCK:
                _PENDING.discard(self)
            raise

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # surfaced on wait(), the next async_save, or at exit
            self._error = e
        finally:
            if self._error is None:
                with _PENDING_LOCK:
                    _PENDING.discard(self)
            self._done.set()


def _finish_pending_saves() -> None:
    """Exit hook: wait for every background save, and report the failures nobody was told of.

    Registered with ``threading._register_atexit``: it runs at interpreter exit (normal end,
    ``sys.exit`` or an uncaught exception, after its traceback is printed) in the main thread,
    before the non-daemon threads are joined and, because such hooks run in reverse order of
    registration and ours is registered after ``concurrent.futures``' own, before thread pools
    refuse new work. (Waiting in a plain ``atexit`` hook, or relying on the join of the
    non-daemon writer thread, is too late: the writer's pools are shut down by then and the
    save dies with "cannot schedule new futures after interpreter shutdown".)"""
    global _EXIT_FAILED
    with _PENDING_LOCK:
        pending = list(_PENDING)
    running = [h for h in pending if not h.done()]
    if running:
        print(f"ckptzip: waiting for {len(running)} checkpoint save(s) to finish before exit: "
              + ", ".join(str(h.path) for h in running), file=sys.stderr, flush=True)
    try:
        for h in pending:
            h._done.wait()
    except KeyboardInterrupt:
        lost = [str(h.path) for h in pending if not h.done()]
        print("\n" + "!" * 78 + "\nckptzip: INTERRUPTED while finishing checkpoint saves at exit; "
              f"NOT saved: {', '.join(lost)}\n" + "!" * 78, file=sys.stderr, flush=True)
        _EXIT_FAILED = True
        return
    with _PENDING_LOCK:
        failed = [h for h in _PENDING if h.done() and h._error is not None and not h._reported]
        _PENDING.clear()
    for h in failed:
        h._reported = True
        tb = "".join(traceback.format_exception(type(h._error), h._error, h._error.__traceback__))
        print("\n" + "!" * 78 + f"\nckptzip: CHECKPOINT NOT SAVED: the background save to {h.path} "
              f"failed and its error was never collected (SaveHandle.wait() was not called):\n{tb}"
              + "!" * 78, file=sys.stderr, flush=True)
    if failed:
        _EXIT_FAILED = True


def _exit_status() -> None:
    """Plain ``atexit`` hook (registered at import, so it runs after the hooks of libraries
    imported later): make the exit status 1 when a checkpoint was lost at exit. Python offers no
    way to change the exit status this late other than ``os._exit``, which skips what is left
    of interpreter shutdown; stdio and logging are flushed first."""
    if not _EXIT_FAILED:
        return
    try:
        import logging
        logging.shutdown()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)


threading._register_atexit(_finish_pending_saves)
atexit.register(_exit_status)


class _OnGPU:
    """A compressed group kept on the GPU during the snapshot; the background writer copies it
    into a pooled pinned buffer (:meth:`fetch`, at most one window) and then lets the GPU memory
    go. So the host memory of an async save on a GPU is a few pooled windows, not the checkpoint."""

    def __init__(self, buf: torch.Tensor, rel, per_unit: list, packed: torch.cuda.Event, hashes=None) -> None:
        self.buf, self.rel, self.per_unit, self._packed = buf, rel, per_unit, packed
        self._hashes = hashes  # (XXH3 of chunks ``idx`` on the GPU, idx) or None: see _gpu_hashes

    def fetch(self) -> tuple:
        """(pinned host buffer leased from ``PINNED``: the writer gives it back, rows, chunks per
        unit, indices of the chunks whose checksums the rows already hold or None)."""
        buf, self.buf = self.buf, None
        host, done = _copy_to_host(buf, self._packed, PINNED.acquire)
        done.synchronize()
        hashed = None
        if self._hashes is not None:
            (h, idx), self._hashes = self._hashes, None
            with torch.cuda.device(h.device), torch.cuda.stream(_copy_stream(h.device)):
                got = h.cpu()  # (on the side stream, which waited for the packed event: the hashes are done)
            self.rel["xxh3"][idx] = got.numpy().view(np.uint64)  # (these rows are this group's alone)
            hashed = idx
        return host, self.rel, self.per_unit, hashed


def _gpu_hashes(buf: torch.Tensor, rel: np.ndarray):
    """The chunk checksums (XXH3-64) of a packed GPU group, queued on the GPU for every chunk the
    kernel takes (over 240 bytes; packed 16-byte aligned), as (int64 tensor, chunk indices);
    None where the kernels are not ready. The background writer then hashes only the rest on
    the host: hashing there is a Python call per chunk in the writer's threads, which took the
    GIL from the training loop the save runs beside (issue 14 item 4)."""
    tk = triton_kernels(start=False)
    if tk is None or not enabled("xxh3"):
        return None
    idx = np.nonzero(rel["stored"] >= HASH_MIN)[0]
    if not len(idx):
        return None
    out: list = []
    try:
        if not launch("xxh3", lambda: out.append(tk.xxh3_chunks(buf, rel["offset"][idx].astype(np.int64),
                                                                rel["stored"][idx].astype(np.int64)))):
            return None
    except torch.cuda.OutOfMemoryError:  # (its tables and output): the host hashes this window
        return None
    return out[0], idx


def _copy_to_host(buf: torch.Tensor, after: torch.cuda.Event, take) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Copy a GPU buffer into ``take(n)`` (pinned host memory) on the device's side stream once
    ``after`` has happened; returns the host buffer and the event that marks the copy done."""
    stream = _copy_stream(buf.device)
    host = take(buf.numel())
    with torch.cuda.device(buf.device), torch.cuda.stream(stream):
        stream.wait_event(after)
        host.copy_(buf, non_blocking=True)
        buf.record_stream(stream)  # keep the allocator from reusing it before the copy ran
        done = torch.cuda.Event()
        done.record(stream)
    return host, done


_STREAMS: dict = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for snapshot copies (created once: streams are not freed)."""
    s = _STREAMS.get(device)
    if s is None:
        s = _STREAMS[device] = torch.cuda.Stream(device)
    return s


def _snapshot(prep, gpu_bytes: int | None, arena: Arena) -> list:
    """Make the prepared save independent of the caller's tensors; returns per group one of:
    an :class:`_OnGPU` (compressed, packed into one GPU buffer: the snapshot is the compressed
    bytes, copied to the host later by the writer), (host, rows, chunks per unit) for a group
    copied to the host now (once the GPU snapshot would exceed ``gpu_bytes``), or None (raw bytes
    copied to the host, encoded later: CPU codecs)."""
    # The arena holds the raw bytes of CPU-encoded groups (reserved now, so it never grows
    # mid-snapshot); GPU groups stay on the GPU (pinning host memory for them here made the first
    # stall seconds long) unless they overflow ``gpu_bytes``, then the arena grows for them.
    bound = sum(u.data.numel() + 16 * len(u.sizes) for grp in prep.groups if grp[0].plan.codec.device != "cuda"
                for u in grp)
    arena.reset(bound + 64 * len(prep.groups) if bound else 0)
    if gpu_bytes is None and torch.cuda.is_available():
        gpu_bytes = free_gpu_bytes() // 4
    staged = []
    held = 0
    inflight: deque = deque()
    for grp in prep.groups:
        if grp[0].plan.codec.device == "cuda":
            while len(inflight) >= 2:
                inflight.popleft().synchronize()
            enc = encode_group_arrays(grp, large_alone=False)  # (few launches: the caller waits for the host)
            buf, rel = gather_gpu(enc)
            per_unit = enc.counts
            del enc
            keep = held + buf.numel() <= (gpu_bytes or 0)
            hashes = _gpu_hashes(buf, rel) if keep else None  # (before the event: fetch waits for it)
            packed = torch.cuda.Event()
            packed.record()
            if keep:
                held += buf.numel()
                staged.append(_OnGPU(buf, rel, per_unit, packed, hashes))
            else:
                # over the GPU snapshot budget: copy to the host now, on the side stream, while
                # the next group compresses
                host, done = _copy_to_host(buf, packed, arena.take)
                inflight.append(done)
                staged.append((host, rel, per_unit))
        else:
            for u in grp:
                # a reference transform (derived copy, delta against a base) reads another
                # storage: take its residual now, while every tensor is as at the call
                d = u.data
                if u.plan.ref is not None and d.numel():
                    d, u.resolved = u.plan.ref.encode(d, start=u.start), True
                u.data = arena.take(d.numel()).copy_(d)
            staged.append(None)
    for ev in inflight:
        ev.synchronize()
    release_scratch()  # nvCOMP's scratch is not held while the snapshot waits to be written
    return staged


class Snapshot:
    """A save of one object, planned and made independent of the object's tensors (see
    :func:`snapshot`). ``raw_bytes`` (int): the raw size of the object's storages; ``stall_s``
    (float, seconds): how long taking it blocked. :meth:`write` writes it once."""

    def __init__(self, prep, staged: list, arena: Arena, stall_s: float) -> None:
        self._prep, self._staged, self.arena, self.stall_s = prep, staged, arena, stall_s
        self.raw_bytes = prep.total
        self._written = False

    def write(self, path, *, fsync: bool = True, progress=None) -> dict:
        """Write the snapshot to ``path`` (local path, fsspec URL or writable binary file object)
        exactly as :func:`ckptzip.save` would have written the object at snapshot time; returns
        the same summary ``{"raw_bytes", "stored_bytes", "path"}``. Blocking; may run in any
        thread. One call per snapshot (the staged buffers are consumed); the arena it used may be
        reused once it returns."""
        if self._written:
            raise RuntimeError("this snapshot was already written")
        self._written = True
        staged, self._staged = self._staged, None
        return write(self._prep, path, fsync, progress, staged)


def snapshot(obj: Any, *, codec: str | dict = "auto", transform: str | None = "auto",
             chunk_size: int = DEFAULT_CHUNK, level: int | None = None, metadata=None,
             allow_pickle: bool = False, device: str | None = None, portable: bool = False,
             storage_gbps: float | None = None, window: int | None = None, reuse_plan: bool = True,
             gpu_snapshot_bytes: int | None = None, arena: Arena | None = None, base=None, target=None,
             derive: bool = True) -> Snapshot:
    """Take a consistent snapshot of ``obj`` for a later :meth:`Snapshot.write` (the building
    block of :func:`async_save`, also used by ``ckptzip.dcp.Writer.stage``). Arguments as for
    :func:`async_save`. On a GPU the snapshot is the compression itself (compressed chunks held
    in GPU memory up to ``gpu_snapshot_bytes``, the rest copied to the host arena now); on the
    CPU it is a copy of the raw bytes into the arena. Once it returns, ``obj``'s tensors may
    change. ``arena`` (default None: the module's shared arena, which :func:`async_save` also
    uses: one snapshot in flight at a time): the host :class:`Arena` the snapshot's bytes live
    in until :meth:`Snapshot.write` returns; pass your own to keep several snapshots apart.
    ``base`` / ``target`` / ``derive``: an incremental save against ``base`` that will be written
    to ``target`` (see :func:`ckptzip.save`)."""
    t0 = time.perf_counter()
    arena = ARENA if arena is None else arena
    prep = prepare(obj, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
                   storage_gbps, window, reuse_plan, base=base, target=target, derive=derive)
    staged = _snapshot(prep, gpu_snapshot_bytes, arena)
    return Snapshot(prep, staged, arena, time.perf_counter() - t0)


def async_save(obj: Any, path, *, codec: str | dict = "auto", transform: str | None = "auto",
               chunk_size: int = DEFAULT_CHUNK, level: int | None = None, metadata=None,
               allow_pickle: bool = False, fsync: bool = True, progress=None, device: str | None = None,
               portable: bool = False, storage_gbps: float | None = None, window: int | None = None,
               reuse_plan: bool = True, gpu_snapshot_bytes: int | None = None, base=None,
               derive: bool = True) -> SaveHandle:
    """Like :func:`ckptzip.save` (same arguments, same defaults), but return a
    :class:`SaveHandle` as soon as a consistent snapshot of ``obj`` is taken; compression (on
    the CPU), the file write, fsync and the atomic rename go on in a background thread. After
    the call returns, ``obj``'s tensors may be modified freely.

    Arguments shared with :func:`ckptzip.save`: ``path`` (local path or fsspec URL),
    ``codec`` (default ``"auto"``), ``transform`` (``"auto"``, ``"byteplane"`` or None; default
    ``"auto"``), ``chunk_size`` (bytes per chunk, 64 B to 16 MiB; default 1 MiB),
    ``level`` (CPU zstd 1-22 / deflate 0-9; default None: the codec's default),
    ``metadata`` (str -> str mapping stored in the manifest; default none), ``allow_pickle``
    (default False), ``fsync`` (default True: fsync the file and its directory before the save
    counts as done), ``progress`` (called as ``progress(bytes_done, total_bytes)`` from the
    background thread, bytes of raw data; default None), ``device`` (``"cpu"``, ``"cuda"`` or None:
    the GPU when nvCOMP is usable), ``portable`` (default False), ``storage_gbps`` (GB/s, the
    write bandwidth you expect; default None), ``window`` (bytes of data encoded per group;
    default None: 64 MiB on the CPU, sized from free memory on the GPU), ``base`` (an earlier
    checkpoint: an incremental save, see :func:`ckptzip.save`; default None), ``derive``
    (default True).

    Async-only arguments: ``reuse_plan`` (default True): reuse the codec choices sampled for an
    earlier save of the same layout (the usual case in a training loop), keeping sampling out of
    the stall. ``gpu_snapshot_bytes`` (bytes; default None: a quarter of the free GPU memory): how
    much GPU memory the compressed snapshot may hold until the background thread has copied it
    to the host; groups beyond it are copied to the host before this call returns (a longer
    stall). Ignored without a GPU.

    One save is in flight at a time: the call first waits for the previous ``async_save``. If
    that one failed and its error was not yet raised by its ``wait()``, this call raises that
    error (the original exception, with a note naming its path) and does *not* start the new
    save; call again to retry. Errors of this save surface on ``handle.wait()``, on the next
    ``async_save``, or at interpreter exit (see the module docstring: pending saves are completed
    at exit, never dropped silently). Host memory: on the CPU a reused staging arena of the raw
    size of ``obj``; on a GPU a few pooled pinned windows (the compressed snapshot waits on the
    GPU), plus arena space for what exceeds ``gpu_snapshot_bytes``."""
    global _LAST
    with _LAST_LOCK:
        prev = _LAST
    if prev is not None:
        prev._done.wait()  # the arena is reused: one save in flight at a time
        if prev._error is not None and not prev._reported:
            prev._mark_reported()
            err = prev._error
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(f"(raised by async_save: the previous background save to {prev.path} "
                             "failed; the new save was not started)")
            raise err
    snap = snapshot(obj, codec=codec, transform=transform, chunk_size=chunk_size, level=level,
                    metadata=metadata, allow_pickle=allow_pickle, device=device, portable=portable,
                    storage_gbps=storage_gbps, window=window, reuse_plan=reuse_plan,
                    gpu_snapshot_bytes=gpu_snapshot_bytes, base=base,
                    target=path if base is not None else None, derive=derive)
    handle = SaveHandle()
    handle.path = str(path)
    handle.stall_s = snap.stall_s
    handle._start(lambda: snap.write(path, fsync=fsync, progress=progress), "ckptzip-async-save")
    with _LAST_LOCK:
        _LAST = handle
    return handle
