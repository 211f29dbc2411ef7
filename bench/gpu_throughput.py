"""GPU compress/decompress throughput of ckptzip's planned encode and decode (transform +
nvCOMP + packing the chosen bytes of every chunk), on device-resident data, excluding disk and
host copies. Used by bench/run_bench.py and on its own: python bench/gpu_throughput.py"""
import json
import time

import torch

from ckptzip.planner import Planner
from ckptzip.engine import FLAG_STORED_RAW, decode_chunks, encode_window, gpu_window, windows
from ckptzip.tree import StorageRef


def ref_of(t: torch.Tensor) -> StorageRef:
    return StorageRef(t.reshape(-1).view(torch.uint8), str(t.dtype)[6:], str(t.device),
                      t.element_size() if t.is_floating_point() and t.element_size() > 1 else 0)


def measure(t: torch.Tensor, codec="auto", reps=3, portable=False):
    ref = ref_of(t)
    win = gpu_window()
    plan = Planner(codec, "auto", 1 << 20, None, "cuda", portable).plan_all([ref], win)[0]
    n = ref.data.numel()
    best_e = best_d = 1e9
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        packed, encoded = [], []
        for a, b, offs, sizes, planes in windows(n, plan.transform, plan.chunk_size, win, plan.plane_chunks):
            encoded.append((a, b, offs, sizes, *encode_window(plan, ref.data[a:b], offs, sizes, planes)))
        torch.cuda.synchronize()
        best_e = min(best_e, time.perf_counter() - t0)  # transform + nvCOMP (packing excluded)
        for a, b, offs, sizes, stream, comp, doffs, dsizes in encoded:
            # pack as the file does: chosen bytes of each chunk at 16-byte aligned offsets
            flags, stored, soffs, pos = [], [], [], 0
            for o, sz, co, cn in zip(offs, sizes, doffs, dsizes):
                raw = cn >= sz
                flags.append(FLAG_STORED_RAW if raw else 0)
                stored.append(sz if raw else cn)
                soffs.append(pos)
                pos += (stored[-1] + 15) // 16 * 16
            buf = torch.empty(pos, dtype=torch.uint8, device="cuda")
            for o, sz, co, cn, so, st in zip(offs, sizes, doffs, dsizes, soffs, stored):
                buf[so:so + st].copy_(stream[o:o + sz] if cn >= sz else comp[co:co + cn])
            packed.append((a, b, buf, soffs, stored, sizes, flags))
        del encoded
        total = sum(sum(p[4]) for p in packed)
        dst = torch.empty_like(ref.data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a, b, buf, soffs, stored, sizes, flags in packed:
            decode_chunks(buf, soffs, stored, sizes, flags, plan.transform, plan.codec, dst[a:b], "cuda")
        torch.cuda.synchronize()
        best_d = min(best_d, time.perf_counter() - t0)
        del packed
    assert torch.equal(dst, ref.data), "round trip failed"
    return {"codec": plan.codec.get_config(), "transform": plan.transform.get_config() if plan.transform else None,
            "raw_planes": sorted(plan.raw_planes), "plane_chunks": plan.plane_chunks, "ratio": total / n, "compress_GBps": n / best_e / 1e9, "decompress_GBps": n / best_d / 1e9,
            "choice": plan.choice}


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    res = {"fp32 (1 GiB)": measure(w), "bf16 (0.5 GiB)": measure(w.bfloat16()),
           "fp32 zstd": measure(w[: 64 << 20], "zstd")}
    print(json.dumps(res, indent=1))
