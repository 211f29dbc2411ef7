"""Exploration on a GPU: where ckptzip's GPU time goes. (1) nvCOMP ANS alone: GB/s by chunk size,
batch size and sub-chunk count, GPU time (CUDA events) vs wall time, with and without sync-free
decompression configs; what a corrupt chunk does; whether reading one batch's sizes waits for a
later batch. (2) The planned encode/decode of 1 GiB fp32 and 0.5 GiB bf16, step by step.
(3) cProfile of one async_save of a GPT-sized state.

    PYTHONPATH=src python bench/probes/probe_throughput.py   (writes $OUT/probe_tp.json)
"""
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from nvidia import nvcomp as nv  # noqa: E402

OUT = os.environ.get("OUT", ".")
res = {}


def ev_time(fn, reps=3):
    """(best GPU ms by events, best wall ms) of fn()."""
    best_g = best_w = 1e9
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        best_w = min(best_w, (time.perf_counter() - t) * 1e3)
        best_g = min(best_g, a.elapsed_time(b))
    return best_g, best_w


def planes_of(x):
    from ckptzip.transforms import BytePlane
    w = x.element_size()
    n = x.numel()
    bp = BytePlane(w, 1024)
    bp.block = n  # one block: each plane contiguous over the whole tensor
    return bp.encode(x.reshape(-1).view(torch.uint8)).view(w, n)


def ans_batch(src, cs, stream, **kw):
    """An ANS |u1 codec over ``src`` cut into ``cs``-byte chunks, with a preallocated output at
    nvCOMP's worst-case size per chunk: (codec, offsets, sizes, cap, out, out offsets, config)."""
    c = nv.Codec(algorithm="ANS", data_type="|u1", bitstream_kind=nv.BitstreamKind.RAW, cuda_stream=stream, **kw)
    offs = list(range(0, src.numel(), cs))
    sizes = [min(cs, src.numel() - x) for x in offs]
    cap = (int(c.get_max_comp_buffer_size(nv.as_array(src[:cs]))) + 15) // 16 * 16
    o = torch.empty(cap * len(sizes), dtype=torch.uint8, device="cuda")
    return c, offs, sizes, cap, o, [i * cap for i in range(len(sizes))], c.compression_config(sizes)


def ans_grid():
    torch.manual_seed(0)
    w = torch.randn(64 << 20, device="cuda") * 0.02  # 256 MB fp32
    p = planes_of(w)
    data = {"exp": p[3].contiguous(), "mant": p[2].contiguous()}
    grid = res["ans_grid"] = {}
    stream = torch.cuda.current_stream().cuda_stream
    for name, buf in data.items():
        for total in (16 << 20, 64 << 20):
            src = buf[:total]
            for cs in (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20):
                for sub in (None, 1, 4, 16):
                    kw = {} if sub is None else {"max_sub_chunk_count": sub}
                    try:
                        nv.Codec(algorithm="ANS", data_type="|u1", bitstream_kind=nv.BitstreamKind.RAW,
                                 cuda_stream=stream, **kw).get_max_comp_buffer_size(nv.as_array(src[:cs]))
                    except Exception as e:  # noqa: BLE001
                        grid[f"{name}/sub{sub}"] = repr(e)
                        continue
                    c, offs, sizes, cap, o, ooffs, cc = ans_batch(src, cs, stream, **kw)
                    box = {}

                    def enc():
                        box["r"] = c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(o, ooffs, [cap] * len(sizes)),
                                            compression_config=cc)

                    ge, we = ev_time(enc)
                    got = [int(x) for x in box["r"].buffer_sizes]
                    d = torch.empty_like(src)
                    dc = c.decompression_config(cc)

                    def dec_nocfg():
                        box["d"] = c.decode(nv.as_arrays(o, ooffs, got), out=nv.as_arrays(d, offs, sizes))

                    def dec_cfg():
                        box["d"] = c.decode(nv.as_arrays(o, ooffs, got), out=nv.as_arrays(d, offs, sizes),
                                            decompression_config=dc)

                    gd0, wd0 = ev_time(dec_nocfg)
                    gd1, wd1 = ev_time(dec_cfg)
                    ok = torch.equal(d, src)
                    key = f"{name}/{total >> 20}MB/{cs >> 10}K/sub{sub}"
                    grid[key] = {"ratio": sum(got) / total, "enc_gpu_GBps": total / ge / 1e6, "enc_wall_GBps": total / we / 1e6,
                                 "dec_gpu_GBps": total / gd0 / 1e6, "dec_wall_GBps": total / wd0 / 1e6,
                                 "dec_cfg_gpu_GBps": total / gd1 / 1e6, "dec_cfg_wall_GBps": total / wd1 / 1e6, "ok": ok}
                    print(key, grid[key], flush=True)
    res["ans_grid"] = grid
    # corrupt chunk with a preconfigured decode
    try:
        src = data["exp"][: 8 << 20]
        cs = 1 << 20
        c, offs, sizes, cap, o, ooffs, cc = ans_batch(src, cs, stream)
        r = c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(o, ooffs, [cap] * len(sizes)), compression_config=cc)
        got = [int(x) for x in r.buffer_sizes]
        out = {}
        for what, mut in (("flip_middle", lambda: o[ooffs[2] + got[2] // 2].bitwise_xor_(0x5A)),
                          ("zero_header", lambda: o[ooffs[3]:ooffs[3] + 64].zero_()),
                          ("short_size", None)):
            if mut:
                mut()
            gg = list(got)
            if what == "short_size":
                gg[4] = gg[4] // 2
            d = torch.zeros_like(src)
            try:
                rr = c.decode(nv.as_arrays(o, ooffs, gg), out=nv.as_arrays(d, offs, sizes),
                              decompression_config=c.decompression_config(cc))
                bs = [int(x) for x in rr.buffer_sizes]
                torch.cuda.synchronize()
                out[what] = {"raised": False, "sizes": bs, "equal_chunks": [bool(torch.equal(d[a:a + cs], src[a:a + cs])) for a in offs]}
            except Exception as e:  # noqa: BLE001
                out[what] = {"raised": f"{type(e).__name__}: {e}"[:300]}
            print(what, out[what], flush=True)
        res["corrupt"] = out
    except Exception as e:  # noqa: BLE001
        res["corrupt"] = str(e)
    # does reading batch A's sizes wait for a later batch B?
    src = data["mant"][: 64 << 20]
    c, offs, sizes, cap, oa, ooffs, _cc = ans_batch(src, 1 << 20, stream)
    ob = torch.empty_like(oa)
    torch.cuda.synchronize()
    ra = c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(oa, ooffs, [cap] * len(sizes)))
    rb = c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(ob, ooffs, [cap] * len(sizes)))
    for _ in range(20):
        rb = c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(ob, ooffs, [cap] * len(sizes)))
    t = time.perf_counter()
    _ = ra.buffer_sizes
    ta = time.perf_counter() - t
    t = time.perf_counter()
    _ = rb.buffer_sizes
    tb = time.perf_counter() - t
    res["sizes_wait"] = {"first_batch_sizes_ms": ta * 1e3, "after_it_ms": tb * 1e3}
    print("sizes_wait", res["sizes_wait"], flush=True)


def grid2():
    """Large batches (256 MB of plane bytes per call) on 1 GiB fp32 / bf16 planes."""
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    p = planes_of(w)
    pb = planes_of(w.bfloat16())
    data = {"exp": (p[3], (64 << 10, 128 << 10, 256 << 10, 1 << 20)), "mant": (p[2], (256 << 10, 1 << 20)),
            "bf16lo": (pb[0], (256 << 10, 1 << 20))}
    grid = res["grid2"] = {}
    stream = torch.cuda.current_stream().cuda_stream
    for name, (src, css) in data.items():
        src = src.contiguous()
        total = src.numel()
        for cs in css:
            for sub in (None, 4, 16):
                kw = {} if sub is None else {"max_sub_chunk_count": sub}
                c, offs, sizes, cap, o, ooffs, cc = ans_batch(src, cs, stream, **kw)
                box = {}
                ge, we = ev_time(lambda: box.__setitem__("r", c.encode(nv.as_arrays(src, offs, sizes), out=nv.as_arrays(o, ooffs, [cap] * len(sizes)), compression_config=cc)))
                got = [int(x) for x in box["r"].buffer_sizes]
                d = torch.empty_like(src)
                dc = c.decompression_config(cc)
                gd, wd = ev_time(lambda: c.decode(nv.as_arrays(o, ooffs, got), out=nv.as_arrays(d, offs, sizes), decompression_config=dc))
                key = f"{name}/{total >> 20}MB/{cs >> 10}K/sub{sub}"
                grid[key] = {"ratio": sum(got) / total, "enc_GBps": total / ge / 1e6, "enc_wall": total / we / 1e6,
                             "dec_cfg_GBps": total / gd / 1e6, "dec_cfg_wall": total / wd / 1e6, "ok": torch.equal(d, src)}
                print(key, grid[key], flush=True)


def pipeline():
    from ckptzip.engine import encode_group_arrays, gpu_window, units_of
    from ckptzip.engine import Planner
    from ckptzip.transforms import BytePlane
    from gpu_throughput import measure, ref_of
    torch.manual_seed(0)
    w = torch.randn(256 << 20, device="cuda") * 0.02
    out = {}
    for name, t in (("fp32 1GiB", w), ("bf16 0.5GiB", w.bfloat16())):
        r = {"measure": measure(t)}
        raw = t.reshape(-1).view(torch.uint8)
        tf = BytePlane(t.element_size(), (16 << 20) // t.element_size())
        dst = torch.empty_like(raw)
        r["triton_encode_ms"] = ev_time(lambda: tf.encode(raw, out=dst))
        back = torch.empty_like(raw)
        r["triton_decode_ms"] = ev_time(lambda: tf.decode(dst, back))
        r["copy_ms"] = ev_time(lambda: back.copy_(raw))
        ref = ref_of(t)
        win = gpu_window()
        plan = Planner("auto", "auto", 1 << 20, None, "cuda", False).plan_all([ref], win)[0]
        units = units_of(0, ref.data, plan, win)
        r["window"] = win
        r["n_units"] = len(units)
        r["chunks_per_unit"] = [len(u.sizes) for u in units][:3]
        pr = cProfile.Profile()
        pr.enable()
        g, wl = ev_time(lambda: [encode_group_arrays([u]) for u in units], reps=2)
        pr.disable()
        r["encode_groups_ms"] = (g, wl)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(18)
        r["encode_profile"] = s.getvalue()[-4000:]
        out[name] = r
        print(name, {k: v for k, v in r.items() if k != "encode_profile"}, flush=True)
        print(r["encode_profile"], flush=True)
    res["pipeline"] = out


def real():
    """Trained GPT components: measure() per component, and a torch.profiler view of one pass."""
    from gpt import checkpoint, components, train
    from gpu_throughput import measure
    from torch.profiler import ProfilerActivity, profile
    steps = int(os.environ.get("STEPS", "300"))
    model, opt, _ = train(steps, log=lambda *a: None)
    state = checkpoint(model, opt)
    out = res["real"] = {}
    for name, ts in components(state).items():
        cat = torch.cat([t.reshape(-1) for t in ts])
        r = measure(cat)
        out[name] = r
        print(name, {k: r[k] for k in ("ratio", "compress_GBps", "decompress_GBps", "raw_planes", "plane_chunks")}, flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            measure(cat, reps=1)
            torch.cuda.synchronize()
        tab = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60)
        out[name]["prof"] = tab
        print(tab, flush=True)
    res["real_state"] = state


def stall():
    import ckptzip
    from gpt import GPT
    state = res.pop("real_state", None)
    if state is None:
        torch.manual_seed(0)
        model = GPT().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            x = torch.randint(0, 256, (4, 128), device="cuda")
            with torch.autocast("cuda", torch.bfloat16):
                loss = model(x).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        sd = model.state_dict()
        state = {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "optimizer": opt.state_dict()}
    os.makedirs("/tmp/probe", exist_ok=True)
    from ckptzip import asyncsave
    phases = {"prepare": [], "snapshot": []}

    def wrap(name, fn):
        def f(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            phases[name].append(time.perf_counter() - t)
            return r
        return f
    asyncsave.prepare = wrap("prepare", asyncsave.prepare)
    asyncsave._snapshot = wrap("snapshot", asyncsave._snapshot)
    from ckptzip import pipeline, transforms
    from ckptzip.engine import encode as engine_encode
    from ckptzip.codecs import gpu as gpuc
    for name, mod, attr in (("encode_group", asyncsave, "encode_group_arrays"), ("gather_gpu", asyncsave, "gather_gpu"),
                            ("tree_encode", pipeline.Encoder, "encode"), ("plan_all", pipeline.Planner, "plan_all"),
                            ("units_of", pipeline, "units_of"), ("nvcomp_encode", gpuc.NvcompCodec, "encode"),
                            ("byteplane_encode", transforms.BytePlane, "encode"),
                            ("foreach_copy", engine_encode.torch, "_foreach_copy_")):
        phases[name] = []
        orig = getattr(mod, attr)

        def timed_fn(*a, _o=orig, _n=name, **k):
            if _n == "tree_encode" and len(a) > 2:  # time only the outermost call
                return _o(*a, **k)
            t = time.perf_counter()
            r = _o(*a, **k)
            phases[_n].append(time.perf_counter() - t)
            return r
        setattr(mod, attr, timed_fn)
    times = []
    for i in range(6):
        if i == 5:
            for v in phases.values():
                v.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = ckptzip.async_save(state, f"/tmp/probe/s{i}.ckz")
        torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t)
        h.wait()
    summary = {k: (len(v), round(sum(v) * 1e3, 2)) for k, v in phases.items()}
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    h = ckptzip.async_save(state, "/tmp/probe/s.ckz")
    pr.disable()
    h.wait()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    res["stall"] = {"times_s": times, "last_save_phases_count_ms": summary, "profile_tottime": s.getvalue()[-6000:]}
    print("stall times", res["stall"]["times_s"], "\nlast save phases (calls, ms):", summary, flush=True)


if __name__ == "__main__":
    for part in sys.argv[1:] or ["grid", "pipeline", "stall"]:
        try:
            {"grid": ans_grid, "grid2": grid2, "real": real, "pipeline": pipeline, "stall": stall}[part]()
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res[part + "_error"] = repr(e)
        with open(os.path.join(OUT, "probe_tp.json"), "w") as f:
            json.dump({k: v for k, v in res.items() if k != "real_state"}, f, indent=1, default=str)
