"""What the peer codecs (lmzip, z4ai, moonclip, ZipNN) store for checkpoint snapshot 2 given snapshot 1.

Each peer is driven through its own public delta / "against a base" API, and also through its
standalone compression of snapshot 2; the smaller of the two (bit-exact ones only) is reported.
Every result is verified by decompressing (against snapshot 1 where it is a delta) and comparing
the bytes of every tensor of snapshot 2. At most 2 threads are used.

Used by ``bench/incremental_bench.py --peers`` (the same snapshots as ckptzip's, in one run).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch

THREADS = 2
os.environ.setdefault("MOONCLIP_THREADS", str(THREADS))  # read when moonclip starts its pool


def _flat(state: dict) -> dict[str, torch.Tensor]:
    """name -> tensor for every tensor of a bench/gpt.py checkpoint() state (same order for s1, s2)."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({f"model_bf16.{k}": v for k, v in state["model_bf16"].items()})
    for i, st in state["optimizer"]["state"].items():
        out.update({f"optimizer.state.{i}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return out


def _b(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _exact(restored: dict, ref: dict[str, torch.Tensor]) -> bool:
    """Same names, and every tensor's bytes identical (restored values: tensors or bytes)."""
    if set(restored) != set(ref):
        return False
    return all((v if isinstance(v, (bytes, bytearray)) else _b(v)) == _b(ref[k])
               for k, v in restored.items())


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


# Each peer function returns [(stored_bytes, method, compress_s, decompress_s, bit_exact), ...]:
# first its delta route, then its standalone route.

def _zipnn(s1, s2, f1, f2, st1, st2, wd):
    from zipnn import ZipNN
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

    def zn(t, delta):  # one instance per call: ZipNN keeps per-call header state
        return ZipNN(input_format="byte", bytearray_dtype=dt[t.dtype], threads=THREADS,
                     delta_compressed_type="byte" if delta else 0)

    out = []
    for delta in (True, False):
        base = {k: _b(v) for k, v in f1.items()} if delta else {}
        kw = lambda k: {"delta_second_data": base[k]} if delta else {}
        blobs, cs = _timed(lambda: {k: zn(t, delta).compress(_b(t), **kw(k)) for k, t in f2.items()})
        back, ds = _timed(lambda: {k: bytes(zn(f2[k], delta).decompress(b, **kw(k))) for k, b in blobs.items()})
        how = ("ZipNN(input_format='byte', bytearray_dtype=<tensor dtype>, delta_compressed_type='byte')"
               ".compress(s2_bytes, delta_second_data=s1_bytes) per tensor (XOR vs s1, then ZipNN)"
               if delta else "ZipNN(input_format='byte', bytearray_dtype=<tensor dtype>).compress(s2_bytes) per tensor")
        out.append((sum(len(b) for b in blobs.values()), how, cs, ds, _exact(back, f2)))
    return out


def _z4ai(s1, s2, f1, f2, st1, st2, wd):
    from safetensors.torch import load as st_load
    from z4ai import model_delta, safetensors as z4st
    blob, cs = _timed(model_delta.compress, st2, st1, threads=THREADS)
    back, ds = _timed(lambda: st_load(model_delta.decompress(blob, st1)))
    out = [(len(blob), "z4ai.model_delta.compress(s2.safetensors, base=s1.safetensors, threads=2): "
            "per-tensor COPY / XOR-delta (z4ai.delta) / FULL by name", cs, ds, _exact(back, f2))]
    blob, cs = _timed(z4st.compress_bytes, st2, threads=1, workers=THREADS)
    back, ds = _timed(lambda: st_load(z4st.decompress_bytes(blob, workers=THREADS)))
    out.append((len(blob), "z4ai.safetensors.compress_bytes(s2.safetensors, workers=2) (standalone)",
                cs, ds, _exact(back, f2)))
    return out


def _lmz(s1, s2, f1, f2, st1, st2, wd):
    import lmz
    from safetensors.torch import load_file
    p1, p2 = os.path.join(wd, "s1.safetensors"), os.path.join(wd, "s2.safetensors")
    arc, full, restored = (os.path.join(wd, n) for n in ("pair.lmz", "s2.lmz", "restored.safetensors"))
    lmz.compress(p1, arc, workers=THREADS)
    before = _du(arc)
    _, cs = _timed(lmz.append, arc, p2, workers=THREADS)
    _, ds = _timed(lmz.extract, arc, "s2.safetensors", restored, overwrite=True, workers=THREADS)
    out = [(_du(arc) - before, "lmz.compress(s1.safetensors, arc) then lmz.append(arc, s2.safetensors) "
            "(tensors delta-coded against s1 in the archive); stored = archive growth; "
            "lmz.extract(arc, 's2.safetensors')", cs, ds, _exact(load_file(restored), f2))]
    _, cs = _timed(lmz.compress, p2, full, workers=THREADS)
    _, ds = _timed(lmz.decompress, full, restored, workers=THREADS, overwrite=True)
    out.append((_du(full), "lmz.compress(s2.safetensors) (standalone)", cs, ds, _exact(load_file(restored), f2)))
    return out


def _moonclip(s1, s2, f1, f2, st1, st2, wd):
    from moonclip import CheckpointManager, flatten_state_dict

    def tensors(s):  # the documented save_raw input: flatten_state_dict per component
        out = {}
        for part in ("model", "model_bf16", "optimizer"):
            out.update(flatten_state_dict(s[part], part)[0])
        return out

    def back(root, sid):  # a fresh manager, so the load reads the store and not a cached base
        return _flat(CheckpointManager(root, async_save=False).load(sid))  # load() unflattens

    out = []
    for delta in (True, False):
        root = os.path.join(wd, "moonclip_delta" if delta else "moonclip_full")
        mgr = CheckpointManager(root, async_save=False)
        if delta:
            mgr.save_raw(step=200, tensors=tensors(s1))
        before = _du(root)
        sid, cs = _timed(mgr.save_raw, step=250, tensors=tensors(s2))
        info = mgr.list_snapshots()[-1]
        restored, ds = _timed(back, root, sid)
        how = (f"CheckpointManager(root, async_save=False).save_raw(step, flatten_state_dict(part) for "
               f"model/model_bf16/optimizer), s1 then s2; stored = store growth; snapshot is_delta="
               f"{info['is_delta']}, tensors delta/full/skipped={info['delta_tensors']}/{info['full_tensors']}/"
               f"{info['skipped_tensors']}" if delta else "CheckpointManager.save_raw of s2 alone (standalone)")
        out.append((_du(root) - before, how, cs, ds, _exact(restored, f2)))
    return out


PEERS = {"lmzip": ("lmz", _lmz), "z4ai": ("z4ai", _z4ai), "moonclip": ("moonclip", _moonclip),
         "ZipNN": ("zipnn", _zipnn)}


def peer_ratios(s1: dict, s2: dict, workdir: str) -> dict[str, dict]:
    """{peer: {stored_bytes, ratio, method, compress_s, decompress_s, bit_exact, ...}} for s2 given s1."""
    import importlib.util
    from safetensors.torch import save, save_file
    torch.set_num_threads(THREADS)
    f1, f2 = _flat(s1), _flat(s2)
    raw = sum(t.untyped_storage().nbytes() for t in f2.values())
    os.makedirs(workdir, exist_ok=True)
    save_file(f1, os.path.join(workdir, "s1.safetensors"))
    save_file(f2, os.path.join(workdir, "s2.safetensors"))
    st1, st2 = save(f1), save(f2)
    results = {}
    for peer, (module, fn) in PEERS.items():
        if importlib.util.find_spec(module) is None:
            results[peer] = {"error": "not installed"}
            continue
        wd = os.path.join(workdir, peer)
        shutil.rmtree(wd, ignore_errors=True)
        os.makedirs(wd)
        for n in ("s1.safetensors", "s2.safetensors"):
            os.link(os.path.join(workdir, n), os.path.join(wd, n))
        try:
            runs = fn(s1, s2, f1, f2, st1, st2, wd)
        except Exception as e:  # a peer that cannot round-trip is reported, not fatal
            results[peer] = {"stored_bytes": None, "ratio": None, "method": f"error: {e!r}",
                             "compress_s": None, "decompress_s": None, "bit_exact": False}
            continue
        finally:
            shutil.rmtree(wd, ignore_errors=True)
        ok = [r for r in runs if r[4]] or runs
        stored, how, cs, ds, exact = min(ok, key=lambda r: r[0])
        results[peer] = {"stored_bytes": stored, "raw_bytes": raw, "ratio": stored / raw, "method": how,
                         "compress_s": round(cs, 3), "decompress_s": round(ds, 3), "bit_exact": exact,
                         "delta_ratio": runs[0][0] / raw, "delta_bit_exact": runs[0][4],
                         "standalone_ratio": runs[1][0] / raw, "standalone_bit_exact": runs[1][4]}
    return results

