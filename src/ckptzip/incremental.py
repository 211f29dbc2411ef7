"""Incremental checkpoints (format 1.1): the base record, finding a base on load, and matching a new
state's storages with its base's storages at save time.

A file saved with ``base=`` records ``bases: [{"file", "sha256", "size", "depth"}]``: the base's
path relative to the new file's directory ('/'-separated), the SHA-256 of the base's manifest
bytes (the ``L`` bytes the footer locates: the JSON document *and* the chunk table with the
XXH3-64 of every chunk), the base's file size, and the chain depth (1 for a standalone base).
Hashing the manifest instead of the whole file costs microseconds instead of a full read, and
binds the data as well as a whole-file hash does against accidental change: any change of a
chunk's bytes either changes its table checksum (then the manifest, hence the SHA-256, differs)
or leaves a chunk that fails its XXH3 check when it is read (ChecksumError). Only a deliberate
XXH3 collision could slip through, and an attacker who can write the base can as well rewrite
the incremental file itself.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Any

import numpy as np
import torch

from .errors import BaseCheckpointError, CorruptFileError
from .storage import is_url
from .transforms.refs import Delta, HiDelta, Xor
from .tree import StorageRef, tensor_keys
from .validate import MAX_CHAIN, located_chain


def manifest_sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def record_for(base_reader: Any, base_path: str, target: Any) -> dict[str, Any]:
    """The ``bases`` record of a file written at ``target`` against ``base_reader``."""
    if base_reader.metadata.get("ckptzip.lossy") == "1":
        from .lossy.errors import LossyCheckpointError
        raise LossyCheckpointError(f"{base_path} is a lossy weights-only export and cannot be the base "
                                   f"of a checkpoint; use a lossless checkpoint")
    if not isinstance(target, (str, os.PathLike)) or is_url(os.fspath(target)) or is_url(base_path):
        raise ValueError("incremental saves (base=) need local paths for the file and its base")
    if os.path.abspath(os.fspath(target)) == os.path.abspath(base_path):
        raise ValueError(f"a checkpoint cannot be its own base ({base_path}); save to a new path")
    tdir = os.path.dirname(os.path.abspath(os.fspath(target)))
    rel = os.path.relpath(os.path.abspath(base_path), tdir).replace(os.sep, "/")
    depth = 1 + (base_reader.bases[0]["depth"] if base_reader.bases else 0)
    if depth > MAX_CHAIN:
        raise BaseCheckpointError(f"base {base_path} is already at the end of a chain of "
                                  f"{depth - 1} bases; at most {MAX_CHAIN} are followed: save a full "
                                  f"checkpoint (no base=)")
    return {"file": rel, "sha256": base_reader.manifest_sha256, "size": base_reader.file_size,
            "depth": depth}


def add_hints(record: dict[str, Any], base_storages: list[dict[str, Any]], used: Any) -> None:
    """Copy into ``record`` (format 1.3 ``storages`` / ``chains``) where base storages ``used``
    are in the base and how they are coded, for those whose chain refers to no other storage (at
    most ``byteplane``; 1.4: also ``expgrid`` first): a reader then plans their decoding from
    this file alone, without parsing the base's document (its size and manifest SHA-256 are
    still checked)."""
    index: dict[str, int] = {}
    chains: list[dict[str, Any]] = []
    rows = []
    for j in sorted(set(used)):
        s = base_storages[j]
        if not locatable(s):
            continue
        cfg = {"transforms": s.get("transforms", []), "codec": s["codec"]}
        k = index.setdefault(repr(cfg), len(chains))
        if k == len(chains):
            chains.append(cfg)
        rows.append([j, s["rows"][0], s["rows"][1], k])
    if rows:
        record["storages"] = rows
        record["chains"] = chains


def base_location(path: str, record: dict[str, Any], base_dir: Any = None,
                  base_path: Any = None) -> str:
    """Where to look for the base a file at ``path`` records: ``base_path`` when given; else the
    recorded relative path next to the file; else, when that does not exist and ``base_dir`` is
    given, the recorded file name in ``base_dir``."""
    if base_path is not None:
        return os.fspath(base_path)
    rel = record["file"]
    if is_url(path):
        here = posixpath.join(posixpath.dirname(path), rel)
    else:
        here = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), *rel.split("/")))
    if base_dir is not None and (is_url(here) or not os.path.exists(here)):
        d = os.fspath(base_dir)
        name = rel.rsplit("/", 1)[-1]
        return posixpath.join(d, name) if is_url(d) else os.path.join(d, name)
    return here


def open_base(reader: Any, base_dir: Any, base_path: Any) -> Any:
    """The reader of ``reader``'s base, checked against its record (size, manifest SHA-256, depth)."""
    from .api import CheckpointReader
    rec = reader.bases[0]
    where = base_location(reader.path, rec, base_dir, base_path)
    depth = getattr(reader, "_depth", 0) + 1
    if depth > MAX_CHAIN:
        raise BaseCheckpointError(f"chain of bases deeper than {MAX_CHAIN} at {reader.path}")
    what = f"base checkpoint {rec['file']!r} of {reader.path} (looked for at {where})"
    try:
        base = CheckpointReader(where, base_dir=base_dir, _depth=depth, max_bytes=reader._max_bytes,
                                decode_device=reader.decode_device)  # (one decode pass with the file's own)
    except FileNotFoundError:
        raise BaseCheckpointError(f"{what} is missing; pass base_dir= or base_path= if it moved") from None
    except BaseCheckpointError:
        raise
    except Exception as e:
        raise BaseCheckpointError(f"{what} cannot be read: {type(e).__name__}: {e}") from None
    if base.file_size != rec["size"] or base.manifest_sha256 != rec["sha256"]:
        base.close()
        raise BaseCheckpointError(f"{what} was altered or replaced: its size/manifest SHA-256 "
                                  f"({base.file_size}, {base.manifest_sha256[:16]}...) differ from the "
                                  f"record ({rec['size']}, {rec['sha256'][:16]}...)")
    got = 1 + (base.bases[0]["depth"] if base.bases else 0)
    if got != rec["depth"]:
        base.close()
        raise BaseCheckpointError(f"{what} has chain depth {got}, the record says {rec['depth']}")
    return base


class BaseFile:
    """A base checkpoint opened for the storages its incremental file's record locates (format
    1.3 ``storages`` / ``chains``): header, footer, manifest bytes (their XXH3-64, and size and
    SHA-256 against the record) and chunk table are read and checked; the document is not parsed
    (on the H100 that saves the 14 ms a manifest of a thousand storages takes)."""

    def __init__(self, where: str, record: dict[str, Any], what: str, parsed: list | None = None) -> None:
        import struct
        from .format import ROW, check_rows, checksum, table_start
        from .io.reader import read_manifest
        from .storage import local_path, open_regular
        try:
            self.fd = open_regular(local_path(where))
        except FileNotFoundError:
            raise BaseCheckpointError(f"{what} is missing; pass base_dir= or base_path= if it moved") from None
        except OSError as e:
            raise BaseCheckpointError(f"{what} cannot be read: {type(e).__name__}: {e}") from None
        try:
            size = os.fstat(self.fd).st_size
            if size != record["size"]:
                raise BaseCheckpointError(f"{what} was altered or replaced: its size ({size}) differs from the "
                                          f"record ({record['size']})")
            raw, off, digest = read_manifest(self.fd, size)
            if checksum(raw) != digest or manifest_sha256(raw) != record["sha256"]:
                raise BaseCheckpointError(f"{what} was altered or replaced: its manifest differs from the "
                                          f"record (SHA-256 {record['sha256'][:16]}...)")
            (jlen,) = struct.unpack_from("<I", raw)
            tstart = table_start(jlen)
            if tstart > len(raw) or (len(raw) - tstart) % ROW.itemsize:
                raise CorruptFileError("chunk table size")
            self.rows = np.frombuffer(bytes(raw[tstart:]), dtype=ROW)
            check_rows(self.rows, off)
            self._ends = np.concatenate([[0], np.cumsum(self.rows["raw"].astype(np.int64))])
        except BaseException as e:
            os.close(self.fd)
            if isinstance(e, (BaseCheckpointError, KeyboardInterrupt, SystemExit, MemoryError)):
                raise
            raise BaseCheckpointError(f"{what} cannot be read: {type(e).__name__}: {e}") from None
        self.hints = {r[0]: r for r in record["storages"]}
        self.chains = record["chains"]
        # one parsed-chain list per chain (engine.storage_chain caches by its identity): those
        # the record's validation parsed (``parsed``: Manifest.base_chains), else parsed on use
        self.parsed = (parsed if parsed is not None and len(parsed) == len(self.chains)
                       else [[(cfg, None) for cfg in c["transforms"]] for c in self.chains])

    def storage(self, j: int, nbytes: int) -> tuple[np.ndarray, dict[str, Any], list] | None:
        """``(chunk rows, storage record, parsed chain)`` of base storage ``j`` of ``nbytes``
        bytes as the record locates it (rows checked: in the table, adding up to ``nbytes``), or
        None when the record does not locate it."""
        h = self.hints.get(j)
        if h is None:
            return None
        _j, first, count, k = h
        if first + count > len(self.rows):
            raise CorruptFileError(f"base storage {j}: rows {first}+{count} beyond the base's chunk table")
        if int(self._ends[first + count] - self._ends[first]) != nbytes:
            raise CorruptFileError(f"base storage {j}: its chunks do not add up to {nbytes} bytes")
        c = self.chains[k]
        return (self.rows[first:first + count], {"nbytes": nbytes, "transforms": c["transforms"], "codec": c["codec"]},
                self.parsed[k])

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_base_file(reader: Any, base_dir: Any, base_path: Any) -> BaseFile | None:
    """:class:`BaseFile` of ``reader``'s base where its record locates storages and the base is
    a local file; else None (the caller opens it with :func:`open_base`)."""
    rec = reader.bases[0]
    if "storages" not in rec or getattr(reader, "_remote", False):
        return None
    where = base_location(reader.path, rec, base_dir, base_path)
    if is_url(where):
        return None
    return BaseFile(where, rec, f"base checkpoint {rec['file']!r} of {reader.path} (looked for at {where})",
                    getattr(reader.manifest, "base_chains", None))


def xor_pairs(root: Any, refs: list[StorageRef], base_reader: Any) -> dict[int, int]:
    """New storage index -> base storage index, matched by the key (tree path) of the first
    tensor that owns each storage, with the same byte count, element type and tensor dtype."""
    new_keys, _ = tensor_keys(root)
    old_keys, _ = tensor_keys(base_reader.manifest.doc["root"])
    bst = base_reader.storages
    pairs: dict[int, int] = {}
    for key, node in new_keys.items():
        i = node.get("s")
        if i in pairs or node.get("t") != "tensor":
            continue
        old = old_keys.get(key)
        if old is None or old.get("t") != "tensor" or old.get("dtype") != node.get("dtype"):
            continue
        j = old["s"]
        if bst[j]["nbytes"] == refs[i].data.numel() and bst[j].get("elem") == refs[i].elem and refs[i].data.numel():
            pairs[i] = j
    return pairs


def delta_candidates(root: Any, refs: list[StorageRef], base_reader: Any, skip: set) -> dict[int, Any]:
    """Bound reference transforms for every storage with a matching base storage (``delta`` for
    floats of 2, 4 or 8 bytes, ``xor`` for anything else): the base storages
    are decoded (pipelined, one pass) onto the device of the storage they are compared with."""
    pairs = {i: j for i, j in xor_pairs(root, refs, base_reader).items() if i not in skip}
    bst = base_reader.storages
    # a load reads the base's document (and plans the base's decoding) for any base storage
    # the file's record cannot locate (add_hints: those whose chain refers to another storage of
    # the base, e.g. expref, derived): 31 ms of a 126 ms load of the H100 benchmark GPT. Pairs
    # with such base storages are dropped (stored standalone); only where the base is itself a
    # delta against its own base is its document read anyway (a chain): then all are kept.
    odd = {i for i, j in pairs.items() if not locatable(bst[j])}
    if odd and not any(against_base(bst[j]) for j in pairs.values()):
        pairs = {i: j for i, j in pairs.items() if i not in odd}
    outs: dict[int, torch.Tensor] = {}
    for i, j in pairs.items():
        if j not in outs:
            outs[j] = torch.empty(refs[i].data.numel(), dtype=torch.uint8, device=refs[i].data.device)
    base_reader._check_budget(sum(t.numel() for t in outs.values()), "the base checkpoint")
    base_reader._fill(outs)
    res = {}
    for i, j in pairs.items():
        t = outs[j]
        if t.device != refs[i].data.device:
            t = t.to(refs[i].data.device)
        w = refs[i].float_width
        if w == 4 and refs[i].data.numel() % 4 == 0 and plain_planes(bst[j], 4):
            rt = HiDelta(0, j)  # (a load then reads 3 of the base storage's 4 planes)
        elif w and refs[i].data.numel() % w == 0:
            rt = Delta(0, j, w)
        else:
            rt = Xor(0, j)
        res[i] = rt.bind(t)
    return res


def locatable(storage: dict[str, Any]) -> bool:
    """Whether a base storage record's chain is one a file's base record can carry (one that
    refers to no other storage: at most ``expgrid`` then ``byteplane``; see :func:`add_hints`), and
    that has chunks of its own (not a packed storage, format 1.5)."""
    return "in" not in storage and located_chain(storage.get("transforms", []))


def against_base(storage: dict[str, Any]) -> bool:
    """Whether a (validated) storage record is stored against its file's own base."""
    tfs = storage.get("transforms", [])
    return bool(tfs) and isinstance(tfs[0].get("ref"), dict) and "base" in tfs[0]["ref"]


def plain_planes(storage: dict[str, Any], width: int) -> bool:
    """Whether a (validated) storage record is stored as ``byteplane`` of ``width`` alone."""
    tfs = storage.get("transforms", [])
    return len(tfs) == 1 and tfs[0].get("id") == "byteplane" and tfs[0].get("width") == width


def chain(path: Any, base_dir: Any = None) -> list[str]:
    """Paths of ``path``'s bases, nearest first (empty for a standalone file), each opened and
    checked against its record; raises :class:`BaseCheckpointError` for a missing or altered one."""
    from .api import CheckpointReader
    out: list[str] = []
    r = CheckpointReader(path, base_dir=base_dir)
    try:
        while r.bases:
            b = open_base(r, base_dir, None)
            r.close()
            r = b
            out.append(r.path)
    finally:
        r.close()
    return out
