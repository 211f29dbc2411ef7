"""The ``ckptzip`` command line."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from . import api
from .cost import CostInputs, monthly_cost
from .errors import CkptzipError

console = Console()
err = Console(stderr=True)


@contextlib.contextmanager
def progress_bar(label: str, quiet: bool = False) -> Iterator:
    """Yields a ``progress(done, total)`` callback drawing a rich bar on stderr."""
    if quiet:
        yield None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True) as p:
        task = p.add_task(label, total=None)

        def cb(done: int, total: int) -> None:
            p.update(task, advance=done, total=total)
        yield cb


def _codec_arg(s: str):
    return json.loads(s) if s.startswith("{") else s


def cmd_compress(a) -> int:
    import torch
    with err.status(f"reading {a.input} (torch.load, weights_only=True)"):
        obj = torch.load(a.input, map_location="cpu", weights_only=True)
    with progress_bar("compressing", a.quiet) as cb:
        r = api.save(obj, a.output, codec=_codec_arg(a.codec), chunk_size=a.chunk_size,
                     level=a.level, progress=cb, portable=a.portable)
    _summary(a.input, r)
    return 0


def _summary(src: str, r: dict) -> None:
    size_in = os.path.getsize(src)
    console.print(f"{src} ({size_in:,} B) -> {r['path']} ({r['stored_bytes']:,} B), "
                  f"ratio {r['stored_bytes'] / max(1, size_in):.3f} of the input, "
                  f"{r['stored_bytes'] / max(1, r['raw_bytes']):.3f} of the tensor bytes")


def cmd_decompress(a) -> int:
    import torch
    with progress_bar("decompressing", a.quiet) as cb:
        obj = api.load(a.input, map_location="cpu", allow_pickle=a.allow_pickle, progress=cb)
    from .storage import atomic_write
    with atomic_write(a.output) as f:
        torch.save(obj, f)
    console.print(f"{a.input} -> {a.output} ({os.path.getsize(a.output):,} B)")
    return 0


def cmd_convert(a) -> int:
    with progress_bar("decoding", a.quiet) as cb:
        obj = api.load(a.input, map_location=None, allow_pickle=True, progress=cb)
    with api.open(a.input) as r:
        meta = r.metadata
    with progress_bar("encoding", a.quiet) as cb:
        res = api.save(obj, a.output, codec=_codec_arg(a.codec), metadata=meta, allow_pickle=True,
                       progress=cb, portable=a.codec in ("zstd", "deflate", "raw"))
    _summary(a.input, res)
    return 0


def info_rows(path: str) -> tuple[dict, list[dict]]:
    with api.open(path) as r:
        rows = []
        for key, node in r._tensor_nodes().items():
            s = r.storages[r._storage_index(node)]
            idx = r._storage_index(node)
            codec = s["codec"]["id"] + (f":{s['codec']['data_type']}" if "data_type" in s["codec"] else "")
            tfs = "+".join(t["id"] for t in s.get("transforms", []))
            rows.append({"key": key, "dtype": node.get("dtype"), "shape": node.get("shape"),
                         "storage": idx, "raw_bytes": s["nbytes"], "stored_bytes": r.stored_bytes(idx),
                         "codec": f"{tfs}+{codec}" if tfs else codec,
                         "choice": s.get("choice", "")})
        head = {"path": path, "file_bytes": r.file_size, "version": r.manifest.doc["version"],
                "created_by": r.manifest.doc.get("created_by"), "metadata": r.metadata,
                "raw_bytes": sum(s["nbytes"] for s in r.storages),
                "storages": len(r.storages), "chunks": int(r.manifest.doc["n_chunks"])}
    return head, rows


def cmd_info(a) -> int:
    head, rows = info_rows(a.file)
    if a.json:
        print(json.dumps({**head, "tensors": rows}, indent=1))
        return 0
    t = Table(title=f"{a.file}  (format {head['version'][0]}.{head['version'][1]}, {head['created_by']})")
    for c in ("key", "dtype", "shape", "raw", "stored", "ratio", "codec"):
        t.add_column(c, justify="right" if c in ("raw", "stored", "ratio") else "left")
    seen = set()
    for r in rows:
        shared = r["storage"] in seen
        seen.add(r["storage"])
        t.add_row(r["key"], r["dtype"], "x".join(map(str, r["shape"])) or "()",
                  f"{r['raw_bytes']:,}", "shared" if shared else f"{r['stored_bytes']:,}",
                  "" if shared else f"{r['stored_bytes'] / max(1, r['raw_bytes']):.3f}",
                  r["codec"] + (f" ({r['choice']})" if r["choice"] else ""))
    console.print(t)
    console.print(f"tensor bytes {head['raw_bytes']:,} -> file {head['file_bytes']:,} "
                  f"(ratio {head['file_bytes'] / max(1, head['raw_bytes']):.3f}), "
                  f"{head['storages']} storages, {head['chunks']} chunks")
    return 0


def cmd_verify(a) -> int:
    try:
        with api.open(a.file) as r, progress_bar("verifying", a.quiet) as cb:
            r.progress = cb
            r.verify()
    except CkptzipError as e:
        console.print(f"[red]FAILED[/red] {a.file}: {type(e).__name__}: {e}")
        return 1
    console.print(f"[green]OK[/green] {a.file}: every chunk's checksum and size verified")
    return 0


def cmd_cost(a) -> int:
    c = CostInputs(checkpoint_gb=a.size_gb, write_gbps=a.write_gbps, interval_min=a.every_min,
                   gpus=a.gpus, gpu_hour_usd=a.gpu_hour, retained=a.retained,
                   storage_gb_month_usd=a.storage_gb_month)
    ratio = a.ratio
    if a.from_file:
        head, _ = info_rows(a.from_file)
        ratio = head["file_bytes"] / max(1, head["raw_bytes"])
    before, after = monthly_cost(c, 1.0), monthly_cost(c, ratio)
    t = Table(title=f"checkpoint cost per month ({c.gpus} GPUs at ${c.gpu_hour_usd}/h, every "
                    f"{c.interval_min:g} min, {c.write_gbps:g} GB/s, {c.retained} kept)")
    for col in ("", "uncompressed", f"ckptzip (ratio {ratio:.3f})", "saved"):
        t.add_column(col, justify="right")
    for k, label in (("checkpoint_gb", "checkpoint GB"), ("write_s", "write stall s"),
                     ("idle_gpu_usd", "idle GPU $"), ("storage_usd", "storage $"), ("total_usd", "total $")):
        t.add_row(label, f"{before[k]:,.1f}", f"{after[k]:,.1f}", f"{before[k] - after[k]:,.1f}")
    console.print(t)
    if a.json:
        print(json.dumps({"ratio": ratio, "before": before, "after": after}))
    return 0


def cmd_ls(a) -> int:
    from .manager import CheckpointManager
    m = CheckpointManager(a.directory, keep_last=None, create=False)
    steps = m.steps()
    if a.json:
        print(json.dumps({"directory": a.directory, "steps": steps, "latest": m.latest()}))
        return 0
    t = Table(title=f"committed checkpoints in {a.directory}")
    for c in ("step", "file", "bytes"):
        t.add_column(c, justify="right" if c != "file" else "left")
    for s in steps:
        p = m.path(s)
        t.add_row(str(s), os.path.basename(p), f"{m.fs.size(m._join(os.path.basename(p))):,}")
    console.print(t)
    if not steps:
        console.print("no committed checkpoint")
    return 0


def cmd_demo(a) -> int:
    from .demo import run_demo
    run_demo(seconds=a.seconds, device=a.device, out_dir=a.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptzip", description="Lossless compression of PyTorch checkpoints")
    p.add_argument("--version", action="version", version=f"ckptzip {api.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def q(sp):
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        return sp

    c = q(sub.add_parser("compress", help="torch.save file -> .ckz"))
    c.add_argument("input")
    c.add_argument("output")
    c.add_argument("--codec", default="auto", help="auto, zstd, deflate, raw, ans, ... or a JSON config")
    c.add_argument("--chunk-size", type=int, default=1 << 20)
    c.add_argument("--level", type=int, default=None, help="zstd/deflate level (CPU)")
    c.add_argument("--portable", action="store_true", help="only codecs any CPU can decode")
    c.set_defaults(fn=cmd_compress)
    d = q(sub.add_parser("decompress", help=".ckz -> torch.save file"))
    d.add_argument("input")
    d.add_argument("output")
    d.add_argument("--allow-pickle", action="store_true")
    d.set_defaults(fn=cmd_decompress)
    v = q(sub.add_parser("convert", help="re-encode a .ckz with another codec (e.g. GPU-only -> zstd)"))
    v.add_argument("input")
    v.add_argument("output")
    v.add_argument("--codec", default="zstd")
    v.set_defaults(fn=cmd_convert)
    i = sub.add_parser("info", help="table of tensors, sizes, ratios and codecs")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)
    f = q(sub.add_parser("verify", help="check every checksum; exit 1 on failure"))
    f.add_argument("file")
    f.set_defaults(fn=cmd_verify)
    k = sub.add_parser("cost", help="monthly idle-GPU and storage dollars, before and after compression")
    k.add_argument("--size-gb", type=float, default=782.0)
    k.add_argument("--write-gbps", type=float, default=5.0)
    k.add_argument("--every-min", type=float, default=30.0)
    k.add_argument("--gpus", type=int, default=8)
    k.add_argument("--gpu-hour", type=float, default=4.40)
    k.add_argument("--retained", type=int, default=10)
    k.add_argument("--storage-gb-month", type=float, default=0.023)
    k.add_argument("--ratio", type=float, default=0.75, help="stored/raw ratio to assume")
    k.add_argument("--from", dest="from_file", help="take the ratio measured on this .ckz file")
    k.add_argument("--json", action="store_true")
    k.set_defaults(fn=cmd_cost)
    ls = sub.add_parser("ls", help="committed checkpoints of a CheckpointManager directory")
    ls.add_argument("directory")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_ls)
    m = sub.add_parser("demo", help="train a tiny model, save with torch.save and ckptzip, compare")
    m.add_argument("--seconds", type=float, default=8.0)
    m.add_argument("--device", default=None)
    m.add_argument("--out", default=None, help="directory for the files (default: a temp dir)")
    m.set_defaults(fn=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except CkptzipError as e:
        err.print(f"[red]error[/red]: {type(e).__name__}: {e}")
        return 2
    except FileNotFoundError as e:
        err.print(f"[red]error[/red]: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
