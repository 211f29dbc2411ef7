"""``async_save``: the training step waits only for a consistent snapshot; writing happens in the
background.

On a GPU the snapshot *is* the compression: every group of storages is compressed by nvCOMP and
its compressed bytes are copied once into a pooled, page-locked host arena; then the caller's
tensors are free to change. Checksums, the file write, fsync and the atomic rename (or the object
store upload) run in a background thread. Without a GPU the snapshot is a copy of the raw bytes into
the arena and compression runs in the background. The arena is reused by the next save and grows
only when a checkpoint needs more than it holds, so its size is bounded by the largest snapshot.
One save is in flight at a time: a new ``async_save`` first waits for the previous one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from .api import _prepare, _write
from .engine import DEFAULT_CHUNK, encode_group, stage_pieces


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
            self._buf = torch.empty(reserve, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            start = (self._pos + 63) // 64 * 64
            if self._buf is None or start + n > self._buf.numel():
                # grow: slices already handed out keep the old buffer alive until the save ends
                need = max(start + n, 2 * self.capacity, 1 << 20)
                self._buf = torch.empty(need, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                start = 0
            self._pos = start + n
            return self._buf[start:start + n]


ARENA = Arena()
_LAST: "SaveHandle | None" = None
_LAST_LOCK = threading.Lock()


class SaveHandle:
    """The future of one ``async_save``. ``wait()`` returns the save summary or raises the error
    the background write met; ``done()`` polls; ``stall_s`` is how long the caller was blocked."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None
        self.stall_s = 0.0
        self.path: str | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> dict:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint {self.path} still being written")
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # surfaced on wait()
            self._error = e
        finally:
            self._done.set()


def _snapshot(prep) -> list:
    """Make the prepared save independent of the caller's tensors; returns per group either
    (host, rows, chunks per unit) for GPU-compressed groups or None (raw bytes copied, encoded
    later). GPU groups are copied to the host on a side stream while the next group compresses;
    at most two groups' compressed buffers are in flight."""
    # upper bound: stored bytes never exceed raw bytes; plus alignment padding per chunk and group
    bound = sum(u.data.numel() + 16 * len(u.sizes) for grp in prep.groups for u in grp) + 64 * len(prep.groups)
    ARENA.reset(bound)
    staged = []
    inflight: deque = deque()
    copy_stream = None
    for grp in prep.groups:
        if grp[0].plan.codec.device == "cuda":
            while len(inflight) >= 2:
                inflight.popleft().synchronize()
            pieces = encode_group(grp)
            flat = [p for up in pieces for p in up]
            if copy_stream is None:
                copy_stream = torch.cuda.Stream()
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(ready)
                host, rel = stage_pieces(flat, ARENA.take, sync=False)
                for t in {id(p[0]): p[0] for p in flat}.values():
                    t.record_stream(copy_stream)  # keep the allocator from reusing it too early
                done = torch.cuda.Event()
                done.record(copy_stream)
            inflight.append(done)
            staged.append((host, rel, [len(up) for up in pieces]))
        else:
            for u in grp:
                u.data = ARENA.take(u.data.numel()).copy_(u.data)
            staged.append(None)
    for ev in inflight:
        ev.synchronize()
    return staged


def async_save(obj: Any, path, *, codec: str | dict = "auto", transform: str | None = "auto",
               chunk_size: int = DEFAULT_CHUNK, level: int | None = None, metadata=None,
               allow_pickle: bool = False, fsync: bool = True, progress=None, device: str | None = None,
               portable: bool = False, storage_gbps: float | None = None, window: int | None = None,
               reuse_plan: bool = True) -> SaveHandle:
    """Like :func:`ckptzip.save` (same arguments), but returns once a consistent snapshot is taken
    (see the module docstring); the write goes on in the background. Errors surface on
    ``handle.wait()``. ``reuse_plan``: reuse the codec choices sampled for an earlier save of the
    same layout (the usual case in a training loop), keeping sampling out of the stall."""
    global _LAST
    with _LAST_LOCK:
        prev = _LAST
    if prev is not None:
        prev._done.wait()  # the arena is reused: one save in flight at a time
    t0 = time.perf_counter()
    prep = _prepare(obj, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
                    storage_gbps, window, reuse_plan)
    staged = _snapshot(prep)
    handle = SaveHandle()
    handle.path = str(path)
    handle.stall_s = time.perf_counter() - t0
    t = threading.Thread(target=handle._run, args=(lambda: _write(prep, path, fsync, progress, staged),),
                         name="ckptzip-async-save")
    t.start()
    with _LAST_LOCK:
        _LAST = handle
    return handle
