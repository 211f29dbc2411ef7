"""Quick GPU check of ckptzip's nvCOMP codec wrappers and GPU<->CPU cross decoding."""
import torch
from ckptzip.codecs import get_codec
src = torch.randn(3 << 20, device="cuda").view(torch.uint8)
src = src[: src.numel() - 5]  # odd size
offs = list(range(0, src.numel(), 1 << 20)); sizes = [min(1 << 20, src.numel() - o) for o in offs]
offs2 = [o + 3 for o in offs[:-1]]; sizes2 = [s - 3 for s in sizes[:-1]]  # misaligned
for wid in ["ans", "zstd", "deflate", "gdeflate", "lz4", "snappy", "bitcomp", "cascaded"]:
    for oo, ss in [(offs, sizes), (offs2, sizes2)]:
        try:
            g = get_codec(wid, "cuda")
            dst, do, ds = g.encode(src, oo, ss)
            out = torch.zeros_like(src)
            g.decode(dst, do, ds, out, oo, ss)
            ok = all(torch.equal(out[o:o + s], src[o:o + s]) for o, s in zip(oo, ss))
            msg = f"{wid}: gpu roundtrip {ok} ratio {sum(ds)/sum(ss):.3f}"
            try:
                c = get_codec(wid, "cpu")
                h = torch.zeros(src.numel(), dtype=torch.uint8)
                c.decode(dst.cpu(), do, ds, h, oo, ss)
                msg += f" | gpu->cpu {all(torch.equal(h[o:o+s], src[o:o+s].cpu()) for o, s in zip(oo, ss))}"
                d2, do2, ds2 = c.encode(src.cpu(), oo, ss)
                out2 = torch.zeros_like(src)
                g.decode(d2.cuda(), do2, ds2, out2, oo, ss)
                msg += f" | cpu->gpu {all(torch.equal(out2[o:o+s], src[o:o+s]) for o, s in zip(oo, ss))}"
            except Exception as e:
                msg += f" | cpu: {type(e).__name__}: {str(e)[:80]}"
            print(msg, flush=True)
        except Exception as e:
            print(wid, "FAIL", type(e).__name__, str(e)[:200], flush=True)
