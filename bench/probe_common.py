"""Shared by the GPU probes: a synthetic component planned as `auto` plans it, its encode+pack
(group by group, as async_save snapshots) and its checked decode (as a load runs it). Engine
functions are looked up on the module at call time, so a probe may wrap them."""
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_throughput import ref_of  # noqa: E402

from ckptzip import engine  # noqa: E402
from ckptzip.codecs import _capi  # noqa: E402
from ckptzip.planner import Planner  # noqa: E402


def components(n=86 << 20):
    """The benchmark GPT's component sizes, synthetic: 343 MB fp32 and 172 MB bf16 weights."""
    torch.manual_seed(0)
    w = torch.randn(n, device="cuda") * 0.02
    return {"fp32": w, "bf16": w.bfloat16()}


def planned(t, warm=0):
    """(plan, units, destination) of tensor ``t`` planned by `auto` in GPU windows, after
    ``warm`` untimed round trips."""
    ref = ref_of(t)
    win = engine.gpu_window()
    plan = Planner("auto", "auto", 1 << 20, None, "cuda", False).plan_all([ref], win)[0]
    units, dst = engine.units_of(0, ref.data, plan, win), torch.empty_like(ref.data)
    for _ in range(warm):
        decode_all(encode_all(units), plan, dst)
    return plan, units, dst


def encode_all(units):
    """Every unit encoded and packed on the GPU: [(unit, packed buffer, rows, offsets)]."""
    out = []
    for u in units:
        buf, rel = engine.gather_gpu(engine.encode_group_arrays([u]))
        out.append((u, buf, rel, rel["offset"].astype(np.int64)))
    return out


def decode_all(packed, plan, dst):
    """Decode what :func:`encode_all` packed into ``dst``, wait for it and check the results;
    returns the perf_counter time at which the host had launched everything."""
    pos = 0
    with _capi.deferred_checks():
        for u, buf, rows, soffs in packed:
            k = u.data.numel()
            engine.decode_group(buf, soffs, rows, [(engine.Job(rows, plan.transform, plan.codec, dst), 0, len(rows),
                                                    pos, pos + k)], "cuda")
            pos += k
        launched = time.perf_counter()
        torch.cuda.synchronize()
    return launched
