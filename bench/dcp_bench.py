"""Distributed checkpoints: ckptzip's DCP storage writer vs DCP's FileSystemWriter (with and
without its ZStandard extension) on the same FSDP2 state, side by side in one run.

An FSDP2 (``fully_shard``) GPT is trained for real (bf16 mixed precision, fp32 params, AdamW) on
text; then its model + optimizer state (``get_state_dict``) is saved and loaded by each method:
save twice (files fsync'd), load with the page cache dropped, ``dcp.async_save`` stall, stored
bytes, per-rank peak extra GPU memory and host RSS. ckptzip's load is checked bit-exact against the
saved state. Any number of GPUs (one rank per GPU, NCCL), or one GPU shared by several ranks
(``--backend gloo``)::

    torchrun --nproc-per-node 1 bench/dcp_bench.py --steps 50 --out OUT            # one H100
    torchrun --nproc-per-node 2 bench/dcp_bench.py --steps 200 --out OUT           # two GPUs

Prints a markdown table and writes ``OUT/dcp_bench.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from gpt import GPT, corpus  # noqa: E402

from ckptzip.storage import start_writeback  # noqa: E402


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(*a) -> None:
    if rank() == 0:
        print(*a, flush=True)


class Peak:
    """Peak host RSS (sampled every 5 ms) and peak GPU memory above the level at entry; with
    several ranks, the largest of any rank (every rank enters and leaves it together)."""

    def __enter__(self):
        self.base_rss = self._rss()
        self.peak_rss = self.base_rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.base_gpu = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return self

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak_rss = max(self.peak_rss, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak_rss = max(self.peak_rss, self._rss())
        self.rss_mib = (self.peak_rss - self.base_rss) / 2**20
        self.gpu_mib = 0.0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.gpu_mib = (torch.cuda.max_memory_allocated() - self.base_gpu) / 2**20
        if dist.is_initialized() and dist.get_world_size() > 1:
            nccl = dist.get_backend() == "nccl"
            t = torch.tensor([self.rss_mib, self.gpu_mib], dtype=torch.float64,
                             device=torch.cuda.current_device() if nccl else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.rss_mib, self.gpu_mib = (float(x) for x in t.tolist())


def barrier():
    if dist.is_initialized():
        dist.barrier()


def drop_caches():
    barrier()
    if rank() == 0:
        os.system("sync")
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError as e:
            log(f"(page cache not dropped: {e})")
    barrier()


def disk_ceiling(disk: str, nbytes: int) -> dict:
    """What the disk gives every rank at once: each rank writes ``nbytes`` (64 MiB writes, each
    one's disk write started at once as ckptzip's writer does, then fsync)
    to a file of its own, then reads it back with the page cache dropped. GB/s over all ranks."""
    os.makedirs(disk, exist_ok=True)
    p = os.path.join(disk, f"ceiling_{rank()}.bin")
    block = os.urandom(64 << 20)
    n = max(1, nbytes // len(block))
    barrier()
    t = time.perf_counter()
    with open(p, "wb", buffering=0) as f:  # each write's disk write started at once, as ckptzip does
        for i in range(n):
            f.write(block)
            start_writeback(f, i * len(block), len(block))
        os.fsync(f.fileno())
    barrier()
    w = time.perf_counter() - t
    drop_caches()
    buf = bytearray(len(block))
    t = time.perf_counter()
    fd = os.open(p, os.O_RDONLY)
    while os.readv(fd, [buf]):
        pass
    os.close(fd)
    barrier()
    r = time.perf_counter() - t
    os.unlink(p)
    total = n * len(block) * (dist.get_world_size() if dist.is_initialized() else 1)
    return {"bytes": total, "write_gbs": total / w / 1e9, "read_gbs": total / r / 1e9}


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(path) for f in fs)


def train(steps: int, d: int, layers: int, heads: int, ctx: int, batch: int, dev: torch.device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = GPT(d=d, layers=layers, heads=heads, ctx=ctx).to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    text = corpus().to(dev)
    g = torch.Generator().manual_seed(1 + rank())

    def one_step(step: int) -> torch.Tensor:
        ix = torch.randint(0, text.numel() - ctx - 1, (batch,), generator=g).to(dev)
        seq = text[ix[:, None] + torch.arange(ctx + 1, device=dev)].long()
        for grp in opt.param_groups:
            grp["lr"] = 3e-4 * min(1.0, (step + 1) / 20)
        loss = torch.nn.functional.cross_entropy(model(seq[:, :-1]).float().reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    t0 = time.time()
    for step in range(steps):
        loss = one_step(step)
        if step % 25 == 0 or step == steps - 1:
            log(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
    return model, opt, one_step


_CKPT_PG = None


def ckpt_group():
    """A gloo group of its own for dcp.async_save: its collectives run in a background thread
    and must not interleave with the training step's on the default group (torch's advice)."""
    global _CKPT_PG
    if _CKPT_PG is None:
        _CKPT_PG = dist.new_group(backend="gloo")
    return _CKPT_PG


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    barrier()


def loop_lost(one_step, state, mk_w, path, dev, base_steps: int = 8) -> dict:
    """Time lost in the training loop to one ``dcp.async_save``: train ``base_steps`` steps
    without a save (the step time), then issue the save and keep training until its future is
    done (at least ``base_steps`` steps); lost = that span - steps x step time."""
    sync(dev)
    t = time.perf_counter()
    for i in range(base_steps):
        one_step(10_000 + i)
    sync(dev)
    step_s = (time.perf_counter() - t) / base_steps
    t = time.perf_counter()
    fut = dcp.async_save(state, storage_writer=mk_w(path), process_group=ckpt_group())
    n = 0
    while True:
        one_step(20_000 + n)
        n += 1
        # every rank must take the same number of steps (FSDP collectives): decide together
        done = torch.tensor([int(fut.done() and n >= base_steps)], device=dev if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            break
    fut.result()
    sync(dev)
    span = time.perf_counter() - t
    return {"step_s": step_s, "steps": n, "span_s": span, "lost_s": span - n * step_s}


def u8(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (bit-exact comparison: NaN payloads and -0.0 count)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def local_tensors(sd, out=None):
    """Every tensor's local data (a DTensor's shard), in a stable order."""
    from torch.distributed.tensor import DTensor
    out = [] if out is None else out
    if isinstance(sd, dict):
        for k in sorted(sd, key=str):
            local_tensors(sd[k], out)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            local_tensors(v, out)
    elif isinstance(sd, DTensor):
        out.append(sd.to_local())
    elif isinstance(sd, torch.Tensor):
        out.append(sd)
    return out


def clone_state(sd):
    from torch.distributed.tensor import DTensor
    if isinstance(sd, dict):
        return {k: clone_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone_state(v) for v in sd]
    if isinstance(sd, DTensor):
        return DTensor.from_local(torch.zeros_like(sd.to_local()), sd.device_mesh, sd.placements,
                                  shape=sd.shape, stride=sd.stride())
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return sd


def consolidate_check(path, state, mine):
    """ckptzip consolidate on rank 0 (one .ckz, no process group needed to read it), then every
    rank checks its shards against the consolidated full tensors, bit-exact."""
    import ckptzip
    import ckptzip.dcp as cz
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    out = path + ".consolidated.ckz"
    t = time.perf_counter()
    if rank() == 0:
        cz.consolidate(path, out)
    barrier()
    dt = time.perf_counter() - t
    full = ckptzip.load(out, map_location="cpu")
    ok = True

    def walk(a, b):
        nonlocal ok
        if isinstance(a, dict):
            for k in a:
                walk(a[k], b[k])
        elif isinstance(a, list):
            for x, y in zip(a, b):
                walk(x, y)
        elif isinstance(a, DTensor):
            shape, off = compute_local_shape_and_global_offset(a.shape, a.device_mesh, a.placements)
            part = b
            for d, (o, n) in enumerate(zip(off, shape)):
                part = part.narrow(d, o, n)
            loc = a.to_local().cpu()
            ok &= torch.equal(u8(loc), u8(part))
        elif isinstance(a, torch.Tensor):
            ok &= torch.equal(u8(a.cpu()), u8(b))
    walk(state, full)
    one = {}
    if rank() == 0:
        # the same directory through DCP in ONE process (resharded by DCP's planner, no process
        # group used), against the consolidated file
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        md = cz.read_metadata(path)
        sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata)}
        t1 = time.perf_counter()
        dcp.load(sd, storage_reader=cz.Reader(path), no_dist=True)
        one["load_1proc_s"] = time.perf_counter() - t1
        flat, _ = flatten_state_dict(full)
        one["load_1proc_bit_exact"] = len(sd) > 0 and all(torch.equal(u8(v), u8(flat[k])) for k, v in sd.items())
        ok &= one["load_1proc_bit_exact"]
        del sd, flat
    del full
    flag = torch.tensor([int(ok)], device=mine[0].device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    barrier()
    size = os.path.getsize(out) if rank() == 0 else None
    if rank() == 0:
        os.remove(out)
    return {"s": dt, "bytes": size, "bit_exact": bool(flag.item()), **one}


def methods(args):
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    out = {
        "DCP FileSystemWriter": (lambda p: FileSystemWriter(p), lambda p: FileSystemReader(p)),
    }
    try:
        from torch.distributed.checkpoint._extension import ZStandard
        import zstandard  # noqa: F401
        out["DCP + ZStandard"] = (lambda p: FileSystemWriter(p, _extensions=[ZStandard()]),
                                  lambda p: FileSystemReader(p))
    except Exception as e:  # noqa: BLE001
        log(f"(DCP ZStandard extension unavailable: {e})")
    import ckptzip.dcp as cz
    out["ckptzip dcp.Writer"] = (lambda p: cz.Writer(p), lambda p: cz.Reader(p))
    want = [w for w in args.methods.split(",") if w]
    if not want:
        return out
    # in the order --methods names them (a slow method last: --deadline-s may skip it, not the others)
    return {k: out[k] for w in want for k in out if w in k}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50, help="training steps before saving (default 50)")
    ap.add_argument("--width", dest="d", type=int, default=2048, help="model width (default 2048: 1.2 B params with 24 layers)")
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks (default 24)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    ap.add_argument("--disk", default="/tmp/dcp_bench", help="directory the checkpoints go to")
    ap.add_argument("--backend", default=None, help="nccl (one GPU per rank, default) or gloo")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where dcp_bench.json goes")
    ap.add_argument("--reps", type=int, default=2, help="saves per method (default 2)")
    ap.add_argument("--no-consolidate", action="store_true", help="skip ckptzip consolidate + its check")
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the disk's write/read GB/s "
                    "(every rank writes up to 8 GiB with fsync, reads it back cold)")
    ap.add_argument("--no-loop", action="store_true", help="skip the time lost in the training loop per async save")
    ap.add_argument("--methods", default="", help="comma-separated substrings: run only the methods whose name "
                    "contains one, e.g. 'FileSystem,ckptzip' (default: all three; one rank on one GPU runs all "
                    "three in about 12 min, over the device's 10-min command limit: split the run)")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip a method (or a loop measurement) "
                    "that would start later than this many seconds after the script started, so that a run "
                    "under a time limit ends with a table (default: no deadline)")
    ap.add_argument("--loop-methods", default="", help="comma-separated substrings: measure the loop time lost only "
                    "for methods whose name contains one (default: every method)")
    a = ap.parse_args()
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    lr = int(os.environ.get("LOCAL_RANK", 0))
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", lr % ngpu) if ngpu else torch.device("cpu")
    if ngpu:
        torch.cuda.set_device(dev)
    model, opt, one_step = train(a.steps, a.d, a.layers, a.heads, a.ctx, a.batch, dev)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    params = sum(p.numel() for p in model.parameters())
    mine = local_tensors(state)
    raw_local = sum(t.numel() * t.element_size() for t in mine)
    raw = torch.tensor([raw_local], device=dev if backend == "nccl" else "cpu")
    dist.all_reduce(raw)
    raw = int(raw.item())
    log(f"params {params / 1e9:.3f} B, state {raw / 1e9:.2f} GB over {dist.get_world_size()} ranks")
    res = {"info": {"params": params, "raw_bytes": raw, "world_size": dist.get_world_size(),
                    "device": torch.cuda.get_device_name(dev) if ngpu else "cpu", "torch": torch.__version__,
                    "steps": a.steps, "date": time.strftime("%Y-%m-%d")}, "methods": {}}
    if not a.no_ceiling:
        res["info"]["disk"] = disk_ceiling(a.disk, min(raw_local, 8 << 30))
        log("disk ceiling", json.dumps(res["info"]["disk"]))
    t_start = time.perf_counter()

    def late(what: str) -> bool:
        if a.deadline_s is None or time.perf_counter() - t_start <= a.deadline_s:
            return False
        log(f"{what}: skipped (past --deadline-s {a.deadline_s:.0f})")
        res.setdefault("skipped", []).append(what)
        return True

    def dump() -> None:  # after every method: a run killed later keeps what it measured
        if rank() == 0:
            os.makedirs(a.out, exist_ok=True)
            tag = "".join(c if c.isalnum() else "_" for c in a.methods)
            with open(os.path.join(a.out, f"dcp_bench{'_' + tag if tag else ''}.json"), "w") as f:
                json.dump(res, f, indent=1)

    for name, (mk_w, mk_r) in methods(a).items():
        if late(name):
            continue
        r = {"save_s": [], "save_gpu_mib": [], "save_rss_mib": []}
        path = os.path.join(a.disk, name.replace(" ", "_").replace("+", "p").replace(".", ""))
        for rep in range(a.reps):
            if rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            barrier()
            if ngpu:
                torch.cuda.synchronize()
            with Peak() as pk:
                t = time.perf_counter()
                dcp.save(state, storage_writer=mk_w(path))
                barrier()
                r["save_s"].append(time.perf_counter() - t)
            r["save_gpu_mib"].append(pk.gpu_mib)
            r["save_rss_mib"].append(pk.rss_mib)
        r["bytes"] = du(path) if rank() == 0 else None
        drop_caches()
        target = clone_state(state)
        with Peak() as pk:
            t = time.perf_counter()
            dcp.load(target, storage_reader=mk_r(path))
            if ngpu:
                torch.cuda.synchronize()
            barrier()
            r["load_s"] = time.perf_counter() - t
        r["load_gpu_mib"], r["load_rss_mib"] = pk.gpu_mib, pk.rss_mib
        got = local_tensors(target)
        exact = all(torch.equal(u8(x), u8(y)) for x, y in zip(mine, got)) and len(mine) == len(got)
        flag = torch.tensor([int(exact)], device=dev if backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        r["bit_exact"] = bool(flag.item())
        del target, got
        # async: the stall is the time dcp.async_save blocks the caller
        if rank() == 0:
            shutil.rmtree(path + "_async", ignore_errors=True)
        barrier()
        stalls = []
        for rep in range(a.reps):
            with Peak() as pk:
                if ngpu:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=mk_w(path + f"_async{rep}"),
                                     process_group=ckpt_group())
                if ngpu:
                    torch.cuda.current_stream().synchronize()
                stalls.append(time.perf_counter() - t)
                fut.result()
                barrier()
            r.setdefault("async_gpu_mib", []).append(pk.gpu_mib)
            r.setdefault("async_rss_mib", []).append(pk.rss_mib)
        r["async_stall_s"] = stalls
        if rank() == 0:
            for rep in range(a.reps):
                shutil.rmtree(path + f"_async{rep}", ignore_errors=True)
        r["ratio"] = r["bytes"] / raw if r["bytes"] else None
        if name.startswith("ckptzip") and not a.no_consolidate:
            r["consolidate"] = consolidate_check(path, state, mine)
        if rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        barrier()
        res["methods"][name] = r
        log(name, json.dumps(r))
        dump()
    if not a.no_loop:
        # last, since training on changes the saved state: time lost in the loop per async save
        want = [w for w in a.loop_methods.split(",") if w]
        for name, (mk_w, _mk_r) in methods(a).items():
            if want and not any(w in name for w in want) or name not in res["methods"] or late(name + " loop"):
                continue
            path = os.path.join(a.disk, "loop_" + name.replace(" ", "_").replace("+", "p").replace(".", ""))
            r = loop_lost(one_step, state, mk_w, path, dev)
            res["methods"][name]["loop"] = r
            log(name, "loop", json.dumps(r))
            if rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
            barrier()
    if rank() == 0:
        lines = ["| method | ratio | save s (2 runs) | load s | async stall s (each run) | loop time lost s | peak extra GPU MiB (save / async) | peak extra RSS MiB (save / async) | bit-exact |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for name, r in res["methods"].items():
            lines.append(f"| {name} | {r['ratio']:.4f} | {' / '.join(f'{x:.2f}' for x in r['save_s'])} | "
                         f"{r['load_s']:.2f} | {' / '.join(f'{x:.3f}' for x in r['async_stall_s'])} | "
                         f"{r['loop']['lost_s'] if 'loop' in r else float('nan'):.2f} | "
                         f"{max(r['save_gpu_mib']):.0f} / {max(r['async_gpu_mib']):.0f} | "
                         f"{max(r['save_rss_mib']):.0f} / {max(r['async_rss_mib']):.0f} | "
                         f"{r['bit_exact']} |")
        base, cz = res["methods"].get("DCP FileSystemWriter"), res["methods"].get("ckptzip dcp.Writer", {})
        if base and cz:
            lines.append("")
            lines.append(f"ckptzip vs DCP: save {min(cz['save_s']) / min(base['save_s']):.2f}x (best against best; "
                         f"{statistics.mean(cz['save_s']) / statistics.mean(base['save_s']):.2f}x mean), load "
                         f"{cz['load_s'] / base['load_s']:.2f}x, async stall "
                         f"{statistics.median(cz['async_stall_s']) / statistics.median(base['async_stall_s']):.3f}x "
                         f"(median), {cz['async_stall_s'][-1] / base['async_stall_s'][-1]:.3f}x (last run)")
        if "consolidate" in cz:
            lines.append(f"ckptzip consolidate: {json.dumps(cz['consolidate'])}")
        print("\n".join(lines), flush=True)
    dump()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
