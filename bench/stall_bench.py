"""Training-step stall per checkpoint on the GPU benchmark model (issue: training-loop
integration): ckptzip async_save vs torch.save vs DCP async_save, same state and disk; staging
memory over 100 async saves; bit-exact resume of the next 50 steps.

    PYTHONPATH=src python bench/stall_bench.py --out DIR
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip  # noqa: E402
from ckptzip import asyncsave  # noqa: E402
from gpt import checkpoint, train  # noqa: E402


def timed(fn):
    """Seconds the caller is blocked: the GPU is idle before; afterwards we wait for the work the
    call left on the training stream (the next step would queue behind it), not for copies it
    left on side streams, which overlap the next steps."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    torch.cuda.current_stream().synchronize()
    return r, time.perf_counter() - t


def fsync_file(p):
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def stalls(state, d, reps=5):
    res = {}

    def torch_save(i):
        p = f"{d}/t{i}.pt"
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    res["torch.save (blocking)"] = [timed(lambda i=i: torch_save(i))[1] for i in range(reps)]
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
    flat = {}
    for k, v in state["model"].items():
        flat[f"model.{k}"] = v
    for k, v in state["model_bf16"].items():
        flat[f"bf16.{k}"] = v
    for pid, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            flat[f"opt.{pid}.{k}"] = v
    out, fut = [], None
    for i in range(reps):
        if fut is not None:
            fut.result()
        f, t = timed(lambda i=i: dcp.async_save(flat, checkpoint_id=f"{d}/dcp{i}"))
        fut = f
        out.append(t)
    fut.result()
    res["DCP async_save"] = out
    out, h = [], None
    for i in range(reps):
        if h is not None:
            h.wait()
        h, t = timed(lambda i=i: ckptzip.async_save(state, f"{d}/c{i}.ckz"))
        out.append(t)
    h.wait()
    res["ckptzip async_save"] = out
    res["ckptzip async_save (reported stall_s)"] = [h.stall_s]
    return {k: {"median_s": statistics.median(v), "all_s": v} for k, v in res.items()}


def loop_cost(model, opt, d, steps=20, reps=3, only=()):
    """Training time lost per checkpoint, background work included: wall time of ``steps``
    training steps that begin with a checkpoint minus the same steps without one (median of
    ``reps`` rounds; every round runs each method once, in turn; also the median of the per-round
    differences); each save is waited for after the steps (not counted: a loop checkpoints far
    less often than every ``steps`` steps)."""
    import torch.nn.functional as F
    from gpt import corpus
    text = corpus(8 << 20).cuda()
    g = torch.Generator().manual_seed(3)

    def step():
        ix = torch.randint(0, text.numel() - 513, (16,), generator=g).cuda()
        seq = text[ix[:, None] + torch.arange(513, device="cuda")].long()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def state():
        sd = model.state_dict()
        return {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "optimizer": opt.state_dict()}

    import torch.distributed.checkpoint as dcp

    def dcp_save(i):
        s = state()
        flat = {f"model.{k}": v for k, v in s["model"].items()}
        flat.update({f"bf16.{k}": v for k, v in s["model_bf16"].items()})
        for pid, st in s["optimizer"]["state"].items():
            flat.update({f"opt.{pid}.{k}": v for k, v in st.items()})
        return dcp.async_save(flat, checkpoint_id=f"{d}/loop_dcp{i}")

    def torch_save(i):
        with open(f"{d}/loop_t{i}.pt", "wb") as f:
            torch.save(state(), f)
            f.flush()
            os.fsync(f.fileno())

    methods = {"none": None, "torch.save": torch_save, "DCP async_save": dcp_save,
               "ckptzip async_save": lambda i: ckptzip.async_save(state(), f"{d}/loop_c{i}.ckz")}
    extra = {  # (only where named in ``only``: what the background write's fsync costs the loop)
        "ckptzip async_save fsync=False": lambda i: ckptzip.async_save(state(), f"{d}/loop_n{i}.ckz", fsync=False)}
    if only:
        methods.update(extra)
        methods = {k: v for k, v in methods.items() if k == "none" or k in only}
    for _ in range(5):
        step()
    ts: dict = {name: [] for name in methods}
    for i in range(reps + 1):  # rounds interleave the methods: drift of the machine hits all alike
        for name, save in methods.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            pending = save(i) if save else None
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if hasattr(pending, "wait"):
                pending.wait()
            elif hasattr(pending, "result"):
                pending.result()
            for p in glob.glob(f"{d}/loop_*"):  # (many rounds of files would fill the disk)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            if i:  # the first round warms up
                ts[name].append(dt)
    out = {name: statistics.median(v) for name, v in ts.items()}
    base = out.pop("none")
    # each round's loss against the same round's loop without a checkpoint, then the median
    paired = {k: statistics.median(a - b for a, b in zip(ts[k], ts["none"])) for k in out}
    return {"steps": steps, "reps": reps, "step_s": base / steps,
            "lost_per_checkpoint_s": {k: v - base for k, v in out.items()},
            "lost_per_checkpoint_s_paired": paired,
            "paired_ci95": {k: paired_ci([a - b for a, b in zip(ts[k], ts["none"])]) for k in out},
            "rounds_s": ts}


def paired_ci(diffs, n=4000, seed=0) -> dict:
    """Mean and median of per-round losses with 95 % bootstrap intervals (percentiles of ``n``
    resamples of the rounds, with replacement): how well one run pins the loss down, since
    rounds vary by tens of ms."""
    import numpy as np
    d = np.asarray(diffs, dtype=np.float64)
    if len(d) < 8:  # (a few rounds: the resamples' percentiles are just their range)
        return {}
    r = np.random.default_rng(seed).choice(d, size=(n, len(d)), replace=True)
    q = lambda x: [float(v) for v in np.percentile(x, [2.5, 97.5])]  # noqa: E731
    return {"rounds": len(d), "mean": float(d.mean()), "mean_ci95": q(r.mean(axis=1)),
            "median": float(np.median(d)), "median_ci95": q(np.median(r, axis=1))}


def staging_over_saves(state, d, n=100):
    caps, gpu_peak, rss = [], [], []
    import resource
    for i in range(n):
        ckptzip.async_save(state, f"{d}/m.ckz", fsync=False).wait()
        caps.append(asyncsave.ARENA.capacity)
        gpu_peak.append(torch.cuda.max_memory_allocated())
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    at = sorted({0, 1, min(9, n - 1), n - 1})
    return {"saves": n, "after_saves": [i + 1 for i in at], "arena_bytes": [caps[i] for i in at],
            "gpu_max_allocated": [gpu_peak[i] for i in at], "max_rss": [rss[i] for i in at]}


def resume_check(d, steps=100, at=50):
    """Train `steps` steps saving at `at`; reload that checkpoint into a fresh model and optimizer
    and train the remaining steps again: the losses must match bit for bit."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from gpt import GPT, corpus
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)  # a resume can only be exact if training is
    text = corpus().cuda()

    def run(model, opt, g, start, end, save_at=None):
        losses = []
        for step in range(start, end):
            ix = torch.randint(0, text.numel() - 513, (8,), generator=g).cuda()
            seq = text[ix[:, None] + torch.arange(513, device="cuda")].long()
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
                loss = F.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step == save_at:
                ckptzip.async_save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                    "gen": g.get_state(), "cuda_rng": torch.cuda.get_rng_state()},
                                   f"{d}/resume.ckz").wait()
        return losses

    torch.manual_seed(0)
    model = GPT().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    full = run(model, opt, g, 0, steps, save_at=at - 1)
    s = ckptzip.load(f"{d}/resume.ckz", map_location="cuda")
    model2 = GPT().cuda()
    model2.load_state_dict(s["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-4)
    opt2.load_state_dict(s["optimizer"])
    g2 = torch.Generator()
    g2.set_state(s["gen"].cpu())
    torch.cuda.set_rng_state(s["cuda_rng"].cpu())
    again = run(model2, opt2, g2, at, steps)
    same = [a == b for a, b in zip(full[at:], again)]
    # sanity: an identical uninterrupted run reproduces itself (training is deterministic)
    torch.manual_seed(0)
    model3 = GPT().cuda()
    opt3 = torch.optim.AdamW(model3.parameters(), lr=3e-4)
    repeat = run(model3, opt3, torch.Generator().manual_seed(1), 0, steps)
    return {"resumed_at": at, "compared_steps": len(again), "bit_exact_steps": sum(same),
            "first_losses": [full[at], again[0]], "all_equal": all(same) and len(again) == steps - at,
            "uninterrupted_run_reproduces_itself": repeat == full}


def profile_async(state, d):
    import cProfile, io, pstats
    ckptzip.async_save(state, f"{d}/p.ckz").wait()
    pr = cProfile.Profile()
    pr.enable()
    h = ckptzip.async_save(state, f"{d}/p.ckz")
    pr.disable()
    h.wait()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25)
    print("stall", h.stall_s)
    with open(os.path.join(os.environ.get("OUT", "."), "async_profile.txt"), "w") as f:
        f.write(f"stall {h.stall_s}\n" + s.getvalue())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--disk", default="/tmp/ckstall")
    ap.add_argument("--saves", type=int, default=100)
    ap.add_argument("--loop-steps", type=int, default=20, help="training steps per loop round (default 20)")
    ap.add_argument("--loop-reps", type=int, default=3, help="timed loop rounds per method, median (default 3)")
    ap.add_argument("--only", default="", help="comma-separated methods of the loop figure, e.g. 'ckptzip async_save' "
                    "(default: all but 'ckptzip async_save fsync=False', which only this option adds: its files "
                    "are deleted once written, so their write-back to the disk is mostly not measured); with it "
                    "only that figure is measured (an A/B of two code versions); 95 %% intervals from 8 rounds on")
    a = ap.parse_args()
    only = [m.strip() for m in a.only.split(",") if m.strip()]
    known = ("torch.save", "DCP async_save", "ckptzip async_save", "ckptzip async_save fsync=False")
    if any(m not in known for m in only):
        ap.error(f"--only: methods are {', '.join(map(repr, known))}")
    os.makedirs(a.disk, exist_ok=True)
    model, opt, _ = train(a.steps)
    state = checkpoint(model, opt)
    # a warm process: the kernels' background compilation (started by the first GPU save; minutes
    # on a fresh machine's empty cache) must not run during the timed rounds (without this wait
    # the first process on a fresh H100 lost 0.21-0.25 s per checkpoint, later ones 0.07-0.14 s)
    from ckptzip.kernels import wait_kernels
    ckptzip.async_save(state, f"{a.disk}/warm.ckz").wait()
    wait_kernels(300)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if only:
        res["loop_cost"] = loop_cost(model, opt, a.disk, a.loop_steps, a.loop_reps, only=only)
        print(json.dumps(res["loop_cost"]), flush=True)
        with open(os.path.join(a.out, "stall.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    profile_async(state, a.disk)
    if a.saves:
        res["stall"] = stalls(state, a.disk)
        print(json.dumps(res["stall"], indent=1), flush=True)
        res["loop_cost"] = loop_cost(model, opt, a.disk, a.loop_steps, a.loop_reps)
        print(json.dumps(res["loop_cost"]), flush=True)
        res["staging"] = staging_over_saves(state, a.disk, a.saves)
        print(json.dumps(res["staging"]), flush=True)
    del model, opt, state
    res["resume"] = resume_check(a.disk)
    print(json.dumps(res["resume"]), flush=True)
    with open(os.path.join(a.out, "stall.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
