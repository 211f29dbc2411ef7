"""Per-tensor scheme allocation under a bits-per-weight or a loss budget.

Each quantizable tensor t has options o (schemes) with a cost c[t][o] (estimated stored bits of
codes + scales + zeros) and a damage d[t][o]:
  * with ``eval_fn``: the measured loss increase when only t is quantized with o (others exact);
  * without: a calibration-free proxy, the relative squared error ||W - Q(W)||^2 / ||W||^2 times a
    role weight (ROLE_WEIGHTS: embeddings and the output head count 4x, other matrices 1x).
Damages are assumed additive. The search keeps, per tensor, the lower convex hull of its
(cost, damage) points and applies hull upgrades across all tensors in order of damage saved per
bit (the Lagrangian / greedy solution of the multiple-choice knapsack), until the bit budget is
spent (``bpw``) or the predicted loss increase is within budget (``max_loss_increase``).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .quant import dequantize, estimate_bits, quantize

# candidate schemes of scheme="auto", cheapest first (bf16 = no quantization beyond bf16 rounding)
AUTO_CANDIDATES = ("int2-g32", "int3-g64", "int3-g32", "int4-g128", "int4-g64", "int4-g32",
                   "int5-g128", "int6-g128", "int8-g128", "bf16")
ROLE_WEIGHTS = (("*embed*", 4.0), ("*tok*", 4.0), ("*wte*", 4.0), ("*wpe*", 4.0), ("*lm_head*", 4.0),
                ("*head*", 4.0), ("*output*", 4.0), ("*", 1.0))


def role_weight(name: str) -> float:
    low = name.lower()
    return next(w for pat, w in ROLE_WEIGHTS if fnmatch.fnmatchcase(low, pat))


def measure(weights: Mapping[str, torch.Tensor], names: Sequence[str], candidates: Sequence[str],
            eval_fn: Callable[[dict], float] | None, progress: Callable[[int, int], None] | None = None,
            dtype: torch.dtype = torch.bfloat16, eval_weights: Mapping[str, torch.Tensor] | None = None
            ) -> tuple[dict, float | None]:
    """{name: {scheme: {"bits", "damage", "err"}}} and the base loss (None without eval_fn).
    ``weights`` are quantized where they are (e.g. on the GPU); ``eval_fn`` sees ``eval_weights``
    (default: ``weights``), the caller's tensors on their own devices, one replaced at a time."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    base = None
    work = dict(weights if eval_weights is None else eval_weights)
    if eval_fn is not None:
        base = float(eval_fn(work))
    total, done = len(names) * len(candidates), 0
    for n in names:
        w = weights[n]
        table[n] = {}
        for s in candidates:
            e = quantize(w, s, name=n)
            row = {"bits": estimate_bits(e), "err": float(e["q"]["err"])}
            if eval_fn is not None:
                orig = work[n]
                work[n] = dequantize(e, dtype=dtype).to(device=orig.device, dtype=orig.dtype)
                row["damage"] = float(eval_fn(work)) - base
                work[n] = orig
            else:
                row["damage"] = role_weight(n) * row["err"] ** 2
            table[n][s] = row
            done += 1
            if progress is not None:
                progress(done, total)
    return table, base


def _hull(opts: dict[str, dict[str, float]]) -> list[str]:
    """Schemes on the lower convex hull of (bits, damage), cheapest first, damage decreasing."""
    pts = sorted(opts.items(), key=lambda kv: (kv[1]["bits"], max(kv[1]["damage"], 0.0)))
    hull: list[tuple[str, float, float]] = []
    for s, r in pts:
        c, d = r["bits"], max(r["damage"], 0.0)
        if hull and d >= hull[-1][2]:
            continue  # costs more, no better
        while len(hull) >= 2:
            (_, c1, d1), (_, c2, d2) = hull[-2], hull[-1]
            if (d1 - d2) * (c - c2) <= (d2 - d) * (c2 - c1):  # slope to the new point at least as steep
                hull.pop()
            else:
                break
        hull.append((s, c, d))
    return [s for s, _, _ in hull]


def allocate(table: dict[str, dict[str, dict[str, float]]], *, budget_bits: float | None = None,
             max_damage: float | None = None) -> dict[str, str]:
    """Per-tensor scheme: least damage within ``budget_bits``, or fewest bits with the
    predicted damage <= ``max_damage``."""
    hulls = {n: _hull(o) for n, o in table.items()}
    choice = {n: h[0] for n, h in hulls.items()}
    bits = sum(table[n][choice[n]]["bits"] for n in table)
    dmg = sum(max(table[n][choice[n]]["damage"], 0.0) for n in table)
    segs = []
    for n, h in hulls.items():
        for a, b in zip(h, h[1:]):
            dc = table[n][b]["bits"] - table[n][a]["bits"]
            dd = max(table[n][a]["damage"], 0.0) - max(table[n][b]["damage"], 0.0)
            segs.append((dd / max(dc, 1e-9), n, a, b))
    segs.sort(key=lambda s: -s[0])
    blocked: set[str] = set()
    for _, n, a, b in segs:
        if max_damage is not None and dmg <= max_damage:
            break
        if n in blocked or choice[n] != a:
            continue
        dc = table[n][b]["bits"] - table[n][a]["bits"]
        if budget_bits is not None and bits + dc > budget_bits:
            blocked.add(n)  # later segments of n are flatter and cost more: skip n from here on
            continue
        bits += dc
        dmg -= max(table[n][a]["damage"], 0.0) - max(table[n][b]["damage"], 0.0)
        choice[n] = b
    return choice


def predicted(table: dict, choice: dict[str, str]) -> tuple[float, float]:
    """(estimated bits, predicted damage) of a choice."""
    return (sum(table[n][s]["bits"] for n, s in choice.items()),
            sum(table[n][s]["damage"] for n, s in choice.items()))


def summarize(table: dict, choice: dict[str, str]) -> dict[str, Any]:
    return {n: {"scheme": s, **table[n][s]} for n, s in choice.items()}
