"""export(): a weights-only, opt-in lossy artifact from any checkpoint ckptzip reads; the lossy
.ckz convention (docs/export.md); readers and the guard that resume paths call."""
from __future__ import annotations

import fnmatch
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import ckptzip

from . import alloc
from .errors import (BudgetError, DestinationError, ExportError, LossyCheckpointError,
                     NonFiniteWeightError, SchemeError)
from .quant import _quantize, check_scheme_dtype, dequantize, parse_scheme
from .sources import find_weights, read_source

FORMAT = "ckptzip-lossy/1"
META_LOSSY = "ckptzip.lossy"
META_SCHEME = "ckptzip.lossy.scheme"
DEFAULT_BPW = 4.5                 # scheme="auto" without eval_fn and without a budget
DEFAULT_MAX_LOSS_INCREASE = 0.001  # scheme="auto" with eval_fn and without a budget (+0.1 %)
Progress = Callable[[int, int], None]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_dst(src: Any, dst: str, force: bool, fmt: str) -> None:
    if isinstance(src, (str, os.PathLike)):
        if os.path.realpath(os.fspath(src)) == os.path.realpath(dst):
            raise DestinationError(f"destination {dst!r} is the source; choose another path")
    if os.path.exists(dst) and not force:
        raise DestinationError(f"destination {dst!r} exists; pass force=True (--force) to overwrite")


def _classify(weights: Mapping[str, torch.Tensor], keep: Iterable[str], nonfinite: str):
    quant, kept = [], {}
    keep = tuple(keep)
    for n, t in weights.items():
        if not t.is_floating_point():
            kept[n] = "not float"
        elif t.ndim < 2:
            kept[n] = "vector (ndim < 2)"
        elif any(fnmatch.fnmatchcase(n, p) for p in keep):
            kept[n] = "keep pattern"
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            kept[n] = "already fp8"
        elif t.numel() == 0:
            kept[n] = "empty"
        elif not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            if nonfinite == "refuse":
                raise NonFiniteWeightError(f"tensor {n!r} holds {bad} NaN/Inf values; fix the checkpoint or "
                                           f"pass nonfinite='keep' to store it losslessly")
            kept[n] = f"{bad} NaN/Inf values (kept exactly)"
        else:
            quant.append(n)
    return quant, kept


def _measure_stored(tree: dict, device: str) -> int:
    """Bytes ckptzip stores for ``tree`` coded on ``device`` (written to a temporary file and
    measured: the export is then written there too, so the measure is the export's size)."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "m.ckz")
        ckptzip.save(tree, p, fsync=False, device=device)
        return os.path.getsize(p)


def export(src: Any, dst: str | os.PathLike, *, scheme: str | Mapping[str, str] = "auto", bpw: float | None = None,
           max_loss_increase: float | None = None, eval_fn: Callable[[dict], float] | None = None,
           keep: Iterable[str] = (), model_key: str | None = None, format: str = "ckz",  # noqa: A002
           force: bool = False, progress: Progress | None = None, nonfinite: str = "refuse",
           dtype: torch.dtype = torch.bfloat16, device: str | None = None,
           candidates: Iterable[str] | None = None, search: bool = True, measure: bool = True,
           sensitivity: Mapping[str, Any] | None = None, damage_model: str = "measured", correct: bool = True,
           max_evals: int = 16) -> dict[str, Any]:
    """Write a weights-only lossy export of ``src`` to ``dst`` and return the report.

    ``scheme``: ``"auto"`` (per-tensor allocation), or one scheme for every quantizable tensor
    (``"bf16"``, ``"fp8"``, ``"int8"``, ``"int6"``, ``"int5"``, ``"int4"``, ``"int4-g32"``,
    ``"int3-g32-sym"`` ...). ``bpw``: bits-per-weight budget of the quantized tensors;
    ``max_loss_increase``: relative loss budget (needs ``eval_fn``, e.g. 0.001 = +0.1 %).
    ``eval_fn(weights) -> float``: loss on held-out data for a dict of (dequantized) weights.
    ``keep``: fnmatch patterns of tensors stored losslessly. ``nonfinite``: ``"refuse"`` (default:
    NonFiniteWeightError naming the tensor) or ``"keep"`` (store such tensors exactly).
    ``format``: ``"ckz"`` (one lossy .ckz) or ``"compressed-tensors"`` (a directory). The library
    prints nothing; ``progress(done, total)`` is called as tensors are measured and quantized.
    ``device``: where the export quantizes, measures its stored size and codes the .ckz (default:
    the GPU if there is one); a GPU's codec and the CPU's store the same codes at slightly
    different sizes, so a ``bpw`` target is met for the device that writes.

    ``scheme="auto"`` options: ``sensitivity``: a table from ``alloc.measure`` (same candidates,
    same eval_fn) to reuse instead of measuring again; ``damage_model``: ``"fit"`` or ``"measured"``
    (alloc.effective); ``correct``: re-measure the joint choice and back off until the measured
    loss increase is within ``max_loss_increase`` (at most ``max_evals`` evals); with ``bpw`` and
    ``measure``, the stored bpw is brought to the largest value <= ``bpw``.
    """
    t0 = time.perf_counter()
    dst = os.fspath(dst)
    if format not in ("ckz", "compressed-tensors"):
        raise ExportError(f"unknown format {format!r} (ckz or compressed-tensors)")
    if nonfinite not in ("refuse", "keep"):
        raise ExportError(f"nonfinite must be 'refuse' or 'keep', not {nonfinite!r}")
    _check_dst(src, dst, force, format)
    if isinstance(src, (str, os.PathLike)) and os.path.isfile(src) and is_lossy(src):
        raise ExportError(f"source {os.fspath(src)!r} is already a lossy export; export from the lossless checkpoint")
    obj, src_desc = read_source(src)
    weights, notes = find_weights(obj, model_key)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    quant_names, kept_reasons = _classify(weights, keep, nonfinite)
    work = {n: weights[n].detach().to(dev) for n in quant_names}
    n_weights = sum(work[n].numel() for n in quant_names)
    t_load = time.perf_counter() - t0

    # -- quantized entries, cached per (tensor, scheme): the correction rounds and the final
    # export use the very same codes
    cache: dict[tuple[str, str], dict] = {}
    params: dict[tuple[str, str], tuple] = {}  # intN (scales, zeros) found by alloc.measure's search

    def entry(n: str, s: str) -> dict:
        if (n, s) not in cache:
            e, bits, _ = _quantize(work[n], s, search=search, name=n, params=params.get((n, s)) if search else None)
            e["q"]["bits_est"] = bits
            cache[(n, s)] = e
        return cache[(n, s)]

    def _codes_tree(c: Mapping[str, str]) -> dict:
        return {"tensors": {n: {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                for k, v in entry(n, c[n]).items() if k in ("codes", "scales", "zeros")}
                            for n in quant_names}}

    def predicted_bits(c: Mapping[str, str]) -> float:
        return sum(table[n][c[n]]["bits"] for n in quant_names)

    def joint_loss(c: Mapping[str, str]) -> float:
        full = dict(weights)
        for n in quant_names:
            full[n] = dequantize(entry(n, c[n]), dtype=dtype, device=weights[n].device).to(weights[n].dtype)
        return float(eval_fn(full))

    def _uniform_guard(choice: dict[str, str], target_bits: float) -> tuple[dict[str, str], dict[str, Any]]:
        """Single-tensor damages miss interactions (at 2-3 bits they add up super-linearly), so with
        eval_fn the allocation is compared, measured jointly, with the largest uniform candidate
        whose stored size also fits; the better of the two is kept (two evals)."""
        fits = []
        for s in sorted(cands, key=lambda s: -sum(table[n][s]["bits"] for n in quant_names)):
            u = {n: s for n in quant_names}
            if sum(table[n][s]["bits"] for n in quant_names) <= target_bits * 1.05 and \
                    8 * _measure_stored(_codes_tree(u), dev) <= target_bits:
                fits.append(u)
                break
        info: dict[str, Any] = {"allocation": joint_loss(choice) - base}
        if fits:
            info["uniform"], info["uniform_scheme"] = joint_loss(fits[0]) - base, next(iter(fits[0].values()))
            if info["uniform"] < info["allocation"]:
                info["picked"] = "uniform"
                return fits[0], info
        info["picked"] = "allocation"
        return choice, info

    # -- choose schemes --------------------------------------------------------------------
    table, base, mode, eff = None, None, "uniform", None
    correction: dict[str, Any] = {}
    if isinstance(scheme, str) and scheme == "auto":
        if max_loss_increase is not None and eval_fn is None:
            raise BudgetError("max_loss_increase needs eval_fn (a loss on held-out data); use bpw= without one")
        if bpw is None and max_loss_increase is None:
            if eval_fn is not None:
                max_loss_increase = DEFAULT_MAX_LOSS_INCREASE
            else:
                bpw = DEFAULT_BPW
        cands = tuple(candidates or alloc.AUTO_CANDIDATES)
        for n in quant_names:
            check_scheme_dtype(n, work[n], parse_scheme(cands[0]))
        if sensitivity is not None:
            table = {n: dict(sensitivity[n]) for n in quant_names if n in sensitivity}
            if len(table) != len(quant_names) or any(not set(cands) <= set(table[n]) for n in table):
                raise ExportError("sensitivity table does not cover every quantized tensor and candidate")
            table = {n: {s: table[n][s] for s in cands} for n in table}
            base = float(eval_fn(dict(weights))) if eval_fn is not None else None
        else:
            full = {**{k: v.to(dev) for k, v in weights.items() if k not in work}, **work}
            table, base = alloc.measure(full, quant_names, cands, eval_fn, progress, dtype, eval_weights=weights,
                                        params=params)
        budget_bits = None if bpw is None else bpw * n_weights
        if budget_bits is not None:
            cheapest = sum(min(r["bits"] for r in table[n].values()) for n in quant_names)
            if cheapest > budget_bits + 1e-6:
                raise BudgetError(f"bpw {bpw} is below the cheapest allocation "
                                  f"({cheapest / max(n_weights, 1):.3f} bits per weight)")
        max_damage = None if max_loss_increase is None else max_loss_increase * abs(base)
        mode = "eval" if eval_fn is not None else "proxy"
        if mode == "eval":
            correction["clean"] = {}
            eff = alloc.effective(table, damage_model, correction["clean"])
        else:
            eff = table
        choice = alloc.allocate(eff, budget_bits=budget_bits, max_damage=max_damage)
        if correct and budget_bits is not None and measure:
            choice, correction["size"] = alloc.target_size(
                eff, lambda c: 8 * _measure_stored(_codes_tree(c), dev), budget_bits, max_damage=max_damage)
            if not correction["size"]["met"]:
                raise BudgetError(f"bpw {bpw} is below the smallest stored allocation "
                                  f"({correction['size']['stored_bits'] / max(n_weights, 1):.3f} bits per weight)")
            if eval_fn is not None and max_damage is None:
                choice, correction["size"]["guard"] = _uniform_guard(choice, budget_bits)
        if correct and max_damage is not None and eval_fn is not None:
            target = budget_bits
            cap = None if target is None else target - max(correction["size"]["stored_bits"] - predicted_bits(choice), 0.0)
            for _ in range(3 if cap is not None else 1):
                choice, correction["loss"] = alloc.correct_loss(eff, lambda c: joint_loss(c) - base, max_damage,
                                                                budget_bits=cap, max_evals=max_evals)
                if cap is None or not measure:
                    break
                stored = 8 * _measure_stored(_codes_tree(choice), dev)
                correction["size"]["stored_bits"], correction["size"]["met"] = stored, stored <= target
                if stored <= target:
                    break
                cap -= 1.1 * (stored - target)  # both budgets: the size wins, the loss is reported
    elif isinstance(scheme, Mapping):  # an explicit per-tensor choice (e.g. from alloc.allocate)
        missing = [n for n in quant_names if n not in scheme]
        if missing:
            raise SchemeError(f"scheme mapping has no entry for {missing[:5]}")
        choice = {n: parse_scheme(scheme[n]).name for n in quant_names}
        for n in quant_names:
            check_scheme_dtype(n, work[n], parse_scheme(choice[n]))
        mode = "explicit"
    else:
        sc = parse_scheme(scheme)
        for n in quant_names:
            check_scheme_dtype(n, work[n], sc)
        choice = {n: sc.name for n in quant_names}

    # -- quantize --------------------------------------------------------------------------
    entries, rows = {}, {}
    for i, n in enumerate(quant_names):
        e = dict(entry(n, choice[n]))
        e["q"] = dict(e["q"])
        if table is not None:
            e["q"]["loss_delta"] = table[n][choice[n]]["damage"] if mode == "eval" else None
            e["q"]["proxy"] = table[n][choice[n]]["damage"] if mode == "proxy" else None
        entries[n] = e
        rows[n] = {"scheme": e["q"]["scheme"], "shape": list(work[n].shape), "numel": work[n].numel(),
                   "dtype": _dtype_name(work[n]), "err": e["q"]["err"],
                   "bpw_est": e["q"]["bits_est"] / work[n].numel(),
                   "loss_delta": e["q"].get("loss_delta")}
        if mode == "eval" and eff is not None:
            rows[n]["loss_delta_clean"] = eff[n][choice[n]].get("damage_clean")
        if progress is not None and table is None:
            progress(i + 1, len(quant_names))
    t_quant = time.perf_counter() - t0 - t_load

    # -- verify with one eval of the full choice ---------------------------------------------
    loss = {"base": None, "predicted": None, "measured": None, "change_pct": None}
    if eval_fn is not None:
        full = {k: v for k, v in weights.items()}
        if base is None:
            base = float(eval_fn(full))
        for n, e in entries.items():
            full[n] = dequantize(e, dtype=dtype, device=weights[n].device).to(weights[n].dtype)
        lc = correction.get("loss")
        measured = float(eval_fn(full))  # one more eval of the exported codes: the reported figure
        loss.update(base=base, measured=measured, change_pct=100.0 * (measured - base) / abs(base))
        if table is not None and mode == "eval":
            loss["predicted"] = base + alloc.predicted(table, choice)[1]
            if eff is not None:
                loss["predicted_fit"] = base + alloc.predicted(eff, choice)[1]
        if lc:
            loss["met"] = (measured - base) <= max_loss_increase * abs(base)

    cpu_entries = {n: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
                   for n, e in entries.items()}
    kept = {n: weights[n].detach().cpu() for n in kept_reasons}
    est_bits = sum(e["q"]["bits_est"] for e in entries.values())
    report: dict[str, Any] = {
        "format": format, "source": src_desc, "model_key": notes["model_key"], "dropped": notes["dropped"],
        "scheme": scheme if isinstance(scheme, str) else "explicit", "mode": mode,
        "budget": {"bpw": bpw, "max_loss_increase": max_loss_increase},
        "quantized": rows, "kept": kept_reasons,
        "n_quantized_weights": n_weights,
        "source_weight_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "bpw_est": est_bits / max(n_weights, 1),
        "loss": loss,
        "correction": _plain(correction),
        "time_s": {"load": t_load, "quantize": t_quant},
    }
    if measure and entries:
        stored = _measure_stored({"tensors": {n: {k: e[k] for k in ("codes", "scales", "zeros")}
                                              for n, e in cpu_entries.items()}}, dev)
        report["bpw"] = stored * 8 / n_weights
    else:
        report["bpw"] = None
    scheme_label = scheme if isinstance(scheme, str) and scheme != "auto" else \
        ("auto:" if scheme == "auto" else "explicit:") + ",".join(sorted(set(choice.values())))

    t_w = time.perf_counter()
    if format == "ckz":
        tree = {"format": FORMAT, "tensors": cpu_entries, "kept": kept, "report": _plain(report)}
        ckptzip.save(tree, dst, metadata={META_LOSSY: "1", META_SCHEME: scheme_label,
                                          "ckptzip.lossy.format": FORMAT}, device=dev)
        report["dst_bytes"] = os.path.getsize(dst)
    else:
        from .ctensors import write_compressed_tensors
        report["dst_bytes"] = write_compressed_tensors(dst, cpu_entries, kept, report, force=force, dtype=dtype)
    report["time_s"]["write"] = time.perf_counter() - t_w
    report["time_s"]["total"] = time.perf_counter() - t0
    report["dst"] = dst
    return report


def _plain(o: Any) -> Any:
    """The report as plain containers (no tuples of mixed types, floats only where finite)."""
    if isinstance(o, Mapping):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return o


# -- reading --------------------------------------------------------------------------------
def is_lossy(path_or_reader: Any) -> bool:
    """True when the file (a path or an open CheckpointReader) is a lossy export."""
    if isinstance(path_or_reader, ckptzip.CheckpointReader):
        return path_or_reader.metadata.get(META_LOSSY) == "1"
    p = os.fspath(path_or_reader)
    if os.path.isdir(p):  # a compressed-tensors export: config.json with a quantization_config
        try:
            with open(os.path.join(p, "config.json")) as f:
                return "quantization_config" in json.load(f)
        except (OSError, ValueError):
            return False
    try:
        with ckptzip.open(p) as r:
            return r.metadata.get(META_LOSSY) == "1"
    except ckptzip.CkptzipError:
        return False


def ensure_lossless(path: Any) -> None:
    """Raise LossyCheckpointError when ``path`` is a lossy export (for resume paths)."""
    if is_lossy(path):
        name = path if not isinstance(path, ckptzip.CheckpointReader) else "this checkpoint"
        raise LossyCheckpointError(f"{os.fspath(name) if not isinstance(name, str) else name} is a lossy "
                                   f"weights-only export and cannot be resumed from; use a lossless checkpoint")


def _load_tree(path: Any) -> dict:
    p = os.fspath(path)
    with ckptzip.open(p, map_location="cpu") as r:
        if r.metadata.get(META_LOSSY) != "1":
            raise ExportError(f"{p!r} is not a lossy export (no {META_LOSSY} metadata)")
        tree = r.load()  # the raw tree (ckptzip.load would dequantize)
    return _check_tree(tree, p)


def _check_tree(tree: Any, where: str) -> dict:
    if not isinstance(tree, Mapping) or tree.get("format") != FORMAT:
        raise ExportError(f"{where!r}: unknown lossy format {tree.get('format') if isinstance(tree, Mapping) else None!r}")
    return tree


def dequantize_tree(tree: Any, dtype: torch.dtype = torch.bfloat16, device: Any = None,
                    where: str = "lossy export") -> dict[str, torch.Tensor]:
    """{name: dequantized tensor (``dtype``)} of a lossy tree, plus its kept tensors as stored."""
    tree = _check_tree(tree, where)
    out = {n: dequantize(e, dtype=dtype, device=device) for n, e in tree["tensors"].items()}
    for n, t in tree["kept"].items():
        out[n] = t.to(device) if device is not None else t
    return out


def load_lossy(path: Any, dtype: torch.dtype = torch.bfloat16, device: str | None = None) -> dict[str, torch.Tensor]:
    """{name: dequantized tensor (``dtype``)} for every quantized tensor, plus the kept tensors as
    stored (what ``ckptzip.load`` returns for a lossy export)."""
    return dequantize_tree(_load_tree(path), dtype, device, os.fspath(path))


def load_codes(path: Any) -> dict[str, Any]:
    """The raw lossy tree: ``{"tensors": {name: {"q", "codes", "scales", "zeros"}}, "kept", "report"}``
    (unpack codes with ckptzip.lossy.unpack_codes)."""
    return dict(_load_tree(path))


__all__ = ["export", "is_lossy", "ensure_lossless", "load_lossy", "load_codes", "dequantize_tree",
           "SchemeError", "FORMAT"]
