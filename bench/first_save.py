"""The first save and the first load of a process, with empty compiler caches (issue: performance
where users feel it). Each measurement runs in a fresh Python process with its own empty Triton
cache directory, after the benchmark state exists on the GPU (so CUDA is initialised for every
method alike): torch.save (+ fsync) vs ckptzip.save, then torch.load vs ckptzip.load of those
files (page cache dropped when permitted); the same for ``portable=True`` (GPU zstd). Each call's
peak extra GPU memory (torch's allocator, which nvCOMP's temporary memory also comes from): above
the state during a save, above the state and the loaded copy during a load.

    PYTHONPATH=src python bench/first_save.py --out OUT [--reps 3]

Prints a table and writes OUT/first_save.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import os, sys, time, json
t_import = time.perf_counter()
import torch
sys.path.insert(0, {bench!r})
from gpt import one_step_state
state = one_step_state("cuda")
torch.cuda.synchronize()
method, path = {method!r}, {path!r}
def drop(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
t = time.perf_counter()
if method == "torch.save":
    with open(path, "wb") as f:
        torch.save(state, f); f.flush(); os.fsync(f.fileno())
elif method.startswith("ckptzip.save"):
    import ckptzip
    ckptzip.save(state, path, portable=method.endswith("portable")); torch.cuda.synchronize()
elif method == "torch.load":
    drop(path); t = time.perf_counter()
    s = torch.load(path, map_location="cuda", weights_only=True); torch.cuda.synchronize()
elif method.startswith("ckptzip.load"):
    drop(path); t = time.perf_counter()
    import ckptzip
    s = ckptzip.load(path, map_location="cuda"); torch.cuda.synchronize()
dt = time.perf_counter() - t
extra = torch.cuda.max_memory_allocated() - (torch.cuda.memory_allocated() if "load" in method else base)
print(json.dumps({{"method": method, "s": dt, "gpu_mib": extra / 2**20}}))
"""


def run(method: str, path: str, env: dict) -> dict:
    bench = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(bench=bench, method=method, path=path)
    with tempfile.TemporaryDirectory() as cache:
        e = {**env, "TRITON_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where first_save.json goes")
    ap.add_argument("--disk", default="/tmp/first_save", help="directory for the files")
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per method (default 3)")
    ap.add_argument("--only", default=None, help="comma-separated methods to run, e.g. "
                    "'ckptzip.save,ckptzip.load' (default: all six; a load needs its save's file)")
    a = ap.parse_args()
    os.makedirs(a.disk, exist_ok=True)
    # ckptzip's bytecode compiled first, as pip does when it installs a package (torch's is): on a
    # machine with PYTHONDONTWRITEBYTECODE=1 every fresh process otherwise compiles ckptzip's
    # sources inside the timed first call (0.12-0.17 s against 0.03-0.04 s imported from .pyc on
    # a 2-core CPU)
    import compileall
    import ckptzip
    compileall.compile_dir(os.path.dirname(ckptzip.__file__), quiet=1)
    env = dict(os.environ)
    files = {"torch": os.path.join(a.disk, "s.pt"), "ckptzip": os.path.join(a.disk, "s.ckz"),
             "portable": os.path.join(a.disk, "p.ckz")}
    res: dict[str, list[float]] = {}
    mem: dict[str, list[float]] = {}
    for rep in range(a.reps):
        for method, f in (("torch.save", files["torch"]), ("ckptzip.save", files["ckptzip"]),
                          ("torch.load", files["torch"]), ("ckptzip.load", files["ckptzip"]),
                          ("ckptzip.save portable", files["portable"]), ("ckptzip.load portable", files["portable"])):
            if a.only and method not in a.only.split(","):
                continue
            r = run(method, f, env)
            res.setdefault(method, []).append(r["s"])
            mem.setdefault(method, []).append(r["gpu_mib"])
            print(method, f"{r['s']:.3f} s, {r['gpu_mib']:.0f} MiB extra GPU", flush=True)
    sizes = {k: os.path.getsize(v) for k, v in files.items()}
    lines = ["| first call in a fresh process | median s | all runs s | peak extra GPU MiB (max) |",
             "|---|---|---|---|"]
    for m, xs in res.items():
        lines.append(f"| {m} | {statistics.median(xs):.3f} | {' / '.join(f'{x:.3f}' for x in xs)} "
                     f"| {max(mem[m]):.0f} |")
    print("\n".join(lines))
    print("bytes: " + "  ".join(f"{k} {v:,}" for k, v in sizes.items()))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "first_save.json"), "w") as f:
        json.dump({"runs": res, "gpu_mib": mem, "bytes": sizes, "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
