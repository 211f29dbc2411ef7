"""CPU benchmark (issue 14 item 5): a small model trained for real on this machine's CPU (model +
AdamW state, fp32, and a bf16 copy of the same state), then, side by side in one run and on the
same state and cores:

* ckptzip.save to a file on disk (fsync'd; also with ``reuse_plan=True``, as a training loop's
  repeated saves and the manager run) and ckptzip.load, MB/s of raw tensor bytes;
* ckptzip in memory (save to / load from a BytesIO): compress / decompress MB/s and ratio; also
  of the one blob ZipNN gets (every tensor's bytes concatenated, as one tensor);
* ZipNN (if installed: ``pip install zipnn==0.5.4``) on the same bytes (every tensor's bytes
  concatenated, ``ZipNN(bytearray_dtype=..., threads=<cores>)``): compress / decompress MB/s
  and ratio;
* ZipNN end to end, as a user checkpoints a state dict with it: torch.save's bytes compressed by
  ZipNN, then decompressed and read by torch.load (in memory);
* torch.save + fsync and torch.load of the same state.

Every figure is the best of ``--reps`` rounds; the rounds interleave all contenders so that
background load hits them alike. Prints a markdown table, and the in-memory figures' medians,
and writes JSON (every round's seconds included).

    PYTHONPATH=src python bench/cpu_bench.py --steps 300 --json docs/data/cpu_bench_2core.json

``--state PATH`` benches a given state instead (float32 and bfloat16 tensors saved with
torch.save, such as the GPU benchmark's 1.2 GB GPT state as CPU tensors): ckptzip in memory
against ZipNN on the same bytes as one blob per dtype.
"""
import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import ckptzip
from ckptzip.demo import TinyLM, _text


def train(steps: int):
    torch.manual_seed(0)
    text = _text()
    model = TinyLM(d=256, layers=4, ctx=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.zeros(())
    for _ in range(steps):
        ix = torch.randint(0, text.numel() - 65, (16,))
        seq = torch.stack([text[i:i + 65] for i in ix.tolist()]).long()
        loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 256), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, loss.item()


def tensors_of(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


def to_bf16(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.bfloat16) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: to_bf16(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_bf16(v) for v in obj)
    return obj


def fsync_save(state, path):
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def same(a, b) -> bool:
    ta, tb = list(tensors_of(a)), list(tensors_of(b))
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb))


def _blob(ts) -> bytes:
    """The tensors' bytes concatenated: the one blob ZipNN gets."""
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in ts)


def bench_state(name, state, dtype, reps, workdir, threads):
    ts = list(tensors_of(state))
    raw = sum(t.numel() * t.element_size() for t in ts)
    blob = _blob(ts)
    pt, ckz = os.path.join(workdir, f"{name}.pt"), os.path.join(workdir, f"{name}.ckz")
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    blob_t = torch.frombuffer(bytearray(blob[:len(blob) // tdt.itemsize * tdt.itemsize]), dtype=tdt)
    zn = None
    try:
        import zipnn
        zn = zipnn.ZipNN(bytearray_dtype=dtype, threads=threads)
    except ImportError:
        pass
    mem = {}
    runs = {
        "torch.save+fsync": lambda: fsync_save(state, pt),
        "torch.load": lambda: torch.load(pt, weights_only=True),
        "ckptzip.save (fsync)": lambda: ckptzip.save(state, ckz, fsync=True),
        # a training loop's repeated saves of one layout (the manager's default)
        "ckptzip.save (fsync, reuse_plan)": lambda: ckptzip.save(state, ckz, fsync=True, reuse_plan=True),
        "ckptzip.load": lambda: ckptzip.load(ckz),
        "ckptzip compress (memory)": lambda: mem.__setitem__("ckz", _save_mem(state)),
        "ckptzip decompress (memory)": lambda: ckptzip.load(io.BytesIO(mem["ckz"])),
        # the same one blob ZipNN gets (one tensor of the state's dtype): the codec path without
        # per-tensor work (one storage, one manifest entry, one output allocation)
        "ckptzip blob compress": lambda: mem.__setitem__("ckzb", _save_mem({"blob": blob_t})),
        "ckptzip blob decompress": lambda: ckptzip.load(io.BytesIO(mem["ckzb"])),
    }
    if zn is not None:
        # ZipNN 0.5.4's compress rewrites its input buffer in place (even a bytes object): it
        # gets a fresh copy every round, made outside the timed region
        runs["zipnn compress"] = lambda: mem.__setitem__("zn", zn.compress(mem.pop("zn_in")))
        runs["zipnn decompress"] = lambda: zn.decompress(mem["zn"])
        # end to end, as a user checkpoints a state dict with ZipNN: torch.save's bytes through
        # ZipNN, and back through torch.load (in memory; no file, no fsync)
        # (ZipNN 0.5.4 crashed, double free, on a buffer whose length is not a multiple of the
        # dtype's: the pickle's bytes are zero-padded, and cut back after decompression)
        runs["zipnn+torch.save"] = lambda: mem.__setitem__("znpt", zn.compress(_padded(_pt_bytes(state), 4)))
        runs["zipnn+torch.load"] = lambda: torch.load(io.BytesIO(_unpad(zn.decompress(mem["znpt"]))), weights_only=True)
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        for k, fn in runs.items():
            if k == "zipnn compress":
                mem["zn_in"] = bytearray(blob)
            t = time.perf_counter()
            fn()
            times.setdefault(k, []).append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    assert same(ckptzip.load(ckz), state) and same(ckptzip.load(io.BytesIO(mem["ckz"])), state)
    assert same(ckptzip.load(io.BytesIO(mem["ckzb"]))["blob"], blob_t)
    res = {"raw_bytes": raw, "seconds": best, "median_seconds": med, "all_seconds": times,
           "MBps": {k: raw / v / 1e6 for k, v in best.items()},
           "MBps_median": {k: raw / v / 1e6 for k, v in med.items()},
           "bytes": {"torch.save": os.path.getsize(pt), "ckptzip": os.path.getsize(ckz),
                     "ckptzip (memory)": len(mem["ckz"]), "ckptzip (one blob)": len(mem["ckzb"])}}
    res["ratio"] = {"ckptzip": os.path.getsize(ckz) / raw, "torch.save": os.path.getsize(pt) / raw}
    if zn is not None:
        assert bytes(zn.decompress(mem["zn"])) == blob
        res["bytes"]["zipnn"] = len(mem["zn"])
        res["ratio"]["zipnn"] = len(mem["zn"]) / raw
        assert same(torch.load(io.BytesIO(_unpad(zn.decompress(mem["znpt"]))), weights_only=True), state)
        res["bytes"]["zipnn+torch.save"] = len(mem["znpt"])
        res["ratio"]["zipnn+torch.save"] = len(mem["znpt"]) / raw
    return res


def bench_file_state(state, reps, threads):
    """``--state``: a large state of several dtypes, in memory: ckptzip on the state against
    ZipNN on the same bytes as one blob per dtype (ZipNN takes one dtype per call), rounds
    interleaved; ZipNN's input copies are made outside the timed region."""
    import zipnn
    ts = list(tensors_of(state))
    raw = sum(t.numel() * t.element_size() for t in ts)
    blobs = {}
    for t in ts:
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(t.dtype)
        if name is None:
            raise SystemExit(f"error: --state holds {t.dtype} tensors; ZipNN takes float32 and bfloat16")
        blobs.setdefault(name, []).append(t)
    blobs = {k: _blob(v) for k, v in blobs.items()}
    zns = {k: zipnn.ZipNN(bytearray_dtype=k, threads=threads) for k in blobs}
    mem: dict = {}

    def zn_compress() -> float:
        ins = {k: bytearray(b) for k, b in blobs.items()}
        t = time.perf_counter()
        mem["zn"] = {k: zns[k].compress(ins[k]) for k in blobs}
        return time.perf_counter() - t

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in ("ckptzip compress", "ckptzip decompress", "zipnn compress",
                                                     "zipnn decompress")}
    for _ in range(reps):
        times["ckptzip compress"].append(timed(lambda: mem.__setitem__("ckz", _save_mem(state))))
        times["zipnn compress"].append(zn_compress())
        times["zipnn decompress"].append(timed(lambda: [zns[k].decompress(v) for k, v in mem["zn"].items()]))
        times["ckptzip decompress"].append(timed(lambda: ckptzip.load(io.BytesIO(mem["ckz"]))))
    assert same(ckptzip.load(io.BytesIO(mem["ckz"])), state)
    assert all(bytes(zns[k].decompress(v)) == blobs[k] for k, v in mem["zn"].items())
    zb = sum(len(v) for v in mem["zn"].values())
    return {"raw_bytes": raw, "tensors": len(ts), "all_seconds": times,
            "MBps": {k: raw / min(v) / 1e6 for k, v in times.items()},
            "MBps_median": {k: raw / statistics.median(v) / 1e6 for k, v in times.items()},
            "ratio": {"ckptzip": len(mem["ckz"]) / raw, "zipnn": zb / raw}}


def _pt_bytes(state) -> bytes:
    b = io.BytesIO()
    torch.save(state, b)
    return b.getvalue()


def _padded(b: bytes, width: int) -> bytearray:
    """``b`` zero-padded to a multiple of ``width`` bytes, its length in the last 8 bytes."""
    n = len(b)
    return bytearray(b + bytes((-(n + 8)) % width) + n.to_bytes(8, "little"))


def _unpad(b) -> bytes:
    b = bytes(b)
    return b[:int.from_bytes(b[-8:], "little")]


def _save_mem(state) -> bytes:
    b = io.BytesIO()
    ckptzip.save(state, b)
    return b.getvalue()


def table(results) -> str:
    rows = ["| state | tool | ratio (stored / raw) | compress / save MB/s | decompress / load MB/s |",
            "|---|---|---|---|---|"]
    for name, r in results.items():
        m, q = r["MBps"], r["ratio"]
        rows.append(f"| {name} | ckptzip in memory | {r['bytes']['ckptzip (memory)'] / r['raw_bytes']:.4f} | "
                    f"{m['ckptzip compress (memory)']:,.0f} | {m['ckptzip decompress (memory)']:,.0f} |")
        rows.append(f"| {name} | ckptzip on one blob, in memory | {r['bytes']['ckptzip (one blob)'] / r['raw_bytes']:.4f} | "
                    f"{m['ckptzip blob compress']:,.0f} | {m['ckptzip blob decompress']:,.0f} |")
        if "zipnn" in q:
            rows.append(f"| {name} | ZipNN in memory | {q['zipnn']:.4f} | {m['zipnn compress']:,.0f} | "
                        f"{m['zipnn decompress']:,.0f} |")
            rows.append(f"| {name} | ZipNN of torch.save's bytes + torch.load, in memory | "
                        f"{q['zipnn+torch.save']:.4f} | {m['zipnn+torch.save']:,.0f} | {m['zipnn+torch.load']:,.0f} |")
        rows.append(f"| {name} | ckptzip.save (fsync) / load, file | {q['ckptzip']:.4f} | "
                    f"{m['ckptzip.save (fsync)']:,.0f} | {m['ckptzip.load']:,.0f} |")
        rows.append(f"| {name} | ckptzip.save (fsync, reuse_plan=True) / load, file | {q['ckptzip']:.4f} | "
                    f"{m['ckptzip.save (fsync, reuse_plan)']:,.0f} | {m['ckptzip.load']:,.0f} |")
        rows.append(f"| {name} | torch.save + fsync / torch.load, file | {q['torch.save']:.4f} | "
                    f"{m['torch.save+fsync']:,.0f} | {m['torch.load']:,.0f} |")
    return "\n".join(rows)


def median_table(results) -> str:
    """The in-memory figures' medians over the rounds (the best-of table above can be decided by
    one lucky round: ZipNN's decompress is twice as fast in rounds where its output lands in
    memory that earlier rounds freed)."""
    rows = ["| state | tool | compress MB/s (median) | decompress MB/s (median) |", "|---|---|---|---|"]
    for name, r in results.items():
        m = r["MBps_median"]
        for tool, c, d in (("ckptzip in memory", "ckptzip compress (memory)", "ckptzip decompress (memory)"),
                           ("ckptzip on one blob", "ckptzip blob compress", "ckptzip blob decompress"),
                           ("ZipNN in memory", "zipnn compress", "zipnn decompress")):
            if c in m:
                rows.append(f"| {name} | {tool} | {m[c]:,.0f} | {m[d]:,.0f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir on the cwd's disk)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--cache", default=None, help="trained state saved here (torch.save) and reused by later "
                    "runs with the same --steps: training takes minutes on 2 busy cores and is deterministic")
    ap.add_argument("--state", default=None, help="instead: a state of float32 and bfloat16 tensors saved with "
                    "torch.save (e.g. the GPU benchmark's GPT state), ckptzip in memory against ZipNN's "
                    "per-dtype blobs (needs zipnn)")
    a = ap.parse_args()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if a.state:
        state = torch.load(a.state, map_location="cpu", weights_only=True)
        r = bench_file_state(state, a.reps, threads)
        print(f"{r['tensors']} tensors, {r['raw_bytes'] / 1e6:,.0f} MB raw, {threads} threads")
        print("| tool | stored / raw | compress MB/s best (median) | decompress MB/s best (median) |")
        print("|---|---|---|---|")
        for tool in ("ckptzip", "zipnn"):
            c, d = f"{tool} compress", f"{tool} decompress"
            print(f"| {tool} | {r['ratio'][tool]:.4f} | {r['MBps'][c]:,.0f} ({r['MBps_median'][c]:,.0f}) | "
                  f"{r['MBps'][d]:,.0f} ({r['MBps_median'][d]:,.0f}) |")
        r["command"] = "PYTHONPATH=src python bench/cpu_bench.py " + " ".join(
            f"--{k} {v}" for k, v in vars(a).items() if v is not None)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=1)
        return
    t0 = time.time()
    cached = None
    if a.cache and os.path.exists(a.cache):
        cached = torch.load(a.cache, weights_only=True)
        if cached.get("steps") != a.steps:
            cached = None
    if cached is not None:
        state, loss, params = cached["state"], cached["loss"], cached["params"]
    else:
        model, opt, loss = train(a.steps)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": a.steps}
        params = sum(p.numel() for p in model.parameters())
        if a.cache:
            torch.save({"steps": a.steps, "loss": loss, "params": params, "state": state}, a.cache)
    train_s = time.time() - t0
    try:
        import zipnn
        zver = getattr(zipnn, "__version__", "installed")
    except ImportError:
        zver = None
    res = {"params": params, "steps": a.steps, "final_loss": loss,
           "train_s": train_s, "cpu_cores": threads, "cpu": platform.processor() or platform.machine(),
           "trained_here": cached is None, "torch": torch.__version__, "ckptzip": ckptzip.__version__, "zipnn": zver,
           "command": "PYTHONPATH=src python bench/cpu_bench.py " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if v is not None),
           "states": {}}
    with tempfile.TemporaryDirectory(dir=a.dir or os.getcwd(), prefix=".cpu_bench.") as d:
        res["states"]["fp32 model + AdamW"] = bench_state("fp32", state, "float32", a.reps, d, threads)
        res["states"]["bf16 model + AdamW"] = bench_state("bf16", to_bf16(state), "bfloat16", a.reps, d, threads)
    md = table(res["states"])
    res["table"] = md
    res["median_table"] = median_table(res["states"])
    print(md)
    print()
    print(res["median_table"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    else:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
