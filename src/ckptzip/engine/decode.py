"""Decoding: batches of whole transform blocks, grouped up to a window, read and checksummed by
a reader thread while the previous group is decoded straight into the destination tensors."""
from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import native
from ..codecs import _capi
from ..codecs import cpu as ccpu
from ..codecs.base import Codec, get_codec
from ..codecs.cpu import cpu_threads, pmap, pmap_balanced, pmap_sized, runs
from ..codecs.gpu import release_scratch
from ..errors import ChecksumError, CodecError, CorruptFileError
from ..format import FLAG_STORED_RAW
from ..io.reader import HASH_PARALLEL_MIN, read_split, read_stored, verify
from ..storage import split_ranges
from ..kernels import PARTIAL, PARTIAL16, enabled, launch, triton_kernels
from ..transforms import RefTransform, Transform, get_transform
from ..transforms.byteplane import BytePlane, PlaneSubset, np_decode_onto
from ..transforms.refs import Delta, fused_planes, multi_segment, planes_after_ref
from .memory import ALIGN, HOST, PINNED, copy_segments, empty_bytes
from .plan import DEFAULT_WINDOW, codec_calls

#: decoded bytes per group on the CPU: small enough that reading and checksumming the next
#: group overlaps decoding this one, large enough for few codec calls; at least CPU_GROUP_PER_THREAD
#: per thread of the CPU pool (a fused batch is cut between threads where all its planes' chunks
#: start, 4 MiB of words each for the writer's 1 MiB chunks: a 16 MiB group kept 16 cores to 4)
CPU_GROUP = 16 << 20
CPU_GROUP_PER_THREAD = 4 << 20
#: the same from memory (a BytesIO): nothing to read ahead, so groups are larger (fewer waits for
#: a group's last piece); see docs/benchmarks.md, "Twenty-second session"
MEM_GROUP = 64 << 20
#: CPU groups of local files read their raw chunks straight into the decode stream
#: (io.reader.read_split); False: into the read buffer, copied afterwards (tests cover both)
SPLIT_READS = True
#: CPU byteplane batches of zstd and stored chunks are decoded in one pass per batch (the codec
#: fused with the byteplane inverse, :func:`_decode_fused`); False: the codec into the group
#: stream, then the inverse into the destination (tests cover both)
FUSED = True
#: the chunks of fused batches are verified by the decoding threads, each piece's just before
#: its decode (in parallel and while the next group is read), where the reader would hash them
#: on its one thread (under io.reader.HASH_PARALLEL_MIN); False: by the reader thread, with the
#: group's other chunks (tests cover both)
VERIFY_IN_PIECES = True
#: smaller batches take the two-step path: their table and call cost about 40 us, as much as
#: the pass they save (2-core loads from memory, medians of 11 interleaved rounds: 200 tensors
#: of 200 KB 81 -> 65 ms fused from 32 KiB on; 800 of 52 KB no faster)
FUSED_MIN = 64 << 10
#: CPU batches of byte planes alone (no reference transform, whole-word rotation), or without a
#: transform, up to this size are undone in one loop on the decoding thread, each by one call
#: of the C extension (or a copy): the general path (tensor slices, checks, the pool's runs)
#: cost about 35 us per batch, more than the work for the norms, biases and counters of a model
#: state (151 of the 208 storages of bench/cpu_bench.py's state are under 64 KiB, 0.4 % of its
#: bytes)
SMALL_INVERSE = 64 << 10
#: read buffers (decode groups) in flight: the caller holds up to two (one decoding on the
#: GPU), the reader fills the others ahead of it
READ_AHEAD = 4
#: fused batches are cut into pieces of about 1/PIECES_PER_THREAD of a thread's share (at least
#: PIECE_MIN bytes; cuts fall where every plane has a chunk start), which the calling thread and
#: the pool's take costliest first as they come free (``pmap_balanced``): one piece per thread
#: left a thread idle for up to half of a group (pieces of the same size decode 2-4x apart)
PIECES_PER_THREAD = 8
PIECE_MIN = 256 << 10
#: a group's batches outside its fused plan that hold fewer stream bytes than this are decoded
#: by the calling thread while the pool's threads take the fused pieces (below PARALLEL_BYTES
#: and ZSTD_PARALLEL_BYTES, their own steps never wait for the pool)
OVERLAP_REST = 256 << 10
#: fused pieces (without a reference transform, or with expgrid / expref) are taken by the
#: threads from one queue in C (``planes_fused_many``) instead of one Python call each
QUEUE_PIECES = True


def storage_chain(s: dict[str, Any], device: str, cache: dict | None = None, parsed: list | None = None
                  ) -> tuple[RefTransform | None, Transform | None, Codec]:
    """A storage's transform chain and codec: ``(reference transform or None, byteplane or None,
    codec)``. Format 1.1 chains have at most two elements, a reference transform (``xor``,
    ``derived``) only first; the reference transform comes back unbound. ``cache`` (one per
    reader): storages with the same configs share the parsed objects (unbound, never modified:
    binding makes a copy), so a file of many storages parses each distinct chain once; the
    size check runs for every storage. ``parsed``: the storage's chain as the manifest's
    validation parsed it (``Manifest.chains``; storages with equal configs share one list, the
    cache key then), not parsed again."""
    tfs = s.get("transforms", [])
    if cache is None:
        key = None
    elif parsed is not None:
        key = (id(parsed), device)  # (the reader keeps the manifest, so the list outlives the cache)
    else:
        key = (repr(tfs), repr(s.get("codec")), device)
    got = cache.get(key) if key is not None else None
    if got is None:
        if len(tfs) > 2:
            raise CorruptFileError("transform chains have at most two elements (format 1.1)")
        if parsed is not None:
            parsed = [t if t is not None else get_transform(cfg) for cfg, t in parsed]
        else:
            parsed = [get_transform(t) for t in tfs]
        ref = parsed[0] if parsed and isinstance(parsed[0], RefTransform) else None
        rest = parsed[1:] if ref is not None else parsed
        if len(rest) > 1 or any(isinstance(t, RefTransform) for t in rest):
            raise CorruptFileError("a reference transform (xor, derived) may only be the first of a chain "
                                   "of at most two")
        ckey = ("codec", repr(s["codec"]), device) if cache is not None else None
        codec = cache.get(ckey) if ckey is not None else None
        if codec is None:
            codec = get_codec(s["codec"], device)
            if ckey is not None:
                cache[ckey] = codec
        got = (ref, rest[0] if rest else None, codec)
        if key is not None:
            if len(cache) > 4096:
                cache.clear()
            cache[key] = got
    for t in got[:2]:
        if t is not None and not t.accepts(s["nbytes"]):
            raise CorruptFileError(f"storage size does not fit its {t.wire_id} transform (not a multiple of "
                                   f"its width, or another size)")
    return got


def storage_plan_from_manifest(s: dict[str, Any], device: str) -> tuple[Transform | None, Codec]:
    """``(transform, codec)`` of a storage without a reference transform (see :func:`storage_chain`)."""
    ref, tf, codec = storage_chain(s, device)
    if ref is not None:
        raise CorruptFileError(f"storage refers to another storage ({ref.wire_id}); decode it with "
                               f"its reference")
    return tf, codec


def batches(rows: np.ndarray, nbytes: int, tf: Transform | None, window: int, word: int = 1
            ) -> Iterator[tuple[int, int, int, int]]:
    """(first row, end row, start byte, end byte) of each decode batch of one storage: a batch
    ends on a byteplane block boundary, and on a multiple of ``word`` (the first transform's
    word: a reference transform is undone word by word), once it holds ``window`` bytes (or at
    the end)."""
    if nbytes <= window and len(rows):  # (most storages: one batch, no running sums needed;
        yield 0, len(rows), 0, nbytes    # the manifest's validation made the chunks add up)
        return
    span = math.lcm(tf.block * tf.width if tf else 1, word)
    ends = np.cumsum(rows["raw"].astype(np.int64))
    i, n, start = 0, len(rows), 0
    while i < n:
        j = i
        while j < n:
            j += 1
            if (ends[j - 1] - start) >= window and ends[j - 1] % span == 0:
                break
        end = int(ends[j - 1])
        if tf is not None and end % (tf.block * tf.width) and end != nbytes:
            raise CorruptFileError("chunk boundaries do not align with byteplane blocks")
        yield i, j, start, end
        i, start = j, end


@dataclass
class Job:
    """One storage to decode into ``out`` (a flat uint8 tensor)."""
    rows: np.ndarray
    tf: Transform | None
    codec: Codec
    out: torch.Tensor
    #: a bound reference transform undone last (``xor``: ``out`` already holds the base storage)
    ref: RefTransform | None = None
    #: the file to read from (a base checkpoint's), or None: the one :func:`decode_jobs` is given
    fd: Any = None

    @property
    def stream_nbytes(self) -> int:
        """Bytes of the transformed stream its rows hold (a :class:`PlaneSubset` holds 3 of 4)."""
        n = self.out.numel()
        return n // 4 * self.tf.width if isinstance(self.tf, PlaneSubset) else n

    def dst(self, a: int, b: int) -> torch.Tensor:
        """The destination bytes of stream bytes ``a:b`` (whole blocks for a :class:`PlaneSubset`)."""
        if isinstance(self.tf, PlaneSubset):
            k = self.tf.width
            return self.out[a // k * 4:b // k * 4]
        return self.out[a:b]


def decode_jobs(fd: int, jobs: list[Job], window: int = DEFAULT_WINDOW,
                progress: Callable[[int], None] | None = None, breaks: Collection[int] = (),
                idle: Callable[[], None] | None = None) -> None:
    """Decode storages. Batches of whole blocks are grouped up to ``window`` bytes (many small
    storages per read and per codec call); a reader thread reads and checksums the next group
    into one of four pooled buffers while the current one is decoded (from memory, a
    ``FileObjectSource`` over a BytesIO, there is nothing to read: each group is prepared on
    this thread, and ``idle`` runs while the pool's threads decode the first group's fused
    pieces). Groups are decoded in
    order; a new group starts at every job index in ``breaks`` (a job that refers to the output
    of an earlier one is never in the same group: CPU groups undo transforms in parallel) and
    wherever the file changes (a job's ``fd``: a base checkpoint's storages). ``idle``: work of
    the caller's that needs no decoded bytes, done on this thread while the reader thread reads
    the first groups (the reader, not this thread, sets the pace of a load from fast storage);
    an error it raises ends the decode."""
    mem = getattr(fd, "mem", None) is not None  # (an in-memory source: storage.FileObjectSource)
    if not any(job.codec.device == "cuda" for job in jobs):
        # (the reader's next group overlaps this one's decoding)
        window = min(window, max(MEM_GROUP if mem else CPU_GROUP, CPU_GROUP_PER_THREAD * cpu_threads()))
    breaks = set(breaks)
    items = []
    pending = False  # a break whose job had no batch (an empty storage) goes to the next batch made
    for k, job in enumerate(jobs):
        pending = pending or k in breaks
        nb, nr = job.stream_nbytes, len(job.rows)
        if nb <= window and nr:  # (most storages: one batch; see batches())
            items.append((job, 0, nr, 0, nb, pending))
            pending = False
            continue
        for i, j, a, b in batches(job.rows, nb, job.tf, window, job.ref.word if job.ref else 1):
            items.append((job, i, j, a, b, pending))
            pending = False
    grouped: list[list] = []
    size = 0
    for *it, brk in items:
        if (grouped and not brk and size + (it[4] - it[3]) <= window
                and it[0].codec.device == grouped[-1][0][0].codec.device and it[0].fd == grouped[-1][0][0].fd):
            grouped[-1].append(tuple(it))
            size += it[4] - it[3]
        else:
            grouped.append([tuple(it)])
            size = it[4] - it[3]
    if not grouped:
        return
    gpu = any(job.codec.device == "cuda" or job.out.device.type == "cuda" for job in jobs)
    # where the Triton kernels are ready, GPU groups' chunks of more than 240 bytes are hashed on
    # the GPU after their upload (the reader's threads then only read: hashing there contended
    # with this thread for the GIL), and verified before the group's decode results are
    tk = triton_kernels(start=False) if gpu else None

    def prepare(grp: list) -> tuple:
        """One group's read (or, from memory, its views) and fused plan, as the decode loop takes it."""
        rows = _cat_rows([job.rows[i:j] for job, i, j, _a, _b in grp])
        # chunks hashed on the GPU are decoded before they are verified: only for codecs
        # whose decoders are bounded on any input (a damaged Zstd chunk hung nvCOMP)
        gpu_hash = (tk is not None and grp[0][0].codec.device == "cuda"
                    and all(job.codec.decodes_unverified for job, *_ in grp))
        src = fd if grp[0][0].fd is None else grp[0][0].fd
        pre = None
        cpu = grp[0][0].codec.device == "cpu" and all(job.out.device.type == "cpu" for job, *_ in grp)
        plan = _fused_plan(rows, grp, mem=getattr(src, "mem", None) is not None) if cpu else None
        # (the fused batches' chunks are verified by the decoding threads, each piece's
        # just before it is decoded: in parallel, not all on this thread before any decode)
        defer = plan.rows if plan is not None and plan.verify else None
        to_stream = rows["flags"] == FLAG_STORED_RAW
        if plan is not None:  # (the fused batches' stored planes are read into the buffer)
            to_stream &= ~plan.rows
        if SPLIT_READS and native.lib is not None and isinstance(src, int) and cpu and bool(to_stream.any()):
            # CPU group: raw chunks read straight into the stream
            pre = group_stream(rows, grp, "cpu", filled=True)
            host, soffs = read_split(src, rows, pre.stream.numpy(), pre.roffs, to_stream, defer)
            later = None
        else:
            host, soffs, later = read_stored(src, rows, pinned=gpu, gpu_hash=gpu_hash, defer=defer)
        return host, soffs, rows, later, (pre, plan), None

    if not gpu and mem and all(job.fd is None for job in jobs):
        # from memory there is nothing to read ahead: each group is prepared on this thread
        # just before its decode, with no reader thread to start and hand over to
        # (idle runs on this thread while the pool's threads start decoding the first group)
        todo = iter(grouped)
        with _capi.deferred_checks():
            _decode_loop(grouped, lambda: (0, *prepare(next(todo))), lambda _slot: None, progress, tk, idle)
        return

    q: queue.Queue = queue.Queue(maxsize=2)
    free: queue.Queue = queue.Queue()
    for slot in range(READ_AHEAD):
        free.put(slot)
    stop = threading.Event()

    def reader() -> None:
        try:
            for grp in grouped:
                if stop.is_set():
                    return
                slot = free.get()
                q.put((slot, *prepare(grp)))
        except BaseException as e:  # re-raised by the consumer
            q.put((None, None, None, None, None, (None, None), e))

    t = threading.Thread(target=reader, name="ckptzip-reader", daemon=True)
    t.start()
    try:
        if idle is not None:
            idle()
        with _capi.deferred_checks():
            _decode_loop(grouped, q.get, free.put, progress, tk)
    finally:
        stop.set()
        release_scratch()
        while t.is_alive():  # unblock a reader waiting for a slot or for queue room
            free.put(0)
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            t.join(timeout=0.01)


def _cat_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Chunk-table rows (contiguous slices of one structured array) concatenated as bytes: numpy's
    concatenate of structured arrays promotes their fields per array (a millisecond per hundred
    storages, holding the GIL)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8) for p in parts]).view(parts[0].dtype)


def _decode_loop(grouped: list, take: Callable[[], tuple], give: Callable[[int], None], progress, tk=None,
                 first: Callable[[], None] | None = None) -> None:
    """Consume what ``take`` returns (the reader thread's queue, or each group prepared on this
    thread): decode each group, hand its slot back (``give``). On the GPU
    a group's host buffer is handed back once the GPU is done with it, which the loop waits for
    only after it has queued the next group's work (the host launches group k while the GPU
    runs group k-1). Chunks the reader left to the GPU (``later``) are hashed by ``tk`` right
    after the upload; their checksums are verified before the group's decode statuses, and
    before any error the group's decoding raised, so a damaged chunk is a ChecksumError.
    ``first``: work for this thread in the first group's decode (:func:`decode_group`)."""
    prev = None  # (host buffer, slot, event after its work, decode-check mark, hashes) in flight

    def finish(p) -> None:
        host, slot, ev, mark, hashed = p
        ev.synchronize()  # its copies and decodes are done: the pinned buffer may be reused
        _verify_gpu_hashes(hashed)
        _capi.check_decodes(upto=mark)
        PINNED.release(host)
        give(slot)

    for grp in grouped:
        slot, host, soffs, rows, later, (pre, plan), err = take()
        if err is not None:
            raise err
        work = grp[0][0].codec.device
        src = host.to(work, non_blocking=True) if work != "cpu" else host
        hashed = None
        if later is not None and len(later):
            got = tk.xxh3_chunks(src, np.asarray(soffs, dtype=np.int64)[later], rows["stored"][later].astype(np.int64))
            hashed = (got.to("cpu", non_blocking=True), rows["xxh3"][later], rows["offset"][later])
        try:
            decode_group(src, soffs, rows, grp, work, tk, pre, plan, first)
            first = None
        except BaseException:
            if hashed is not None:
                torch.cuda.current_stream().synchronize()
                _verify_gpu_hashes(hashed)
            raise
        if work == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            cur = (host, slot, ev, _capi.pending_decodes(), hashed)
            if prev is not None:
                finish(prev)
            prev = cur
        else:
            if prev is not None:
                finish(prev)
                prev = None
            PINNED.release(host)  # (after an error it is not reused: the lease just lapses)
            give(slot)
        if progress and grp[0][0].fd is None:  # (a base file's storages are not counted)
            progress(sum(b - a for _j, _i, _jj, a, b in grp))
    if prev is not None:
        finish(prev)


def _verify_gpu_hashes(hashed) -> None:
    """Raise ChecksumError for the first chunk whose GPU-computed XXH3 (copied to the host; the
    caller has waited for the copy) differs from the chunk table's."""
    if hashed is None:
        return
    got, want, offs = hashed
    bad = np.nonzero(got.numpy().view(np.uint64) != want.astype(np.uint64))[0]
    if len(bad):
        raise ChecksumError(f"chunk at file offset {int(offs[bad[0]])} fails its checksum")


class GroupStream(NamedTuple):
    """A decode group's stream and where each chunk's output goes in it."""
    direct: bool  # one batch without transforms: the stream is its destination
    starts: np.ndarray  # each batch's first byte in the stream
    stream: torch.Tensor
    roffs: np.ndarray  # each chunk's output offset in the stream
    filled: bool  # the reader put the raw chunks in place already (io.reader.read_split)


def group_stream(rows: np.ndarray, grp: list, work: str, filled: bool = False) -> GroupStream:
    """The group's :class:`GroupStream`. Each batch starts 16-byte aligned (a storage of a
    few bytes, such as an optimizer's step count, would otherwise misalign every chunk after it,
    and nvCOMP's outputs must be aligned: each misaligned chunk was decoded aside and copied)."""
    raws = rows["raw"].astype(np.int64)
    direct = (len(grp) == 1 and grp[0][0].tf is None and grp[0][0].ref is None
              and grp[0][0].out.device.type == work)
    sizes = np.asarray([b - a for _job, _i, _j, a, b in grp], dtype=np.int64)
    starts = np.zeros(len(grp), dtype=np.int64)
    np.cumsum(-(-sizes[:-1] // ALIGN) * ALIGN, out=starts[1:])
    total = int(starts[-1] + sizes[-1])
    if direct:
        stream = grp[0][0].out[grp[0][3]:grp[0][4]]
    else:  # (pinned where it goes to the GPU next: the copy is then asynchronous)
        to_gpu = work == "cpu" and grp[0][0].out.device.type == "cuda"
        stream = (HOST.take(total) if work == "cpu" and not to_gpu
                  else torch.empty(total, dtype=torch.uint8, device=work, pin_memory=to_gpu))
    counts = np.asarray([j - i for _job, i, j, _a, _b in grp], dtype=np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # each row's batch's first row
    within = np.cumsum(raws) - raws
    roffs = np.repeat(starts, counts) + within - within[first]
    return GroupStream(direct, starts, stream, roffs, filled)


def decode_group(src: torch.Tensor, soffs: list[int], rows: np.ndarray, grp: list, work: str, tk=None,
                 pre: GroupStream | None = None, plan: FusedPlan | None = None,
                 first: Callable[[], None] | None = None) -> None:
    """Decode a group of batches (``rows`` concatenated in group order, already verified): the
    batches of ``plan`` in one pass each (:func:`_decode_fused`; their chunks are all in
    ``src``); of the others, raw chunks are copied (unless ``pre`` says the reader put them in
    place), codec chunks go to one call per codec, transforms are undone per batch, or, on the
    GPU with the Triton kernels ``tk``, in one launch per kind of transform chain. ``first``:
    the caller's work that needs no decoded bytes, done on this thread while the pool's threads
    start on the fused pieces (before anything else where there are none)."""
    soffs = np.asarray(soffs, dtype=np.int64)
    if plan is None or not any(plan.batches):
        if first is not None:
            first()
        _decode_rest(src, soffs, rows, grp, work, tk, pre, plan)
        return
    if all(plan.batches):
        _decode_fused(src, soffs, plan, rows, first)
        return
    if sum(b - a for (_job, _i, _j, a, b), f in zip(grp, plan.batches) if not f) >= OVERLAP_REST:
        _decode_fused(src, soffs, plan, rows, first)
        _decode_rest(src, soffs, rows, grp, work, tk, pre, plan)
        return

    later: list[BaseException] = []

    def mine() -> None:
        # the other batches (small storages: all their steps run inline) on this thread
        # while the pool's threads start on the fused pieces
        if first is not None:
            first()
        try:
            _decode_rest(src, soffs, rows, grp, work, tk, pre, plan)
        except BaseException as e:  # (after the pieces' errors, as when they ran first)
            later.append(e)
    _decode_fused(src, soffs, plan, rows, mine)
    if later:
        raise later[0]


def _decode_rest(src: torch.Tensor, soffs: np.ndarray, rows: np.ndarray, grp: list, work: str, tk,
                 pre: GroupStream | None, plan: FusedPlan | None) -> None:
    """:func:`decode_group`'s two-step path: the batches that ``plan`` (if any) leaves."""
    stored = rows["stored"].astype(np.int64)
    raws = rows["raw"].astype(np.int64)
    if pre is None:
        pre = group_stream(rows, grp, work)
    direct, starts, stream, roffs, filled = pre
    left = ~plan.rows if plan is not None else np.ones(len(rows), dtype=bool)  # (the other batches' rows)
    is_raw = (rows["flags"] == FLAG_STORED_RAW) & left
    if filled:
        pass
    elif work == "cpu":  # numpy: torch's intra-op threads stall on oversubscribed cores
        _np_copy_segments(src.numpy(), soffs[is_raw], stream.numpy(), roffs[is_raw], raws[is_raw])
    else:
        copy_segments(src, soffs[is_raw], stream, roffs[is_raw], raws[is_raw], start_kernels=False)
    job_key, calls = codec_calls(job.codec for job, *_ in grp)
    if len(calls) > 1:
        key_of_row = np.repeat(np.asarray(job_key, dtype=np.int64), [j - i for _job, i, j, _a, _b in grp])
    coded = ~is_raw & left
    for k, codec in enumerate(calls):
        ks = np.nonzero(coded if len(calls) == 1 else coded & (key_of_row == k))[0]
        if len(ks):
            cols = (soffs[ks], stored[ks], roffs[ks], raws[ks])
            if codec.device != "cuda":
                cols = tuple(c.tolist() for c in cols)
            codec.decode(src, cols[0], cols[1], stream, cols[2], cols[3])
    if direct:
        return
    if work == "cpu":
        outs = {job.out.device for job, *_ in grp}
        if all(d.type == "cpu" for d in outs):
            done = plan.batches if plan is not None else [False] * len(grp)
            todo = [(b, pos) for b, pos, f in zip(grp, starts.tolist(), done) if not f]
            _cpu_untransform(stream, [b for b, _pos in todo], [pos for _b, pos in todo])
            return
        if len(outs) == 1:  # chunks decoded on the host for one GPU: transforms undone there
            stream, work = stream.to(grp[0][0].out.device, non_blocking=True), "cuda"
    todo = zip(grp, starts.tolist())
    if work == "cuda" and tk is not None and enabled("decode_multi"):
        todo = _untransform_multi(tk, stream, list(todo))
    for (job, i, j, a, b), pos in todo:
        part = stream[pos:pos + (b - a)]
        dst = job.dst(a, b)
        # (chunks decoded on the CPU for a GPU tensor: the two steps)
        fz = fused_planes(job.tf, job.ref, a, dst, start=False) if part.device == dst.device else None
        if fz is not None and fz[0].decode_ref(part, fz[1], dst, *fz[2:]):
            pass  # one kernel: planes -> residual -> onto the base (the reference may be dst itself)
        elif job.ref is not None:
            if job.tf is not None:
                tmp = torch.empty_like(part)
                job.tf.decode(part, tmp)
                part = tmp
            job.ref.decode(part, dst, start=a)
        elif job.tf is not None:
            if dst.device.type == work:
                job.tf.decode(part, dst)
            else:
                tmp = torch.empty(dst.numel(), dtype=torch.uint8, device=part.device)  # (a PlaneSubset's
                job.tf.decode(part, tmp)  # destination is 4/3 of its stream)
                dst.copy_(tmp)
        else:
            dst.copy_(part)


def _untransform_multi(tk, stream: torch.Tensor, todo: list) -> list:
    """Undo the transforms of a GPU group's batches (``((job, i, j, a, b), position in stream)``)
    with one kernel launch per kind of chain (:func:`~ckptzip.transforms.refs.multi_segment`) and
    one segment copy for the batches without transforms; return the batches left to undo one by
    one (other chains, destinations elsewhere, and all of a kind whose kernel failed to compile).
    The host only builds offset tables: a few microseconds per batch instead of a launch or
    several torch operations each."""
    base = stream.data_ptr()
    kinds: dict[tuple, list] = {}
    copies: list = []
    rest: list = []
    for item in todo:
        (job, _i, _j, a, b), pos = item
        out = job.out
        if out.device != stream.device:
            rest.append(item)
        elif job.ref is None and job.tf is None:
            copies.append(item)
        elif isinstance(job.tf, PlaneSubset):  # planes of a base storage (hidelta's reference)
            k = job.tf.width
            doff = out.data_ptr() + a // k * 4 - base
            if doff % 4:
                rest.append(item)
            else:
                kinds.setdefault((PARTIAL16 if job.tf.rotate == 16 else PARTIAL, 4, True), []).append(
                    (item, (pos, doff, doff, (b - a) // k, job.tf.block, 0, 0, 0)))
        else:
            k = multi_segment(job.tf, job.ref, a, b - a, out.data_ptr() + a, out.device)
            if k is None:
                rest.append(item)
            else:
                mode, w, planes, block, rptr, cptr, ncols, w0 = k
                kinds.setdefault((mode, w, planes), []).append(
                    (item, (pos, out.data_ptr() + a - base, rptr - base, (b - a) // w, block,
                            cptr - base if cptr else 0, ncols, w0)))
    if copies:
        cols = np.asarray([(pos, job.out.data_ptr() + a - base, b - a) for (job, _i, _j, a, b), pos in copies],
                          dtype=np.int64).T
        tk.copy_segments(stream, cols[0], stream, cols[1], cols[2])
    for (mode, w, planes), segs in kinds.items():
        if launch("decode_multi", tk.decode_multi, stream, *np.asarray([s for _item, s in segs], dtype=np.int64).T,
                  w, mode, planes):
            continue
        rest.extend(item for item, _s in segs)
    return rest


def _fusable(job: Job) -> bool:
    """Whether a job's batches are decoded by :func:`_decode_fused`: byte planes (whole-word
    rotation) of a CPU destination, zstd frames decoded by the system's libzstd (stored chunks
    aside), and no reference transform or one undone in place word by word (``expgrid``,
    ``expref``: applied to each piece right after its words are assembled)."""
    tf = job.tf
    return (FUSED and type(tf) is BytePlane and tf.rotate is None
            and (job.ref is None or job.ref.in_place and tf.width % job.ref.word == 0)  # (pieces: whole ref words)
            and type(job.codec) is ccpu.ZstdCPU and job.out.device.type == "cpu" and ccpu.native_zstd())


def _fused_batch(job: Job, a: int, b: int) -> bool:
    """Whether stream bytes ``a:b`` of ``job`` go to :func:`_decode_fused`."""
    return b - a >= FUSED_MIN and _fusable(job)


def _fused_tables(rows: np.ndarray, counts: np.ndarray, width: np.ndarray, block: np.ndarray,
                  nbytes: np.ndarray) -> tuple[list, np.ndarray]:
    """The chunk tables of :func:`ckptzip._bpnative.planes_fused` for many batches in one numpy
    pass (per batch, numpy calls cost about 20 us): batch k is the next ``counts[k]`` (at least
    one) of ``rows`` (in stream order), with its byteplane width, block (words) and stream
    bytes. Returns the table's columns without the source offsets, for all rows (batch k's rows
    are a slice of each): plane (+ 256 for a zstd frame), first word, words and stored size of
    each chunk; and whether each batch can be decoded so. A batch with a chunk across two planes
    cannot (a layout this writer never makes: such a batch is decoded the two-step way, which
    takes any chunking)."""
    raws = rows["raw"].astype(np.int64)
    w, blk, nb = (np.repeat(x, counts) for x in (width, block, nbytes))
    starts = np.cumsum(counts) - counts
    ends = np.cumsum(raws)
    pos = ends - raws
    pos -= np.repeat(pos[starts], counts)  # each chunk's first byte in its batch's stream
    bi = pos // (blk * w)
    m = np.minimum(blk, nb // w - bi * blk)  # each chunk's block's words
    bad = (raws <= 0) | (nb % w != 0) | (m <= 0)
    m = np.maximum(m, 1)
    within = pos - bi * (blk * w)
    plane = within // m
    off = within - plane * m
    bad |= off + raws > m
    kind = (rows["flags"] != FLAG_STORED_RAW).astype(np.int64)
    return [plane + 256 * kind, bi * blk + off, raws, rows["stored"].astype(np.int64)], ~np.logical_or.reduceat(bad, starts)


class FusedPlan(NamedTuple):
    """The batches of a CPU decode group that :func:`_decode_fused` decodes."""
    rows: np.ndarray  # a mask of the group's rows that belong to them
    batches: list  # a flag per batch of the group
    items: list  # (job, a, b, first row, table without source offsets) per fused batch
    #: per item, :func:`_piece_cost` of its whole batch (one numpy pass for all of them)
    costs: list
    #: their chunks are verified by the decoding threads, each piece's just before it is
    #: decoded (the reader read them without verifying: ``defer``), else by the reader
    verify: bool = False


def _fused_plan(rows: np.ndarray, grp: list, mem: bool = False) -> FusedPlan | None:
    """The group's :func:`_fused_batch` batches with their ``planes_fused`` tables (the
    source-offset column is added once the group is read), or None where there is none.
    ``mem``: the group is read from memory (nothing is read, so its pieces verify it at any
    size)."""
    want = [k for k, (job, i, j, a, b) in enumerate(grp) if j > i and _fused_batch(job, a, b)]
    if not want:
        return None
    counts = np.fromiter((j - i for _job, i, j, _a, _b in grp), dtype=np.int64, count=len(grp))
    first = np.cumsum(counts) - counts
    sel = np.asarray(want, dtype=np.int64)
    c = counts[sel]
    # the selected batches' rows, in group order (each batch's rows are contiguous in the group)
    idx = np.repeat(first[sel] - (np.cumsum(c) - c), c) + np.arange(int(c.sum()), dtype=np.int64)
    tfs = [grp[k][0].tf for k in want]
    nbytes = np.fromiter((grp[k][4] - grp[k][3] for k in want), np.int64, len(want))
    cols, ok = _fused_tables(rows[idx], c, np.fromiter((t.width for t in tfs), np.int64, len(tfs)),
                             np.fromiter((t.block for t in tfs), np.int64, len(tfs)), nbytes)
    # each batch's whole cost (_piece_cost of all its words): its bytes, and CODED_EXTRA more per
    # byte of its zstd-coded chunks
    whole = (nbytes + CODED_EXTRA * np.add.reduceat(np.where(cols[0] >= 256, cols[2], 0),
                                                    np.cumsum(c) - c)).tolist()
    items, flags, costs = [], [False] * len(grp), []
    mask = np.zeros(len(rows), dtype=bool)
    at = 0
    for k, n, good, cost in zip(want, c.tolist(), ok.tolist(), whole):
        if good:
            job, _i, _j, a, b = grp[k]
            r0 = int(first[k])
            flags[k] = True
            mask[r0:r0 + n] = True
            items.append((job, a, b, r0, [col[at:at + n] for col in cols]))
            costs.append(cost)
        at += n
    if not items:
        return None
    # the decoding threads verify the chunks where the reader would hash them on its one thread
    # (a 16-core host's 64 MiB groups are hashed by the read pool's threads as they are read:
    # there, hashing in the decoding threads made a 2.4 GB load 5-7 % slower)
    verify = VERIFY_IN_PIECES and (mem or int(rows["stored"][mask].sum()) < HASH_PARALLEL_MIN)
    return FusedPlan(mask, flags, items, costs, verify)


def _decode_fused(src: torch.Tensor, soffs: np.ndarray, plan: FusedPlan, rows: np.ndarray,
                  first: Callable[[], None] | None = None) -> None:
    """Decode the batches of ``plan`` straight from the read buffer ``src`` (chunk ``i`` of the
    group at ``soffs[i]``, its chunk-table row ``rows[i]``) into their destinations: each batch's words are assembled in one pass
    from its stored planes, read where they lie, and its zstd planes, each frame decoded into a
    chunk-sized scratch just before (``planes_fused``). The two-step path wrote every byte into
    the group stream first and read it back. Large batches are cut into pieces where every plane
    has a chunk start (no chunk is decoded by two pieces; :data:`PIECES_PER_THREAD`), which the
    calling thread and the CPU pool's take costliest first (:func:`pmap_balanced`).
    With ``plan.verify`` the reader left these batches' checksums to this function: each
    piece's chunks are verified by its thread just before it decodes them. ``first``: the
    group's other work, done by the calling thread before it takes pieces."""
    threads = cpu_threads()
    total = sum(b - a for _job, a, b, _r0, _t in plan.items)
    share = max(PIECE_MIN, -(-total // (PIECES_PER_THREAD * threads)))
    work = []  # (item, first word, end word)
    costs = []  # each piece's _piece_cost
    for it, cost in zip(plan.items, plan.costs):
        job, a, b, _r0, t = it
        w = job.tf.width
        nw = (b - a) // w
        if b - a <= share:
            work.append((it, 0, nw))
            costs.append(cost)
            continue
        starts = t[1][t[0] % 256 == 0]  # where every plane's chunks start
        for p in range(1, w):
            starts = np.intersect1d(starts, t[1][t[0] % 256 == p], assume_unique=True)
        want = np.arange(1, -(-(b - a) // share)) * (share // w)
        cuts = np.unique(starts[np.clip(np.searchsorted(starts, want), 0, len(starts) - 1)])
        edges = [0, *[int(x) for x in cuts if 0 < x < nw], nw]
        work.extend((it, e0, e1) for e0, e1 in zip(edges, edges[1:]))
        costs.extend(_piece_cost(it, e0, e1) for e0, e1 in zip(edges, edges[1:]))
    s = src.numpy()
    # (with native.XXH3 each piece's chunks are verified inside planes_fused, without the GIL)
    sums = rows["xxh3"].astype(np.uint64) if plan.verify and native.XXH3 else None  # (lib is set here)

    def call(k: int) -> tuple:
        """Piece k's planes_fused arguments after the source."""
        (job, a, b, r0, t), w0, w1 = work[k]
        n = len(t[0])
        return (job.out.numpy()[a:b], job.tf.width, t[0], t[1], t[2], np.ascontiguousarray(soffs[r0:r0 + n]), t[3],
                w0, w1, sums[r0:r0 + n] if sums is not None else None)

    def failed(k: int, err: tuple) -> None:
        r0 = work[k][0][3]
        if err[1] == "checksum" and sums is not None:
            raise ChecksumError(f"chunk at file offset {int(rows['offset'][r0 + err[0]])} fails its checksum")
        raise CodecError(f"zstd: chunk {r0 + max(err[0], 0)} {err[1]}")

    def one(k: int) -> None:
        (job, a, b, r0, t), w0, w1 = work[k]
        *args, xxh = call(k)
        if sums is None and plan.verify:  # (this piece's chunks: those holding words w0..w1)
            mine = np.nonzero((t[1] < w1) & (t[1] + t[2] > w0))[0] if w0 or w1 < (b - a) // job.tf.width else slice(None)
            verify(s, args[5][mine], rows[r0:r0 + len(t[0])][mine])
        try:
            err = native.lib.planes_fused(s, *args, *(() if xxh is None else (xxh,)))
        except ValueError as e:  # (the table is built from a validated manifest)
            raise CorruptFileError(f"byteplane chunks: {e}") from None
        if err is not None:
            failed(k, err)
        if job.ref is not None:  # (in place, on the piece while it is in the cache)
            w = job.tf.width
            piece = job.out[a + w0 * w:a + w1 * w]
            job.ref.decode(piece, piece, start=a + w0 * w)
    # pieces whose chunks are verified in C (or were by the reader), without a reference
    # transform or with one C undoes (expgrid, expref), go to one shared queue in C: each thread
    # takes pieces from it in one call without the GIL (no handover per piece, while the calling
    # thread runs ``first``'s Python)
    posts = {id(it): _queue_post(it[0], it[1], it[2]) for it in plan.items} if QUEUE_PIECES else {}
    queued = ([k for k, (it, _w0, _w1) in enumerate(work) if posts[id(it)] is not False]
              if QUEUE_PIECES and (sums is not None or not plan.verify) else [])
    if len(queued) < 2:
        pmap_balanced(one, costs, PIECE_MIN, first)
        return
    is_queued = set(queued)
    rest = [k for k in range(len(work)) if k not in is_queued]
    items = [(*call(k), posts[id(work[k][0])]) for k in queued]
    order = np.argsort(-np.asarray([costs[k] for k in queued]), kind="stable").astype(np.int64)
    counter = np.zeros(2, dtype=np.int64)

    def take(j: int) -> None:
        if j >= len(rest):  # (one of the queue's takers: every thread runs one)
            try:
                err = native.lib.planes_fused_many(s, items, order, counter)
            except ValueError as e:
                raise CorruptFileError(f"byteplane chunks: {e}") from None
            if err is not None:
                failed(queued[err[0]], err[1:])
            return
        one(rest[j])
    queue_cost = sum(costs[k] for k in queued)
    pmap_balanced(take, [costs[k] for k in rest] + [queue_cost] * threads, PIECE_MIN, first)


def _queue_post(job: Job, a: int, b: int):
    """A fused batch's reference step for ``planes_fused_many`` (:meth:`RefTransform.c_step`,
    applied by C to each piece once decoded), None where it has none, or False where C has no
    such step (the piece is decoded by its own call, then the step in Python)."""
    if job.ref is None:
        return None
    step = job.ref.c_step(a, b - a)
    return False if step is None else step


#: what a zstd-coded byte of a fused batch costs beyond a byte assembled from stored planes, in
#: units of the latter (:func:`_piece_cost`, and the whole batches' costs in :func:`_fused_plan`)
CODED_EXTRA = 3


def _piece_cost(item, w0: int, w1: int) -> float:
    """Estimated decode time of words ``w0:w1`` of a fused batch, in units of a byte assembled
    from stored planes: a zstd-coded byte costs about 4 (the 2-core VM: 0.6-1.7 GB/s a core
    for zstd frames of byte planes, 5-8 GB/s for the assembly)."""
    t = item[4]
    lo, hi = np.maximum(t[1], w0), np.minimum(t[1] + t[2], w1)
    coded = int(np.sum(np.where((t[0] >= 256) & (hi > lo), hi - lo, 0)))
    return (w1 - w0) * item[0].tf.width + CODED_EXTRA * coded


def _np_copy_segments(src: np.ndarray, soffs: np.ndarray, dst: np.ndarray, doffs: np.ndarray,
                      lens: np.ndarray) -> None:
    """dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]], runs of adjacent segments in one copy."""
    if not len(lens):
        return
    brk = np.ones(len(lens), dtype=bool)
    brk[1:] = (soffs[1:] != soffs[:-1] + lens[:-1]) | (doffs[1:] != doffs[:-1] + lens[:-1])
    starts = np.nonzero(brk)[0]
    lens = np.add.reduceat(lens, starts)
    soffs, doffs = soffs[starts], doffs[starts]
    if native.lib is not None:  # in C, without the GIL, split between the pool's threads
        k = cpu_threads() if int(lens.sum()) >= ccpu.PARALLEL_BYTES else 1
        if k > 1:  # merged runs longer than a thread's share are cut into shares first
            soffs, doffs, lens = split_ranges(soffs, doffs, lens, -(-int(lens.sum()) // k))
        parts = runs(lens.tolist(), k) if k > 1 else [range(len(lens))]
        pmap(lambda r: native.lib.copy_segments(src, dst, *(np.ascontiguousarray(a[parts[r].start:parts[r].stop])
                                                            for a in (soffs, doffs, lens))), len(parts))
        return
    for s, d, n in zip(soffs.tolist(), doffs.tolist(), lens.tolist()):
        dst[d:d + n] = src[s:s + n]


def _cpu_untransform(stream: torch.Tensor, grp: list, starts: list[int]) -> None:
    """Undo the transforms of a CPU group (batch k at ``starts[k]`` of ``stream``) into the CPU
    destinations, storages spread over the CPU pool's threads (numpy releases the GIL). A
    reference transform is undone last, from a scratch buffer it may overwrite (``stream`` is
    scratch whenever a group has one). Small batches of byte planes alone, or without a
    transform, are undone (copied) first, in one loop on this thread (:data:`SMALL_INVERSE`)."""
    if native.lib is not None:
        is_small = [b - a <= SMALL_INVERSE and job.ref is None
                    and (job.tf is None or type(job.tf) is BytePlane and job.tf.rotate is None)
                    for job, _i, _j, a, b in grp]
        if any(is_small):
            s, dec = stream.numpy(), native.lib.decode
            small = [(item, pos) for item, pos, sm in zip(grp, starts, is_small) if sm]

            def one(k: int) -> None:
                (job, _i, _j, a, b), pos = small[k]
                if job.tf is None:  # (a small storage without transform: a copy)
                    np.copyto(job.out.numpy()[a:b], s[pos:pos + (b - a)])
                    return
                w = job.tf.width
                dec(s[pos:pos + (b - a)], job.out.numpy()[a:b], w, job.tf.block, 0, (b - a) // w)
            pmap_sized(one, [item[4] - item[3] for item, _pos in small], inline_small=True)
            grp = [item for item, sm in zip(grp, is_small) if not sm]
            starts = [pos for pos, sm in zip(starts, is_small) if not sm]
            if not grp:
                return
    tasks = [(job.tf, job.ref, stream[pos:pos + (b - a)], job.dst(a, b), a, b)
             for (job, _i, _j, a, b), pos in zip(grp, starts)]

    def one(k: int) -> None:
        tf, ref, part, dst, a, b_ = tasks[k]
        if ref is not None:
            if _fused(tf, ref):
                np_decode_onto(part.numpy(), dst.numpy(), ref.base_slice(a, b_ - a).numpy(), tf.width, tf.block,
                               "delta" if isinstance(ref, Delta) else "xor")
                return
            if tf is not None and ref.in_place:  # planes into the destination, then the words there
                tf.decode(part, dst)
                ref.decode(dst, dst, start=a)
                return
            if tf is not None:
                tmp = empty_bytes(part.numel())
                tf.decode(part, tmp)
                part = tmp
            ref.decode_scratch(part, dst, start=a)
        elif tf is not None:
            tf.decode(part, dst)
        else:
            np.copyto(dst.numpy(), part.numpy())
    pmap_sized(one, [b - a for _job, _i, _j, a, b in grp])


def _fused(tf: Transform | None, ref: RefTransform) -> bool:
    """Whether a CPU ``byteplane`` + ``delta``/``xor`` pair is undone in one cache-blocked pass."""
    return planes_after_ref(tf, ref) and ref.ref.device.type == "cpu"
