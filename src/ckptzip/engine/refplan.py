"""Reference transforms at save time (format 1.1/1.2): which storages are ``derived`` (a cast of
another storage of the same state), which are ``expref`` candidates (Adam's m predicted from its
v), and which are stored as ``delta``/``xor`` against a base checkpoint.

* :func:`find_derived` is exact and hash-free: 16-bit storages are matched with float32 storages of
  the same element count by casting a few sampled elements of every candidate (one batched
  comparison per shape, on the storages' device), then the best candidate is verified on every
  element; the mismatches (exceptions) are counted on the device and fetched in one sync per
  shape. A storage whose copy differs in at most :data:`MAX_EXCEPTIONS` of its elements is
  derived: its residual (mostly zero words) costs almost nothing.
* :func:`ref_variant` / :func:`choose_ref` let the planner sample a storage with and without
  ``delta`` (or ``xor``) against its base storage and keep it only where the sampled stored size
  shrinks by at least :data:`REF_MARGIN`.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

import numpy as np

import torch

from .. import native
from ..codecs.cpu import pmap_sized
from ..transforms.refs import Derived, ExpGrid, ExpRef, RefTransform, cast16
from ..tree import StorageRef, contiguous_stride, memoized, tensor_keys
from .plan import Plan

#: a derived storage may differ from the cast of its source in at most this share of elements
MAX_EXCEPTIONS = 1 / 16
#: sampled elements per candidate pair
PROBE = 64
#: delta/xor is kept when the sampled stored size is below (1 - REF_MARGIN) x the size without it
REF_MARGIN = 0.02
#: full verification in slices of this many elements (bounds temporary memory)
VERIFY_SLICE = 1 << 24
_TO = {"bfloat16": "bfloat16", "float16": "float16"}


def _probe_idx(n: int, device: torch.device) -> torch.Tensor:
    k = min(n, PROBE)
    return torch.arange(k, dtype=torch.int64, device=device) * (n - 1) // max(k - 1, 1)  # exact, in range


def _mismatches(tgt: torch.Tensor, src: torch.Tensor, to: str) -> torch.Tensor:
    """Number of 16-bit words of ``tgt`` (flat uint8) that differ from the cast of ``src``."""
    t16 = tgt.view(torch.int16)
    n = t16.numel()
    count = torch.zeros((), dtype=torch.int64, device=tgt.device)
    for a in range(0, n, VERIFY_SLICE):
        b = min(n, a + VERIFY_SLICE)
        count += (t16[a:b] != cast16(src[4 * a:4 * b], to)).sum()
    return count


#: layout of a state -> the derived pairs found for it: [(target, source, to)] (``reuse``)
_PAIRS: "OrderedDict[tuple, list[tuple[int, int, str]]]" = OrderedDict()
_PAIRS_LOCK = threading.Lock()
#: a reused layout's pairs probed per save, in turn (all of them every ``len(pairs) / 16``
#: saves): probing all 149 pairs of the benchmark GPT took 13 ms of an async save's stall
PROBE_PAIRS = 16
_TURN: dict = {}  # layout -> index of the first pair the next save probes


def _layout(refs: list[StorageRef]) -> tuple:
    return tuple((r.device, r.data.numel(), r.elem) for r in refs)  # (r.device: str(r.data.device))


def _probes_hold(refs: list[StorageRef], pairs: list[tuple[int, int, str]]) -> bool:
    """Whether every pair still matches on its sampled elements (batched per shape and dtype,
    one sync per device)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for t, s, to in pairs:
        groups.setdefault((refs[t].data.device, refs[t].data.numel() // 2, to), []).append((t, s))
    oks: dict = {}
    for (dev, n, to), ts in groups.items():
        idx = _probe_idx(n, dev)
        src = torch.stack([refs[s].data.view(torch.float32)[idx] for _t, s in ts])
        tgt = torch.stack([refs[t].data.view(torch.int16)[idx] for t, _s in ts])
        pred = cast16(src.contiguous().view(-1).view(torch.uint8), to).view(len(ts), -1)
        oks.setdefault(dev, []).append(((tgt == pred).sum(-1) >= (1 - MAX_EXCEPTIONS) * idx.numel()).all())
    return all(bool(torch.stack(xs).all()) for xs in oks.values())


def find_derived(refs: list[StorageRef], reuse: bool = False, memo: dict | None = None) -> dict[int, Derived]:
    """Storage index -> bound ``derived`` transform, for every 16-bit float storage that is a cast
    of a float32 storage of the same state (up to :data:`MAX_EXCEPTIONS`). With ``reuse``, the
    pairs found for the same layout before (a training loop saves the same state again and
    again) are kept when their sampled elements still match, without verifying every element,
    :data:`PROBE_PAIRS` of them per save in turn: the residual is exact whatever the copy holds,
    so a pair that drifted costs size, never data, until its turn comes (then all are looked
    for again). ``memo``: see :func:`~ckptzip.tree.memoized`."""
    if reuse:
        key = memoized(memo, "layout", None, lambda: _layout(refs))
        with _PAIRS_LOCK:
            pairs = _PAIRS.get(key)
            at = _TURN.get(key, 0) % len(pairs) if pairs else 0
            _TURN[key] = at + PROBE_PAIRS
        probe = (pairs + pairs)[at:at + min(PROBE_PAIRS, len(pairs))] if pairs else []
        if pairs and _probes_hold(refs, probe):  # no pair found before: look again
            with _PAIRS_LOCK:
                if key in _PAIRS:
                    _PAIRS.move_to_end(key)
            return {t: Derived(s, "float32", to).bind(refs[s].data) for t, s, to in pairs}
        found = find_derived(refs)
        with _PAIRS_LOCK:
            _PAIRS[key] = [(t, d.storage, d.to) for t, d in found.items()]
            while len(_PAIRS) > 8:
                _TURN.pop(_PAIRS.popitem(last=False)[0], None)
        return found
    targets: dict[tuple, list[int]] = {}
    sources: dict[tuple, list[int]] = {}
    for i, r in enumerate(refs):
        n = r.data.numel()
        if r.elem in _TO and n and n % 2 == 0:
            targets.setdefault((r.data.device, n // 2), []).append(i)
        elif r.elem == "float32" and n and n % 4 == 0:
            sources.setdefault((r.data.device, n // 4), []).append(i)
    found: dict[int, Derived] = {}
    # probes: every target against every source of its shape, all shapes before one sync per device
    probed: dict[torch.device, list] = {}
    for key, ts in targets.items():
        ss = sources.get(key)
        if not ss:
            continue
        dev, n = key
        idx = _probe_idx(n, dev)
        src = torch.stack([refs[s].data.view(torch.float32)[idx] for s in ss])  # [S, k]
        tgt = torch.stack([refs[t].data.view(torch.int16)[idx] for t in ts])     # [T, k]
        for to in ("bfloat16", "float16"):
            sel = [j for j, t in enumerate(ts) if refs[t].elem == to]
            if not sel:
                continue
            pred = cast16(src.contiguous().view(-1).view(torch.uint8), to).view(len(ss), -1)
            score = (tgt[sel][:, None, :] == pred[None, :, :]).sum(-1)               # [T', S]
            best, arg = score.max(dim=1)
            probed.setdefault(dev, []).append(([ts[j] for j in sel], ss, to, idx.numel(), torch.stack([best, arg])))
    pairs: list[tuple[int, int, str]] = []
    for items in probed.values():
        got = torch.cat([x[4] for x in items], dim=1).tolist()  # one sync per device
        k = 0
        for sel_ts, ss, to, m, _ba in items:
            for t, b, a in zip(sel_ts, got[0][k:k + len(sel_ts)], got[1][k:k + len(sel_ts)]):
                if b >= (1 - MAX_EXCEPTIONS) * m:
                    pairs.append((t, ss[a], to))
            k += len(sel_ts)
    # every element of the candidate pairs: pairs of one size and cast counted together
    counts = _mismatches_many(refs, pairs)
    for (t, s, to), c in zip(pairs, counts):
        if c <= MAX_EXCEPTIONS * (refs[t].data.numel() // 2):
            found[t] = Derived(s, "float32", to).bind(refs[s].data)
    return found


def _mismatches_many(refs: list[StorageRef], pairs: list[tuple[int, int, str]]) -> list[int]:
    """:func:`_mismatches` of every (target, source, to) pair, in one sync per device: pairs of
    the same size, device and cast are stacked in slices of at most :data:`VERIFY_SLICE`
    elements and counted by a few operations per slice (one set of operations per pair cost
    about 0.1 ms each in Python and launches: 149 pairs of the benchmark GPT)."""
    out = [0] * len(pairs)
    # host pairs cast to bfloat16: counted in one C pass each, on the CPU pool (the stacked
    # copies, prediction and comparison took 0.69 s for the 149 pairs of the benchmark GPT on a
    # 2-core VM, a third of its CPU save)
    host = [k for k, (t, s, to) in enumerate(pairs) if to == "bfloat16" and refs[t].data.device.type == "cpu"
            and refs[s].data.device.type == "cpu"] if native.lib is not None else []
    if host:
        def one(j: int) -> None:
            t, s, _to = pairs[host[j]]
            out[host[j]] = native.lib.cast_bf16_diff(refs[s].data.numpy(), refs[t].data.numpy())
        pmap_sized(one, [refs[pairs[k][1]].data.numel() for k in host], inline_small=True)
    per: dict[tuple, list[int]] = {}
    done = set(host)
    for k, (t, _s, to) in enumerate(pairs):
        if k in done:
            continue
        d = refs[t].data
        per.setdefault((d.device, d.numel() // 2, to), []).append(k)
    parts: dict[torch.device, list] = {}
    for (dev, n, to), ks in per.items():
        if n > VERIFY_SLICE // 2:
            for k in ks:
                t, s, _to = pairs[k]
                parts.setdefault(dev, []).append(([k], _mismatches(refs[t].data, refs[s].data, to).view(1)))
            continue
        step = max(1, VERIFY_SLICE // 4 // n)  # (stacked copies: about 40 MiB of temporaries a slice)
        for a in range(0, len(ks), step):
            sub = ks[a:a + step]
            src = torch.stack([refs[pairs[k][1]].data.view(torch.float32) for k in sub])  # [K, n]
            tgt = torch.stack([refs[pairs[k][0]].data.view(torch.int16) for k in sub])    # [K, n]
            pred = cast16(src.view(-1).view(torch.uint8), to).view(len(sub), n)
            parts.setdefault(dev, []).append((sub, (tgt != pred).sum(-1)))
    for items in parts.values():
        got = torch.cat([c for _ks, c in items]).tolist()  # one sync per device
        for k, c in zip([k for ks, _c in items for k in ks], got):
            out[k] = int(c)
    return out


#: a key of Adam's first moment (``....exp_avg``; DCP rank files append ``@offsets``)
_EXP_AVG = re.compile(r"(.*\.)?exp_avg(@[0-9,]*)?\Z", re.S)


def find_expref(root, refs: list[StorageRef], skip: set, keys: dict | None = None,
                memo: dict | None = None) -> dict[int, ExpRef]:
    """Storage index -> bound ``expref`` candidate, for every float32 first moment of Adam
    (key ``...exp_avg``) whose second moment (the key with ``exp_avg_sq``) is a float32 storage
    of the same size: the planner samples each and keeps it only where it pays. Pairs are found
    by key alone (no GPU work); storages in ``skip`` already have a reference. ``keys``:
    :func:`~ckptzip.tree.tensor_keys` of ``root`` if the caller has them; ``memo``: see
    :func:`~ckptzip.tree.memoized`."""
    pairs = memoized(memo, "expref", frozenset(skip), lambda: _expref_pairs(root, refs, skip, keys))
    return {i: ExpRef(k).bind(refs[k].data) for i, k in pairs}


def _expref_pairs(root, refs: list[StorageRef], skip: set, keys: dict | None) -> list[tuple[int, int]]:
    keys = keys if keys is not None else tensor_keys(root, escaped=False)[0]
    found: dict[int, int] = {}
    for key, node in keys.items():
        m = _EXP_AVG.match(key)
        if m is None or node.get("t") != "tensor":
            continue
        other = keys.get(f"{m.group(1) or ''}exp_avg_sq{m.group(2) or ''}")
        if other is None or other.get("t") != "tensor":
            continue
        i, k = node.get("s"), other.get("s")
        if i == k or i in skip or i in found or k in found:
            continue
        a, b = refs[i], refs[k]
        if a.elem == b.elem == "float32" and a.data.numel() == b.data.numel() and a.data.numel() % 4 == 0 \
                and a.data.numel() and a.data.device == b.data.device:
            found[i] = k
    return list(found.items())


#: a key of Adam's second moment (``....exp_avg_sq``, optionally ``@offsets``)
_EXP_AVG_SQ = re.compile(r"(.*\.)?exp_avg_sq(@[0-9,]*)?\Z", re.S)


#: layout -> [fits, saves that used them] (``reuse``): later saves of a training loop take the
#: fits of an earlier save (a stale fit predicts a little worse, never wrongly: the residual is
#: exact), refitted every REFIT_EVERY saves
_GRIDS: "OrderedDict[tuple, list]" = OrderedDict()
REFIT_EVERY = 4


def find_expgrid(root, refs: list[StorageRef], skip: set, keys: dict | None = None,
                 reuse: bool = False, memo: dict | None = None) -> dict[int, ExpGrid]:
    """Storage index -> fitted ``expgrid`` candidate, for every float32 second moment of Adam
    (key ``...exp_avg_sq``) held by a contiguous tensor of two or more dimensions that covers
    its whole storage (rows = first dimension). The fit reads the storage once on its device;
    the planner samples each candidate and keeps it only where it pays. With ``reuse``, the fits
    made for the same layout by one of the last REFIT_EVERY saves are taken again (no fit: no
    pass over the storages, no device sync). ``memo``: see :func:`~ckptzip.tree.memoized`."""
    cands, key = memoized(memo, "expgrid", frozenset(skip), lambda: _expgrid_candidates(root, refs, skip, keys))
    if not cands:
        return {}
    found = {i: (refs[i].data, rows, cols) for i, rows, cols in cands}
    if reuse:
        with _PAIRS_LOCK:
            got = _GRIDS.get(key)
            if got is not None and got[1] < REFIT_EVERY:
                got[1] += 1
                _GRIDS.move_to_end(key)
                return dict(zip(found, got[0]))
    fits = ExpGrid.fit_many(list(found.values()))
    if reuse:
        with _PAIRS_LOCK:
            _GRIDS[key] = [fits, 1]
            while len(_GRIDS) > 8:
                _GRIDS.popitem(last=False)
    return dict(zip(found, fits))


def _expgrid_candidates(root, refs: list[StorageRef], skip: set, keys: dict | None) -> tuple[list, tuple]:
    """``([(storage, rows, cols)], key of the fits in _GRIDS)`` for :func:`find_expgrid`."""
    keys = keys if keys is not None else tensor_keys(root, escaped=False)[0]
    found: dict[int, tuple] = {}
    for key, node in keys.items():
        if _EXP_AVG_SQ.match(key) is None or node.get("t") != "tensor" or node.get("dtype") != "float32":
            continue
        i, shape, stride = node.get("s"), node.get("shape"), node.get("stride")
        if i in skip or i in found or not isinstance(shape, list) or len(shape) < 2:
            continue
        numel = int(np.prod(shape, dtype=np.int64))
        r = refs[i]
        if (r.elem != "float32" or stride != contiguous_stride(shape) or node.get("offset", 0) != 0
                or numel * 4 != r.data.numel() or shape[0] < 2 or numel // shape[0] < 2):
            continue
        found[i] = (shape[0], numel // shape[0])
    return ([(i, rows, cols) for i, (rows, cols) in found.items()],
            tuple((i, refs[i].device, refs[i].data.numel(), rows, cols) for i, (rows, cols) in found.items()))


def derived_plan(plan: Plan, ref: Derived) -> Plan:
    """The plan of a derived storage: its residual (nearly all zero) goes to the codec as bytes."""
    return Plan(None, plan.codec, plan.chunk_size, choice=f"derived from storage {ref.storage} "
                f"({ref.src} -> {ref.to})", ref=ref)


def ref_variant(plan: Plan, variants: dict[str, Plan], ref: RefTransform,
                alt: RefTransform | None = None) -> dict[str, Plan]:
    """The variants to sample for a storage with a first-transform candidate (a base storage,
    the storage ``expref`` predicts from, an ``expgrid`` fit) and optionally a second one
    (``alt``): the plain plan (when the planner would not sample it otherwise), the same layout
    with the candidate first (``ref``, ``alt``), and, where the planner tries smaller chunks for
    the exponent plane, the smallest of those with the candidate first (``ref_exp``,
    ``alt_exp``: that plane only)."""
    out = dict(variants) if variants else {"plain": plan}
    like = variants.get("planes", plan) if variants else plan
    exp = [v for k, v in (variants or {}).items() if k.startswith("exp")]
    for name, rt in (("ref", ref), ("alt", alt)):
        if rt is None:
            continue
        out[name] = Plan(like.transform, like.codec, like.chunk_size, ref=rt)
        if exp:
            e = min(exp, key=lambda v: min(v.plane_chunks.values()))
            out[f"{name}_exp"] = Plan(e.transform, e.codec, e.chunk_size, raw_planes=e.raw_planes,
                                      plane_chunks=dict(e.plane_chunks), ref=rt)
    return out


def _ref_est(var: dict[str, Plan], stored: dict, i: int, name: str, sample: int,
             raw_plane_ratio: float) -> float:
    """Sampled stored bytes of variant ``name`` (with its smaller exponent chunks where those
    were smaller); sets the variant's raw planes and plane chunks accordingly."""
    x = var[name]
    st = stored[(i, name)]
    if x.transform is None:
        return float(sum(st))
    per_plane = sample // x.transform.width
    st = list(st[: x.transform.width])
    top = x.transform.width - 1
    got = stored.get((i, f"{name}_exp"))
    if got is not None and got[top] < st[top]:  # the exponent plane in smaller chunks
        x.plane_chunks = dict(var[f"{name}_exp"].plane_chunks)
        st[top] = got[top]
    x.raw_planes = frozenset(p for p in range(len(st)) if st[p] > raw_plane_ratio * per_plane)
    return float(sum(min(v, per_plane) for v in st))


def choose_ref(plan: Plan, var: dict[str, Plan], stored: dict, i: int, sample: int,
               raw_plane_ratio: float) -> Plan:
    """Keep the candidate (of ``ref`` and ``alt``) whose sampled stored size is smallest where it
    beats the plan chosen without one by its margin."""
    if "plain" in var:
        base = float(sum(stored[(i, "plain")]))
    else:
        base = plan.est if plan.est is not None else float(sample)
    ests = {n: _ref_est(var, stored, i, n, sample, raw_plane_ratio) for n in ("ref", "alt") if n in var}
    name = min(ests, key=ests.get)
    x, est = var[name], ests[name]
    others = "".join(f", {var[n].ref.wire_id} {e / sample:.3f}" for n, e in ests.items() if n != name)
    if est < (1 - getattr(x.ref, "margin", REF_MARGIN)) * base:
        x.choice = f"{x.ref.wire_id}: sample {est / sample:.3f} vs {base / sample:.3f} without{others}"
        x.est = est
        return x
    plan.choice = (plan.choice + "; " if plan.choice else "") + \
        f"no {x.ref.wire_id}: sample {est / sample:.3f} vs {base / sample:.3f}{others}"
    return plan


#: bytes of a storage's start whose exponents decide an exponent predictor on the CPU (16 Ki words:
#: the order-0 estimate's bias, ~0.01 bit, is well under the 0.064-bit margin)
CPU_PREDICT_SAMPLE = 64 << 10


def _exp_bits(words: np.ndarray) -> float:
    """Order-0 entropy (bits per word) of the exponent fields of uint32 ``words``: the top byte
    of the byteplane rotation's words, which the C extension's ``top_entropy`` counts in one
    pass (numpy's shift, cast and bincount took about 60 us per 16 Ki words; ``plane_entropy``,
    which counts all four planes, 4x the work the choice needs)."""
    if native.lib is not None and words.size and words.flags.c_contiguous:
        return native.lib.top_entropy(words.view(np.uint8)) + 0.0
    c = np.bincount((words >> 23).astype(np.uint8), minlength=256)  # the cast keeps bits 23..30
    q = c[c > 0] / max(1, len(words))
    return float(-(q * np.log2(q)).sum()) + 0.0  # not -0.0


def _residual_step(rt: RefTransform, x: torch.Tensor):
    """``top_entropy``'s step for the residual of ``rt`` over the CPU words ``x`` (a storage's
    first bytes: :meth:`RefTransform.c_step`), or None where the residual is made as a tensor
    (no C extension, elsewhere)."""
    if native.lib is None or x.device.type != "cpu" or not x.is_contiguous():
        return None
    return rt.c_step(0, x.numel())


def cpu_choose(plan: Plan, ref: StorageRef, rt: RefTransform, sample: int) -> Plan:
    """On the CPU, keep an exponent predictor (``expref``, ``expgrid``) where it lowers the
    order-0 entropy of the exponents of the storage's first ``sample`` bytes by its margin (a
    share of the storage's 32 bits per word); no codec call (the CPU planner estimates planes the
    same way)."""
    n = min(ref.data.numel(), sample) // 4 * 4
    if n < 4096:
        return plan
    x = ref.data[:n]
    h0 = _exp_bits(x.cpu().numpy().view(np.uint32))
    step = _residual_step(rt, x)
    if step is not None:  # (the residual's histogram in one C pass, no residual tensor)
        h1 = native.lib.top_entropy(x.numpy(), step) + 0.0
    else:
        h1 = _exp_bits(rt.encode(x, start=0).cpu().numpy().view(np.uint32))
    if (h0 - h1) / 32 >= getattr(rt, "margin", REF_MARGIN):
        return Plan(plan.transform, plan.codec, plan.chunk_size, raw_planes=plan.raw_planes, ref=rt,
                    choice=f"{rt.wire_id}: exponent {h1:.2f} vs {h0:.2f} bits (sample)")
    plan.choice = (plan.choice + "; " if plan.choice else "") + \
        f"no {rt.wire_id}: exponent {h1:.2f} vs {h0:.2f} bits (sample)"
    return plan
