"""torch.distributed.checkpoint (DCP) storage backed by ckptzip.

Usage::

    import torch.distributed.checkpoint as dcp
    from ckptzip.dcp import Writer, Reader

    dcp.save(state, storage_writer=Writer("ckpt/step_100"))
    dcp.load(state, storage_reader=Reader("ckpt/step_100"))

Every rank writes ONE ``.ckz`` file (``__{rank}_0.ckz``) with :func:`ckptzip.save`, compressing
its shards where they are (on the GPU for CUDA shards when nvCOMP is usable). The coordinator then
writes the global metadata as JSON (``ckptzip.dcp.json``, never a pickle) and, last of all, the
commit marker ``COMMIT``. :class:`Reader` refuses a directory without a valid marker, validates the
JSON strictly and rebuilds DCP's ``Metadata`` from it; DCP's planner does the resharding (a
checkpoint written by N ranks loads on M ranks). The layout is documented in ``docs/dcp.md``.
"""
from __future__ import annotations

import collections
import copy
import hashlib
import io
import json
import math
import os
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

import ckptzip
from ckptzip.errors import CkptzipError, CorruptFileError, PickleNotAllowedError, ResourceLimitError
from ckptzip.storage import is_url, local_path, open_for_write
from ckptzip.validate import strict_json

__all__ = ["Writer", "Reader", "consolidate", "read_full", "read_metadata", "item_key", "DCPMetadataError",
           "IncompleteCheckpointError", "METADATA_NAME", "COMMIT_NAME", "FORMAT", "FORMAT_VERSION"]

METADATA_NAME = "ckptzip.dcp.json"
COMMIT_NAME = "COMMIT"
FORMAT = "ckptzip-dcp"
FORMAT_VERSION = 1
DCP_VERSION = "1.0.0"  # the DCP metadata version this layout corresponds to (FileSystemWriter's)
MAX_METADATA_BYTES = 1 << 30
MAX_NDIM = 64
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}\.ckz$")
#: what this module's writer leaves in a step directory before its commit: rank files
#: (``__{rank}_{0,1}.ckz``) and atomic_write's temporary files of them
_RANK_RE = re.compile(r"__[0-9]+_[01]\.ckz|\.__[0-9]+_[01]\.ckz\.[a-z0-9_]+\.tmp(?:\.old)?", re.ASCII)

# dtype names accepted in the metadata (only those this torch defines are used).
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
_DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_DTYPE_TO_NAME = {d: n for n, d in _DTYPES.items()}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}
_MF_TO_NAME = {v: k for k, v in _MEMORY_FORMATS.items()}


class DCPMetadataError(CorruptFileError):
    """The DCP checkpoint's JSON metadata (or commit marker) is malformed, hostile or inconsistent."""

    def __str__(self) -> str:
        # DCP's loader folds read_metadata's exception into an AssertionError message (and that
        # into a CheckpointException): keep the error's name in the text so it stays visible.
        return f"{type(self).__name__}: {super().__str__()}"


class IncompleteCheckpointError(DCPMetadataError):
    """The DCP checkpoint directory is not committed (no valid ``COMMIT`` marker, e.g. a rank died
    mid-save), or a file the metadata references is missing or has another size."""


def item_key(index: MetadataIndex) -> str:
    """The key a WriteItem is stored under in its rank's .ckz file: ``fqn@o0,o1,...`` for a tensor
    chunk at offsets (o0, o1, ...) (``fqn@`` for a 0-d tensor) and ``fqn@bytes`` for a bytes item.
    The part after the LAST ``@`` is digits and commas or ``bytes``, so keys are unique."""
    if index.offset is None:
        return f"{index.fqn}@bytes"
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


@dataclass(frozen=True)
class _Stored:
    """WriteResult.storage_data: where one item lives."""
    file: str
    key: str
    file_bytes: int


# -- path helpers (local paths and fsspec URLs) ----------------------------------------------
def _join(base: str, name: str) -> str:
    if is_url(base):
        return base.rstrip("/") + "/" + name
    return os.path.join(local_path(base), name)


def not_a_checkpoint(path: str) -> Exception:
    """The error for a directory without ckptzip's metadata and commit marker, saying what it is
    instead: missing, torch's own DCP format (never unpickled here), a CheckpointManager
    directory, an interrupted ckptzip save, or something else."""
    if not is_url(path) and not os.path.isdir(path):
        return FileNotFoundError(2, "No such directory", path)
    try:
        if is_url(path):
            fs, p = _fs(path)
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False)]
        else:
            names = os.listdir(path)
    except OSError:
        names = []
    if ".metadata" in names:
        return DCPMetadataError(f"{path}: a checkpoint written by torch.distributed.checkpoint's own writer (its "
                                ".metadata is a pickle, which ckptzip never loads): not a ckptzip DCP checkpoint")
    if any(re.fullmatch(r"step-\d+(\.ckz|\.commit)?", n) for n in names):
        return DCPMetadataError(f"{path}: a CheckpointManager directory, not one checkpoint: list it with "
                                "`ckptzip ls` and pass a step-N directory or file")
    if any(_RANK_RE.fullmatch(n) for n in names):
        return IncompleteCheckpointError(f"{path}: rank files but no {METADATA_NAME} and no {COMMIT_NAME}: a ckptzip "
                                         "DCP save that is still running or was interrupted (not committed)")
    ckz = sorted(n for n in names if n.endswith(".ckz"))
    more = f" and {len(ckz) - 1} more .ckz files" if len(ckz) > 1 else ""
    hint = f"; it holds {ckz[0]!r}{more}: pass a file" if ckz else ""
    return DCPMetadataError(f"{path}: no {METADATA_NAME} and no {COMMIT_NAME}: not a ckptzip DCP checkpoint{hint}")


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` (a local directory or fsspec URL) looks like a ckptzip DCP checkpoint: it
    holds the JSON metadata or the commit marker (complete or not; :func:`read_metadata` says)."""
    if is_url(path):
        return _size(_join(path, METADATA_NAME)) is not None or _size(_join(path, COMMIT_NAME)) is not None
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in (METADATA_NAME, COMMIT_NAME))


def _fs(url: str):
    import fsspec
    return fsspec.core.url_to_fs(url)


def _mkdir(base: str) -> None:
    if is_url(base):
        fs, p = _fs(base)
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(local_path(base), exist_ok=True)


def _size(path: str) -> int | None:
    """Size of a file, or None when it does not exist."""
    if is_url(path):
        fs, p = _fs(path)
        return int(fs.size(p)) if fs.exists(p) else None
    try:
        st = os.stat(local_path(path))
    except FileNotFoundError:
        return None
    import stat
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _read_bytes(path: str, limit: int) -> bytes | None:
    size = _size(path)
    if size is None:
        return None
    if size > limit:
        raise DCPMetadataError(f"{path}: {size} bytes, more than the {limit} allowed")
    if is_url(path):
        fs, p = _fs(path)
        with fs.open(p, "rb") as f:
            return f.read(limit + 1)
    with open(local_path(path), "rb") as f:
        return f.read(limit + 1)


def _remove(path: str) -> None:
    try:
        if is_url(path):
            fs, p = _fs(path)
            if fs.exists(p):
                fs.rm(p)
        else:
            os.unlink(local_path(path))
    except FileNotFoundError:
        pass


def _write_atomic(path: str, data: bytes) -> None:
    with open_for_write(path) as f:
        f.write(data)


# -- metadata <-> JSON -----------------------------------------------------------------------
def _props_to_json(p: TensorProperties) -> dict[str, Any]:
    if p.dtype not in _DTYPE_TO_NAME:
        raise ValueError(f"ckptzip.dcp: dtype {p.dtype} is not supported")
    if p.layout != torch.strided:
        raise ValueError(f"ckptzip.dcp: layout {p.layout} is not supported (strided only)")
    return {"dtype": _DTYPE_TO_NAME[p.dtype], "layout": "strided", "requires_grad": bool(p.requires_grad),
            "memory_format": _MF_TO_NAME.get(p.memory_format, "contiguous_format"),
            "pin_memory": bool(p.pin_memory)}


def _planner_data_to_json(pd: Any) -> Any:
    """DefaultSavePlanner's planner_data: fqn -> object path (tuple of str / int). Anything else is
    not representable without pickle and is dropped (None)."""
    if not isinstance(pd, dict):
        return None
    out = {}
    for k, path in pd.items():
        if not isinstance(k, str) or not isinstance(path, (tuple, list)):
            return None
        if not all(type(x) in (str, int) for x in path):
            return None
        out[k] = list(path)
    return out


def _metadata_to_json(md: Metadata, storage: dict[MetadataIndex, _Stored], storage_meta: StorageMeta | None,
                      files: dict[str, int]) -> dict[str, Any]:
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            sdm[fqn] = {"type": "tensor", "properties": _props_to_json(m.properties),
                        "size": [int(x) for x in m.size],
                        "chunks": [{"offsets": [int(x) for x in c.offsets], "sizes": [int(x) for x in c.sizes]}
                                   for c in m.chunks]}
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise ValueError(f"ckptzip.dcp: unsupported storage metadata {type(m).__name__} for {fqn!r}")
    items = [{"fqn": idx.fqn, "offset": None if idx.offset is None else [int(x) for x in idx.offset],
              "file": s.file, "key": s.key} for idx, s in storage.items()]
    sm = None
    if storage_meta is not None:
        sm = {"checkpoint_id": None if storage_meta.checkpoint_id is None else os.fspath(storage_meta.checkpoint_id),
              "save_id": storage_meta.save_id, "modules": [str(m) for m in (storage_meta.modules or [])]}
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "dcp_version": DCP_VERSION,
            "files": {name: {"bytes": n} for name, n in sorted(files.items())},
            "state_dict_metadata": sdm, "storage_data": items,
            "planner_data": _planner_data_to_json(md.planner_data), "storage_meta": sm}


def _bad(msg: str) -> DCPMetadataError:
    return DCPMetadataError(f"DCP metadata: {msg}")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _int_list(x: Any, what: str, ndim: int | None = None) -> list[int]:
    if type(x) is not list or len(x) > MAX_NDIM or not all(_is_int(v) and 0 <= v < MAX_DIM for v in x):
        raise _bad(f"{what} must be a list of at most {MAX_NDIM} non-negative ints under 2**62, got {x!r:.200}")
    if ndim is not None and len(x) != ndim:
        raise _bad(f"{what} has {len(x)} dims, the tensor has {ndim}")
    return x


def _want(d: Any, keys: set[str], what: str, optional: set[str] = frozenset()) -> None:
    if type(d) is not dict:
        raise _bad(f"{what} must be an object, got {type(d).__name__}")
    missing = keys - set(d)
    extra = set(d) - keys - optional
    if missing or extra:
        raise _bad(f"{what}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")


#: a tensor dimension, offset or chunk size must be below this (torch takes sizes as int64)
MAX_DIM = 1 << 62
#: ``max_bytes`` for reads of the metadata that allocate nothing from it (the writer's own
#: check, a base's commit check, the manager's listing): no bound on the declared bytes
NO_BYTES_LIMIT = 1 << 200


def _declared_limit(files: dict[str, int]) -> int:
    """The most tensor bytes a checkpoint of these rank files may declare: what ckptzip's reader
    lets each file decode (``max(1 GiB, 4096 x its size)``, :attr:`ckptzip.CheckpointReader.max_bytes`),
    summed over the files."""
    from ckptzip.api import DEFAULT_EXPANSION, DEFAULT_MIN_BYTES
    return sum(max(DEFAULT_MIN_BYTES, DEFAULT_EXPANSION * n) for n in files.values())


def parse_metadata_json(raw: bytes, max_bytes: int | None = None) -> tuple[Metadata, dict[str, int]]:
    """Validate the JSON metadata document and rebuild DCP's ``Metadata`` from it (never
    unpickles). Returns the Metadata (``storage_data``: MetadataIndex -> ``_Stored``) and the
    ``{file name: bytes}`` table. Raises :class:`DCPMetadataError` on anything malformed."""
    doc = strict_json(raw, _bad, "UTF-8 JSON")
    _want(doc, {"format", "format_version", "dcp_version", "files", "state_dict_metadata", "storage_data",
                "planner_data", "storage_meta"}, "document")
    if doc["format"] != FORMAT:
        raise _bad(f"format is {doc['format']!r:.100}, not {FORMAT!r}")
    if not _is_int(doc["format_version"]) or doc["format_version"] != FORMAT_VERSION:
        raise _bad(f"unsupported format_version {doc['format_version']!r:.100}")
    if doc["dcp_version"] is not None and type(doc["dcp_version"]) is not str:
        raise _bad("dcp_version must be a string")

    files: dict[str, int] = {}
    if type(doc["files"]) is not dict:
        raise _bad("files must be an object")
    for name, info in doc["files"].items():
        if not _FILE_RE.match(name) or ".." in name:
            raise _bad(f"file name {name!r:.200} is not a plain .ckz name inside the checkpoint directory")
        _want(info, {"bytes"}, f"files[{name!r}]")
        if not _is_int(info["bytes"]) or info["bytes"] < 0:
            raise _bad(f"files[{name!r}].bytes must be a non-negative int")
        files[name] = info["bytes"]

    sdm: dict[str, Any] = {}
    if type(doc["state_dict_metadata"]) is not dict:
        raise _bad("state_dict_metadata must be an object")
    # whole tensors are allocated from these sizes before any chunk is read (read_full, DCP's
    # empty-state-dict planner): their bytes are bounded by the files' before anything else
    limit = _declared_limit(files) if max_bytes is None else max_bytes
    declared = 0
    for fqn, m in doc["state_dict_metadata"].items():
        w = f"state_dict_metadata[{fqn!r:.200}]"
        if type(m) is not dict or m.get("type") not in ("tensor", "bytes"):
            raise _bad(f"{w} must be an object with type 'tensor' or 'bytes'")
        if m["type"] == "bytes":
            _want(m, {"type"}, w)
            sdm[fqn] = BytesStorageMetadata()
            continue
        _want(m, {"type", "properties", "size", "chunks"}, w)
        p = m["properties"]
        _want(p, {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"}, f"{w}.properties")
        if type(p["dtype"]) is not str or p["dtype"] not in _DTYPES:
            raise _bad(f"{w}: dtype {p['dtype']!r:.100} is not an allowed dtype name")
        if p["layout"] != "strided":
            raise _bad(f"{w}: layout {p['layout']!r:.100} is not 'strided'")
        if type(p["memory_format"]) is not str or p["memory_format"] not in _MEMORY_FORMATS:
            raise _bad(f"{w}: memory_format {p['memory_format']!r:.100} is not allowed")
        if type(p["requires_grad"]) is not bool or type(p["pin_memory"]) is not bool:
            raise _bad(f"{w}: requires_grad and pin_memory must be booleans")
        size = _int_list(m["size"], f"{w}.size")
        declared += math.prod(size) * _DTYPES[p["dtype"]].itemsize
        if declared > limit:
            raise ResourceLimitError(
                f"DCP metadata declares more than {limit} tensor bytes (at {fqn!r:.200}), more than its rank "
                f"files may hold (default: max(1 GiB, 4096 x each file's size), summed); if you trust this "
                f"checkpoint, pass a larger max_bytes to Reader / read_full / read_metadata")
        if type(m["chunks"]) is not list:
            raise _bad(f"{w}.chunks must be a list")
        chunks = []
        for i, c in enumerate(m["chunks"]):
            _want(c, {"offsets", "sizes"}, f"{w}.chunks[{i}]")
            offs = _int_list(c["offsets"], f"{w}.chunks[{i}].offsets", len(size))
            sizes = _int_list(c["sizes"], f"{w}.chunks[{i}].sizes", len(size))
            if any(o + s > n for o, s, n in zip(offs, sizes, size)):
                raise _bad(f"{w}.chunks[{i}] (offsets {offs}, sizes {sizes}) lies outside the tensor size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offs), sizes=torch.Size(sizes)))
        props = TensorProperties(dtype=_DTYPES[p["dtype"]], layout=torch.strided,
                                 requires_grad=p["requires_grad"],
                                 memory_format=_MEMORY_FORMATS[p["memory_format"]], pin_memory=p["pin_memory"])
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)

    storage: dict[MetadataIndex, _Stored] = {}
    if type(doc["storage_data"]) is not list:
        raise _bad("storage_data must be a list")
    keys_seen: dict[tuple[str, str], Any] = {}
    for i, it in enumerate(doc["storage_data"]):
        w = f"storage_data[{i}]"
        _want(it, {"fqn", "offset", "file", "key"}, w)
        fqn, off, file, key = it["fqn"], it["offset"], it["file"], it["key"]
        if type(fqn) is not str or fqn not in sdm:
            raise _bad(f"{w}: fqn {fqn!r:.200} is not in state_dict_metadata")
        if type(file) is not str or file not in files:
            raise _bad(f"{w}: file {file!r:.200} is not listed in files")
        if type(key) is not str:
            raise _bad(f"{w}: key {key!r:.200} is not a string")
        m = sdm[fqn]
        if isinstance(m, BytesStorageMetadata):
            if off is not None:
                raise _bad(f"{w}: a bytes item has no offset")
            idx = MetadataIndex(fqn)
        else:
            off = _int_list(off, f"{w}.offset", len(m.size))
            if not any(list(c.offsets) == off for c in m.chunks):
                raise _bad(f"{w}: offset {off} is not the offset of a chunk of {fqn!r:.200}")
            idx = MetadataIndex(fqn, off)
        if idx in storage:
            raise _bad(f"{w}: {fqn!r:.200} at {off} is stored twice")
        # one stored key may serve several items only when they are alike (a tensor tied under
        # two names, staged once by Writer.stage)
        what = "bytes" if off is None else \
            (m.properties.dtype, next(tuple(c.sizes) for c in m.chunks if list(c.offsets) == off))
        if keys_seen.setdefault((file, key), what) != what:
            raise _bad(f"{w}: key {key!r:.200} is used twice in {file} for items of different dtype or size")
        storage[idx] = _Stored(file=file, key=key, file_bytes=files[file])
    for fqn, m in sdm.items():  # every saved chunk / bytes item must be stored somewhere
        idxs = [MetadataIndex(fqn)] if isinstance(m, BytesStorageMetadata) else \
            [MetadataIndex(fqn, c.offsets) for c in m.chunks]
        for idx in idxs:
            if idx not in storage:
                raise _bad(f"{fqn!r:.200} at offset {idx.offset} has no storage_data entry")

    pd = doc["planner_data"]
    planner_data = None
    if pd is not None:
        if type(pd) is not dict:
            raise _bad("planner_data must be an object or null")
        planner_data = {}
        for k, path in pd.items():
            if k not in sdm or type(path) is not list or not path or len(path) > 256 or \
                    not all(type(x) is str or _is_int(x) for x in path):
                raise _bad(f"planner_data[{k!r:.200}] must be a non-empty list of str / int for a known fqn")
            if ".".join(map(str, path)) != k:  # (DCP's flattening names every item by its path)
                raise _bad(f"planner_data[{k!r:.200}]: the path does not spell the item's name")
            planner_data[k] = tuple(path)
        _check_object_paths(planner_data)

    sm = doc["storage_meta"]
    storage_meta = StorageMeta()
    if sm is not None:
        _want(sm, {"checkpoint_id", "save_id", "modules"}, "storage_meta")
        if not all(v is None or type(v) is str for v in (sm["checkpoint_id"], sm["save_id"])) or \
                type(sm["modules"]) is not list or not all(type(x) is str for x in sm["modules"]):
            raise _bad("storage_meta fields have wrong types")
        storage_meta = StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], modules=sm["modules"])
    md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                  storage_meta=storage_meta, version=doc["dcp_version"])
    return md, files


#: planner_data's list indices may imply at most this many list slots per item, plus a constant
#: (DCP fills a list up to its largest index with None: a forged index of 2**64 was a
#: MemoryError, or an unbounded allocation without a memory limit, in read_full / consolidate)
_SLOTS_PER_ITEM = 16
_SLOTS_EXTRA = 1024


def _check_object_paths(paths: dict[str, tuple]) -> None:
    """planner_data's object paths must form one tree as DCP's flattening makes it (a dict's keys
    are str, a list's indices int; the root is a dict), so that rebuilding the nested state dict
    (``read_full``, which DCP does with ``set_element``) meets no container of the wrong kind and
    allocates O(metadata) memory: no place is both a dict and a list, no item's place is another
    item's or inside it, and indices are non-negative and bounded in all (:data:`_SLOTS_PER_ITEM`).
    One walk of a trie (time linear in the paths' total length)."""
    root: list = [str, {}, False, -1]  # a place: [type of its keys, children, an item's?, largest index]
    slots = 0  # list slots the rebuilt state dict will hold (each list's largest index + 1)
    for fqn, path in paths.items():
        node = root
        for key in path:
            kind = type(key)
            if node[2]:
                raise _bad(f"planner_data[{fqn!r:.200}]: its place is inside another item's")
            if node[0] is None:
                node[0] = kind
            elif node[0] is not kind:
                raise _bad(f"planner_data[{fqn!r:.200}]: a place is used both as a dict and as a list"
                           if node is not root else f"planner_data[{fqn!r:.200}]: the state dict's own keys are str")
            if kind is int:
                if key < 0:
                    raise _bad(f"planner_data[{fqn!r:.200}]: a negative list index")
                if key > node[3]:
                    slots += key - node[3]
                    node[3] = key
                    if slots > _SLOTS_PER_ITEM * len(paths) + _SLOTS_EXTRA:
                        raise _bad("planner_data: list indices far beyond the number of items")
            node = node[1].setdefault(key, [None, {}, False, -1])
        if node[2] or node[1]:
            raise _bad(f"planner_data[{fqn!r:.200}]: its place is another item's, or holds other items")
        node[2] = True


def commit_marker(path: str) -> dict[str, Any]:
    """The checkpoint directory's ``COMMIT`` marker (``{"format", "format_version",
    "metadata_sha256", "save_id"}``), read within 64 KiB and parsed strictly; raises
    :class:`IncompleteCheckpointError` when it is missing or malformed."""
    marker = _read_bytes(_join(path, COMMIT_NAME), 1 << 16)
    if marker is None:
        raise IncompleteCheckpointError(
            f"{path}: no {COMMIT_NAME} marker: the checkpoint was not completed (a rank may have died mid-save)")
    doc = strict_json(marker, lambda m: IncompleteCheckpointError(f"{path}: {COMMIT_NAME} marker: {m}"))
    if type(doc) is not dict or doc.get("format") != FORMAT or type(doc.get("metadata_sha256")) is not str:
        raise IncompleteCheckpointError(f"{path}: {COMMIT_NAME} marker is malformed")
    return doc


def _check_commit(path: str, raw: bytes) -> None:
    doc = commit_marker(path)
    if doc["metadata_sha256"] != hashlib.sha256(raw).hexdigest():
        raise IncompleteCheckpointError(
            f"{path}: {COMMIT_NAME} marker does not match {METADATA_NAME} (a later save was interrupted)")


def read_metadata(path: str | os.PathLike, *, check_files: bool = True, max_bytes: int | None = None) -> Metadata:
    """Read, check and rebuild the DCP ``Metadata`` of a ckptzip DCP checkpoint directory.

    Raises :class:`IncompleteCheckpointError` without a valid commit marker or when a referenced
    file is missing / of another size, :class:`DCPMetadataError` for malformed metadata."""
    path = os.fspath(path)
    raw = _read_bytes(_join(path, METADATA_NAME), MAX_METADATA_BYTES)
    if raw is None:
        if _size(_join(path, COMMIT_NAME)) is None:
            raise not_a_checkpoint(path)
        raise IncompleteCheckpointError(f"{path}: {METADATA_NAME} is missing")
    _check_commit(path, raw)
    md, files = parse_metadata_json(raw, max_bytes)
    if check_files:
        for name, n in files.items():
            got = _size(_join(path, name))
            if got is None:
                raise IncompleteCheckpointError(f"{path}: rank file {name} is missing")
            if got != n:
                raise IncompleteCheckpointError(f"{path}: rank file {name} has {got} bytes, the metadata says {n}")
    return md


# -- writer ------------------------------------------------------------------------------------
def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes (views of larger storages are copied, so a rank file
    never holds a whole storage for a slice of it)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and \
            t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _tensor_id(t: torch.Tensor) -> tuple:
    """Identity of a tensor's bytes: the same storage region seen with the same geometry."""
    st = t.untyped_storage()
    return (st.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


def _local_tensors(obj: Any, path: str, out: list) -> Any:
    """A copy of ``obj``'s containers (dicts, lists, tuples) with non-tensor leaves deep-copied
    and tensors kept as they are; appends (path, local tensor) for every tensor (a DTensor's
    local shard, a ShardedTensor's local shards)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local") and hasattr(obj, "placements"):  # DTensor
            out.append((path, obj.to_local()))
        elif hasattr(obj, "local_shards"):  # ShardedTensor
            for i, sh in enumerate(obj.local_shards()):
                out.append((f"{path}#{i}", sh.tensor))
        else:
            out.append((path, obj))
        return obj
    if isinstance(obj, dict):
        new = {k: _local_tensors(v, f"{path}.{k}" if path else str(k), out) for k, v in obj.items()}
        if type(obj) is not dict:
            try:
                return type(obj)(new)
            except Exception:
                return new
        return new
    if isinstance(obj, list):
        return [_local_tensors(v, f"{path}.{i}" if path else str(i), out) for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(_local_tensors(v, f"{path}.{i}" if path else str(i), out) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


# save keywords that only the staging snapshot takes (ckptzip.asyncsave.snapshot), and those
# that only the write of a snapshot takes
_STAGE_ONLY = ("reuse_plan", "gpu_snapshot_bytes")
_WRITE_ONLY = ("fsync", "progress")


def _writer_options() -> set[str]:
    """The keyword arguments of :class:`Writer` that go to ckptzip.save (less those it sets itself)."""
    import inspect
    return (set(inspect.signature(ckptzip.save).parameters) - {"obj", "path", "codec", "portable", "base",
                                                                 "metadata"}) | set(_STAGE_ONLY)


class _Staged:
    """What :meth:`Writer.stage` took: the snapshot of this rank's tensors and the map from a
    tensor's identity to its key in the snapshot."""

    def __init__(self, snap: Any, keys: dict, sizes: dict, based_in: str | None = None) -> None:
        self.snap, self.keys, self.sizes = snap, keys, sizes
        self.based_in = based_in  # incremental: the directory its base record is relative to


class _PathId:
    """``checkpoint_id`` handling shared by Writer and Reader: the checkpoint directory (or URL)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class Writer(_PathId, StorageWriter):
    """DCP ``StorageWriter`` writing one ckptzip ``.ckz`` file per rank plus JSON metadata and a
    commit marker. ``codec``, ``portable`` and ``save_kwargs`` go to :func:`ckptzip.save`.

    Also DCP's ``AsyncStager``: ``dcp.async_save(state, storage_writer=Writer(p))`` (no
    ``async_stager``) calls :meth:`stage`, which compresses this rank's tensors now (on the GPU
    where they live, into a pooled snapshot; on the CPU a copy into a pooled host arena), so the
    training step waits for the compression, not for a copy of the state to host memory. The
    save then writes the snapshot and never reads the caller's tensors. ``save_kwargs`` may also
    hold ``gpu_snapshot_bytes`` and ``reuse_plan`` (see :func:`ckptzip.asyncsave.snapshot`).

    ``base`` (a local directory: a committed checkpoint of this writer, default None): an
    incremental save. Each rank's tensor file ``__<r>_0.ckz`` is stored against the file of the
    same name in ``base`` (format 1.1 ``delta``/``xor`` per storage where that is smaller, see
    :func:`ckptzip.save`), recording it by relative path and content hash; a rank whose file is
    missing there saves in full. Tensors pair by key, so the base must come from the same save
    mode (``dcp.save`` or ``dcp.async_save``) and sharding; loading needs the base directory next
    to this one (a missing or altered base is a :class:`~ckptzip.BaseCheckpointError` naming it).
    With ``dcp.async_save`` the rank is taken from ``process_group`` (default: the default group;
    pass the group given to ``dcp.async_save``), and the writer must
    already have the checkpoint's path when the call stages (``Writer(path)`` or
    ``writer.reset(path)``: DCP applies ``checkpoint_id`` only after staging; a mismatch fails the
    save). Attribute ``base`` may be changed between saves of one writer."""

    # AsyncStager protocol: stage() is synchronous, nothing to synchronize after it.
    _synchronize_after_execute: bool = False

    def __init__(self, path: str | os.PathLike, *, codec: str | dict = "auto", portable: bool = False,
                 base: str | os.PathLike | None = None, process_group: Any = None, **save_kwargs: Any) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.base = base
        self.process_group = process_group  # the group DCP numbers rank files by (staging's base file)
        self.codec = codec
        self.portable = portable
        known = _writer_options()
        unknown = sorted(set(save_kwargs) - known)
        if unknown:  # (else a typo surfaced only inside dcp.save, wrapped in DCP's CheckpointException)
            raise TypeError(f"ckptzip.dcp.Writer() got unexpected keyword argument(s) {unknown}; it takes "
                            f"{sorted(known)} besides codec, portable, base and process_group"
                            + (" (metadata is the Writer's own: each rank file records its rank)"
                               if "metadata" in unknown else ""))
        self.stage_kwargs = {k: save_kwargs.pop(k) for k in _STAGE_ONLY if k in save_kwargs}
        self.save_kwargs = save_kwargs
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self._staged: _Staged | None = None
        self._dropped = False       # a stage() dropped an unwritten snapshot: its save must fail
        self._arena = None          # pooled host arena of the snapshots, reused across saves
        self._lock = threading.Lock()

    # -- AsyncStager --------------------------------------------------------------------------
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Snapshot (compress, on the GPU where the tensors are) every tensor of this rank's
        ``state_dict`` and return a copy of its containers (tensors kept, other leaves
        deep-copied) for DCP to plan the save with. The following ``write_data`` of this writer
        writes the snapshot. One ``dcp.async_save`` per writer in flight at a time: wait for the
        previous save's future first (a snapshot not yet written raises ``RuntimeError`` here and
        is dropped)."""
        from ckptzip.asyncsave import Arena, snapshot
        with self._lock:
            stale, self._staged = self._staged, None
        if stale is not None:
            self._arena = None  # it may still be in use by a save that has not written it
            with self._lock:
                self._dropped = True  # that save's write_data must fail, never write live tensors
            raise RuntimeError("ckptzip.dcp.Writer.stage: the previous dcp.async_save with this writer has not "
                               "written its data yet (still running, or it failed before writing): wait for its "
                               "future before the next save; the stale snapshot was dropped")
        found: list = []
        staged_sd = _local_tensors(state_dict, "", found)
        obj: dict[str, torch.Tensor] = {}
        keys: dict[tuple, str] = {}
        sizes: dict[str, int] = {}
        for path, t in found:
            tid = _tensor_id(t)
            if tid in keys:
                continue
            name = f"{path}@s{len(obj)}"
            keys[tid] = name
            obj[name] = _own(t)
            sizes[name] = t.numel() * t.element_size()
        if self._arena is None:
            self._arena = Arena()
        kw = {k: v for k, v in self.save_kwargs.items() if k not in _WRITE_ONLY}
        name = f"__{_group_rank(self.process_group)}_0.ckz"  # DCP numbers rank files by group rank
        target = _join(self.path, name)
        snap, based = self._against_base(name, lambda base: snapshot(
            obj, codec=self.codec, portable=self.portable, arena=self._arena,
            metadata={"ckptzip.dcp": "rank file (staged)"}, base=base, target=target if base else None,
            **kw, **self.stage_kwargs))
        with self._lock:
            self._staged = _Staged(snap, keys, sizes, _abs_dir(self.path) if based else None)
        return staged_sd

    def _against_base(self, name: str, run: Callable[[str | None], Any]) -> tuple[Any, bool]:
        """``(run(base), True)`` with this rank's base file ``name`` in an incremental save;
        ``(run(None), False)`` when there is none or it cannot be used (missing, damaged,
        unreadable): this rank then saves in full, its file saying so (an error raised on one
        rank here would leave the others waiting in DCP's collectives)."""
        try:
            base = self._base_file(name)
            if base is not None:
                return run(base), True
        except (CkptzipError, OSError):
            pass
        return run(None), False

    def _base_file(self, name: str) -> str | None:
        """The base of this rank's file ``name`` in an incremental save (``base`` set): the file
        of that name in the base directory, which must be a committed local checkpoint; None
        when there is no base or the base has no such file (this rank saves in full)."""
        if self.base is None:
            return None
        base = os.fspath(self.base)
        if is_url(base) or is_url(self.path):
            raise ValueError("ckptzip.dcp.Writer(base=...): incremental saves need local directories")
        read_metadata(base, check_files=False, max_bytes=NO_BYTES_LIMIT)  # committed, or a named error (the file itself is
        # checked by size and manifest hash when it is read as the base)
        p = os.path.join(local_path(base), name)
        return p if os.path.isfile(p) else None

    def synchronize_staging(self) -> None:
        """Nothing to do: :meth:`stage` returns once the snapshot is taken."""

    def close(self) -> None:
        """Drop a snapshot not written and the pooled host arena."""
        with self._lock:
            self._staged = None
            self._arena = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        if kwargs.get("use_collectives", True) is False:
            raise NotImplementedError("ckptzip.dcp.Writer needs use_collectives=True (the coordinator writes "
                                      "the global metadata and the commit marker)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        _mkdir(self.path)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Coordinator only, before any rank writes: un-commit what this directory held before, so
        # an interrupted overwrite can never look complete.
        _remove(_join(self.path, COMMIT_NAME))
        _remove(_join(self.path, METADATA_NAME))
        return [replace(p, storage_data={"ckptzip_file": f"__{i}_0.ckz", "ckptzip_file_1": f"__{i}_1.ckz"})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self._lock:
            staged, self._staged = self._staged, None
            dropped, self._dropped = self._dropped, False
        if dropped and staged is None:
            raise RuntimeError("ckptzip.dcp.Writer: the snapshot staged for this save was dropped by a later "
                               "stage() (a second dcp.async_save with the same writer before this one wrote); "
                               "not writing the live tensors in its place: this save fails, nothing is committed")
        fut: Future = Future()
        if staged is not None:
            fut.set_result(self._write_staged(plan, planner, staged))
            return fut
        if not plan.items:
            fut.set_result([])
            return fut
        name = plan.storage_data["ckptzip_file"]
        if not _FILE_RE.match(name):
            raise ValueError(f"bad rank file name {name!r}")
        obj: dict[str, torch.Tensor] = {}
        sizes: dict[str, int] = {}
        keys: dict[str, Any] = {}
        for item in plan.items:
            key = item_key(item.index)
            if key in obj:
                raise ValueError(f"ckptzip.dcp: two write items map to the key {key!r}")
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):
                raw = data.getvalue()
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            elif isinstance(data, torch.Tensor):
                t = _own(data)
            else:
                raise TypeError(f"ckptzip.dcp: resolve_data gave {type(data).__name__} for {item.index.fqn!r}")
            obj[key] = t
            sizes[key] = t.numel() * t.element_size()
            keys[key] = item.index
        summary, _ = self._against_base(name, lambda base: ckptzip.save(
            obj, _join(self.path, name), codec=self.codec, portable=self.portable,
            metadata={"ckptzip.dcp": "rank file", "rank": str(self.rank)}, base=base, **self.save_kwargs))
        nbytes = int(summary["stored_bytes"])
        results = [WriteResult(index=keys[k], size_in_bytes=sizes[k], storage_data=_Stored(name, k, nbytes))
                   for k in obj]
        fut.set_result(results)
        return fut

    def _write_staged(self, plan: SavePlan, planner: SavePlanner, staged: _Staged) -> list[WriteResult]:
        """write_data after :meth:`stage`: the snapshot goes to ``__{i}_0.ckz`` as it is (tensor
        items map to its keys by tensor identity; the caller's tensors are never read); bytes
        items (made now from the deep-copied leaves of the staged state dict) go to
        ``__{i}_1.ckz``."""
        name0 = plan.storage_data["ckptzip_file"]
        name1 = plan.storage_data.get("ckptzip_file_1") or name0.replace("_0.ckz", "_1.ckz")
        for n in (name0, name1):
            if not _FILE_RE.match(n):
                raise ValueError(f"bad rank file name {n!r}")
        wkw = {k: v for k, v in self.save_kwargs.items() if k in _WRITE_ONLY}
        if staged.based_in is not None and staged.based_in != _abs_dir(self.path):
            raise ValueError(f"ckptzip.dcp.Writer: the incremental snapshot was staged for {staged.based_in} but "
                             f"is being written to {self.path} (its base is recorded relative to the first): give "
                             "the checkpoint path to the writer (Writer(path) or writer.reset(path)) before "
                             "dcp.async_save, which applies checkpoint_id only after staging")
        tensor_items: list = []
        extra: dict[str, torch.Tensor] = {}
        extra_items: list = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):
                raw = data.getvalue()
                key = item_key(item.index)
                if key in extra:
                    raise ValueError(f"ckptzip.dcp: two write items map to the key {key!r}")
                extra[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
                    torch.empty(0, dtype=torch.uint8)
                extra_items.append((item.index, key, len(raw)))
            elif isinstance(data, torch.Tensor):
                key = staged.keys.get(_tensor_id(data))
                if key is None:
                    raise RuntimeError(f"ckptzip.dcp: {item.index.fqn!r} was not in the state dict given to "
                                       "Writer.stage (a planner that makes new tensors cannot be used with "
                                       "the writer's staging; pass another async_stager)")
                tensor_items.append((item.index, key, data.numel() * data.element_size()))
            else:
                raise TypeError(f"ckptzip.dcp: resolve_data gave {type(data).__name__} for {item.index.fqn!r}")
        results: list[WriteResult] = []
        if tensor_items:
            n0 = int(staged.snap.write(_join(self.path, name0), **wkw)["stored_bytes"])
            results += [WriteResult(index=idx, size_in_bytes=n, storage_data=_Stored(name0, k, n0))
                        for idx, k, n in tensor_items]
        if extra:
            n1 = int(ckptzip.save(extra, _join(self.path, name1), codec=self.codec, portable=self.portable,
                                  metadata={"ckptzip.dcp": "rank file", "rank": str(self.rank)},
                                  **self.save_kwargs)["stored_bytes"])
            results += [WriteResult(index=idx, size_in_bytes=n, storage_data=_Stored(name1, k, n1))
                        for idx, k, n in extra_items]
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # Runs on the coordinator after DCP gathered every rank's write results: every rank file
        # is complete and durable (ckptzip.save fsyncs before it returns). Metadata first, then
        # the commit marker, each atomically.
        storage: dict[MetadataIndex, _Stored] = {}
        files: dict[str, int] = {}
        for rank_results in results:
            for wr in rank_results:
                s = wr.storage_data
                storage[wr.index] = s
                files[s.file] = s.file_bytes
        doc = _metadata_to_json(metadata, storage, self.storage_meta(), files)
        raw = json.dumps(doc, separators=(",", ":"), sort_keys=False).encode("utf-8")
        # never commit something the reader would refuse (beyond the size bound, which a reader
        # lifts with max_bytes for a state that compresses more than 4096 x)
        parse_metadata_json(raw, max_bytes=NO_BYTES_LIMIT)
        _write_atomic(_join(self.path, METADATA_NAME), raw)
        marker = {"format": FORMAT, "format_version": FORMAT_VERSION,
                  "metadata_sha256": hashlib.sha256(raw).hexdigest(), "save_id": self.save_id}
        _write_atomic(_join(self.path, COMMIT_NAME), json.dumps(marker).encode("utf-8"))
        metadata.version = DCP_VERSION
        metadata.storage_data = storage


# -- reader ------------------------------------------------------------------------------------
def _abs_dir(path: str | os.PathLike) -> str:
    return os.path.abspath(local_path(os.fspath(path)))


def _group_rank(group: Any = None) -> int:
    import torch.distributed as dist
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _narrow(t: torch.Tensor, offsets, lengths, what: str) -> torch.Tensor:
    if len(offsets) != t.dim() or len(lengths) != t.dim():
        raise DCPMetadataError(f"{what}: request of {len(offsets)} dims for a stored chunk of {t.dim()}")
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o < 0 or n < 0 or o + n > t.shape[d]:
            raise DCPMetadataError(f"{what}: request [{o}, {o + n}) outside dim {d} of size {t.shape[d]}")
        t = t.narrow(d, o, n)
    return t


def _safe_bytes(raw: bytes, what: str) -> io.BytesIO:
    """Bytes items are torch.save payloads that DCP's DefaultLoadPlanner.load_bytes reads with
    ``torch.load(weights_only=False)``. Without allow_pickle we first load them with
    ``weights_only=True`` (PyTorch's restricted unpickler: no arbitrary globals), then hand the
    planner a fresh torch.save of the result, so the planner never sees the original pickle."""
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise PickleNotAllowedError(
            f"{what}: this bytes item needs full unpickling ({type(e).__name__}: {str(e)[:300]}); "
            "pass Reader(..., allow_pickle=True) if you trust the checkpoint") from None
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


class Reader(_PathId, StorageReader):
    """DCP ``StorageReader`` for checkpoints written by :class:`Writer`. Never unpickles the
    metadata; bytes items are loaded through ``torch.load(weights_only=True)`` unless
    ``allow_pickle=True``. ``cache_bytes`` (default 0): decoded chunks kept beyond the one being
    served (read items are served chunk by chunk, so more only helps an unusual planner); the
    memory a load adds on the target's device is then one decoded chunk plus the engine's
    decode window. ``max_bytes``: the most tensor bytes the metadata may declare (default: what
    the rank files may hold, ``max(1 GiB, 4096 x size)`` each, summed; more is a
    :class:`~ckptzip.ResourceLimitError`)."""

    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False, cache_bytes: int = 0,
                 max_bytes: int | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.allow_pickle = allow_pickle
        self.max_bytes = max_bytes
        self.cache_bytes = cache_bytes
        self.storage_data: dict[MetadataIndex, _Stored] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self) -> Metadata:  # no **kwargs: no fallback to per-rank metadata
        md = read_metadata(self.path, max_bytes=self.max_bytes)
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise DCPMetadataError("metadata has no ckptzip storage_data")
        self.storage_data = metadata.storage_data
        # what each stored chunk must be: (sizes, dtype), checked against the decoded tensor
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        for fqn, m in metadata.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                for c in m.chunks:
                    self._chunks[MetadataIndex(fqn, c.offsets)] = (torch.Size(c.sizes), m.properties.dtype)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = collections.defaultdict(list)
        for req in plan.items:
            s = self.storage_data.get(req.storage_index)
            if s is None:
                raise DCPMetadataError(f"no stored item for {req.storage_index}")
            per_file[s.file].append((s.key, req))
        for name, reqs in per_file.items():
            self._read_file(name, reqs, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, name: str, reqs: list, planner: LoadPlanner) -> None:
        path = _join(self.path, name)
        readers: dict[str, Any] = {}  # device -> CheckpointReader
        cache: collections.OrderedDict[tuple[str, str], torch.Tensor] = collections.OrderedDict()
        cached = 0

        def opened(device: torch.device):
            ent = readers.get(str(device))
            if ent is None:
                ent = readers[str(device)] = ckptzip.open(path, map_location=device)
                if ent.metadata.get("ckptzip.lossy") == "1":  # not a rank file of ours: never resume from it
                    from .lossy.errors import LossyCheckpointError
                    ent.close()
                    raise LossyCheckpointError(f"{path} is a lossy weights-only export, not a rank file")
            return ent

        def fetch(key: str, device: torch.device) -> torch.Tensor:
            nonlocal cached
            ck = (key, str(device))
            if ck in cache:
                cache.move_to_end(ck)
                return cache[ck]
            while cache and cached > self.cache_bytes:  # drop before decoding the next chunk
                _, old = cache.popitem(last=False)
                cached -= old.numel() * old.element_size()
            ent = opened(device)
            try:
                t = ent.get_tensor(key, keep=False)
            except KeyError:
                raise DCPMetadataError(f"{path}: holds no item {key!r}") from None
            if not isinstance(t, torch.Tensor):
                raise DCPMetadataError(f"{path}: item {key!r} is not a tensor")
            cache[ck] = t
            cached += t.numel() * t.element_size()
            return t

        try:
            # serve the items in the file's order (read items of one stored chunk in a row): each
            # read then asks the kernel for the bytes that come next (a cold disk keeps reading
            # while this chunk is decoded)
            ent = opened(torch.device("cpu"))
            where = {t["key"]: t["storage"] for t in ent.tensor_info() if isinstance(t["storage"], int)}
            reqs.sort(key=lambda kr: (where.get(kr[0], len(where)), kr[0]))
            # a read item that is a whole stored chunk (no resharding) is decoded straight into
            # its target, all of them in one pipelined pass; the rest chunk by chunk
            whole: dict[str, tuple[Any, torch.Tensor]] = {}
            rest: list[tuple[str, Any, torch.Tensor | None]] = []
            for key, req in reqs:
                want = self._chunks.get(req.storage_index)
                if (req.type != LoadItemType.BYTE_IO and want is not None and key not in whole
                        and not any(req.storage_offsets) and tuple(req.lengths) == tuple(want[0])):
                    target = planner.resolve_tensor(req).detach()
                    if target.dtype == want[1] and target.size() == want[0]:
                        whole[key] = (req, target)
                    else:
                        rest.append((key, req, target))
                else:
                    rest.append((key, req, None))
            filled = set(ent.read_into({k: t for k, (_r, t) in whole.items()})) if whole else set()
            for key, (req, target) in whole.items():
                if key in filled:
                    planner.commit_tensor(req, target)
                else:
                    rest.append((key, req, target))
            rest.sort(key=lambda kr: (where.get(kr[0], len(where)), kr[0]))
            for key, req, target in rest:
                what = f"{name}:{key}"
                if req.type == LoadItemType.BYTE_IO:
                    t = fetch(key, torch.device("cpu"))
                    if t.dtype != torch.uint8 or t.dim() != 1:
                        raise DCPMetadataError(f"{what}: a bytes item must be a 1-d uint8 tensor")
                    raw = t.numpy().tobytes()
                    buf = io.BytesIO(raw) if self.allow_pickle else _safe_bytes(raw, what)
                    planner.load_bytes(req, buf)
                    continue
                if target is None:
                    target = planner.resolve_tensor(req).detach()
                src = fetch(key, target.device)
                want = self._chunks.get(req.storage_index)
                if want is None:
                    raise DCPMetadataError(f"{what}: {req.storage_index} is not a chunk of the metadata")
                if src.shape != want[0] or src.dtype != want[1]:
                    raise DCPMetadataError(f"{what}: stored chunk is {src.dtype} {tuple(src.shape)}, the metadata "
                                           f"says {want[1]} {tuple(want[0])}")
                src = _narrow(src, req.storage_offsets, req.lengths, what)
                if target.size() != src.size():
                    raise DCPMetadataError(f"{what}: stored region {tuple(src.size())} does not fit the target "
                                           f"{tuple(target.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
        finally:
            cache.clear()
            for ent in readers.values():
                ent.close()


# -- consolidation -------------------------------------------------------------------------------
def output_inside(path: str | os.PathLike, out_path: str | os.PathLike) -> bool:
    """Whether the local file ``out_path`` would land inside the local checkpoint directory
    ``path`` (any spelling, links resolved), where it could replace a rank file or the marker."""
    path, out_path = os.fspath(path), os.fspath(out_path)
    if is_url(path) or is_url(out_path):
        return False
    src = os.path.realpath(path)
    return os.path.commonpath([src, os.path.realpath(os.path.dirname(os.path.abspath(out_path)))]) == src


def read_full(path: str | os.PathLike, **reader_kwargs: Any) -> dict[str, Any]:
    """The whole, unsharded state dict of the DCP checkpoint in ``path`` (written by
    :class:`Writer`), read in this process (no process group needed), nested as it was saved.
    Errors are ckptzip's own (e.g. :class:`~ckptzip.BaseCheckpointError`), not DCP's wrapper.
    ``reader_kwargs`` go to :class:`Reader`."""
    # As torch's own format_utils.dcp_to_torch_save does (dcp.load keeps only the keys of the
    # state dict it is given, so the empty-state-dict planner goes through _load_state_dict).
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=Reader(path, **reader_kwargs),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:  # one process: raise its error itself (e.g. a missing base)
        first = next(iter(getattr(e, "failures", {}).values()), None)
        first = first[0] if isinstance(first, tuple) else first
        if not isinstance(first, CkptzipError):
            # DCP >= 2.13 reports a reader's refused metadata as its own AssertionError
            # ("metadata is None"), with ckptzip's error only in the message: raise that error
            read_metadata(path, max_bytes=reader_kwargs.get("max_bytes"))
        if isinstance(first, Exception):
            raise first from None
        raise
    return sd


def consolidate(path: str | os.PathLike, out_path: str | os.PathLike, *, allow_pickle: bool = False,
                **save_kwargs: Any) -> dict[str, Any]:
    """Read the DCP checkpoint in ``path`` (written by :class:`Writer`) in this process (no process
    group needed, :func:`read_full`) and write ONE .ckz file with the full, unsharded state dict,
    nested as it was saved (e.g. ``{"model": {...}, "optim": {...}}``), which :func:`ckptzip.load`
    reads without torch.distributed. Holds the whole state in host memory. Returns
    :func:`ckptzip.save`'s summary."""
    if output_inside(path, out_path):
        raise ValueError(f"consolidate: the output {os.fspath(out_path)!r} is inside the checkpoint directory "
                         f"{os.fspath(path)!r} (it could replace one of its files); write it elsewhere")
    return ckptzip.save(read_full(path, allow_pickle=allow_pickle), out_path, **save_kwargs)

