"""CPU implementations of the standard wire formats: ``raw``, ``zstd`` (zstd frames) and
``deflate`` (raw RFC 1951 deflate streams). Chunks are processed in parallel threads; both
libraries release the GIL while they work."""
from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import torch
import zstandard

from .. import native
from ..errors import CodecError
from .base import Codec, register

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=cpu_threads(),
                                       thread_name_prefix="ckptzip")
        return _POOL


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU uint8 tensor."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU uint8 tensor")
    return t.numpy()


def cpu_threads() -> int:
    """Threads for CPU work: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def pmap(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``[fn(i) for i in range(n)]`` on the CPU pool. Every item has finished before this
    returns or raises (the first item's error): a failed decode never leaves a pool thread still
    writing into the caller's tensors."""
    # inline when there is one item, or when called from a pool thread (no nested waits)
    if n <= 1 or threading.current_thread().name.startswith("ckptzip_"):
        return [fn(i) for i in range(n)]
    futs = [_pool().submit(fn, i) for i in range(n)]
    concurrent.futures.wait(futs)
    return [f.result() for f in futs]


#: CPU work on at least this many bytes is split between the pool's threads (byteplane passes,
#: raw-chunk copies); smaller work runs on the caller's thread
PARALLEL_BYTES = 4 << 20


def runs(sizes: list[int], most: int) -> list[range]:
    """Consecutive index runs of ``sizes`` (at most ``most`` of them when there are more items),
    cut where the running total crosses equal shares of the sum."""
    n = len(sizes)
    if n <= most:
        return [range(k, k + 1) for k in range(n)]
    cum = np.cumsum(np.asarray(sizes, dtype=np.int64))
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, most) / most, side="right")
    edges = sorted(set([0, *cuts.tolist(), n]))
    return [range(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def pmap_sized(fn: Callable[[int], Any], sizes: list[int], inline_small: bool = False) -> None:
    """``fn(k)`` for every item ``k`` (of ``sizes[k]`` bytes) on the CPU pool: many small items
    go in a few runs of about equal bytes (one pool task each cost more in the pool's futures
    than the work), large ones one task each. ``inline_small``: on the caller's thread where the
    items hold less than PARALLEL_BYTES in all (loops of C calls over small storages)."""
    if inline_small and sum(sizes) < PARALLEL_BYTES:
        for k in range(len(sizes)):
            fn(k)
        return
    rs = runs(sizes, 4 * cpu_threads())
    pmap(lambda r: [fn(k) for k in rs[r]], len(rs))


def pmap_balanced(fn: Callable[[int], Any], costs: list[float], least: float,
                  first: Callable[[], Any] | None = None) -> None:
    """``fn(k)`` for every item ``k``, the costliest first, on the calling thread and
    ``cpu_threads() - 1`` of the pool's, each taking the next task as it comes free: the last
    tasks, the cheapest, even out the threads' ends (pieces of one decode differ 2-4x in time),
    and the caller, which would only wait, does a thread's share. Cheap items go together in
    tasks of at least ``least`` cost; one task runs on the calling thread alone. ``first``:
    other work the calling thread does before it takes tasks (while the pool's threads take
    the costliest; work that itself calls the pool would wait behind them). Every item has
    finished before this returns or raises (the first error raised, ``first``'s before the
    items')."""
    order = sorted(range(len(costs)), key=costs.__getitem__, reverse=True)
    tasks: list[list[int]] = []
    acc = 0.0
    for k in order:
        if not tasks or acc >= least:
            tasks.append([])
            acc = 0.0
        tasks[-1].append(k)
        acc += costs[k]
    helpers = min(cpu_threads(), len(tasks) + (first is not None)) - 1
    if helpers < 1 or threading.current_thread().name.startswith("ckptzip_"):
        failed: BaseException | None = None  # (as below: first's error once the items are done)
        if first is not None:
            try:
                first()
            except BaseException as e:
                failed = e
        try:
            for t in tasks:
                for k in t:
                    fn(k)
        except BaseException:
            if failed is None:
                raise
        if failed is not None:
            raise failed
        return
    todo = iter(tasks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                t = next(todo, None)
            if t is None:
                return
            for k in t:
                try:
                    fn(k)
                except BaseException as e:  # (raised once every item is done)
                    errors.append(e)
    futs = [_pool().submit(work) for _ in range(helpers)]
    try:
        if first is not None:
            try:
                first()
            except BaseException as e:  # (raised once every item is done)
                errors.insert(0, e)
        work()
    finally:  # (a helper still queued behind other work has nothing left to take: cancelled,
        # not waited for; a cancelled future counts as done only once a worker dequeues it)
        concurrent.futures.wait([f for f in futs if not f.cancel()])
    if errors:
        try:
            raise errors[0]
        finally:  # (the list would keep the error's frames, and their tensors, in a cycle)
            errors.clear()


def _concat(outs: list) -> tuple[torch.Tensor, list[int], list[int]]:
    """Compressed chunks (buffers) back to back in one uint8 tensor: (tensor, offsets, sizes)."""
    out_sizes = [len(o) for o in outs]
    out_offsets = np.concatenate([[0], np.cumsum(out_sizes[:-1], dtype=np.int64)]).tolist() if outs else []
    from ..engine.memory import HOST  # (here: the engine imports this module)
    dst = HOST.take(sum(out_sizes))
    d = dst.numpy()
    for o, off, n in zip(outs, out_offsets, out_sizes):
        d[off:off + n] = np.frombuffer(o, dtype=np.uint8)
    return dst, out_offsets, out_sizes

class _ByteCodec(Codec):
    """Shared driver: per-chunk ``_compress(bytes)->bytes`` and ``_decompress(bytes, n)->bytes``."""

    def _compress(self, data: memoryview) -> bytes:
        raise NotImplementedError

    def _decompress(self, data: memoryview, n: int) -> bytes:
        raise NotImplementedError

    def encode(self, src, offsets, sizes):
        a = as_numpy(src)
        outs = pmap(lambda i: self._compress(memoryview(a[offsets[i]:offsets[i] + sizes[i]])),
                     len(sizes))
        return _concat(outs)

    def decode(self, src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes):
        a, d = as_numpy(src), as_numpy(dst)

        def one(i: int) -> None:
            n = dst_sizes[i]
            try:
                out = self._decompress(memoryview(a[src_offsets[i]:src_offsets[i] + src_sizes[i]]), n)
            except CodecError:
                raise
            except Exception as e:  # library errors on corrupt streams become named errors
                raise CodecError(f"{self.wire_id}: chunk {i} does not decode: {e}") from None
            if len(out) != n:
                raise CodecError(f"{self.wire_id}: chunk {i} decoded to {len(out)} bytes, expected {n}")
            d[dst_offsets[i]:dst_offsets[i] + n] = np.frombuffer(out, dtype=np.uint8)

        pmap(one, len(src_sizes))


@register
class RawCPU(_ByteCodec):
    """Identity: the chunk is stored as is."""
    wire_id: ClassVar[str] = "raw"

    def _compress(self, data):
        return bytes(data)

    def _decompress(self, data, n):
        return bytes(data)


#: zstd parameters for byte planes (local option ``planes=1``): fast strategy, matches of 7+ bytes only
#: and a tiny hash table. Exponent planes are near-random runs of a few values: matches barely
#: pay, the Huffman-coded literals do the work. On trained fp32 exponent planes this is smaller
#: than level 1 or 3 (0.315 vs 0.345 / 0.365 of the raw bytes) and 2x faster than level 1.
PLANE_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6,
                    search_log=1, min_match=7, target_length=0, write_content_size=1)
#: byte planes through the system's libzstd where it is found (``native.lib.zstd_encode``):
#: PLANE_PARAMS' match finder with acceleration 256, and the literals Huffman-coded, which
#: libzstd turns off for an accelerated fast strategy unless asked (experimental parameter
#: ZSTD_c_literalCompressionMode = huffman). The same standard frames, which any zstd decodes;
#: on the fp32 / bf16 planes of the CPU benchmark state 1.6x faster to compress, 1.5x faster to
#: decompress and 0.2-2 % smaller than PLANE_PARAMS (docs/benchmarks.md, "Eighteenth session").
#: (id, value) pairs of ZSTD_cParameter: strategy fast, windowLog, hashLog, chainLog, searchLog,
#: minMatch, targetLength, contentSizeFlag, checksumFlag, literalCompressionMode
FAST_PLANE_PARAMS = ((107, 1), (101, 17), (102, 6), (103, 6), (104, 1), (105, 7), (106, 256),
                     (200, 1), (201, 0), (1002, 1))
_FAST_OK: bool | None = None


def _fast_planes() -> bool:
    """Whether the native plane compressor works here (libzstd found, its parameters taken)."""
    global _FAST_OK
    if _FAST_OK is None:
        ok = False
        lib = native.lib
        if lib is not None and lib.zstd_version():
            try:
                src = np.arange(256, dtype=np.uint8)
                dst, out = np.zeros(1024, dtype=np.uint8), np.zeros(1, dtype=np.int64)
                one = np.asarray([0], dtype=np.int64)
                err = lib.zstd_encode(src, dst, one, one + 256, one, one + 1024, out, _params())
                ok = err is None and bytes(zstandard.ZstdDecompressor().decompress(dst[:int(out[0])].tobytes())) == src.tobytes()
            except Exception:
                ok = False
        _FAST_OK = ok
    return _FAST_OK


def _params() -> np.ndarray:
    return np.asarray(FAST_PLANE_PARAMS, dtype=np.int32).reshape(-1)


def _bounds(sizes: np.ndarray) -> np.ndarray:
    """ZSTD_COMPRESSBOUND of each size: room for any input's frame."""
    small = (128 << 10) - sizes
    return sizes + (sizes >> 8) + np.where(small > 0, small >> 11, 0)


#: zstd calls over at least this many bytes are split between the pool's threads: zstd runs at
#: 0.35-1.3 GB/s per core (byte planes, compress / decompress), so far smaller work pays for
#: the pool than the byteplane passes' PARALLEL_BYTES (a CPU save's 8 MiB groups had 2-3 MB of
#: coded planes each, compressed on one thread in 6.6-8 ms)
ZSTD_PARALLEL_BYTES = 512 << 10


#: zstd work over ZSTD_PARALLEL_BYTES is cut into this many runs per thread, taken largest first
#: as threads come free: frames of exponent planes take about twice as long per byte as those
#: of mantissa planes, and a storage's parts differ (weights, Adam's moments), so two runs of
#: equal bytes left one thread idle for up to half of a call
ZSTD_RUNS_PER_THREAD = 4


def _native_runs(call: Callable, cols: list, sizes: np.ndarray) -> None:
    """``call(*(c[run] for c in cols))`` (a :mod:`ckptzip._bpnative` zstd call over chunks) for
    runs of chunks of about equal ``sizes`` bytes, shared by the calling thread and the CPU
    pool's (:func:`pmap_balanced`), one run for small work; the first ``(index, message)`` a
    call returns becomes a CodecError naming the chunk (index -1: the call as a whole)."""
    n = len(sizes)
    big = int(sizes.sum()) >= ZSTD_PARALLEL_BYTES
    rs = runs(sizes.tolist(), ZSTD_RUNS_PER_THREAD * cpu_threads()) if big else [range(n)]
    errs: list = [None] * len(rs)

    def one(k: int) -> None:
        errs[k] = call(*(c[rs[k].start:rs[k].stop] for c in cols))
    pmap_balanced(one, [float(sizes[r.start:r.stop].sum()) for r in rs], 0.0)
    for r, e in zip(rs, errs):
        if e is not None:
            raise CodecError(f"zstd: chunk {r.start + max(e[0], 0)} {e[1]}")


def native_zstd() -> bool:
    """Whether zstd frames are decoded by the system's libzstd through the C extension (else by
    python-zstandard)."""
    return native.lib is not None and bool(native.lib.zstd_version())


#: False: byte planes through python-zstandard with PLANE_PARAMS (tests compare both)
FAST_PLANES = True
#: below this many bytes per call, chunks are (de)compressed on the calling thread
_MULTI_MIN = 1 << 20


def _segments(offsets, sizes) -> bytes:
    seg = np.empty((len(sizes), 2), dtype="<u8")
    seg[:, 0], seg[:, 1] = offsets, sizes
    return seg.tobytes()


@register
class ZstdCPU(_ByteCodec):
    """Standard zstd frames (RFC 8878) through the ``zstandard`` library. With its C backend,
    all chunks of a call are (de)compressed by ``multi_*_to_buffer`` in C threads, without
    the GIL and without Python per chunk."""
    wire_id: ClassVar[str] = "zstd"

    @classmethod
    def local_keys(cls):
        return ("level", "planes")

    def __init__(self, **config):
        super().__init__(**config)
        self.level = int(config.get("level", 3))
        self.planes = bool(config.get("planes", False))
        self._tls = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        c = getattr(self._tls, "c", None)
        if c is None:
            if self.planes:
                c = zstandard.ZstdCompressor(
                    compression_params=zstandard.ZstdCompressionParameters(**PLANE_PARAMS))
            else:
                c = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            self._tls.c = c
        return c

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._tls, "d", None)
        if d is None:
            d = self._tls.d = zstandard.ZstdDecompressor()
        return d

    @staticmethod
    def _multi(sizes) -> int:
        """Threads for one multi-buffer call, or 0 to use the per-chunk path (the CFFI backend
        has no multi-buffer calls; empty chunks are not accepted by them)."""
        if zstandard.backend != "cext" or not sizes or min(sizes) == 0:
            return 0
        total = sum(sizes)
        return max(1, min(cpu_threads(), len(sizes), total // _MULTI_MIN or 1))

    def encode(self, src, offsets, sizes):
        if self.planes and len(sizes) and FAST_PLANES and _fast_planes():
            return self._encode_native(src, offsets, sizes)
        threads = self._multi(sizes)
        if not threads:
            return super().encode(src, offsets, sizes)
        a = as_numpy(src)
        res = self._cctx().multi_compress_to_buffer(
            zstandard.BufferWithSegments(memoryview(a), _segments(offsets, sizes)), threads=threads)
        return _concat([res[i] for i in range(len(res))])

    def decode(self, src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes):
        if native_zstd() and len(dst_sizes):
            return self._decode_native(src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes)
        threads = self._multi(dst_sizes)
        if not threads:
            return super().decode(src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes)
        a, d = as_numpy(src), as_numpy(dst)
        # the same refusal as the per-chunk path, for every frame, before anything is allocated
        for i, (so, ss, n) in enumerate(zip(src_offsets, src_sizes, dst_sizes)):
            try:
                declared = zstandard.frame_content_size(memoryview(a[so:so + ss]))
            except Exception as e:
                raise CodecError(f"zstd: chunk {i} does not decode: {e}") from None
            if declared >= 0 and declared != n:
                raise CodecError(f"zstd: frame declares {declared} bytes, the chunk table {n}")
        # decompressed_sizes (the chunk table's raw sizes) bound every output: a frame that
        # decodes to more or fewer bytes than its row declares is refused, and the one output
        # buffer is exactly the sum of the declared raw sizes
        try:
            res = self._dctx().multi_decompress_to_buffer(
                zstandard.BufferWithSegments(memoryview(a), _segments(src_offsets, src_sizes)),
                decompressed_sizes=np.asarray(dst_sizes, dtype="<u8").tobytes(), threads=threads)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd: chunk does not decode: {e}") from None
        if len(res) != len(dst_sizes):
            raise CodecError(f"zstd: {len(res)} chunks decoded, expected {len(dst_sizes)}")
        for i, (off, n) in enumerate(zip(dst_offsets, dst_sizes)):
            seg = np.frombuffer(res[i], dtype=np.uint8)
            if len(seg) != n:
                raise CodecError(f"zstd: chunk {i} decoded to {len(seg)} bytes, expected {n}")
            d[off:off + n] = seg

    @staticmethod
    def _encode_native(src, offsets, sizes):
        """Byte planes with :data:`FAST_PLANE_PARAMS`, every frame straight into its slot of one
        output buffer (sized by the compress bound), in runs of about equal bytes on the CPU pool."""
        from ..engine.memory import HOST  # (here: the engine imports this module)
        a = as_numpy(src)
        so, ss = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
        caps = _bounds(ss)
        doffs = np.zeros(len(caps), dtype=np.int64)
        np.cumsum(caps[:-1], out=doffs[1:])
        dst = HOST.take(int(caps.sum()))
        d = dst.numpy()
        got = np.zeros(len(ss), dtype=np.int64)
        par = _params()
        _native_runs(lambda *c: native.lib.zstd_encode(a, d, *c, par), [so, ss, doffs, caps, got], ss)
        return dst, doffs.tolist(), got.tolist()

    @staticmethod
    def _decode_native(src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes):
        """The frames straight into their slots of ``dst`` with the system's libzstd, in runs of
        about equal bytes on the CPU pool (no result buffers, no Python per chunk)."""
        a, d = as_numpy(src), as_numpy(dst)
        cols = [np.asarray(c, dtype=np.int64) for c in (src_offsets, src_sizes, dst_offsets, dst_sizes)]
        _native_runs(lambda *c: native.lib.zstd_decode(a, d, *c), cols, cols[3])

    def _compress(self, data):
        return self._cctx().compress(data)

    def _decompress(self, data, n):
        # Never trust the frame header: zstandard's one-shot decompress() allocates the content
        # size a frame declares and ignores max_output_size then (a 33 KB frame can claim GBs).
        # A declared size other than n is refused before anything is allocated; otherwise (and
        # for frames without a content size, as nvCOMP writes them) the frame is streamed into
        # at most n + 1 bytes, so a chunk never costs more than its declared raw size.
        declared = zstandard.frame_content_size(data)
        if declared >= 0 and declared != n:
            raise CodecError(f"zstd: frame declares {declared} bytes, the chunk table {n}")
        if declared == n:
            return self._dctx().decompress(data)  # allocates exactly the n bytes declared
        parts, got = [], 0
        with self._dctx().stream_reader(data, read_across_frames=False, read_size=1 << 17) as r:
            while got <= n:
                part = r.read(n + 1 - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
        if got != n:
            raise CodecError(f"zstd: chunk decodes to {'more' if got > n else 'fewer'} than the "
                             f"declared {n} bytes")
        return parts[0] if len(parts) == 1 else b"".join(parts)


@register
class DeflateCPU(_ByteCodec):
    """Raw deflate streams (RFC 1951, no zlib/gzip wrapper) through the standard library."""
    wire_id: ClassVar[str] = "deflate"

    @classmethod
    def local_keys(cls):
        return ("level",)

    def _compress(self, data):
        c = zlib.compressobj(int(self.config.get("level", 6)), zlib.DEFLATED, -15)
        return c.compress(data) + c.flush()

    def _decompress(self, data, n):
        # max_length bounds the output (and the allocation) by the declared raw size
        d = zlib.decompressobj(-15)
        out = d.decompress(data, n)
        if d.unconsumed_tail or not d.eof or len(out) != n:
            raise CodecError("deflate: stream longer than declared or incomplete")
        return out
