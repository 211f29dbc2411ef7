"""Chunk planning, the storage encoder that feeds the writer, and the storage decoder.

A storage (a flat byte buffer) is processed in *windows* of whole transform blocks so that the
memory any step holds is bounded by the window size, whatever the tensor's size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .codecs.base import Codec, get_codec
from .errors import ChecksumError, CorruptFileError
from .format import FLAG_STORED_RAW, ROW, checksum
from .storage import pread_into
from .transforms import BytePlane, get_transform

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


def gpu_window(budget: int | None = None) -> int:
    """Window bytes for GPU work: peak extra memory is under 6 windows (staged input, planes,
    compressed output at nvCOMP's worst-case size, transform temporaries), kept under ``budget``
    (default: the smaller of 1 GiB and 10 % of free GPU memory)."""
    if budget is None:
        free, _total = torch.cuda.mem_get_info()
        budget = min(1 << 30, free // 10)
    return max(1 << 20, (budget // 6) >> 20 << 20)


class PinnedPool:
    """Reused page-locked host buffers (one per use), grown only when a larger one is needed."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, n: int) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or b.numel() < n:
            b = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._bufs[name] = b
        return b[:n]


PINNED = PinnedPool()


def windows(nbytes: int, tf: BytePlane | None, chunk: int, window: int
            ) -> Iterator[tuple[int, int, list[int], list[int], list[int]]]:
    """(start, end, chunk offsets, chunk sizes, chunk planes) per window; offsets are relative to
    the window's transformed stream, which has the same length as the window; planes are the
    byteplane index of each chunk (-1 without a transform)."""
    span = tf.block * tf.width if tf else chunk
    step = max(span, window // span * span)
    for a in range(0, nbytes, step):
        b = min(nbytes, a + step)
        segs = tf.segments(b - a) if tf else [(0, b - a)]
        offs, sizes, planes = [], [], []
        for k, (o, n) in enumerate(segs):
            for c in range(0, n, chunk):
                offs.append(o + c)
                sizes.append(min(chunk, n - c))
                planes.append(k % tf.width if tf else -1)
        yield a, b, offs, sizes, planes


def encode_window(plan: Plan, src: torch.Tensor, offs: list[int], sizes: list[int], planes: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Transform and compress one window. Returns (stream, compressed, comp offsets, comp sizes),
    all on the codec's device. Chunks of planes in ``plan.raw_planes`` skip the codec (their
    comp size is reported as their raw size, so the writer stores them raw)."""
    dev = plan.codec.device
    if src.device.type != dev:
        if dev == "cuda":
            staged = PINNED.get("stage", src.numel())
            staged.copy_(src)
            src = staged.to(dev, non_blocking=True)
        else:
            src = src.to(dev)
    stream = plan.transform.encode(src) if plan.transform else src
    sel = [k for k, p in enumerate(planes) if p not in plan.raw_planes]
    doffs, dsizes = [0] * len(sizes), list(sizes)
    if not sel:
        return stream, stream[:0], doffs, dsizes
    dst, do, ds = plan.codec.encode(stream, [offs[k] for k in sel], [sizes[k] for k in sel])
    for i, k in enumerate(sel):
        doffs[k], dsizes[k] = do[i], ds[i]
    return stream, dst, doffs, dsizes


def write_chunks(f, pos: int, stream_h: np.ndarray, comp_h: np.ndarray, offs, sizes, doffs, dsizes,
                 rows: list) -> int:
    """Write one window's chunks (a chunk that did not shrink is stored raw) and append their
    chunk-table rows. Returns the new file position."""
    for o, n, co, cn in zip(offs, sizes, doffs, dsizes):
        if cn >= n:
            data, flags = stream_h[o:o + n], FLAG_STORED_RAW
        else:
            data, flags = comp_h[co:co + cn], 0
        mv = memoryview(data)
        f.write(mv)
        rows.append((pos, len(data), n, checksum(mv), flags))
        pos += len(data)
    return pos


def write_chunks_gpu(f, pos: int, stream: torch.Tensor, comp: torch.Tensor, offs, sizes, doffs,
                     dsizes, rows: list) -> int:
    """GPU variant of :func:`write_chunks`: the chosen bytes of every chunk are copied once into a
    pooled pinned buffer, in file order, then written."""
    pick = [(comp, co, cn, 0) if cn < n else (stream, o, n, FLAG_STORED_RAW)
            for o, n, co, cn in zip(offs, sizes, doffs, dsizes)]
    total = sum(p[2] for p in pick)
    host = PINNED.get("write", total)
    p = 0
    for t, o, n, _fl in pick:
        host[p:p + n].copy_(t[o:o + n], non_blocking=True)
        p += n
    torch.cuda.current_stream(comp.device).synchronize()
    h = host.numpy()
    f.write(memoryview(h))
    p = 0
    for (_t, _o, n, fl), raw in zip(pick, sizes):
        rows.append((pos + p, n, raw, checksum(memoryview(h[p:p + n])), fl))
        p += n
    return pos + total


def rows_array(rows: list) -> np.ndarray:
    return np.array(rows, dtype=ROW) if rows else np.zeros(0, ROW)


def storage_plan_from_manifest(s: dict[str, Any], device: str) -> tuple[BytePlane | None, Codec]:
    tfs = s.get("transforms", [])
    if len(tfs) > 1:
        raise CorruptFileError("format v1 readers decode chains of at most one transform")
    tf = get_transform(tfs[0]) if tfs else None
    if tf is not None and not tf.accepts(s["nbytes"]):
        raise CorruptFileError("storage size is not a multiple of its byteplane width")
    return tf, get_codec(s["codec"], device)


def decode_storage(fd: int, rows: np.ndarray, nbytes: int, tf: BytePlane | None, codec: Codec,
                   out_device: str | torch.device, window: int = DEFAULT_WINDOW,
                   progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Read, verify and decode one storage; returns a flat uint8 tensor on ``out_device``."""
    out = torch.empty(nbytes, dtype=torch.uint8, device=out_device)
    work = codec.device
    span = tf.block * tf.width if tf else 1
    raw = rows["raw"].astype(np.int64)
    ends = np.cumsum(raw)
    i, n, start = 0, len(rows), 0
    while i < n:
        # a batch ends on a block boundary once it holds at least `window` bytes (or at the end)
        j = i
        while j < n:
            j += 1
            if (ends[j - 1] - start) >= window and ends[j - 1] % span == 0:
                break
        if j == n and ends[-1] != nbytes:
            raise CorruptFileError("chunk sizes do not add up to the storage size")
        batch = rows[i:j]
        end = int(ends[j - 1])
        if tf is not None and end % span and end != nbytes:
            raise CorruptFileError("chunk boundaries do not align with byteplane blocks")
        _decode_batch(fd, batch, tf, codec, out[start:end], work)
        if progress:
            progress(end - start)
        i, start = j, end
    return out


def _read_stored(fd: int, batch: np.ndarray, pinned: bool = False) -> tuple[torch.Tensor, list[int]]:
    stored = batch["stored"].astype(np.int64)
    offs = np.concatenate([[0], np.cumsum(stored)[:-1]]).astype(np.int64)
    if pinned:  # the previous batch's host-to-device copy must be done before the buffer is reused
        torch.cuda.current_stream().synchronize()
    buf = PINNED.get("read", int(stored.sum())) if pinned else torch.empty(int(stored.sum()), dtype=torch.uint8)
    b = buf.numpy()
    fo = batch["offset"].astype(np.int64)
    contiguous = len(batch) > 0 and bool(np.all(fo[1:] == fo[:-1] + stored[:-1]))
    if contiguous:
        pread_into(fd, memoryview(b), int(fo[0]))
    else:
        for k in range(len(batch)):
            pread_into(fd, memoryview(b[offs[k]:offs[k] + stored[k]]), int(fo[k]))
    for k in range(len(batch)):
        if checksum(memoryview(b[offs[k]:offs[k] + stored[k]])) != int(batch["xxh3"][k]):
            raise ChecksumError(f"chunk at file offset {int(fo[k])} fails its checksum")
    return buf, offs.tolist()


def _decode_batch(fd: int, batch: np.ndarray, tf: BytePlane | None, codec: Codec,
                  dst: torch.Tensor, work: str) -> None:
    host, soffs = _read_stored(fd, batch, pinned=work == "cuda")
    src = host.to(work, non_blocking=True) if work != "cpu" else host
    decode_chunks(src, soffs, batch["stored"].tolist(), batch["raw"].tolist(), batch["flags"].tolist(),
                  tf, codec, dst, work)


def decode_chunks(src: torch.Tensor, soffs: list[int], stored: list[int], raws: list[int],
                  flags: list[int], tf: BytePlane | None, codec: Codec, dst: torch.Tensor,
                  work: str) -> None:
    """Decode verified stored chunks (``src`` on ``work``) into ``dst``: raw chunks are copied,
    the others go to the codec in one batch, then the transform is undone."""
    stream = dst if (tf is None and dst.device.type == work) else \
        torch.empty(dst.numel(), dtype=torch.uint8, device=work)
    roffs = np.concatenate([[0], np.cumsum(raws)[:-1]]).astype(np.int64).tolist() if raws else []
    ci = [k for k in range(len(raws)) if flags[k] != FLAG_STORED_RAW]
    for k in range(len(raws)):
        if flags[k] == FLAG_STORED_RAW:
            stream[roffs[k]:roffs[k] + raws[k]].copy_(src[soffs[k]:soffs[k] + stored[k]])
    if ci:
        codec.decode(src, [soffs[k] for k in ci], [stored[k] for k in ci],
                     stream, [roffs[k] for k in ci], [raws[k] for k in ci])
    if tf is not None:
        if dst.device.type == work:
            tf.decode(stream, dst)
        else:
            tmp = torch.empty_like(stream)
            tf.decode(stream, tmp)
            dst.copy_(tmp)
    elif stream is not dst:
        dst.copy_(stream)
