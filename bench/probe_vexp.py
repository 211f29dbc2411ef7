"""Adam v's exponent plane: which GPU coder and chunk size gets closest to its local entropy."""
import json, os, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvidia import nvcomp as nv
from gpt import train, checkpoint, components
from ckptzip.transforms import BytePlane


def run(buf, cs, algorithm, **kw):
    c = nv.Codec(algorithm=algorithm, bitstream_kind=nv.BitstreamKind.RAW, **kw)
    n = buf.numel(); offs = list(range(0, n, cs)); sizes = [min(cs, n - o) for o in offs]
    cap = (int(c.get_max_comp_buffer_size(nv.as_array(buf[:cs]))) + 15) // 16 * 16
    o = torch.empty(cap * len(sizes), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    r = c.encode(nv.as_arrays(buf, offs, sizes), out=nv.as_arrays(o, [i * cap for i in range(len(sizes))], [cap] * len(sizes)))
    got = r.buffer_sizes; torch.cuda.synchronize()
    return sum(min(g, s) for g, s in zip(got, sizes)) / n, n / (time.perf_counter() - t) / 1e9


def main(state=None):
    if state is None:
        m, o, _ = train(int(os.environ.get("STEPS", "1000")))
        state = checkpoint(m, o)
    v = torch.cat([t.reshape(-1) for t in components(state)["adam v"]])
    planes = BytePlane(4, 1 << 22).encode(v.view(torch.uint8))
    nb = v.numel() // (1 << 22)
    full = planes[: nb * (4 << 22)].view(nb, 4, 1 << 22)
    exp = full[:, 3].reshape(-1).contiguous()
    p2 = full[:, 2].reshape(-1).contiguous()
    res = {}
    for cs in (128 << 10, 256 << 10, 512 << 10, 1 << 20):
        res[f"ans u1 {cs >> 10}K"] = run(exp, cs, "ANS", data_type="|u1")
        for sub in (4, 16, 64):
            try:
                res[f"ans u1 {cs >> 10}K sub{sub}"] = run(exp, cs, "ANS", data_type="|u1", max_sub_chunk_count=sub)
            except Exception as e:
                res[f"ans u1 {cs >> 10}K sub{sub}"] = str(e)[:80]
    for cs in (64 << 10, 256 << 10, 1 << 20):
        res[f"zstd {cs >> 10}K"] = run(exp, cs, "Zstd")
        for lvl in (2, 5):
            res[f"gdeflate{lvl} {cs >> 10}K"] = run(exp, cs, "GDeflate", algorithm_type=lvl)
    res["plane2 ans 1M"] = run(p2, 1 << 20, "ANS", data_type="|u1")
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
