"""Reading an export source and finding the model weights in it."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..torchfile import read_safetensors
from .errors import ExportError, NoFloatWeightsError

MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict", "model_state", "weights", "params")
OPTIM_KEYS = ("optimizer", "optim", "opt", "optimizer_states", "optimizer_state", "optimizer_state_dict",
              "lr_scheduler", "scheduler", "lr_schedulers")

def read_source(src: Any) -> tuple[Any, str]:
    """(the object, a description). SRC: a state dict, a .ckz, a safetensors file, a ckptzip DCP
    directory (``ckptzip.dcp.Writer``) or a torch file (read without pickle: tensors, containers,
    numbers, strings, numpy data and RNG states). Nothing from a file runs code: a DCP directory of
    torch's own FileSystemWriter keeps its metadata as a pickle and is refused."""
    if isinstance(src, Mapping):
        return src, "<in-memory state dict>"
    path = os.fspath(src)
    if os.path.isdir(path):
        from ..dcp import is_checkpoint_dir
        if is_checkpoint_dir(path):
            import tempfile

            import ckptzip
            from ..dcp import consolidate
            with tempfile.TemporaryDirectory() as d:
                consolidate(path, os.path.join(d, "s.ckz"))
                return ckptzip.load(os.path.join(d, "s.ckz"), map_location="cpu"), path
        if os.path.exists(os.path.join(path, ".metadata")):
            raise ExportError(f"{path}: a torch.distributed.checkpoint directory of FileSystemWriter keeps "
                              f"its metadata as a pickle, which ckptzip does not run; if you trust it, "
                              f"convert it with torch's dcp_to_torch_save first, or save with "
                              f"ckptzip.dcp.Writer")
        st = os.path.join(path, "model.safetensors")
        if os.path.exists(st):
            return read_safetensors(st)[0], st
    if path.endswith(".safetensors"):
        return read_safetensors(path)[0], path
    import ckptzip
    try:
        with ckptzip.open(path):
            pass
        return ckptzip.load(path, map_location="cpu"), path
    except ckptzip.CkptzipError:
        if path.endswith(".ckz"):
            raise
    from ..torchfile import load_torch_file
    return load_torch_file(path), path


def _is_tensor_dict(d: Any) -> bool:
    return isinstance(d, Mapping) and any(isinstance(v, torch.Tensor) for v in _flat(d).values())


_SCALARS = (int, float, str, bool, type(None), bytes)


def _holds_tensors(v: Any, depth: int = 0) -> bool:
    """Whether a tensor lies anywhere in ``v`` (dicts, lists and tuples; 64 levels deep at most;
    plain scalars skipped without a call: a sampler's list of millions of ints is quick)."""
    if isinstance(v, torch.Tensor):
        return True
    if depth >= 64:
        return False
    items = v.values() if isinstance(v, Mapping) else v if isinstance(v, (list, tuple)) else ()
    return any(_holds_tensors(x, depth + 1) for x in items if type(x) not in _SCALARS)


def _root_key(obj: Mapping, key: str) -> str:
    """The top-level key that holds ``key``: itself where it is one (a name with dots, such as
    "model.ema"), else the first part of the dotted path."""
    return key if key in {str(k) for k in obj} else key.split(".")[0]


def _flat(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _is_optimizer(key: str, v: Any) -> bool:
    if str(key).lower() in OPTIM_KEYS:
        return True
    if isinstance(v, Mapping) and ("param_groups" in v or "exp_avg" in v or "exp_avg_sq" in v):
        return True
    if isinstance(v, Mapping):
        flat = _flat(v)
        return any(k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq", "momentum_buffer") for k in flat)
    return False


def _duplicate_of(low: dict[str, Any], high: dict[str, Any]) -> bool:
    """``low``'s tensors are ``high``'s cast to a lower-precision float dtype."""
    if low.keys() != high.keys():
        return False
    lower = False
    for k, a in low.items():
        b = high[k]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        if a.is_floating_point() and b.is_floating_point():
            if a.element_size() > b.element_size():
                return False
            if a.element_size() < b.element_size():
                lower = True
            if not torch.equal(a, b.to(a.dtype)):
                return False
        elif not torch.equal(a, b):
            return False
    return lower


def find_weights(obj: Any, model_key: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat {name: tensor} of the model weights, notes for the report: which key, what was dropped)."""
    notes: dict[str, Any] = {"model_key": None, "dropped": {}}
    if not isinstance(obj, Mapping):
        raise NoFloatWeightsError(f"source is a {type(obj).__name__}, not a dict of tensors; no float weights found")
    top_keys = [str(k) for k in obj.keys()]
    if model_key is not None:
        node: Any = obj
        if model_key in obj:
            node = obj[model_key]
        else:
            for part in model_key.split("."):
                if not isinstance(node, Mapping) or part not in node:
                    raise NoFloatWeightsError(f"model_key {model_key!r} not found; top-level keys: {top_keys}")
                node = node[part]
        if not _is_tensor_dict(node):
            raise NoFloatWeightsError(f"model_key {model_key!r} holds no tensors; top-level keys: {top_keys}")
        weights, notes["model_key"] = _flat(node), model_key
        root = _root_key(obj, model_key)
        for k, v in obj.items():
            if str(k) != root and _is_optimizer(k, v):
                notes["dropped"][str(k)] = "optimizer state"
    else:
        cands = {str(k): v for k, v in obj.items() if _is_tensor_dict(v)}
        optim = {k for k, v in cands.items() if _is_optimizer(k, v)}
        for k in optim:
            notes["dropped"][k] = "optimizer state"
        cands = {k: v for k, v in cands.items() if k not in optim}
        flat_c = {k: _flat(v) for k, v in cands.items()}
        for k in list(flat_c):  # duplicate precision copies: keep the higher-precision master
            for m in flat_c:
                if m != k and k in flat_c and m in flat_c and _duplicate_of(flat_c[k], flat_c[m]):
                    notes["dropped"][k] = f"duplicate lower-precision copy of {m!r}"
                    del flat_c[k]
                    break
        chosen = next((k for k in MODEL_KEYS if k in flat_c), None)
        if chosen is None and len(flat_c) == 1:
            chosen = next(iter(flat_c))
        if chosen is not None:
            weights, notes["model_key"] = flat_c[chosen], chosen
            for k in flat_c:
                if k != chosen:
                    notes["dropped"][k] = f"not the model weights (pass model_key={k!r} to export it)"
        else:
            top = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
            if not top and flat_c:
                raise NoFloatWeightsError(f"several weight dicts {sorted(flat_c)} and none named like a model; "
                                          f"pass model_key (top-level keys: {top_keys})")
            weights = top
            for k in flat_c:
                notes["dropped"][k] = f"not the model weights (pass model_key={k!r} to export it)"
    # every other top-level entry that holds tensors is dropped too, lists included (Lightning's
    # optimizer_states, an RNG state tensor): the report names each one
    root = _root_key(obj, notes["model_key"]) if notes["model_key"] is not None else None
    for k, v in obj.items():
        k = str(k)
        if k in notes["dropped"] or k == root or (root is None and isinstance(v, torch.Tensor)):
            continue  # (no model dict: the top-level tensors are the weights)
        if _holds_tensors(v):
            optim = _is_optimizer(k, v) or (isinstance(v, (list, tuple)) and any(_is_optimizer(k, x) for x in v))
            notes["dropped"][k] = "optimizer state" if optim else "not the model weights"
    weights = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    if not any(v.is_floating_point() for v in weights.values()):
        raise NoFloatWeightsError(f"no float weights found; top-level keys: {top_keys}")
    return weights, notes
