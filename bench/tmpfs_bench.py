"""Saves to and loads from fast storage (tmpfs: the page cache, what a parallel file system or
GPUDirect Storage would deliver at 10-25 GB/s per node), with the machine's own ceilings measured
in the same run (issue: performance where users feel it, item 3).

Ceilings, on the same byte count as ckptzip's file:
* read: tmpfs -> pinned host memory with 1 and with N threads (16 MiB preads);
* host -> GPU copy from pinned memory; GPU -> host copy into pinned memory;
* write: GPU -> pinned host -> tmpfs file (the copy and N threads' writes), i.e. what any writer of
  these bytes must do at least; one round of it before every timed save round (best and median).
Then ckptzip.save (default, and with ``reuse_plan=True`` as a training loop's repeated saves
and the manager use it) / ckptzip.load of the benchmark state (1.2 GB on the GPU; warm process,
best and median of ``--reps``), with where the load's time goes (host reads + checksums on the reader thread,
GPU decode on the caller's thread).

    PYTHONPATH=src python bench/tmpfs_bench.py --out OUT [--dir /dev/shm] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
import ckptzip  # noqa: E402
from ckptzip.engine import decode as _decode  # noqa: E402
from gpt import one_step_state  # noqa: E402

PIECE = 16 << 20


def best_med(xs):
    return min(xs), statistics.median(xs)


def read_ceiling(path: str, n: int, threads: int, reps: int) -> float:
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    mv = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(threads)
    ts = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(lambda a: os.preadv(fd, [mv[a:a + PIECE]], a), range(0, n, PIECE)))
            ts.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        pool.shutdown()
    return n / min(ts) / 1e9


class WriteCeiling:
    """GPU -> pinned host -> new tmpfs file of ``gpu``'s bytes (N threads' writes, fsync): one
    round per call of :meth:`once`, taken between ckptzip's timed rounds, so that the ceiling
    and ckptzip see the same machine state and the same number of rounds (a ceiling of 3
    rounds taken once moved from 1.9 to 2.9 GB/s between two runs on one machine)."""

    def __init__(self, path: str, gpu: torch.Tensor, threads: int) -> None:
        self.path, self.gpu, self.n = path, gpu, gpu.numel()
        self.host = torch.empty(self.n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.mv = memoryview(self.host.numpy())
        self.pool = ThreadPoolExecutor(threads)
        self.sync = torch.cuda.synchronize if gpu.is_cuda else (lambda: None)
        self.d2h, self.wr, self.both = [], [], []

    def once(self) -> None:
        n, mv = self.n, self.mv
        self.sync()
        t = time.perf_counter()
        self.host.copy_(self.gpu, non_blocking=True)
        self.sync()
        t1 = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, n)
        list(self.pool.map(lambda a: os.pwritev(fd, [mv[a:a + PIECE]], a), range(0, n, PIECE)))
        os.fsync(fd)
        os.close(fd)
        t2 = time.perf_counter()
        self.d2h.append(t1 - t)
        self.wr.append(t2 - t1)
        self.both.append(t2 - t)

    def result(self) -> dict:
        self.pool.shutdown()
        n = self.n
        return {"d2h_gbs": n / min(self.d2h) / 1e9, "write_gbs": n / min(self.wr) / 1e9,
                "gpu_to_file_gbs": n / min(self.both) / 1e9,
                "gpu_to_file_gbs_median": n / statistics.median(self.both) / 1e9, "gpu_to_file_s": self.both}


def h2d_ceiling(n: int, reps: int) -> float:
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return n / min(ts) / 1e9


class Timers:
    """Wall time inside the load's stages (monkeypatched around the engine's functions)."""

    def __init__(self) -> None:
        self.t = {"read+checksum (reader thread)": 0.0, "decode (caller)": 0.0}
        _decode.read_stored = self._timed(_decode.read_stored, "read+checksum (reader thread)")
        _decode.decode_group = self._timed(_decode.decode_group, "decode (caller)")

    def _timed(self, fn, key: str):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t
        return run

    def reset(self) -> None:
        for k in self.t:
            self.t[k] = 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where tmpfs_bench.json goes")
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs directory (default /dev/shm)")
    ap.add_argument("--reps", type=int, default=7, help="timed saves and loads (default 7)")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1),
                    help="threads for the read/write ceilings (default: min(16, cores))")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of this script)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one warm load (cProfile of the caller's thread, top 40 by own time) "
                         "into OUT/tmpfs_load_profile.txt")
    a = ap.parse_args()
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    state = one_step_state(dev)
    sync()
    raw = sum(t.numel() * t.element_size() for d in (state["model"], state["model_bf16"]) for t in d.values())
    raw += sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values()
               if torch.is_tensor(t))
    path = os.path.join(a.dir, "tmpfs_bench.ckz")
    scratch = os.path.join(a.dir, "tmpfs_bench.bin")
    for _ in range(2):  # warm: compilers, pinned pool, plan cache
        ckptzip.save(state, path)
        ckptzip.load(path, map_location=dev)
    if dev == "cuda":
        # the kernels' background compilation (started by the first GPU save; minutes on a fresh
        # machine's empty cache) must not run during the timed rounds: in the first process on a
        # fresh H100 it made loads 0.146-0.274 s instead of 0.08-0.11
        from ckptzip.kernels import wait_kernels
        wait_kernels(600)
    n = os.path.getsize(path)
    res = {"info": {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "raw_bytes": raw, "stored_bytes": n,
                    "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}}
    gpu = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    wc = WriteCeiling(scratch, gpu, a.threads)
    wc.once()  # (the file the read ceilings read)
    res["ceiling"] = {"read_1thread_gbs": read_ceiling(scratch, n, 1, 3),
                      f"read_{a.threads}threads_gbs": read_ceiling(scratch, n, a.threads, 3),
                      "h2d_gbs": h2d_ceiling(n, 3) if dev == "cuda" else float("inf")}
    wc.d2h.clear(), wc.wr.clear(), wc.both.clear()
    saves, reused, loads = [], [], []
    timers = Timers()
    stages = []
    ckptzip.save(state, path, reuse_plan=True)  # (fills the plan cache)
    for _ in range(a.reps):
        wc.once()  # the write ceiling, in every round
        sync()
        t = time.perf_counter()
        ckptzip.save(state, path)
        saves.append(time.perf_counter() - t)
        sync()
        t = time.perf_counter()
        ckptzip.save(state, path, reuse_plan=True)  # a training loop's repeated saves
        reused.append(time.perf_counter() - t)
        timers.reset()
        t = time.perf_counter()
        out = ckptzip.load(path, map_location=dev)
        sync()
        loads.append(time.perf_counter() - t)
        stages.append(dict(timers.t))
        del out
    res["ceiling"].update(wc.result())
    os.unlink(scratch)
    del gpu, wc
    b, m = best_med(saves)
    res["save"] = {"s": saves, "best_s": b, "median_s": m, "stored_gbs_best": n / b / 1e9, "raw_gbs_best": raw / b / 1e9}
    b, m = best_med(reused)
    res["save_reuse_plan"] = {"s": reused, "best_s": b, "median_s": m, "stored_gbs_best": n / b / 1e9,
                              "raw_gbs_best": raw / b / 1e9}
    b, m = best_med(loads)
    res["load"] = {"s": loads, "best_s": b, "median_s": m, "stored_gbs_best": n / b / 1e9, "stages": stages[loads.index(b)]}
    if a.profile:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        out = ckptzip.load(path, map_location=dev)
        sync()
        pr.disable()
        del out
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(40)
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tmpfs_load_profile.txt"), "w") as f:
            f.write(buf.getvalue())
    os.unlink(path)
    c = res["ceiling"]
    print(f"state {raw / 1e9:.2f} GB raw, {n / 1e9:.3f} GB stored; {res['info']['device']}")
    print("| ceiling | GB/s |\n|---|---|")
    for k, v in c.items():
        if not isinstance(v, list):
            print(f"| {k} | {v:.1f} |")
    cb, cm = best_med(c["gpu_to_file_s"])
    print(f"GPU->file ceiling, same rounds: best {cb:.3f} s, median {cm:.3f} s")
    print("\n| ckptzip | best s | median s | stored GB/s (best) | vs ceiling (best / median) |\n|---|---|---|---|---|")
    for name, r in (("save", res["save"]), ("save, reuse_plan=True", res["save_reuse_plan"])):
        print(f"| {name} | {r['best_s']:.3f} | {r['median_s']:.3f} | {r['stored_gbs_best']:.2f} | "
              f"{cb / r['best_s']:.0%} / {cm / r['median_s']:.0%} of GPU->file |")
    rk = f"read_{a.threads}threads_gbs"
    print(f"| load | {res['load']['best_s']:.3f} | {res['load']['median_s']:.3f} | {res['load']['stored_gbs_best']:.2f} | "
          f"{res['load']['stored_gbs_best'] / min(c[rk], c['h2d_gbs']):.0%} of min(read, H2D) |")
    print("load stages (best run):", json.dumps({k: round(v, 4) for k, v in res["load"]["stages"].items()}))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tmpfs_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
