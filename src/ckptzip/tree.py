"""Object tree <-> manifest nodes. Tensors become references to deduplicated storages, so views,
non-contiguous tensors and tensors that share memory come back exactly as they were saved."""
from __future__ import annotations

import base64
import collections
import json
import math
import pickle
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import CorruptFileError, PickleNotAllowedError, UnsupportedObjectError
from .format import dump_json
from .validate import MAX_DEPTH, MAX_INT_DIGITS, dec_to_int, int_to_dec

def _usable(d: torch.dtype) -> bool:
    """A dtype whose tensors can be created, copied and viewed as bytes (drops quantized, sub-byte
    and bit-container dtypes, which have no storage semantics of their own)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.zeros(2, dtype=d)
        return t.clone().view(torch.uint8).numel() == 2 * d.itemsize
    except Exception:
        return False


DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and _usable(d)
}
NP_KINDS = "biufc"


_DTYPE_NAMES: dict = {}  # torch.dtype -> its wire name (a save names hundreds of tensors' dtypes)
_DEVICE_NAMES: dict = {}  # torch.device -> str


def dtype_name(d: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(d)
    if name is None:
        name = str(d).removeprefix("torch.")
        if name not in DTYPES:
            raise UnsupportedObjectError(f"tensors of dtype {d} are not supported")
        _DTYPE_NAMES[d] = name
    return name


def _device_name(d: torch.device) -> str:
    name = _DEVICE_NAMES.get(d)
    if name is None:
        name = _DEVICE_NAMES[d] = str(d)
    return name


@dataclass
class StorageRef:
    """One storage to write: its bytes as a flat uint8 tensor plus the element dtype hint."""
    data: torch.Tensor        # flat uint8, on the tensor's device, never written to
    elem: str                 # dtype name (torch) or numpy dtype str used to pick a transform
    device: str
    float_width: int          # 2, 4 or 8 for floating element types, else 0


def _float_width(d: torch.dtype) -> int:
    return d.itemsize if (d.is_floating_point and d.itemsize in (2, 4, 8)) else 0


@dataclass
class Encoder:
    allow_pickle: bool = False
    storages: list[StorageRef] = field(default_factory=list)
    _index: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _empty: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # per device: see _storage

    def _storage(self, t: torch.Tensor, dtype: str, dev: torch.device | None = None) -> int:
        st = t.untyped_storage()
        if dev is None:
            dev = t.device
        dname = _device_name(dev)
        nbytes = st.nbytes()
        key = (dname, st.data_ptr(), nbytes) if nbytes else (dname, -len(self.storages), 0)  # (empty
        idx = self._index.get(key)                                                            # ones are never shared)
        if idx is None:
            # the storage as one flat uint8 tensor: a new tensor of an empty one set to it
            # (2.7 us against 4.3 for torch.empty(0).set_() on a sandbox core, which took 2.7-5.4
            # us on CUDA: hundreds per save's stall)
            empty = self._empty.get(dev)
            if empty is None:
                empty = self._empty[dev] = torch.empty(0, dtype=torch.uint8, device=dev)
            flat = empty.detach().set_(st)
            idx = len(self.storages)
            self._index[key] = idx
            self.storages.append(StorageRef(flat, dtype, dname, _float_width(t.dtype)))
        return idx

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        dev = t.device
        if t.layout is not torch.strided or t.is_quantized or dev.type not in ("cpu", "cuda"):
            raise UnsupportedObjectError(
                f"only dense CPU/CUDA tensors are supported (got layout={t.layout}, device={dev})")
        if type(t) is torch.Tensor:  # (the common case first: a save names hundreds of tensors)
            node: dict[str, Any] = {"t": "tensor", "rg": True} if t.requires_grad else {"t": "tensor"}
        elif isinstance(t, torch.nn.Parameter):
            node = {"t": "tensor", "param": True, "rg": bool(t.requires_grad)}
            t = t.data
        else:
            raise UnsupportedObjectError(f"tensor subclass {type(t).__name__} is not supported")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        dtype = dtype_name(t.dtype)
        node["s"] = self._storage(t, dtype, dev)
        node["dtype"] = dtype
        node["shape"] = list(t.shape)
        node["stride"] = list(t.stride())
        node["offset"] = t.storage_offset()
        return node

    def ndarray(self, a: np.ndarray) -> dict[str, Any]:
        if a.dtype.kind not in NP_KINDS + "?" or a.dtype.fields is not None or a.dtype.hasobject:
            raise UnsupportedObjectError(f"numpy arrays of dtype {a.dtype} are not supported")
        shape = list(a.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
        a = np.ascontiguousarray(a)
        flat = torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
        idx = len(self.storages)
        fw = a.dtype.itemsize if a.dtype.kind == "f" and a.dtype.itemsize in (2, 4, 8) \
            and a.dtype.byteorder in "<=|" else 0
        self.storages.append(StorageRef(flat, a.dtype.str, "cpu", fw))
        return {"t": "ndarray", "s": idx, "dtype": a.dtype.str, "shape": shape}

    def encode(self, obj: Any, depth: int = 0) -> Any:
        """The JSON node of ``obj`` (its tensors registered as storages). An object that cannot
        be stored raises :class:`UnsupportedObjectError` naming where it is (``['model'][3]``)."""
        if depth:
            return self._encode(obj, depth)
        try:
            return self._encode(obj, 0)
        except UnsupportedObjectError as e:
            where = getattr(e, "where", None)
            if not where:
                raise
            path = "".join(f"[{k!r}]" for k in reversed(where))
            raise UnsupportedObjectError(f"{e} (at {path[:300]})") from None

    def _child(self, v: Any, d: int, key: Any) -> Any:
        try:
            return self._encode(v, d)
        except UnsupportedObjectError as e:
            if not hasattr(e, "where"):
                e.where = []
            e.where.append(key if isinstance(key, (str, int)) else type(key).__name__)
            raise

    def _encode(self, obj: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedObjectError(f"object nesting deeper than {MAX_DEPTH}")
        d = depth + 1
        if isinstance(obj, torch.Tensor):  # (tensors and str keys first: most of a state's nodes)
            return self.tensor(obj)
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if type(obj) is int:
            if obj.bit_length() > MAX_INT_DIGITS * 3.3219:  # more digits than any reader accepts
                raise UnsupportedObjectError(f"ints of more than {MAX_INT_DIGITS} decimal digits are "
                                             f"not supported")
            return _int_node(obj)
        if type(obj) is float:
            return _float_node(_PACK_F64(obj))
        if type(obj) in (dict, collections.OrderedDict):
            tag = "dict" if type(obj) is dict else "odict"
            return {"t": tag, "k": [k if type(k) is str else self._key(k) for k in obj],
                    "v": [self._child(v, d, k) for k, v in obj.items()]}
        if type(obj) is list:
            return {"t": "list", "v": [self._child(v, d, i) for i, v in enumerate(obj)]}
        if type(obj) is tuple:
            return {"t": "tuple", "v": [self._child(v, d, i) for i, v in enumerate(obj)]}
        if type(obj) is torch.Size:
            return {"t": "size", "v": [int(x) for x in obj]}
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"t": "device", "v": str(obj)}
        if type(obj) in (bytes, bytearray):
            return {"t": "bytes" if type(obj) is bytes else "bytearray", "v": base64.b64encode(obj).decode()}
        if isinstance(obj, np.ndarray) and type(obj) is np.ndarray:
            return self.ndarray(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in NP_KINDS + "?":
            return {"t": "npscalar", "dtype": obj.dtype.str, "v": obj.tobytes().hex()}
        if self.allow_pickle:
            return {"t": "pickle", "v": base64.b64encode(pickle.dumps(obj, protocol=4)).decode()}
        raise UnsupportedObjectError(
            f"cannot store an object of type {type(obj).__module__}.{type(obj).__qualname__} without "
            f"pickle; pass allow_pickle=True (and load with allow_pickle=True) or convert it")

    def _key(self, k: Any) -> Any:
        if isinstance(k, str) or type(k) in (int, bool) or k is None or type(k) is float \
                or type(k) is tuple:
            return self.encode(k)
        if self.allow_pickle:
            return self.encode(k)
        raise UnsupportedObjectError(f"dict keys of type {type(k).__name__} are not supported")


_PACK_F64 = struct.Struct("<d").pack


def _int_node(v: int) -> dict:
    return {"t": "int", "v": int_to_dec(v)}  # (not limited by sys.set_int_max_str_digits)


def _float_node(packed: bytes) -> dict:
    return {"t": "float", "v": packed.hex()}


# -- saving one structure again and again ------------------------------------------------------
#
# A training loop saves the same structure at every checkpoint: the same containers and keys,
# tensors of the same dtypes, shapes and strides sharing storages the same way; only tensor
# data and a few scalars (step counters, learning rates) change. :func:`encode_reusing` walks
# the object once, collecting what the tree depends on (its *signature*) and the storages, and
# when the signature is one it has encoded before it reuses that tree (the scalars refilled)
# instead of building every node again. Values computed from the tree's structure alone
# (tensor keys, the tree's JSON around its scalars) are kept with it (``memo``).

#: the layouts of the last saves, most recently used last (a few: a job may save two states
#: in turn, a model and its EMA)
_LAYOUTS: list = []
_LAYOUTS_LOCK = threading.Lock()
MAX_LAYOUTS = 4
#: ints up to this many bits are taken by the walk (larger ones: the full encoder's checks)
_WALK_INT_BITS = 63


class _Layout:
    """One structure as encoded: its signature, the last tree with its scalars, and ``memo``."""
    __slots__ = ("sig", "root", "vals", "memo")

    def __init__(self, sig: list, root: Any, vals: list) -> None:
        self.sig, self.root, self.vals, self.memo = sig, root, vals, {}


@dataclass
class Reused:
    """What :func:`encode_reusing` knows about a tree it encoded: ``memo`` (shared by every
    save of the structure; values that depend on the structure alone) and the scalars, in
    encoding order (floats as their 8 little-endian bytes)."""
    memo: dict
    vals: list


def memoized(memo: dict | None, name: str, arg: Any, make: Callable[[], Any]) -> Any:
    """``make()``, or the value made for an equal ``arg`` by the last save of the same tree
    structure (``memo``: :attr:`Reused.memo`, or None: nothing kept). Only for values that
    depend on the structure alone: the tensors' keys, dtypes, shapes and strides, and the
    storages' sizes, element types and devices (never on tensor data or addresses)."""
    if memo is None:
        return make()
    got = memo.get(name)
    if got is not None and got[0] == arg:
        return got[1]
    value = make()
    memo[name] = (arg, value)
    return value


def _walk_object(obj: Any) -> tuple[list, list, list[StorageRef]] | None:
    """``(signature, scalars, storages)`` of ``obj`` as :class:`Encoder` would store it, or None
    for anything but the common shapes (dicts and ordered dicts with str or int keys, lists,
    tuples, dense tensors and parameters, None, bools, strs, ints, floats): those go through
    :class:`Encoder` alone. The signature holds every container's type, length and keys, every
    scalar's type and every tensor's class, requires_grad, dtype, device, shape, stride, offset,
    storage index and storage size: equal signatures encode to equal trees except for the
    scalars, and to storages of equal sizes, element types and devices."""
    sig: list = []
    vals: list = []
    enc = Encoder()  # (its storages: deduplicated and indexed by the encoder's own rule)
    put, val = sig.append, vals.append
    stack: list = [(obj, 0)]
    pop, push = stack.pop, stack.extend
    while stack:
        o, depth = pop()
        tp = type(o)
        if tp is torch.Tensor or tp is torch.nn.Parameter:
            dev = o.device
            rg = o.requires_grad
            if tp is not torch.Tensor:
                o = o.data
            if (o.layout is not torch.strided or dev.type not in ("cpu", "cuda") or o.is_quantized
                    or o.is_conj() or o.is_neg()):
                return None
            dt = o.dtype
            name = _DTYPE_NAMES.get(dt)
            if name is None:
                if str(dt).removeprefix("torch.") not in DTYPES:
                    return None  # (the encoder names the error)
                name = dtype_name(dt)
            idx = enc._storage(o, name, dev)
            put((tp, rg, dt, dev, o.shape, o.stride(), o.storage_offset(), idx, enc.storages[idx].data.numel()))
        elif o is None or tp is bool or tp is str:
            put(tp)
            val(o)
        elif tp is int:
            if o.bit_length() > _WALK_INT_BITS:
                return None
            put(tp)
            val(o)
        elif tp is float:
            put(tp)
            val(_PACK_F64(o))
        elif depth >= MAX_DEPTH:
            return None  # (the encoder names the error; a cycle ends here too)
        elif tp is dict or tp is collections.OrderedDict:
            put((tp, len(o)))
            for k in o:
                tk = type(k)
                if tk is str:
                    put(k)
                elif tk is int and k.bit_length() <= _WALK_INT_BITS:
                    put((tk, k))
                else:
                    return None
            d = depth + 1
            push([(v, d) for v in reversed(o.values())])
        elif tp is list or tp is tuple:
            put((tp, len(o)))
            d = depth + 1
            push([(v, d) for v in reversed(o)])
        else:
            return None
    return sig, vals, enc.storages


def _refill(n: Any, vals) -> Any:
    """A copy of tree ``n`` with its scalars taken in turn from iterator ``vals`` (containers
    copied, tensor nodes and key lists shared)."""
    if type(n) is dict:
        t = n["t"]
        if t == "tensor":
            return n
        if t == "dict" or t == "odict":
            return {"t": t, "k": n["k"], "v": [_refill(v, vals) for v in n["v"]]}
        if t == "list" or t == "tuple":
            return {"t": t, "v": [_refill(v, vals) for v in n["v"]]}
    v = next(vals)  # a scalar's place: its node now
    return _float_node(v) if type(v) is bytes else _int_node(v) if type(v) is int else v


def _same_storages(a: list[StorageRef], b: list[StorageRef]) -> bool:
    return len(a) == len(b) and all(
        x.data.data_ptr() == y.data.data_ptr() and x.data.numel() == y.data.numel() and x.elem == y.elem
        and x.device == y.device and x.float_width == y.float_width for x, y in zip(a, b))


def encode_reusing(obj: Any, allow_pickle: bool = False) -> tuple[Any, list[StorageRef], Reused | None]:
    """``(root, storages, reused)``: the tree and storages :class:`Encoder` makes of ``obj``,
    reusing the tree of an earlier call with the same structure (see above; ``reused`` None:
    ``obj`` has a shape the walk leaves to the encoder). The tree returned may be shared with
    other saves: it must not be modified."""
    got = _walk_object(obj)
    if got is None:
        enc = Encoder(allow_pickle=allow_pickle)
        return enc.encode(obj), enc.storages, None
    sig, vals, storages = got
    with _LAYOUTS_LOCK:
        lay = next((x for x in reversed(_LAYOUTS) if x.sig == sig), None)
        if lay is not None:
            _LAYOUTS.remove(lay)
            _LAYOUTS.append(lay)
            if lay.vals != vals:  # (the same structure, new scalars: a new tree, its nodes shared)
                lay.root, lay.vals = _refill(lay.root, iter(vals)), vals
            return lay.root, storages, Reused(lay.memo, vals)
    enc = Encoder(allow_pickle=allow_pickle)
    root = enc.encode(obj)
    # kept only if the object did not change while it was encoded (another thread setting a
    # step counter, a tensor resized in place): the tree is then the signature's and the
    # scalars' for as long as it is reused
    again = _walk_object(obj)
    if again is None or again[0] != sig or again[1] != vals or not _same_storages(enc.storages, storages):
        return root, enc.storages, None
    with _LAYOUTS_LOCK:
        lay = next((x for x in _LAYOUTS if x.sig == sig), None)  # (another thread's save of it)
        if lay is None:
            lay = _Layout(sig, root, vals)
            _LAYOUTS.append(lay)
            del _LAYOUTS[:-MAX_LAYOUTS]
    return root, storages, Reused(lay.memo, vals)


#: a scalar's place in :func:`root_json`'s template (the template is used only where its JSON
#: text appears once per scalar: never where the tree's own strs hold it)
_HOLE = "\x00ckptzip-scalar\x00"


def _scalar_json(v: Any) -> str:
    if type(v) is bytes:
        return '{"t":"float","v":"' + v.hex() + '"}'
    if type(v) is int:
        return '{"t":"int","v":"' + int_to_dec(v) + '"}'
    return json.dumps(v)  # (None, bools, strs: as the manifest's json.dumps writes them)


def root_json(root: Any, reused: Reused | None) -> str:
    """The tree's JSON as :func:`~ckptzip.format.pack_manifest` writes it (compact, ASCII):
    for a reused structure from its template (the JSON around its scalars, made once), else
    ``json.dumps``."""
    if reused is None:
        return dump_json(root)
    memo = reused.memo
    parts = memo.get("template")
    if parts is None:
        parts = dump_json(_refill(root, iter([_HOLE] * len(reused.vals)))).split(json.dumps(_HOLE))
        memo["template"] = parts = parts if len(parts) == len(reused.vals) + 1 else False
    if parts is False:  # (a tree whose strs hold the hole's text)
        return dump_json(root)
    out = [parts[0]]
    for v, p in zip(reused.vals, parts[1:]):
        out.append(_scalar_json(v))
        out.append(p)
    return "".join(out)


def _bad(msg: str) -> CorruptFileError:
    return CorruptFileError(f"invalid object tree: {msg}")


def _ints(x: Any, what: str, lo: int = 0) -> list[int]:
    if type(x) is not list:
        raise _bad(what)
    for v in x:  # (a loop: a generator in all() cost more than the check, per tensor)
        if type(v) is not int or v < lo:
            raise _bad(what)
    return x


def contiguous_stride(shape: list[int]) -> list[int]:
    """The row-major (C-contiguous) strides of ``shape``, in elements."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def view_extent(shape: list[int], stride: list[int], offset: int) -> int:
    """Elements of storage a strided view needs (0 for an empty view)."""
    end = offset
    for n, st in zip(shape, stride):
        if n == 0:
            return 0
        end += (n - 1) * st
    return end + 1


class Decoder:
    """Rebuilds the object from nodes; ``storage(i, node)`` supplies storage i's bytes."""

    def __init__(self, storage_fn, allow_pickle: bool) -> None:
        self.storage_fn = storage_fn
        self.allow_pickle = allow_pickle

    def tensor_meta(self, node: dict[str, Any], storage_nbytes: int) -> tuple[torch.dtype, list, list, int]:
        name = node.get("dtype")
        dt = DTYPES.get(name) if type(name) is str else None
        if dt is None:
            raise _bad(f"unknown dtype {name!r}")
        shape = _ints(node.get("shape"), "shape")
        stride = _ints(node.get("stride"), "stride")
        off = node.get("offset")
        if len(stride) != len(shape) or type(off) is not int or off < 0 or len(shape) > 64:
            raise _bad("tensor stride/offset")
        if view_extent(shape, stride, off) * dt.itemsize > storage_nbytes:
            raise _bad("tensor view reaches beyond its storage")
        return dt, shape, stride, off

    def decode(self, n: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise _bad("nesting too deep")
        d = depth + 1
        if type(n) is not dict:  # (exact types, as json.loads makes them)
            if n is None or type(n) is bool or type(n) is str:
                return n
            raise _bad(f"node {str(n)[:60]!r}")
        t, v = n.get("t"), n.get("v")
        if type(t) is not str:
            raise _bad(f"node {str(n)[:60]!r}")
        try:
            if t == "tensor":
                st = self.storage_fn(n)  # flat uint8 tensor
                nb = st.numel()
                dt, shape, stride, off = self.tensor_meta(n, nb)
                base = st.view(dt) if nb % dt.itemsize == 0 else st[: nb // dt.itemsize * dt.itemsize].view(dt)
                out = torch.as_strided(base, shape, stride, off)
                if n.get("param"):
                    return torch.nn.Parameter(out, requires_grad=bool(n.get("rg")))
                if n.get("rg"):
                    out.requires_grad_(True)
                return out
            if t == "int":
                return dec_to_int(v)
            if t == "float":
                return struct.unpack("<d", bytes.fromhex(v))[0]
            if t in ("dict", "odict"):
                ks, vs = n.get("k"), v
                if not isinstance(ks, list) or not isinstance(vs, list) or len(ks) != len(vs):
                    raise _bad("dict")
                items = [(self.decode(k, d), self.decode(x, d)) for k, x in zip(ks, vs)]
                out = dict(items) if t == "dict" else collections.OrderedDict(items)
                if len(out) != len(items):  # the lazy reader could not tell which value is meant
                    raise _bad("dict node with duplicate keys")
                return out
            if t in ("list", "tuple"):
                if not isinstance(v, list):
                    raise _bad(t)
                items = [self.decode(x, d) for x in v]
                return items if t == "list" else tuple(items)
            if t == "size":
                return torch.Size(_ints(v, "size"))
            if t == "dtype":
                if v not in DTYPES:
                    raise _bad(f"dtype {v!r}")
                return DTYPES[v]
            if t == "device":
                return torch.device(v)
            if t in ("bytes", "bytearray"):
                b = base64.b64decode(v, validate=True)
                return b if t == "bytes" else bytearray(b)
            if t == "ndarray":
                dt = np.dtype(n.get("dtype"))
                if dt.kind not in NP_KINDS + "?" or dt.hasobject or dt.fields is not None:
                    raise _bad("ndarray dtype")
                shape = _ints(n.get("shape"), "shape")
                st = self.storage_fn(n)
                if math.prod(shape) * dt.itemsize != st.numel():
                    raise _bad("ndarray size")
                return st.numpy().view(dt).reshape(shape)
            if t == "npscalar":
                dt = np.dtype(n.get("dtype"))
                if dt.kind not in NP_KINDS + "?" or dt.hasobject:
                    raise _bad("numpy scalar dtype")
                raw = bytes.fromhex(v)
                if len(raw) != dt.itemsize:
                    raise _bad("numpy scalar size")
                return np.frombuffer(raw, dtype=dt)[0]
            if t == "pickle":
                if not self.allow_pickle:
                    raise PickleNotAllowedError(
                        "the checkpoint holds pickled objects; load with allow_pickle=True only if "
                        "you trust its source")
                return pickle.loads(base64.b64decode(v, validate=True))
        except (CorruptFileError, PickleNotAllowedError):
            raise
        except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, struct.error,
                OverflowError, IndexError) as e:
            raise _bad(f"{t} node: {e}") from None
        raise _bad(f"unknown node type {t!r}")


def _key_component(k: Any) -> tuple[str, Any]:
    """A dict key node's path component: ``(dotted text, escaped JSON value)``."""
    ks = k if isinstance(k, str) else (k.get("v") if isinstance(k, dict) else str(k))
    if isinstance(k, dict) and k.get("t") == "int" and isinstance(k.get("v"), str) and len(k["v"]) <= 18:
        esc: Any = int(k["v"])
    else:  # strings, None, bools, and the key node itself (floats, tuples, ...)
        esc = k
    return str(ks), esc


def _walk(root: Any, keyed: bool) -> list:
    """Every tensor/ndarray node of a tree, depth first in key order: ``(path components, node)``
    (``keyed``; a component is ``(dotted text, escaped JSON value)``), or the nodes alone."""
    out: list = []
    stack = [(root, (), 0)]
    while stack:
        n, comps, depth = stack.pop()
        if depth > MAX_DEPTH or not isinstance(n, dict):
            continue
        t = n.get("t")
        if t in ("tensor", "ndarray"):
            out.append((comps, n) if keyed else n)
        elif t in ("dict", "odict") and isinstance(n.get("k"), list) and isinstance(n.get("v"), list):
            kids = list(zip(n["k"], n["v"]))
            stack.extend((v, comps + (_key_component(k),) if keyed else (), depth + 1) for k, v in reversed(kids))
        elif t in ("list", "tuple") and isinstance(n.get("v"), list):
            kids = list(enumerate(n["v"]))
            stack.extend((v, comps + ((str(i), i),) if keyed else (), depth + 1) for i, v in reversed(kids))
    return out


def tensor_nodes(root: Any) -> list:
    """Every tensor/ndarray node of a (validated) tree, in the order of :func:`tensor_keys`,
    without building their keys."""
    return _walk(root, keyed=False)


def escaped_key(comps: tuple) -> str:
    """The unambiguous key of a tensor: its path as a JSON array (strings stay strings, int keys
    and list indices are numbers, other keys are their manifest key nodes)."""
    return json.dumps([e for _, e in comps], separators=(",", ":"), ensure_ascii=False)


def tensor_keys(root: Any, escaped: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(keys, escaped)``: ``keys`` maps each tensor's dotted key (``"model.fc.weight"``) to its
    node, except where two tensors would share one dotted key (``1`` and ``"1"``, or ``"a.b"``
    and ``{"a": {"b": ...}}``): those tensors are listed under their :func:`escaped_key` instead.
    ``escaped`` maps every tensor's escaped key to its node (``escaped=False``: an empty dict,
    and escaped keys are made only for the tensors listed under theirs)."""
    found = _walk(root, keyed=True)
    dotted = [".".join(c for c, _ in comps) for comps, _ in found]
    esc: dict[int, str] = {}  # (escaped keys, made where needed: a json.dumps per tensor)

    def escaped_of(k: int) -> str:
        e = esc.get(k)
        if e is None:
            e = esc[k] = escaped_key(found[k][0])
        return e
    counts = collections.Counter(dotted)
    use_esc = [counts[d] > 1 for d in dotted] if len(counts) < len(dotted) else [False] * len(dotted)
    while any(use_esc):  # an escaped key must not equal a dotted key that stays dotted
        taken = {escaped_of(k) for k, u in enumerate(use_esc) if u}
        more = [not u and d in taken for d, u in zip(dotted, use_esc)]
        if not any(more):
            break
        use_esc = [u or m for u, m in zip(use_esc, more)]
    keys = {(escaped_of(k) if u else d): node for k, (d, u, (_, node)) in enumerate(zip(dotted, use_esc, found))}
    return keys, ({escaped_of(k): node for k, (_, node) in enumerate(found)} if escaped else {})


def tensor_paths(n: Any) -> dict[str, Any]:
    """Key -> tensor/ndarray node, for the lazy reader (see :func:`tensor_keys`)."""
    return tensor_keys(n, escaped=False)[0]
