"""Exploration on a GPU: where nvCOMP's RAW ANS bitstream records a chunk's uncompressed size
(so a reader can check declared sizes on the host before a sync-free decode), and what a
sync-free decode does when the configured size disagrees with the stream (guard bytes).

    PYTHONPATH=src python bench/probe_ans_header.py
"""
import torch
from nvidia import nvcomp as nv


def enc(c, xs):
    cap = max(int(c.get_max_comp_buffer_size(nv.as_array(x))) for x in xs)
    cap = (cap + 15) // 16 * 16
    offs, pos = [], 0
    for x in xs:
        offs.append(pos)
        pos += (x.numel() + 15) // 16 * 16
    src = torch.zeros(pos, dtype=torch.uint8, device="cuda")
    for o, x in zip(offs, xs):
        src[o:o + x.numel()] = x
    out = torch.empty(cap * len(xs), dtype=torch.uint8, device="cuda")
    r = c.encode(nv.as_arrays(src, offs, [x.numel() for x in xs]), out=nv.as_arrays(out, [i * cap for i in range(len(xs))], [cap] * len(xs)))
    got = [int(s) for s in r.buffer_sizes]
    return [out[i * cap:i * cap + g].clone() for i, g in enumerate(got)]


def main():
    torch.manual_seed(0)
    for dt in ("|u1", "<f2", "<f4"):
        c = nv.Codec(algorithm="ANS", data_type=dt, bitstream_kind=nv.BitstreamKind.RAW)
        sizes = [16, 1000, 4096, 65536, 65552, 131072, 1 << 20, (3 << 20) + 4, 16 << 20]
        for kind in ("zeros", "rand", "exp"):
            xs = []
            for n in sizes:
                if kind == "zeros":
                    x = torch.zeros(n, dtype=torch.uint8, device="cuda")
                elif kind == "rand":
                    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
                else:
                    x = (torch.randn(n, device="cuda") * 3 + 120).clamp(0, 255).to(torch.uint8)
                xs.append(x)
            comp = enc(c, xs)
            for n, cb in zip(sizes, comp):
                h = cb[:32].cpu().numpy()
                print(dt, kind, n, len(cb), h.tobytes().hex(" ", 4), flush=True)
    # sync-free decode with a configured size smaller / larger than the stream's
    c = nv.Codec(algorithm="ANS", data_type="|u1", bitstream_kind=nv.BitstreamKind.RAW)
    x = (torch.randn(1 << 20, device="cuda") * 3 + 120).clamp(0, 255).to(torch.uint8)
    (cb,) = enc(c, [x])
    for claim in (1 << 19, (1 << 20) + 4096):
        out = torch.full((claim + 65536,), 7, dtype=torch.uint8, device="cuda")
        try:
            dc = c.decompression_config(c.compression_config([claim]))
            r = c.decode(nv.as_arrays(cb, [0], [cb.numel()]), out=nv.as_arrays(out, [0], [claim]), decompression_config=dc)
            got = [int(s) for s in r.buffer_sizes]
            torch.cuda.synchronize()
            guard_ok = bool((out[claim:] == 7).all())
            print("claim", claim, "reported", got, "guard intact", guard_ok, "prefix equal",
                  bool(torch.equal(out[:min(claim, x.numel())], x[:min(claim, x.numel())])), flush=True)
        except Exception as e:
            print("claim", claim, "error", repr(e), flush=True)
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print("context after claim", claim, repr(e), flush=True)
            return


if __name__ == "__main__":
    main()
