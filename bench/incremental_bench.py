"""Incremental (format 1.1) checkpoints: full vs incremental ratios on a GPT trained here, load
times, and (on a GPU) compress/decompress throughput of the ``delta`` and ``xor`` transforms.

    PYTHONPATH=src python bench/incremental_bench.py --peers               # small CPU GPT (4.9 M params), + peers
    PYTHONPATH=src python bench/incremental_bench.py --device cuda --dims bench --steps1 300 --gap 100

Snapshot 1 is taken after ``--steps1`` AdamW steps, snapshot 2 ``--gap`` steps later. The state is
the benchmark layout of bench/gpt.py ``checkpoint()``: fp32 weights, a bf16 copy, Adam m and v.
Prints one JSON object: ratios (stored / raw bytes) of snapshot 2 saved standalone (with and
without ``derived``) and against snapshot 1, per component, load times, and GPU throughput.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip  # noqa: E402
from gpt import GPT, checkpoint, corpus  # noqa: E402

DIMS = {"small": dict(d=256, layers=6, heads=8, ctx=128, batch=8),
        "bench": dict(d=768, layers=12, heads=12, ctx=512, batch=16)}


def train_pair(device: str, dims: dict, steps1: int, gap: int, log=print):
    """(snapshot 1, snapshot 2): checkpoint() states ``gap`` steps apart, deep-copied to ``device``."""
    torch.manual_seed(0)
    ctx, batch = dims["ctx"], dims["batch"]
    text = corpus(16 << 20).to(device)
    model = GPT(d=dims["d"], layers=dims["layers"], heads=dims["heads"], ctx=ctx).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator(device="cpu").manual_seed(1)
    snaps, t0 = [], time.time()
    total = steps1 + gap
    for step in range(total):
        ix = torch.randint(0, text.numel() - ctx - 1, (batch,), generator=g).to(device)
        seq = text[ix[:, None] + torch.arange(ctx + 1, device=device)].long()
        lr = 6e-4 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, total))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step + 1 in (steps1, total):
            snaps.append(copy.deepcopy(checkpoint(model, opt)))
            log(f"snapshot after step {step + 1}: loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    return snaps[0], snaps[1]


def _raw(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_raw(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_raw(v) for v in obj)
    return 0


def components(path: str) -> dict[str, float]:
    """Stored / raw bytes per component (bf16 weights, fp32 weights, Adam m, Adam v)."""
    groups = {"bf16 weights": "model_bf16.", "fp32 weights": "model.", "adam m": "exp_avg",
              "adam v": "exp_avg_sq"}
    out = {}
    with ckptzip.open(path) as r:
        seen: dict[int, str] = {}
        for k in r.keys():
            node = r._node(k)
            name = next((g for g, p in groups.items() if (k.startswith(p) if p.endswith(".") else k.endswith(p))), None)
            if name:
                seen.setdefault(node["s"], name)
        acc = {g: [0, 0] for g in groups}
        for s, g in seen.items():
            acc[g][0] += r.stored_bytes(s)
            acc[g][1] += r.storages[s]["nbytes"]
        for g, (st, raw) in acc.items():
            if raw:
                out[g] = round(st / raw, 4)
    return out


def timed_loads(paths: list[str], device: str, reps: int) -> list[list[float]]:
    """Load times of each path, rounds interleaved (path 1, path 2, path 1, ...) after one
    untimed load of each, so that drift of the machine hits every path alike."""
    times: list[list[float]] = [[] for _ in paths]
    for r in range(reps + 1):
        for k, path in enumerate(paths):
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            obj = ckptzip.load(path, map_location=device)
            _sync(device)
            if r:
                times[k].append(time.perf_counter() - t0)
            del obj
    return times


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_delta_throughput(cur: torch.Tensor, base: torch.Tensor, reps: int = 10, kind: str = "delta") -> dict:
    """Compress / decompress GB/s of the planned ``delta`` (what incremental saves use for 16-bit
    floats), ``hidelta`` (float32 against a plain byteplane base storage) or ``xor`` (+ byteplane + codec) encode and decode of one device-resident tensor against its
    base, as bench/gpu_throughput.py measures plain ones (decode: the destination already holds
    the base, as an incremental load leaves it)."""
    from ckptzip.codecs import _capi
    from ckptzip.engine import Job, Planner, decode_group, encode_group_arrays, gather_gpu, gpu_window, units_of
    from ckptzip.kernels import triton_kernels
    from ckptzip.transforms import Xor
    from ckptzip.transforms.refs import Delta
    from ckptzip.tree import StorageRef
    triton_kernels(wait=True)
    dev = "cuda"
    ref = StorageRef(cur.reshape(-1).view(torch.uint8), str(cur.dtype)[6:], str(cur.device), cur.element_size())
    bref = base.reshape(-1).view(torch.uint8)
    win = gpu_window()
    from ckptzip.transforms.refs import HiDelta
    rt = (Delta(0, 0, cur.element_size()) if kind == "delta" else HiDelta(0, 0) if kind == "hidelta"
          else Xor(0, 0))
    plan = Planner("auto", "auto", 1 << 20, None, dev).plan_all([ref], win, ref_tfs={0: rt.bind(bref)})[0]
    units = units_of(0, ref.data, plan, win)
    n = ref.data.numel()
    dst = torch.empty_like(ref.data)
    te, td = [], []
    for _ in range(reps):
        packed = []
        _sync(dev)
        t0 = time.perf_counter()
        for u in units:
            enc = encode_group_arrays([u])
            buf, rel = gather_gpu(enc)
            del enc
            packed.append((u, buf, rel, rel["offset"].astype(np.int64)))
        _sync(dev)
        te.append(time.perf_counter() - t0)
        stored = sum(int(rel["stored"].sum()) for _u, _b, rel, _o in packed)
        dst.copy_(bref)
        _sync(dev)
        t0 = time.perf_counter()
        with _capi.deferred_checks():
            for u, buf, rows, soffs in packed:
                a, b = u.start, u.start + u.data.numel()
                job = Job(rows, plan.transform, plan.codec, dst,
                          plan.ref.bind(dst) if plan.ref is not None else None)
                decode_group(buf, soffs, rows, [(job, 0, len(rows), a, b)], dev)
            _sync(dev)
        td.append(time.perf_counter() - t0)
        del packed
    assert torch.equal(dst, ref.data), "round trip failed"
    return {"choice": plan.choice, "ratio": round(stored / n, 4), "compress_GBps": round(n / min(te) / 1e9, 1),
            "decompress_GBps": round(n / min(td) / 1e9, 1),
            "compress_GBps_median": round(n / statistics.median(te) / 1e9, 1),
            "decompress_GBps_median": round(n / statistics.median(td) / 1e9, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dims", default="small", choices=sorted(DIMS))
    ap.add_argument("--steps1", type=int, default=200)
    ap.add_argument("--gap", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3, help="timed loads of each file, interleaved (default 3)")
    ap.add_argument("--out", default=None, help="directory for the files (default: a temporary one)")
    ap.add_argument("--peers", action="store_true", help="also store snapshot 2 given snapshot 1 with lmzip, "
                    "z4ai, moonclip and ZipNN (bench/peers_incremental.py; the ones installed), same run")
    a = ap.parse_args()
    dims = DIMS[a.dims]
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    s1, s2 = train_pair(a.device, dims, a.steps1, a.gap, log)
    d = a.out or tempfile.mkdtemp(prefix="ckz-incr-")
    os.makedirs(d, exist_ok=True)
    p1, p2, p2i, p2n = (os.path.join(d, n) for n in ("s1.ckz", "s2_full.ckz", "s2_incr.ckz", "s2_noderive.ckz"))
    raw = _raw(s2)
    res = {"device": a.device, "dims": a.dims, "steps1": a.steps1, "gap": a.gap,
           "params": sum(v.numel() for v in s2["model"].values()), "raw_bytes": raw}
    timings = {}
    for name, path, kw, obj in (("s1 full", p1, {}, s1), ("s2 full", p2, {}, s2),
                                ("s2 full, no derived", p2n, {"derive": False}, s2),
                                ("s2 incremental (base s1)", p2i, {"base": p1}, s2)):
        _sync(a.device)
        t0 = time.perf_counter()
        info = ckptzip.save(obj, path, **kw)
        _sync(a.device)
        timings[name] = round(time.perf_counter() - t0, 3)
        res[name] = {"ratio": round(info["stored_bytes"] / raw, 4), "components": components(path),
                     **{k: info[k] for k in ("delta_storages", "derived_storages") if k in info}}
    res["save_s"] = timings
    back = ckptzip.load(p2i, map_location=a.device)
    for k in ("model", "model_bf16"):
        for n, v in s2[k].items():
            assert torch.equal(back[k][n].view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), n
    for i, st in s2["optimizer"]["state"].items():
        for n, v in st.items():
            assert torch.equal(back["optimizer"]["state"][i][n].cpu().reshape(-1).view(torch.uint8),
                               v.cpu().reshape(-1).view(torch.uint8)), (i, n)
    del back
    if a.device == "cuda":  # a warm process: the kernels' background compilation (started by the
        # first GPU save, minutes on a fresh machine's empty cache) is over before loads are timed
        from ckptzip.kernels import wait_kernels
        t0 = time.time()
        wait_kernels(300)
        res["kernels_ready_after_s"] = round(time.time() - t0, 1)
    full, incr = timed_loads([p2, p2i], a.device, a.reps)
    full_s, incr_s = statistics.median(full), statistics.median(incr)
    res["load_s"] = {"standalone": round(full_s, 4), "incremental": round(incr_s, 4),
                     "incremental / standalone": round(incr_s / full_s, 3),
                     "best: incremental / standalone": round(min(incr) / min(full), 3),
                     # each round's incremental load over the same round's standalone one (the
                     # rounds interleave the two, so both see the same state of the machine)
                     "paired: median of incremental / standalone": round(
                         statistics.median(b / a for a, b in zip(full, incr)), 3),
                     "mean: incremental / standalone": round(statistics.mean(incr) / statistics.mean(full), 3),
                     "all": {"standalone": [round(x, 4) for x in full], "incremental": [round(x, 4) for x in incr]}}
    if a.device == "cuda":
        w1 = torch.cat([v.reshape(-1) for v in s1["model"].values()])
        w2 = torch.cat([v.reshape(-1) for v in s2["model"].values()])
        v1 = torch.cat([s["exp_avg_sq"].reshape(-1) for s in s1["optimizer"]["state"].values()])
        v2 = torch.cat([s["exp_avg_sq"].reshape(-1) for s in s2["optimizer"]["state"].values()])
        res["gpu_delta_throughput"] = {"fp32 weights (hidelta: what saves use)": gpu_delta_throughput(w2, w1, kind="hidelta"),
                                       "fp32 weights (delta)": gpu_delta_throughput(w2, w1),
                                       "bf16 weights": gpu_delta_throughput(w2.bfloat16(), w1.bfloat16()),
                                       "adam v": gpu_delta_throughput(v2, v1)}
        res["gpu_xor_throughput"] = {"fp32 weights": gpu_delta_throughput(w2, w1, kind="xor"),
                                     "bf16 weights": gpu_delta_throughput(w2.bfloat16(), w1.bfloat16(), kind="xor")}
    if a.peers:
        from peers_incremental import peer_ratios
        res["peers"] = peer_ratios(s1, s2, os.path.join(d, "peers"))
        rows = [("ckptzip (incremental)", res["s2 incremental (base s1)"]["ratio"])]
        rows += [(n, r["ratio"]) for n, r in res["peers"].items() if "ratio" in r and r.get("bit_exact")]
        for name, ratio in sorted(rows, key=lambda x: x[1]):
            log(f"{name:24s} {ratio:.4f}")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
