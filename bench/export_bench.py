"""Lossy export benchmark (issue 17): the benchmark GPT trained with a held-out split, exported
with uniform round-to-nearest at several bit widths and with the sensitivity allocation at the
same sizes; x vs the full training state, held-out loss change, export time.

GPU (the issue's figures):   python3 bench/export_bench.py --steps 2000 --out export.json
CPU smoke test:              python3 bench/export_bench.py --device cpu --steps 20 --d 64 --layers 2 \
                                 --heads 2 --ctx 64 --batch 4 --eval-batches 2 --corpus-mb 4 --out /tmp/e.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import gpt  # noqa: E402

from ckptzip import lossy as ex  # noqa: E402
from ckptzip.lossy import alloc  # noqa: E402

UNIFORM = ("fp8", "int8-g128", "int6-g128", "int5-g128", "int4-g128", "int4-g32", "int3-g32", "int2-g32")


def train(args, text_train: torch.Tensor, dev: str):
    """gpt.train's loop (same model, optimizer, schedule) on the training split only."""
    torch.manual_seed(0)
    model = gpt.GPT(d=args.d, layers=args.layers, heads=args.heads, ctx=args.ctx).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator(device="cpu").manual_seed(1)
    t0, ctx = time.time(), args.ctx
    for step in range(args.steps):
        ix = torch.randint(0, text_train.numel() - ctx - 1, (args.batch,), generator=g).to(dev)
        seq = text_train[ix[:, None] + torch.arange(ctx + 1, device=dev)].long()
        lr = 6e-4 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, args.steps))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        with torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu"):
            loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", file=sys.stderr)
    return model, opt


def make_eval(model, text_eval: torch.Tensor, args, dev: str):
    """Mean cross-entropy over fixed held-out batches (the same for every variant)."""
    g = torch.Generator(device="cpu").manual_seed(123)
    ctx = args.ctx
    ix = torch.randint(0, text_eval.numel() - ctx - 1, (args.eval_batches, args.batch), generator=g)
    batches = [text_eval[i[:, None].to(dev) + torch.arange(ctx + 1, device=dev)].long() for i in ix]

    @torch.no_grad()
    def eval_fn(weights):
        w = {k: v.to(dev) for k, v in weights.items()}
        tot = 0.0
        for seq in batches:
            with torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16, enabled=dev != "cpu"):
                logits = torch.func.functional_call(model, w, (seq[:, :-1],))
            tot += F.cross_entropy(logits.float().reshape(-1, 256), seq[:, 1:].reshape(-1)).item()
        return tot / len(batches)
    return eval_fn


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def export_times(state, dev: str, d: str, profile: str | None = None) -> dict:
    """Export time of the full state without eval (the state on the device): each scheme exported
    twice in this process; ``first`` includes one-time costs (kernel compilation, caches),
    ``second`` is a warm call. With ``profile`` (a path), cProfile of a third auto export."""
    times = {}
    for s in ("int4-g128", "fp8", "auto"):
        p = os.path.join(d, "t.ckz")
        for k in ("first", "second"):
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            ex.export(state, p, scheme=s, force=True, device=dev, measure=False)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
            times[f"{s} ({k})" if s != "auto" else f"auto, proxy, bpw 4.5 ({k})"] = time.perf_counter() - t
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        ex.export(state, os.path.join(d, "t.ckz"), scheme="auto", force=True, device=dev, measure=False)
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        pr.disable()
        with open(profile, "w") as f:
            pstats.Stats(pr, stream=f).sort_stats("cumtime").print_stats(40)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--corpus-mb", type=int, default=64)
    ap.add_argument("--uniform", default=",".join(UNIFORM), help="uniform RTN schemes, comma separated")
    ap.add_argument("--loss-budgets", default="0.001,0.0005", help="max_loss_increase values for the allocation")
    ap.add_argument("--uniform-search", action="store_true",
                    help="also run every uniform scheme with the clipping search the allocation uses "
                         "(like for like); the allocation rows then target those sizes")
    ap.add_argument("--damage-model", default="measured", choices=("fit", "measured"),
                    help="alloc.effective model of the single-tensor damages")
    ap.add_argument("--max-evals", type=int, default=16, help="joint evals of the loss-budget correction (default 16, as ckptzip.export)")
    ap.add_argument("--out", default="export_bench.json")
    ap.add_argument("--time-only", action="store_true", help="only the export times of the full state (no eval, "
                    "no table; --steps of training, e.g. 20, give the shapes)")
    ap.add_argument("--profile", default=None, help="with --time-only: write a cProfile of an auto export here")
    args = ap.parse_args()
    dev = args.device
    if args.time_only:
        text = gpt.corpus(args.corpus_mb << 20).to(dev)
        model, opt = train(args, text, dev)
        state = gpt.checkpoint(model, opt)
        times = export_times(state, dev, tempfile.mkdtemp(), args.profile)
        print(json.dumps(times, indent=1))
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
                       "export_s": times, "steps": args.steps}, f, indent=1)
        return

    text = gpt.corpus(args.corpus_mb << 20)
    split = int(text.numel() * 0.9)  # hold out the last 10 % of the corpus bytes
    text_train, text_eval = text[:split].to(dev), text[split:].to(dev)
    t0 = time.time()
    model, opt = train(args, text_train, dev)
    train_s = time.time() - t0
    state = gpt.checkpoint(model, opt)
    comp = gpt.components(state)
    full_bytes = sum(nbytes(v) for v in comp.values())
    eval_fn = make_eval(model, text_eval, args, dev)
    weights = {k: v.detach() for k, v in state["model"].items()}
    names = [k for k, v in weights.items() if v.is_floating_point() and v.ndim >= 2]
    base = eval_fn(weights)
    d = tempfile.mkdtemp()
    rows = []

    def run(label, scheme, target=None, **kw):
        p = os.path.join(d, "x.ckz")
        r = ex.export(state, p, scheme=scheme, force=True, eval_fn=eval_fn, device=dev, **kw)
        lp = r["loss"]["predicted"]
        lc = r.get("correction", {}).get("loss")
        row = {"variant": label, "x_vs_full": full_bytes / r["dst_bytes"], "bytes": r["dst_bytes"],
               "bpw": r["bpw"], "bpw_est": r["bpw_est"], "target_bpw": target, "loss": r["loss"]["measured"],
               "loss_change_pct": r["loss"]["change_pct"],
               "predicted_change_pct": None if lp is None else 100 * (lp - r["loss"]["base"]) / r["loss"]["base"],
               "correction_evals": None if lc is None else lc["evals"],
               "correction": r.get("correction"),
               "schemes": {s: sum(1 for q in r["quantized"].values() if q["scheme"] == s)
                           for s in sorted({q["scheme"] for q in r["quantized"].values()})}}
        rows.append(row)
        print(f"{label:40s} x{row['x_vs_full']:6.2f}  bpw {row['bpw']:.3f}  loss {row['loss_change_pct']:+.3f} %",
              file=sys.stderr)
        return r

    run("bf16 (entropy-coded)", "bf16")
    uniform = {}
    for s in [u for u in args.uniform.split(",") if u]:
        uniform[s] = run(f"uniform RTN {s}", s, search=False)
        if args.uniform_search:
            uniform[s] = run(f"uniform clip-search {s}", s, search=True)
    # the sensitivity table: each tensor x each candidate, measured once, reused for every budget
    t1 = time.time()
    table, base2 = alloc.measure({k: v.to(dev) for k, v in weights.items()}, names, alloc.AUTO_CANDIDATES, eval_fn)
    measure_s = time.time() - t1
    common = dict(sensitivity=table, damage_model=args.damage_model, max_evals=args.max_evals)
    for s, r in uniform.items():
        if s == "fp8":
            continue
        # budget: the *stored* bpw of the uniform run; the allocation's stored bpw stays <= it
        run(f"allocation @ {s} size", "auto", target=r["bpw"], bpw=r["bpw"], **common)
    for lb in [float(x) for x in args.loss_budgets.split(",") if x]:
        run(f"allocation loss <= +{100 * lb:g} %, uncorrected", "auto", max_loss_increase=lb, correct=False, **common)
        run(f"allocation loss <= +{100 * lb:g} %, corrected", "auto", max_loss_increase=lb, **common)

    times = export_times(state, dev, d)

    out = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
           "torch": torch.__version__, "args": vars(args), "train_s": train_s, "params": sum(w.numel() for w in weights.values()),
           "full_state_bytes": full_bytes, "state_bytes": {k: nbytes(v) for k, v in comp.items()},
           "base_loss": base, "sensitivity_measure_s": measure_s, "export_s": times, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{out['device']}, {out['params'] / 1e6:.1f} M params, {args.steps} steps, full training state "
          f"{full_bytes / 1e6:,.1f} MB, held-out loss {base:.4f}\n")
    print("| weights as | x vs full state | bpw stored | target bpw | bpw entropy | held-out loss change "
          "| predicted (additive) | joint evals | schemes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = "" if r["predicted_change_pct"] is None else f"{r['predicted_change_pct']:+.3f} %"
        tgt = "" if r["target_bpw"] is None else f"{r['target_bpw']:.3f}"
        ev = "" if r["correction_evals"] is None else str(r["correction_evals"])
        sch = ", ".join(f"{k} x{v}" for k, v in r["schemes"].items())
        print(f"| {r['variant']} | {r['x_vs_full']:.1f} | {r['bpw']:.3f} | {tgt} | {r['bpw_est']:.3f} "
              f"| {r['loss_change_pct']:+.3f} % | {pred} | {ev} | {sch} |")
    print("\nexport time of the full state (no eval): " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
          + f"; sensitivity measurement {measure_s:.1f} s")


if __name__ == "__main__":
    main()
