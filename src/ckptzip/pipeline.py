"""The one save pipeline: prepare -> encode -> (stage) -> write.

:func:`prepare` turns an object into its tree and storages and plans every storage (transform,
codec, chunking, work groups); :func:`write` encodes each group (or takes the group staged earlier
by an asynchronous save's snapshot) and writes the file: header, chunks through the chunk writer,
manifest, footer, atomically. ``ckptzip.save``, ``ckptzip.async_save``, the
``CheckpointManager`` and the integrations all save through these two functions.
"""
from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import __version__
from .codecs.base import MAX_CHUNK
from .codecs.gpu import release_scratch
from .engine import DEFAULT_WINDOW, Planner, encode_group_arrays, gpu_window, groups, units_of
from .format import FOOTER_SIZE, HEADER_SIZE, pack_footer, pack_header, pack_manifest
from .io import ChunkWriter
from .storage import open_for_write
from .tree import Encoder, Reused, StorageRef, encode_reusing, memoized, root_json, tensor_keys

Progress = Callable[[int, int], None]  # (bytes just done, total bytes)

#: where :func:`prepare`'s ``stream`` applies: GPU saves, whose planning takes GPU syncs the
#: writer thread overlaps (on the CPU, planning in batches and an encoder thread that encoded one
#: group while the next was planned were measured no faster: docs/benchmarks.md, "Eighteenth
#: session"; tests add "cpu" to run the same path without a GPU)
STREAM_DEVICES: tuple[str, ...] = ("cuda",)
#: default window of a CPU save to a local file: the writer thread writes one group while the
#: caller encodes the next, and the disk write of each starts early (see docs/benchmarks.md,
#: "Eighteenth session")
CPU_FILE_WINDOW = 8 << 20
#: bytes of storages in a streamed save's first planning batch (see :func:`_planned_groups`)
FIRST_BATCH = 32 << 20
#: storages of at most this many bytes are packed (format 1.5): those of one device and element
#: type are stored back to back as one storage, each one a slice of it (``"in"``), so that a
#: load's and a save's work per storage (planning, chunk tables, decode jobs) is paid once per
#: pack; each is still loaded into its own storage (see docs/format.md and docs/benchmarks.md,
#: "Thirty-second session")
PACK_MAX = 64 << 10
#: a pack holds at most this many bytes (a new one is started beyond)
PACK_BYTES = 16 << 20


@dataclass
class SaveJob:
    """A save, planned: the object tree, its storages, their plans and the grouped work units."""
    root: Any
    meta: dict
    refs: list
    plans: list
    groups: list
    total: int
    bases: list | None = None  # format 1.1 base records (incremental saves)
    #: the tree's structure, reused from an earlier save of the same one (``reuse_plan``)
    reused: Reused | None = None
    #: planned while writing (``groups`` is None, ``plans`` fill in): see :func:`prepare`'s ``stream``
    streamed: Callable[[], Iterator[list]] | None = None
    #: packed saves (format 1.5): ``refs[k]`` is storage ``wire[k]`` of the file (the packs
    #: after the tree's storages), and ``members`` maps each packed storage of the tree to
    #: ``(its StorageRef, pack's storage index, byte offset in the pack)``
    wire: list | None = None
    members: dict | None = None


def pack_groups(refs: list[StorageRef], exclude: set) -> list[list[int]]:
    """Which storages to pack (:data:`PACK_MAX`): per device and element type, the small
    storages not in ``exclude`` in storage order, cut at :data:`PACK_BYTES`; packs of at least
    two storages."""
    by: dict = {}
    for i, r in enumerate(refs):
        n = r.data.numel()
        if 0 < n <= PACK_MAX and i not in exclude:
            by.setdefault((r.device, r.elem, r.float_width), []).append(i)
    out = []
    for idx in by.values():
        cur: list[int] = []
        size = 0
        for i in idx:
            n = refs[i].data.numel()
            if cur and size + n > PACK_BYTES:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        out.append(cur)
    return [g for g in out if len(g) > 1]


def prepare(obj: Any, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
             storage_gbps, window, reuse_plan: bool = False, base=None, target=None,
             derive: bool = True, stream: bool = False, pack: bool = True) -> SaveJob:
    """Plan a save. ``base`` (a local path): store storages as ``xor`` against the same storage of
    that checkpoint where it pays (``target`` is the new file's path, for the relative record);
    ``derive``: store 16-bit copies of float32 storages as ``derived`` (format 1.1) and try Adam's
    first moments as ``expref`` against their second moments (1.2).

    ``stream`` (a GPU save that samples its choices, no base): storages are planned a window
    at a time as :func:`write` asks for their groups, so the sampling of later storages runs
    while earlier windows are written (the writer thread) instead of before the first write.
    Only for targets :func:`write` can rewrite the header of (plain local files): the header's
    minor version is known once every storage is planned.

    ``pack``: small storages are packed (:data:`PACK_MAX`, format 1.5), incremental saves too."""
    if not isinstance(chunk_size, int) or not 64 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be between 64 and {MAX_CHUNK} bytes")
    if transform not in ("auto", "byteplane", None):
        raise ValueError("transform must be 'auto', 'byteplane' or None")
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("metadata must map str to str")
    if reuse_plan:  # (a training loop's saves: the tree of a structure saved before is reused)
        root, storages, reused = encode_reusing(obj, allow_pickle)
    else:
        enc = Encoder(allow_pickle=allow_pickle)
        root, storages, reused = enc.encode(obj), enc.storages, None
    planner = Planner(codec, transform, chunk_size, level, device, portable, storage_gbps)
    if not reuse_plan:  # (a reused plan needs no estimates)
        planner.estimate_ahead(storages)
    try:
        if window is None:
            window = (gpu_window(scratch_heavy=planner.scratch_heavy) if planner.dev == "cuda"
                      else CPU_FILE_WINDOW if stream else DEFAULT_WINDOW)
        ref_tfs: dict = {}
        grid: dict = {}
        memo = reused.memo if reused else None  # (what the tree's structure alone decides)
        if derive and transform == "auto":
            from .engine.refplan import find_derived, find_expgrid, find_expref
            ref_tfs.update(find_derived(storages, reuse=reuse_plan, memo=memo))
            if any(r.elem == "float32" for r in storages):  # (Adam's moments in float32 only: the
                # keys cost 13 us per tensor)
                keys = memoized(memo, "keys", None, lambda: tensor_keys(root, escaped=False)[0])
                ref_tfs.update(find_expref(root, storages, skip=set(ref_tfs), keys=keys, memo=memo))
                grid = find_expgrid(root, storages, skip=set(ref_tfs), keys=keys, reuse=reuse_plan, memo=memo)
        alt: dict = {}
        bases = None
        if base is not None:
            from .api import CheckpointReader
            from .incremental import add_hints, delta_candidates, record_for
            base = os.fspath(base)
            with CheckpointReader(base) as br:
                bases = [record_for(br, base, target)]
                cands = delta_candidates(root, storages, br, skip=set(ref_tfs))
                base_storages = br.storages
                ref_tfs.update(cands)
        for i, g in grid.items():  # Adam's v: expgrid, or the better of delta and expgrid
            if i in ref_tfs:
                alt[i] = g
            else:
                ref_tfs[i] = g
        wire = members = None
        if pack:
            # small storages are packed rather than tried against a reference (expref, derived,
            # expgrid, or a delta against the base: a few bytes at most); a storage a larger one
            # refers to stays whole, and a small one left unpacked keeps its reference unless
            # that storage was packed
            small = [i for i in ref_tfs if storages[i].data.numel() <= PACK_MAX]
            large = {i: rt for i, rt in ref_tfs.items() if i not in small}
            busy = set(large) | set(alt) - set(small) | {rt.storage for rt in large.values() if rt.local}
            packs = pack_groups(storages, busy)
            if packs:
                put = {i for grp in packs for i in grp}
                for i in small:
                    if i in put or ref_tfs[i].local and ref_tfs[i].storage in put:
                        del ref_tfs[i]
                        alt.pop(i, None)
                storages, wire, members, ref_tfs, alt = _packed(storages, packs, ref_tfs, alt)
        total = sum(r.data.numel() for r in storages)
        if stream and planner.dev in STREAM_DEVICES and not reuse_plan and base is None and not alt:
            plans: list = [None] * len(storages)
            planner.hold_rot16()  # one choice for all batches
            return SaveJob(root, meta, storages, plans, None, total, None,
                           streamed=lambda: _planned_groups(planner, storages, plans, window, ref_tfs),
                           wire=wire, members=members)
        plans = planner.plan_all(storages, window, reuse_plan, ref_tfs, alt, memo=memo,
                                 packs=tuple(wire) if wire is not None else None)
        if bases is not None:  # where the base storages the chosen deltas need are (not every candidate's)
            add_hints(bases[0], base_storages, [p.ref.storage for p in plans if p.ref is not None and p.ref.against_base])
        units = [u for i, (ref, plan) in enumerate(zip(storages, plans))
                 for u in units_of(i, ref.data, plan, window)]
        return SaveJob(root, meta, storages, plans, list(groups(units, window)), total, bases, reused,
                       wire=wire, members=members)
    finally:  # (estimates started ahead are waited for or cancelled, whatever happens)
        planner.settle()


def _packed(refs: list[StorageRef], packs: list[list[int]], ref_tfs: dict, alt: dict) -> tuple:
    """The storages to plan once ``packs`` are made: the unpacked ones in order, then one
    :class:`StorageRef` per pack (its members' bytes concatenated: a copy, so the caller's
    tensors are never written); with each one's storage index in the file (``wire``), the
    members (see :attr:`SaveJob.members`), and ``ref_tfs``/``alt`` keyed by the new positions."""
    n = len(refs)
    members: dict = {}
    made = []
    for k, grp in enumerate(packs):
        start = 0
        for i in grp:
            members[i] = (refs[i], n + k, start)
            start += refs[i].data.numel()
        r0 = refs[grp[0]]
        made.append(StorageRef(torch.cat([refs[i].data for i in grp]), r0.elem, r0.device, r0.float_width))
    keep = [i for i in range(n) if i not in members]
    pos = {i: p for p, i in enumerate(keep)}
    return ([refs[i] for i in keep] + made, keep + list(range(n, n + len(packs))), members,
            {pos[i]: rt for i, rt in ref_tfs.items()}, {pos[i]: rt for i, rt in alt.items()})


def _planned_groups(planner, refs: list, plans: list, window: int, ref_tfs: dict) -> Iterator[list]:
    """The groups of a streamed save: storages planned in consecutive batches (their sampling
    in a few batched codec calls, as for a whole save), each batch's groups yielded before the
    next batch is planned; ``plans`` is filled in as it goes. The first batch holds about
    :data:`FIRST_BATCH` bytes, so the first write starts early; each next one twice as many, up
    to ``window``."""
    i, most = 0, min(window, FIRST_BATCH)
    while i < len(refs):
        j, nbytes = i, 0
        while j < len(refs) and (j == i or nbytes + refs[j].data.numel() <= most):
            nbytes += refs[j].data.numel()
            j += 1
        most = min(window, 2 * most)
        plans[i:j] = planner.plan_all(refs[i:j], window, False, {k - i: v for k, v in ref_tfs.items() if i <= k < j})
        yield from groups([u for k in range(i, j) for u in units_of(k, refs[k].data, plans[k], window)], window)
        i = j


#: file size of the last saves of a given raw size (a training loop saves one layout again and
#: again): how much of a new file :class:`ChunkWriter` may allocate ahead on tmpfs
_SIZES: dict[int, int] = {}
_SIZES_LOCK = threading.Lock()


def _expected_size(prep: SaveJob) -> int:
    """The size a save's file will likely have: the last one's of the same raw size, else half
    the raw bytes (pages allocated past the end are given back)."""
    return _SIZES.get(prep.total, prep.total // 2)


def _hints_minor(record: dict) -> int:
    """The minor a base record's located storages need: 3, or 4 where a chain has ``expgrid``."""
    if "storages" not in record:
        return 0
    return 4 if any(t.get("id") == "expgrid" for c in record["chains"] for t in c["transforms"]) else 3


def _minor(prep: SaveJob) -> int:
    """The lowest minor the file's features need (docs/format.md): 1 for bases, else its
    transforms' (1.3: byteplane rotate 16), or its base record's (1.3, 1.4: located storages)."""
    return max([p.ref.minor for p in prep.plans if p.ref is not None] + [1 if prep.bases else 0]
               + [getattr(p.transform, "minor", 0) for p in prep.plans]
               + [_hints_minor(prep.bases[0]) if prep.bases else 0] + [5 if prep.members else 0])


def write(prep: SaveJob, path, fsync: bool, progress: Progress | None, staged: list | None = None) -> dict:
    """Encode (or take the ``staged`` snapshot of) every group and write the file atomically."""
    counts = [0] * len(prep.plans)
    with open_for_write(path, fsync=fsync) as f:
        streamed = prep.streamed is not None
        if streamed and not isinstance(f, io.FileIO):
            raise ValueError("a streamed save is written to plain local files only")
        # (streamed: the minor is known, and the header written again, once every storage is planned)
        minor = 0 if streamed else _minor(prep)
        f.write(pack_header(minor))
        w = ChunkWriter(f, HEADER_SIZE, writeback=fsync, cpu_thread=isinstance(f, io.FileIO),
                        reserve=_expected_size(prep))
        try:
            try:
                for gi, grp in enumerate(prep.streamed() if streamed else prep.groups):
                    if staged is not None and staged[gi] is not None:
                        ent, staged[gi] = staged[gi], None
                        if hasattr(ent, "fetch"):  # kept on the GPU: copied into a pooled pinned buffer now
                            host, rel, per_unit, hashed = ent.fetch()
                            w.add_pooled(host, rel, hashed)
                        else:
                            host, rel, per_unit = ent
                            w.add_staged(host, rel)
                        del ent
                    else:
                        enc = encode_group_arrays(grp)
                        w.add(enc)
                        per_unit = enc.counts
                        del enc  # free this group's GPU buffers before the next is encoded
                    for u, n in zip(grp, per_unit):
                        counts[u.owner] += n
                    if progress:
                        progress(sum(u.data.numel() for u in grp), prep.total)
            finally:
                try:
                    rows = w.finish()
                finally:
                    release_scratch()
            if streamed:
                minor = _minor(prep)
            entries, first = [], 0
            configs: dict = {}  # id -> wire config: storages share transform and codec objects

            def config(o) -> dict:
                c = configs.get(id(o))
                if c is None:
                    c = configs[id(o)] = o.get_config()
                return c
            for ref, plan, count in zip(prep.refs, prep.plans, counts):
                entries.append({
                    "nbytes": ref.data.numel(), "elem": ref.elem, "device": ref.device,
                    "transforms": ([plan.ref.get_config()] if plan.ref is not None else [])
                    + ([config(plan.transform)] if plan.transform else []),
                    "codec": config(plan.codec), "rows": [first, count],
                })
                if plan.choice:
                    entries[-1]["choice"] = plan.choice
                first += count
            if prep.wire is not None:  # (format 1.5: the file's storage order, packed storages as slices)
                placed: list = [None] * len(prep.wire) + [None] * len(prep.members)
                for k, e in zip(prep.wire, entries):
                    placed[k] = e
                for i, (ref, p, start) in prep.members.items():
                    placed[i] = {"nbytes": ref.data.numel(), "elem": ref.elem, "device": ref.device,
                                 "in": [p, start]}
                entries = placed
            pos = w.pos
            doc = {"format": "ckz", "version": [1, minor], "created_by": f"ckptzip {__version__}",
                   "meta": prep.meta, "n_chunks": len(rows), "storages": entries}
            if prep.bases:
                doc["bases"] = prep.bases
            manifest = pack_manifest(doc, rows, root_json(prep.root, prep.reused))
            f.write(manifest)
            f.write(pack_footer(pos, manifest))
            if streamed:
                head = pack_header(minor)
                if os.pwrite(f.fileno(), head, 0) != len(head):
                    raise OSError("short write of the file header")
        except BaseException:
            w.close(check=False)
            raise
        w.close()  # (joins the flusher thread: a sync still running overlapped the manifest's write)
        size = pos + len(manifest) + FOOTER_SIZE
    with _SIZES_LOCK:  # (saves run on several threads: async saves, the DCP writer)
        _SIZES[prep.total] = size
        while len(_SIZES) > 16:
            _SIZES.pop(next(iter(_SIZES)))
    name = getattr(path, "name", "<file object>") if hasattr(path, "write") else os.fspath(path)
    out = {"path": name, "raw_bytes": prep.total, "stored_bytes": size}
    if prep.bases:
        out["base"] = prep.bases[0]["file"]
    refs = [p.ref.wire_id for p in prep.plans if p.ref is not None]
    if refs:
        out["delta_storages"] = refs.count("delta") + refs.count("hidelta") + refs.count("xor")  # against the base
        out["derived_storages"] = refs.count("derived")
        out["expref_storages"] = refs.count("expref")
        out["expgrid_storages"] = refs.count("expgrid")
    return out


