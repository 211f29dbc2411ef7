"""Exploration on a GPU: nvCOMP alignment, ratios per chunk size and layout, cross decoding."""
import json, os, sys, time
import torch
sys.path.insert(0, os.path.dirname(__file__))
from gpt import train, checkpoint, components
from nvidia import nvcomp as nv
from ckptzip.transforms import BytePlane

out = {}
def cat(ts):
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])

def entropy(b):  # order-0 entropy in bits/byte
    h = torch.bincount(b.long(), minlength=256).double(); p = h[h > 0] / b.numel()
    return float(-(p * p.log2()).sum())

def chunked_entropy(b, cs):
    n = b.numel() // cs * cs
    if n == 0: return entropy(b)
    v = b[:n].view(-1, cs).long()
    tot = 0.0
    for r in v: tot += entropy(r) * cs
    return tot / n

def ans_ratio(buf, cs, dt="|u1", algo="ANS", **kw):
    c = nv.Codec(algorithm=algo, bitstream_kind=nv.BitstreamKind.RAW, **({"data_type": dt} if dt else {}), **kw)
    n = buf.numel(); offs = list(range(0, n, cs)); sizes = [min(cs, n - o) for o in offs]
    cap = (int(c.get_max_comp_buffer_size(nv.as_array(buf[:cs]))) + 15) // 16 * 16
    o = torch.empty(cap * len(sizes), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    r = c.encode(nv.as_arrays(buf, offs, sizes), out=nv.as_arrays(o, [i * cap for i in range(len(sizes))], [cap] * len(sizes)))
    got = r.buffer_sizes; torch.cuda.synchronize(); te = time.perf_counter() - t
    # decode
    d = torch.empty_like(buf)
    torch.cuda.synchronize(); t = time.perf_counter()
    r2 = c.decode(nv.as_arrays(o, [i * cap for i in range(len(sizes))], got), out=nv.as_arrays(d, offs, sizes))
    _ = r2.buffer_sizes; torch.cuda.synchronize(); td = time.perf_counter() - t
    assert torch.equal(d, buf)
    return sum(min(g, s) for g, s in zip(got, sizes)) / n, n / te / 1e9, n / td / 1e9

steps = int(os.environ.get("STEPS", "300"))
model, opt, _ = train(steps)
state = checkpoint(model, opt)
for name, ts in components(state).items():
    raw = cat(ts)
    w = 2 if "bf16" in name else 4
    bp = BytePlane(w, 1024); bp.block = raw.numel() // w  # one block: planes over the whole component
    planes = bp.encode(raw).view(w, -1)
    res = {"bytes": raw.numel(), "plane_entropy": [entropy(p) for p in planes]}
    res["bound"] = sum(res["plane_entropy"]) / (8 * w)
    res["exp_plane_chunk_entropy"] = {cs: chunked_entropy(planes[w - 1], cs) / 8 for cs in (4096, 16384, 65536, 262144)}
    for cs in (65536, 262144, 1 << 20):
        res[f"ans_raw_{'f2' if w == 2 else 'f4'}_{cs}"] = ans_ratio(raw, cs, "<f2" if w == 2 else "<f4")
        per = [ans_ratio(p.contiguous(), cs) for p in planes]
        res[f"bp_ans_u1_{cs}"] = (sum(r[0] for r in per) / w, per)
    for cs in (4096, 16384, 65536):
        res[f"exp_plane_ans_{cs}"] = ans_ratio(planes[w - 1].contiguous(), cs)
    res["exp_plane_zstd_gpu_64k"] = ans_ratio(planes[w - 1].contiguous(), 65536, None, "Zstd")
    import zstandard
    ep = planes[w - 1].cpu().numpy().tobytes()[: 8 << 20]
    res["exp_plane_zstd_cpu_l3_8MB"] = len(zstandard.ZstdCompressor(level=3).compress(ep)) / len(ep)
    res["exp_plane_zstd_cpu_l19_8MB"] = len(zstandard.ZstdCompressor(level=19).compress(ep)) / len(ep)
    out[name] = res
    print(name, json.dumps(res, default=str)[:3000], flush=True)

# alignment and cross-decoding
for algo in ["ANS", "Zstd", "Deflate", "LZ4", "Bitcomp", "Cascaded", "GDeflate", "Snappy"]:
    try:
        c = nv.Codec(algorithm=algo, bitstream_kind=nv.BitstreamKind.RAW)
        out[f"align_{algo}"] = (c.get_required_compression_alignment(), c.get_required_decompression_alignment(),
                               int(c.get_max_comp_buffer_size(nv.as_array(torch.empty(1 << 24, dtype=torch.uint8, device='cuda')))))
    except Exception as e:
        out[f"align_{algo}"] = str(e)
print(json.dumps({k: v for k, v in out.items() if k.startswith("align")}))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), default=str, indent=1)
