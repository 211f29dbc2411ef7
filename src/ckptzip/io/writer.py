"""The chunk writer: appends a save's chunks to the file, 16-byte aligned, checksumming and
writing GPU windows on a background thread while the next window is compressed."""
from __future__ import annotations

import io
import os
import queue
import threading
from typing import NamedTuple

import numpy as np
import torch

from .. import native
from ..engine.encode import Encoded, stage_encoded
from ..engine.memory import ALIGN, PINNED
from ..format import ROW, checksum
from ..storage import start_writeback
from .reader import checksums

_ZEROS = memoryview(bytes(ALIGN))
_IOV_MAX = 1024
#: the disk write of written bytes is started (``storage.start_writeback``) in page-aligned
#: ranges of at least this many bytes: a partial page handed over would be written into again
#: by the next window (stable-page file systems then wait for its I/O)
WRITEBACK_MIN = 8 << 20
#: tmpfs files: pages allocated ahead of the writes on a thread (:meth:`ChunkWriter._prealloc`),
#: in steps of this many bytes (each holds the file's lock that writes take too, a few ms)
PREALLOC = os.environ.get("CKPTZIP_PREALLOC", "1") != "0"
PREALLOC_STEP = 32 << 20
_TMPFS_MAGIC = 0x01021994
#: saves that fsync make written windows durable while they go on (:meth:`ChunkWriter._sync_to`);
#: ``CKPTZIP_EARLY_SYNC=0`` leaves it all to the fsync at the end
EARLY_SYNC = os.environ.get("CKPTZIP_EARLY_SYNC", "1") != "0"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _write_all(f, parts: list) -> None:
    """Write the buffers in order: ``os.writev`` batches on a plain unbuffered file (partial
    writes resumed), ``f.write`` per buffer on anything else."""
    if not (isinstance(f, io.FileIO) and hasattr(os, "writev")):
        for p in parts:
            f.write(p)
        return
    fd = f.fileno()
    i = 0
    while i < len(parts):
        batch = parts[i:i + _IOV_MAX]
        n = os.writev(fd, batch)
        for p in batch:
            if n >= len(p):
                n -= len(p)
                i += 1
            else:  # partial write: the rest of this buffer goes first next time
                parts[i] = p[n:]
                break


class _CpuGroup(NamedTuple):
    """A CPU group the writer thread writes: its chunks (views of ``enc``'s buffers), what to
    write (the chunks and their zero padding), and its :class:`Encoded`, kept alive (so the host
    scratch pool does not hand its buffers out again) until written."""
    bufs: list
    parts: list
    enc: Encoded


class ChunkWriter:
    """Appends chunks at 16-byte aligned offsets (zero padding between) and records their table
    rows. GPU windows are copied once into pooled pinned buffers and handed to a background thread
    that checksums and writes them, so the disk write of one window overlaps the compression of
    the next; at most two windows are in flight. With ``cpu_thread`` CPU groups go to that thread
    too (written from where they lie). Saves that fsync make written windows durable on a
    flusher thread as they go; on tmpfs a thread allocates the file's pages ahead (``reserve``).
    :meth:`finish` returns the rows; :meth:`close` joins the helper threads."""

    def __init__(self, f, pos: int, writeback: bool = True, cpu_thread: bool = False, reserve: int = 0) -> None:
        self.f, self.pos, self.rows = f, pos, []
        #: CPU groups too are checksummed and written by the writer thread (at most two in
        #: flight), so that the write of one overlaps the encoding of the next
        self._cpu_thread = cpu_thread
        self._cpu_room = threading.Semaphore(1)
        #: start the disk write of written ranges early (saves that fsync); where it is done up to
        self._wb, self._flushed = writeback, 0
        self._q: queue.Queue | None = None
        self._free: queue.Queue = queue.Queue()
        self._err: BaseException | None = None
        #: the flusher thread (see :meth:`_sync_to`) and what it was asked to make durable
        self._syncer: threading.Thread | None = None
        self._sync_cv = threading.Condition()
        self._sync_want, self._sync_stop = 0, False
        #: tmpfs: the file's pages allocated ahead of the writes (see :meth:`_prealloc`)
        self._pre: threading.Thread | None = None
        self._pre_stop, self._pre_end = False, 0
        if reserve > 0:
            self._prealloc(reserve)

    def _prealloc(self, reserve: int) -> None:
        """On tmpfs, allocate the file's first ``reserve`` bytes (fallocate, KEEP_SIZE) on a
        thread, in :data:`PREALLOC_STEP` steps, while the save plans and encodes its first
        windows: tmpfs spends about 40 % of a write allocating and clearing pages, and the
        writes that follow find them in place (an H100 machine's /dev/shm: 665 MiB written in
        0.29 s, 0.17 s into allocated pages; docs/benchmarks.md, "Eighteenth session"). What
        lies past the file's end when it is complete is given back (:meth:`close`)."""
        lib = native.lib
        if not (PREALLOC and lib is not None and isinstance(self.f, io.FileIO) and hasattr(lib, "fallocate")):
            return
        fd = self.f.fileno()
        try:
            if lib.fs_type(fd) != _TMPFS_MAGIC:
                return
            st = os.fstatvfs(fd)
            if st.f_bavail * st.f_frsize < 2 * reserve:  # (never crowd out the writes themselves)
                return
        except OSError:
            return

        try:
            own = os.dup(fd)  # (the thread's own descriptor: never one the number of which was reused)
        except OSError:
            return

        def run() -> None:
            off = 0
            try:
                while off < reserve and not self._pre_stop:
                    n = min(PREALLOC_STEP, reserve - off)
                    try:
                        lib.fallocate(own, 1, off, n)  # FALLOC_FL_KEEP_SIZE
                    except OSError:
                        return  # (only a head start is lost; the writes report real errors)
                    off += n
                    self._pre_end = off
            finally:
                os.close(own)
        self._pre = threading.Thread(target=run, name="ckptzip-prealloc", daemon=True)
        self._pre.start()

    def _stop_prealloc(self) -> None:
        if self._pre is not None:
            self._pre_stop = True
            self._pre.join()
            self._pre = None

    def _place(self, n: int) -> tuple[int, int]:
        pad = (-self.pos) % ALIGN
        off = self.pos + pad
        self.pos = off + n
        return pad, off

    def add(self, enc: Encoded) -> None:
        """Append a group's chunks, in order. CPU groups are written in place (by the writer
        thread with ``cpu_thread``, else at once); GPU ones are packed on the GPU, copied into a
        pinned buffer and handed to the writer thread."""
        if not len(enc.stored):
            return
        if enc.tensors[0].device.type != "cuda" and (self._q is None or self._cpu_thread):
            # the chunks are written in place (no packing copy), all of them in a few writev
            # calls where the file is a plain file descriptor; with ``cpu_thread``, by the writer
            # thread while the caller encodes the next group
            offs, total = enc.packed()
            pad0, start = self._place(0)
            offs = offs + start
            block = enc.rows(offs)
            # (slices of flat byte memoryviews: they cost less than numpy's slices, per chunk)
            views = [memoryview(t.numpy().reshape(-1)) for t in enc.tensors]
            bufs = [views[t][so:so + ln]
                    for t, so, ln in zip(enc.src.tolist(), enc.soff.tolist(), enc.stored.tolist())]
            pads = (np.append(offs[1:], start + total) - offs - enc.stored).tolist()
            parts = [_ZEROS[:pad0]] if pad0 else []
            for b, p in zip(bufs, pads):
                parts.append(b)
                if p:
                    parts.append(_ZEROS[:p])
            self.pos = start + total
            self.rows.append(block)
            grp = _CpuGroup(bufs, parts, enc)
            if not self._cpu_thread:
                self._write_cpu(block, grp, self.pos)
                return
            # one CPU group in flight (being written while the caller encodes the next), so a
            # save holds at most two windows, as ``window`` promises
            self._check()
            self._start_thread()
            self._cpu_room.acquire()
            if self._err is not None:
                self._cpu_room.release()
                self._check()
            self._q.put((None, None, self.pos, block, grp))
            return
        slot = self._slot()
        host, rel = stage_encoded(enc, PINNED.acquire)
        self._enqueue((slot, host), host, rel)

    def _write_cpu(self, block: np.ndarray, grp: _CpuGroup, end: int) -> None:
        """Checksum a CPU group's chunks into its rows ``block`` (or take the checksums its
        encoding computed) and write it (it ends at ``end``)."""
        sums = grp.enc.xxh3
        block["xxh3"] = sums if sums is not None else [checksum(b) for b in grp.bufs]
        _write_all(self.f, grp.parts)
        self._written(end)

    def add_pooled(self, host: torch.Tensor, rel: np.ndarray, hashed: np.ndarray | None = None) -> None:
        """Append a packed group held in a buffer leased from ``PINNED`` (given back once
        written); waits while two windows are in flight, as :meth:`add` does. ``hashed``: the
        chunks whose checksums ``rel`` already holds (computed on the GPU), or None."""
        self._enqueue((self._slot(), host), host, rel, hashed)

    def _slot(self):
        """A flow-control token (at most two pooled windows in flight), once the writer thread runs."""
        self._check()
        self._start_thread()
        slot = self._free.get()
        self._check()
        return slot

    def add_staged(self, host: torch.Tensor, rel: np.ndarray) -> None:
        """Append a group staged earlier by :func:`stage_encoded` (its buffer is not recycled)."""
        self._check()
        self._start_thread()
        self._enqueue(None, host, rel)

    def _start_thread(self) -> None:
        if self._q is None:
            self._q = queue.Queue(maxsize=1)
            for slot in range(2):
                self._free.put(slot)
            self._thread = threading.Thread(target=self._run, name="ckptzip-writer", daemon=True)
            self._thread.start()

    def _enqueue(self, slot, host: torch.Tensor, rel: np.ndarray, hashed: np.ndarray | None = None) -> None:
        pad, start = self._place(0)
        if pad:
            self._q.put((None, torch.zeros(pad, dtype=torch.uint8), start - pad, None, None))
        block = rel.copy()
        block["offset"] += start
        self.rows.append(block)
        self.pos = start + host.numel()
        self._q.put((slot, host, start, block, hashed))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            # (a CPU group: no host buffer, ``start`` is where it ends, ``hashed`` the _CpuGroup)
            slot, host, start, block, hashed = item
            cpu = isinstance(hashed, _CpuGroup)
            try:
                if cpu:
                    if self._err is None:
                        self._write_cpu(block, hashed, start)
                elif self._err is None:
                    h = host.numpy()
                    if block is not None:
                        rel = (block["offset"] - start).astype(np.int64)
                        stored = block["stored"].astype(np.int64)
                        if hashed is None:
                            block["xxh3"] = checksums(h, rel.tolist(), stored.tolist())
                        else:  # the others' checksums were computed on the GPU
                            rest = np.ones(len(block), dtype=bool)
                            rest[hashed] = False
                            sel = np.nonzero(rest)[0]
                            if len(sel):
                                block["xxh3"][sel] = checksums(h, rel[sel].tolist(), stored[sel].tolist())
                    _write_all(self.f, [memoryview(h)])  # (a short write is resumed)
                    self._written(start + h.nbytes)
            except BaseException as e:  # surfaced in the main thread
                self._err = e
            finally:
                if slot is not None:  # (flow-control token, pinned buffer to give back)
                    PINNED.release(slot[1])
                    self._free.put(slot[0])
                if cpu:
                    self._cpu_room.release()
                # (no reference outlives the item: the host scratch pool reuses a buffer only
                # once nothing holds it)
                item = slot = host = block = hashed = h = None

    def _written(self, end: int) -> None:
        """Bytes up to ``end`` are written: start the disk write of the whole pages not yet
        handed over, once there are :data:`WRITEBACK_MIN` bytes of them (one thread at a time:
        the writer thread, or the caller's before it starts)."""
        upto = end // _PAGE * _PAGE
        if self._wb and upto - self._flushed >= WRITEBACK_MIN:
            start_writeback(self.f, self._flushed, upto - self._flushed)
            self._flushed = upto
            self._sync_to(upto)

    def _sync_to(self, end: int) -> None:
        """Have the flusher thread make the file durable up to ``end`` (``os.fdatasync``) while
        the save goes on: the fsync at the end then waits for the last few windows only. A
        virtual disk measured: 32 MiB written and fsynced once, 47-71 ms in that fsync even
        after the data was written back (the device's cache flush); fdatasync after each 8 MiB,
        17 ms each and 15 ms at the end (docs/benchmarks.md, "Eighteenth session")."""
        if not (EARLY_SYNC and isinstance(self.f, io.FileIO) and hasattr(os, "fdatasync")):
            return
        with self._sync_cv:
            self._sync_want = max(self._sync_want, end)
            if self._syncer is None:
                self._syncer = threading.Thread(target=self._sync_run, name="ckptzip-flusher", daemon=True)
                self._syncer.start()
            self._sync_cv.notify()

    def _sync_run(self) -> None:
        done = 0
        while True:
            with self._sync_cv:
                while self._sync_want <= done and not self._sync_stop:
                    self._sync_cv.wait()
                if self._sync_want <= done:
                    return
                want = self._sync_want
            try:
                os.fdatasync(self.f.fileno())
            except BaseException as e:  # surfaced in the main thread (the final fsync would fail too)
                self._err = self._err or e
                return
            done = want

    def _stop_syncer(self, wait: bool = True) -> None:
        if self._syncer is not None:
            with self._sync_cv:
                self._sync_stop = True
                self._sync_cv.notify()
            if wait:
                self._syncer.join()
                self._syncer = None

    def _check(self) -> None:
        if self._err is not None:
            raise self._err

    def finish(self) -> np.ndarray:
        """Wait for queued windows; returns the chunk table rows."""
        try:
            self._stop_prealloc()
            if self._q is not None:
                self._q.put(None)
                self._thread.join()
                self._q = None
        finally:
            self._stop_syncer(wait=False)
        self._check()
        return np.concatenate(self.rows) if self.rows else np.zeros(0, ROW)

    def close(self, check: bool = True) -> None:
        """Join the flusher thread (before the file is closed); with ``check``, raise the error of
        an early sync (an I/O error reported to it is not reported again to the final fsync of
        the same file description). :meth:`finish` only tells the flusher to stop, so that a
        sync still running overlaps the writing of the manifest."""
        self._stop_syncer()
        self._stop_prealloc()
        if self._pre_end:  # pages allocated past the file's end go back
            try:
                end = -(-os.fstat(self.f.fileno()).st_size // _PAGE) * _PAGE
                if self._pre_end > end:
                    native.lib.fallocate(self.f.fileno(), 3, end, self._pre_end - end)  # PUNCH_HOLE | KEEP_SIZE
            except OSError:
                pass
            self._pre_end = 0
        if check:
            self._check()
