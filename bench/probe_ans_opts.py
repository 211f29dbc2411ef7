"""Exploration on a GPU: nvCOMP 6.0 ANS options of the C API on exponent planes (128 KiB chunks,
as the planner picks): compression with histogram_reduction_log2 0-3 and states_per_lane 1/2
(kernel time, ratio), and decompression with the generic kernel (data type read from the stream)
or a specialized one (data type and states named). Kernel times by CUDA events, median of 20.

    PYTHONPATH=src python bench/probe_ans_opts.py
"""
import json
import struct
import statistics

import numpy as np
import torch

from ckptzip.codecs import _capi
from ckptzip.transforms import BytePlane


def timed(fn, reps=20):
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    w = torch.randn(84 << 20, device="cuda") * 0.02
    for name, t in (("fp32", w), ("bf16", w.bfloat16())):
        width = t.element_size()
        raw = t.view(torch.uint8)
        planes = BytePlane(width, 1 << 22).encode(raw)
        # the exponent plane of every 4 Mi-word block, gathered into one buffer
        exp = planes.view(-1, width, 1 << 22)[:, width - 1].reshape(-1)
        chunk = 128 << 10
        n = exp.numel()
        offs = np.arange(0, n, chunk, dtype=np.int64)
        sizes = np.minimum(chunk, n - offs)
        for dt_name, dt in (("|u1", 1),):
            for states in (0, 1, 2):
                for red in (0, 1, 2, 3):
                    copts = _capi._Opts.of(struct.pack("<iiBBB", 0, dt, 0, states, red))
                    cap = (_capi.max_output("ANS", bytes(copts), chunk) + 15) // 16 * 16
                    out = torch.empty(cap * len(sizes), dtype=torch.uint8, device="cuda")
                    oo = np.arange(len(sizes), dtype=np.int64) * cap
                    tc = timed(lambda: _capi.compress("ANS", copts, exp, offs, sizes, out, oo, cap).sizes())
                    got = _capi.compress("ANS", copts, exp, offs, sizes, out, oo, cap).sizes()
                    dst = torch.empty_like(exp)
                    res = {"data": name, "states": states, "hist_red": red, "ratio": round(float(got.sum()) / n, 4),
                           "c_GBps": round(n / tc / 1e9, 1)}
                    for label, dopts in (("generic", struct.pack("<iIBBB", 0, 0xFF, 0, 0, 0)),
                                         ("typed", struct.pack("<iIBBB", 0, dt, 0, 0, 0)),
                                         ("typed+states2", struct.pack("<iIBBB", 0, dt, 0, 2, 0)),
                                         ("typed+states1", struct.pack("<iIBBB", 0, dt, 0, 1, 0)),
                                         ("generic+skipval", struct.pack("<iIBBB", 0, 0xFF, 0, 0, 1))):
                        o = _capi._Opts.of(dopts)
                        dst.zero_()
                        try:
                            with _capi.deferred_checks():
                                td = timed(lambda: _capi.decompress("ANS", o, out, oo, got, dst, offs, sizes))
                            ok = bool(torch.equal(dst, exp))
                        except Exception as e:
                            td, ok = float("nan"), f"error: {e}"[:80]
                        res[f"d_{label}"] = round(n / td / 1e9, 1) if ok is True else ok
                    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
