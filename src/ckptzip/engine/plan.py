"""Planning: how a storage is cut into windows, units and groups of work.

A storage (a flat byte buffer) is processed in *windows* of whole transform blocks so that the
memory any step holds is bounded by the window size, whatever the tensor's size. A *unit* is one
window of one storage with its chunk layout; a *group* is a run of units of about one window's
bytes that share codec calls.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs.base import Codec
from ..transforms import Transform

DEFAULT_CHUNK = 1 << 20
DEFAULT_WINDOW = 64 << 20


@dataclass
class Plan:
    """One storage's encoding: the transform (or None), the codec and the chunk size."""
    transform: Transform | None
    codec: Codec
    chunk_size: int
    choice: str | None = None
    raw_planes: frozenset = frozenset()
    plane_chunks: dict = None  # plane index -> chunk size, where it differs from chunk_size
    #: a bound reference transform (``xor``/``derived``) applied before ``transform`` (format 1.1)
    ref: Transform | None = None
    est: float | None = None  # sampled stored bytes per input byte (planner bookkeeping)


def with_ref(plan: Plan, ref: Transform | None) -> Plan:
    """``plan`` with another bound reference transform (a shallow copy; ``dataclasses.replace``
    ran ``__init__`` again, about 8 us each for the 300 plans of a reused layout per save)."""
    p = object.__new__(Plan)
    p.__dict__.update(plan.__dict__)
    p.ref = ref
    return p


def gpu_decode_window(budget: int | None = None) -> int:
    """Group bytes for GPU decoding: small enough that reading the next group overlaps decoding
    this one from the start (64 MiB), and at most one encode window (see :func:`gpu_window`)."""
    return min(64 << 20, gpu_window(budget))


def gpu_window(budget: int | None = None, scratch_heavy: bool = False) -> int:
    """Window bytes for GPU work: peak extra memory is under 4 windows (the transformed window,
    compressed output at nvCOMP's worst-case size, gather and staging slices), kept under
    ``budget`` (default: the smaller of 1 GiB and 10 % of free GPU memory). Windows are as large
    as that allows because nvCOMP's throughput grows with the bytes per call: ANS on H100 ran at
    ~50 GB/s with 16 MB per call, ~150 with 64 MB and 300-400 with 256 MB
    (bench/probe_throughput.py). ``scratch_heavy`` (GPU zstd / deflate saves): half that, since
    those codecs also need a copy of the window with aligned chunks and nvCOMP scratch (capped
    per call, ``NvcompCodec.call_bytes``), and their 5-8 GB/s do not grow with larger calls."""
    if budget is None:
        from .memory import free_gpu_bytes
        budget = min(1 << 30, free_gpu_bytes() // 10)
    return max(1 << 20, (budget // (8 if scratch_heavy else 4)) >> 20 << 20)



def windows(nbytes: int, tf: Transform | None, chunk: int, window: int,
            plane_chunks: dict[int, int] | None = None
            ) -> tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
    """(start, end, chunk offsets, chunk sizes, chunk planes) per window; offsets are relative to
    the window's transformed stream, which has the same length as the window; planes are the
    byteplane index of each chunk (-1 without a transform). ``plane_chunks`` overrides the chunk
    size of some planes. Memoized: a training loop saves the same shapes again and again."""
    tf_key = (tf.width, tf.block) if tf else None
    return _windows(nbytes, tf_key, chunk, window, tuple(sorted(plane_chunks.items())) if plane_chunks else ())


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
    start: int = 0  # byte offset of ``data`` within its storage
    resolved: bool = False  # ``data`` already holds the residual of the plan's reference transform


def units_of(owner: int, data: torch.Tensor, plan: Plan, window: int, limit: int | None = None) -> list[Unit]:
    n = data.numel() if limit is None else min(limit, data.numel())
    return [Unit(owner, data if a == 0 and b == data.numel() else data[a:b], plan, offs, sizes, planes,
                 start=a)
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



def codec_key(c: Codec) -> tuple:
    """Codecs with equal keys share one call (same implementation, same options)."""
    return (type(c).__name__, repr(sorted(c.config.items())))


def codec_calls(codecs: Iterable[Codec]) -> tuple[list[int], list[Codec]]:
    """For each of ``codecs``, the index of the codec call it joins (codecs with equal
    :func:`codec_key` share one), and each call's codec. The key is made once per codec object:
    the units of a group and the jobs of a load share a few objects, and a key per item cost
    about 2 us each, for hundreds of small storages per load."""
    calls: list[Codec] = []
    by_key: dict[tuple, int] = {}
    by_obj: dict[int, int] = {}  # (the objects outlive this loop: ids are not reused)
    out = []
    for c in codecs:
        k = by_obj.get(id(c))
        if k is None:
            k = by_obj[id(c)] = by_key.setdefault(codec_key(c), len(calls))
            if k == len(calls):
                calls.append(c)
        out.append(k)
    return out, calls
