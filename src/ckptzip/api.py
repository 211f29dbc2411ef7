"""Public API: ``save``, ``load`` and the lazy reader ``open``."""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import __version__  # noqa: F401  (the CLI reads it from here)
from .engine import (DEFAULT_CHUNK, DEFAULT_WINDOW, Job, decode_jobs, empty_bytes, gpu_decode_window, gpu_ok,
                     storage_chain)
from .errors import BaseCheckpointError, CorruptFileError, GPURequiredError, ResourceLimitError, TensorNotFoundError
from .format import parse_manifest
from .io.reader import read_manifest
from .kernels import triton_kernels
from .pipeline import prepare, write
from .storage import FileObjectSource, RemoteSource, is_file_object, is_url, local_path, open_regular
from .incremental import chain as _chain
from .incremental import manifest_sha256, open_base, open_base_file
from .transforms.byteplane import BytePlane, PlaneSubset, plane_rows
from .transforms.refs import HiDelta
from .tree import Decoder, contiguous_stride, tensor_keys, tensor_nodes

Progress = Callable[[int, int], None]  # (bytes just done, total bytes)
_VERIFY_BATCH = 256 << 20  # decoded bytes per verify batch
#: decoded packs (format 1.5) a reader keeps for their other members' later reads, in all
PACK_CACHE_BYTES = 64 << 20


def save(obj: Any, path: str | os.PathLike, *, codec: str | dict = "auto", transform: str | None = "auto",
         chunk_size: int = DEFAULT_CHUNK, level: int | None = None, metadata: Mapping[str, str] | None = None,
         allow_pickle: bool = False, fsync: bool = True, progress: Progress | None = None,
         device: str | None = None, portable: bool = False, storage_gbps: float | None = None,
         window: int | None = None, base: str | os.PathLike | None = None,
         derive: bool = True, reuse_plan: bool = False) -> dict[str, Any]:
    """Save ``obj`` (a state dict or any nesting of containers, tensors and plain values) to
    ``path`` (a local path, or an fsspec URL such as ``s3://bucket/key.ckz``).

    ``path`` may also be a binary file object with ``write`` (written in place, not closed, no
    atomic rename). Options (defaults in the signature):

    * ``codec``: ``"auto"`` (default: nvCOMP ANS on byte planes on a GPU, zstd on the CPU), a wire
      id (``"zstd"``, ``"deflate"``, ``"raw"``, or GPU-only ``"ans"``, ``"bitcomp"``,
      ``"gdeflate"``, ``"lz4"``, ``"snappy"``, ``"cascaded"``) or a wire config dict.
    * ``transform``: ``"auto"`` (byte planes for float storages), ``"byteplane"`` or ``None``.
    * ``chunk_size``: bytes per compressed chunk, 64 to 16 MiB (16,777,216), default 1 MiB; each
      chunk is decodable on its own (smaller: finer random access, more table rows).
    * ``level``: codec level where the codec has one (zstd 1-22, deflate 0-9; default: the
      codec's own, zstd 3 / the byte-plane setting on the CPU); ignored by nvCOMP codecs.
    * ``metadata``: ``{str: str}`` stored in the manifest (``CheckpointReader.metadata``).
    * ``allow_pickle``: store objects ckptzip cannot represent by pickling them (default False:
      :class:`~ckptzip.UnsupportedObjectError`); loading them then needs ``allow_pickle=True``.
    * ``fsync``: fsync the file and its directory before returning (default True).
    * ``progress``: ``progress(bytes_done, bytes_total)`` called as storages are written (raw
      bytes; called from this thread).
    * ``device``: ``"cpu"``, ``"cuda"`` or None (default: the GPU when CUDA and nvCOMP are usable).
    * ``portable``: only codecs any CPU decodes (zstd/deflate/raw), default False.
    * ``storage_gbps``: the write bandwidth you expect, GB/s; steers ``auto`` on the GPU (slow
      storage favours stronger codecs). Default None (unknown).
    * ``window``: bytes processed per step, bounding working memory (default: a quarter of the GPU
      budget, min(1 GiB, 10 % of free GPU memory), on a GPU; on the CPU 8 MiB for local files, so
      that one window is written while the next is encoded, else 64 MiB).
    * ``reuse_plan``: reuse the codec and transform choices sampled by an earlier save of the
      same layout (same storages, dtypes and options) in this process instead of sampling again
      (default False; :func:`async_save` and :class:`CheckpointManager` default to True). A
      training loop saves one layout again and again with slowly changing statistics; the
      sampling took 0.11 s of a 0.35 s save of the 1.2 GB benchmark state on an H100 (a GPU save
      to a local file now samples later storages while earlier ones are written, so most of it
      overlaps the write). Files stay exact either way; only the choices (and so the ratio) can
      lag the data.

    The write is atomic. Returns a summary ``{"raw_bytes", "stored_bytes", "path"}`` (plus
    ``base``, ``delta_storages`` and ``derived_storages`` where format 1.1 references were used).

    ``base``: the local path of an earlier checkpoint of the same state (an *incremental* save):
    each storage whose tensor has the same key, dtype and size there is stored as its difference
    from it (transform ``delta`` for floats, ``xor`` otherwise) where a sample shows that this pays. The file records the base by its path relative to
    this file's directory and its manifest's SHA-256; loading needs the base (see :func:`load`,
    ``base_dir``/``base_path``). ``derive`` (with ``transform="auto"``): a 16-bit float storage
    that equals the cast of a float32 storage of the same state (a bf16 copy of master weights)
    is stored as a reference to it plus the (usually no) differing elements.
    """
    # a local file: a GPU save that samples plans later storages while earlier ones are written
    local = not hasattr(path, "write") and not is_url(path)
    prep = prepare(obj, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
                   storage_gbps, window, reuse_plan, base=base, target=path, derive=derive, stream=local)
    return write(prep, path, fsync, progress)


def _check_target(dev: torch.device, map_location: Any) -> torch.device:
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"map_location={map_location!r} gives device {dev}; ckptzip loads to cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GPURequiredError(
            f"map_location={map_location!r} asks for {dev}, but CUDA is not available on this machine "
            f"(torch.cuda.is_available() is False); load with map_location='cpu'")
    return dev


def _resolve_device(saved: str, map_location: Any) -> torch.device:
    """Where a storage saved on ``saved`` (a validated device string) goes. ``saved`` only
    steers placement: without ``map_location`` a CUDA storage on a machine without CUDA loads to
    the CPU. An explicit ``map_location`` that names CUDA without CUDA is an error, as in
    ``torch.load``. A callable gets here only in its legacy one-argument form."""
    if map_location is None:
        dev = torch.device(saved)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return torch.device("cpu")
        return dev
    if isinstance(map_location, Mapping):
        target = map_location.get(saved, saved)
        if target == saved:
            return _resolve_device(saved, None)
        return _check_target(torch.device(target), map_location)
    if callable(map_location):
        return _check_target(torch.device(map_location(saved)), map_location)
    return _check_target(torch.device(map_location), map_location)


def _maps_storages(ml: Any) -> bool:
    """Whether ``map_location`` is a torch-style callable: decoded storages are handed to it
    (on the host) instead of being decoded where it says."""
    return callable(ml) and not isinstance(ml, Mapping) and _torch_style(ml)


def _torch_style(fn: Any) -> bool:
    """Whether a ``map_location`` callable takes torch.load's ``(storage, location)``; a callable
    that accepts exactly one positional argument is the legacy ckptzip form ``fn(location)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


#: default resource bound (see docs/format.md, *Resource bounds*): a file may declare at most
#: max(DEFAULT_MIN_BYTES, DEFAULT_EXPANSION x its size) of decoded storage bytes
DEFAULT_EXPANSION = 4096
DEFAULT_MIN_BYTES = 1 << 30


def _ref_levels(jobs: dict[int, Job]) -> dict[int, int]:
    """Each job's depth in its chain of local references (0: refers to no storage of this file;
    validate.py refused cycles). A loop, not a recursive closure: a closure that calls itself is a
    reference cycle, which kept every job, and so every output tensor of a load, alive until the
    garbage collector ran (a caller's ``del`` freed nothing; the next load faulted in new pages)."""
    level: dict[int, int] = {}
    for i in jobs:
        chain = []
        k = i
        while k not in level:
            r = jobs[k].ref
            if r is None or not r.local:
                level[k] = 0
                break
            chain.append(k)
            k = r.storage
            if len(chain) > len(jobs):  # (unreachable after validate.py)
                raise CorruptFileError("storage references form a cycle")
        for d, k2 in enumerate(reversed(chain), 1):
            level[k2] = level[k] + d
    return level


class CheckpointReader:
    """Lazy reader over one .ckz file: keys, metadata and single tensors without reading the rest.

    Use as a context manager: ``with ckptzip.open(path) as r: w = r.get_tensor("model.fc.weight")``.
    ``path`` is a local path, an fsspec URL or a binary file object open for reading (with
    ``read`` and ``seek``; it is not closed). ``max_bytes`` bounds the decoded bytes one call
    may allocate (``load``/``verify``: all storages; ``get_tensor``: its storage); the default
    is ``max(1 GiB, 4096 x the file size)``; a file that declares more raises
    :class:`~ckptzip.ResourceLimitError` before anything is allocated.
    """

    def __init__(self, path: Any, *, map_location: Any = None, allow_pickle: bool = False,
                 progress: Progress | None = None, decode_device: str | None = None,
                 max_bytes: int | None = None, base_dir: Any = None, base_path: Any = None,
                 _depth: int = 0) -> None:
        self._fd = None
        self._base = None
        self._base_file = None  # (format 1.3: the base opened for the storages this file's record locates)
        self._full_planes = False  # verify(): every plane of the base storages read and checksummed
        self._depth = _depth
        self.base_dir, self.base_path = base_dir, base_path
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                      or max_bytes < 0):
            raise ValueError("max_bytes must be a non-negative int or None")
        self.decode_device = decode_device  # "cpu"/"cuda" forces where chunks are decoded
        self.map_location = map_location
        self.allow_pickle = allow_pickle
        self.progress = progress
        self._max_bytes = max_bytes
        if is_file_object(path):
            self.path = str(getattr(path, "name", "<file object>"))
            self._remote = True  # positional reads go through the source object
            self._fd = FileObjectSource(path)
        else:
            self.path = os.fspath(path)
            self._remote = is_url(self.path)
            self._fd = RemoteSource(self.path) if self._remote else open_regular(local_path(self.path))
        try:
            self._open()
        except BaseException:
            self._fd.close() if self._remote else os.close(self._fd)
            self._fd = None
            raise
        self._cache: dict[int, torch.Tensor] = {}
        #: decoded packs (format 1.5) kept for later reads of their other members, oldest first,
        #: at most PACK_CACHE_BYTES in all (lazy readers go key by key: the DCP reader, get_tensor)
        self._packs: dict[int, torch.Tensor] = {}
        self._chains: dict = {}  # parsed transform chains and codecs (engine.storage_chain)
        self._devices: dict = {}  # (saved device, str or torch.device map_location) -> device
        self._gpu: bool | None = None

    def _open(self) -> None:
        size = self._fd.size if self._remote else os.fstat(self._fd).st_size
        raw, off, digest = read_manifest(self._fd, size)
        self.manifest = parse_manifest(bytes(raw), digest, off)
        self._manifest_raw = raw  # (its SHA-256, for base records, made when asked: manifest_sha256)
        self._manifest_sha256: str | None = None
        self.file_size = size
        self._paths: dict[str, Any] | None = None
        self._escaped: dict[str, Any] = {}

    @property
    def manifest_sha256(self) -> str:
        """The SHA-256 (hex) of the manifest's bytes, as base records hold it (format 1.1)."""
        if self._manifest_sha256 is None:
            self._manifest_sha256 = manifest_sha256(self._manifest_raw)
        return self._manifest_sha256

    @property
    def max_bytes(self) -> int:
        """The decoded-bytes limit in force (``max_bytes`` or the default for this file)."""
        if self._max_bytes is not None:
            return self._max_bytes
        return max(DEFAULT_MIN_BYTES, DEFAULT_EXPANSION * self.file_size)

    def _check_budget(self, nbytes: int, what: str) -> None:
        if nbytes > self.max_bytes:
            raise ResourceLimitError(
                f"{what} declares {nbytes} decoded bytes, more than max_bytes={self.max_bytes} "
                f"(default: max(1 GiB, {DEFAULT_EXPANSION} x the file's {self.file_size} bytes)); "
                f"if you trust this file, pass a larger max_bytes to load/open")

    # -- metadata ---------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.manifest.doc.get("meta", {}))

    @property
    def storages(self) -> list[dict[str, Any]]:
        return self.manifest.doc["storages"]

    def _tensor_nodes(self) -> dict[str, Any]:
        if self._paths is None:
            self._paths, self._escaped = tensor_keys(self.manifest.doc["root"])
        return self._paths

    def _node(self, key: str) -> Any:
        node = self._tensor_nodes().get(key)
        return self._escaped.get(key) if node is None else node

    def keys(self) -> list[str]:
        """Keys of every tensor and numpy array: dotted paths (``"model.fc.weight"``), except
        for tensors whose dotted path another tensor shares (keys ``1`` and ``"1"``, or ``"a.b"``
        and ``{"a": {"b": ...}}``), which are listed by their escaped key, the path as a JSON
        array (``'["a.b"]'``, ``'[1]'``). :meth:`get_tensor` accepts either form."""
        return list(self._tensor_nodes())

    def tensor_info(self) -> list[dict[str, Any]]:
        """Per tensor and numpy array, in key order, what the manifest says of it:
        ``{"key", "dtype", "shape", "storage"}`` (``storage`` indexes :attr:`storages`)."""
        return [{"key": k, "dtype": n.get("dtype"), "shape": n.get("shape"), "storage": self._storage_index(n)}
                for k, n in self._tensor_nodes().items()]

    def __contains__(self, key: str) -> bool:
        return self._node(key) is not None

    def stored_bytes(self, index: int) -> int:
        """Stored bytes of storage ``index``'s own chunks (0 for a packed storage: format 1.5,
        its bytes are its pack's)."""
        if "in" in self.storages[index]:
            return 0
        first, count = self.storages[index]["rows"]
        return int(self.manifest.rows["stored"][first:first + count].astype(np.int64).sum())

    # -- data -------------------------------------------------------------------------------
    def _storage_index(self, node: dict[str, Any]) -> int:
        s = node.get("s")
        if type(s) is not int or not 0 <= s < len(self.manifest.doc["storages"]):
            raise CorruptFileError(f"tensor refers to storage {s!r}, which does not exist")
        return s

    def _job(self, i: int, t: str = "tensor") -> Job:
        return self._job_into(i, self._out(i, t))

    def _out(self, i: int, t: str = "tensor") -> torch.Tensor:
        """A new output for storage ``i`` (reached by a node of kind ``t``), where it goes."""
        return empty_bytes(self.manifest.doc["storages"][i]["nbytes"], self._out_device(i, t))

    def _out_device(self, i: int, t: str) -> torch.device:
        """Where storage ``i``'s output goes when a node of kind ``t`` reaches it first."""
        ml = self.map_location if t == "tensor" else "cpu"
        if _maps_storages(ml):
            return torch.device("cpu")  # decoded on the host, then handed to ml(storage, location)
        saved = self.manifest.doc["storages"][i].get("device", "cpu") if t == "tensor" else "cpu"
        key = (saved, ml) if ml is None or isinstance(ml, (str, torch.device)) else None
        dev = self._devices.get(key) if key is not None else None
        if dev is None:
            dev = _resolve_device(saved, ml)
            if key is not None:
                self._devices[key] = dev
        return dev

    def _outs(self, kinds: dict[int, str]) -> dict[int, torch.Tensor]:
        """:meth:`_out` of every storage in ``kinds`` (index -> kind of its first node), each
        device resolved once per saved device and kind (a load makes hundreds)."""
        storages = self.storages
        devs: dict = {}
        outs = {}
        for i, t in kinds.items():
            s = storages[i]
            key = (s.get("device", "cpu"), t)
            dev = devs.get(key)
            if dev is None:
                dev = devs[key] = self._out_device(i, t)
            outs[i] = empty_bytes(s["nbytes"], dev)
        return outs

    def _jobs(self, outs: dict[int, torch.Tensor]) -> dict[int, Job]:
        """:meth:`_job_into` for every output but those of packed storages (format 1.5), which
        :meth:`_plan_fill` fills from their packs."""
        storages = self.storages
        return {i: self._job_into(i, o) for i, o in outs.items() if "in" not in storages[i]}

    def _job_into(self, i: int, out: torch.Tensor) -> Job:
        """A job that decodes storage ``i`` into ``out``; a reference transform comes back unbound
        (see :meth:`_fill`)."""
        s = self.manifest.doc["storages"][i]
        first, count = s["rows"]
        chain = self.manifest.chains[i] if self.manifest.chains is not None else None
        return self._job_of(s, self.manifest.rows[first:first + count], out, chain)

    def _job_of(self, s: dict[str, Any], rows: np.ndarray, out: torch.Tensor, chain: list | None = None) -> Job:
        """A job for storage record ``s`` (of this file, or located in a base by this file's
        record) whose chunk rows are ``rows``: decoded where ``out`` is, or where the caller said."""
        if self.decode_device is None and out.device.type != "cuda" and self._gpu is None:
            self._gpu = gpu_ok()
        work = self.decode_device or ("cuda" if out.device.type == "cuda" or self._gpu else "cpu")
        ref, tf, codec = storage_chain(s, work, self._chains, chain)
        if not codec.safe_on_forged and self.decode_device is None:
            ref, tf, codec = storage_chain(s, "cpu", self._chains, chain)  # (Codec.safe_on_forged)
        return Job(rows, tf, codec, out, ref)

    # -- format 1.1 references: bases and derived storages ------------------------------------
    @property
    def bases(self) -> list[dict[str, Any]]:
        """The base records (format 1.1): ``[{"file", "sha256", "size", "depth"}]`` or ``[]``."""
        return self.manifest.doc.get("bases", [])

    @property
    def base(self) -> dict[str, Any] | None:
        """The base record of an incremental checkpoint, or None for a standalone one."""
        return self.bases[0] if self.bases else None

    def base_reader(self) -> "CheckpointReader":
        """The reader of this file's base, opened and checked on first use
        (:class:`~ckptzip.BaseCheckpointError` if it is missing, altered or too deep; and, as its
        document is now parsed, this file's record of located storages checked against it)."""
        if self._base is None:
            if not self.bases:
                raise BaseCheckpointError(f"{self.path} is not an incremental checkpoint")
            base = open_base(self, self.base_dir, self.base_path)
            try:
                self._check_hints(base)
            except BaseException:
                base.close()
                raise
            self._base = base
        return self._base

    def _fill(self, outs: dict[int, torch.Tensor], prog: Callable[[int], None] | None = None,
              made: dict[int, Job] | None = None, idle: Callable[[], None] | None = None) -> None:
        """Decode storages ``i`` into the flat uint8 tensors ``outs[i]``, resolving references:
        storages a ``derived`` or ``expref`` one refers to are decoded first (into temporaries unless requested),
        level by level; an ``xor`` storage is first filled with its base storage (decoded from
        the base file straight into the destination), then its residual is applied in place.
        Everything, base storages included, is decoded in one pipelined pass.
        ``made``: jobs already made for these outputs by :meth:`_job_into` (used, not remade)."""
        batch, breaks, copies, fresh = self._plan_fill(outs, made)
        gpu = any(j.codec.device == "cuda" for j in batch)
        decode_jobs(self._fd, batch, gpu_decode_window() if gpu else DEFAULT_WINDOW, prog, breaks, idle)
        for p, t in fresh.items():  # (decoded and checked: kept for the pack's other members)
            self._keep_pack(p, t)
        if copies:  # (format 1.5: each packed storage from its pack, once the packs are decoded)
            dsts, srcs = zip(*copies)
            if len({t.device for t in dsts + srcs}) == 1:
                torch._foreach_copy_(list(dsts), list(srcs))
            else:
                for d, src in copies:
                    d.copy_(src)

    def _keep_pack(self, p: int, t: torch.Tensor) -> None:
        """Keep decoded pack ``p`` (see ``_packs``), dropping the oldest beyond the limit."""
        if t.numel() > PACK_CACHE_BYTES:
            return
        self._packs.pop(p, None)
        self._packs[p] = t
        total = sum(x.numel() for x in self._packs.values())
        while total > PACK_CACHE_BYTES:
            total -= self._packs.pop(next(iter(self._packs))).numel()

    def _plan_fill(self, outs: dict[int, torch.Tensor], made: dict[int, Job] | None = None
                   ) -> tuple[list[Job], list[int], list, dict[int, torch.Tensor]]:
        """The jobs of :meth:`_fill`, in decode order, the job indices where a new decode
        group must start (the base file's jobs first, their ``fd`` the base's, then this file's
        references level by level), the copies ``(output, slice of its pack)`` that fill
        packed storages (format 1.5) once the jobs are done, and the packs these jobs decode
        (a pack decoded by an earlier call is taken from ``_packs``)."""
        need = dict(outs)
        extra = 0  # bytes of temporaries: referred-to storages and packs nobody asked for
        storages = self.storages
        asked = sum(storages[j]["nbytes"] for j in outs if 0 <= j < len(storages))
        jobs: dict[int, Job] = {}
        packed: dict[int, int] = {}
        fresh: dict[int, torch.Tensor] = {}
        kept: set[int] = set()  # packs taken from _packs: nothing to decode
        todo = list(need)
        while todo:
            i = todo.pop()
            if i in jobs or i in packed:
                continue
            at = storages[i].get("in")
            if at is not None:  # (validated: its pack is a storage with chunks, the slice inside it)
                p = packed[i] = at[0]
                if p not in need:
                    if p in self._packs:  # (decoded before: copied from, nothing decoded)
                        need[p] = self._packs[p]
                        kept.add(p)
                    else:
                        extra += storages[p]["nbytes"]
                        self._check_budget(asked + extra, "the requested storages with their packs")
                        need[p] = fresh[p] = empty_bytes(storages[p]["nbytes"], need[i].device)
                if p not in kept:
                    todo.append(p)
                continue
            job = made.get(i) if made else None
            if job is None or job.out is not need[i] or job.ref is not None and job.ref.ref is not None:
                job = self._job_into(i, need[i])
            jobs[i] = job
            if job.ref is not None and job.ref.local:
                k = job.ref.storage
                if k not in need:
                    extra += storages[k]["nbytes"]
                    self._check_budget(asked + extra, "the requested storages with those they refer to")
                    need[k] = empty_bytes(storages[k]["nbytes"], need[i].device)
                todo.append(k)
        level = _ref_levels(jobs)
        order = sorted(jobs, key=lambda i: (level[i], i))
        # storages against a base file (xor, delta) first get their base storage, decoded from
        # that file by jobs that run first in the same pipelined pass (a group never mixes
        # files or levels; the GPU runs them in stream order); then every level of this file
        pre: list[Job] = []
        pre_breaks: list[int] = []
        xors = [jobs[i] for i in order if jobs[i].ref is not None and jobs[i].ref.against_base]
        located = self._located_base_jobs(xors) if xors else None
        if located is not None:  # (format 1.3: planned from this file's record, the base's document unread)
            pre = located
        elif xors:
            base = self.base_reader()
            first: dict[int, torch.Tensor] = {}
            shared = False
            for j in xors:
                bj = j.ref.storage
                if bj >= len(base.storages) or base.storages[bj]["nbytes"] != j.out.numel():
                    raise BaseCheckpointError(
                        f"base checkpoint {self.bases[0]['file']!r} of {self.path} has no storage {bj} "
                        f"of {j.out.numel()} bytes")
                # (a packed base storage is copied from its pack after decoding: also before)
                shared = shared or (bj in first) or "in" in base.storages[bj]
                first.setdefault(bj, j.out)
            if shared:  # two storages against one base storage: decoded once, before, and copied
                base._fill(first)
                for j in xors:
                    if first[j.ref.storage] is not j.out:
                        j.out.copy_(first[j.ref.storage])
            else:
                pre, pre_breaks, _none, _fresh = base._plan_fill(first)  # (no packed storage: see shared)
                partial = set() if self._full_planes else {id(j.out) for j in xors if isinstance(j.ref, HiDelta)}
                # not where another job reads that storage's words: a storage of the base that
                # refers to it (derived), or the base's own reference transform undone in place
                # onto what its base's job wrote there (then that job is not the base's own)
                partial -= {id(j.ref.ref) for j in pre if j.ref is not None}
                for j in pre:
                    own = j.fd is None  # (the base's base's jobs come with their fd set)
                    if own:
                        j.fd = base._fd
                    if own and id(j.out) in partial:
                        _planes_only(j)
        for j in xors:
            j.ref = j.ref.bind(j.out)  # in place: out holds the base, the residual is applied to it
        batch = [jobs[i] for i in order]
        for j in batch:
            if j.ref is not None and j.ref.local:
                j.ref = j.ref.bind(need[j.ref.storage])
        breaks = [k for k in range(1, len(order)) if level[order[k]] != level[order[k - 1]]]
        if pre:
            breaks = pre_breaks + [len(pre)] + [len(pre) + k for k in breaks]
        copies = []
        for i, p in packed.items():
            start = storages[i]["in"][1]
            copies.append((need[i], need[p][start:start + storages[i]["nbytes"]]))
        return pre + batch, breaks, copies, fresh

    def _located_base_jobs(self, xors: list[Job]) -> list[Job] | None:
        """The base's jobs for ``xors`` (storages against the base) planned from this file's
        base record (format 1.3 ``storages``/``chains``), the base opened as a
        :class:`~ckptzip.incremental.BaseFile`; None where the record does not locate every one
        of them, two share a base storage, or the base is not a local file (the caller then
        opens the base as a reader)."""
        if len({j.ref.storage for j in xors}) < len(xors):
            return None
        if self._base_file is None:
            if not self.bases or "storages" not in self.bases[0]:
                return None
            hints = {r[0] for r in self.bases[0]["storages"]}
            if any(j.ref.storage not in hints for j in xors):
                return None
            self._base_file = open_base_file(self, self.base_dir, self.base_path)
            if self._base_file is None:
                return None
        bf = self._base_file
        jobs = []
        for j in xors:
            got = bf.storage(j.ref.storage, j.out.numel())
            if got is None:
                return None
            job = self._job_of(got[1], got[0], j.out, got[2])
            job.fd = bf.fd
            if isinstance(j.ref, HiDelta) and not self._full_planes:
                _planes_only(job)
            jobs.append(job)
        return jobs

    def _check_hints(self, base: "CheckpointReader") -> None:
        """Once the base's document is parsed (:meth:`base_reader`), the record's located storages
        (format 1.3) must say what the base says: each one's chunk rows and chain
        (CorruptFileError otherwise), so that a file decodes the same whether or not its reader
        planned from the record."""
        rec = self.bases[0] if self.bases else {}
        for j, first, count, c in rec.get("storages", []):
            s = base.storages[j] if j < len(base.storages) else None
            ch = rec["chains"][c]
            if (s is None or s.get("rows") != [first, count] or s.get("transforms", []) != ch["transforms"]
                    or s["codec"] != ch["codec"]):
                raise CorruptFileError(f"{self.path}: its base record locates base storage {j} other than "
                                       f"{self.bases[0]['file']!r} stores it")

    def _mapped(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """torch.load's convention: ``map_location(storage, location)`` gets the storage
        restored on the CPU and its saved location string and returns the storage to use (its
        device decides), or None for the default placement."""
        loc = self.storages[i].get("device", "cpu")
        r = self.map_location(out.untyped_storage(), loc)
        if r is None:
            return out.to(_resolve_device(loc, None))
        if isinstance(r, torch.TypedStorage):
            r = r.untyped()
        if isinstance(r, torch.UntypedStorage):
            r = torch.empty(0, dtype=torch.uint8, device=r.device).set_(r)
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"map_location returned {type(r).__name__}; expected a storage, a tensor or None")
        r = r.detach().contiguous().view(-1).view(torch.uint8)
        if r.numel() != out.numel():
            raise ValueError(f"map_location returned {r.numel()} bytes for a storage of {out.numel()}")
        return r

    def _decode(self, outs: dict[int, torch.Tensor], jobs: dict[int, Job], total: int | None = None,
                idle: Callable[[], None] | None = None) -> None:
        """Decode storages into ``outs`` (``jobs``: made for them already; none for packed ones)."""
        total = self._total_bytes() if total is None else total
        prog = (lambda n: self.progress(n, total)) if self.progress else None
        self._fill(outs, prog, jobs, idle)
        self._cache.update(outs)

    def _place(self, kinds: dict[int, str]) -> None:
        """Hand decoded tensor storages to a torch-style ``map_location`` callable."""
        if _maps_storages(self.map_location):
            for i, t in kinds.items():
                if t == "tensor" and i in self._cache:
                    self._cache[i] = self._mapped(i, self._cache[i])

    def _storage(self, node: dict[str, Any]) -> torch.Tensor:
        i = self._storage_index(node)
        if i not in self._cache:
            self._check_budget(self.storages[i]["nbytes"], f"storage {i}")
            t = node.get("t", "tensor")
            outs = {i: self._out(i, t)}
            self._decode(outs, self._jobs(outs))
            self._place({i: t})
        return self._cache[i]

    def _prefetch_all(self, early: Callable[[dict[int, torch.Tensor]], None] | None = None) -> None:
        """Decode every storage in one pipelined pass (file order), using each storage's first
        referencing node kind to place it (a storage reached by no key is decoded on demand).
        ``early(outs)``: called with the storages' output tensors (not yet filled) once the
        reader thread has started (see :func:`~ckptzip.engine.decode.decode_jobs`' ``idle``)."""
        kinds: dict[int, str] = {}
        for n in (self._tensor_nodes().values() if self._paths is not None else tensor_nodes(self.manifest.doc["root"])):
            if type(n.get("s")) is int:
                kinds.setdefault(n["s"], n["t"])
        storages = self.storages
        kinds = {i: t for i, t in sorted(kinds.items()) if 0 <= i < len(storages)}
        self._check_budget(sum(storages[i]["nbytes"] for i in kinds), "the checkpoint")
        outs = self._outs(kinds)
        self._decode(outs, self._jobs(outs), idle=(lambda: early(outs)) if early is not None else None)
        self._place(kinds)

    def _total_bytes(self) -> int:
        return self.manifest.total_nbytes

    def get_tensor(self, key: str, *, keep: bool = True) -> Any:
        """One tensor (or numpy array) by dotted key, reading only its own chunks. The reader
        keeps the storages it decoded (tensors sharing one come back as views of it) until it is
        closed; ``keep=False`` lets them go once returned (memory bounded by what the caller
        holds: the DCP reader serves a file tensor by tensor this way)."""
        node = self._node(key)
        if node is None:
            raise TensorNotFoundError(key)
        before = set(self._cache) if not keep else None
        out = Decoder(self._storage, self.allow_pickle).decode(node)
        if before is not None:
            for i in set(self._cache) - before:
                del self._cache[i]
        return out

    def read_into(self, targets: Mapping[str, torch.Tensor]) -> list[str]:
        """Decode tensors by key straight into the caller's tensors, all in one pipelined pass
        (no decoded copy is made), and return the keys filled. A key is filled only where the
        stored tensor is its storage's whole contiguous content with the target's dtype and
        shape, and the target is a contiguous CPU or CUDA tensor; other keys (views into larger
        storages, storages shared by several keys, mismatches) are left untouched for
        :meth:`get_tensor`. A failed decode may leave filled targets partly written."""
        outs: dict[int, torch.Tensor] = {}
        done: list[str] = []
        meta = Decoder(None, False)
        for key, tgt in targets.items():
            node = self._node(key)
            if not isinstance(node, dict) or node.get("t") != "tensor" or not isinstance(tgt, torch.Tensor):
                continue
            i = self._storage_index(node)
            s = self.storages[i]
            dt, shape, stride, off = meta.tensor_meta(node, s["nbytes"])
            if (dt != tgt.dtype or list(tgt.shape) != shape or stride != contiguous_stride(shape) or off != 0 or i in outs
                    or i in self._cache or not tgt.is_contiguous() or tgt.numel() == 0
                    or tgt.device.type not in ("cpu", "cuda") or s["nbytes"] != tgt.numel() * tgt.element_size()):
                continue
            outs[i] = tgt.detach().reshape(-1).view(torch.uint8)
            done.append(key)
        if outs:
            self._check_budget(sum(self.storages[i]["nbytes"] for i in outs), "the requested tensors")
            self._fill(outs, None, self._jobs(outs))
        return done

    def load(self) -> Any:
        """The whole object, as ``ckptzip.load`` returns it. The object tree is built while the
        reader thread reads the first groups: its tensors are views of the output storages,
        which decoding then fills in place (the tree never reads their bytes). Not with a
        torch-style ``map_location`` callable, which replaces the storages after decoding."""
        built: list = []

        def early(outs: dict[int, torch.Tensor]) -> None:
            def storage(node: dict[str, Any]) -> torch.Tensor:
                i = self._storage_index(node)
                if i not in outs:  # (a storage decoded on demand: build the tree afterwards)
                    raise _NotPrefetched
                return outs[i]
            try:
                built.append(Decoder(storage, self.allow_pickle).decode(self.manifest.doc["root"]))
            except _NotPrefetched:
                pass
        self._prefetch_all(None if _maps_storages(self.map_location) else early)
        obj = built[0] if built else Decoder(self._storage, self.allow_pickle).decode(self.manifest.doc["root"])
        self._cache.clear()
        self._packs.clear()
        return obj

    def verify(self) -> None:
        """Decode every storage (checking every checksum); raises on the first failure.

        One pipelined pass in file order, in batches of about 256 MiB of decoded bytes (at least
        one storage) whose results are dropped: linear in the number of storages. The base
        storages an incremental file needs are read whole (a load may read only some of their
        byte planes, format 1.3), and the base's document is parsed to check the file's record
        of where they are and how they are coded."""
        total = self._total_bytes()
        self._check_budget(total, "the checkpoint")
        if self.bases and "storages" in self.bases[0]:
            self.base_reader()  # (a load trusts the record; parsing the base checks it)
        batch: dict[int, Job] = {}
        size = 0
        self._full_planes = True
        try:
            for i in range(len(self.storages)):
                if "in" not in self.storages[i]:  # (a packed storage: its pack is decoded)
                    batch[i] = self._job(i, "ndarray")
                    size += self.storages[i]["nbytes"]
                if batch and (size >= _VERIFY_BATCH or i == len(self.storages) - 1):
                    self._decode({j: job.out for j, job in batch.items()}, batch, total)
                    for j in batch:
                        self._cache.pop(j, None)
                    batch, size = {}, 0
        finally:
            self._full_planes = False

    def close(self) -> None:
        self._packs = {}
        if getattr(self, "_base", None) is not None:
            self._base.close()
            self._base = None
        if getattr(self, "_base_file", None) is not None:
            self._base_file.close()
            self._base_file = None
        if getattr(self, "_fd", None) is None:
            return
        if self._remote:
            self._fd.close()
        else:
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _NotPrefetched(Exception):
    """The tree refers to a storage the prefetch does not decode (see :meth:`CheckpointReader.load`)."""


def _planes_only(job: Job) -> None:
    """Turn a job that decodes a plain ``byteplane`` width-4 base storage for ``hidelta``
    (which reads the top half of each word) into one that reads planes 2 and 3 (``rotate`` 16)
    or 0, 2 and 3 only, where its chunks hold whole planes."""
    if job.ref is None and isinstance(job.tf, BytePlane) and job.tf.width == 4:
        sub = PlaneSubset(job.tf.block, job.tf.rotate)
        rows = plane_rows(job.rows, job.tf, job.out.numel(), sub.planes)
        if rows is not None:
            job.rows, job.tf = rows, sub


def open(path: Any, **kwargs: Any) -> CheckpointReader:  # noqa: A001
    """Open a checkpoint lazily (see :class:`CheckpointReader`); ``path`` may be a binary file
    object."""
    return CheckpointReader(path, **kwargs)


def load(path: Any, *, map_location: Any = None, allow_pickle: bool = False,
         progress: Progress | None = None, decode_device: str | None = None,
         max_bytes: int | None = None, base_dir: Any = None, base_path: Any = None,
         dtype: torch.dtype | None = None, allow_lossy: bool = True) -> Any:
    """Load what :func:`save` wrote from ``path`` (a local path, an fsspec URL, or a binary file
    object with ``read`` and ``seek``, left open). Tensors come back bit-exact, on their saved
    device unless ``map_location`` says otherwise: ``"cpu"``, ``"cuda"``, a ``torch.device``, a
    dict mapping saved locations to new ones, or a callable ``fn(storage, location)`` as in
    ``torch.load`` (it gets each storage restored on the CPU and its saved location string, e.g.
    ``"cuda:0"``, and returns the storage to use, or None for the default placement; a callable
    of one argument is called as ``fn(location)`` and returns a device). A saved CUDA location
    loads to the CPU on a machine without CUDA; an explicit CUDA ``map_location`` there raises
    :class:`~ckptzip.GPURequiredError`. ``max_bytes`` bounds the decoded bytes (default
    ``max(1 GiB, 4096 x file size)``, see :class:`CheckpointReader`). Pickled objects load only
    with ``allow_pickle=True``. ``progress(bytes_done, bytes_total)`` is called with decoded
    (raw) bytes. ``decode_device``: ``"cpu"`` or ``"cuda"`` forces where chunks are decoded
    (default: the GPU when the destination is on one or nvCOMP is usable, else the CPU; but
    zstd chunks on the CPU unless ``"cuda"`` is given: nvCOMP 6.0's Zstd decoder hung on
    forged chunks). Chunks decoded on the CPU for a tensor on one GPU have their byte planes
    undone on that GPU.
    ``base_dir`` / ``base_path``: where to find the base checkpoint(s) of an incremental file
    that moved (default: the recorded relative path).

    An incremental checkpoint (saved with ``base=``) loads its chain of bases bit-exact: each base
    is found at the path recorded relative to the file, or given explicitly: ``base_path`` (the
    immediate base) or ``base_dir`` (a directory holding the bases by file name, for the whole
    chain). A missing, altered or replaced base raises :class:`~ckptzip.BaseCheckpointError`
    naming it.

    A lossy export (:func:`ckptzip.export`; its metadata says ``ckptzip.lossy``) loads as
    ``{name: dequantized tensor}`` in ``dtype`` (default ``torch.bfloat16``) plus its lossless
    tensors; ``ckptzip.lossy.load_codes`` gives the codes and scales. ``dtype`` applies to lossy
    exports only. ``allow_lossy=False`` (resume paths) raises
    :class:`~ckptzip.lossy.LossyCheckpointError` for a lossy export instead."""
    with CheckpointReader(path, map_location=map_location, allow_pickle=allow_pickle,
                          progress=progress, decode_device=decode_device, max_bytes=max_bytes,
                          base_dir=base_dir, base_path=base_path) as r:
        lossy = r.metadata.get("ckptzip.lossy") == "1"
        if lossy and not allow_lossy:
            from .lossy.errors import LossyCheckpointError
            raise LossyCheckpointError(f"{os.fspath(path) if isinstance(path, (str, os.PathLike)) else 'this file'} "
                                       f"is a lossy weights-only export and cannot be resumed from; use a "
                                       f"lossless checkpoint")
        obj = r.load()
        if torch.cuda.is_initialized():  # this process uses the GPU: compile the kernels from now
            # on, in the background (not during this load: see kernels.triton_kernels)
            triton_kernels()
        if not lossy:
            return obj
    from .lossy.core import dequantize_tree
    dev = map_location if isinstance(map_location, (str, torch.device)) else None
    return dequantize_tree(obj, dtype or torch.bfloat16, dev, os.fspath(path) if isinstance(path, (str, os.PathLike))
                           else "lossy export")


def base_chain(path: Any, *, base_dir: Any = None) -> list[str]:
    """The bases an incremental checkpoint needs, nearest first (``[]`` for a standalone file):
    the paths where they were found, each checked against its record (size, manifest SHA-256,
    chain depth). Raises :class:`~ckptzip.BaseCheckpointError` naming a missing or altered base.
    A checkpoint directory must keep every file in the chain of a file it keeps."""
    return _chain(path, base_dir)
