"""How each storage is encoded: transform, codec, chunking (what ``codec="auto"`` decides).

``auto`` on the CPU: byte planes + zstd for floats, zstd otherwise. On a GPU: deflate (byte
planes for floats, entropy-coded only) when ``portable``, zstd when the storage is slower than GPU
zstd; otherwise nvCOMP ANS,
with the layout (byte planes + byte symbols, or whole 16/32-bit words) picked by compressing a
sample both ways. For byte planes, a sample also decides which planes are stored raw (they do not
shrink: low mantissa bytes) and whether the exponent plane does better in smaller chunks (Adam's
v has exponents that vary locally). Samples of all storages are compressed together, in a few
batched codec calls.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any

from collections import OrderedDict

import numpy as np
import torch

from .. import native
from ..codecs.base import MAX_CHUNK, Codec, get_codec
from ..errors import UnknownCodecError
from ..kernels import rot16_ready, triton_kernels
from ..transforms import BytePlane
from ..tree import StorageRef, memoized
from . import refplan
from .encode import encode_group_arrays
from .plan import DEFAULT_CHUNK, Plan, Unit, groups, units_of, with_ref

#: GPU zstd compresses at about 5-8 GB/s; storage slower than this gets zstd on the GPU
GPU_ZSTD_GBPS = 6.0
STANDARD = ("zstd", "deflate", "raw")
_ANS_WORD = {2: "<f2", 4: "<f4"}
#: a byte plane whose sample shrinks by less than this is stored raw without calling the codec
#: (0.995 was measured on the one-H100 DCP state: 0.8205 -> 0.8204 of raw, not worth the ANS work)
RAW_PLANE_RATIO = 0.985
#: sample bytes per storage for these choices; storages under MIN_SAMPLED are not sampled
SAMPLE = 4 << 20
CPU_SAMPLE = 1 << 20  # CPU codecs are slow: sample less
#: on the CPU, raw planes are chosen without calling the codec: a byte plane is stored raw when
#: the order-0 entropy of a sample of it exceeds this fraction of 8 bits (zstd's Huffman-coded
#: literals come within about 1 % of it); the sample is 4 runs of CPU_ENTROPY_RUN words
CPU_RAW_ENTROPY = 0.97
CPU_ENTROPY_RUN = 1 << 12
MIN_SAMPLED = 1 << 20
MIN_TRANSFORMED = 64 << 10  # on the GPU, smaller float storages skip the byteplane transform
#: on the CPU, float storages under this many bytes skip it: whole words in zstd frames of the
#: chunk size, one frame at the default 1 MiB (the biases, norms and step counters of a model
#: state; their planes were chunks of a few bytes to a few hundred, each its own frame, row and
#: checksum). Smaller files too; from 1 KiB up, byte planes pay (docs/benchmarks.md,
#: "Twenty-third session")
CPU_MIN_TRANSFORMED = 1 << 10
#: chunk sizes tried for the exponent plane (locally varying exponents, as in Adam's v, favour
#: small chunks; trained weights favour large ones). Smaller chunks cost nvCOMP throughput, so a
#: smaller one is taken only when it saves at least MIN_GAIN of the whole storage.
EXP_CHUNKS = (128 << 10, 64 << 10)
MIN_GAIN = {128 << 10: 0.0, 64 << 10: 0.004}
#: ANS encoder option for byte planes: fewer sub-chunks per chunk, less per-chunk overhead
#: (measured on Adam v's exponent plane: 0.316 at 128 KiB vs 0.321 with nvCOMP's default of 8)
ANS_PLANES = {"max_sub_chunk_count": 4}


#: tests and golden files: CPU saves also write ``byteplane`` ``rotate`` 16 (GPU saves do once
#: its kernels are compiled; CPU saves keep the whole-word rotation, which the C code does in one pass)
ROT16_ON_CPU = False

_PLAN_CACHE: "OrderedDict[tuple, list[Plan]]" = OrderedDict()
_PLAN_LOCK = threading.Lock()


def gpu_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from ..codecs.gpu import gpu_available
    return gpu_available()


def byteplane_for(ref: StorageRef, chunk_size: int) -> BytePlane | None:
    """Byte planes for float storages, in blocks of up to 16 chunks of each plane (at most 16 MiB
    of storage): big enough that runs of raw planes move in few copies, small enough for windows."""
    w = ref.float_width
    if w and ref.data.numel() % w == 0:
        key = (w, chunk_size)
        bp = _BYTEPLANES.get(key)  # (immutable: storages share one)
        if bp is None:
            bp = _BYTEPLANES[key] = BytePlane(w, max(1, min(MAX_CHUNK // w, chunk_size * 16 // w)))
        return bp
    return None


_BYTEPLANES: dict = {}


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_NONE: frozenset = frozenset()


def _whole_words(chunk: int, width: int) -> int:
    """A chunk size for ANS on words of ``width`` bytes: nvCOMP needs every chunk to hold whole
    words (a ``chunk_size`` such as 65 is rounded down to 64)."""
    return max(width, chunk // width * width)


def _estimated(nbytes: int, width: int) -> bool:
    """Whether a storage of ``nbytes`` holds enough words of ``width`` bytes for the raw-plane
    estimate's 4 runs of CPU_ENTROPY_RUN words (smaller ones send every plane to the codec)."""
    return nbytes // width >= 4 * CPU_ENTROPY_RUN


def cpu_raw_planes(data: torch.Tensor, width: int) -> frozenset:
    """Byte planes (as :class:`BytePlane` numbers them) whose order-0 entropy, estimated on up to
    4 runs of CPU_ENTROPY_RUN words spread over ``data``, exceeds CPU_RAW_ENTROPY. Storages under
    4 runs are not estimated (all planes go to the codec; a chunk that does not shrink stays
    raw)."""
    n, k = data.numel() // width, CPU_ENTROPY_RUN
    if not _estimated(data.numel(), width):
        return frozenset()
    # numpy, not torch ops: torch's intra-op threads stall when the cores are oversubscribed
    words = data[:n * width] if data.device.type == "cpu" else data[:n * width].cpu()
    starts = [i * (n - k) // 3 for i in range(4)]
    if native.lib is not None:  # one C pass over the sample
        h = np.empty(width, dtype=np.float64)
        native.lib.plane_entropy(words.numpy(), h, width, np.asarray(starts, dtype=np.int64), k)
    else:
        u = words.numpy().view(_UINT[width])
        u = np.concatenate([u[a:a + k] for a in starts])
        r = (u << 1) | (u >> (8 * width - 1))
        q = np.stack([np.bincount((r >> (8 * p)).astype(np.uint8), minlength=256)
                      for p in range(width)]) / len(u)
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -np.nansum(q * np.log2(q), axis=1)
    return frozenset(int(p) for p in np.nonzero(h > 8 * CPU_RAW_ENTROPY)[0])


def rot16_raw_planes(raw: frozenset | None) -> frozenset | None:
    """The raw planes of a float32 plan sampled with the whole-word rotation, for the same
    storage under ``rotate`` 16. Plane 3 (the exponent) and plane 1 keep their choice. The sign
    moves from plane 0 (beside the 7 low mantissa bits) to plane 2 (beside the 7 high ones): plane
    2 is coded where either of its sources was, so a constant sign (Adam's v, variances) is never
    stored raw; plane 0 keeps plane 0's choice (where only the sign made it shrink, its chunks
    are stored raw after the codec's try). Without this, Adam's v without ``expgrid`` went from
    0.795 to 0.826 of raw on the H100 benchmark state (docs/benchmarks.md, thirty-second session)."""
    if not raw or 2 not in raw or 0 in raw:
        return raw
    return raw - {2}


class Planner:
    def __init__(self, codec: str | dict = "auto", transform: str | None = "auto",
                 chunk_size: int = DEFAULT_CHUNK, level: int | None = None, device: str | None = None,
                 portable: bool = False, storage_gbps: float | None = None) -> None:
        self.cfg = dict(codec) if isinstance(codec, dict) else {"id": codec}
        self.auto = self.cfg["id"] == "auto"
        if portable and not self.auto and self.cfg["id"] not in STANDARD:
            raise UnknownCodecError(f"codec {self.cfg['id']!r} is not portable; use zstd, deflate or raw")
        self.transform, self.chunk_size, self.level = transform, chunk_size, level
        self.dev = device if device in ("cpu", "cuda") else ("cuda" if gpu_ok() else "cpu")
        self.portable = portable
        self.slow_storage = storage_gbps is not None and storage_gbps < GPU_ZSTD_GBPS
        self._codecs: dict = {}
        #: the rotate-16 choice held for the rest of a save (see :meth:`hold_rot16`), or None
        self._rot16_held: bool | None = None
        #: raw-plane estimates computed ahead on a pool thread (see :meth:`estimate_ahead`)
        self._ahead = None
        self._base: tuple | None = None  # (see :meth:`_base_codec`)
        self._planes_codec: Codec | None = None

    def estimate_ahead(self, refs: list[StorageRef]) -> None:
        """CPU saves: start the raw-plane estimates (:func:`cpu_raw_planes`) of every float
        storage large enough to be estimated, all in one call of the C extension without the
        GIL on one of the CPU pool's threads, while the caller's thread goes on planning (the
        reference searches of :mod:`refplan`, the object tree's keys); :meth:`base_plan` takes
        them from there (a 2-core save of the fp32 benchmark state estimates 57 storages, 2-3 ms
        on the caller's thread). The storages go in two halves, one pool task each, so that two
        threads share them. A half still queued when the estimates are needed is not waited
        for: :meth:`_raw_planes` makes it itself, in one call (a bf16 save plans at once, and
        its thread then shares the work with the pool's instead of doing all of it)."""
        if (self.dev != "cpu" or self.transform not in ("auto", "byteplane") or native.lib is None
                or self.codec_id == "raw"):
            return
        todo = [r for r in refs if r.float_width and r.data.device.type == "cpu" and r.data.numel() % r.float_width == 0
                and _estimated(r.data.numel(), r.float_width)]
        if len(todo) > 1:
            from ..codecs.cpu import _pool
            widths = np.fromiter((r.float_width for r in todo), dtype=np.int64, count=len(todo))
            bits = np.empty((len(todo), 8), dtype=np.float64)
            srcs = [r.data.numpy() for r in todo]
            m = len(todo) // 2
            halves = [(srcs[a:b], widths[a:b], bits[a:b]) for a, b in ((0, m), (m, len(todo)))]
            futs: list = []
            try:
                for h in halves:
                    futs.append(_pool().submit(native.lib.plane_entropy_many, *h, CPU_ENTROPY_RUN))
            except BaseException:  # (no task left reading the caller's tensors unrecorded)
                concurrent.futures.wait([f for f in futs if not f.cancel()])
                raise
            self._ahead = (futs, {id(r): k for k, r in enumerate(todo)}, bits, halves)

    def _raw_planes(self, ref: StorageRef, width: int) -> frozenset:
        if not _estimated(ref.data.numel(), width):
            return _NONE
        if self._ahead is not None and width == ref.float_width:
            futs, index, bits, halves = self._ahead
            k = index.get(id(ref))
            if k is not None:
                if futs is not None:
                    for f, h in zip(futs, halves):
                        if f.cancel():  # still queued (behind other pool work, or its thread not
                            # yet awake): not waited for, made here
                            native.lib.plane_entropy_many(*h, CPU_ENTROPY_RUN)
                    for f in futs:
                        if not f.cancelled():
                            f.result()
                    self._ahead = (None, index, bits, halves)
                return frozenset(int(p) for p in np.nonzero(bits[k, :width] > 8 * CPU_RAW_ENTROPY)[0])
        return cpu_raw_planes(ref.data, width)

    def settle(self) -> None:
        """Cancel the estimates started ahead, or wait for them: a save that ends (or fails)
        leaves no pool thread still reading the caller's tensors."""
        if self._ahead is not None:
            futs = self._ahead[0] or []
            concurrent.futures.wait([f for f in futs if not f.cancel()])
            self._ahead = None

    def hold_rot16(self) -> None:
        """Make :meth:`_rot16` answer as it does now for every later call: a save planned in
        batches (``pipeline.prepare(stream=True)``) then treats its float32 storages alike even
        if the kernels finish compiling mid-save, as planning them all at once would."""
        self._rot16_held = bool(self._rot16())

    @property
    def codec_id(self) -> str:
        """The codec's wire id: ``auto`` picks nvCOMP ANS on a GPU, deflate there if the file
        must be portable, zstd there if the storage is slower than GPU zstd; zstd on the CPU."""
        if not self.auto:
            return self.cfg["id"]
        if self.dev != "cuda":
            return "zstd"
        return "deflate" if self.portable else "zstd" if self.slow_storage else "ans"

    @property
    def scratch_heavy(self) -> bool:
        """Whether GPU saves use a codec whose nvCOMP scratch and aligned copies need smaller
        windows (zstd, deflate: see :func:`ckptzip.engine.plan.gpu_window`)."""
        return self.dev == "cuda" and self.codec_id in ("zstd", "deflate", "gdeflate")

    def codec(self, cfg: dict, local: dict | None = None) -> Codec:
        key = (repr(sorted(cfg.items())), repr(sorted((local or {}).items())))
        if key not in self._codecs:
            self._codecs[key] = get_codec(cfg, self.dev, **(local or {}))
        return self._codecs[key]

    def _base_codec(self) -> tuple:
        """What :meth:`base_plan` starts from, the same for every storage of a save: ``(config,
        whether a level applies, ANS on byte planes, codec, whether floats get byte planes)``."""
        got = self._base
        if got is None:
            cfg = self.cfg
            if self.auto:
                cfg = {"id": self.codec_id}
            lvl = self.level is not None and cfg["id"] in ("zstd", "deflate") and self.dev == "cpu"
            local = {"level": self.level} if lvl else {}
            ans_planes = cfg["id"] == "ans" and "data_type" not in cfg
            if ans_planes:
                cfg = {"id": "ans", "data_type": "|u1"}
                local = ANS_PLANES
            c = self.codec(cfg, local)
            want_tf = self.transform == "byteplane" or (self.transform == "auto" and c.wire_id != "raw")
            got = self._base = (cfg, lvl, ans_planes, c, want_tf)
        return got

    def _plane_codec(self) -> Codec:
        """The CPU zstd codec of :meth:`_base_codec`'s config with its parameters for byte planes
        (see :meth:`base_plan`)."""
        if self._planes_codec is None:
            self._planes_codec = self.codec(self._base_codec()[0], {"planes": 1})
        return self._planes_codec

    def base_plan(self, ref: StorageRef) -> tuple[Plan, dict[str, Plan]]:
        """A storage's plan before sampling, and the variant plans to sample (if any)."""
        cfg, lvl, ans_planes, c, want_tf = self._base_codec()
        tf = byteplane_for(ref, self.chunk_size) if want_tf else None
        if self.auto and cfg["id"] == "deflate" and self.dev == "cuda":
            # portable on a GPU: byte planes need only the entropy coder (nvCOMP Deflate's
            # algorithm 0: no scratch, 40-65 GB/s; GPU Zstd's scratch alone is over 1 GiB at
            # 64 KiB chunks), other storages get matches too
            c = self.codec(cfg, {"algorithm": 0 if tf is not None else 1})
        chunk = min(self.chunk_size, c.max_chunk)
        if self.chunk_size == DEFAULT_CHUNK:
            chunk = min(chunk, getattr(c, "preferred_chunk", chunk))
        word = _ANS_WORD.get(tf.width) if tf is not None else None
        if self.auto and ans_planes and word and ref.data.numel() < MIN_TRANSFORMED:
            # tiny storages (biases, norms): ANS on whole words compresses them about as well as
            # byte planes and needs no transform launch of their own
            return Plan(None, self.codec({"id": "ans", "data_type": word}), _whole_words(chunk, tf.width)), {}
        if self.auto and cfg["id"] == "ans" and tf is None and ref.elem.startswith("float8"):
            return Plan(None, self.codec({"id": "ans", "data_type": "|f1"}), chunk), {}
        if self.dev == "cpu" and tf is not None:
            # CPU: zstd with parameters for byte planes unless a level was asked for (also for
            # the small storages stored without planes: one codec call per group), and raw
            # planes from a cheap entropy estimate instead of sampling with the codec
            if c.wire_id == "zstd" and not lvl and "level" not in cfg:
                c = self._plane_codec()
            if self.transform == "auto" and ref.data.numel() < CPU_MIN_TRANSFORMED:
                return Plan(None, c, _whole_words(chunk, tf.width)), {}
            return Plan(tf, c, chunk, raw_planes=self._raw_planes(ref, tf.width)), {}
        plan = Plan(tf, c, chunk)
        if tf is None or ref.data.numel() < MIN_SAMPLED:
            return plan, {}
        top = tf.width - 1
        variants = {"planes": plan}
        if c.wire_id == "ans":
            for ec in EXP_CHUNKS:
                if ec < chunk:
                    variants[f"exp{ec}"] = Plan(tf, c, chunk, raw_planes=frozenset(range(top)),
                                                plane_chunks={top: ec})
        word = _ANS_WORD.get(tf.width)
        if self.auto and c.wire_id == "ans" and word:
            variants["words"] = Plan(None, self.codec({"id": "ans", "data_type": word}), _whole_words(chunk, tf.width))
        return plan, variants

    def plan_all(self, refs: list[StorageRef], window: int, reuse: bool = False,
                 ref_tfs: dict | None = None, alt_tfs: dict | None = None, memo: dict | None = None,
                 packs: Any = None) -> list[Plan]:
        """Plans for every storage. With ``reuse``, the sampled decisions are remembered for the
        same checkpoint layout and options (a training loop saves the same structure again and
        again, with slowly changing statistics), so only the first save of a run pays for
        sampling. ``memo``: the tree structure's (:attr:`ckptzip.tree.Reused.memo`), where the
        storages' part of that layout's key is kept; ``packs``: what sets ``refs`` apart from
        the structure's storages (format 1.5 packing: one structure is saved packed, and
        unpacked where it is incremental), part of that key."""
        local_only = not any(rt.against_base for rt in (ref_tfs or {}).values())
        if not reuse or not local_only or alt_tfs:  # delta/xor: sampled against this save's base, never cached
            return self._plan_all(refs, window, ref_tfs, alt_tfs)
        key = (repr(sorted(self.cfg.items())), self.transform, self.chunk_size, self.level, self.dev,
               self.portable, self.slow_storage, window, self._rot16(),
               memoized(memo, "plan_refs", packs, lambda: tuple((r.data.numel(), r.elem, r.float_width) for r in refs)),
               tuple(sorted((i, rt.layout_key()) for i, rt in (ref_tfs or {}).items())))
        with _PLAN_LOCK:
            cached = _PLAN_CACHE.get(key)
            if cached is not None:
                _PLAN_CACHE.move_to_end(key)
        if cached is None:
            plans = self._plan_all(refs, window, ref_tfs)
            # cached unbound: a plan must not keep this save's tensors alive after it
            with _PLAN_LOCK:
                _PLAN_CACHE[key] = [with_ref(p, p.ref.bind(None)) if p.ref is not None else p for p in plans]
                while len(_PLAN_CACHE) > 8:
                    _PLAN_CACHE.popitem(last=False)
            return plans
        if not ref_tfs:
            return cached
        # a cached plan with a reference is bound to the tensors of the save that made it: bind
        # to these (an ``expref`` the sampling rejected stays rejected)
        return [with_ref(p, ref_tfs[i]) if i in ref_tfs and p.ref is not None else p for i, p in enumerate(cached)]

    def _plan_all(self, refs: list[StorageRef], window: int, ref_tfs: dict | None = None,
                  alt_tfs: dict | None = None) -> list[Plan]:
        plans, variants = [], []
        for i, ref in enumerate(refs):
            p, v = self.base_plan(ref)
            rt = (ref_tfs or {}).get(i)
            if rt is not None and p.transform is None and p.chunk_size % rt.word:
                rt = None  # windows of whole chunks would split the transform's words
            if rt is not None and p.codec.wire_id != "raw":  # format 1.1 references (refplan.py)
                if rt.wire_id == "derived":
                    p, v = refplan.derived_plan(p, rt), {}
                elif self.dev == "cpu" and not rt.against_base and not v:
                    p = refplan.cpu_choose(p, ref, rt, refplan.CPU_PREDICT_SAMPLE)
                else:
                    v = refplan.ref_variant(p, v, rt, (alt_tfs or {}).get(i))
            plans.append(p)
            variants.append(v)
        # sample every variant of every storage, all in a few batched codec calls
        units: list[Unit] = []
        self.sample = SAMPLE if self.dev == "cuda" else CPU_SAMPLE
        for i, (ref, var) in enumerate(zip(refs, variants)):
            for name, vp in var.items():
                for u in units_of(i, ref.data, vp, window, self.sample):
                    u.variant = name
                    units.append(u)
        stored: dict[tuple[int, str], list[int]] = {}
        for grp in groups(units, window):
            enc = encode_group_arrays(grp, checksums=False)
            k = 0
            for u, c in zip(grp, enc.counts):
                acc = stored.setdefault((u.owner, u.variant), [0] * 8)
                per_plane = np.bincount(np.maximum(u.planes, 0), weights=enc.stored[k:k + c], minlength=8)
                for p, n in enumerate(per_plane.tolist()):
                    acc[p] += int(n)
                k += c
            del enc  # free this group's GPU buffers before the next is encoded
        for i, (ref, var) in enumerate(zip(refs, variants)):
            if "planes" in var:
                plans[i] = self._decide(ref, plans[i], var, stored, i)
            if "ref" in var:
                plans[i] = refplan.choose_ref(plans[i], var, stored, i, min(ref.data.numel(), self.sample),
                                              RAW_PLANE_RATIO)
        if self._rot16():
            # float32 planes alone on a GPU: byteplane rotate 16 (format 1.3). Same planes'
            # statistics as the whole-word rotation (the sign moves between two planes of
            # random mantissa bits), and a later incremental file's hidelta then reads only
            # planes 2 and 3 of this storage (0.32 instead of 0.57 of its raw bytes). On the
            # torch path too (a process's first save); not in the seconds between the warm-up's
            # kernels and its rotate-16 kernels (the Triton whole-word kernels are faster than
            # the torch path)
            plans = [dataclasses.replace(p, transform=BytePlane(4, p.transform.block, 16),
                                         raw_planes=rot16_raw_planes(p.raw_planes))
                     if p.ref is None and isinstance(p.transform, BytePlane) and p.transform.width == 4
                     and p.transform.rotate is None and refs[i].elem == "float32" else p
                     for i, p in enumerate(plans)]
        return plans

    def _rot16(self) -> bool:
        """Whether float32 planes alone get ``byteplane`` ``rotate`` 16 now (see :meth:`_plan_all`)."""
        if self._rot16_held is not None:
            return self._rot16_held
        return (self.dev == "cuda" and (triton_kernels(start=False) is None or rot16_ready())) or ROT16_ON_CPU

    def _decide(self, ref: StorageRef, plan: Plan, var: dict, stored: dict, i: int) -> Plan:
        tf = plan.transform
        sample = min(ref.data.numel(), self.sample)
        per_plane = sample // tf.width
        st = stored[(i, "planes")][: tf.width]
        plan.raw_planes = frozenset(p for p in range(tf.width) if st[p] > RAW_PLANE_RATIO * per_plane)
        top = tf.width - 1
        if top not in plan.raw_planes:
            for ec in EXP_CHUNKS:
                got = stored.get((i, f"exp{ec}"))
                if got is not None and got[top] < st[top] - MIN_GAIN[ec] * sample:
                    plan.plane_chunks = {top: ec}
                    st[top] = got[top]
        planes_bytes = sum(min(x, per_plane) for x in st)
        plan.est = planes_bytes
        if "words" not in var:
            return plan
        words_bytes = stored[(i, "words")][0]
        var["words"].est = words_bytes
        best = var["words"] if words_bytes < planes_bytes else plan
        best.choice = (f"ans/{'words' if best is not plan else 'planes'}: sample {planes_bytes / sample:.3f} "
                       f"planes (raw planes {sorted(plan.raw_planes)}, chunks {plan.plane_chunks or {}}) "
                       f"vs {words_bytes / sample:.3f} words")
        return best
