"""The one validation layer for a parsed manifest document (normative text: docs/format.md).

``parse_manifest`` calls :func:`load_document` and :func:`validate_document` once, right after it
has read the chunk table, so that every field a reader later uses (storages, their devices, codec
and transform parameters, the object tree) has been checked for type, range and consistency
before anything is sized, allocated or constructed from it. The threat model is a file whose
author controls every byte and recomputes every checksum: checksums prove integrity, not intent.
"""
from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Callable
from typing import Any

from . import native
from .codecs.base import check_params, wire_keys
from .errors import CorruptFileError, UnknownCodecError

#: nesting deeper than this is invalid (the object tree, and JSON in general)
MAX_DEPTH = 200
#: longest decimal string accepted for an ``int`` node (digits, sign not counted). Parsing is
#: subquadratic here but not linear: 1,000,000 digits take about a second.
MAX_INT_DIGITS = 1_000_000
#: storage ``device`` strings a reader accepts (informative: they only steer placement)
DEVICE_RE = re.compile(r"(cpu|cuda(:[0-9]{1,4})?)\Z")
_INT_RE = re.compile(r"-?[0-9]+\Z")
_FLOAT_RE = re.compile(r"[0-9a-fA-F]{16}\Z")
_SHA_RE = re.compile(r"[0-9a-f]{64}\Z")
#: transform ids that refer to another storage (format 1.1; ``expref`` 1.2) and those this reader
#: implements
REF_TRANSFORMS = frozenset({"xor", "delta", "hidelta", "derived", "expref"})
#: transforms that may only come first in a chain: the reference transforms and ``expgrid`` (1.2)
FIRST_TRANSFORMS = REF_TRANSFORMS | {"expgrid"}
KNOWN_TRANSFORMS = frozenset({"byteplane", "xor", "delta", "hidelta", "derived", "expref", "expgrid"})
#: at most this many bases per file (1.1 writers write one) and this many files in a chain
MAX_BASES = 1
MAX_CHAIN = 64
#: at most this many references within a file in a row (``derived``/``expref`` of a storage that
#: refers to another...; ckptzip's writers make chains of one)
MAX_LOCAL_DEPTH = 4
NODE_TYPES = frozenset({"int", "float", "bytes", "bytearray", "list", "tuple", "dict", "odict", "size",
                        "dtype", "device", "tensor", "ndarray", "npscalar", "pickle"})


def _bad(msg: str) -> CorruptFileError:
    return CorruptFileError(f"invalid manifest: {msg}")


def _is_int(x: Any) -> bool:
    return type(x) is int


# -- JSON -------------------------------------------------------------------------------------
def strict_json(text: bytes, error: Callable[[str], Exception], what: str = "JSON") -> Any:
    """Parse ``text`` as UTF-8 JSON strictly: no repeated member names, no NaN/Infinity, nesting
    bounded by the interpreter. Any failure raises ``error(message)``: the manifest, the DCP
    metadata and safetensors headers each pass their own named error."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise _Refused(f"duplicate JSON object key {dup[:60]!r}")
        return d

    def no_constant(name: str) -> Any:
        raise _Refused(f"JSON constant {name} (not allowed)")
    try:
        s = text.decode("utf-8")
        lib = native.lib
        if lib is not None:  # plain dicts, then one count in C (no Python call per object)
            doc = json.loads(s, parse_constant=no_constant)
            written, kept = lib.json_members(text, doc)
            if written == kept:
                return doc
        return json.loads(s, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except _Refused as e:
        raise error(str(e)) from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{what} does not parse: {str(e)[:200]}") from None


class _Refused(Exception):
    """Raised inside the JSON hooks; turned into the caller's error by :func:`strict_json`."""


def load_document(text: bytes) -> Any:
    """Parse the manifest JSON strictly: UTF-8, no duplicate object keys, no NaN/Infinity."""
    return strict_json(text, _bad, "manifest JSON")


# -- big ints without sys.set_int_max_str_digits ----------------------------------------------
_SMALL_DIGITS = 4000  # below CPython's default int/str conversion limit (4300)
_SMALL_BITS = 13000   # < 4000 decimal digits


@functools.lru_cache(maxsize=128)
def _pow10(k: int) -> int:
    return 10 ** k


def _parse_digits(s: str) -> int:
    if len(s) <= _SMALL_DIGITS:
        return int(s)
    k = len(s) // 2
    return _parse_digits(s[:-k]) * _pow10(k) + _parse_digits(s[-k:])


def _format_digits(n: int) -> str:
    if n.bit_length() <= _SMALL_BITS:
        return str(n)
    k = int(n.bit_length() * 0.30102999566398120) // 2
    q, r = divmod(n, _pow10(k))
    return _format_digits(q) + _format_digits(r).zfill(k)


def int_to_dec(n: int) -> str:
    """Decimal string of any int, whatever ``sys.get_int_max_str_digits()`` says."""
    return "-" + _format_digits(-n) if n < 0 else _format_digits(n)


def dec_to_int(s: Any) -> int:
    """Parse an ``int`` node's ``v`` (``-?[0-9]+``, at most :data:`MAX_INT_DIGITS` digits)."""
    if not isinstance(s, str) or len(s) > MAX_INT_DIGITS + 1 or not _INT_RE.match(s):
        raise CorruptFileError(f"invalid object tree: int {str(s)[:40]!r} (a decimal string of at "
                               f"most {MAX_INT_DIGITS} digits is required)")
    return -_parse_digits(s[1:]) if s[0] == "-" else _parse_digits(s)


# -- the document -------------------------------------------------------------------------------
def validate_document(doc: dict[str, Any], n_chunks: int, chains: list | None = None,
                      hint_chains: list | None = None) -> int:
    """Check every field a reader uses; return the total declared bytes of all storages
    with chunks (a packed storage, format 1.5, is decoded as part of its pack).
    ``chains``: a list that receives each storage's parsed chain, ``[(transform config, parsed
    transform or None for an unknown id)]`` (storages with equal configs share one list, never
    modified), so that readers need not parse them again. ``hint_chains``: a list that receives
    the parsed chains of the base record's ``chains`` (format 1.3), likewise.

    Raises CorruptFileError (or UnknownCodecError for codec/transform parameters no
    implementation knows). Codec and transform *ids* that this version does not know are left to
    the decoder (they fail with UnknownCodecError when their storage is decoded), so that keys and
    metadata of such files stay readable."""
    meta = doc.get("meta", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("meta must map strings to strings")
    storages = doc.get("storages")
    if not isinstance(storages, list):
        raise _bad("storages")
    n_bases = _bases(doc, hint_chains)
    total = 0
    seen: dict = {}  # configs already checked: storages usually share a few of them
    parsed = [] if chains is None else chains
    packed = False
    for i, s in enumerate(storages):
        nb, chain = _storage(i, s, seen)
        parsed.append(chain)
        if "in" in s:  # (its bytes are decoded as its pack's: counted once)
            packed = True
        else:
            total += nb
    if packed:
        _packs(storages)
    _refs(storages, n_bases, parsed)
    if "root" not in doc:
        raise _bad("root")
    _Tree(len(storages)).node(doc["root"], 0)
    return total


def _storage(i: int, s: Any, seen: dict | None = None) -> tuple[int, list]:
    # (exact types, as json.loads makes them: a bool is no int; a loop of plain checks, since
    # this runs once per storage of every file read)
    if type(s) is not dict:
        raise _bad(f"storage {i}")
    nb = s.get("nbytes")
    if type(nb) is not int or nb < 0:
        raise _bad(f"storage {i} nbytes")
    dev = s.get("device", "cpu")
    if dev != "cpu" and (type(dev) is not str or not DEVICE_RE.match(dev)):
        raise _bad(f"storage {i} device {str(dev)[:40]!r} (cpu, cuda or cuda:N)")
    if "elem" in s and type(s["elem"]) is not str:
        raise _bad(f"storage {i} elem")
    if "choice" in s and type(s["choice"]) is not str:
        raise _bad(f"storage {i} choice")
    if "in" in s:  # format 1.5: bytes [start, start + nbytes) of pack p (checked by _packs; that it
        at = s["in"]  # has no rows, codec or transforms: by format.parse_manifest's row checks)
        if (type(at) is not list or len(at) != 2 or type(at[0]) is not int or type(at[1]) is not int
                or at[0] < 0 or at[1] < 0):
            raise _bad(f"storage {i}: 'in' must be [pack, start] (non-negative ints)")
        return nb, []
    codec = s.get("codec")
    if type(codec) is not dict or type(codec.get("id")) is not str:
        raise _bad(f"storage {i} codec")
    tfs = s.get("transforms", [])
    if type(tfs) is not list:
        raise _bad(f"storage {i} transforms")
    # storages share a few chains, but a reference transform's "ref" differs per storage: the
    # cache key leaves it out, and a hit parses only that first transform again (its ints checked)
    ref = tfs[0].get("ref") if tfs and type(tfs[0]) is dict and type(tfs[0].get("ref")) is dict else None
    key = None
    if seen is not None:  # (tagged: a chain without "ref" never takes the key of one with it)
        key = ("plain", _chain_key(codec, tfs)) if ref is None else \
            ("ref", _chain_key(codec, [{k: v for k, v in tfs[0].items() if k != "ref"}] + tfs[1:]))
    hit = seen.get(key) if key is not None else None
    if hit is not None and ref is not None and hit[0][1] is not None:
        from .transforms import get_transform
        parsed = [(tfs[0], get_transform(tfs[0]))] + hit[1:]
    elif hit is not None and ref is None:
        parsed = hit
    else:
        parsed = _chain(i, codec, tfs)
        if key is not None:
            if len(seen) > 4096:
                seen.clear()
            seen[key] = parsed
    for tf, t in parsed:
        if t is not None and not t.accepts(nb):
            raise CorruptFileError(f"storage size does not fit its {tf['id']} transform (not a multiple of its width, or another size)")
    return nb, parsed


def _chain_key(codec: dict, tfs: list) -> Any:
    """A key equal for equal codec and transform configs: their items as tuples where every value
    is a str or an int (what ckptzip writes), else their repr (which never equals such a tuple)."""
    try:
        if not all(type(t) is dict for t in tfs):
            raise TypeError
        # (chains of any length: a repr of expgrid's base64 terms cost more than its parse)
        key = (tuple(codec.items()), *(tuple(t.items()) for t in tfs))
        hash(key)  # (a list or dict value: TypeError)
        for part in key:
            for _k, v in part:
                if type(v) is not str and type(v) is not int:
                    raise TypeError
        return key
    except TypeError:
        return repr(codec), repr(tfs)


def _chain(i: int, codec: dict, tfs: list) -> list:
    """Check storage ``i``'s codec parameters and transform chain (what does not depend on its
    size); return ``[(transform config, parsed transform or None for an unknown id)]``."""
    keys = wire_keys(codec["id"])
    if keys is not None:  # a known id: only its wire parameters, of the right JSON type
        params = {k: v for k, v in codec.items() if k != "id"}
        try:
            check_params(codec["id"], params, keys)
        except UnknownCodecError as e:
            if set(params) <= keys:  # known names, wrong types: the file lies
                raise CorruptFileError(f"storage {i}: {e}") from None
            raise
    if len(tfs) > 2:
        raise CorruptFileError("transform chains have at most two elements (format 1.1)")
    out = []
    for k, tf in enumerate(tfs):
        if not isinstance(tf, dict) or not isinstance(tf.get("id"), str):
            raise _bad(f"storage {i} transform")
        if tf["id"] in FIRST_TRANSFORMS and k != 0:
            raise _bad(f"storage {i}: {tf['id']} may only be the first transform of a chain")
        if len(tfs) == 2 and k == 0 and tf["id"] not in FIRST_TRANSFORMS and tf["id"] in KNOWN_TRANSFORMS:
            raise _bad(f"storage {i}: a chain of two starts with a reference transform (xor, delta, derived, "
                       f"expref) or expgrid")
        t = None
        if tf["id"] in KNOWN_TRANSFORMS:
            from .transforms import get_transform
            t = get_transform(tf)
        out.append((tf, t))
    return out


def _bases(doc: dict[str, Any], hint_chains: list | None = None) -> int:
    """Check the ``bases`` records (format 1.1); return how many there are."""
    bases = doc.get("bases", [])
    if not isinstance(bases, list) or len(bases) > MAX_BASES:
        raise _bad(f"bases must be a list of at most {MAX_BASES} records")
    for k, b in enumerate(bases):
        if (not isinstance(b, dict) or not {"file", "sha256", "size", "depth"} <= set(b)
                or set(b) - {"file", "sha256", "size", "depth", "storages", "chains"}
                or ("storages" in b) != ("chains" in b)):
            raise _bad(f"base {k} must have file, sha256, size and depth, and may have storages with chains")
        f = b["file"]
        if (not isinstance(f, str) or not f or len(f) > 4096 or "\0" in f or "\\" in f
                or f.startswith("/") or ":" in f.split("/")[0]):
            raise _bad(f"base {k} file {str(f)[:80]!r} (a relative '/'-separated path)")
        if not isinstance(b["sha256"], str) or not _SHA_RE.match(b["sha256"]):
            raise _bad(f"base {k} sha256 (64 lowercase hex digits)")
        if not _is_int(b["size"]) or b["size"] < 0:
            raise _bad(f"base {k} size")
        if not _is_int(b["depth"]) or not 1 <= b["depth"] <= MAX_CHAIN:
            raise _bad(f"base {k} depth must be 1..{MAX_CHAIN} (the longest chain of bases a reader follows)")
        if "storages" in b:
            _base_hints(k, b, hint_chains)
    return len(bases)


def located_chain(tfs: Any) -> bool:
    """Whether a transform list is one a base record may locate (refers to no other storage):
    empty, ``[byteplane]`` (1.3), ``[expgrid]`` or ``[expgrid, byteplane]`` (1.4)."""
    ids = [t.get("id") if isinstance(t, dict) else None for t in tfs]
    return ids in ([], ["byteplane"], ["expgrid"], ["expgrid", "byteplane"])


def _base_hints(k: int, b: dict[str, Any], out: list | None = None) -> None:
    """A base record's ``storages`` (``[j, first, count, chain]``, ``j`` increasing) and
    ``chains`` (``{"transforms", "codec"}``: at most a ``byteplane``, format 1.3, or ``expgrid``
    then at most a ``byteplane``, 1.4: chains that refer to no other storage). Ranges in the
    base's chunk table are checked against that table when it is read."""
    chains, rows = b["chains"], b["storages"]
    if not isinstance(chains, list) or not isinstance(rows, list):
        raise _bad(f"base {k} storages/chains")
    for c, ch in enumerate(chains):
        if not isinstance(ch, dict) or set(ch) != {"transforms", "codec"}:
            raise _bad(f"base {k} chain {c} must have exactly transforms and codec")
        tfs, codec = ch["transforms"], ch["codec"]
        if (not isinstance(tfs, list) or len(tfs) > 2 or not isinstance(codec, dict)
                or not isinstance(codec.get("id"), str)):
            raise _bad(f"base {k} chain {c}")
        if not located_chain(tfs):
            raise _bad(f"base {k} chain {c}: only expgrid and/or byteplane (or nothing) may precede the codec")
        parsed = _chain(-1, codec, tfs)
        if out is not None:
            out.append(parsed)
    last = -1
    for r in rows:
        if (not isinstance(r, list) or len(r) != 4 or not all(_is_int(x) and x >= 0 for x in r)
                or r[0] <= last or r[3] >= len(chains)):
            raise _bad(f"base {k} storages entry {str(r)[:60]} ([storage, first row, row count, chain], "
                       f"storages increasing)")
        last = r[0]


def _packs(storages: list) -> None:
    """Format 1.5 packed storages: each ``in`` names a pack (a storage of this file that is not
    itself packed, other than the storage, whose chain refers to no other storage) and lies
    inside it."""
    for i, s in enumerate(storages):
        at = s.get("in")
        if at is None:
            continue
        p, start = at
        if p >= len(storages) or p == i or "in" in storages[p]:
            raise _bad(f"storage {i}: packed in storage {p}, which does not exist, is itself or is packed")
        if start + s["nbytes"] > storages[p]["nbytes"]:
            raise _bad(f"storage {i}: bytes {start}..{start + s['nbytes']} lie outside its pack, storage {p}")
        if not located_chain(storages[p].get("transforms", [])):
            raise _bad(f"storage {i}: its pack, storage {p}, has a transform that refers to another storage")


def _refs(storages: list, n_bases: int, chains: list) -> None:
    """Reference fields of ``xor``/``delta``/``derived``/``expref``: in range, sizes that match,
    and no cycle among references within the file (``derived``, ``expref``: a storage is decoded
    after the storage it refers to). ``chains``: each storage's parsed chain (:func:`_chain`)."""
    deps: dict[int, int] = {}
    for i, s in enumerate(storages):
        tfs = s.get("transforms", [])
        if not tfs or tfs[0]["id"] not in REF_TRANSFORMS:
            continue
        t = chains[i][0][1]  # parsed by _chain: option names and integer fields checked there
        if t.against_base:
            if t.base >= n_bases:
                raise _bad(f"storage {i}: {t.wire_id} refers to base {t.base}, which does not exist")
        else:
            k = t.storage
            if k >= len(storages) or k == i or "in" in storages[k]:
                raise _bad(f"storage {i}: {t.wire_id} refers to storage {k}, which does not exist, is itself "
                           f"or is packed")
            if storages[k]["nbytes"] != t.ref_nbytes(s["nbytes"]):
                raise _bad(f"storage {i}: {t.wire_id} reference {k} has {storages[k]['nbytes']} bytes, "
                           f"expected {t.ref_nbytes(s['nbytes'])}")
            deps[i] = k
    for i in deps:  # each walk stops after MAX_LOCAL_DEPTH steps: linear in the storages
        j, steps = i, 0
        while j in deps:
            j = deps[j]
            steps += 1
            if j == i:
                raise _bad(f"storage {i}: references within the file (derived, expref) form a cycle")
            if steps > MAX_LOCAL_DEPTH:
                raise _bad(f"storage {i}: a chain of more than {MAX_LOCAL_DEPTH} references within the file "
                           f"(derived, expref), or a cycle")


class _Tree:
    """One walk over the object tree: node shapes, storage indices, int strings and dict keys."""

    def __init__(self, n_storages: int) -> None:
        self.n_storages = n_storages

    def node(self, n: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _bad(f"object tree nested deeper than {MAX_DEPTH}")
        if type(n) is not dict:  # (exact types, as json.loads makes them)
            if n is None or type(n) is bool or type(n) is str:
                return
            raise _bad(f"tree node {str(n)[:60]!r}")
        t, v = n.get("t"), n.get("v")
        if t == "tensor" or t == "ndarray":  # (most nodes, then dicts: tested first)
            s = n.get("s")
            if type(s) is not int or not 0 <= s < self.n_storages:
                raise _bad(f"tensor refers to storage {str(s)[:20]!r}, which does not exist")
        elif t == "dict" or t == "odict":
            ks = n.get("k")
            if type(ks) is not list or type(v) is not list or len(ks) != len(v):
                raise _bad("dict node")
            d = depth + 1
            if all(type(k) is str for k in ks):  # (string keys: their own values)
                if len(set(ks)) != len(ks):
                    seen: set[Any] = set()
                    dup = next(k for k in ks if k in seen or seen.add(k))
                    raise _bad(f"dict node with duplicate key {dup[:60]!r}")
            else:
                seen = set()
                for k in ks:
                    self.node(k, d)
                    kv = key_value(k)
                    if kv in seen:
                        raise _bad(f"dict node with duplicate key {str(kv)[:60]!r}")
                    seen.add(kv)
            for x in v:
                self.node(x, d)
        elif type(t) is not str:
            raise _bad(f"tree node {str(n)[:60]!r}")
        elif t not in NODE_TYPES:
            raise _bad(f"unknown tree node type {t[:40]!r}")
        elif t == "int":
            _check_int(v)
        elif t == "float":
            if type(v) is not str or not _FLOAT_RE.match(v):
                raise _bad("float node")
        elif t in ("list", "tuple"):
            if type(v) is not list:
                raise _bad(f"{t} node")
            for x in v:
                self.node(x, depth + 1)
        elif t == "size":
            if type(v) is not list or not all(_is_int(x) and x >= 0 for x in v):
                raise _bad("size node")
        elif t in ("bytes", "bytearray", "pickle", "dtype", "device", "npscalar"):
            if type(v) is not str:
                raise _bad(f"{t} node")


def _check_int(v: Any) -> None:
    if not isinstance(v, str) or len(v) > MAX_INT_DIGITS + 1 or not _INT_RE.match(v):
        raise _bad(f"int node {str(v)[:40]!r} (a decimal string of at most {MAX_INT_DIGITS} digits)")


def key_value(k: Any) -> Any:
    """A hashable stand-in for the Python value of a dict key node, equal exactly when the
    decoded keys are equal (``1``, ``1.0`` and ``True`` collide, as in a Python dict)."""
    if k is None or isinstance(k, (bool, str)):
        return k
    t = k.get("t")
    if t == "int":
        return dec_to_int(k.get("v"))
    if t == "float":
        x = struct.unpack("<d", bytes.fromhex(k["v"]))[0]
        return object() if math.isnan(x) else x  # NaN keys never compare equal
    if t == "tuple":
        return tuple(key_value(x) for x in k["v"])
    return ("node", json.dumps(k, sort_keys=True))
