"""Encoding: transform a group of units into one stream on the codec's device, compress every
chunk of each codec in one call, and pack the chunks (16-byte aligned) for staging or writing."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import native
from ..codecs.cpu import pmap_balanced, pmap_sized
from ..format import FLAG_STORED_RAW, ROW
from ..kernels import MULTI_MAX, enabled, launch, triton_kernels
from ..transforms import Transform
from ..transforms.byteplane import BytePlane
from ..transforms.refs import fused_planes, multi_segment
from .memory import HOST, PINNED, ceil_align, copy_segments
from .plan import Unit, codec_calls

#: CPU units of byte planes alone (whole-word rotation) up to this size are transformed in one
#: loop on the encoding thread, one C call each: the general path (checks, the pool's runs) cost
#: about 30 us per unit, more than the work for a model's norms, biases and counters
SMALL_PLANES = 64 << 10
#: host units without a transform in a GPU group are uploaded together up to this many bytes
#: (see encode_group_arrays): an optimizer's step counters, a model's small buffers kept on the
#: CPU (an upload from pageable memory this small returns at once)
HOSTED_MAX = 256 << 10
#: larger CPU units are transformed in pieces of this many bytes (see encode_group_arrays)
TF_PIECE = 1 << 20
#: host tensors are moved to the GPU and transformed in slices of this size (whole transform
#: blocks), so staging needs no window-sized GPU buffer
STAGE_SLICE = 32 << 20


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
    #: each chunk's XXH3-64 (uint64), computed by the encoding for CPU groups (see
    #: :func:`_cpu_checksums`), or None: the writer computes them
    xxh3: np.ndarray | None = None

    def packed(self) -> tuple[np.ndarray, int]:
        """16-byte aligned offsets of the chunks packed back to back, and the packed size."""
        padded = ceil_align(self.stored)
        offs = np.zeros(len(padded), dtype=np.int64)
        np.cumsum(padded[:-1], out=offs[1:])
        return offs, int(padded.sum())

    def rows(self, offs: np.ndarray) -> np.ndarray:
        """Table rows (checksums zero) for chunks placed at ``offs``."""
        r = np.zeros(len(offs), ROW)
        r["offset"], r["stored"], r["raw"], r["flags"] = offs, self.stored, self.raw, self.flags
        return r


def encode_group_arrays(units: list[Unit], checksums: bool = True, large_alone: bool = True) -> Encoded:
    """Transform every unit into one group stream on the codec device and compress all chunks of
    each codec in one call; a chunk that does not shrink stays raw. Chunk bookkeeping is done
    with numpy arrays: a group holds thousands of chunks. ``checksums=False``: CPU groups'
    chunks are not hashed (``Encoded.xxh3`` None: the planner's samples, never written).
    ``large_alone`` (GPU groups): units of :data:`~ckptzip.kernels.MULTI_MAX` bytes or more take
    the one-storage kernels, faster on the GPU; False (an async save's snapshot, where the
    training loop waits for the host): they join the multi-segment launches, one per kind of
    chain instead of one each (a Triton launch costs the host 50-100 us; same bytes)."""
    dev = units[0].plan.codec.device
    # each unit starts 16-byte aligned in the group stream, so nvCOMP reads chunks in place
    total = sum(ceil_align(u.data.numel()) for u in units)
    # on a GPU with the Triton kernels, each kind of chain is applied to all its units in one
    # launch (multi[k]: the unit's segment; see transforms.refs.multi_segment)
    multi: list = [None] * len(units)
    here = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else None  # the group stream's
    tk = None
    if dev == "cuda" and enabled("encode_multi") and not (len(units) == 1 and units[0].plan.transform is None):
        tk = triton_kernels()
        if tk is not None:
            multi = [multi_segment(u.plan.transform, u.plan.ref, u.start, u.data.numel(), u.data.data_ptr(), here,
                                   large_alone=large_alone)
                     if not u.resolved and u.data.numel() and u.data.device == here
                     and (u.plan.transform is not None or u.plan.ref is not None) else None for u in units]

    def fused_of(u: Unit):  # (on a GPU, ``xor`` / ``delta`` then ``byteplane`` is one fused kernel)
        return (fused_planes(u.plan.transform, u.plan.ref, u.start, u.data)
                if here is not None and not u.resolved and u.data.numel() and u.data.device == here else None)

    def residual(u: Unit, fz):  # a unit's data after its reference transform (xor, derived, ...:
        # one elementwise op per window, on the storage's device), unless fused, or made by the
        # CPU planes' pass itself (pre)
        return (u.plan.ref.encode(u.data, start=u.start) if u.plan.ref is not None and not u.resolved
                and u.data.numel() and fz is None and id(u) not in pres else u.data)

    # CPU expgrid / expref units under plain byte planes: the residual is made word by word in
    # the planes' C pass (encode's pre step), not as a whole new tensor first on this thread
    pres = {id(u): p for u in units if dev == "cpu" for p in (_pre_step(u),) if p is not None}
    fused = [fused_of(u) if mk is None else None for u, mk in zip(units, multi)]
    datas = [residual(u, fz) if mk is None else u.data for u, fz, mk in zip(units, fused, multi)]
    single = len(units) == 1 and units[0].plan.transform is None and datas[0].device.type == dev
    stream = datas[0] if single else HOST.take(total) if dev == "cpu" else torch.empty(total, dtype=torch.uint8, device=dev)
    staged = None
    copies: tuple[list, list] = ([], [])  # plain same-device copies, done in one batched call
    cpu_tf: list = []  # CPU transforms, run by the CPU pool's threads after the loop

    def steps(u: Unit, data: torch.Tensor, fz, pos: int) -> None:  # one unit's transforms, on its own
        nonlocal staged
        n = data.numel()
        if data.device.type != dev and dev == "cuda":
            if staged is None:
                staged = PINNED.acquire(total)
            staged[pos:pos + n].copy_(data)
            _upload(staged[pos:pos + n], stream[pos:pos + n], u.plan.transform)
            return
        src = data if data.device.type == dev else data.to(dev)
        if u.plan.transform is not None and dev == "cpu":
            cpu_tf.append((u.plan.transform, src, stream[pos:pos + n], pres.get(id(u)), u))
        elif fz is not None and fz[0].encode_ref(src, fz[1], stream[pos:pos + n], *fz[2:]):
            pass  # one kernel: residual against the base -> planes
        elif fz is not None:  # the fused kernel is unavailable: the two steps
            u.plan.transform.encode(u.plan.ref.encode(src, start=u.start), out=stream[pos:pos + n])
        elif u.plan.transform is not None:
            u.plan.transform.encode(src, out=stream[pos:pos + n])
        else:
            copies[0].append(stream[pos:pos + n])
            copies[1].append(src)

    kinds: dict[tuple, list] = {}  # (mode, width, planes) -> [(unit, position, segment)]
    # GPU units without a transform under MULTI_MAX bytes (norms, biases, step counters, ...):
    # [(address, position, bytes)], copied into the stream by one copy_segments launch (a
    # slice and a copy each cost the host about 25 us per unit, for 403 of the GPU benchmark's)
    plain: list[tuple[int, int, int]] = []
    plain_steps: list[tuple] = []  # their steps() arguments, for the torch way if the launch fails
    # host units of that kind (optimizers' step counters): [(position, data)], uploaded together
    # and placed by the same launch (a pinned slice, a copy and an upload each cost the host
    # about 15 us per unit, for 149 of the GPU benchmark's)
    hosted: list[tuple[int, torch.Tensor]] = []
    hosted_bytes = 0
    pos = 0
    for u, data, fz, mk in zip(units, datas, fused, multi):
        n = data.numel()
        u.base = pos
        if mk is not None:
            mode, w, planes, block, rptr, cptr, ncols, w0 = mk
            sb = stream.data_ptr()
            kinds.setdefault((mode, w, planes), []).append(
                (u, pos, (pos, data.data_ptr() - sb, rptr - sb, n // w, block, cptr - sb if cptr else 0, ncols, w0)))
        elif not single and n:
            if tk is not None and u.plan.transform is None and n < MULTI_MAX and data.device == here:
                plain.append((data.data_ptr(), pos, n))
                plain_steps.append((u, data, fz, pos))
            elif (tk is not None and u.plan.transform is None and data.device.type == "cpu"
                  and hosted_bytes + ceil_align(n) <= HOSTED_MAX):
                hosted.append((pos, data))
                hosted_bytes += ceil_align(n)
                plain_steps.append((u, data, fz, pos))
            else:
                steps(u, data, fz, pos)
        pos += ceil_align(n)
    if hosted:  # one small upload from pageable memory (no pinned buffer, no wait for it later)
        pad = np.zeros(16, dtype=np.uint8)
        parts = [x for _p, d in hosted for x in (d.numpy(), pad[:ceil_align(d.numel()) - d.numel()])]
        up = torch.from_numpy(np.concatenate(parts)).to(here, non_blocking=True)
        at = up.data_ptr()  # (each piece 16-byte aligned there, as in the stream: the kernel's wide copies)
        for p, d in hosted:
            plain.append((at, p, d.numel()))
            at += ceil_align(d.numel())
    if plain:
        addr, at, lens = np.asarray(plain, dtype=np.int64).T
        if not launch("encode_multi", tk.copy_segments, stream, addr - stream.data_ptr(), stream, at, lens):
            for args in plain_steps:  # the kernel is unavailable: torch copies
                steps(*args)
    for (mode, w, planes), segs in kinds.items():
        # each kind of chain (planes, expref, expgrid, derived, xor/delta + planes) in one launch
        if not launch("encode_multi", tk.encode_multi, stream,
                      *np.asarray([sg for _u, _p, sg in segs], dtype=np.int64).T, w, mode, planes):
            for u, p, _sg in segs:  # the kernel is unavailable: unit by unit
                fz = fused_of(u)
                steps(u, residual(u, fz), fz, p)
    if copies[0]:
        if dev == "cpu":  # numpy: torch's intra-op threads stall on oversubscribed cores
            for d, s in zip(*copies):
                np.copyto(d.numpy(), s.numpy())
        else:
            torch._foreach_copy_(*copies)
    if cpu_tf and native.lib is not None:  # small units of byte planes alone: one C call each, here
        is_small = [t[1].numel() <= SMALL_PLANES and type(t[0]) is BytePlane and t[0].rotate is None for t in cpu_tf]
        if any(is_small):
            enc = native.lib.encode
            small = [t for t, sm in zip(cpu_tf, is_small) if sm]

            def one(k: int) -> None:
                tf, src, out, pre, _u = small[k]
                enc(src.numpy(), out.numpy(), tf.width, tf.block, 0, src.numel() // tf.width, pre)
            pmap_sized(one, [t[1].numel() for t in small], inline_small=True)
            cpu_tf = [t for t, sm in zip(cpu_tf, is_small) if not sm]
    if cpu_tf and native.lib is not None and all(type(t[0]) is BytePlane and t[0].rotate is None for t in cpu_tf):
        # the group's byte planes in pieces of TF_PIECE bytes, shared by this thread and the
        # pool's as they come free (a task per unit left one thread to do a 20 MB unit alone)
        pieces = []  # (unit, first word, end word)
        for k, (tf, src, *_rest) in enumerate(cpu_tf):
            n, step = src.numel() // tf.width, max(1, TF_PIECE // tf.width)
            pieces.extend((k, a, min(n, a + step)) for a in range(0, n, step))
        enc = native.lib.encode

        def piece(i: int) -> None:
            k, a, b = pieces[i]
            tf, src, out, pre, _u = cpu_tf[k]
            enc(src.numpy(), out.numpy(), tf.width, tf.block, a, b, pre)
        pmap_balanced(piece, [float(b - a) * cpu_tf[k][0].width for k, a, b in pieces], TF_PIECE / 2)
    elif cpu_tf:
        def whole(i: int) -> None:
            tf, src, out, pre, u = cpu_tf[i]
            tf.encode(src if pre is None else u.plan.ref.encode(src, start=u.start), out=out)
        pmap_sized(whole, [t[1].numel() for t in cpu_tf])
    # chunk bookkeeping in whole-group numpy passes (a few numpy calls per unit cost 10-20 us
    # each: most of a GPU snapshot's host time for the 745 storages of the benchmark state)
    counts = [len(u.sizes) for u in units]
    per_chunk = np.repeat(np.arange(len(units)), counts)
    soff = np.concatenate([u.offs for u in units]) + np.asarray([u.base for u in units], dtype=np.int64)[per_chunk]
    raw = np.concatenate([u.sizes for u in units])
    planes = np.concatenate([u.planes for u in units])
    stored = raw.copy()
    src = np.zeros(len(raw), dtype=np.int64)
    flags = np.full(len(raw), FLAG_STORED_RAW, dtype=np.uint8)
    tensors = [stream]
    # each unit's codec call (equal keys share one) and raw planes (a bit mask), per chunk
    unit_call, calls = codec_calls(u.plan.codec for u in units)
    unit_codec = np.asarray(unit_call, dtype=np.int64)
    raw_bits = np.asarray([sum(1 << p for p in u.plan.raw_planes) for u in units], dtype=np.int64)
    coded = ((raw_bits[per_chunk] >> np.maximum(planes, 0)) & 1) == 0
    coded |= planes < 0  # (chunks without a transform have no plane: never raw)
    chunk_codec = unit_codec[per_chunk]
    for ci, codec in enumerate(calls):
        idx = np.nonzero(coded & (chunk_codec == ci))[0] if len(calls) > 1 else np.nonzero(coded)[0]
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
    return Encoded(tensors, src, soff, stored, raw, flags, counts,
                   _cpu_checksums(tensors, src, soff, stored) if dev == "cpu" and checksums else None)


#: chunks of a CPU group are hashed in runs of about this many bytes on the pool's threads
HASH_RUN = 2 << 20


def _cpu_checksums(tensors: list, src: np.ndarray, soff: np.ndarray, stored: np.ndarray) -> np.ndarray | None:
    """The XXH3-64 of every chunk of a CPU group (``tensors[src[i]]``'s bytes ``soff[i]:+stored[i]``),
    in C without the GIL on the CPU pool's threads, in runs of about :data:`HASH_RUN` bytes of
    chunks: the writer takes them for the CPU groups it writes in place (one Python call per
    chunk on one thread before: about 3 ms of each fp32 save of the CPU benchmark state on a
    sandbox core; a CPU group staged into a pinned buffer, in a save whose writer thread runs
    for GPU groups, is hashed there again). None where checksums are not computed in C
    (``native.XXH3``)."""
    if not (native.XXH3 and native.lib is not None) or not len(stored):
        return None
    out = np.zeros(len(stored), dtype=np.uint64)
    parts: list[np.ndarray] = []  # chunk indices of one source tensor each
    for t in range(len(tensors)):
        sel = np.nonzero(src == t)[0]
        if len(sel):
            cum = np.cumsum(stored[sel])
            cuts = np.searchsorted(cum, np.arange(HASH_RUN, int(cum[-1]), HASH_RUN), side="right")
            parts.extend(p for p in np.split(sel, cuts) if len(p))
    arrays = [t.numpy() for t in tensors]
    xxh3_many = native.lib.xxh3_many

    def one(k: int) -> None:
        sel = parts[k]
        got = np.zeros(len(sel), dtype=np.uint64)
        xxh3_many(arrays[int(src[sel[0]])], soff[sel], stored[sel], got)
        out[sel] = got
    pmap_sized(one, [int(stored[p].sum()) for p in parts], inline_small=True)
    return out


def _pre_step(u: Unit):
    """The pre step of ``_bpnative.encode`` that makes a CPU unit's ``expgrid`` / ``expref``
    residual inside its byte planes' pass (:meth:`RefTransform.c_step`), or None where the unit
    has none or the residual is made apart (no C extension, other transforms)."""
    ref, tf = u.plan.ref, u.plan.transform
    if (ref is None or u.resolved or native.lib is None or type(tf) is not BytePlane or tf.rotate is not None
            or tf.width != 4 or u.data.device.type != "cpu" or not u.data.numel()):
        return None
    return ref.c_step(u.start, u.data.numel())


def pack(enc: Encoded, out: torch.Tensor, offs: np.ndarray) -> None:
    """Copy every chunk of ``enc`` into ``out`` at ``offs``, zeroing the padding up to the next
    16-byte boundary (``offs`` from :meth:`Encoded.packed`: every byte of ``out`` is written)."""
    padded = ceil_align(enc.stored)
    base = enc.tensors[0]
    tk = triton_kernels() if base.is_cuda else None
    if tk is not None:  # one launch gathers from every tensor (offsets relative to the first)
        rel = np.array([t.data_ptr() - base.data_ptr() for t in enc.tensors], dtype=np.int64)
        tk.copy_segments(base, enc.soff + rel[enc.src], out, offs, enc.stored, padded)
        return
    for t in range(len(enc.tensors)):
        sel = np.nonzero(enc.src == t)[0]
        if len(sel):
            copy_segments(enc.tensors[t], enc.soff[sel], out, offs[sel], enc.stored[sel], padded[sel])


def _upload(host: torch.Tensor, dst: torch.Tensor, tf: Transform | None) -> None:
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
