"""Reading and writing the files the CLI converts from and to: ``torch.save`` files (read without
arbitrary pickle) and safetensors files (read and written by a small validating parser of our own).

``load_torch_file(path)`` tells the formats apart by their first bytes, never by the file name:

* a ``.ckz`` file is refused (it is already compressed; use ``ckptzip convert``);
* a safetensors file (little-endian u64 header length N, then N bytes of JSON starting with ``{``)
  is read by :func:`read_safetensors`, which validates every name, dtype, shape and offset before
  reading any tensor data;
* a ``torch.save`` file (zip archive, or the legacy pickle format) is read with
  ``torch.load(weights_only=True)``, with the numpy globals that plain training checkpoints need
  (numpy arrays, scalars and dtypes, as in ``np.random.get_state()``) allowed for that one call;
  ``allow_pickle=True`` reads it with ``weights_only=False`` (arbitrary code: trusted files only);
* anything else raises :class:`InputFormatError`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .errors import CkptzipError
from .format import MAGIC
from .validate import strict_json

__all__ = ["InputFormatError", "load_torch_file", "read_safetensors", "write_safetensors",
           "flatten_tensors", "sniff", "SAFETENSORS_DTYPES"]


class InputFormatError(CkptzipError, ValueError):
    """An input file that is not what it must be (not a torch.save file, a malformed safetensors
    file, an object that cannot be written as safetensors)."""


# --------------------------------------------------------------------------------------------
# format detection

#: largest safetensors JSON header we accept (the reference implementation's limit is 100 MB)
MAX_SAFETENSORS_HEADER = 100_000_000


def sniff(path: str | os.PathLike) -> str:
    """``"ckz"``, ``"safetensors"``, ``"torch-zip"``, ``"torch-legacy"`` or ``"unknown"``, from
    the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(16)
        size = os.fstat(f.fileno()).st_size
    if head.startswith(MAGIC):
        return "ckz"
    if len(head) >= 9:
        n = int.from_bytes(head[:8], "little")
        if 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER) and head[8:9] == b"{":
            return "safetensors"
    if head.startswith(b"PK\x03\x04"):
        return "torch-zip"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "torch-legacy"  # a pickle stream (torch's legacy format starts with one)
    return "unknown"


# --------------------------------------------------------------------------------------------
# torch.save files without arbitrary pickle

def _numpy_safe_globals() -> list:
    """The numpy functions and classes that pickles of numpy arrays, scalars and dtypes name,
    under both their numpy 2 (``numpy._core``) and numpy 1 (``numpy.core``) module names (a file
    written under one numpy must load under the other)."""
    try:
        from numpy._core import multiarray as ma
    except ImportError:  # numpy < 1.26 has only numpy.core
        from numpy.core import multiarray as ma  # type: ignore[no-redef]
    out: list = [np.ndarray, np.dtype]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out += [(ma._reconstruct, f"{mod}._reconstruct"), (ma.scalar, f"{mod}.scalar")]
    # BUILD on a dtype checks the instance's class: numpy 2 has one class per dtype
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [c for c in vars(dtypes).values() if isinstance(c, type) and issubclass(c, np.dtype)]
    return out


@contextlib.contextmanager
def numpy_safe_globals() -> Iterator[None]:
    """Allow the numpy globals of :func:`_numpy_safe_globals` in ``torch.load(weights_only=True)``
    for the duration of the block only (the process-wide allowlist is left as it was)."""
    with torch.serialization.safe_globals(_numpy_safe_globals()):
        yield


def load_torch_file(path: str | os.PathLike, allow_pickle: bool = False) -> Any:
    """Read a ``torch.save`` file (or a safetensors file) onto the CPU.

    Without ``allow_pickle`` no code from the file runs: ``torch.load(weights_only=True)`` with
    numpy arrays, scalars and dtypes allowed (what ``ckptzip.save`` can store: tensors, containers,
    numbers, strings, numpy data and the RNG states of ``random``, numpy and torch). A file that
    needs other classes raises :class:`~ckptzip.PickleNotAllowedError`; with ``allow_pickle=True``
    it is read with ``weights_only=False`` (only for files you trust).
    Raises :class:`InputFormatError` for files that are neither torch nor safetensors files and
    ``OSError`` for files that cannot be read.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "is a directory, not a checkpoint file", path)
    kind = sniff(path)
    if kind == "ckz":
        raise InputFormatError(f"{path!r} is already a .ckz file (use `ckptzip convert` to re-encode it)")
    if kind == "safetensors":
        return read_safetensors(path)[0]
    if kind == "unknown":
        raise InputFormatError(f"{path!r} is not a torch.save or safetensors file")
    from .errors import PickleNotAllowedError
    if allow_pickle:
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except (OSError, CkptzipError):
            raise
        except Exception as e:
            raise InputFormatError(f"{path!r}: torch.load failed: {_first_line(e)}") from None
    import pickle
    try:
        with numpy_safe_globals():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "GLOBAL" in msg or "global" in msg.lower() and "allowed" in msg:
            raise PickleNotAllowedError(
                f"{path!r} holds objects that need pickle{_unsupported_global(msg)}; pass "
                f"--allow-pickle (allow_pickle=True) only if you trust the file's source") from None
        raise InputFormatError(f"{path!r} is not a readable torch.save file: {_detail(e)}") from None
    except (OSError, CkptzipError):
        raise
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError... on damaged files
        raise InputFormatError(f"{path!r} is not a readable torch.save file: "
                               f"{type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0][:300] if lines else type(e).__name__


def _detail(e: BaseException) -> str:
    """The informative line of a weights-only unpickler error (torch wraps it in boilerplate)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    lines = [s for s in lines if not s.startswith(("Weights only load failed", "Check the documentation",
                                                   "Please file an issue"))] or lines
    return lines[0][:300] if lines else type(e).__name__


def _unsupported_global(msg: str) -> str:
    import re
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    return f" (such as {m.group(1)})" if m else ""


# --------------------------------------------------------------------------------------------
# safetensors

#: safetensors dtype names -> torch dtypes (those this torch has)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
        ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"),
        ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("U8", "uint8"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
        ("C64", "complex64"), ("C128", "complex128"),
    ) if isinstance(getattr(torch, attr, None), torch.dtype)
}
_TORCH_TO_ST = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _parse_safetensors_header(raw: bytes, buffer_len: int) -> tuple[dict, dict[str, str]]:
    """Validate the JSON header against a data buffer of ``buffer_len`` bytes."""
    doc = strict_json(raw, lambda m: InputFormatError(f"safetensors header: {m}"), "JSON")
    if not isinstance(doc, dict):
        raise InputFormatError("safetensors header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise InputFormatError("safetensors __metadata__ must map strings to strings")
    spans = []
    for name, e in doc.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise InputFormatError(f"safetensors entry {name!r}: needs exactly dtype, shape, data_offsets")
        dt = SAFETENSORS_DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dt is None:
            raise InputFormatError(f"safetensors entry {name!r}: unsupported dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or len(shape) > 64 or \
                not all(type(n) is int and n >= 0 for n in shape):
            raise InputFormatError(f"safetensors entry {name!r}: invalid shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(n) is int for n in offs) \
                or not 0 <= offs[0] <= offs[1] <= buffer_len:
            raise InputFormatError(f"safetensors entry {name!r}: data_offsets {offs!r} outside the "
                                   f"{buffer_len}-byte data buffer")
        if math.prod(shape) * dt.itemsize != offs[1] - offs[0]:
            raise InputFormatError(f"safetensors entry {name!r}: shape {shape} of {e['dtype']} needs "
                                   f"{math.prod(shape) * dt.itemsize} bytes, offsets give "
                                   f"{offs[1] - offs[0]}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos = 0
    for b, e, name in spans:  # the buffer is indexed entirely, without overlaps or holes
        if b != pos:
            raise InputFormatError(f"safetensors entry {name!r}: data at {b} "
                                   f"{'overlaps the previous entry' if b < pos else f'leaves a hole after {pos}'}")
        pos = e
    if pos != buffer_len:
        raise InputFormatError(f"safetensors data buffer has {buffer_len - pos} unindexed trailing bytes")
    return doc, meta


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file, on the CPU, in header order. Every entry is
    validated (dtype, shape, offsets inside the buffer and consistent with the shape, no overlaps
    or holes, no duplicate names) before any tensor data is read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise InputFormatError(f"{os.fspath(path)!r}: too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > MAX_SAFETENSORS_HEADER or n > size - 8:
            raise InputFormatError(f"{os.fspath(path)!r}: safetensors header length {n} exceeds the file "
                                   f"or the {MAX_SAFETENSORS_HEADER}-byte limit")
        raw = f.read(n)
        if len(raw) != n:
            raise InputFormatError(f"{os.fspath(path)!r}: safetensors header is truncated")
        base = 8 + n
        doc, meta = _parse_safetensors_header(raw, size - base)
        out: dict[str, torch.Tensor] = {}
        for name, e in doc.items():
            dt = SAFETENSORS_DTYPES[e["dtype"]]
            b, end = e["data_offsets"]
            buf = torch.empty(end - b, dtype=torch.uint8)
            if end > b:
                f.seek(base + b)
                got = f.readinto(memoryview(buf.numpy()))
                if got != end - b:
                    raise InputFormatError(f"{os.fspath(path)!r}: file ends inside tensor {name!r}")
            if dt == torch.bool and buf.numel() and int(buf.max()) > 1:
                raise InputFormatError(f"safetensors entry {name!r}: BOOL bytes other than 0 and 1")
            t = buf.view(dt)
            if sys.byteorder == "big" and dt.itemsize > 1:
                t = torch.from_numpy(t.numpy().byteswap())  # pragma: no cover
            out[name] = t.reshape(e["shape"])
    return out, meta


def flatten_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """A nested state dict (dicts, lists, tuples) as ``{dotted.key: tensor}``; numpy arrays become
    tensors. Raises :class:`InputFormatError` naming the first few non-tensor values, or two
    entries that flatten to the same key."""
    out: dict[str, torch.Tensor] = {}
    bad: list[str] = []

    def walk(x: Any, key: str) -> None:
        if isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            for i, v in enumerate(x):
                walk(v, f"{key}.{i}" if key else str(i))
        elif isinstance(x, (torch.Tensor, np.ndarray)):
            if key in out:
                raise InputFormatError(f"two entries flatten to the same safetensors key {key!r}")
            if isinstance(x, np.ndarray):
                try:
                    x = torch.from_numpy(np.ascontiguousarray(x))
                except TypeError:
                    bad.append(f"{key!r} (numpy {x.dtype})")
                    return
            out[key] = x
        else:
            bad.append(f"{key!r} ({type(x).__name__})")
    walk(obj, "")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise InputFormatError(f"safetensors holds only tensors; not tensors: {', '.join(bad[:5])}{more} "
                               f"(write a torch.save file instead: --format torch)")
    return out


def write_safetensors(obj: Any, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                      fsync: bool = True) -> int:
    """Write ``obj`` (a possibly nested state dict of tensors) as a safetensors file, atomically.
    Tensors sharing storage are written as separate copies, non-contiguous ones contiguously,
    CUDA ones from the CPU. ``metadata`` (str -> str) goes to ``__metadata__``. Returns the file
    size in bytes."""
    from .storage import open_for_write
    tensors = flatten_tensors(obj)
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise InputFormatError("safetensors metadata must map strings to strings")
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name, t in tensors.items():
        if name == "__metadata__":
            raise InputFormatError("a tensor named '__metadata__' cannot be written as safetensors")
        st = _TORCH_TO_ST.get(t.dtype)
        if st is None or t.layout != torch.strided or t.is_quantized:
            raise InputFormatError(f"tensor {name!r} of dtype {t.dtype} cannot be written as safetensors")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data buffer starts 8-byte aligned, as the reference writer does
    with open_for_write(path, fsync=fsync) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                c = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
                f.write(memoryview(c.reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(raw) + pos
