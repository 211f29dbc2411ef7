"""GPU compress/decompress throughput of ckptzip's planned encode and decode (transform +
nvCOMP), on device-resident data, excluding disk and host copies."""
import json, os, sys, time
import torch
from ckptzip.api import _choose
from ckptzip.engine import encode_window, windows, Plan
from ckptzip.tree import StorageRef


def measure(t: torch.Tensor, codec="auto", reps=3):
    ref = StorageRef(t.view(-1).view(torch.uint8), str(t.dtype)[6:], "cuda:0",
                     t.element_size() if t.is_floating_point() else 0)
    plan = _choose(ref, codec, "auto", 1 << 20, None, {}, "cuda")
    n = ref.data.numel()
    best_e = best_d = 1e9
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        outs = [(a, b, offs, sizes, *encode_window(plan, ref.data[a:b], offs, sizes))
                for a, b, offs, sizes in windows(n, plan.transform, plan.chunk_size, 256 << 20)]
        torch.cuda.synchronize(); best_e = min(best_e, time.perf_counter() - t0)
        stored = sum(sum(min(x, y) for x, y in zip(o[-1], o[3])) for o in outs)
        dst = torch.empty_like(ref.data)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for a, b, offs, sizes, stream, comp, doffs, dsizes in outs:
            tmp = torch.empty(b - a, dtype=torch.uint8, device="cuda") if plan.transform else dst[a:b]
            plan.codec.decode(comp, doffs, dsizes, tmp, offs, sizes)
            if plan.transform:
                plan.transform.decode(tmp, dst[a:b])
        torch.cuda.synchronize(); best_d = min(best_d, time.perf_counter() - t0)
        del outs
    assert torch.equal(dst, ref.data)
    return {"codec": plan.codec.get_config(), "transform": plan.transform.get_config() if plan.transform else None,
            "ratio_before_raw_fallback": stored / n, "compress_GBps": n / best_e / 1e9,
            "decompress_GBps": n / best_d / 1e9, "choice": plan.choice}


if __name__ == "__main__":
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    res = {"fp32 (1 GiB)": measure(w), "bf16 (0.5 GiB)": measure(w.bfloat16()),
           "fp32 zstd": measure(w[: 64 << 20], "zstd")}
    print(json.dumps(res, indent=1))
