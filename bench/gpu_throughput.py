"""GPU compress/decompress throughput of ckptzip's planned encode and decode (transform +
nvCOMP + packing the chosen bytes of every chunk), on device-resident data, excluding disk and
host copies. Used by bench/run_bench.py and on its own: python bench/gpu_throughput.py"""
import gc
import json
import statistics
import time

import numpy as np
import torch

from ckptzip.codecs import _capi
from ckptzip.engine import (DEFAULT_WINDOW, Job, Planner, decode_group, encode_group_arrays, gather_gpu,
                            gpu_window, stage_encoded, units_of)
from ckptzip.tree import StorageRef


def ref_of(t: torch.Tensor) -> StorageRef:
    return StorageRef(t.reshape(-1).view(torch.uint8), str(t.dtype)[6:], str(t.device),
                      t.element_size() if t.is_floating_point() and t.element_size() > 1 else 0)


def measure(t: torch.Tensor, codec="auto", reps=10, portable=False, device="cuda"):
    """Best-of-``reps`` (and median) compress and decompress GB/s of ckptzip's planned encode and decode, data
    resident on ``device``, as a save and a load run them window by window. Compress: transform,
    codec, and packing every chunk's chosen bytes into one buffer (what ``async_save`` keeps as
    its snapshot). Decompress: from those packed buffers, raw copies + codec + inverse transform
    into the destination. Checks the round trip."""
    from ckptzip.kernels import triton_kernels
    triton_kernels(wait=True)  # steady-state figures: the kernels, not the first-save torch path
    ref = ref_of(t)
    win = gpu_window() if device == "cuda" else DEFAULT_WINDOW
    plan = Planner(codec, "auto", 1 << 20, None, device, portable).plan_all([ref], win)[0]
    n = ref.data.numel()
    units = units_of(0, ref.data, plan, win)
    times_e, times_d = [], []
    dst = torch.empty_like(ref.data)
    gc_was = gc.isenabled()
    gc.disable()  # a collection in a 2-4 ms timed section is noise, not the engine's cost
    for _ in range(reps):
        packed = []
        _sync(device)
        t0 = time.perf_counter()
        for u in units:
            enc = encode_group_arrays([u])
            if device == "cuda":
                buf, rel = gather_gpu(enc)
            else:
                buf, rel = stage_encoded(enc, lambda k: torch.empty(k, dtype=torch.uint8))
            del enc
            packed.append((u, buf, rel, rel["offset"].astype(np.int64)))
        _sync(device)
        times_e.append(time.perf_counter() - t0)
        total = sum(int(rel["stored"].sum()) for _u, _b, rel, _o in packed)
        dst.zero_()
        _sync(device)
        t0 = time.perf_counter()
        a = 0
        with _capi.deferred_checks():  # as a load does: decode results checked where it syncs
            for u, buf, rows, soffs in packed:
                b = a + u.data.numel()
                decode_group(buf, soffs, rows, [(Job(rows, plan.transform, plan.codec, dst), 0, len(rows), a, b)],
                             device)
                a = b
            _sync(device)
        times_d.append(time.perf_counter() - t0)
        del packed
    if gc_was:
        gc.enable()
    assert torch.equal(dst, ref.data), "round trip failed"
    best_e, best_d = min(times_e), min(times_d)
    return {"codec": plan.codec.get_config(), "transform": plan.transform.get_config() if plan.transform else None,
            "raw_planes": sorted(plan.raw_planes), "plane_chunks": plan.plane_chunks, "ratio": total / n,
            "compress_GBps": n / best_e / 1e9, "decompress_GBps": n / best_d / 1e9, "choice": plan.choice,
            "compress_GBps_median": n / statistics.median(times_e) / 1e9,
            "decompress_GBps_median": n / statistics.median(times_d) / 1e9, "reps": reps,
            "window": win}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    res = {"fp32 (1 GiB)": measure(w), "bf16 (0.5 GiB)": measure(w.bfloat16()),
           "fp32 zstd": measure(w[: 64 << 20], "zstd")}
    print(json.dumps(res, indent=1))
