"""Format v1 framing: header, chunk table, manifest and footer (normative text: docs/format.md).

Every number read here is checked before anything is sized or sought from it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .codecs.base import MAX_CHUNK
from .errors import (ChecksumError, CorruptFileError, NotCkptzipFileError, TruncatedFileError, UnknownCodecError,
                     UnsupportedVersionError)
from .validate import MAX_DEPTH, load_document, validate_document

MAGIC = b"CKPTZIP\x00"
FOOTER_MAGIC = b"CKZ1END\x00"
#: the newest version this code writes (and reads: every 1.x); a file is written with the lowest
#: minor its features need: 1.0 without references, 1.1 with ``xor``/``delta``/``derived``
#: transforms or ``bases``, 1.2 with ``expref``/``expgrid``, 1.3 with ``hidelta``, ``byteplane``
#: ``rotate`` or located base storages, 1.4 with located base storages coded ``expgrid``, 1.5 with
#: packed storages (``in``), so that older readers load what they can
VERSION = (1, 5)
HEADER = struct.Struct("<8sHHI")          # magic, major, minor, flags
FOOTER = struct.Struct("<QQQ8s")          # manifest offset, manifest length, xxh3-64, magic
HEADER_SIZE, FOOTER_SIZE = HEADER.size, FOOTER.size   # 16, 32
#: one chunk-table row: file offset, stored bytes, raw bytes, xxh3-64 of the stored bytes, flags
ROW = np.dtype([("offset", "<u8"), ("stored", "<u4"), ("raw", "<u4"), ("xxh3", "<u8"),
                ("flags", "u1")])
FLAG_STORED_RAW = 1
#: limits that keep a hostile manifest from steering allocations or recursion
MAX_MANIFEST = 1 << 30
MAX_STORAGE_BYTES = 1 << 50


def checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def pack_header(minor: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION[0], minor, 0)


def dump_json(doc: Any) -> str:
    """A manifest document (or part of one) as the manifest holds it: compact ASCII JSON."""
    # (check_circular off: the document is a tree the writer built, with no cycle to find; the
    # check kept a dict of every container, about 20 % of the dump)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, check_circular=False)


def pack_manifest(doc: dict[str, Any], rows: np.ndarray, root_json: str | None = None) -> bytes:
    """The manifest: ``doc`` as JSON, and ``root_json`` (the object tree's JSON, made by the
    caller: :func:`~ckptzip.tree.root_json`) as its last member ``root``; then the chunk table."""
    text = dump_json(doc)
    if root_json is not None:
        text = f'{text[:-1]},"root":{root_json}}}'
    body = text.encode()
    pad = (-(4 + len(body))) % 8
    return struct.pack("<I", len(body)) + body + b" " * pad + rows.astype(ROW).tobytes()


def pack_footer(manifest_offset: int, manifest: bytes) -> bytes:
    return FOOTER.pack(manifest_offset, len(manifest), checksum(manifest), FOOTER_MAGIC)


#: the NotCkptzipFileError message of a file that does not start with the magic (the CLI adds a hint to it)
NOT_CKZ = "not a ckptzip file (bad magic)"


def check_header(raw: bytes) -> None:
    if len(raw) < HEADER_SIZE:
        if raw[:len(MAGIC)] != MAGIC[:len(raw)]:  # (a short file of something else is no truncated .ckz)
            raise NotCkptzipFileError(NOT_CKZ)
        raise TruncatedFileError("file is shorter than the 16-byte header")
    magic, major, minor, _flags = HEADER.unpack(raw[:HEADER_SIZE])
    if magic != MAGIC:
        raise NotCkptzipFileError(NOT_CKZ)
    if major != VERSION[0]:
        raise UnsupportedVersionError(f"format version {major}.{minor}; this reader reads {VERSION[0]}.x")


def parse_footer(raw: bytes, file_size: int) -> tuple[int, int, int]:
    if file_size < HEADER_SIZE + FOOTER_SIZE:
        raise TruncatedFileError(f"file of {file_size} bytes is too short for header and footer")
    off, length, digest, magic = FOOTER.unpack(raw)
    if magic != FOOTER_MAGIC:
        raise TruncatedFileError("no footer at the end of the file (truncated or incomplete write)")
    end = file_size - FOOTER_SIZE
    if not (HEADER_SIZE <= off <= end and 4 <= length <= MAX_MANIFEST and off + length == end):
        raise CorruptFileError(f"footer locates the manifest at [{off}, +{length}) in a file of {file_size}")
    return off, length, digest


@dataclass
class Manifest:
    doc: dict[str, Any]
    rows: np.ndarray          # structured ROW array
    data_end: int             # first byte after the data section (= manifest offset)
    total_nbytes: int = 0     # sum of every storage's declared nbytes
    #: each storage's parsed chain, ``[(transform config, transform or None)]`` (validate.py)
    chains: list | None = None
    #: the base record's parsed ``chains`` (format 1.3 located base storages), likewise
    base_chains: list | None = None


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise CorruptFileError(f"invalid manifest: {msg}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_manifest(raw: bytes, digest: int, data_end: int) -> Manifest:
    if checksum(raw) != digest:
        raise ChecksumError("manifest checksum mismatch")
    (jlen,) = struct.unpack_from("<I", raw)
    _need(4 + jlen <= len(raw), "JSON length beyond the manifest")
    doc = load_document(raw[4:4 + jlen])
    _need(isinstance(doc, dict), "top level is not an object")
    ver = doc.get("version")
    _need(isinstance(ver, list) and len(ver) == 2 and all(_is_int(v) for v in ver), "version")
    if ver[0] != VERSION[0]:
        raise UnsupportedVersionError(f"manifest version {ver}; this reader reads {VERSION[0]}.x")
    _need(doc.get("format") == "ckz", "format tag")
    n = doc.get("n_chunks")
    tstart = table_start(jlen)
    _need(_is_int(n) and n >= 0 and tstart + n * ROW.itemsize == len(raw), "chunk table size")
    rows = np.frombuffer(raw, dtype=ROW, count=n, offset=tstart) if n else np.zeros(0, ROW)
    check_rows(rows, data_end)
    try:
        total, chains, hints = _check_document(doc, rows, n)
    except (CorruptFileError, UnknownCodecError) as e:
        if ver[1] > VERSION[1]:  # a newer minor may add fields, storage kinds and chains this reader refuses
            raise UnsupportedVersionError(
                f"format version 1.{ver[1]} is newer than this reader's 1.{VERSION[1]}, and the file uses "
                f"something it does not know ({e}); upgrade ckptzip") from None
        raise
    return Manifest(doc, rows, data_end, total, chains, hints)


def _check_document(doc: dict, rows: np.ndarray, n: int) -> tuple[int, list, list]:
    """The checks of :func:`parse_manifest` after the version: every storage record's chunk
    rows as a whole, then the one validation pass over every field a reader uses
    (validate.py); ``(total declared bytes, parsed chains, parsed base-record chains)``."""
    _need(isinstance(doc.get("meta", {}), dict), "meta")
    storages = doc.get("storages")
    _need(isinstance(storages, list), "storages")
    firsts, counts, sizes = [], [], []
    for i, s in enumerate(storages):  # (exact types: what json.loads makes; a bool is no int)
        if type(s) is not dict:
            _need(False, f"storage {i}")
        nb, rr = s.get("nbytes"), s.get("rows")
        if type(nb) is not int or not 0 <= nb <= MAX_STORAGE_BYTES:
            _need(False, f"storage {i} nbytes")
        if "in" in s:  # (format 1.5: a slice of a pack, no chunks of its own; validate.py checks it)
            if "rows" in s or "codec" in s or "transforms" in s:
                _need(False, f"storage {i}: a packed storage ('in') has no rows, codec or transforms")
            firsts.append(0)
            counts.append(0)
            sizes.append(0)
            continue
        if (type(rr) is not list or len(rr) != 2 or type(rr[0]) is not int or type(rr[1]) is not int
                or rr[0] < 0 or rr[1] < 0 or rr[0] + rr[1] > n):
            _need(False, f"storage {i} rows")
        if type(s.get("codec")) is not dict or ("transforms" in s and type(s["transforms"]) is not list):
            _need(False, f"storage {i} codec/transforms")
        firsts.append(rr[0])
        counts.append(rr[1])
        sizes.append(nb)
    if storages:  # whole-table checks (one numpy pass, not one per storage)
        first = np.asarray(firsts, dtype=np.int64)
        count = np.asarray(counts, dtype=np.int64)
        # no chunk row belongs to two storages: the non-empty row ranges, in order, do not overlap
        ne = np.nonzero(count > 0)[0]
        order = ne[np.argsort(first[ne], kind="stable")]
        bad = np.nonzero(first[order][1:] < (first + count)[order][:-1])[0]
        if len(bad):
            i = int(max(order[bad[0]], order[bad[0] + 1]))
            _need(False, f"storage {i} shares chunk rows with another storage")
        # every storage's chunks add up to its size
        cum = np.zeros(n + 1, dtype=np.uint64)
        if n:
            np.cumsum(rows["raw"].astype(np.uint64), out=cum[1:])
        got = cum[first + count] - cum[first]
        wrong = np.nonzero(got != np.asarray(sizes, dtype=np.uint64))[0]
        if len(wrong):
            _need(False, f"storage {int(wrong[0])} chunk sizes do not add up")
    _need("root" in doc, "root")
    # the one validation pass over every field a reader uses (validate.py)
    chains: list = []
    hints: list = []
    total = validate_document(doc, n, chains, hints)
    return total, chains, hints


def table_start(jlen: int) -> int:
    """Where the chunk table starts in a manifest whose JSON has ``jlen`` bytes (after the u32
    length and the JSON, padded to a multiple of 8)."""
    return 4 + jlen + (-(4 + jlen)) % 8


def check_rows(rows: np.ndarray, data_end: int) -> None:
    """Chunk-table rows: inside the data section (``16 <= offset``, ``offset + stored <=
    data_end``), sizes and flags valid (docs/format.md)."""
    if not len(rows):
        return
    off = rows["offset"].astype(np.uint64)
    stored = rows["stored"].astype(np.uint64)
    # compare without overflow: offset first, then the room left after it
    _need(bool(np.all(off >= HEADER_SIZE)) and bool(np.all(off <= data_end)), "chunk outside the data section")
    _need(bool(np.all(stored <= np.uint64(data_end) - off)), "chunk outside the data section")
    _need(bool(np.all(rows["raw"] >= 1)) and bool(np.all(rows["raw"] <= MAX_CHUNK)), "chunk raw size")
    _need(bool(np.all(rows["stored"] >= 1)) and bool(np.all(rows["stored"] <= rows["raw"])),
          "chunk stored size")
    _need(bool(np.all(rows["flags"] <= FLAG_STORED_RAW)), "chunk flags")
    raw_flag = rows["flags"] == FLAG_STORED_RAW
    _need(bool(np.all(rows["stored"][raw_flag] == rows["raw"][raw_flag])), "raw chunk sizes")
