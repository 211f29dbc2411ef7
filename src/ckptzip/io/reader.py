"""Reading stored chunks: one read per batch where the chunks lie in order, every checksum
verified before any byte reaches a decoder, except those the caller hashes on the GPU
(``gpu_hash``: chunks of more than 240 bytes at 8-byte aligned offsets, checked by the GPU
decode loop before it returns, see :func:`ckptzip.engine.decode.decode_jobs`)."""
from __future__ import annotations

import numpy as np
import torch

from ..engine.memory import ALIGN, HOST, PINNED, ceil_align
from ..errors import ChecksumError
from ..format import FOOTER_SIZE, HEADER_SIZE, check_header, checksum, parse_footer
from ..kernels import HASH_MIN
from .. import native
from ..storage import READ_THREADS, pread_exact, pread_into, pread_ranges, read_pool, run_all, will_need


def read_manifest(src, size: int) -> tuple[bytearray, int, int]:
    """The manifest bytes of a checkpoint of ``size`` bytes (an fd or a positional-read source),
    its offset (the data section's end) and the footer's XXH3-64 of it; the header and footer
    are checked first (named errors for a file that is not a checkpoint or is cut short)."""
    head = bytearray(min(size, HEADER_SIZE))
    if head:
        pread_into(src, memoryview(head), 0)
    check_header(bytes(head))
    if size < HEADER_SIZE + FOOTER_SIZE:
        parse_footer(b"", size)
    foot = bytearray(FOOTER_SIZE)
    pread_into(src, memoryview(foot), size - FOOTER_SIZE)
    off, length, digest = parse_footer(bytes(foot), size)
    raw = bytearray(length)
    pread_into(src, memoryview(raw), off)
    return raw, off, digest


def read_stored(fd: int, batch: np.ndarray, pinned: bool = False, gpu_hash: bool = False,
                defer: np.ndarray | None = None) -> tuple[torch.Tensor, list[int], np.ndarray | None]:
    """Read a batch's stored chunks into one host buffer and verify their checksums. Returns the
    buffer (leased from :data:`PINNED` when ``pinned``: the caller releases it; released here
    on an error) and each chunk's offset in it (16-byte aligned when the file's chunks are).
    Third: None, or with ``gpu_hash`` the indices of the chunks not verified here (more than 240
    bytes at 8-byte aligned offsets), for the caller to verify on the GPU. ``defer``: a mask of
    chunks not verified here either; the caller verifies them (:func:`verify`) before it decodes
    them. From an in-memory source (``storage.FileObjectSource.mem``), the buffer is a view of the
    source's own bytes, not a copy: callers only read it."""
    stored = batch["stored"].astype(np.int64)
    fo = batch["offset"].astype(np.int64)
    n = len(batch)
    if n and not pinned and getattr(fd, "mem", None) is not None:
        # an in-memory source (storage.FileObjectSource.view): the chunks are verified and
        # decoded where they lie, nothing is copied
        lo = int(fo.min())
        buf = fd.view(lo, int((fo + stored).max()) - lo)
        offs = fo - lo
        host = np.ones(n, dtype=bool) if defer is None else ~defer
        _verify_hashed(batch, host, checksums(buf.numpy(), offs, stored, host))
        return buf, offs.tolist(), None
    span = int(fo[-1] + stored[-1] - fo[0]) if n else 0
    in_order = n > 0 and bool(np.all(fo[1:] >= fo[:-1] + stored[:-1]))
    if in_order and span <= int(stored.sum()) + ALIGN * n:  # one read covers the batch
        offs = fo - fo[0]
        total = span
    else:
        padded = ceil_align(stored)
        offs = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
        total = int(padded.sum())
    buf = PINNED.acquire(total) if pinned else HOST.take(total)
    later = np.nonzero((stored >= HASH_MIN) & (offs % 8 == 0))[0] if gpu_hash else None
    try:
        return buf, _read_into(fd, batch, buf, fo, offs, stored, in_order and total == span, later, defer), later
    except BaseException:
        if pinned:
            PINNED.release(buf)
        raise


def _read_into(fd, batch: np.ndarray, buf: torch.Tensor, fo: np.ndarray, offs: np.ndarray,
               stored: np.ndarray, one_read: bool, later: np.ndarray | None = None,
               defer: np.ndarray | None = None) -> list[int]:
    n = len(batch)
    b = buf.numpy()
    total = int(stored.sum())
    host = np.ones(n, dtype=bool)  # chunks verified here (the others: on the GPU, by the caller)
    if later is not None:
        host[later] = False
    if defer is not None:
        host &= ~defer
    # (per chunk, Python lists and memoryview slices: numpy scalars cost several times more,
    # which counts for files of 16 KiB chunks)
    mv, ol, sl, hl = memoryview(b), offs.tolist(), stored.tolist(), host.tolist()
    if isinstance(fd, int) and READ_THREADS > 1 and total >= _PARALLEL_MIN and native.lib is not None:
        # local file: every range read by threads in C, then the host's checksums
        if one_read:
            pread_ranges(fd, b, fo[:1], [0], [int(offs[-1] + stored[-1])])
        else:
            pread_ranges(fd, b, fo, offs, stored)
        sums = checksums(b, offs, stored, host) if host.any() else [None] * n
    elif isinstance(fd, int) and n > 1 and READ_THREADS > 1 and total >= _PARALLEL_MIN:
        # local file: the chunks in contiguous parts, each read and checksummed by one thread
        # of the pool while its bytes are still in the CPU's cache
        ends = np.cumsum(stored)
        cuts = np.searchsorted(ends, np.arange(1, 2 * READ_THREADS) * (total / (2 * READ_THREADS)))
        bounds = sorted({0, n, *[int(c) + 1 for c in cuts if c + 1 < n]})

        def part(ab: tuple[int, int]) -> list[int]:
            a, z = ab
            if one_read:
                pread_exact(fd, memoryview(b[offs[a]:offs[z - 1] + stored[z - 1]]), int(fo[a]))
            else:
                for k in range(a, z):
                    pread_exact(fd, memoryview(b[offs[k]:offs[k] + stored[k]]), int(fo[k]))
            return [checksum(mv[ol[k]:ol[k] + sl[k]]) if hl[k] else None for k in range(a, z)]
        pool = read_pool()
        sums = [x for got in run_all([pool.submit(part, ab) for ab in zip(bounds[:-1], bounds[1:])]) for x in got]
    elif one_read:
        pread_into(fd, memoryview(b), int(fo[0]))
        sums = checksums(b, offs, stored, host)
    else:
        for k in range(n):
            pread_into(fd, memoryview(b[offs[k]:offs[k] + stored[k]]), int(fo[k]))
        sums = checksums(b, offs, stored, host)
    if n:
        will_need(fd, int(fo[-1] + stored[-1]))
    _verify_hashed(batch, host, sums)
    return ol


def _verify_hashed(batch: np.ndarray, host: np.ndarray, sums: list[int | None]) -> None:
    """:func:`_verify` for the chunks ``host`` marks, whose XXH3 :func:`checksums` gave in ``sums``."""
    ks = np.nonzero(host)[0]
    _verify(batch, ks, np.fromiter((sums[k] for k in ks.tolist()), dtype=np.uint64, count=len(ks)))


def verify(buf: np.ndarray, offs: np.ndarray, batch: np.ndarray) -> None:
    """ChecksumError for the first chunk of ``batch`` (chunk-table rows) whose bytes at ``offs``
    in ``buf`` fail their XXH3 (the chunks a read left to its caller: ``defer``)."""
    got = np.array(checksums(buf, offs, batch["stored"]), dtype=np.uint64)
    _verify(batch, np.arange(len(batch)), got)


def _verify(batch: np.ndarray, ks: np.ndarray, got: np.ndarray) -> None:
    """ChecksumError for the first of the chunks ``ks`` whose XXH3 ``got`` (uint64) is not the
    chunk table's."""
    bad = ks[got != batch["xxh3"][ks].astype(np.uint64)]
    if len(bad):
        raise ChecksumError(f"chunk at file offset {int(batch['offset'][bad[0]])} fails its checksum")


#: batches from this size on are read and checksummed in parallel parts (local files)
_PARALLEL_MIN = 8 << 20


def read_split(fd: int, batch: np.ndarray, stream: np.ndarray, roffs: np.ndarray,
               to_stream: np.ndarray, defer: np.ndarray | None = None) -> tuple[torch.Tensor, list[int]]:
    """A CPU decode group's chunks read with its stream laid out already: the chunks
    ``to_stream`` marks (stored raw, and not decoded where they lie in the buffer) straight into
    their places ``roffs`` in ``stream`` (no copy afterwards), the others into a host buffer.
    Every checksum is verified before anything is decoded, here or, for the buffered chunks
    ``defer`` marks, by the caller (:func:`verify`). Returns the buffer and each chunk's offset
    in it (0 for those in the stream). Local files, C extension only
    (:func:`~ckptzip.storage.pread_ranges`)."""
    stored = batch["stored"].astype(np.int64)
    fo = batch["offset"].astype(np.int64)
    buffered = ~to_stream
    padded = np.where(buffered, ceil_align(stored), 0)
    soffs = np.cumsum(padded) - padded
    buf = HOST.take(int(padded.sum()))
    b = buf.numpy()
    roffs = np.asarray(roffs, dtype=np.int64)
    pread_ranges(fd, stream, fo[to_stream], roffs[to_stream], stored[to_stream])
    pread_ranges(fd, b, fo[buffered], soffs[buffered], stored[buffered])
    here = buffered if defer is None else buffered & ~defer
    sums = np.zeros(len(batch), dtype=np.uint64)
    if to_stream.any():
        sums[to_stream] = np.array(checksums(stream, roffs[to_stream], stored[to_stream]), dtype=np.uint64)
    if here.any():
        sums[here] = np.array(checksums(b, soffs[here], stored[here]), dtype=np.uint64)
    if len(batch):
        will_need(fd, int(fo[-1] + stored[-1]))
    ks = np.nonzero(to_stream | here)[0]
    _verify(batch, ks, sums[ks])
    return buf, soffs.tolist()


#: chunks of at least this many bytes in all are hashed by the read pool's threads
HASH_PARALLEL_MIN = 32 << 20


def _checksums_c(b: np.ndarray, offs, stored, which: np.ndarray | None) -> list[int | None]:
    """:func:`checksums` by ``native.lib.xxh3_many``, large batches in parts on the read pool."""
    offs = np.ascontiguousarray(offs, dtype=np.int64)
    stored = np.ascontiguousarray(stored, dtype=np.int64)
    keep = np.ones(len(offs), dtype=bool) if which is None else np.asarray(which, dtype=bool)
    ks = np.nonzero(keep)[0]
    got = np.zeros(len(ks), dtype=np.uint64)
    o, z = offs[ks], stored[ks]
    if int(z.sum()) < HASH_PARALLEL_MIN or len(ks) < 4 or READ_THREADS < 2:
        native.lib.xxh3_many(b, o, z, got)
    else:
        parts = [p for p in np.array_split(np.arange(len(ks)), READ_THREADS) if len(p)]
        list(read_pool().map(lambda p: native.lib.xxh3_many(b, o[p[0]:p[-1] + 1], z[p[0]:p[-1] + 1],
                                                             got[p[0]:p[-1] + 1]), parts))
    if which is None:
        return got.tolist()
    out: list[int | None] = [None] * len(offs)
    for k, v in zip(ks.tolist(), got.tolist()):
        out[k] = v
    return out


def checksums(b: np.ndarray, offs, stored, which: np.ndarray | None = None) -> list[int | None]:
    """XXH3-64 of every chunk (of those ``which`` marks; None for the others); large batches are
    hashed by the read pool's threads, each taking a contiguous part of the chunks (xxhash
    releases the GIL on large inputs)."""
    n = len(offs)
    if native.XXH3 and native.lib is not None:  # in C, without the GIL (see native.XXH3)
        return _checksums_c(b, offs, stored, which)
    mv, ol, sl = memoryview(b), np.asarray(offs).tolist(), np.asarray(stored).tolist()
    wl = which.tolist() if which is not None else None

    def run(ks) -> list[int | None]:
        return [checksum(mv[ol[k]:ol[k] + sl[k]]) if wl is None or wl[k] else None for k in ks]
    if int(np.sum(stored)) < HASH_PARALLEL_MIN or n < 4 or READ_THREADS < 2:
        return run(range(n))
    return [x for part in read_pool().map(run, [range(a[0], a[-1] + 1) for a in np.array_split(np.arange(n), READ_THREADS) if len(a)])
            for x in part]
