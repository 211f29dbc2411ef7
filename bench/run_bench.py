"""The GPU benchmark (issue: GPU engine). Trains a GPT-2-small-class model for real, then on that
one state dict measures side by side, in one run: torch.save/torch.load, DCP (+ its zstd
extension), ZipNN (all CPU cores), the nvCOMP blog recipe (ANS and Zstd on each tensor's raw
bytes, default settings) and ckptzip (auto, ans, zstd = portable). Writes bench.json, bench.png
and prints markdown tables.

    PYTHONPATH=src python bench/run_bench.py --steps 1000 --out DIR
"""
import argparse
import json
import os
import platform
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip  # noqa: E402
from gpt import checkpoint, components, train  # noqa: E402
from gpu_throughput import measure  # noqa: E402


def sync():
    torch.cuda.synchronize()


def drop_cache(path):
    """Evict a file (or every file of a directory) from the page cache, so loads read the disk."""
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def plane_bound(t: torch.Tensor) -> float:
    """Order-0 entropy bound of the byte planes (after the sign rotation) as a ratio."""
    from ckptzip.transforms import BytePlane
    w = t.element_size()
    raw = t.reshape(-1).view(torch.uint8)
    bp = BytePlane(w, 1 << 20)
    planes = bp.encode(raw)
    n = raw.numel() // w
    bits = 0.0
    full = n // bp.block * bp.block
    pv = planes[: full * w].view(-1, w, bp.block)
    for k in range(w):
        parts = [pv[:, k].reshape(-1)]
        if n > full:
            parts.append(planes[full * w:].view(w, n - full)[k])
        h = torch.bincount(torch.cat(parts).long(), minlength=256).double()
        p = h[h > 0] / h.sum()
        bits += float(-(p * p.log2()).sum())
    return bits / (8 * w)


def blog_recipe(ts, algorithm):
    """NVIDIA blog recipe: nvcomp.Codec(algorithm=...) on each tensor's raw bytes, defaults."""
    from nvidia import nvcomp as nv
    codec = nv.Codec(algorithm=algorithm)
    arrs = [nv.as_array(t.reshape(-1).view(torch.uint8)) for t in ts]
    sync()
    t0 = time.perf_counter()
    enc = [codec.encode(a) for a in arrs]
    sizes = [e.buffer_size for e in enc]
    sync()
    te = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec = [codec.decode(e) for e in enc]
    _ = [d.buffer_size for d in dec]
    sync()
    td = time.perf_counter() - t0
    raw = sum(t.numel() * t.element_size() for t in ts)
    for d, t in zip(dec[:3], ts[:3]):
        assert torch.equal(torch.as_tensor(d, device="cuda").view(torch.uint8).reshape(-1),
                           t.reshape(-1).view(torch.uint8))
    return {"ratio": sum(sizes) / raw, "compress_GBps": raw / te / 1e9, "decompress_GBps": raw / td / 1e9}


def zipnn_mod():
    try:
        from zipnn import ZipNN
        return ZipNN
    except Exception as e:  # noqa: BLE001
        return str(e)


def zipnn_component(ts, dtype_name):
    ZipNN = zipnn_mod()
    if isinstance(ZipNN, str):
        return {"error": ZipNN}
    z = ZipNN(input_format="byte", bytearray_dtype=dtype_name, threads=os.cpu_count())
    blobs = [t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() for t in ts]
    raw = sum(len(b) for b in blobs)
    t0 = time.perf_counter()
    comp = [z.compress(bytearray(b)) for b in blobs]  # a copy: ZipNN rewrites its input in place
    te = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec = [z.decompress(c) for c in comp]
    td = time.perf_counter() - t0
    assert bytes(dec[0]) == blobs[0]
    return {"ratio": sum(len(c) for c in comp) / raw, "compress_GBps": raw / te / 1e9, "decompress_GBps": raw / td / 1e9}


def flat(state):
    out = {}

    def rec(o, p):
        if isinstance(o, torch.Tensor):
            out[p] = o
        elif isinstance(o, dict):
            for k, v in o.items():
                rec(v, f"{p}.{k}" if p else str(k))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                rec(v, f"{p}.{i}")
    rec(state, "")
    return out


def timed(fn):
    sync()
    t0 = time.perf_counter()
    r = fn()
    sync()
    return r, time.perf_counter() - t0


def e2e(state, d, reps=3):
    """End-to-end save (fsync'd) and load (page cache dropped) seconds on local disk. Every method
    saves and loads ``reps`` times in a row: the first (cold: first call of the process for that
    method) is reported on its own, the figure is the median of the others (a training job saves
    many times per process). Peak extra GPU memory: above the state during save, above the
    state and the loaded copy during load."""
    import statistics
    res = {}
    tensors = flat(state)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())

    def torch_save(p):
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def run(name, save, load, path):
        try:
            saves, loads, peaks_s, peaks_l = [], [], [], []
            back = None
            for _ in range(reps):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                _, ts = timed(lambda: save(path))
                peaks_s.append((torch.cuda.max_memory_allocated() - base) / 2**20)
                drop_cache(path)
                back = None  # the previous load's copy is not part of this load's peak
                sync()
                torch.cuda.reset_peak_memory_stats()
                back, tl = timed(lambda: load(path))
                peaks_l.append((torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()) / 2**20)
                saves.append(ts)
                loads.append(tl)
            warm_s, warm_l = saves[1:] or saves, loads[1:] or loads
            res[name] = {"bytes": du(path), "ratio": du(path) / raw, "save_s": statistics.median(warm_s),
                         "load_s": statistics.median(warm_l), "save_first_s": saves[0], "load_first_s": loads[0],
                         "save_all_s": saves, "load_all_s": loads, "peak_extra_gpu_MiB_save": max(peaks_s),
                         "peak_extra_gpu_MiB_load": max(peaks_l)}
            if isinstance(back, dict) and "_check" not in name:
                fb = flat(back)
                bad = [k for k, v in tensors.items() if k in fb and not torch.equal(
                    fb[k].reshape(-1).view(torch.uint8).to(v.device), v.reshape(-1).view(torch.uint8))]
                res[name]["bit_exact"] = not bad and len(fb) >= len(tensors)
            del back
            print(name, res[name], flush=True)
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, res[name], flush=True)

    run("torch.save", torch_save, lambda p: torch.load(p, map_location="cuda", weights_only=True), f"{d}/t.pt")
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint._extension import ZStandard

        def dcp_load(p):
            tmpl = {k: torch.empty_like(v) for k, v in tensors.items()}
            dcp.load(tmpl, storage_reader=FileSystemReader(p))
            return tmpl
        run("DCP", lambda p: dcp.save(tensors, storage_writer=FileSystemWriter(p)), dcp_load, f"{d}/dcp")
        run("DCP+zstd", lambda p: dcp.save(tensors, storage_writer=FileSystemWriter(p, _extensions=[ZStandard()])),
            dcp_load, f"{d}/dcpz")
    except Exception as e:  # noqa: BLE001
        res["DCP+zstd"] = {"error": str(e)}
    for name, kw in (("ckptzip auto", {}), ("ckptzip zstd (portable)", {"portable": True})):
        run(name, lambda p, kw=kw: ckptzip.save(state, p, **kw), lambda p: ckptzip.load(p, map_location="cuda"),
            f"{d}/c{len(res)}.ckz")
    return res


def exponent_locality(v_tensors):
    """Why Adam v compresses below its global order-0 bound: entropy of v's exponent plane
    globally, per 64 KiB chunk, per row, and after a row-to-row delta."""
    out = {}
    tot = {"global": 0.0, "chunk64k": 0.0, "rowdelta_global": 0.0, "n": 0}

    def H(x):
        h = torch.bincount(x.long(), minlength=256).double()
        p = h[h > 0] / h.sum()
        return float(-(p * p.log2()).sum())
    allexp, alldelta = [], []
    for t in v_tensors:
        if t.dim() != 2 or t.numel() < 65536:
            continue
        e = (((t.view(torch.int32) << 1) >> 24) & 0xFF).to(torch.uint8)  # rotated top byte
        allexp.append(e.reshape(-1))
        d = (e[1:].int() - e[:-1].int()) & 0xFF
        alldelta.append(torch.cat([e[0].int(), d.reshape(-1)]).to(torch.uint8))
        c = e.reshape(-1)[: e.numel() // 65536 * 65536].view(-1, 65536)
        tot["chunk64k"] += sum(H(r) for r in c) * 65536
        tot["n"] += c.numel()
    ea, da = torch.cat(allexp), torch.cat(alldelta)
    out["exp_plane_bits_global"] = H(ea)
    out["exp_plane_bits_per_64KiB_chunk"] = tot["chunk64k"] / max(1, tot["n"])
    out["exp_plane_bits_after_row_delta"] = H(da)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--disk", default="/tmp/ckbench")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.disk, exist_ok=True)
    from nvidia import nvcomp
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "nvcomp": nvcomp.__version__,
            "python": platform.python_version(), "cpu_cores": os.cpu_count(), "steps": a.steps,
            "ckptzip": ckptzip.__version__}
    print(info, flush=True)
    model, opt, losses = train(a.steps)
    state = checkpoint(model, opt)
    del model, opt
    info["params_M"] = sum(t.numel() for t in state["model"].values()) / 1e6
    info["final_loss"] = [x for x in losses if x == x][-1]
    comps = components(state)
    per = {}
    for cname, ts in comps.items():
        cat = torch.cat([t.reshape(-1) for t in ts])
        r = {"bytes": cat.numel() * cat.element_size(), "bound": plane_bound(cat)}
        r["ckptzip auto"] = measure(cat, "auto")
        r["ckptzip ans"] = measure(cat, "ans")
        r["ckptzip zstd (portable)"] = measure(cat, "zstd", reps=1)
        # ratios of the real per-tensor plans (each tensor is its own storage in a checkpoint)
        for variant, kw in (("ckptzip auto", {}), ("ckptzip zstd (portable)", {"portable": True})):
            p = f"{a.disk}/comp.ckz"
            ckptzip.save(ts, p, fsync=False, **kw)
            r[variant]["ratio_per_tensor_file"] = os.path.getsize(p) / r["bytes"]
        r["blog ANS"] = blog_recipe(ts, "ANS")
        r["blog Zstd"] = blog_recipe(ts, "Zstd")
        r["ZipNN"] = zipnn_component(ts, "bfloat16" if cat.dtype == torch.bfloat16 else "float32")
        per[cname] = r
        print(cname, json.dumps(r, default=str), flush=True)
        del cat
    locality = exponent_locality(comps["adam v"])
    print("adam v exponent locality", locality, flush=True)
    with open(os.path.join(a.out, "bench_partial.json"), "w") as f:  # in case the e2e part is cut off
        json.dump({"info": info, "components": per, "adam_v_exponent": locality}, f, indent=1, default=str)
    whole = e2e(state, a.disk)
    res = {"info": info, "components": per, "end_to_end": whole, "adam_v_exponent": locality}
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    report(res, a.out)


def report(res, out):
    comps = res["components"]
    methods = ["ckptzip auto", "ckptzip ans", "ckptzip zstd (portable)", "blog ANS", "blog Zstd", "ZipNN"]
    lines = ["| component | bytes | bound | " + " | ".join(methods) + " |",
             "|---|---|---|" + "---|" * len(methods)]
    for c, r in comps.items():
        cells = []
        for m in methods:
            x = r.get(m, {})
            ratio = x.get("ratio_per_tensor_file", x.get("ratio"))
            cells.append("n/a" if ratio is None else f"{ratio:.4f}")
        lines.append(f"| {c} | {r['bytes'] / 1e6:.0f} MB | {r['bound']:.4f} | " + " | ".join(cells) + " |")
    lines += ["", "| component | " + " | ".join(f"{m} GB/s (c/d)" for m in methods) + " |",
              "|---|" + "---|" * len(methods)]
    for c, r in comps.items():
        cells = []
        for m in methods:
            x = r.get(m, {})
            cells.append(f"{x['compress_GBps']:.1f} / {x['decompress_GBps']:.1f}" if "compress_GBps" in x else "n/a")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "| end to end | bytes | ratio | save s (median of later) | load s | first save s | first load s "
              "| bit-exact | peak extra GPU MiB save / load |", "|---|---|---|---|---|---|---|---|---|"]
    for m, x in res["end_to_end"].items():
        if "error" in x:
            lines.append(f"| {m} | error: {x['error'][:80]} | | | | | | | |")
            continue
        lines.append(f"| {m} | {x['bytes']:,} | {x['ratio']:.4f} | {x['save_s']:.2f} | {x['load_s']:.2f} | "
                     f"{x.get('save_first_s', 0):.2f} | {x.get('load_first_s', 0):.2f} | {x.get('bit_exact', '')} | "
                     f"{x.get('peak_extra_gpu_MiB_save', 0):.0f} / {x.get('peak_extra_gpu_MiB_load', 0):.0f} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        names = list(comps)
        width = 0.12
        for i, m in enumerate(methods + ["bound"]):
            vals = [(comps[c]["bound"] if m == "bound" else comps[c].get(m, {}).get(
                "ratio_per_tensor_file", comps[c].get(m, {}).get("ratio", float("nan")))) for c in names]
            axes[0].bar([j + i * width for j in range(len(names))], vals, width, label=m)
        axes[0].set_xticks([j + 3 * width for j in range(len(names))], names)
        axes[0].set_ylim(0.5, 1.05)
        axes[0].set_ylabel("stored / raw (lower is better)")
        axes[0].legend(fontsize=7)
        e = {k: v for k, v in res["end_to_end"].items() if "error" not in v}
        ks = list(e)
        axes[1].bar([j - 0.2 for j in range(len(ks))], [e[k]["save_s"] for k in ks], 0.4, label="save s")
        axes[1].bar([j + 0.2 for j in range(len(ks))], [e[k]["load_s"] for k in ks], 0.4, label="load s")
        axes[1].set_xticks(range(len(ks)), ks, rotation=20, fontsize=7)
        axes[1].set_ylabel("seconds, local disk (lower is better)")
        axes[1].legend()
        fig.suptitle(f"{res['info']['device']}, {res['info']['params_M']:.0f} M params, {res['info']['steps']} steps")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "bench.png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        print("no chart:", e)


if __name__ == "__main__":
    main()
