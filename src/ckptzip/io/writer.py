"""The chunk writer: appends a save's chunks to the file, 16-byte aligned, checksumming and
writing GPU windows on a background thread while the next window is compressed."""
from __future__ import annotations

import io
import os
import queue
import threading

import numpy as np
import torch

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


class ChunkWriter:
    """Appends chunks at 16-byte aligned offsets (zero padding between) and records their table
    rows. GPU windows are copied once into pooled pinned buffers and handed to a background thread
    that checksums and writes them, so the disk write of one window overlaps the compression of
    the next; at most two windows are in flight."""

    def __init__(self, f, pos: int, writeback: bool = True) -> None:
        self.f, self.pos, self.rows = f, pos, []
        #: start the disk write of written ranges early (saves that fsync); where it is done up to
        self._wb, self._flushed = writeback, 0
        self._q: queue.Queue | None = None
        self._free: queue.Queue = queue.Queue()
        self._err: BaseException | None = None

    def _place(self, n: int) -> tuple[int, int]:
        pad = (-self.pos) % ALIGN
        off = self.pos + pad
        self.pos = off + n
        return pad, off

    def add(self, enc: Encoded) -> None:
        """Append a group's chunks, in order. CPU groups are written at once; GPU ones are packed
        on the GPU, copied into a pinned buffer and handed to the writer thread."""
        if not len(enc.stored):
            return
        if enc.tensors[0].device.type != "cuda" and self._q is None:
            # the chunks are written in place (no packing copy), all of them in a few writev
            # calls where the file is a plain file descriptor
            offs, total = enc.packed()
            pad0, start = self._place(0)
            offs = offs + start
            block = enc.rows(offs)
            arrays = [t.numpy() for t in enc.tensors]
            bufs = [memoryview(arrays[t][so:so + ln])
                    for t, so, ln in zip(enc.src.tolist(), enc.soff.tolist(), enc.stored.tolist())]
            block["xxh3"] = [checksum(b) for b in bufs]
            pads = (np.append(offs[1:], start + total) - offs - enc.stored).tolist()
            parts = [_ZEROS[:pad0]] if pad0 else []
            for b, p in zip(bufs, pads):
                parts.append(b)
                if p:
                    parts.append(_ZEROS[:p])
            _write_all(self.f, parts)
            self.pos = start + total
            self._written(self.pos)
            self.rows.append(block)
            return
        slot = self._slot()
        host, rel = stage_encoded(enc, PINNED.acquire)
        self._enqueue((slot, host), host, rel)

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
            slot, host, start, block, hashed = item
            try:
                if self._err is None:
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

    def _written(self, end: int) -> None:
        """Bytes up to ``end`` are written: start the disk write of the whole pages not yet
        handed over, once there are :data:`WRITEBACK_MIN` bytes of them (one thread at a time:
        the writer thread, or the caller's before it starts)."""
        upto = end // _PAGE * _PAGE
        if self._wb and upto - self._flushed >= WRITEBACK_MIN:
            start_writeback(self.f, self._flushed, upto - self._flushed)
            self._flushed = upto

    def _check(self) -> None:
        if self._err is not None:
            raise self._err

    def finish(self) -> np.ndarray:
        """Wait for queued windows; returns the chunk table rows."""
        if self._q is not None:
            self._q.put(None)
            self._thread.join()
            self._q = None
        self._check()
        return np.concatenate(self.rows) if self.rows else np.zeros(0, ROW)
