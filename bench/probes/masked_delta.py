"""Probe (not a benchmark): how much of the fp32 weights' delta gain sits in the upper bytes,
and how many base bytes a load must read, per variant. Order-0 entropy per byte plane.

    cd bench/probes && python3 masked_delta.py bench 300 100     # H100: the issue 13 state
    cd bench/probes && python3 masked_delta.py small 100 50      # CPU

Result and conclusion: docs/benchmarks.md, thirteenth session, "What an incremental load must
read"; data: docs/data/masked_delta_h100_s13.json."""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from incremental_bench import DIMS, train_pair

dev = "cuda" if torch.cuda.is_available() else "cpu"
dims = sys.argv[1] if len(sys.argv) > 1 else ("bench" if dev == "cuda" else "small")
s1, s2 = train_pair(dev, DIMS[dims], int(sys.argv[2]) if len(sys.argv) > 2 else 300, int(sys.argv[3]) if len(sys.argv) > 3 else 100)
M = 0xFFFFFFFF

def planes(u):  # u: int64 tensor holding uint32 words -> 4 byte planes (after rotl 1)
    r = ((u << 1) | (u >> 31)) & M
    return [((r >> (8 * k)) & 255) for k in range(4)]

def ent(p):  # order-0 entropy bits/byte
    h = torch.bincount(p.flatten(), minlength=256).double()
    q = h[h > 0] / h.sum()
    return float(-(q * q.log2()).sum()) / 8

def fold(d, bits):  # sign-folded, as ckptzip's delta
    top = d >> (bits - 1) & 1
    return d ^ (top * ((1 << (bits - 1)) - 1))

acc = {}
tot = 0
for k in s2["model"]:
    x = s2["model"][k].float().flatten().view(torch.int32).to(torch.int64) & M
    b = s1["model"][k].float().flatten().view(torch.int32).to(torch.int64) & M
    n = x.numel(); tot += n
    v = {}
    v["standalone"] = planes(x)
    v["xor"] = planes(x ^ b)
    v["delta"] = planes(fold((x - b) & M, 32))
    # what a base can supply from its top planes only (byteplane rotates left by one bit, so
    # planes 2-3 hold bits 15-30 and planes 1-3 bits 7-30: the sign is in plane 0)
    for bits, mask in ((16, 0x7FFF8000), (24, 0x7FFFFF80)):
        bm = b & mask
        v[f"xor mask{bits}"] = planes(x ^ bm)
        v[f"delta mask{bits}"] = planes(fold((x - bm) & M, 32))
    rot = lambda u: ((u << 1) | (u >> 31)) & M
    R, B = rot(x), rot(b)
    for bits in (16, 24):  # the difference of the rotated words' top bits (sign now in bit 0)
        lo = 32 - bits
        hi = fold(((R >> lo) - (B >> lo)) & ((1 << bits) - 1), bits)
        w = (hi << lo) | (R & ((1 << lo) - 1))
        v[f"rot-delta top{bits}"] = [((w >> (8 * k)) & 255) for k in range(4)]
    for name, ps in v.items():
        a = acc.setdefault(name, [0.0] * 4)
        for i, p in enumerate(ps):
            a[i] += ent(p) * n
out = {name: [round(e / tot, 4) for e in a] for name, a in acc.items()}
base = out["standalone"]
res = {}
for name, e in out.items():
    ratio = sum(e) / 4
    need = {"standalone": 0, "xor": 4, "delta": 4, "xor mask16": 2, "delta mask16": 2, "xor mask24": 3, "delta mask24": 3, "rot-delta top16": 2, "rot-delta top24": 3}[name]
    base_read = sum(base[4 - need:]) / 4  # planes 3 (top) down: what the base must supply, as stored bytes per raw byte
    res[name] = {"planes 0..3": e, "ratio": round(ratio, 4), "base bytes read per raw byte": round(base_read, 4)}
print(json.dumps({"device": dev, "dims": dims, "fp32 weight words": tot, "variants": res}, indent=1))
for k, v in res.items():
    print(f"{k:14s}", v["planes 0..3"], v["ratio"], v["base bytes read per raw byte"])
