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
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from .pipeline import prepare, write
from .engine import DEFAULT_CHUNK, encode_group_arrays, gather_gpu


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


class _OnGPU:
    """A compressed group kept on the GPU during the snapshot; the background writer copies it
    to the host arena (:meth:`fetch`) and then lets the GPU memory go."""

    def __init__(self, buf: torch.Tensor, rel, per_unit: list, packed: torch.cuda.Event) -> None:
        self.buf, self.rel, self.per_unit, self._packed = buf, rel, per_unit, packed

    def fetch(self) -> tuple:
        buf, self.buf = self.buf, None
        host, done = _copy_to_host(buf, self._packed)
        done.synchronize()
        return host, self.rel, self.per_unit


def _copy_to_host(buf: torch.Tensor, after: torch.cuda.Event) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Copy a GPU buffer into an arena slice on the device's side stream once ``after`` has
    happened; returns the slice and the event that marks the copy done."""
    stream = _copy_stream(buf.device)
    host = ARENA.take(buf.numel())
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


def _snapshot(prep, gpu_bytes: int | None) -> list:
    """Make the prepared save independent of the caller's tensors; returns per group one of:
    an :class:`_OnGPU` (compressed, packed into one GPU buffer: the snapshot is the compressed
    bytes, copied to the host later by the writer), (host, rows, chunks per unit) for a group
    copied to the host now (once the GPU snapshot would exceed ``gpu_bytes``), or None (raw bytes
    copied to the host, encoded later: CPU codecs)."""
    # upper bound: stored bytes never exceed raw bytes; plus alignment padding per chunk and group
    bound = sum(u.data.numel() + 16 * len(u.sizes) for grp in prep.groups for u in grp) + 64 * len(prep.groups)
    ARENA.reset(bound)
    if gpu_bytes is None and torch.cuda.is_available():
        gpu_bytes = torch.cuda.mem_get_info()[0] // 4
    staged = []
    held = 0
    inflight: deque = deque()
    for grp in prep.groups:
        if grp[0].plan.codec.device == "cuda":
            while len(inflight) >= 2:
                inflight.popleft().synchronize()
            enc = encode_group_arrays(grp)
            buf, rel = gather_gpu(enc)
            per_unit = enc.counts
            del enc
            packed = torch.cuda.Event()
            packed.record()
            if held + buf.numel() <= (gpu_bytes or 0):
                held += buf.numel()
                staged.append(_OnGPU(buf, rel, per_unit, packed))
            else:
                # over the GPU snapshot budget: copy to the host now, on the side stream, while
                # the next group compresses
                host, done = _copy_to_host(buf, packed)
                inflight.append(done)
                staged.append((host, rel, per_unit))
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
               reuse_plan: bool = True, gpu_snapshot_bytes: int | None = None) -> SaveHandle:
    """Like :func:`ckptzip.save` (same arguments), but returns once a consistent snapshot is taken
    (see the module docstring); the write goes on in the background. Errors surface on
    ``handle.wait()``. ``reuse_plan``: reuse the codec choices sampled for an earlier save of the
    same layout (the usual case in a training loop), keeping sampling out of the stall.
    ``gpu_snapshot_bytes``: how much GPU memory the compressed snapshot may hold until the
    background thread has copied it to the host (default: a quarter of the free GPU memory);
    groups beyond it are copied to the host before this call returns (a longer stall)."""
    global _LAST
    with _LAST_LOCK:
        prev = _LAST
    if prev is not None:
        prev._done.wait()  # the arena is reused: one save in flight at a time
    t0 = time.perf_counter()
    prep = prepare(obj, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
                    storage_gbps, window, reuse_plan)
    staged = _snapshot(prep, gpu_snapshot_bytes)
    handle = SaveHandle()
    handle.path = str(path)
    handle.stall_s = time.perf_counter() - t0
    t = threading.Thread(target=handle._run, args=(lambda: write(prep, path, fsync, progress, staged),),
                         name="ckptzip-async-save")
    t.start()
    with _LAST_LOCK:
        _LAST = handle
    return handle
