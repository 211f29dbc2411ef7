"""nvCOMP's batched C API through ctypes, for the codecs on the throughput path (ANS, Zstd).

The Python binding (``nvidia.nvcomp``) allocates and frees pinned host memory around every call,
and ``cudaFreeHost`` waits for the whole device, so no call could overlap the GPU work queued
before it. Called directly, a batched call is: one pinned host-to-device copy of the chunk table
(pointers and sizes), the kernel launch, and, for compression, one device-to-host copy of the
compressed sizes and statuses. Temporary memory comes from torch's caching allocator on the
current stream. Nothing here synchronizes except reading compressed sizes back
(:meth:`Batch.sizes`); decode statuses are checked when the caller asks (:func:`check_decodes`).

Everything nvCOMP is told comes from sizes we validated: chunk sizes within the algorithm's limit,
output slots of at least nvCOMP's worst-case compressed size, decode outputs we allocated with the
sizes our manifest declares. The same bitstreams as the Python binding's RAW kind are produced and
read (the binding calls these functions).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import struct
import threading

import numpy as np
import torch

from ..errors import CodecError

_DTYPES = {"|i1": 0, "|u1": 1, "|f1": 9, "<f2": 10, "<f4": 11}
_DEFAULT_BACKEND = 0
_TYPE_BITS = 0xFF


class _Opts(ctypes.Structure):
    """Every options struct of the algorithms used here is 64 bytes, 4-byte aligned."""
    _fields_ = [("words", ctypes.c_uint32 * 16)]

    @classmethod
    def of(cls, raw: bytes) -> "_Opts":
        o = cls()
        ctypes.memmove(ctypes.addressof(o), raw.ljust(64, b"\0"), 64)
        return o


def ans_opts(data_type: str = "|u1", max_sub_chunk_count: int = 0) -> tuple[_Opts, _Opts]:
    """(compress, decompress) options for ANS; the decoder reads the data type from the stream."""
    if data_type not in _DTYPES:
        raise CodecError(f"ANS data_type {data_type!r} not in {sorted(_DTYPES)}")
    comp = struct.pack("<iiBBB", 0, _DTYPES[data_type], int(max_sub_chunk_count), 0, 0)
    dec = struct.pack("<iIBBB", _DEFAULT_BACKEND, _TYPE_BITS, 0, 0, 0)
    return _Opts.of(comp), _Opts.of(dec)


def zstd_opts() -> tuple[_Opts, _Opts]:
    return _Opts.of(b""), _Opts.of(struct.pack("<i", _DEFAULT_BACKEND))


#: nvCOMP's Deflate algorithms (0: Huffman only ... 5: highest ratio); the config check of
#: :class:`ckptzip.codecs.gpu.DeflateGPU` and :func:`deflate_opts` both use this range
DEFLATE_ALGORITHMS = range(6)


def deflate_opts(algorithm: int = 1) -> tuple[_Opts, _Opts]:
    """(compress, decompress) options for Deflate. ``algorithm`` steers only the encoder: 0 is
    entropy coding only (Huffman, no matches: no scratch memory, 40-65 GB/s on an H100), 1
    nvCOMP's default (matches + Huffman), up to 5 (highest ratio); every one writes standard raw
    deflate streams."""
    if type(algorithm) is not int or algorithm not in DEFLATE_ALGORITHMS:
        raise CodecError(f"Deflate algorithm {algorithm!r} not in 0..{DEFLATE_ALGORITHMS[-1]}")
    return _Opts.of(struct.pack("<i", algorithm)), _Opts.of(struct.pack("<ii", _DEFAULT_BACKEND, 0))


_SZ = ctypes.c_size_t
_P = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _lib():
    """libnvcomp.so.6 from the nvidia-libnvcomp wheel (the one the Python binding loaded)."""
    import nvidia.libnvcomp as pkg  # noqa: PLC0415
    base = os.path.dirname(pkg.__file__)
    for sub in ("lib64", "lib", "bin"):
        path = os.path.join(base, sub, "libnvcomp.so.6")
        if os.path.isfile(path):
            lib = ctypes.CDLL(path, ctypes.RTLD_LOCAL)
            break
    else:
        raise OSError(f"libnvcomp.so.6 not found under {base}")
    for alg in ("ANS", "Zstd", "Deflate"):
        p = f"nvcompBatched{alg}"
        _sig(lib, p + "CompressGetMaxOutputChunkSize", [_SZ, _Opts, ctypes.POINTER(_SZ)])
        _sig(lib, p + "CompressGetTempSize", [_SZ, _SZ, _Opts, ctypes.POINTER(_SZ), _SZ, _P])
        _sig(lib, p + "DecompressGetTempSize", [_SZ, _SZ, _Opts, ctypes.POINTER(_SZ), _SZ, _P])
        _sig(lib, p + "CompressAsync", [_P, _P, _SZ, _SZ, _P, _SZ, _P, _P, _Opts, _P, _P])
        _sig(lib, p + "DecompressAsync", [_P, _P, _P, _P, _SZ, _P, _SZ, _P, _Opts, _P, _P])
    return lib


def _sig(lib, name, args) -> None:
    f = getattr(lib, name)
    f.argtypes, f.restype = args, ctypes.c_int


def available() -> bool:
    try:
        _lib()
    except Exception:
        return False
    return True


def _call(name: str, *args) -> None:
    st = getattr(_lib(), name)(*args)
    if st != 0:
        raise CodecError(f"nvCOMP {name} returned status {st}")


@functools.lru_cache(maxsize=256)
def max_output(alg: str, comp_opts_raw: bytes, chunk: int) -> int:
    """nvCOMP's worst-case compressed size of a ``chunk``-byte chunk."""
    out = _SZ(0)
    _call(f"nvcompBatched{alg}CompressGetMaxOutputChunkSize", _SZ(chunk), _Opts.of(comp_opts_raw),
          ctypes.byref(out))
    return int(out.value)


def _table(*cols: np.ndarray, device: torch.device) -> torch.Tensor:
    """Columns of int64 uploaded as one (len(cols), n) device tensor. An asynchronous copy from
    pageable memory: CUDA stages the bytes before the call returns, without waiting for the
    device, which costs less host time than pinning a buffer for a few kilobytes."""
    return torch.from_numpy(np.stack(cols).astype(np.int64, copy=False)).to(device, non_blocking=True)


_TEMP_SIZES: dict = {}


def _temp_size(kind: str, alg: str, opts: _Opts, n: int, mx: int, total: int, stream: int) -> _SZ:
    """nvCOMP's scratch size for a batch (a host-side query, memoized: a load repeats shapes)."""
    key = (kind, alg, bytes(opts), n, mx, total)
    got = _TEMP_SIZES.get(key)
    if got is None:
        if len(_TEMP_SIZES) > 4096:
            _TEMP_SIZES.clear()
        out = _SZ(0)
        _call(f"nvcompBatched{alg}{kind}GetTempSize", _SZ(n), _SZ(mx), opts, ctypes.byref(out), _SZ(total),
              _P(stream))
        got = _TEMP_SIZES[key] = int(out.value)
    return _SZ(got)




_TEMP: dict = {}  # (device index, stream) -> scratch tensor, reused in stream order


def _temp(dev: torch.device, stream: int, n: int) -> torch.Tensor:
    """nvCOMP scratch of at least ``n`` bytes for work queued on ``stream``: reused call after
    call (stream order makes that safe), grown when a call needs more."""
    key = (dev.index, stream)
    t = _TEMP.get(key)
    if t is None or t.numel() < n:
        # the old scratch goes back to torch's allocator first (stream-ordered: work queued on
        # this stream still finishes with it), so that growing never holds both; grown in 16 MiB
        # steps, not to each call's exact size (a save's calls differ by a few bytes)
        _TEMP.pop(key, None)
        del t
        t = _TEMP[key] = torch.empty(_ceil(max(n, 1 << 20), 16 << 20), dtype=torch.uint8, device=dev)
    return t


def release_scratch() -> None:
    """Hand every cached nvCOMP scratch buffer back to torch's allocator (end of a save or
    load: the scratch is not held against the caller's GPU memory between checkpoints)."""
    _TEMP.clear()


def _ceil(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _on(dev: torch.device):
    """The device's context if it is not the current one (nvCOMP launches on the current device)."""
    if dev.index is None or dev.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(dev)


def compress(alg: str, opts: _Opts, src: torch.Tensor, offs, sizes, out: torch.Tensor, out_offs,
             cap: int) -> "Batch":
    """Compress chunks ``src[offs[i]:+sizes[i]]`` into ``out[out_offs[i]:+cap]`` (``cap`` at least
    :func:`max_output` of the largest chunk; all 16-byte aligned, checked by the caller)."""
    with _on(src.device):
        return _compress(alg, opts, src, offs, sizes, out, out_offs, cap)


def _setup(kind: str, alg: str, opts: _Opts, dev: torch.device, sizes: np.ndarray):
    """What both directions need for a batch whose uncompressed chunk sizes are ``sizes``: the
    current stream, the largest chunk, nvCOMP's scratch size and the scratch tensor."""
    stream = torch.cuda.current_stream(dev)
    mx, total = int(sizes.max()), int(sizes.sum())
    temp_n = _temp_size(kind, alg, opts, len(sizes), mx, total, stream.cuda_stream)
    return stream, mx, temp_n, _temp(dev, stream.cuda_stream, int(temp_n.value))


def _compress(alg, opts, src, offs, sizes, out, out_offs, cap) -> "Batch":
    dev = src.device
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    tab = _table(np.asarray(offs, dtype=np.int64) + src.data_ptr(), sizes,
                 np.asarray(out_offs, dtype=np.int64) + out.data_ptr(), device=dev)
    res = torch.zeros(2, n, dtype=torch.int64, device=dev)  # compressed sizes, statuses (int32)
    stream, mx, temp_n, temp = _setup("Compress", alg, opts, dev, sizes)
    _call(f"nvcompBatched{alg}CompressAsync", _P(tab[0].data_ptr()), _P(tab[1].data_ptr()), _SZ(mx), _SZ(n),
          _P(temp.data_ptr()), temp_n, _P(tab[2].data_ptr()), _P(res[0].data_ptr()), opts,
          _P(res[1].data_ptr()), _P(stream.cuda_stream))
    host = res.to("cpu", non_blocking=True)  # into pinned memory
    ev = torch.cuda.Event()
    ev.record()
    return Batch(host, ev, cap)


class Batch:
    """A launched compression; :meth:`sizes` waits for it and returns the compressed sizes."""

    def __init__(self, host: torch.Tensor, ev, cap: int) -> None:
        self._host, self._ev, self._cap = host, ev, cap

    def sizes(self) -> np.ndarray:
        self._ev.synchronize()
        got = self._host[0].numpy().copy()
        st = self._host[1].numpy().view(np.int32)[:len(got)]  # n int32 statuses at the row's start
        if (st != 0).any():
            raise CodecError(f"nvCOMP compression failed with status {int(st[st != 0][0])}")
        if not ((got > 0) & (got <= self._cap)).all():
            raise CodecError("nvCOMP compression returned impossible sizes")
        return got


_PENDING = threading.local()


def decompress(alg: str, opts: _Opts, src: torch.Tensor, offs, sizes, dst: torch.Tensor, dst_offs,
               dst_sizes) -> None:
    """Decode chunks into ``dst[dst_offs[i]:+dst_sizes[i]]`` (allocated by the caller from the
    manifest's sizes; nvCOMP does not write past them). Asynchronous: whether every chunk
    decoded to exactly its declared size is checked by :func:`check_decodes` (at once unless
    within :func:`deferred_checks`)."""
    with _on(dst.device):
        _decompress(alg, opts, src, offs, sizes, dst, dst_offs, dst_sizes)
    if not getattr(_PENDING, "depth", 0):
        check_decodes()


def _decompress(alg, opts, src, offs, sizes, dst, dst_offs, dst_sizes) -> None:
    dev = dst.device
    dst_sizes = np.asarray(dst_sizes, dtype=np.int64)
    n = len(dst_sizes)
    tab = _table(np.asarray(offs, dtype=np.int64) + src.data_ptr(), sizes,
                 np.asarray(dst_offs, dtype=np.int64) + dst.data_ptr(), dst_sizes, device=dev)
    res = torch.full((2, n), -1, dtype=torch.int64, device=dev)  # decoded sizes, statuses (int32)
    stream, _mx, temp_n, temp = _setup("Decompress", alg, opts, dev, dst_sizes)
    _call(f"nvcompBatched{alg}DecompressAsync", _P(tab[0].data_ptr()), _P(tab[1].data_ptr()),
          _P(tab[3].data_ptr()), _P(res[0].data_ptr()), _SZ(n), _P(temp.data_ptr()), temp_n,
          _P(tab[2].data_ptr()), opts, _P(res[1].data_ptr()), _P(stream.cuda_stream))
    pending = getattr(_PENDING, "items", None)
    if pending is None:
        pending = _PENDING.items = []
    pending.append((res.to("cpu", non_blocking=True), dst_sizes, stream))


@contextlib.contextmanager
def deferred_checks():
    """Within this block, decodes on this thread do not wait for their own result: the caller
    calls :func:`check_decodes` where it synchronizes anyway (and the block's end does)."""
    _PENDING.depth = getattr(_PENDING, "depth", 0) + 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _PENDING.depth -= 1
        if not _PENDING.depth:
            if ok:
                check_decodes()
            else:
                _PENDING.items = []


def pending_decodes() -> int:
    """A mark for :func:`check_decodes`' ``upto``: the count of decode calls this thread has made
    (checked or not)."""
    return getattr(_PENDING, "checked", 0) + len(getattr(_PENDING, "items", None) or ())


def check_decodes(upto: int | None = None) -> None:
    """Raise :class:`CodecError` if any decode launched by this thread since the last check
    failed or produced a size other than declared (one device-to-host copy; synchronizes).
    ``upto`` (a :func:`pending_decodes` mark): check only the calls made before the mark, which
    the caller has already waited for (an event recorded after them); later ones stay pending."""
    pending = getattr(_PENDING, "items", None)
    if not pending:
        return
    done = getattr(_PENDING, "checked", 0)
    if upto is not None:
        k = max(0, upto - done)
        pending, _PENDING.items = pending[:k], pending[k:]
        _PENDING.checked = done + len(pending)
        if not pending:
            return
        # the caller's event covers the current stream of the current device only: a decode
        # queued elsewhere (an output on another GPU) is waited for here
        cur = torch.cuda.current_stream()
        for stream in {(x[2].device, x[2].cuda_stream): x[2] for x in pending}.values():
            if stream.cuda_stream != cur.cuda_stream or stream.device != cur.device:
                stream.synchronize()
    else:
        _PENDING.items = []
        _PENDING.checked = done + len(pending)
        for stream in {(x[2].device, x[2].cuda_stream): x[2] for x in pending}.values():
            stream.synchronize()  # the results were copied into pinned memory on these streams
    host = [r.numpy() for r, _w, _s in pending]
    ok = all(np.array_equal(h[0], w) and not h[1].view(np.int32)[:len(w)].any()  # n int32 statuses first
             for h, (_r, w, _s) in zip(host, pending))
    if not ok:
        raise CodecError("nvCOMP: chunks failed to decode or decoded to other sizes than declared")
