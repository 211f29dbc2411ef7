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
from .base import Codec, register

_LOCK = threading.Lock()
_MAX_OUT: dict = {}  # (codec id, chunk bytes) -> nvCOMP's worst-case compressed size
_HEADER_OK: dict = {}  # (algorithm, options) -> whether the RAW header self-test passed


@functools.lru_cache(maxsize=1)
def _nvcomp():
    try:
        from nvidia import nvcomp  # noqa: PLC0415
    except Exception as e:  # ImportError, or a broken install
        return e
    if os.environ.get("CKPTZIP_NVCOMP_ALLOCATOR", "torch") == "torch":
        try:
            nvcomp.set_device_allocator(_torch_scratch)
        except Exception:  # an older binding without allocator hooks: keep nvCOMP's own
            pass
    return nvcomp


class _Scratch:
    """nvCOMP scratch memory held as a torch tensor (freed when nvCOMP drops this object)."""
    __slots__ = ("t", "ptr")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.ptr = t, t.data_ptr()


def _torch_scratch(nbytes: int, stream) -> _Scratch:
    """nvCOMP's device allocator: torch's caching allocator, on the stream nvCOMP works on.
    nvCOMP's default allocator costs ~0.3 ms per call (cudaMalloc/cudaFree); with this one fp32
    compress went from 91 to 114 GB/s and decompress from 126 to 161 GB/s on an H100
    (bench/probe_host.py). Set CKPTZIP_NVCOMP_ALLOCATOR=nvcomp to keep nvCOMP's own."""
    dev = stream.device if stream.device >= 0 else torch.cuda.current_device()
    n = max(int(nbytes), 1)
    if stream.ptr == torch.cuda.current_stream(dev).cuda_stream:
        return _Scratch(torch.empty(n, dtype=torch.uint8, device=dev))
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=dev)):
        return _Scratch(torch.empty(n, dtype=torch.uint8, device=dev))


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


def _ceil(x: int, a: int) -> int:
    return (x + a - 1) // a * a


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

    def _opts(self) -> tuple:
        return tuple(sorted(self.config.items()))

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

    def _aligned(self, src: torch.Tensor, offsets, sizes):
        """(buffer, offsets) with every chunk start aligned; copies only if needed."""
        a = self._align
        if src.data_ptr() % a == 0 and not (np.asarray(offsets, dtype=np.int64) % a).any():
            return src, list(offsets)
        new, pos = _packed(sizes, a)
        buf = torch.empty(max(pos, 1), dtype=torch.uint8, device=src.device)
        for o, n, p in zip(offsets, sizes, new):
            buf[p:p + n].copy_(src[o:o + n])
        return buf, new

    def _check_sizes(self, sizes) -> None:
        arr = np.asarray(sizes, dtype=np.int64)
        bad = (arr < 1) | (arr > self.max_chunk)
        if bad.any():
            n = int(arr[bad][0])
            raise CodecError(f"nvCOMP {self.algorithm}: chunk of {n} bytes outside [1, {self.max_chunk}]")
        dt = self.config.get("data_type", "|u1")
        w = int(dt[-1]) if dt[-1].isdigit() else 1
        if w > 1 and (arr % w).any():
            raise CodecError(f"nvCOMP {self.algorithm}: chunk sizes must be multiples of {w} for {dt}")

    def encode(self, src, offsets, sizes):
        if src.device.type != "cuda":
            raise CodecError("GPU codec given a CPU tensor")
        self._check_sizes(sizes)
        nv = _nvcomp()
        codec = self._nv(src.device)
        if not sizes:
            return torch.empty(0, dtype=torch.uint8, device=src.device), [], []
        buf, offs = self._aligned(src, offsets, sizes)
        cap = _ceil(self._max_out(nv, codec, max(sizes)), self._align)
        out = torch.empty(cap * len(sizes), dtype=torch.uint8, device=src.device)
        out_offs = [i * cap for i in range(len(sizes))]
        try:
            res = codec.encode(nv.as_arrays(buf, list(offs), list(sizes)),
                               out=nv.as_arrays(out, out_offs, [cap] * len(sizes)))
            got = [int(x) for x in res.buffer_sizes]
        except Exception as e:
            raise CodecError(f"nvCOMP {self.algorithm} encode failed: {e}") from None
        if len(got) != len(sizes) or any(not 0 < g <= cap for g in got):
            raise CodecError(f"nvCOMP {self.algorithm} encode returned impossible sizes")
        return out, out_offs, got

    #: where a RAW chunk of this algorithm records its uncompressed size (little-endian uint32 at
    #: this byte offset), when known: a reader that holds the chunks on the host checks the sizes
    #: there and decodes without the size read-back (see :meth:`decode`)
    header_size_at: ClassVar[int | None] = None

    def _header_check(self, codec) -> bool:
        """Whether this nvCOMP build writes the size where :attr:`header_size_at` says (a
        self-test, once per codec configuration): otherwise decoding keeps the checked path."""
        key = ("header", self.algorithm, self._opts())
        ok = _HEADER_OK.get(key)
        if ok is None:
            ok = False
            if self.header_size_at is not None:
                try:
                    w = 4
                    sizes = [4096 + 16 * w, 1000 * w]
                    src = torch.randint(0, 64, (sum(sizes) + 16,), dtype=torch.uint8, device="cuda")
                    out, offs, got = self.encode(src, [0, sizes[0]], sizes)
                    heads = out.cpu().numpy()
                    ok = all(int(heads[o + self.header_size_at:o + self.header_size_at + 4].view("<u4")[0]) == n
                             for o, n in zip(offs, sizes))
                except Exception:  # noqa: BLE001 - any failure just keeps the checked path
                    ok = False
            _HEADER_OK[key] = ok
        return ok

    def _verify_headers(self, host: np.ndarray, offsets, sizes, want) -> None:
        at = self.header_size_at
        offs = np.asarray(offsets, dtype=np.int64)
        n = np.asarray(sizes, dtype=np.int64)
        if (n < at + 4).any() or (offs < 0).any() or (offs + n > host.size).any():
            raise CodecError(f"nvCOMP {self.algorithm}: chunk too short for its header")
        idx = (offs + at)[:, None] + np.arange(4)
        declared = host[idx].astype(np.int64) @ np.array([1, 1 << 8, 1 << 16, 1 << 24], dtype=np.int64)
        bad = declared != np.asarray(want, dtype=np.int64)
        if bad.any():
            k = int(np.nonzero(bad)[0][0])
            raise CodecError(f"nvCOMP {self.algorithm}: chunk header declares {int(declared[k])} bytes, "
                             f"the chunk table {int(want[k])}")

    def decode(self, src, src_offsets, src_sizes, dst, dst_offsets, dst_sizes, host=None):
        """As :meth:`Codec.decode`. ``host``, when given, is a host copy of ``src`` (a numpy uint8
        array, same offsets): for algorithms whose RAW header records the uncompressed size
        (ANS), the sizes are checked there and the chunks decoded with a configuration built from
        them, without nvCOMP's two size read-backs (synchronizations) per call; nvCOMP does not
        write past a configured output size (bench/probe_ans_header.py)."""
        if not src_sizes:
            return
        self._check_sizes(dst_sizes)
        nv = _nvcomp()
        codec = self._nv(dst.device)
        verified = host is not None and self._header_check(codec)
        if verified:
            self._verify_headers(host, src_offsets, src_sizes, dst_sizes)
        if src.device != dst.device:
            src = src.to(dst.device, non_blocking=True)
        sbuf, soffs = self._aligned(src, src_offsets, src_sizes)
        a = self._align
        ok = (np.asarray(dst_offsets, dtype=np.int64) % a == 0) & (dst.data_ptr() % a == 0)
        direct, staged = np.nonzero(ok)[0].tolist(), np.nonzero(~ok)[0].tolist()
        toffs, pos = _packed([dst_sizes[i] for i in staged], a)
        tmp = torch.empty(pos, dtype=torch.uint8, device=dst.device) if staged else None
        groups = [(direct, dst, [dst_offsets[i] for i in direct]), (staged, tmp, toffs)]
        for idx, buf, offs in groups:
            if not idx:
                continue
            want = [int(dst_sizes[i]) for i in idx]
            try:
                arrs = nv.as_arrays(sbuf, [soffs[i] for i in idx], [src_sizes[i] for i in idx])
                if verified:
                    cfg = codec.decompression_config(codec.compression_config(want))
                    codec.decode(arrs, out=nv.as_arrays(buf, offs, want), decompression_config=cfg)
                    continue
                res = codec.decode(arrs, out=nv.as_arrays(buf, offs, want))
                got = [int(x) for x in res.buffer_sizes]
            except Exception as e:
                raise CodecError(f"nvCOMP {self.algorithm} decode failed: {e}") from None
            if got != want:
                raise CodecError(f"nvCOMP {self.algorithm}: chunks decoded to other sizes than declared")
        for i, p in zip(staged, toffs):
            o, n = dst_offsets[i], dst_sizes[i]
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


def _dtypes(allowed):
    def check(cfg):
        if "data_type" in cfg and cfg["data_type"] not in allowed:
            raise UnknownCodecError(f"data_type {cfg['data_type']!r} not in {allowed}")
    return check


#: max_sub_chunk_count only steers the encoder (decoders read it from the stream)
ANSGPU = _gpu_codec("ans", "ANS", ("data_type",), _dtypes(("|u1", "<f2", "<f4", "|f1", "|i1")), 1 << 20,
                    ("max_sub_chunk_count",))
ZstdGPU = _gpu_codec("zstd", "Zstd")
DeflateGPU = _gpu_codec("deflate", "Deflate")
GDeflateGPU = _gpu_codec("gdeflate", "GDeflate")
LZ4GPU = _gpu_codec("lz4", "LZ4", ("data_type",))
SnappyGPU = _gpu_codec("snappy", "Snappy")
BitcompGPU = _gpu_codec("bitcomp", "Bitcomp", ("data_type", "algorithm_type"), None, 1 << 20)
CascadedGPU = _gpu_codec("cascaded", "Cascaded", ("data_type",))
#: nvCOMP 6.0's RAW ANS chunk starts with its uncompressed size (uint32 LE), for every data type
ANSGPU.header_size_at = 0
#: 1 MiB Cascaded chunks decoded to other sizes than declared on nvCOMP 6.0 (seen on an H100);
#: 64 KiB chunks round-trip, so no larger chunk is written or accepted
CascadedGPU.max_chunk = 64 * 1024
