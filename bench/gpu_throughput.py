"""GPU compress/decompress throughput of ckptzip's planned encode and decode (transform +
nvCOMP + packing the chosen bytes of every chunk), on device-resident data, excluding disk and
host copies. Used by bench/run_bench.py and on its own: python bench/gpu_throughput.py"""
import json
import time

import torch

from ckptzip.planner import Planner
import numpy as np

from ckptzip.engine import DEFAULT_WINDOW, Job, decode_group, encode_group, gpu_window, units_of
from ckptzip.format import ROW
from ckptzip.tree import StorageRef


def ref_of(t: torch.Tensor) -> StorageRef:
    return StorageRef(t.reshape(-1).view(torch.uint8), str(t.dtype)[6:], str(t.device),
                      t.element_size() if t.is_floating_point() and t.element_size() > 1 else 0)


def measure(t: torch.Tensor, codec="auto", reps=3, portable=False, device="cuda"):
    """Best-of-``reps`` compress and decompress GB/s of ckptzip's planned encode (transform +
    codec, packing excluded) and decode (raw copies + codec + inverse transform), data resident
    on ``device``; checks the round trip."""
    ref = ref_of(t)
    win = gpu_window() if device == "cuda" else DEFAULT_WINDOW
    plan = Planner(codec, "auto", 1 << 20, None, device, portable).plan_all([ref], win)[0]
    n = ref.data.numel()
    units = units_of(0, ref.data, plan, win)
    best_e = best_d = 1e9
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        encoded = [encode_group([u]) for u in units]
        _sync(device)
        best_e = min(best_e, time.perf_counter() - t0)
        # pack as the file does: chosen bytes of each chunk at 16-byte aligned offsets
        packed = []
        for u, (pieces,) in zip(units, encoded):
            rows = np.zeros(len(pieces), ROW)
            soffs, pos = [], 0
            for k, (_t, _so, ln, raw, flags) in enumerate(pieces):
                rows[k]["stored"], rows[k]["raw"], rows[k]["flags"] = ln, raw, flags
                soffs.append(pos)
                pos += (ln + 15) // 16 * 16
            buf = torch.zeros(pos, dtype=torch.uint8, device=device)
            for (tt, so, ln, _raw, _fl), o in zip(pieces, soffs):
                buf[o:o + ln].copy_(tt[so:so + ln])
            packed.append((u, buf, soffs, rows))
        del encoded
        total = sum(int(p[3]["stored"].sum()) for p in packed)
        dst = torch.empty_like(ref.data)
        _sync(device)
        t0 = time.perf_counter()
        a = 0
        for u, buf, soffs, rows in packed:
            b = a + u.data.numel()
            decode_group(buf, soffs, rows, [(Job(rows, plan.transform, plan.codec, dst), 0, len(rows), a, b)], device)
            a = b
        _sync(device)
        best_d = min(best_d, time.perf_counter() - t0)
        del packed
    assert torch.equal(dst, ref.data), "round trip failed"
    return {"codec": plan.codec.get_config(), "transform": plan.transform.get_config() if plan.transform else None,
            "raw_planes": sorted(plan.raw_planes), "plane_chunks": plan.plane_chunks, "ratio": total / n,
            "compress_GBps": n / best_e / 1e9, "decompress_GBps": n / best_d / 1e9, "choice": plan.choice}


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    res = {"fp32 (1 GiB)": measure(w), "bf16 (0.5 GiB)": measure(w.bfloat16()),
           "fp32 zstd": measure(w[: 64 << 20], "zstd")}
    print(json.dumps(res, indent=1))
