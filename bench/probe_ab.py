"""Exploration on a GPU: A/B of engine switches on gpu_throughput.measure (343 MB fp32, 172 MB
bf16 synthetic weights): nvCOMP scratch allocator (torch vs nvCOMP's), header-checked sync-free
ANS decode on/off, pinned vs pageable tile table; plus the cost of building decode configs.

    CKPTZIP_NVCOMP_ALLOCATOR=nvcomp|torch PYTHONPATH=src python bench/probe_ab.py
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import measure  # noqa: E402

from ckptzip import _triton_bp  # noqa: E402
from ckptzip.codecs import gpu as G  # noqa: E402


def main():
    torch.manual_seed(0)
    w = torch.randn(86 << 20, device="cuda") * 0.02
    d = {"fp32": w, "bf16": w.bfloat16()}
    alloc = os.environ.get("CKPTZIP_NVCOMP_ALLOCATOR", "torch")
    orig = G.NvcompCodec._header_check
    for verified in (True, False):
        G.NvcompCodec._header_check = orig if verified else (lambda self, c: False)
        for pin in (True, False):
            _triton_bp.PIN_TABLE = pin
            for k, t in d.items():
                measure(t, reps=1)
                r = [measure(t, reps=20) for _ in range(2)]
                print(json.dumps({"alloc": alloc, "verified": verified, "pin": pin, "data": k,
                                  "c best": [round(x["compress_GBps"], 1) for x in r],
                                  "c med": [round(x["compress_GBps_median"], 1) for x in r],
                                  "d best": [round(x["decompress_GBps"], 1) for x in r],
                                  "d med": [round(x["decompress_GBps_median"], 1) for x in r]}), flush=True)
    G.NvcompCodec._header_check = orig
    nv = G._nvcomp()
    c = G._make_codec("ANS", 0, torch.cuda.current_stream().cuda_stream, (("data_type", "|u1"),))
    sizes = [1 << 20] * 82
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cc = c.compression_config(sizes)
        t1 = time.perf_counter()
        c.decompression_config(cc)
        t2 = time.perf_counter()
        print("config ms", round((t1 - t0) * 1e3, 3), round((t2 - t1) * 1e3, 3), flush=True)
    del nv


if __name__ == "__main__":
    main()
