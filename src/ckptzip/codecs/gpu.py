"""nvCOMP (GPU) implementations, through ``nvidia.nvcomp`` (``pip install 'ckptzip[cu13]'``).

nvCOMP is imported lazily and every call is guarded: chunk sizes are checked against each
algorithm's limit before a call, outputs are always preallocated by us (batched RAW calls without
preallocated outputs crashed nvCOMP 6.0), misaligned chunks are staged through aligned buffers,
and any nvCOMP error becomes :class:`~ckptzip.CodecError`. Standard bitstreams (zstd frames, raw
deflate) share their wire id with the CPU implementations, so either side reads what the other
wrote. GPU-only bitstreams (ANS, Bitcomp, Cascaded, GDeflate, LZ4, Snappy) raise
:class:`~ckptzip.GPURequiredError` on a machine without a GPU.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CodecError, GPURequiredError, UnknownCodecError
from . import _capi
from .base import Codec, register

_LOCK = threading.Lock()
_MAX_OUT: dict = {}  # (codec id, chunk bytes) -> nvCOMP's worst-case compressed size


#: zero nvCOMP's output slots before compressing: its ANS compressor leaves a few bytes inside
#: a chunk unset, so without this the same tensors give files that differ in those bytes (stale
#: GPU memory of the process); costs 2-3 % of the codec's compress GB/s (H100, docs/benchmarks.md)
ZERO_OUTPUT = True


@functools.lru_cache(maxsize=1)
def _nvcomp():
    try:
        from nvidia import nvcomp  # noqa: PLC0415
    except Exception as e:  # ImportError, or a broken install
        return e
    return nvcomp


def gpu_status() -> str | None:
    """None if GPU codecs are usable here, else a sentence saying why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    nv = _nvcomp()
    if isinstance(nv, Exception):
        return f"nvidia-nvcomp is not installed ({nv}); pip install 'ckptzip[cu13]'"
    try:
        _make_codec("LZ4", torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream, ())
    except Exception as e:  # e.g. "CUDA driver version is insufficient"
        return f"nvCOMP cannot start: {e}"
    return None


@functools.lru_cache(maxsize=1)
def _cached_status() -> str | None:
    return gpu_status()


def gpu_available() -> bool:
    return _cached_status() is None


def require_gpu(wire_id: str) -> None:
    why = _cached_status()
    if why is not None:
        raise GPURequiredError(
            f"codec {wire_id!r} needs a CUDA GPU with nvCOMP, and here {why}. On a GPU machine, "
            f"`ckptzip convert IN OUT --codec zstd` writes a copy any CPU can read")


@functools.lru_cache(maxsize=64)
def _make_codec(algorithm: str, device: int, stream: int, opts: tuple):
    nv = _nvcomp()
    return nv.Codec(algorithm=algorithm, device_id=device, cuda_stream=stream,
                    bitstream_kind=nv.BitstreamKind.RAW, **dict(opts))


#: chunks up to this size are compressed in their own nvCOMP call (see NvcompCodec.encode)
SMALL_CHUNK = 128 * 1024


def _ceil(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _split_calls(calls: list, arr: np.ndarray, limit: int, max_chunks: int) -> list:
    """Each call's chunk indices cut, in order, into runs of at most ``max_chunks`` chunks whose
    count times the call's largest chunk is at most ``limit`` (at least one chunk a run): nvCOMP
    sizes its scratch per chunk (Zstd on an H100: 1,488 MiB for 256 chunks of 1 MiB, 1,126 MiB
    for 512 chunks of up to 64 KiB)."""
    out = []
    for idx in calls:
        ii = np.arange(len(arr))[idx]
        k = max(1, min(max_chunks, limit // int(arr[ii].max())))
        out.extend([idx] if len(ii) <= k else [ii[a:a + k] for a in range(0, len(ii), k)])
    return out


def _packed(sizes, a: int) -> tuple[list[int], int]:
    """Offsets that pack chunks of ``sizes`` back to back, each ``a``-aligned, and the total."""
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += _ceil(n, a)
    return offs, pos


class NvcompCodec(Codec):
    """Batched RAW nvCOMP codec; subclasses name the algorithm and its wire options."""

    device: ClassVar[str] = "cuda"
    algorithm: ClassVar[str]
    max_chunk: ClassVar[int] = 16 * 1024 * 1024
    #: chunk size that keeps the GPU busy: entropy coders like large chunks (better ratio),
    #: LZ-style codecs parallelise over chunks and want many small ones
    preferred_chunk: ClassVar[int] = 64 * 1024

    #: name in nvCOMP's C API when this codec is called through it (see ``_capi``), else None
    capi: ClassVar[str | None] = None
    #: where nvCOMP's compress scratch grows with the chunks per call: the most chunks x largest
    #: chunk bytes, and the most chunks, one call gets (None: no limit; see :func:`_split_calls`)
    call_bytes: ClassVar[int | None] = None
    call_chunks: ClassVar[int] = 1 << 30
    #: whether decoding goes through the C API too. Not for Zstd: its decoder's scratch depends
    #: on each frame's window size, which GetTempSize cannot know, and a hostile frame (a
    #: decompression bomb) aborted the process through the C API; the binding sizes it per call.
    capi_decode: ClassVar[bool] = True

    def _opts(self) -> tuple:
        """Options for the Python binding (an encoder-only ``algorithm`` steers the C API path
        only: the binding's own keyword of that name is the codec's name)."""
        return tuple(sorted((k, v) for k, v in self.config.items() if k != "algorithm"))

    def call_limits(self) -> tuple[int, int] | None:
        """``(chunk bytes, chunks)`` one compress call may take (see :func:`_split_calls`), or
        None where nvCOMP's scratch does not grow with the call."""
        return (self.call_bytes, self.call_chunks) if self.call_bytes else None

    @functools.cached_property
    def _c(self):
        """(compress options, decompress options) for the C API path, or None for the binding.
        CKPTZIP_NVCOMP_CAPI=0 forces the binding (same bitstreams)."""
        if self.capi is None or os.environ.get("CKPTZIP_NVCOMP_CAPI", "1") == "0" or not _capi.available():
            return None
        if self.capi == "ANS":
            return _capi.ans_opts(self.config.get("data_type", "|u1"), int(self.config.get("max_sub_chunk_count", 0)))
        if self.capi == "Deflate":
            return _capi.deflate_opts(self.config.get("algorithm", 1))
        return _capi.zstd_opts()

    def _nv(self, dev: torch.device):
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        with torch.cuda.device(idx):
            stream = torch.cuda.current_stream().cuda_stream
        try:
            with _LOCK:
                return _make_codec(self.algorithm, idx, stream, self._opts())
        except Exception as e:
            raise CodecError(f"nvCOMP {self.algorithm} with {dict(self._opts())}: {e}") from None

    @functools.cached_property
    def _align(self) -> int:
        return 16

    def _max_out(self, nv, codec, n: int) -> int:
        key = (id(codec), n)
        got = _MAX_OUT.get(key)
        if got is None:
            probe = torch.empty(n, dtype=torch.uint8, device="cuda")
            got = _MAX_OUT[key] = int(codec.get_max_comp_buffer_size(nv.as_array(probe)))
        return got

    def _aligned(self, src: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray):
        """(buffer, offsets) with every chunk start aligned; copies only if needed."""
        a = self._align
        if src.data_ptr() % a == 0 and not (offsets % a).any():
            return src, offsets
        new, pos = _packed(sizes.tolist(), a)
        buf = torch.empty(max(pos, 1), dtype=torch.uint8, device=src.device)
        for o, n, p in zip(offsets.tolist(), sizes.tolist(), new):
            buf[p:p + n].copy_(src[o:o + n])
        return buf, np.asarray(new, dtype=np.int64)

    def _check_sizes(self, arr: np.ndarray) -> None:
        bad = (arr < 1) | (arr > self.max_chunk)
        if bad.any():
            n = int(arr[bad][0])
            raise CodecError(f"nvCOMP {self.algorithm}: chunk of {n} bytes outside [1, {self.max_chunk}]")
        dt = self.config.get("data_type", "|u1")
        w = int(dt[-1]) if dt[-1].isdigit() else 1
        if w > 1 and (arr % w).any():
            raise CodecError(f"nvCOMP {self.algorithm}: chunk sizes must be multiples of {w} for {dt}")

    def encode(self, src, offsets, sizes):
        """As :meth:`Codec.encode`; offsets and sizes come back as int64 numpy arrays."""
        if src.device.type != "cuda":
            raise CodecError("GPU codec given a CPU tensor")
        arr = np.asarray(sizes, dtype=np.int64).reshape(-1)
        self._check_sizes(arr)
        c = self._c
        if c is None:
            nv = _nvcomp()
            codec = self._nv(src.device)
        if not len(arr):
            return torch.empty(0, dtype=torch.uint8, device=src.device), np.zeros(0, np.int64), np.zeros(0, np.int64)
        buf, offs = self._aligned(src, np.asarray(offsets, dtype=np.int64).reshape(-1), arr)
        # nvCOMP wants every output slot of a call to hold the worst case of the call's largest
        # chunk; a group of 64 KiB exponent chunks beside 1 MiB ones then reserved ~5x its input
        # (3 GB during a save), so small and large chunks go to separate calls
        small = arr <= SMALL_CHUNK
        calls = [idx if len(idx) < len(arr) else slice(None) for idx in
                 (np.nonzero(m)[0] for m in (small, ~small)) if len(idx)]
        lim = self.call_limits()
        if lim:
            calls = _split_calls(calls, arr, *lim)
        if c is not None:
            caps = [_ceil(_capi.max_output(self.capi, bytes(c[0]), int(arr[idx].max())), self._align) for idx in calls]
        else:
            caps = [_ceil(self._max_out(nv, codec, int(arr[idx].max())), self._align) for idx in calls]
        counts = [len(arr[idx]) for idx in calls]
        out = (torch.zeros if ZERO_OUTPUT else torch.empty)(
            sum(cap * k for cap, k in zip(caps, counts)), dtype=torch.uint8, device=src.device)
        out_offs = np.zeros(len(arr), dtype=np.int64)
        slot = np.zeros(len(arr), dtype=np.int64)
        got = np.zeros(len(arr), dtype=np.int64)
        pos = 0
        try:
            results = []  # both calls are launched before either's sizes are read back
            for cap, k, idx in zip(caps, counts, calls):
                out_offs[idx] = pos + cap * np.arange(k)
                slot[idx] = cap
                pos += cap * k
                if c is not None:
                    results.append(_capi.compress(self.capi, c[0], buf, offs[idx], arr[idx], out, out_offs[idx], cap))
                    continue
                results.append(codec.encode(nv.as_arrays(buf, offs[idx].tolist(), arr[idx].tolist()),
                                            out=nv.as_arrays(out, out_offs[idx].tolist(), [cap] * k)))
            for idx, res in zip(calls, results):
                got[idx] = res.sizes() if c is not None else [int(x) for x in res.buffer_sizes]
        except CodecError:
            raise
        except Exception as e:
            raise CodecError(f"nvCOMP {self.algorithm} encode failed: {e}") from None
        if not ((got > 0) & (got <= slot)).all():
            raise CodecError(f"nvCOMP {self.algorithm} encode returned impossible sizes")
        return out, out_offs, got

    def decode(self, src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes):
        src_sizes = np.asarray(src_sizes, dtype=np.int64).reshape(-1)
        if not len(src_sizes):
            return
        dst_sizes = np.asarray(dst_sizes, dtype=np.int64).reshape(-1)
        dst_offsets = np.asarray(dst_offsets, dtype=np.int64).reshape(-1)
        self._check_sizes(dst_sizes)
        c = self._c if self.capi_decode else None
        if c is None:
            nv = _nvcomp()
            codec = self._nv(dst.device)
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=True)
        sbuf, soffs = self._aligned(src, np.asarray(src_offsets, dtype=np.int64).reshape(-1), src_sizes)
        a = self._align
        ok = (dst_offsets % a == 0) & (dst.data_ptr() % a == 0)
        if ok.all():
            groups = [(slice(None), dst, dst_offsets)]
            staged = toffs = []
        else:
            direct, staged = np.nonzero(ok)[0], np.nonzero(~ok)[0]
            toffs, pos = _packed(dst_sizes[staged].tolist(), a)
            tmp = torch.empty(pos, dtype=torch.uint8, device=dst.device)
            groups = [(direct, dst, dst_offsets[direct]), (staged, tmp, np.asarray(toffs, dtype=np.int64))]
        for idx, buf, offs in groups:
            want = dst_sizes[idx]
            if not len(want):
                continue
            if c is not None:  # asynchronous; sizes and statuses checked by _capi
                _capi.decompress(self.capi, c[1], sbuf, soffs[idx], src_sizes[idx], buf, offs, want)
                continue
            try:
                res = codec.decode(nv.as_arrays(sbuf, soffs[idx].tolist(), src_sizes[idx].tolist()),
                                   out=nv.as_arrays(buf, offs.tolist(), want.tolist()))
                got = [int(x) for x in res.buffer_sizes]
            except Exception as e:
                raise CodecError(f"nvCOMP {self.algorithm} decode failed: {e}") from None
            if got != want.tolist():
                raise CodecError(f"nvCOMP {self.algorithm}: chunks decoded to other sizes than declared")
        for i, p in zip(np.asarray(staged).tolist(), toffs):
            o, n = int(dst_offsets[i]), int(dst_sizes[i])
            dst[o:o + n].copy_(tmp[p:p + n])


def _gpu_codec(wire_id: str, algorithm: str, keys: tuple[str, ...] = (), validate=None,
               preferred_chunk: int = 64 * 1024, local: tuple[str, ...] = ()):
    def __init__(self, **config: Any) -> None:
        Codec.__init__(self, **config)
        if validate:
            validate(config)

    def local_keys(cls) -> tuple[str, ...]:
        return local

    cls = type(f"{algorithm}GPU", (NvcompCodec,), {
        "wire_id": wire_id, "algorithm": algorithm, "config_keys": keys, "__init__": __init__,
        "preferred_chunk": preferred_chunk, "local_keys": classmethod(local_keys),
        "__doc__": f"nvCOMP {algorithm} (RAW bitstream) on the GPU; wire id {wire_id!r}."})
    return register(cls)


def _deflate_algorithm(cfg):
    a = cfg.get("algorithm", 1)
    if type(a) is not int or a not in _capi.DEFLATE_ALGORITHMS:
        raise UnknownCodecError(f"Deflate algorithm {a!r} not in 0..{_capi.DEFLATE_ALGORITHMS[-1]}")


def release_scratch() -> None:
    """Hand nvCOMP's cached scratch memory back to torch's allocator (called at the end of
    every save and load)."""
    _capi.release_scratch()


def _dtypes(allowed):
    def check(cfg):
        if "data_type" in cfg and cfg["data_type"] not in allowed:
            raise UnknownCodecError(f"data_type {cfg['data_type']!r} not in {allowed}")
    return check


#: max_sub_chunk_count only steers the encoder (decoders read it from the stream)
ANSGPU = _gpu_codec("ans", "ANS", ("data_type",), _dtypes(("|u1", "<f2", "<f4", "|f1", "|i1")), 1 << 20,
                    ("max_sub_chunk_count",))
ZstdGPU = _gpu_codec("zstd", "Zstd")
ANSGPU.capi, ZstdGPU.capi = "ANS", "Zstd"
# ANS decodes exactly the declared symbols of each chunk (bounded work on any input: the GPU
# tests decode damaged and forged ANS chunks); other GPU decoders see only verified chunks
ANSGPU.decodes_unverified = True
ZstdGPU.safe_on_forged = False  # (tests/test_gpu.py, test_forged_zstd_gpu_load_returns)
# nvCOMP 6.0 Zstd compress scratch on an H100 (GetTempSize, MiB) is mostly fixed by the largest
# chunk: 505 at 4 KiB, 619 at 16 KiB, 771 at 32 KiB, 1,074 at 64 KiB and more, plus a part per
# chunk (1,178 for 1,024 chunks of 64 KiB, 2,739 of 1 MiB); each call costs 10-25 ms whatever
# its size. So 16 KiB chunks (also faster and no larger: 6.3 vs 3.7 GB/s, 0.506 vs 0.515 of
# exponent-like bytes in one 64 MiB call), calls cut at 32 MiB (scratch <= ~650 MiB).
ZstdGPU.preferred_chunk = 16 << 10
ZstdGPU.call_bytes = 32 << 20
ZstdGPU.capi_decode = False
#: ``algorithm`` (encoder only, nvCOMP's Deflate algorithm 0-5): 0 is entropy coding alone, no
#: scratch, 40-65 GB/s; 1 (default) adds matches, scratch ~5.5x the call's chunk bytes
DeflateGPU = _gpu_codec("deflate", "Deflate", (), _deflate_algorithm, local=("algorithm",))
DeflateGPU.capi = "Deflate"
DeflateGPU.capi_decode = False  # decoded through the binding, as before (scratch sized per call)
DeflateGPU.call_bytes = 16 << 20


def _deflate_call_limits(self) -> tuple[int, int] | None:
    # algorithm 0 needs no scratch; the binding (no C API) ignores the algorithm: limits then
    entropy_only = self.config.get("algorithm", 1) == 0 and self._c is not None
    return None if entropy_only else (self.call_bytes, self.call_chunks)


DeflateGPU.call_limits = _deflate_call_limits
GDeflateGPU = _gpu_codec("gdeflate", "GDeflate")
LZ4GPU = _gpu_codec("lz4", "LZ4", ("data_type",))
SnappyGPU = _gpu_codec("snappy", "Snappy")
BitcompGPU = _gpu_codec("bitcomp", "Bitcomp", ("data_type", "algorithm_type"), None, 1 << 20)
CascadedGPU = _gpu_codec("cascaded", "Cascaded", ("data_type",))
#: 1 MiB Cascaded chunks decoded to other sizes than declared on nvCOMP 6.0 (seen on an H100);
#: 64 KiB chunks round-trip, so no larger chunk is written or accepted
CascadedGPU.max_chunk = 64 * 1024
