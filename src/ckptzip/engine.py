"""Chunk planning, the storage encoder that feeds the writer, and the storage decoder.

A storage (a flat byte buffer) is processed in *windows* of whole transform blocks so that the
memory any step holds is bounded by the window size, whatever the tensor's size.
"""
from __future__ import annotations

import functools
import queue
from collections.abc import Callable, Iterator
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .codecs import _capi
from .codecs.base import Codec, get_codec
from .errors import ChecksumError, CorruptFileError
from .format import FLAG_STORED_RAW, ROW, checksum
from .storage import pread_into
from .transforms import BytePlane, _triton, get_transform

DEFAULT_CHUNK = 1 << 20
DEFAULT_WINDOW = 64 << 20


@dataclass
class Plan:
    """One storage's encoding: the transform (or None), the codec and the chunk size."""
    transform: BytePlane | None
    codec: Codec
    chunk_size: int
    choice: str | None = None
    raw_planes: frozenset = frozenset()
    plane_chunks: dict = None  # plane index -> chunk size, where it differs from chunk_size


def gpu_decode_window(budget: int | None = None) -> int:
    """Group bytes for GPU decoding: small enough that reading the next group overlaps decoding
    this one from the start (64 MiB), and at most one encode window (see :func:`gpu_window`)."""
    return min(64 << 20, gpu_window(budget))


def gpu_window(budget: int | None = None) -> int:
    """Window bytes for GPU work: peak extra memory is under 4 windows (the transformed window,
    compressed output at nvCOMP's worst-case size, gather and staging slices), kept under
    ``budget`` (default: the smaller of 1 GiB and 10 % of free GPU memory). Windows are as large
    as that allows because nvCOMP's throughput grows with the bytes per call: ANS on H100 ran at
    ~50 GB/s with 16 MB per call, ~150 with 64 MB and 300-400 with 256 MB
    (bench/probe_throughput.py)."""
    if budget is None:
        free, _total = torch.cuda.mem_get_info()
        budget = min(1 << 30, free // 10)
    return max(1 << 20, (budget // 4) >> 20 << 20)


#: host tensors are moved to the GPU and transformed in slices of this size (whole transform
#: blocks), so staging needs no window-sized GPU buffer
STAGE_SLICE = 32 << 20


class PinnedPool:
    """Page-locked host buffers shared by saves and loads: :meth:`acquire` leases one of at
    least ``n`` bytes (the smallest free one that fits, else a new one), :meth:`release` gives it
    back. Pinning costs ~1 ms per 1.5 MB, so a load after a save reuses the save's write buffers
    instead of pinning its own. Sizes are rounded up to 8 MiB so that buffers fit later
    requests; at most ``MAX_FREE`` free buffers are kept (the smallest go first)."""

    MAX_FREE = 6
    GRAIN = 8 << 20

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, weakref.ref] = {}  # weak: a lease lost to an exception is just freed
        self._lock = threading.Lock()

    def acquire(self, n: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= n]
            b = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if b is None:
            cap = max(n, 1) if n < self.GRAIN else -(-n // self.GRAIN) * self.GRAIN
            b = torch.empty(cap, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        with self._lock:
            self._leased[b.data_ptr()] = weakref.ref(b)
        return b[:n]

    def release(self, view: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire` (or a view that starts where it starts)."""
        with self._lock:
            ref = self._leased.pop(view.data_ptr(), None)
            b = ref() if ref is not None else None
            if b is None:
                return
            self._free.append(b)
            if len(self._free) > self.MAX_FREE:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


PINNED = PinnedPool()


def windows(nbytes: int, tf: BytePlane | None, chunk: int, window: int,
            plane_chunks: dict[int, int] | None = None
            ) -> tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
    """(start, end, chunk offsets, chunk sizes, chunk planes) per window; offsets are relative to
    the window's transformed stream, which has the same length as the window; planes are the
    byteplane index of each chunk (-1 without a transform). ``plane_chunks`` overrides the chunk
    size of some planes. Memoized: a training loop saves the same shapes again and again."""
    tf_key = (tf.width, tf.block) if tf else None
    return _windows(nbytes, tf_key, chunk, window, tuple(sorted((plane_chunks or {}).items())))


@functools.lru_cache(maxsize=8192)
def _windows(nbytes: int, tf_key: tuple[int, int] | None, chunk: int, window: int, plane_chunks: tuple):
    pc = dict(plane_chunks)
    width, block = tf_key if tf_key else (1, 0)
    span = block * width if tf_key else chunk
    step = max(span, window // span * span)
    out = []
    for a in range(0, nbytes, step):
        b = min(nbytes, a + step)
        offs, sizes, planes = [], [], []
        words = (b - a) // width
        seg = 0
        for start in range(0, words, block) if tf_key else [0]:
            m = min(block, words - start) if tf_key else b - a
            for plane in range(width) if tf_key else [-1]:
                cs = pc.get(plane, chunk)
                for c in range(0, m, cs):
                    offs.append(seg + c)
                    sizes.append(min(cs, m - c))
                    planes.append(plane)
                seg += m
        arrs = []
        for x in (offs, sizes, planes):
            arr = np.array(x, dtype=np.int64)
            arr.flags.writeable = False  # shared by every caller of this memoized layout
            arrs.append(arr)
        out.append((a, b, *arrs))
    return tuple(out)


@dataclass
class Unit:
    """One window of one storage, planned: what encode_group_arrays compresses."""
    owner: int
    data: torch.Tensor
    plan: Plan
    offs: list
    sizes: list
    planes: list
    base: int = 0


def units_of(owner: int, data: torch.Tensor, plan: Plan, window: int, limit: int | None = None) -> list[Unit]:
    n = data.numel() if limit is None else min(limit, data.numel())
    return [Unit(owner, data if a == 0 and b == data.numel() else data[a:b], plan, offs, sizes, planes)
            for a, b, offs, sizes, planes in windows(n, plan.transform, plan.chunk_size, window, plan.plane_chunks)]


def groups(units: list[Unit], window: int, max_chunks: int = 8192) -> Iterator[list[Unit]]:
    """Consecutive units packed into groups of about ``window`` bytes, so that many small storages
    share one nvCOMP call (a call costs ~0.5 ms whatever its size)."""
    cur: list[Unit] = []
    nbytes = nchunks = 0
    for u in units:
        if cur and (nbytes + u.data.numel() > window or nchunks + len(u.sizes) > max_chunks
                    or u.plan.codec.device != cur[0].plan.codec.device):
            yield cur
            cur, nbytes, nchunks = [], 0, 0
        cur.append(u)
        nbytes += u.data.numel()
        nchunks += len(u.sizes)
    if cur:
        yield cur


def _ceil16(n):
    """``n`` (an int or an array) rounded up to the chunk alignment, :data:`ALIGN` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _codec_key(c: Codec) -> tuple:
    return (type(c).__name__, repr(sorted(c.config.items())))


@dataclass
class Encoded:
    """A compressed group: per chunk (in unit order) the source tensor (an index into
    ``tensors``: 0 is the transformed group stream, then one output buffer per codec call), the
    offset there, stored bytes, raw bytes and flags; ``counts`` is the number of chunks per
    unit."""
    tensors: list
    src: np.ndarray
    soff: np.ndarray
    stored: np.ndarray
    raw: np.ndarray
    flags: np.ndarray
    counts: list

    def packed(self) -> tuple[np.ndarray, int]:
        """16-byte aligned offsets of the chunks packed back to back, and the packed size."""
        padded = _ceil16(self.stored)
        offs = np.zeros(len(padded), dtype=np.int64)
        np.cumsum(padded[:-1], out=offs[1:])
        return offs, int(padded.sum())

    def rows(self, offs: np.ndarray) -> np.ndarray:
        """Table rows (checksums zero) for chunks placed at ``offs``."""
        r = np.zeros(len(offs), ROW)
        r["offset"], r["stored"], r["raw"], r["flags"] = offs, self.stored, self.raw, self.flags
        return r


def encode_group_arrays(units: list[Unit]) -> Encoded:
    """Transform every unit into one group stream on the codec device and compress all chunks of
    each codec in one call; a chunk that does not shrink stays raw. Chunk bookkeeping is done
    with numpy arrays: a group holds thousands of chunks."""
    dev = units[0].plan.codec.device
    # each unit starts 16-byte aligned in the group stream, so nvCOMP reads chunks in place
    total = sum(_ceil16(u.data.numel()) for u in units)
    single = len(units) == 1 and units[0].plan.transform is None and units[0].data.device.type == dev
    stream = units[0].data if single else torch.empty(total, dtype=torch.uint8, device=dev)
    staged = None
    pos = 0
    copies: tuple[list, list] = ([], [])  # plain same-device copies, done in one batched call
    for u in units:
        n = u.data.numel()
        u.base = pos
        if not single and n:
            if u.data.device.type != dev and dev == "cuda":
                if staged is None:
                    staged = PINNED.acquire(total)
                staged[pos:pos + n].copy_(u.data)
                _upload(staged[pos:pos + n], stream[pos:pos + n], u.plan.transform)
            else:
                src = u.data if u.data.device.type == dev else u.data.to(dev)
                if u.plan.transform is not None:
                    u.plan.transform.encode(src, out=stream[pos:pos + n])
                else:
                    copies[0].append(stream[pos:pos + n])
                    copies[1].append(src)
        pos += _ceil16(n)
    if copies[0]:
        torch._foreach_copy_(*copies)
    counts = [len(u.sizes) for u in units]
    soff = np.concatenate([u.offs + u.base for u in units])
    raw = np.concatenate([u.sizes for u in units])
    stored = raw.copy()
    src = np.zeros(len(raw), dtype=np.int64)
    flags = np.full(len(raw), FLAG_STORED_RAW, dtype=np.uint8)
    tensors = [stream]
    by_codec: dict[tuple, tuple[Codec, list]] = {}
    k = 0
    for u, c in zip(units, counts):
        sel = np.arange(k, k + c)
        if u.plan.raw_planes:
            sel = sel[~np.isin(u.planes, list(u.plan.raw_planes))]
        by_codec.setdefault(_codec_key(u.plan.codec), (u.plan.codec, []))[1].append(sel)
        k += c
    for codec, sels in by_codec.values():
        idx = np.concatenate(sels)
        if not len(idx):
            continue
        cuda = codec.device == "cuda"  # GPU codecs take numpy arrays (thousands of chunks), CPU ones lists
        comp, doffs, dsizes = codec.encode(stream, *((soff[idx], raw[idx]) if cuda else (soff[idx].tolist(),
                                                                                          raw[idx].tolist())))
        dsizes = np.asarray(dsizes, dtype=np.int64)
        shrink = dsizes < raw[idx]
        hit = idx[shrink]
        src[hit] = len(tensors)
        soff[hit] = np.asarray(doffs, dtype=np.int64)[shrink]
        stored[hit] = dsizes[shrink]
        flags[hit] = 0
        tensors.append(comp)
    if staged is not None:
        torch.cuda.current_stream().synchronize()  # the staging buffer may be reused next group
        PINNED.release(staged)
    return Encoded(tensors, src, soff, stored, raw, flags, counts)


def copy_segments(src: torch.Tensor, soffs: np.ndarray, dst: torch.Tensor, doffs: np.ndarray,
                  lens: np.ndarray, ends: np.ndarray | None = None) -> None:
    """dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]] for every i (flat uint8 tensors, same
    device), and dst[doffs[i]+lens[i]:doffs[i]+ends[i]] zeroed where ``ends`` is given. On CUDA,
    one Triton kernel launch for all; elsewhere, one copy per run of adjacent segments."""
    if not len(lens):
        return
    ends = lens if ends is None else ends
    tk = _triton() if src.is_cuda else None
    if tk is not None:
        tk.copy_segments(src, soffs, dst, doffs, lens, ends)
        return
    # merge runs of segments that are adjacent on both sides (only a run's last one has padding)
    brk = np.ones(len(lens), dtype=bool)
    brk[1:] = ((soffs[1:] != soffs[:-1] + lens[:-1]) | (doffs[1:] != doffs[:-1] + lens[:-1])
               | (ends[:-1] != lens[:-1]))
    if not brk.all():
        starts = np.nonzero(brk)[0]
        last = np.append(starts[1:], len(lens)) - 1
        pads = (ends - lens)[last]
        lens, soffs, doffs = np.add.reduceat(lens, starts), soffs[starts], doffs[starts]
        ends = lens + pads
    for s, d, n, e in zip(soffs.tolist(), doffs.tolist(), lens.tolist(), ends.tolist()):
        dst[d:d + n].copy_(src[s:s + n])
        if e > n:
            dst[d + n:d + e].zero_()


def pack(enc: Encoded, out: torch.Tensor, offs: np.ndarray) -> None:
    """Copy every chunk of ``enc`` into ``out`` at ``offs``, zeroing the padding up to the next
    16-byte boundary (``offs`` from :meth:`Encoded.packed`: every byte of ``out`` is written)."""
    padded = _ceil16(enc.stored)
    base = enc.tensors[0]
    tk = _triton() if base.is_cuda else None
    if tk is not None:  # one launch gathers from every tensor (offsets relative to the first)
        rel = np.array([t.data_ptr() - base.data_ptr() for t in enc.tensors], dtype=np.int64)
        tk.copy_segments(base, enc.soff + rel[enc.src], out, offs, enc.stored, padded)
        return
    for t in range(len(enc.tensors)):
        sel = np.nonzero(enc.src == t)[0]
        if len(sel):
            copy_segments(enc.tensors[t], enc.soff[sel], out, offs[sel], enc.stored[sel], padded[sel])


def _upload(host: torch.Tensor, dst: torch.Tensor, tf: BytePlane | None) -> None:
    """Copy pinned ``host`` bytes to the GPU into ``dst``, transformed, in slices of whole
    transform blocks (a block's planes occupy exactly the block's byte range)."""
    if tf is None:
        dst.copy_(host, non_blocking=True)
        return
    span = tf.block * tf.width
    step = max(span, STAGE_SLICE // span * span)
    for a in range(0, host.numel(), step):
        b = min(host.numel(), a + step)
        tf.encode(host[a:b].to(dst.device, non_blocking=True), out=dst[a:b])


ALIGN = 16  # every chunk starts at a 16-byte aligned file offset (nvCOMP's strictest alignment)


def _packed_into(enc: Encoded, alloc: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """The chunks of ``enc`` packed at 16-byte aligned offsets (zero padding between) into
    ``alloc(n)`` on the group's device; returns it and the rows (relative offsets, checksums 0)."""
    offs, total = enc.packed()
    out = alloc(total)
    pack(enc, out, offs)
    return out, enc.rows(offs)


def gather_gpu(enc: Encoded) -> tuple[torch.Tensor, np.ndarray]:
    """The chunks of a GPU group packed into one new GPU tensor (see :func:`_packed_into`)."""
    return _packed_into(enc, lambda n: torch.empty(n, dtype=torch.uint8, device=enc.tensors[0].device))


def stage_encoded(enc: Encoded, alloc: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """The chunks of a group packed into one host buffer from ``alloc(n)``; a GPU group is packed
    on the GPU and copied once (waits for the copy)."""
    if enc.tensors[0].device.type != "cuda":
        return _packed_into(enc, alloc)
    buf, rows = gather_gpu(enc)
    host = alloc(buf.numel())
    host.copy_(buf, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host, rows


class ChunkWriter:
    """Appends chunks at 16-byte aligned offsets (zero padding between) and records their table
    rows. GPU windows are copied once into pooled pinned buffers and handed to a background thread
    that checksums and writes them, so the disk write of one window overlaps the compression of
    the next; at most two windows are in flight."""

    def __init__(self, f, pos: int) -> None:
        self.f, self.pos, self.rows = f, pos, []
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
            block = enc.rows(np.zeros(len(enc.stored), dtype=np.int64))
            for k, (t, so, ln) in enumerate(zip(enc.src.tolist(), enc.soff.tolist(), enc.stored.tolist())):
                pad, off = self._place(ln)
                if pad:
                    self.f.write(b"\0" * pad)
                mv = memoryview(enc.tensors[t][so:so + ln].numpy())
                self.f.write(mv)
                block[k]["offset"], block[k]["xxh3"] = off, checksum(mv)
            self.rows.append(block)
            return
        self._check()
        self._start_thread()
        slot = self._free.get()
        self._check()
        host, rel = stage_encoded(enc, PINNED.acquire)
        self._enqueue((slot, host), host, rel)

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

    def _enqueue(self, slot, host: torch.Tensor, rel: np.ndarray) -> None:
        pad, start = self._place(0)
        if pad:
            self._q.put((None, torch.zeros(pad, dtype=torch.uint8), start - pad, None))
        block = rel.copy()
        block["offset"] += start
        self.rows.append(block)
        self.pos = start + host.numel()
        self._q.put((slot, host, start, block))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            slot, host, start, block = item
            try:
                if self._err is None:
                    h = host.numpy()
                    if block is not None:
                        rel = (block["offset"] - start).astype(np.int64)
                        block["xxh3"] = _checksums(h, rel.tolist(), block["stored"].astype(np.int64).tolist())
                    self.f.write(memoryview(h))
            except BaseException as e:  # surfaced in the main thread
                self._err = e
            finally:
                if slot is not None:  # (flow-control token, pinned buffer to give back)
                    PINNED.release(slot[1])
                    self._free.put(slot[0])

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


def storage_plan_from_manifest(s: dict[str, Any], device: str) -> tuple[BytePlane | None, Codec]:
    tfs = s.get("transforms", [])
    if len(tfs) > 1:
        raise CorruptFileError("format v1 readers decode chains of at most one transform")
    tf = get_transform(tfs[0]) if tfs else None
    if tf is not None and not tf.accepts(s["nbytes"]):
        raise CorruptFileError("storage size is not a multiple of its byteplane width")
    return tf, get_codec(s["codec"], device)


def batches(rows: np.ndarray, nbytes: int, tf: BytePlane | None, window: int
            ) -> Iterator[tuple[int, int, int, int]]:
    """(first row, end row, start byte, end byte) of each decode batch of one storage: a batch
    ends on a byteplane block boundary once it holds ``window`` bytes (or at the end)."""
    span = tf.block * tf.width if tf else 1
    ends = np.cumsum(rows["raw"].astype(np.int64))
    i, n, start = 0, len(rows), 0
    while i < n:
        j = i
        while j < n:
            j += 1
            if (ends[j - 1] - start) >= window and ends[j - 1] % span == 0:
                break
        end = int(ends[j - 1])
        if tf is not None and end % span and end != nbytes:
            raise CorruptFileError("chunk boundaries do not align with byteplane blocks")
        yield i, j, start, end
        i, start = j, end


@dataclass
class Job:
    """One storage to decode into ``out`` (a flat uint8 tensor)."""
    rows: np.ndarray
    tf: BytePlane | None
    codec: Codec
    out: torch.Tensor


def decode_jobs(fd: int, jobs: list[Job], window: int = DEFAULT_WINDOW,
                progress: Callable[[int], None] | None = None) -> None:
    """Decode storages. Batches of whole blocks are grouped up to ``window`` bytes (many small
    storages per read and per codec call); a reader thread reads and checksums the next group
    into one of three pooled buffers while the current one is decoded."""
    items = [(job, i, j, a, b) for job in jobs for i, j, a, b in batches(job.rows, job.out.numel(), job.tf, window)]
    grouped: list[list] = []
    size = 0
    for it in items:
        if grouped and size + (it[4] - it[3]) <= window and it[0].codec.device == grouped[-1][0][0].codec.device:
            grouped[-1].append(it)
            size += it[4] - it[3]
        else:
            grouped.append([it])
            size = it[4] - it[3]
    if not grouped:
        return
    gpu = any(job.codec.device == "cuda" for job in jobs)
    q: queue.Queue = queue.Queue(maxsize=2)
    free: queue.Queue = queue.Queue()
    for slot in range(3):
        free.put(slot)
    stop = threading.Event()

    def reader() -> None:
        try:
            for grp in grouped:
                if stop.is_set():
                    return
                slot = free.get()
                rows = np.concatenate([job.rows[i:j] for job, i, j, _a, _b in grp])
                host, soffs = read_stored(fd, rows, pinned=gpu)
                q.put((slot, host, soffs, rows, None))
        except BaseException as e:  # re-raised by the consumer
            q.put((None, None, None, None, e))

    t = threading.Thread(target=reader, name="ckptzip-reader", daemon=True)
    t.start()
    try:
        with _capi.deferred_checks():
            _decode_loop(grouped, q, free, progress)
    finally:
        stop.set()
        while t.is_alive():  # unblock a reader waiting for a slot or for queue room
            free.put(0)
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.01)


def _decode_loop(grouped: list, q: queue.Queue, free: queue.Queue, progress) -> None:
    """Consume what the reader thread queued: decode each group, hand its slot back."""
    for grp in grouped:
        slot, host, soffs, rows, err = q.get()
        if err is not None:
            raise err
        work = grp[0][0].codec.device
        src = host.to(work, non_blocking=True) if work != "cpu" else host
        decode_group(src, soffs, rows, grp, work)
        if work == "cuda":
            torch.cuda.current_stream().synchronize()  # the pinned buffer may be reused now
            _capi.check_decodes()
        PINNED.release(host)  # (after an error it is not reused: the lease just lapses)
        free.put(slot)
        if progress:
            progress(sum(b - a for _j, _i, _jj, a, b in grp))


def decode_group(src: torch.Tensor, soffs: list[int], rows: np.ndarray, grp: list, work: str) -> None:
    """Decode a group of batches (``rows`` concatenated in group order, already verified): raw
    chunks are copied, codec chunks go to one call per codec, transforms are undone per batch."""
    stored = rows["stored"].astype(np.int64)
    raws = rows["raw"].astype(np.int64)
    soffs = np.asarray(soffs, dtype=np.int64)
    total = int(raws.sum())
    direct = len(grp) == 1 and grp[0][0].tf is None and grp[0][0].out.device.type == work
    stream = grp[0][0].out[grp[0][3]:grp[0][4]] if direct else torch.empty(total, dtype=torch.uint8, device=work)
    roffs = np.zeros(len(raws), dtype=np.int64)
    np.cumsum(raws[:-1], out=roffs[1:])
    is_raw = rows["flags"] == FLAG_STORED_RAW
    copy_segments(src, soffs[is_raw], stream, roffs[is_raw], raws[is_raw])
    keys: dict[tuple, tuple[int, Codec]] = {}
    job_key = [keys.setdefault(_codec_key(job.codec), (len(keys), job.codec))[0] for job, *_ in grp]
    if len(keys) > 1:
        key_of_row = np.repeat(np.asarray(job_key, dtype=np.int64), [j - i for _job, i, j, _a, _b in grp])
    for k, codec in keys.values():
        ks = np.nonzero(~is_raw if len(keys) == 1 else ~is_raw & (key_of_row == k))[0]
        if len(ks):
            cols = (soffs[ks], stored[ks], roffs[ks], raws[ks])
            if codec.device != "cuda":
                cols = tuple(c.tolist() for c in cols)
            codec.decode(src, cols[0], cols[1], stream, cols[2], cols[3])
    if direct:
        return
    pos = 0
    for job, i, j, a, b in grp:
        part = stream[pos:pos + (b - a)]
        dst = job.out[a:b]
        if job.tf is not None:
            if dst.device.type == work:
                job.tf.decode(part, dst)
            else:
                tmp = torch.empty_like(part)
                job.tf.decode(part, tmp)
                dst.copy_(tmp)
        else:
            dst.copy_(part)
        pos += b - a


def read_stored(fd: int, batch: np.ndarray, pinned: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Read a batch's stored chunks into one host buffer and verify their checksums. Returns the
    buffer (leased from :data:`PINNED` when ``pinned``: the caller releases it; released here
    on an error) and each chunk's offset in it (16-byte aligned when the file's chunks are)."""
    stored = batch["stored"].astype(np.int64)
    fo = batch["offset"].astype(np.int64)
    n = len(batch)
    span = int(fo[-1] + stored[-1] - fo[0]) if n else 0
    in_order = n > 0 and bool(np.all(fo[1:] >= fo[:-1] + stored[:-1]))
    if in_order and span <= int(stored.sum()) + ALIGN * n:  # one read covers the batch
        offs = fo - fo[0]
        total = span
    else:
        padded = _ceil16(stored)
        offs = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        total = int(padded.sum())
    buf = PINNED.acquire(total) if pinned else torch.empty(total, dtype=torch.uint8)
    try:
        return buf, _read_into(fd, batch, buf, fo, offs, stored, in_order and total == span)
    except BaseException:
        if pinned:
            PINNED.release(buf)
        raise


def _read_into(fd: int, batch: np.ndarray, buf: torch.Tensor, fo: np.ndarray, offs: np.ndarray,
               stored: np.ndarray, one_read: bool) -> list[int]:
    n = len(batch)
    b = buf.numpy()
    if one_read:
        pread_into(fd, memoryview(b), int(fo[0]))
    else:
        for k in range(n):
            pread_into(fd, memoryview(b[offs[k]:offs[k] + stored[k]]), int(fo[k]))
    sums = _checksums(b, offs, stored)
    for k in range(n):
        if sums[k] != int(batch["xxh3"][k]):
            raise ChecksumError(f"chunk at file offset {int(fo[k])} fails its checksum")
    return offs.tolist()


_SUM_POOL = None


def _checksums(b: np.ndarray, offs, stored) -> list[int]:
    """XXH3-64 of every chunk; large batches are hashed by four threads, each taking a
    contiguous quarter of the chunks (xxhash releases the GIL on large inputs)."""
    n = len(offs)

    def run(ks) -> list[int]:
        return [checksum(memoryview(b[offs[k]:offs[k] + stored[k]])) for k in ks]
    if int(np.sum(stored)) < (32 << 20) or n < 4:
        return run(range(n))
    global _SUM_POOL
    if _SUM_POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _SUM_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptzip-sum")
    return [x for part in _SUM_POOL.map(run, np.array_split(np.arange(n), 4)) for x in part]
