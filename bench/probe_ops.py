"""Exploration on a GPU machine: host cost of single operations (us per call, mean of 2000):
numpy table building, torch dispatch, pinned uploads, a plain kernel launch, a Triton launch
through JITFunction and through the compiled kernel handle, and ctypes calls into nvCOMP.

    PYTHONPATH=src python bench/probe_ops.py
"""
import time

import numpy as np
import torch
import triton
import triton.language as tl

from ckptzip import _triton_bp


@triton.jit
def _noop(x, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n), mask=i < n)


def per_call(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return dt


def main():
    x = torch.zeros(1 << 20, device="cuda")
    a = np.arange(700, dtype=np.int64)
    pinned = torch.zeros(4 * 700, dtype=torch.int64).pin_memory()
    dev = torch.empty(4 * 700, dtype=torch.int64, device="cuda")
    u8 = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(u8)
    res = {
        "np.stack 4x700": per_call(lambda: np.stack([a, a, a, a])),
        "torch.empty(cuda)": per_call(lambda: torch.empty(1000, device="cuda")),
        "x.add_(1)": per_call(lambda: x.add_(1)),
        "from_numpy.pin_memory": per_call(lambda: torch.from_numpy(np.stack([a, a, a, a])).pin_memory()),
        "pinned->dev copy_ nb": per_call(lambda: dev.copy_(pinned, non_blocking=True)),
        "from_numpy.pin.to(cuda)": per_call(lambda: torch.from_numpy(np.stack([a, a, a, a])).pin_memory().to(
            "cuda", non_blocking=True)),
        "triton JIT launch": per_call(lambda: _noop[(1,)](x, 1000, BLOCK=1024)),
        "torch.cuda.current_stream": per_call(lambda: torch.cuda.current_stream().cuda_stream),
        "byteplane encode (Triton, 64 MiB)": per_call(lambda: _triton_bp.encode(u8, 2, 1 << 22, out=out), 200),
        "copy_segments 21 segs (Triton)": per_call(lambda: _triton_bp.copy_segments(
            u8, np.arange(21, dtype=np.int64) * (3 << 20), out, np.arange(21, dtype=np.int64) * (3 << 20),
            np.full(21, 2 << 20, dtype=np.int64)), 200),
    }
    for k, v in res.items():
        print(f"{k:40s} {v:8.1f} us")


if __name__ == "__main__":
    main()
