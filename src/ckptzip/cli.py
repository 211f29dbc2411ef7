"""The ``ckptzip`` command line.

Conventions (the same for every command):

* Errors are one line on stderr, ``error: ...``; exit status 2 for usage errors (bad options,
  input == output), 1 for failures (missing or unreadable files, corrupt or hostile checkpoints,
  no GPU), 128 + the signal number when interrupted (SIGINT, SIGTERM; a file being written is
  removed). Unexpected internal errors print one line too; ``CKPTZIP_DEBUG=1`` adds tracebacks.
* Pickle never runs unless ``--allow-pickle`` is given (``compress``, ``decompress``, ``convert``).
* Every string that comes from a file (tensor names, metadata, messages quoting them) is printed
  as data: never interpreted as rich markup, with control characters escaped (:func:`clean`).
* Progress bars and spinners go to stderr, only when stderr is a terminal and ``--quiet`` is not
  given; stdout carries results only (``--json`` output is JSON and nothing else).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table
from rich.text import Text

from . import __version__
from .codecs.base import MAX_CHUNK
from .cost import CostInputs, monthly_cost
from .engine import DEFAULT_CHUNK
from .storage import is_url
from .errors import (CkptzipError, CorruptFileError, NotCkptzipFileError, PickleNotAllowedError, ResourceLimitError,
                     UnsupportedObjectError)


class CorruptDCPError(CorruptFileError):
    """A DCP checkpoint's rank file lacks an item its metadata names."""

# Piped output (| grep, | cat) is not cut to 80 columns: tables keep whole names there.
console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)
err = Console(stderr=True, highlight=False)

DEBUG_ENV = "CKPTZIP_DEBUG"
MIN_CHUNK = 64            # api.save's smallest chunk_size
#: --level ranges per codec (zstd's negative levels are its fast modes)
LEVELS = {"zstd": (-(1 << 17), 22), "deflate": (0, 9)}


class UsageError(Exception):
    """A bad command line: exit status 2."""


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the SIGTERM/SIGINT handler, so that ``finally`` blocks and the
    atomic writer's cleanup (which removes its temp file) run before the process exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# --------------------------------------------------------------------------------------------
# printing strings from files

def _esc(c: str) -> str:
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def clean(s: Any) -> str:
    """``s`` as one printable line: every non-printable character (ESC and other controls,
    newlines, tabs, bidi overrides, ...) replaced by its ``\\xNN``/``\\uNNNN`` escape. Use for every
    string that comes from a file or from the user before it reaches the terminal."""
    s = str(s)
    return s if s.isprintable() else "".join(c if c.isprintable() else _esc(c) for c in s)


def text(s: Any, style: str | None = None) -> Text:
    """A rich ``Text`` of :func:`clean` (``s``): rich never parses it as markup (``[/x]`` is data)."""
    return Text(clean(s), style=style or "")


def line(*parts: Any) -> Text:
    """One output line from ``str`` parts (data, cleaned) and ``(str, style)`` tuples."""
    return Text.assemble(*[(clean(p[0]), p[1]) if isinstance(p, tuple) else clean(p) for p in parts])


def say(t: Text) -> None:
    """Print one line to stdout, never wrapped (scripts parse it)."""
    console.print(t, soft_wrap=True)


def error_line(msg: str) -> None:
    sys.stderr.write(f"error: {clean(msg)}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# progress

def _show_progress(quiet: bool) -> bool:
    return not quiet and err.is_terminal


@contextlib.contextmanager
def progress_bar(label: str, quiet: bool = False) -> Iterator:
    """Yields a ``progress(done, total)`` callback drawing a bar on stderr, or None when ``quiet``
    or when stderr is not a terminal."""
    if not _show_progress(quiet):
        yield None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True) as p:
        task = p.add_task(label, total=None)

        def cb(done: int, total: int) -> None:
            p.update(task, advance=done, total=total)
        yield cb


@contextlib.contextmanager
def spinner(label: str, quiet: bool = False) -> Iterator[None]:
    if not _show_progress(quiet):
        yield
        return
    with err.status(text(label)):
        yield


# --------------------------------------------------------------------------------------------
# argument types and checks

def _codec_type(s: str) -> str | dict:
    """``--codec``: a wire id or a JSON object with an ``id``."""
    if not s.lstrip().startswith("{"):
        if not s or not s.replace("_", "").replace("-", "").isalnum():
            raise argparse.ArgumentTypeError(f"invalid codec name {s!r}")
        return s
    try:
        cfg = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON codec config: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("id"), str):
        raise argparse.ArgumentTypeError('a JSON codec config is an object with a string "id", '
                                         'e.g. {"id": "zstd"}')
    return cfg


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes_arg(s: str) -> int:
    """Bytes, optionally with a K, M, G or T suffix (KiB, MiB, GiB, TiB)."""
    t = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        n = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {s!r} (bytes, or with a K/M/G/T suffix)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{s} is negative")
    return n


def _size_type(s: str) -> int:
    """``--chunk-size``: bytes, optionally with a K or M suffix (KiB, MiB)."""
    n = _bytes_arg(s)
    if not MIN_CHUNK <= n <= MAX_CHUNK:
        raise argparse.ArgumentTypeError(f"{s} is out of range: {MIN_CHUNK} to {MAX_CHUNK} bytes (16M)")
    return n


def _positive(kind):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {s!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{s} must be a positive number")
        return v
    return parse


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be >= 0")
    return v


def _gpu_usable() -> bool:
    from .engine import gpu_ok
    return gpu_ok()


def _check_device(device: str | None) -> None:
    if device == "cuda" and not _gpu_usable():
        import torch
        why = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else \
            "nvCOMP is not usable (pip install 'ckptzip[cu13]')"
        raise CkptzipError(f"--device cuda: no usable CUDA GPU here ({why})")


def _check_save_options(a) -> None:
    """Validate the encoding options before any file is read (a bad option after reading a large
    checkpoint would waste minutes)."""
    cfg = a.codec if isinstance(a.codec, dict) else {"id": a.codec}
    cid = cfg["id"]
    if a.level is not None:
        lv_codec = "zstd" if cid == "auto" else cid
        if lv_codec not in LEVELS:
            raise UsageError(f"--level applies to zstd and deflate (and auto), not to {cid!r}")
        lo, hi = LEVELS[lv_codec]
        if not lo <= a.level <= hi:
            raise UsageError(f"--level {a.level} is out of range for {lv_codec}: {lo} to {hi}")
    _check_device(a.device)
    if cid != "auto":
        from .codecs import get_codec, registered
        if cid not in registered():
            raise UsageError(f"unknown codec {cid!r}; known: auto, {', '.join(registered())}")
        if a.portable and cid not in ("zstd", "deflate", "raw"):
            raise UsageError(f"--portable allows only zstd, deflate and raw (and auto), not {cid!r}")
        dev = a.device or ("cuda" if _gpu_usable() else "cpu")
        get_codec(cfg, dev)  # unknown options, GPU-only codecs without a GPU: before reading


def _check_io(src: str, dst: str) -> None:
    """Refuse what would fail late or destroy data: a directory as input or output, a missing
    output directory, and an output that is the input (any spelling, links included)."""
    if not is_url(src):
        if os.path.isdir(src):
            raise IsADirectoryError(21, "Is a directory (expected a checkpoint file)", src)
        if not os.path.exists(src):
            raise FileNotFoundError(2, "No such file or directory", src)
    if is_url(dst):
        return
    if os.path.isdir(dst):
        raise IsADirectoryError(21, "Is a directory (give the output file's name)", dst)
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, "Output directory does not exist", parent)
    same = os.path.realpath(src) == os.path.realpath(dst)
    if not same and os.path.exists(dst) and not is_url(src):
        with contextlib.suppress(OSError):
            same = os.path.samefile(src, dst)
    if same:
        raise UsageError(f"output {dst!r} is the input file; write to another path")


# --------------------------------------------------------------------------------------------
# commands

def cmd_compress(a) -> int:
    from . import api
    from .torchfile import load_torch_file, read_safetensors, sniff
    _check_save_options(a)
    _check_io(a.input, a.output)
    meta: dict[str, str] = {}
    with spinner(f"reading {a.input}", a.quiet):
        if not is_url(a.input) and sniff(a.input) == "safetensors":
            obj, meta = read_safetensors(a.input)  # its __metadata__ becomes the .ckz metadata
        else:
            obj = load_torch_file(a.input, allow_pickle=a.allow_pickle)
    with progress_bar("compressing", a.quiet) as cb:
        r = api.save(obj, a.output, codec=a.codec, chunk_size=a.chunk_size, level=a.level,
                     metadata=meta, allow_pickle=a.allow_pickle, progress=cb, portable=a.portable,
                     device=a.device)
    _summary(a.input, r)
    return 0


def _summary(src: str, r: dict, size_in: int | None = None) -> None:
    size_in = os.path.getsize(src) if size_in is None else size_in
    say(line(f"{src} ({size_in:,} B) -> {r['path']} ({r['stored_bytes']:,} B), "
             f"ratio {r['stored_bytes'] / max(1, size_in):.3f} of the input, "
             f"{r['stored_bytes'] / max(1, r['raw_bytes']):.3f} of the tensor bytes"))


def _out_format(a) -> str:
    if a.format != "auto":
        return a.format
    return "safetensors" if a.output.lower().endswith(".safetensors") else "torch"


def cmd_decompress(a) -> int:
    from . import api
    _check_io(a.input, a.output)
    fmt = _out_format(a)
    with progress_bar("decompressing", a.quiet) as cb, \
            api.open(a.input, map_location="cpu", allow_pickle=a.allow_pickle, progress=cb,
                     max_bytes=a.max_bytes) as r:
        obj = r.load()
        meta = r.metadata
    if fmt == "safetensors":
        from .torchfile import write_safetensors
        size = write_safetensors(obj, a.output, metadata=meta)
    else:
        import torch
        from .storage import open_for_write
        with open_for_write(a.output) as f:
            torch.save(obj, f)
        size = os.path.getsize(a.output) if not is_url(a.output) else 0
    say(line(f"{a.input} -> {a.output} ({size:,} B, {fmt})"))
    return 0


def cmd_convert(a) -> int:
    from . import api
    _check_save_options(a)
    _check_io(a.input, a.output)
    with progress_bar("decoding", a.quiet) as cb, \
            api.open(a.input, map_location=None, allow_pickle=a.allow_pickle, progress=cb,
                     max_bytes=a.max_bytes) as r:
        obj = r.load()
        meta = r.metadata
    with progress_bar("encoding", a.quiet) as cb:
        res = api.save(obj, a.output, codec=a.codec, chunk_size=a.chunk_size, level=a.level,
                       metadata=meta, allow_pickle=a.allow_pickle, progress=cb, portable=a.portable,
                       device=a.device)
    _summary(a.input, res)
    return 0


def _check_input(path: str) -> None:
    if not is_url(path) and os.path.isdir(path):
        from .dcp import not_a_checkpoint
        raise not_a_checkpoint(path)  # says what the directory is instead


def _named(e: BaseException) -> str:
    """``Name: message``, once (DCP's errors already start with their name)."""
    text, name = str(e), type(e).__name__
    return text if text.startswith(name + ":") else f"{name}: {text}"


def _is_dcp_dir(path: str) -> bool:
    """A ckptzip DCP checkpoint directory (it holds the JSON metadata or the commit marker)."""
    from .dcp import is_checkpoint_dir
    return is_checkpoint_dir(path)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def dcp_info(path: str) -> dict:
    """The rank files and the per-tensor chunk table of a ckptzip DCP checkpoint directory."""
    from .dcp import read_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = read_metadata(path)
    files: dict[str, int] = {}
    where: dict[tuple, Any] = {}
    for idx, st in md.storage_data.items():
        files[st.file] = st.file_bytes
        where[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = st
    tensors, raw = [], 0
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            item = m.properties.dtype.itemsize
            for c in m.chunks:
                st = where[(fqn, tuple(c.offsets))]
                n = item
                for x in c.sizes:
                    n *= x
                raw += n
                tensors.append({"fqn": fqn, "dtype": str(m.properties.dtype).replace("torch.", ""),
                                "size": list(m.size), "offsets": list(c.offsets), "sizes": list(c.sizes),
                                "raw_bytes": n, "file": st.file, "key": st.key})
        else:
            st = where[(fqn, None)]
            tensors.append({"fqn": fqn, "dtype": "bytes", "size": None, "offsets": None, "sizes": None,
                            "raw_bytes": None, "file": st.file, "key": st.key})
    return {"path": path, "format": "ckptzip-dcp", "files": [{"name": k, "bytes": v} for k, v in sorted(files.items())],
            "file_bytes": sum(files.values()), "tensor_raw_bytes": raw, "items": tensors}


def cmd_info_dcp(a) -> int:
    d = dcp_info(a.file)
    if a.json:
        print(json.dumps(d, indent=1))
        return 0
    t = Table(title=line(f"{a.file}  (ckptzip DCP checkpoint, {_count(len(d['files']), 'rank file')})"))
    for c in ("file", "bytes"):
        t.add_column(c, justify="right" if c == "bytes" else "left")
    for f in d["files"]:
        t.add_row(text(f["name"]), f"{f['bytes']:,}")
    console.print(t)
    t = Table(title=line("items"))
    for c in ("fqn", "dtype", "size", "chunk offsets", "chunk sizes", "raw", "file"):
        t.add_column(c, justify="right" if c == "raw" else "left", overflow="fold" if c == "fqn" else "ellipsis")
    for r in d["items"]:
        t.add_row(text(r["fqn"]), text(r["dtype"]), text(_shape(r["size"]) if r["size"] is not None else ""),
                  text(",".join(map(str, r["offsets"] or []))), text(_shape(r["sizes"]) if r["sizes"] is not None else ""),
                  text("" if r["raw_bytes"] is None else f"{r['raw_bytes']:,}"), text(r["file"]))
    console.print(t)
    say(line(f"tensor bytes {d['tensor_raw_bytes']:,} -> files {d['file_bytes']:,} "
             f"(ratio {d['file_bytes'] / max(1, d['tensor_raw_bytes']):.3f}), {_count(len(d['files']), 'rank file')}, "
             f"{len(d['items'])} items"))
    return 0


def cmd_verify_dcp(a) -> int:
    from . import api
    from .dcp import read_metadata
    try:
        md = read_metadata(a.file)  # commit marker, metadata schema, every rank file's size
        files = sorted({s.file for s in md.storage_data.values()})
        keys: dict[str, set] = {}
        for s in md.storage_data.values():
            keys.setdefault(s.file, set()).add(s.key)
        for name in files:
            p = f"{a.file.rstrip('/')}/{name}" if is_url(a.file) else os.path.join(a.file, name)
            try:
                with api.open(p, max_bytes=a.max_bytes) as r, progress_bar(f"verifying {name}", a.quiet) as cb:
                    missing = keys[name] - set(r.keys())
                    if missing:
                        raise CorruptDCPError(f"{name} lacks item {sorted(missing)[0]!r} named by the metadata")
                    r.progress = cb
                    r.verify()
            except CkptzipError as e:
                say(line(("FAILED", "red"), f" {a.file}: rank file {name}: {_named(e)}"))
                return 1
    except CkptzipError as e:
        say(line(("FAILED", "red"), f" {a.file}: {_named(e)}"))
        return 1
    say(line(("OK", "green"), f" {a.file}: commit marker, metadata and {_count(len(files), 'rank file')} "
             "(every chunk's checksum and size) verified"))
    return 0


def info_rows(path: str, max_bytes: int | None = None) -> tuple[dict, list[dict]]:
    from . import api
    _check_input(path)
    with api.open(path, max_bytes=max_bytes) as r:
        rows = []
        for t in r.tensor_info():
            key, idx = t["key"], t["storage"]
            s = r.storages[idx]
            pack = s["in"][0] if "in" in s else None  # (format 1.5: stored inside storage `pack`)
            p = s if pack is None else r.storages[pack]
            codec = p["codec"]["id"] + (f":{p['codec']['data_type']}" if "data_type" in p["codec"] else "")
            tfs = "+".join(t["id"] for t in p.get("transforms", []))
            rows.append({"key": key, "dtype": t["dtype"], "shape": t["shape"],
                         "storage": idx, "raw_bytes": s["nbytes"], "stored_bytes": r.stored_bytes(idx),
                         "codec": f"{tfs}+{codec}" if tfs else codec,
                         "choice": s.get("choice", "")})
            if pack is not None:
                rows[-1]["packed_in"] = pack
        packs = {s["in"][0] for s in r.storages if "in" in s}
        head = {"path": path, "file_bytes": r.file_size, "version": r.manifest.doc["version"],
                "created_by": r.manifest.doc.get("created_by"), "metadata": r.metadata,
                "raw_bytes": sum(s["nbytes"] for k, s in enumerate(r.storages) if k not in packs),
                "storages": len(r.storages), "chunks": int(r.manifest.doc["n_chunks"]),
                "base": r.base}
    return head, rows


def _shape(shape: Any) -> str:
    if isinstance(shape, list):
        return "x".join(map(str, shape)) or "()"
    return str(shape)


def cmd_info(a) -> int:
    if _is_dcp_dir(a.file):
        return cmd_info_dcp(a)
    head, rows = info_rows(a.file, a.max_bytes)
    if a.json:
        print(json.dumps({**head, "tensors": rows}, indent=1))  # JSON escapes control characters
        return 0
    v = head["version"]
    lossy = head["metadata"].get("ckptzip.lossy") == "1"
    t = Table(title=line(("LOSSY export (not for resuming)  ", "bold red") if lossy else "",
                         f"{a.file}  (format {v[0]}.{v[1]}, {head['created_by']})"))
    for c in ("key", "dtype", "shape", "raw", "stored", "ratio", "codec"):
        t.add_column(c, justify="right" if c in ("raw", "stored", "ratio") else "left",
                     overflow="fold" if c == "key" else "ellipsis")
    seen = set()
    for r in rows:
        shared = r["storage"] in seen
        seen.add(r["storage"])
        packed = "packed_in" in r
        t.add_row(text(r["key"] or "(the whole object)"), text(r["dtype"]), text(_shape(r["shape"])),
                  text(f"{r['raw_bytes']:,}"),
                  text("shared" if shared else "packed" if packed else f"{r['stored_bytes']:,}"),
                  text("" if shared or packed else f"{r['stored_bytes'] / max(1, r['raw_bytes']):.3f}"),
                  text((f"in storage {r['packed_in']}: " if packed else "") + r["codec"]
                       + (f" ({r['choice']})" if r["choice"] else "")))
    console.print(t)
    for k, val in head["metadata"].items():
        say(line(("metadata ", "dim"), f"{k} = {val}"))
    if head["base"]:
        b = head["base"]
        say(line(("incremental ", "dim"), f"against base {b.get('file')} (chain depth {b.get('depth')}, "
                 f"manifest sha256 {str(b.get('sha256'))[:16]}...); `ckptzip convert` writes a full copy"))
    say(line(f"tensor bytes {head['raw_bytes']:,} -> file {head['file_bytes']:,} "
             f"(ratio {head['file_bytes'] / max(1, head['raw_bytes']):.3f}), "
             f"{_count(head['storages'], 'storage')}, {_count(head['chunks'], 'chunk')}"))
    return 0


def cmd_verify(a) -> int:
    from . import api
    if _is_dcp_dir(a.file):
        return cmd_verify_dcp(a)
    _check_input(a.file)
    try:
        with api.open(a.file, max_bytes=a.max_bytes) as r, progress_bar("verifying", a.quiet) as cb:
            r.progress = cb
            r.verify()
    except CkptzipError as e:
        say(line(("FAILED", "red"), f" {a.file}: {_named(e)}"))
        return 1
    say(line(("OK", "green"), f" {a.file}: every chunk's checksum and size verified"))
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
    if a.json:
        print(json.dumps({"ratio": ratio, "before": before, "after": after}))
        return 0
    t = Table(title=f"checkpoint cost per month ({c.gpus} GPUs at ${c.gpu_hour_usd}/h, every "
                    f"{c.interval_min:g} min, {c.write_gbps:g} GB/s, {c.retained} kept)")
    for col in ("", "uncompressed", f"ckptzip (ratio {ratio:.3f})", "saved"):
        t.add_column(col, justify="right")
    for k, label in (("checkpoint_gb", "checkpoint GB"), ("write_s", "write stall s"),
                     ("idle_gpu_usd", "idle GPU $"), ("storage_usd", "storage $"), ("total_usd", "total $")):
        t.add_row(label, f"{before[k]:,.1f}", f"{after[k]:,.1f}", f"{before[k] - after[k]:,.1f}")
    console.print(t)
    return 0


def cmd_consolidate(a) -> int:
    from .dcp import consolidate
    _check_save_options(a)
    if not is_url(a.directory) and not os.path.isdir(a.directory):
        raise FileNotFoundError(2, "No such directory", a.directory)
    if os.path.abspath(a.output) == os.path.abspath(a.directory) or (
            not is_url(a.output) and os.path.isdir(a.output)):
        raise UsageError(f"{a.output}: the output must be a file, not a directory")
    from .dcp import output_inside
    if output_inside(a.directory, a.output):
        raise UsageError(f"output {a.output!r} is inside the checkpoint directory {a.directory!r}; "
                         "write it elsewhere")
    parent = os.path.dirname(os.path.abspath(a.output))
    if not is_url(a.output) and not os.path.isdir(parent):
        raise FileNotFoundError(2, "Output directory does not exist", parent)
    from torch.distributed.checkpoint.api import CheckpointException
    from .dcp import read_metadata
    read_metadata(a.directory)  # named errors (not committed, bad metadata) before DCP wraps them
    try:
        with progress_bar("consolidating", a.quiet) as cb:
            res = consolidate(a.directory, a.output, allow_pickle=a.allow_pickle, codec=a.codec,
                              chunk_size=a.chunk_size, level=a.level, progress=cb, portable=a.portable,
                              device=a.device)
    except CheckpointException as e:  # a BaseException: give its first failure, one line
        first = next(iter(getattr(e, "failures", {}).values()), None)
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            raise first from None
        raise CorruptDCPError(str(e).splitlines()[0]) from None
    _summary(a.directory, res, dcp_info(a.directory)["file_bytes"])  # the rank files, not the dir entry
    return 0


def _import_eval(spec: str):
    """``MODULE:FUNCTION`` -> the function (the module is imported: trusted code you named),
    found in the current directory first, as ``python -m ckptzip`` would: the ``ckptzip``
    script's sys.path does not hold it, so it is added for the rest of this (short) process, where
    the function's own imports and spawned DataLoader workers look too."""
    import importlib
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise UsageError(f"--eval takes MODULE:FUNCTION, not {spec!r}")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--eval {spec}: {e}") from None
    if not callable(f):
        raise UsageError(f"--eval {spec}: not callable")
    return f


def cmd_export(a) -> int:
    from . import lossy
    from .lossy.quant import parse_scheme
    if a.scheme != "auto":
        try:
            parse_scheme(a.scheme)
        except lossy.SchemeError as e:
            raise UsageError(f"--scheme: {e}") from None
    eval_fn = _import_eval(a.eval) if a.eval else None
    if not is_url(a.src) and not os.path.exists(a.src):
        raise FileNotFoundError(2, "No such file or directory", a.src)
    show = _show_progress(a.quiet or a.json)
    with contextlib.ExitStack() as stack:
        cb = None
        if show:
            p = stack.enter_context(Progress("[progress.description]{task.description}", BarColumn(),
                                             "{task.completed}/{task.total}", TimeRemainingColumn(),
                                             console=err, transient=True))
            task = p.add_task("exporting", total=None)

            def bar(done: int, total: int) -> None:
                p.update(task, completed=done, total=total)
            cb = bar
        rep = lossy.export(a.src, a.dst, scheme=a.scheme, bpw=a.bpw, max_loss_increase=a.max_loss_increase,
                           eval_fn=eval_fn, keep=tuple(a.keep or ()), model_key=a.model_key, format=a.format,
                           force=a.force, progress=cb, nonfinite=a.nonfinite)
    if a.json:
        print(json.dumps(rep, default=str))
        return 0
    t = Table(title=line(f"LOSSY export {a.dst}"))
    for c in ("tensor", "shape", "scheme", "bpw (est)", "rel. err", "loss change"):
        t.add_column(c, justify="left" if c in ("tensor", "scheme") else "right",
                     overflow="fold" if c == "tensor" else "ellipsis")
    for n, r in rep.get("quantized", {}).items():
        ld = r.get("loss_delta")
        t.add_row(text(n), text(_shape(r["shape"])), text(r["scheme"]), f"{r['bpw_est']:.2f}", f"{r['err']:.4f}",
                  "" if ld is None else f"{ld:+.5f}")
    for n, why in rep.get("kept", {}).items():
        t.add_row(text(n), "", text("kept (lossless)"), "", "0", "", style="dim")
    console.print(t)
    for k, why in (rep.get("dropped") or {}).items():
        say(line(("dropped ", "dim"), f"{k}: {why}"))
    if rep.get("bpw") is not None:
        say(line(f"bits per quantized weight {rep['bpw']:.3f}; file {rep.get('dst_bytes', 0):,} bytes"))
    loss = rep.get("loss") or {}
    if loss.get("change_pct") is not None:
        say(line(f"held-out loss {loss['base']:.5f} -> {loss['measured']:.5f} ({loss['change_pct']:+.3f} %)"))
    return 0


def cmd_ls(a) -> int:
    from .manager import CheckpointManager
    if not is_url(a.directory) and not os.path.isdir(a.directory):
        if os.path.exists(a.directory):
            raise NotADirectoryError(20, "Not a directory", a.directory)
        raise FileNotFoundError(2, "No such directory", a.directory)
    m = CheckpointManager(a.directory, keep_last=None, create=False)
    if is_url(a.directory) and not m.fs.isdir(m.root):
        raise FileNotFoundError(2, "No such directory", a.directory)
    entries = m.entries()
    steps = [e.step for e in entries if e.status == "committed"]
    if a.json:
        print(json.dumps({"directory": a.directory, "steps": steps, "latest": steps[-1] if steps else None,
                          "entries": [{**e._asdict(), "base": m.base_of(e.step) if e.status == "committed"
                                       else None} for e in entries]}))
        return 0
    t = Table(title=line(f"checkpoints in {a.directory}"))
    base = {e.step: m.base_of(e.step) for e in entries if e.status == "committed"}
    for c in ("step", "name", "kind", "bytes", "base", "status", "reason"):
        t.add_column(c, justify="right" if c in ("step", "bytes") else "left",
                     overflow="fold" if c == "reason" else "ellipsis")
    style = {"committed": "green", "uncommitted": "yellow", "damaged": "red"}
    for e in entries:
        t.add_row("" if e.step is None else str(e.step), text(e.name + ("/" if e.kind == "dcp" and
                                                                        not e.name.endswith(".commit") else "")),
                  text("dcp" if e.kind == "dcp" else "file"), "" if e.bytes is None else f"{e.bytes:,}",
                  "" if base.get(e.step) is None else f"step {base[e.step]}",
                  text(e.status, style[e.status]), text(e.reason or ""))
    console.print(t)
    if not steps:
        say(line("no committed checkpoint"))
        if not entries and not is_url(a.directory) and _is_dcp_dir(a.directory):
            say(line("(this directory is one DCP checkpoint, not a manager directory: try `ckptzip info` on it)"))
    return 0


def cmd_demo(a) -> int:
    _check_device(a.device)
    from .demo import run_demo
    run_demo(seconds=a.seconds, device=a.device, out_dir=a.out)
    return 0


# --------------------------------------------------------------------------------------------
# the parser

class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilog as written; ``(default: X)`` after every option that has a default
    worth stating (not flags, not None, not when the help text already names it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in h.lower() \
                and action.option_strings:
            h += " (default: %(default)s)"
        return h


class _Parser(argparse.ArgumentParser):
    """Usage errors become one line (``error: ...``) and exit status 2, through :func:`main`."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


EPILOG = """\
exit status: 0 success, 1 failure (missing/unreadable/corrupt file, no GPU, verify failed),
2 usage error, 128+N killed by signal N (an output being written is removed).
Errors are one line on stderr; set CKPTZIP_DEBUG=1 for tracebacks.
Progress bars go to stderr, only when it is a terminal and --quiet is not given.
Pickle never runs unless --allow-pickle is given: use it only for files you trust."""


def add_save_options(sp: argparse.ArgumentParser, codec_default: str) -> None:
    """The encoding options shared by ``compress`` and ``convert``."""
    g = sp.add_argument_group("encoding options")
    g.add_argument("--codec", type=_codec_type, default=codec_default, metavar="CODEC",
                   help="auto (zstd on the CPU; on a GPU nvCOMP ANS, or deflate when --portable), "
                        "zstd, deflate, raw (any CPU decodes these), or GPU-only ans, bitcomp, "
                        "gdeflate, lz4, snappy, cascaded; or a JSON wire config such as "
                        "'{\"id\": \"ans\", \"data_type\": \"<f2\"}'")
    g.add_argument("--level", type=int, default=None,
                   help="compression level for CPU zstd (1 to 22, higher is smaller and slower; "
                        "negative levels, down to -131072, are faster) or deflate (0 to 9); other codecs and GPU "
                        "encoding have none. Default: the codec's own (zstd 3, deflate 6)")
    g.add_argument("--chunk-size", type=_size_type, default=DEFAULT_CHUNK, metavar="BYTES",
                   help=f"uncompressed bytes per chunk, {MIN_CHUNK} to {MAX_CHUNK} (16M); K and M "
                        "suffixes mean KiB and MiB. Smaller chunks read single tensors with less "
                        "waste, larger ones compress slightly better")
    g.add_argument("--portable", action="store_true",
                   help="only codecs any CPU can decode (zstd, deflate, raw), even on a GPU")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to encode; default: the GPU when CUDA and nvCOMP are usable, else "
                        "the CPU. cuda without a usable GPU is an error")


def _add_pickle(sp: argparse.ArgumentParser, what: str) -> None:
    sp.add_argument("--allow-pickle", action="store_true",
                    help=f"{what}. Unpickling runs code chosen by the file's author: only for "
                         "files you trust")


def _add_max_bytes(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--max-bytes", type=_bytes_arg, default=None, metavar="BYTES",
                    help="refuse files declaring more decoded bytes than this; K/M/G/T suffixes "
                         "(default: max(1 GiB, 4096 x the file size))")


def _add_quiet(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar (there is none anyway when stderr is not a terminal)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptzip", description="Lossless compression of PyTorch checkpoints (.ckz files).\n"
                "`ckptzip COMMAND --help` describes each command's options.",
                epilog=EPILOG, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"ckptzip {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        import textwrap
        return sub.add_parser(name, help=help, description=textwrap.fill(description or help, 90),
                              epilog=EPILOG, formatter_class=_Formatter)

    c = command("compress", "torch.save or safetensors file -> .ckz",
                "Compress a torch.save file (read with torch.load(weights_only=True): tensors, "
                "containers, numbers, strings, numpy arrays/scalars and RNG states; no pickle) "
                "or a safetensors file (detected by its header; its __metadata__ becomes the "
                ".ckz metadata) into a .ckz file, written atomically.")
    c.add_argument("input", help="torch.save or safetensors file")
    c.add_argument("output", help=".ckz file to write (replaced atomically; must not be the input)")
    add_save_options(c, "auto")
    _add_pickle(c, "read input files that hold arbitrary Python objects (torch.load with "
                   "weights_only=False) and store them pickled in the .ckz")
    _add_quiet(c)
    c.set_defaults(fn=cmd_compress)

    d = command("decompress", ".ckz -> torch.save or safetensors file")
    d.add_argument("input", help=".ckz file")
    d.add_argument("output", help="file to write (replaced atomically; must not be the input)")
    d.add_argument("--format", choices=("auto", "torch", "safetensors"), default="auto",
                   help="output format; auto: safetensors if OUTPUT ends in .safetensors, else "
                        "torch.save. safetensors holds tensors only (nested dicts are flattened "
                        "to dotted keys, shared or strided tensors written as contiguous copies, "
                        "the .ckz metadata goes to __metadata__); other values are an error")
    _add_pickle(d, "load pickled objects stored in the .ckz")
    _add_max_bytes(d)
    _add_quiet(d)
    d.set_defaults(fn=cmd_decompress)

    v = command("convert", "re-encode a .ckz with other options (e.g. GPU-only codec -> zstd)",
                "Decode a .ckz and encode it again with other encoding options; its metadata is "
                "kept. Use on a GPU machine to make a CPU-readable copy of a file written with a "
                "GPU-only codec. The output is always a full (standalone) checkpoint: an "
                "incremental input is resolved against its base (--full says so explicitly).")
    v.add_argument("input", help=".ckz file")
    v.add_argument("output", help=".ckz file to write (replaced atomically; must not be the input)")
    add_save_options(v, "zstd")
    _add_pickle(v, "load and re-store pickled objects held by the .ckz")
    v.add_argument("--full", action="store_true",
                   help="write a full, standalone checkpoint (the default and only mode: an "
                        "incremental input is resolved against its base)")
    _add_max_bytes(v)
    _add_quiet(v)
    v.set_defaults(fn=cmd_convert)

    cs = command("consolidate", "ckptzip DCP checkpoint directory -> one .ckz",
                 "Read a sharded checkpoint written with ckptzip.dcp.Writer (any number of ranks) in "
                 "this process, without torch.distributed, and write the whole unsharded state dict "
                 "as one .ckz file (nested as it was saved) that ckptzip.load reads. Holds the whole "
                 "state in host memory.")
    cs.add_argument("directory", help="ckptzip DCP checkpoint directory (local or fsspec URL)")
    cs.add_argument("output", help=".ckz file to write (replaced atomically)")
    add_save_options(cs, "auto")
    _add_pickle(cs, "load bytes items that need full unpickling (objects other than tensors, "
                    "containers, numbers and strings) and store them pickled in the .ckz")
    _add_quiet(cs)
    cs.set_defaults(fn=cmd_consolidate)

    i = command("info", "table of tensors, sizes, ratios and codecs (reads the manifest only)",
                "Table of tensors, sizes, ratios and codecs of a .ckz file (reads the manifest only), "
                "or of a ckptzip DCP checkpoint directory (ckptzip.dcp.Writer): its rank files and, "
                "per tensor, every chunk (offsets, sizes) and the rank file holding it.")
    i.add_argument("file", help=".ckz file or ckptzip DCP checkpoint directory")
    i.add_argument("--json", action="store_true", help="print JSON only (for scripts)")
    _add_max_bytes(i)
    i.set_defaults(fn=cmd_info)

    f = command("verify", "decode every chunk and check its checksum and size; exit 1 on failure",
                "Decode every chunk and check its checksum and size; exit 1 on failure. For a ckptzip "
                "DCP checkpoint directory: the commit marker, the JSON metadata (validated), every "
                "rank file's size and every chunk of every rank file.")
    f.add_argument("file", help=".ckz file or ckptzip DCP checkpoint directory")
    _add_max_bytes(f)
    _add_quiet(f)
    f.set_defaults(fn=cmd_verify)

    k = command("cost", "monthly idle-GPU and storage dollars, before and after compression")
    k.add_argument("--size-gb", type=_positive(float), default=782.0, help="checkpoint size, GB (10^9 B)")
    k.add_argument("--write-gbps", type=_positive(float), default=5.0, help="write bandwidth, GB/s")
    k.add_argument("--every-min", type=_positive(float), default=30.0, help="minutes between checkpoints")
    k.add_argument("--gpus", type=_positive(int), default=8, help="GPUs idle while a checkpoint is written")
    k.add_argument("--gpu-hour", type=float, default=4.40, help="price of one GPU hour, USD")
    k.add_argument("--retained", type=_nonneg_int, default=10, help="checkpoints kept in storage")
    k.add_argument("--storage-gb-month", type=float, default=0.023, help="storage price, USD per GB-month")
    k.add_argument("--ratio", type=_positive(float), default=0.75,
                   help="compressed/uncompressed size ratio to assume")
    k.add_argument("--from", dest="from_file", metavar="FILE", default=None,
                   help="take the ratio measured on this .ckz file instead of --ratio")
    k.add_argument("--json", action="store_true", help="print JSON only (for scripts)")
    k.set_defaults(fn=cmd_cost)

    ex = command("export", "LOSSY weights-only export (quantized) of a checkpoint; never for resuming",
                 "Write a lossy, weights-only artifact of SRC (a .ckz, a torch .pt read without pickle, "
                 "a safetensors file or a ckptzip DCP checkpoint directory): the model weights are "
                 "found (or --model-key), the optimizer state and the duplicate precision copy are "
                 "dropped, matrices are quantized (fp8 per row, intN group-wise) and entropy-coded; "
                 "vectors, non-float tensors and --keep matches stay lossless. Resume paths refuse "
                 "the result (LossyCheckpointError). See docs/export.md.")
    ex.add_argument("src", help="checkpoint to export from")
    ex.add_argument("dst", help="output .ckz file, or directory for --format compressed-tensors")
    ex.add_argument("--scheme", default="auto",
                    help="auto (the default: per-tensor allocation under --bpw or --max-loss-increase) "
                         "or one of bf16, fp8, int8, int6, int5, int4, int3, int2, optionally "
                         "-g32/-g64/-g128 (group size, default 128) and -sym (symmetric; default asymmetric)")
    ex.add_argument("--bpw", type=_positive(float), default=None,
                    help="bits-per-weight budget of the quantized tensors for --scheme auto "
                         "(default 4.5 without --eval)")
    ex.add_argument("--max-loss-increase", type=_positive(float), default=None,
                    help="relative held-out loss budget for --scheme auto, e.g. 0.001 = +0.1 %% "
                         "(needs --eval; default 0.001 with --eval)")
    ex.add_argument("--eval", default=None, metavar="MODULE:FUNCTION",
                    help="function(weights: dict[str, Tensor]) -> float held-out loss; the module is "
                         "imported (your code), from the current directory or sys.path")
    ex.add_argument("--keep", action="append", metavar="PATTERN",
                    help="fnmatch pattern of tensor names stored losslessly (repeatable)")
    ex.add_argument("--model-key", default=None, help="key of the model state dict in SRC (default: found)")
    ex.add_argument("--format", choices=("ckz", "compressed-tensors"), default="ckz",
                    help="a lossy .ckz, or a compressed-tensors directory (safetensors + config.json)")
    ex.add_argument("--nonfinite", choices=("refuse", "keep"), default="refuse",
                    help="weights with NaN/Inf: refuse (error naming the tensor) or keep them lossless")
    ex.add_argument("--force", action="store_true", help="replace an existing DST")
    ex.add_argument("--json", action="store_true", help="print the report as JSON only")
    _add_quiet(ex)
    ex.set_defaults(fn=cmd_export)

    ls = command("ls", "checkpoints of a CheckpointManager directory, with their status",
                 "Every checkpoint of a CheckpointManager directory (files and distributed checkpoint "
                 "directories) with its status: committed (loadable), uncommitted (no commit marker: "
                 "in progress or interrupted) or damaged, and why.")
    ls.add_argument("directory", help="local directory or fsspec URL; it must exist")
    ls.add_argument("--json", action="store_true", help="print JSON only (for scripts)")
    ls.set_defaults(fn=cmd_ls)

    m = command("demo", "train a tiny model, save with torch.save and ckptzip, compare")
    m.add_argument("--seconds", type=_positive(float), default=8.0, help="training time, seconds")
    m.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda if available, else cpu")
    m.add_argument("--out", default=None, help="directory for the files (default: a temp dir)")
    m.set_defaults(fn=cmd_demo)
    return p


# --------------------------------------------------------------------------------------------
# main

@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` in the main thread while the command runs, so
    an atomic write in progress removes its temp file. Previous handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)
    old = {}
    for s in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, OSError):
            old[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(s, h)


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")

    def trace() -> None:
        if debug:
            import traceback
            traceback.print_exc()
    try:
        with _signals_raise():
            try:
                a = parser.parse_args(argv)
            except SystemExit as e:  # --help, --version
                return e.code if isinstance(e.code, int) else 0
            return a.fn(a)
    except UsageError as e:
        trace()
        error_line(str(e))
        return 2
    except Interrupted as e:
        trace()
        error_line(f"interrupted by {signal.Signals(e.signum).name}; nothing was written")
        return 128 + e.signum
    except KeyboardInterrupt:
        trace()
        error_line("interrupted")
        return 130
    except CkptzipError as e:
        trace()
        hint = " (command line: --allow-pickle)" if isinstance(
            e, (PickleNotAllowedError, UnsupportedObjectError)) and "--allow-pickle" not in str(e) else ""
        if isinstance(e, ResourceLimitError):
            hint += " (command line: --max-bytes)"
        if isinstance(e, NotCkptzipFileError):
            hint += " (`ckptzip compress` converts a torch.save or safetensors file)"
        error_line(f"{_named(e)}{hint}")
        return 1
    except BrokenPipeError:  # e.g. `ckptzip info x.ckz | head`
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        trace()
        error_line(_os_message(e))
        return 1
    except MemoryError:
        trace()
        error_line("out of memory")
        return 1
    except (ValueError, TypeError) as e:
        trace()
        error_line(str(e) or type(e).__name__)
        return 1
    except Exception as e:
        if debug:
            raise
        error_line(f"internal error: {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for a traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
