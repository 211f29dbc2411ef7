"""Per-tensor scheme allocation under a bits-per-weight or a loss budget.

Each quantizable tensor t has options o (schemes) with a cost c[t][o] (estimated stored bits of
codes + scales + zeros) and a damage d[t][o]:
  * with ``eval_fn``: the measured loss increase when only t is quantized with o (others exact);
  * without: a calibration-free proxy, the relative squared error ||W - Q(W)||^2 / ||W||^2 times a
    role weight (ROLE_WEIGHTS: embeddings and the output head count 4x, other matrices 1x).
Damages are assumed additive when choosing; they are not (quantizing several tensors interacts),
so export() re-measures the joint choice and corrects it (``correct_loss``). Single-tensor damages
near the eval noise floor are noisy (and often negative); ``effective()`` replaces them by a
per-tensor fit ``k_t * err^2`` (``model="fit"``) or clamps them at 0 (``model="measured"``), plus
a tiny ``err^2`` tie-break so that a bit budget is always spent on the largest remaining error.
The search keeps, per tensor, the lower convex hull of its
(cost, damage) points and applies hull upgrades across all tensors in order of damage saved per
bit (the Lagrangian / greedy solution of the multiple-choice knapsack), until the bit budget is
spent (``bpw``) or the predicted loss increase is within budget (``max_loss_increase``).
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .quant import _quantize, dequantize

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
            dtype: torch.dtype = torch.bfloat16, eval_weights: Mapping[str, torch.Tensor] | None = None,
            params: dict | None = None) -> tuple[dict, float | None]:
    """{name: {scheme: {"bits", "damage", "err"}}} and the base loss (None without eval_fn).
    ``weights`` are quantized where they are (e.g. on the GPU); ``eval_fn`` sees ``eval_weights``
    (default: ``weights``), the caller's tensors on their own devices, one replaced at a time.
    ``params`` (a dict) receives ``{(name, scheme): (scales, zeros)}`` of the intN candidates (the
    clipping search's result, small: 2-3 bytes per group), so that export() re-quantizes the chosen
    schemes without searching again (quant._quantize(params=...): the same entries)."""
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
            e, bits, prm = _quantize(w, s, name=n, pack=eval_fn is not None)  # packed codes only to evaluate
            if params is not None and prm is not None:
                params[(n, s)] = prm
            row = {"bits": bits, "err": float(e["q"]["err"])}
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
    if budget_bits is not None and (max_damage is None or dmg > max_damage):
        _fill(table, choice, budget_bits - bits)
    return choice


def _fill(table: dict, choice: dict[str, str], left: float) -> None:
    """Spend bits the hull walk left over (a tensor whose next hull step did not fit may still
    fit a scheme off the hull, or a jump over several steps): repeatedly take the single change
    with the largest damage reduction that fits the leftover bits."""
    while True:
        best = None
        for n, opts in table.items():
            c0, d0 = opts[choice[n]]["bits"], max(opts[choice[n]]["damage"], 0.0)
            for s, r in opts.items():
                dc, dd = r["bits"] - c0, d0 - max(r["damage"], 0.0)
                if dd > 0 and dc <= left and (best is None or dd > best[0]):
                    best = (dd, n, s, dc)
        if best is None:
            return
        _, n, s, dc = best
        choice[n] = s
        left -= dc


def proxy(name: str, row: Mapping[str, float]) -> float:
    """The calibration-free damage proxy of one (tensor, scheme): role weight * relative error^2."""
    return role_weight(name) * float(row.get("err", 0.0)) ** 2


def clean(table: dict[str, dict[str, dict[str, float]]], quantile: float = 0.25
          ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, Any]]:
    """Measured single-tensor damages made fit for allocation: (copy of ``table``, info).

    A single-tensor eval can measure ~0 or a negative increase for a scheme that does hurt (held-out
    noise, or quantizing one tensor lowering the loss by chance); the additive greedy then treats
    that scheme as free. Two rules, per entry, the raw value kept in ``damage_raw``:

    * floor: ``damage >= kappa * proxy`` (``proxy`` = role weight * err^2, the eval-free damage),
      ``kappa`` the ``quantile`` (25th percentile) of ``damage / proxy`` over the entries whose
      measured damage is clearly positive (> 2x the largest negative damage of the table, the noise
      level); no such entry: no floor;
    * monotone: per tensor, along its schemes from the finest (smallest err, then most bits) to the
      coarsest, a running max: a coarser scheme never has a lower damage than a finer one.

    info: ``kappa``, ``noise``, ``n_floored`` and ``n_monotone`` (entries each rule raised)."""
    dmg = [r["damage"] for opts in table.values() for r in opts.values()]
    noise = max([-d for d in dmg if d < 0], default=0.0)
    ratios = sorted(r["damage"] / p for n, opts in table.items() for r in opts.values()
                    if r["damage"] > 2 * noise and r["damage"] > 0 and (p := proxy(n, r)) > 0)
    kappa = ratios[min(int(quantile * len(ratios)), len(ratios) - 1)] if ratios else 0.0
    out: dict[str, dict[str, dict[str, float]]] = {}
    n_floor = n_mono = 0
    for n, opts in table.items():
        order = sorted(opts, key=lambda s: (opts[s].get("err", 0.0), -opts[s]["bits"]))
        run = -float("inf")
        row_out = {}
        for s in order:
            r = opts[s]
            d = r["damage"]
            f = kappa * proxy(n, r)
            if f > d:
                d, n_floor = f, n_floor + 1
            if run > d:
                d, n_mono = run, n_mono + 1
            run = d
            row_out[s] = {**r, "damage": d, "damage_raw": r["damage"]}
        out[n] = {s: row_out[s] for s in opts}
    return out, {"kappa": kappa, "noise": noise, "n_floored": n_floor, "n_monotone": n_mono}


def effective(table: dict[str, dict[str, dict[str, float]]], model: str = "fit",
              info: dict[str, Any] | None = None) -> dict:
    """A copy of ``table`` whose ``damage`` is what allocate() should optimize (the measured value
    stays in ``damage_measured``).

    ``"fit"``: per tensor, the least-squares ``k_t`` of ``damage ~ k_t * err^2`` over its schemes
    (dominated by the cheap schemes, whose damages stand far above the eval noise), so that the
    near-lossless schemes get a smooth, positive damage instead of noise; ``"measured"``: the
    measured damage clamped at 0. Both add ``1e-6 * (median k) * err^2`` (never 0), which only
    breaks ties: leftover bits go to the largest errors, instead of stopping where noise said 0.
    Both start from the cleaned damages (``clean``: floor ``kappa * proxy``, monotone in the
    scheme's error; kept in ``damage_clean``); ``info`` (a dict) receives ``clean``'s info."""
    if model not in ("fit", "measured"):
        raise ValueError(f"damage model must be 'fit' or 'measured', not {model!r}")
    raw = table
    table, cinfo = clean(raw)
    if info is not None:
        info.update(cinfo)
    ks = {}
    for n, opts in table.items():
        num = sum(r["damage"] * r["err"] ** 2 for r in opts.values())
        den = sum(r["err"] ** 4 for r in opts.values())
        ks[n] = max(num / den, 0.0) if den > 0 else 0.0
    pos = sorted(k for k in ks.values() if k > 0)
    tie = 1e-6 * (pos[len(pos) // 2] if pos else 1.0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for n, opts in table.items():
        out[n] = {}
        for s, r in opts.items():
            e2 = r["err"] ** 2
            d = ks[n] * e2 if model == "fit" else max(r["damage"], 0.0)
            out[n][s] = {**raw[n][s], "damage": d + tie * e2, "damage_measured": raw[n][s]["damage"],
                         "damage_clean": r["damage"]}
    return out


def cheapest(table: dict) -> dict[str, str]:
    """Every tensor at its cheapest scheme."""
    return {n: min(o, key=lambda s: o[s]["bits"]) for n, o in table.items()}


def correct_loss(table: dict, joint_damage: Callable[[dict[str, str]], float], max_damage: float, *,
                 budget_bits: float | None = None, max_evals: int = 8, slack: float = 0.85,
                 stall_tau: float = 3.0, stall_damage: float = 0.7
                 ) -> tuple[dict[str, str], dict[str, Any]]:
    """Meet a loss budget measured on the joint choice, not on the sum of single-tensor damages.

    Round 0 is the greedy choice for the predicted budget ``tau = max_damage``. Each round measures
    ``D = joint_damage(choice)`` (one eval) and scales the predicted damages by the observed ratio
    ``r = D / predicted`` (the interaction correction): the next target is ``tau = slack *
    max_damage / r``. allocate() then moves the tensors with the largest damage per saved bit to
    their next safer scheme (a batch: all upgrades until the scaled prediction fits), or back
    when the choice was well within budget. Targets stay strictly between the largest feasible
    and the smallest infeasible tau tried (bisection when the ratio step would leave that bracket).

    Stall: when an infeasible round's ``tau`` is ``stall_tau`` (3x) or more below an earlier
    infeasible round's and its ``D`` is still >= ``stall_damage`` (0.7x) of that round's, the damage
    sits in tensors the scaling does not move (predicted ~0, measured large jointly). If at least
    ``2 * ceil(log2(quantized tensors)) + 2`` evals are left, they are found by group testing
    (``_group_test``: halving, one eval per step, on the current choice) and pinned to their safest
    scheme (most bits); the bracket restarts on the pinned table. Otherwise the scaling goes on
    (with ``clean``ed damages it moves them too, at a lower tau: a less tight choice).

    Stops after ``max_evals`` evals, or when a feasible choice uses >= ``slack`` of the budget.
    Returns the feasible choice (group-test choices included, within ``budget_bits``) with the
    fewest estimated bits (else the one with the least measured damage; ``info["met"]`` says
    which) and ``info`` with every round (``kind``: ``"alloc"`` or ``"group"``) and ``pinned``."""
    rounds: list[dict[str, Any]] = []
    seen: dict[tuple, float] = {}
    safe = {n: max(o, key=lambda s: (o[s]["bits"], -o[s].get("err", 0.0))) for n, o in table.items()}
    pinned: dict[str, str] = {}
    work = table
    ok_tau, bad_tau = None, None
    stalls: list[tuple[float, float]] = []  # (tau, D) of the infeasible rounds since the last pinning
    diffuse = False
    tau = max_damage

    def evaluate(choice: dict[str, str], kind: str, tau_: float | None) -> float:
        key = tuple(sorted(choice.items()))
        if key in seen:
            return seen[key]
        d = float(joint_damage(choice))
        seen[key] = d
        bits, pred = predicted(table, choice)
        rounds.append({"kind": kind, "tau": tau_, "bits": bits, "predicted": pred, "measured": d,
                       "choice": dict(choice)})
        return d

    def evals_left() -> int:
        return max_evals - len(rounds)

    for _ in range(2 * max_evals + 4):
        if evals_left() <= 0:
            break
        choice = allocate(work, budget_bits=budget_bits, max_damage=tau)
        key = tuple(sorted(choice.items()))
        _, pred = predicted(table, choice)
        if key in seen and not pinned:  # the same choice again: nothing new to learn, stop
            break
        d = evaluate(choice, "alloc", tau)
        if d <= max_damage:
            ok_tau = tau if ok_tau is None else max(ok_tau, tau)
            if d >= slack * max_damage:
                break
        else:
            bad_tau = tau if bad_tau is None else min(bad_tau, tau)
            stalled = any(t >= stall_tau * tau and d >= stall_damage * dt for t, dt in stalls)
            stalls.append((tau, d))
            n_q = sum(choice[n] != safe[n] and n not in pinned for n in choice)
            if stalled and not diffuse and evals_left() >= 2 * math.ceil(math.log2(max(n_q, 2))) + 2:
                # enough evals left to find two culprits and re-allocate; else the scaling goes on
                found, cur, d_cur = _group_test(table, choice, d, safe, pinned, evaluate, evals_left, max_damage)
                diffuse = not found  # no tensor carries the excess: do not test again
                if found:
                    pinned.update({c: safe[c] for c in found})
                    work = {n: ({pinned[n]: o[pinned[n]]} if n in pinned else o) for n, o in table.items()}
                    ok_tau, bad_tau, stalls = None, None, []
                    _, p_cur = predicted(table, cur)
                    if d_cur <= max_damage and d_cur >= slack * max_damage:
                        break
                    tau = slack * max_damage * p_cur / d_cur if d_cur > 0 and p_cur > 0 else max_damage
                    continue
        if d > 0 and pred > 0:
            new = slack * max_damage * pred / d  # tau for which the scaled prediction meets the budget
        else:
            new = tau * 2 if tau > 0 else max_damage  # no damage measured: try fewer bits
        lo = ok_tau if ok_tau is not None else 0.0
        if bad_tau is not None and not (lo < new < bad_tau):
            new = 0.5 * (lo + bad_tau)
        elif bad_tau is None and new <= lo:
            new = 2 * lo if lo > 0 else max_damage
        if bad_tau is not None and ok_tau is not None and bad_tau - ok_tau <= 1e-3 * max_damage:
            break
        if abs(new - tau) <= 1e-12 * max(abs(tau), 1e-30):
            break
        tau = new
    feas = [r for r in rounds if r["measured"] <= max_damage
            and (budget_bits is None or r["kind"] == "alloc" or r["bits"] <= budget_bits)]
    best = min(feas, key=lambda r: r["bits"]) if feas else min(rounds, key=lambda r: r["measured"])
    info = {"met": bool(feas), "evals": len(rounds), "measured": best["measured"], "predicted": best["predicted"],
            "pinned": dict(pinned), "rounds": [{k: v for k, v in r.items() if k != "choice"} for r in rounds]}
    return best["choice"], info


def _group_test(table: dict, choice: dict[str, str], d: float, safe: dict[str, str], pinned: dict[str, str],
                evaluate: Callable[..., float], evals_left: Callable[[], int], max_damage: float
                ) -> tuple[list[str], dict[str, str], float]:
    """Find the tensors that carry a joint damage the tau scaling does not move.

    Suspects: the quantized tensors of ``choice`` (not at their safe scheme), those whose damage
    ``clean`` raised first (``damage_clean > damage_measured``: the single measurement said less),
    then in order of predicted damage relative to their error proxy, smallest first. The first
    split is the raised ones against the rest (if both are non-empty), then halving: revert the
    first part to the safe scheme and measure (one eval); the part whose revert removes at least
    half of the excess the suspects carry is kept, down to one tensor, which is reverted in the current choice. Repeats
    while the current choice is over budget and evals are left. A last tensor carrying less than a
    quarter of the excess over budget is not a culprit (the damage is spread out: scaling's job).
    Returns (culprits, the choice with them reverted, its measured or estimated damage)."""
    cur = dict(choice)
    culprits: list[str] = []

    def raised(n: str) -> bool:  # its single damage was raised by clean(): the measurement said less
        r = table[n][cur[n]]
        return r.get("damage_clean", 0.0) > r.get("damage_measured", r.get("damage_clean", 0.0))

    def rel(n: str) -> tuple[bool, float]:
        r = table[n][cur[n]]
        p = proxy(n, r)
        return not raised(n), (r["damage"] / p if p > 0 else r["damage"] * 1e30)

    while d > max_damage and evals_left() >= 1:
        sus = sorted((n for n in cur if cur[n] != safe[n] and n not in pinned and n not in culprits), key=rel)
        if not sus:
            break
        n_raised = sum(raised(n) for n in sus)
        group, excess, last = sus, d, None  # excess: what the group carries (all reverted: ~0 left)
        while len(group) > 1 and evals_left() >= 1:
            # the first split tests the raised tensors (the prime suspects) together, then halves
            k = n_raised if group is sus and 0 < n_raised < len(group) else len(group) // 2
            a, b = group[:k], group[k:]
            d_a = evaluate({**cur, **{n: safe[n] for n in a}}, "group", None)
            e_a = d - d_a
            if e_a >= 0.5 * excess:
                group, excess, last = a, e_a, d_a
            else:
                group, excess, last = b, excess - e_a, None
        if len(group) > 1 or excess < 0.25 * (d - max_damage):
            break
        c = group[0]
        culprits.append(c)
        cur[c] = safe[c]
        if last is not None:
            d = last
        elif evals_left() >= 1:
            d = evaluate(cur, "group", None)
        else:
            d = max(d - excess, 0.0)
    return culprits, cur, d


def target_size(table: dict, stored_bits: Callable[[dict[str, str]], float], target_bits: float, *,
                max_damage: float | None = None, rounds: int = 8, tol: float = 0.003
                ) -> tuple[dict[str, str], dict[str, Any]]:
    """The allocation whose *stored* bits (``stored_bits(choice)``, e.g. the measured size of the
    saved codes) are as large as possible but never above ``target_bits``.

    The allocation budgets estimated bits; stored bits differ by the container and entropy-coder
    overhead (about +0.03..0.1 bpw). Each round allocates for an estimated budget ``b``, measures
    the stored size ``S`` and moves ``b`` by the miss (``b += target - S``, bisecting inside the
    bracket of budgets known to fit / to overshoot). Stops within ``tol`` below the target. If
    nothing fits after ``rounds`` rounds, the cheapest choice (``info["met"]`` says whether it fits)."""
    fit_b, over_b, best = None, None, None
    hist: list[dict[str, Any]] = []
    b = target_bits
    for _ in range(rounds):
        choice = allocate(table, budget_bits=b, max_damage=max_damage)
        s = float(stored_bits(choice))
        hist.append({"budget_est_bits": b, "stored_bits": s})
        if s <= target_bits:
            fit_b = b if fit_b is None else max(fit_b, b)
            if best is None or s > best[1]:
                best = (choice, s)
            if target_bits - s <= tol * target_bits or max_damage is not None:
                break  # close enough (with a loss budget, fewer bits than the target are fine)
        else:
            over_b = b if over_b is None else min(over_b, b)
        new = b + (target_bits - s) * (1.002 if s > target_bits else 0.95)
        if over_b is not None and new >= over_b:
            new = 0.5 * ((fit_b if fit_b is not None else new) + over_b) if fit_b is not None else over_b - 1.5 * (s - target_bits)
        if fit_b is not None and new <= fit_b:
            break
        b = new
    if best is None:
        choice = cheapest(table)
        best = (choice, float(stored_bits(choice)))
        hist.append({"budget_est_bits": None, "stored_bits": best[1]})
    return best[0], {"met": best[1] <= target_bits, "stored_bits": best[1], "rounds": hist}


def predicted(table: dict, choice: dict[str, str]) -> tuple[float, float]:
    """(estimated bits, predicted damage) of a choice."""
    return (sum(table[n][s]["bits"] for n, s in choice.items()),
            sum(table[n][s]["damage"] for n, s in choice.items()))


def summarize(table: dict, choice: dict[str, str]) -> dict[str, Any]:
    return {n: {"scheme": s, **table[n][s]} for n, s in choice.items()}
