"""GPU tests (marked ``gpu``; skipped without a CUDA GPU and nvCOMP)."""

import numpy as np
import pytest
import torch

import ckptzip
from ckptzip.codecs import registered
from conftest import same_bits

pytestmark = pytest.mark.gpu
GPU_CODECS = [w for w, d in registered().items() if "cuda" in d]


def state(device="cuda", n=1_500_000):
    torch.manual_seed(0)
    w = torch.randn(n, device=device) * 0.02
    return {"w": w, "w_bf16": w.bfloat16(), "m": w * 1e-3, "v": (w * 1e-3) ** 2 + 1e-12,
            "i": torch.arange(1000, device=device), "f8": w[:4096].to(torch.float8_e4m3fn),
            "odd": torch.randn(1001, device=device).half()[1:], "empty": torch.empty(0, device=device),
            "cpu": torch.randn(3000)}


@pytest.mark.parametrize("codec", GPU_CODECS + ["auto"])
def test_save_load_every_codec(tmp_path, codec):
    s = state()
    before = {k: v.clone() for k, v in s.items()}
    p = tmp_path / f"{codec}.ckz"
    kw = {"transform": None} if codec in ("bitcomp", "cascaded") else {}
    ckptzip.save(s, p, codec=codec, device="cuda", **kw)
    for k in s:
        assert same_bits(s[k], before[k]), "caller's tensor modified"
    back = ckptzip.load(p, map_location="cuda")
    for k, v in s.items():
        assert back[k].device.type == "cuda"
        assert same_bits(back[k], v), k
    back_cpu = ckptzip.load(p, map_location="cpu")
    assert same_bits(back_cpu["w"], s["w"])


@pytest.mark.parametrize("codec", ["zstd", "deflate"])
def test_gpu_written_standard_file_decodes_on_cpu(tmp_path, codec):
    s = state()
    p = tmp_path / "p.ckz"
    ckptzip.save(s, p, codec=codec, device="cuda")
    back = ckptzip.load(p, map_location="cpu", decode_device="cpu")
    for k, v in s.items():
        assert same_bits(back[k], v), k
    q = tmp_path / "q.ckz"
    ckptzip.save(back, q, codec=codec, device="cpu")
    back2 = ckptzip.load(q, map_location="cuda", decode_device="cuda")
    assert same_bits(back2["w"], s["w"])


def test_auto_records_choice_and_portable(tmp_path):
    s = state()
    p = tmp_path / "a.ckz"
    ckptzip.save(s, p)
    with ckptzip.open(p) as r:
        ids = {st["codec"]["id"] for st in r.storages}
        assert "ans" in ids
        assert any("choice" in st for st in r.storages)
    q = tmp_path / "port.ckz"
    ckptzip.save(s, q, portable=True)
    with ckptzip.open(q) as r:
        assert {st["codec"]["id"] for st in r.storages} <= {"deflate", "raw"}
    back = ckptzip.load(q, map_location="cpu", decode_device="cpu")
    assert same_bits(back["v"], s["v"])


def test_convert_gpu_only_to_zstd(tmp_path):
    from ckptzip.cli import main
    s = state()
    p, q = tmp_path / "a.ckz", tmp_path / "z.ckz"
    ckptzip.save(s, p, codec="ans")
    assert main(["convert", str(p), str(q), "--codec", "zstd", "-q"]) == 0
    back = ckptzip.load(q, map_location="cpu", decode_device="cpu")
    assert same_bits(back["w"], s["w"].cpu())


def test_peak_gpu_memory_bounded(tmp_path):
    big = torch.randn(256 << 20)  # 1 GiB of fp32 on the host
    p = tmp_path / "big.ckz"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ckptzip.save({"x": big}, p, fsync=False)
    peak_save = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    back = ckptzip.load(p, map_location="cpu")
    peak_load = torch.cuda.max_memory_allocated() - base
    assert same_bits(back["x"], big)
    budget = min(1 << 30, torch.cuda.mem_get_info()[0] // 10)
    print(f"peak extra GPU memory: save {peak_save / 2**20:.0f} MiB, load {peak_load / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
    assert peak_save <= budget and peak_load <= budget


def test_peak_gpu_memory_bounded_gpu_state_mixed_chunks(tmp_path):
    """GPU-resident tensors whose plans mix 64 KiB exponent chunks with 1 MiB ones (as Adam's v
    gets): small and large chunks get separate nvCOMP calls, so output slots are not all sized
    for the largest chunk."""
    torch.manual_seed(0)
    st = {"v": (torch.randn(96 << 20, device="cuda") * 1e-3) ** 2,
          "w": (torch.randn(64 << 20, device="cuda") * 0.02).bfloat16()}
    p = tmp_path / "g.ckz"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ckptzip.save(st, p, fsync=False)
    peak_save = torch.cuda.max_memory_allocated() - base
    budget = min(1 << 30, torch.cuda.mem_get_info()[0] // 10)
    back = ckptzip.load(p, map_location="cuda")
    assert all(same_bits(back[k], st[k]) for k in st)
    print(f"peak extra GPU memory during save: {peak_save / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
    assert peak_save <= budget


@pytest.mark.parametrize("kw", [{"portable": True}, {"codec": "zstd"}, {"codec": "deflate"}])
def test_peak_gpu_memory_bounded_standard_codecs(tmp_path, kw):
    """Saves in CPU-readable codecs stay in the budget, nvCOMP's scratch included (it is handed
    back at the end of every save, so each save counts it): portable = byte planes through
    Deflate's entropy-only algorithm (no scratch); GPU Zstd in 16 KiB chunks, calls cut at
    32 MiB (its scratch is over 1 GiB at 64 KiB chunks)."""
    from ckptzip.codecs import _capi
    torch.manual_seed(0)
    st = {"v": (torch.randn(96 << 20, device="cuda") * 1e-3) ** 2,
          "w": (torch.randn(64 << 20, device="cuda") * 0.02).bfloat16(),
          "i": torch.arange(1 << 20, device="cuda")}
    p = tmp_path / "s.ckz"
    budget = min(1 << 30, torch.cuda.mem_get_info()[0] // 10)
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ckptzip.save(st, p, fsync=False, **kw)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        print(f"{kw}: peak extra GPU memory {peak / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
        assert peak <= budget
        assert not _capi._TEMP and torch.cuda.memory_allocated() <= base
    with ckptzip.open(p) as r:
        ids = {s_["codec"]["id"] for s_ in r.storages}
    assert ids <= {kw.get("codec", "deflate"), "raw"}, ids
    back = ckptzip.load(p, map_location="cpu", decode_device="cpu")
    assert all(same_bits(back[k], st[k].cpu()) for k in st)
    back = ckptzip.load(p, map_location="cuda")
    assert all(same_bits(back[k], st[k]) for k in st)


@pytest.mark.parametrize("algorithm", [0, 1, 2])
def test_gpu_deflate_algorithms_are_standard_streams(algorithm):
    """Every nvCOMP Deflate algorithm writes raw deflate streams that zlib decodes."""
    import zlib
    from ckptzip.codecs.base import get_codec
    torch.manual_seed(1)
    data = torch.cat([(torch.randn(1 << 18) * 3 + 120).clamp(0, 255).to(torch.uint8),
                      torch.randint(0, 256, (100_000,), dtype=torch.uint8),
                      torch.zeros(70_000, dtype=torch.uint8)]).cuda()
    c = get_codec("deflate", "cuda", algorithm=algorithm)
    offs = [0, 65536, 1 << 18, (1 << 18) + 100_000]
    sizes = [65536, (1 << 18) - 65536, 100_000, 70_000]
    out, o, n = c.encode(data, offs, sizes)
    host = out.cpu().numpy().tobytes()
    for a, k, oo, nn in zip(offs, sizes, o.tolist(), n.tolist()):
        got = zlib.decompress(host[oo:oo + nn], -15)
        assert got == data[a:a + k].cpu().numpy().tobytes()
    dst = torch.empty_like(data)
    c.decode(out, o, n, dst, offs, sizes)
    assert torch.equal(dst, data)


def test_bad_stream_is_an_exception_not_a_crash(tmp_path):
    from conftest import read_parts, write_parts
    from ckptzip import format as fmt
    p = tmp_path / "a.ckz"
    ckptzip.save({"w": torch.randn(300_000, device="cuda")}, p, codec="ans")
    data, doc, rows = read_parts(p)
    r = rows[0]
    off, n = int(r["offset"]), int(r["stored"])
    if r["flags"]:
        pytest.skip("first chunk stored raw")
    junk = bytes((i * 131 + 7) & 0xFF for i in range(n))
    data = data[:off] + junk + data[off + n:]
    rows[0]["xxh3"] = fmt.checksum(junk)
    write_parts(p, data, doc, rows)
    with pytest.raises(ckptzip.CkptzipError):
        ckptzip.load(p, map_location="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n,block", [(0, 8), (1, 8), (1000, 64), (100_003, 4096), (3 << 20, 1 << 20)])
def test_triton_byteplane_matches_torch(dtype, n, block):
    from ckptzip import transforms
    from ckptzip.kernels import triton_kernels
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    x = torch.randn(n, device="cuda").to(dtype).view(torch.uint8)
    bp = transforms.BytePlane(dtype.itemsize, block)
    gpu = bp.encode(x)
    cpu = bp.encode(x.cpu())
    assert torch.equal(gpu.cpu(), cpu)
    out = torch.empty_like(x)
    bp.decode(gpu, out)
    assert torch.equal(out, x)


@pytest.mark.parametrize("claim", [1 << 16, 1 << 20, 1 << 24, 0xFFFFFFFF])
def test_ans_chunk_claiming_a_larger_size_is_an_exception(tmp_path, claim):
    """nvCOMP 6.0 ANS chunks start with their uncompressed size (uint32 LE); a chunk that claims
    more than its table row declares (checksum fixed up, so only the codec can tell) must be
    refused by the C-API decode path, not written past its output or crash."""
    import struct
    from conftest import read_parts, write_parts
    from ckptzip import format as fmt
    p = tmp_path / "a.ckz"
    ckptzip.save({"w": torch.randn(300_000, device="cuda")}, p, codec="ans")
    data, doc, rows = read_parts(p)
    k = next(i for i in range(len(rows)) if not rows[i]["flags"])
    off, n = int(rows[k]["offset"]), int(rows[k]["stored"])
    chunk = bytearray(data[off:off + n])
    (have,) = struct.unpack_from("<I", chunk, 0)
    assert have == int(rows[k]["raw"])
    struct.pack_into("<I", chunk, 0, max(claim, have + 16) & 0xFFFFFFFF)
    data = data[:off] + bytes(chunk) + data[off + n:]
    rows[k]["xxh3"] = fmt.checksum(bytes(chunk))
    write_parts(p, data, doc, rows)
    with pytest.raises(ckptzip.CkptzipError):
        ckptzip.load(p, map_location="cuda")
    q = tmp_path / "b.ckz"  # the device and the process are still sound
    x = torch.randn(100_000, device="cuda")
    ckptzip.save({"x": x}, q, codec="ans")
    assert same_bits(ckptzip.load(q, map_location="cuda")["x"], x)


@pytest.mark.parametrize("gpu_snapshot_bytes", [None, 1])
def test_async_save_gpu_state(tmp_path, gpu_snapshot_bytes):
    """async_save of CUDA tensors: the snapshot is the GPU compression (default: kept on the GPU,
    no host arena reserved; ``gpu_snapshot_bytes=1``: every group copied to the host in the
    call); the state changes right after the call; the file holds it as it was, and every
    pinned buffer the writer leased is given back."""
    from ckptzip.asyncsave import Arena, snapshot
    from ckptzip.engine import PINNED
    s = state()
    before = {k: v.clone() for k, v in s.items()}
    arena = Arena()
    snap = snapshot(s, device="cuda", arena=arena, gpu_snapshot_bytes=gpu_snapshot_bytes)
    if gpu_snapshot_bytes is None:
        assert arena.capacity <= (1 << 20), arena.capacity  # only the small CPU tensor's bytes
    for v in s.values():
        if v.numel():
            v.view(torch.uint8).bitwise_not_()
    snap.write(tmp_path / "a.ckz")
    assert PINNED.outstanding() == 0
    back = ckptzip.load(tmp_path / "a.ckz", map_location="cuda")
    for k, v in before.items():
        assert same_bits(back[k], v), k
    h = ckptzip.async_save(before, tmp_path / "b.ckz", device="cuda", gpu_snapshot_bytes=gpu_snapshot_bytes)
    h.wait()
    back = ckptzip.load(tmp_path / "b.ckz", map_location="cpu")
    for k, v in before.items():
        assert same_bits(back[k], v), k


def _adam_state():
    """A model state with Adam's moments: large (6 MiB) and small float32 storages, their bfloat16
    copies, step counters, odd-sized and offset views, ints."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.LayerNorm(1536), torch.nn.Linear(1536, 3)).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(2):
        net(torch.randn(8, 1024, device="cuda")).square().sum().backward()
        opt.step()
    sd = net.state_dict()
    w = sd["0.weight"]
    return {"model": sd, "bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()}, "optimizer": opt.state_dict(),
            "i8": torch.arange(7, dtype=torch.int8, device="cuda"), "view": w[1:, 3:5],
            "i16": torch.randint(0, 9, (333,), dtype=torch.int16, device="cuda")[1:],
            "f16": torch.randn(1001, device="cuda").half()[1:], "cpu": torch.randn(3000)}


@pytest.mark.usefixtures("no_pack")
@pytest.mark.parametrize("chunk_size", [1 << 20, 4096])
def test_snapshot_launch_policy_writes_the_same_bytes(tmp_path, monkeypatch, chunk_size):
    """An async snapshot's encoding (``large_alone=False``: large storages in the multi-segment
    launches) packs exactly the bytes and rows of a save's (one-storage kernels), and the small
    units without a transform (on the GPU, or on the host and uploaded together) copied by one
    ``copy_segments`` launch exactly what torch's copies give where that kernel is unavailable.
    Large storages join the multi-segment launches only with ``large_alone=False``; a kernel
    that raises turns its family off, and the torch way writes the same bytes."""
    from ckptzip.engine import encode as enc_mod, gather_gpu
    from ckptzip import kernels as kmod
    from ckptzip.kernels import MULTI_MAX, enabled, triton_kernels
    from ckptzip.pipeline import prepare
    tk = triton_kernels(wait=True)
    if tk is None:
        pytest.skip("no Triton")
    s = _adam_state()
    prep = prepare(s, "auto", "auto", chunk_size, None, None, False, "cuda", False, None, None)
    gpu = [g for g in prep.groups if g[0].plan.codec.device == "cuda"]
    assert any(u.data.numel() >= MULTI_MAX for g in gpu for u in g)
    assert sum(u.plan.transform is None and 0 < u.data.numel() < MULTI_MAX for g in gpu for u in g) >= 5
    # host units in GPU groups (Adam's step counters), uploaded together for the copy kernel
    assert sum(u.plan.transform is None and u.data.device.type == "cpu" for g in gpu for u in g) >= 2

    def packed(grp, **kw):
        buf, rows = gather_gpu(enc_mod.encode_group_arrays(grp, **kw))
        return buf.cpu(), rows

    real = enc_mod.launch
    ran: list = []
    packed_want: dict = {}
    # large_alone -> the largest segment of a multi-segment launch whose chain also has a
    # one-storage kernel (byte planes alone or after xor / delta / expref / hidelta)
    largest = {False: 0, True: 0}
    alone_modes = (kmod.PLAIN, kmod.PLAIN16, kmod.XOR, kmod.DELTA, kmod.EXPREF, kmod.HIDELTA)
    alone = [True]

    def counted(fam, k, *a):  # every launch must run: a failed one turns its family off
        ok = real(fam, k, *a)
        assert ok, (fam, k)
        ran.append(k == tk.copy_segments)
        if k == tk.encode_multi and a[-2] in alone_modes and a[-1]:  # (stream, soffs, doffs, roffs,
            largest[alone[0]] = max(largest[alone[0]], int(np.max(a[4])) * a[-3])  # nwords, ..., width, mode, planes)
        return ok
    for grp in gpu:
        monkeypatch.setattr(enc_mod, "launch", counted)
        alone[0] = True
        want_buf, want_rows = packed_want[id(grp)] = packed(grp)
        for kw, copy_kernel in (({"large_alone": False}, True), ({}, False), ({"large_alone": False}, False)):
            alone[0] = kw.get("large_alone", True)
            monkeypatch.setattr(enc_mod, "launch", counted if copy_kernel else
                                lambda fam, k, *a: False if k == tk.copy_segments else counted(fam, k, *a))
            buf, rows = packed(grp, **kw)
            assert torch.equal(buf, want_buf) and (rows == want_rows).all(), (kw, copy_kernel)
    monkeypatch.setattr(enc_mod, "launch", real)
    assert any(ran) and not all(ran)  # the copy kernel and the multi-segment ones ran
    assert enabled("encode_multi")
    # large storages join the multi-segment launches only where asked (large_alone=False)
    assert largest[False] >= MULTI_MAX > largest[True], largest
    # a kernel that really fails (not a refused launch): its family is turned off and every
    # unit takes the torch way, with the same bytes
    def broken(*a, **k):
        raise RuntimeError("simulated Triton failure")
    for name in ("copy_segments", "encode_multi"):
        try:
            for grp in gpu:
                monkeypatch.setattr(tk, name, broken)
                enc = enc_mod.encode_group_arrays(grp, large_alone=False)
                monkeypatch.undo()  # (packing calls copy_segments itself)
                buf, rows = gather_gpu(enc)
                assert torch.equal(buf.cpu(), packed_want[id(grp)][0]), name
                assert (rows == packed_want[id(grp)][1]).all(), name
            assert not enabled("encode_multi")
        finally:
            monkeypatch.undo()
            kmod._OFF.discard("encode_multi")
    assert enabled("encode_multi")
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
    ckptzip.async_save(s, tmp_path / "a.ckz", chunk_size=chunk_size).wait()
    back = ckptzip.load(tmp_path / "a.ckz", map_location="cpu")
    for k in ("i8", "view", "i16", "f16", "cpu"):
        assert same_bits(back[k], before[k]), k
    for k, v in s["bf16"].items():
        assert same_bits(back["bf16"][k], v) and same_bits(back["model"][k], s["model"][k]), k
    for i, st in s["optimizer"]["state"].items():
        for k, v in st.items():
            assert same_bits(back["optimizer"]["state"][i][k], v), (i, k)


def test_cast16_cuda_matches_cpu_on_edge_patterns():
    """The derived prediction on CUDA (torch's cast + NaN fill) equals the CPU bit formula on every
    high half-word with the low halves that decide rounding (ties, carries into the exponent,
    overflow to infinity, subnormals, NaN payloads)."""
    from ckptzip.transforms.refs import cast16
    hi = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    u = ((hi[:, None] << 16) | lows[None, :]).reshape(-1)
    src = (u - ((u >> 31) << 32)).to(torch.int32).view(torch.uint8)
    for to in ("bfloat16", "float16"):
        assert torch.equal(cast16(src.cuda(), to).cpu(), cast16(src, to)), to


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["xor", "delta", "hidelta"])
@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (100_003, 4096), (3 << 20, 1 << 20)])
def test_fused_reference_planes_match_two_steps(dtype, kind, n, block):
    """The one-kernel ``xor``/``delta`` + ``byteplane`` (incremental saves and loads on a GPU)
    writes the bytes of the two separate steps (CPU numpy), and undoes them in place."""
    from ckptzip import transforms
    from ckptzip.kernels import triton_kernels
    from ckptzip.kernels import DELTA, HIDELTA, XOR
    from ckptzip.transforms.refs import Delta, HiDelta, Xor, fused_planes
    if kind == "hidelta" and dtype != torch.float32:
        pytest.skip("hidelta is for float32")
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(n)
    base = torch.randn(n, device="cuda", generator=g).to(dtype)
    x = base + 1e-3 * torch.randn(n, device="cuda", generator=g).to(dtype)
    x[::7] = torch.randn(x[::7].shape, device="cuda", generator=g).to(dtype)
    xb, bb = x.view(-1).view(torch.uint8), base.view(-1).view(torch.uint8)
    w = dtype.itemsize
    bp = transforms.BytePlane(w, block)
    rt = (Delta(0, 0, w) if kind == "delta" else HiDelta(0, 0) if kind == "hidelta" else Xor(0, 0)).bind(bb)
    fz = fused_planes(bp, rt, 0, xb)
    mode = {"delta": DELTA, "hidelta": HIDELTA, "xor": XOR}[kind]
    assert fz is not None and fz[2:] == (w, block, mode) and torch.equal(fz[1], bb)
    kern = fz[0]
    want = bp.encode(rt.bind(bb.cpu()).encode(xb.cpu()))
    got = torch.empty_like(xb)
    assert kern.encode_ref(xb, bb, got, w, block, mode)
    assert torch.equal(got.cpu(), want)
    dst = bb.clone()
    assert kern.decode_ref(got, dst, dst, w, block, mode)
    assert torch.equal(dst, xb)
    if n > 1:  # a destination or data slice off the word grid is left to the two steps
        assert fused_planes(bp, rt, 0, xb[1:1 + w * (n - 1)]) is None


@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (100_003, 4096), (3 << 20, 1 << 20)])
def test_fused_expref_planes_match_two_steps(n, block):
    """The one-kernel ``expref`` + ``byteplane`` (Adam's m against v, every default save and load
    on a GPU) writes the bytes of the two torch steps, and undoes them; special values included."""
    from ckptzip import transforms
    from ckptzip.kernels import EXPREF, triton_kernels
    from ckptzip.transforms.refs import ExpRef, fused_planes
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(n)
    v = (torch.randn(n, device="cuda", generator=g) * 1e-3) ** 2
    m = torch.randn(n, device="cuda", generator=g) * v.sqrt()
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e38], device="cuda")
    m[:min(n, 7)] = specials[:min(n, 7)]
    v[1:min(n, 7):2] = specials[1:min(n, 7):2]
    mb, vb = m.view(torch.uint8), v.view(torch.uint8)
    bp = transforms.BytePlane(4, block)
    rt = ExpRef(1).bind(vb)
    fz = fused_planes(bp, rt, 0, mb)
    assert fz is not None and fz[2:] == (4, block, EXPREF) and torch.equal(fz[1], vb)
    want = bp.encode(rt.encode(mb))
    got = torch.empty_like(mb)
    assert fz[0].encode_ref(mb, vb, got, 4, block, EXPREF)
    assert torch.equal(got, want)
    dst = torch.empty_like(mb)
    assert fz[0].decode_ref(got, vb, dst, 4, block, EXPREF)
    assert torch.equal(dst, mb)
    assert fused_planes(transforms.BytePlane(2, block), ExpRef(1).bind(vb), 0, mb) is None


@pytest.mark.parametrize("kind", ["plain2", "plain4", "plain8", "xor4", "delta2", "expref", "expref_words", "derived",
                                  "derived_planes", "expgrid", "expgrid_words", "delta_words2", "delta_words4",
                                  "delta_words8"])
def test_multi_segment_kernel_matches_per_storage(kind):
    """One ``decode_multi`` launch over segments of many sizes, each with its own destination and
    reference allocation, and storages cut in two segments at a block boundary (the second one
    starting mid-storage), writes what the per-storage steps (CPU) write; ``derived`` on every
    rounding edge pattern and NaN payload."""
    from ckptzip import transforms
    from ckptzip.kernels import DELTA, DERIVED, EXPGRID, EXPREF, PLAIN, XOR, triton_kernels
    from ckptzip.transforms.refs import Delta, ExpGrid, ExpRef, cast16
    tk = triton_kernels(wait=True)
    if tk is None:
        pytest.skip("no Triton")
    mode, w, planes = {"plain2": (PLAIN, 2, True), "plain4": (PLAIN, 4, True), "plain8": (PLAIN, 8, True),
                       "xor4": (XOR, 4, True), "delta2": (DELTA, 2, True), "expref": (EXPREF, 4, True),
                       "expref_words": (EXPREF, 4, False), "derived": (DERIVED, 2, False),
                       "derived_planes": (DERIVED, 2, True), "expgrid": (EXPGRID, 4, True),
                       "expgrid_words": (EXPGRID, 4, False), "delta_words2": (DELTA, 2, False),
                       "delta_words4": (DELTA, 4, False), "delta_words8": (DELTA, 8, False)}[kind]
    g = np.random.default_rng(len(kind))
    counts = [1, 3, 2047, 2048, 2049, 100_003, 5, 7 * 3001]
    if mode == DERIVED:
        hi = np.arange(1 << 16, dtype=np.uint32)
        lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
        counts.append(len(hi) * len(lows))
    block = 1000
    parts = []  # (storage's residual-encoded bytes of one segment, destination slice, ref address, words, w0, coff, cols)
    want = []
    keep = []
    for c in counts:
        nb = c * w
        coff = cols = 0
        if mode == DERIVED:
            u = ((hi[:, None] << 16) | lows[None, :]).reshape(-1) if c > 200_000 else g.integers(0, 1 << 32, c, dtype=np.uint32)
            ref = torch.from_numpy(u.view(np.uint8).copy())
            pred = cast16(ref, "bfloat16").view(torch.uint8)
            target = pred.clone()
            target[::5] = torch.from_numpy(g.integers(0, 256, len(target[::5]), dtype=np.uint8))
            resid = target ^ pred
        elif mode == EXPGRID:
            cols = 7 if c % 7 == 0 else 1
            eg = ExpGrid(c // cols, cols, g.integers(0, 1 << 16, c // cols).astype("<u2"),
                         g.integers(-(1 << 15), 1 << 15, cols).astype("<i2"))
            target = torch.from_numpy(g.integers(0, 256, nb, dtype=np.uint8))
            resid = eg.encode(target)
            r32, c32 = eg._pred(torch.device("cuda"), 0, eg.rows)
            ref, coff = r32, c32
            keep.append((r32, c32))
        else:
            ref = torch.from_numpy(g.integers(0, 256, nb, dtype=np.uint8))
            target = torch.from_numpy(g.integers(0, 256, nb, dtype=np.uint8))
            resid = {PLAIN: lambda: target, XOR: lambda: target ^ ref,
                     DELTA: lambda: Delta(0, 0, w).bind(ref).encode(target),
                     EXPREF: lambda: ExpRef(0).bind(ref).encode(target)}[mode]()
        dst = torch.empty(nb, dtype=torch.uint8, device="cuda")
        rg = ref if ref.is_cuda else ref.cuda()
        tg = target.cuda()
        keep.append((rg, tg))
        want.append((dst, target))
        cut = block * 2 if c > block * 3 else c  # words in the first segment
        for a, b in ((0, cut), (cut, c)):
            if b > a:
                seg = resid[a * w:b * w]
                enc = transforms.BytePlane(w, block).encode(seg) if planes else seg
                rptr = rg.data_ptr() + (0 if mode == EXPGRID else a * w * (2 if mode == DERIVED else 1))
                parts.append((enc, dst.data_ptr() + a * w, rptr, b - a, a, coff.data_ptr() if mode == EXPGRID else 0, cols,
                              tg.data_ptr() + a * w))
    stream = torch.zeros(sum(-(-len(p[0]) // 16) * 16 for p in parts), dtype=torch.uint8, device="cuda")
    segs, esegs, pos = [], [], 0
    base = stream.data_ptr()
    for enc, dptr, rptr, n, a, cptr, cols, tptr in parts:
        stream[pos:pos + len(enc)] = enc.cuda()
        segs.append((pos, dptr - base, rptr - base if mode != PLAIN else 0, n, block,
                     cptr - base if cptr else 0, cols, a))
        esegs.append((pos, tptr - base) + segs[-1][2:])
        pos += -(-len(enc) // 16) * 16
    cols_ = np.asarray(segs, dtype=np.int64).T
    tk.decode_multi(stream, *cols_, w, mode, planes)
    for dst, target in want:
        assert torch.equal(dst.cpu(), target)
    # the encoder: the same segments from the targets give the same stream (padding untouched)
    again = torch.zeros_like(stream)
    ecols = np.asarray(esegs, dtype=np.int64).T
    ecols[1:3] += stream.data_ptr() - again.data_ptr()  # (addresses as offsets from ``again``'s first byte)
    ecols[5] = np.where(ecols[5] != 0, ecols[5] + stream.data_ptr() - again.data_ptr(), 0)
    tk.encode_multi(again, *ecols, w, mode, planes)
    assert torch.equal(again, stream)


def test_loads_undo_chains_in_one_launch_per_kind(tmp_path, monkeypatch):
    """A GPU load of a mixed state (fp32 weights, their bf16 copy, Adam m and v, small and odd
    tensors) undoes its chains through the multi-segment kernels, bit-exact, and equals the load
    storage by storage."""
    import ckptzip.engine.decode as dec
    from ckptzip.kernels import triton_kernels
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(3)
    w = {f"w{i}": torch.randn(n, device="cuda", generator=g) * 0.02 for i, n in enumerate([3, 1000, 65_536, 300_001])}
    v = {k: (torch.randn_like(x) * 1e-3) ** 2 for k, x in w.items()}
    st = {"model": w, "bf16": {k: x.bfloat16() for k, x in w.items()},
          "opt": {k: {"exp_avg": torch.randn_like(x) * v[k].sqrt(), "exp_avg_sq": v[k], "step": torch.tensor(5.0)}
                  for k, x in w.items()},
          "ids": torch.arange(1001, device="cuda", dtype=torch.int32), "h": torch.randn(77, device="cuda").half()}
    p = tmp_path / "m.ckz"
    info = ckptzip.save(st, p)
    assert info.get("derived_storages") and info.get("expref_storages")
    kinds = []
    real = dec.multi_segment

    def spy(*a, **k):
        r = real(*a, **k)
        kinds.append(r[0] if r is not None else None)
        return r
    monkeypatch.setattr(dec, "multi_segment", spy)
    back = ckptzip.load(p, map_location="cuda")
    from ckptzip.kernels import DERIVED, EXPREF, PLAIN, PLAIN16
    assert {DERIVED, EXPREF} <= set(kinds) and {PLAIN, PLAIN16} & set(kinds)  # (float32 planes: rotate 16)

    def flat(o, pre=""):
        if isinstance(o, dict):
            for k, x in o.items():
                yield from flat(x, f"{pre}.{k}")
        else:
            yield pre, o
    want = dict(flat(st))
    got = dict(flat(back))
    assert set(got) == set(want)
    for k in want:
        assert same_bits(got[k], want[k]), k
    import ckptzip.kernels as kernels
    monkeypatch.setattr(kernels, "_OFF", {"decode_multi"})
    one = dict(flat(ckptzip.load(p, map_location="cuda")))
    for k in want:
        assert same_bits(one[k], want[k]), k
    # saves: the multi-segment encoder writes the file the unit-by-unit steps write
    q = tmp_path / "one.ckz"
    monkeypatch.setattr(kernels, "_OFF", {"decode_multi", "encode_multi"})
    ckptzip.save(st, q)
    assert p.read_bytes() == q.read_bytes()


def test_fused_incremental_file_equals_unfused(tmp_path, monkeypatch):
    """An incremental save and load on the GPU through the fused kernels: the chunk table of the
    two-step path (nvCOMP's ANS leaves a few bytes inside a chunk unset, so chunk bytes are
    compared through decoding, not directly), tensors bit-exact, and, written with GPU zstd,
    decoded on the CPU (numpy, no fused kernel) bit-exact: the fused writer keeps the wire format."""
    from ckptzip.kernels import DELTA, HIDELTA, XOR, triton_kernels
    import ckptzip.engine.decode as dec
    import ckptzip.engine.encode as enc
    from conftest import read_parts
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    s1 = state()
    s2 = {k: (v + 1e-5 * torch.randn_like(v) if v.is_floating_point() and v.dtype.itemsize >= 2 and v.numel() else v)
          for k, v in s1.items()}
    a, b, c = tmp_path / "a.ckz", tmp_path / "b.ckz", tmp_path / "c.ckz"
    ckptzip.save(s1, a, codec="ans")
    calls = []
    real = enc.fused_planes

    def spy(*args, **kw):
        r = real(*args, **kw)
        calls.append(r is not None)
        return r
    real_multi = dec.multi_segment

    def spy_multi(*args, **kw):
        r = real_multi(*args, **kw)
        calls.append(r is not None and r[0] in (XOR, DELTA, HIDELTA))  # the fused modes against a base
        return r
    monkeypatch.setattr(enc, "fused_planes", spy)
    monkeypatch.setattr(dec, "fused_planes", spy)
    monkeypatch.setattr(dec, "multi_segment", spy_multi)
    monkeypatch.setattr(enc, "multi_segment", spy_multi)
    info = ckptzip.save(s2, b, base=a, codec="ans")
    assert info["delta_storages"] > 0 and any(calls)
    n = len(calls)
    back = ckptzip.load(b, map_location="cuda")
    assert any(calls[n:])
    for k, v in s2.items():
        assert same_bits(back[k], v), k
    za, zb = tmp_path / "za.ckz", tmp_path / "zb.ckz"
    ckptzip.save(s1, za, codec="zstd")
    n = len(calls)
    ckptzip.save(s2, zb, base=za, codec="zstd")
    assert any(calls[n:])
    back = ckptzip.load(zb, map_location="cpu", decode_device="cpu")
    for k, v in s2.items():
        assert same_bits(back[k], v.cpu()), k
    monkeypatch.setattr(enc, "fused_planes", lambda *a, **k: None)
    monkeypatch.setattr(dec, "fused_planes", lambda *a, **k: None)
    monkeypatch.setattr(dec, "multi_segment", lambda *a, **k: None)
    monkeypatch.setattr(enc, "multi_segment", lambda *a, **k: None)
    ckptzip.save(s2, c, base=a, codec="ans")
    rb, rc = read_parts(b)[2], read_parts(c)[2]
    for f in ("raw", "stored", "flags", "offset"):
        assert (rb[f] == rc[f]).all(), f
    # nvCOMP's output slots are zeroed first (codecs.gpu.ZERO_OUTPUT): the files are byte-identical
    assert b.read_bytes() == c.read_bytes()
    back = ckptzip.load(b, map_location="cuda")
    for k, v in s2.items():
        assert same_bits(back[k], v), k


def test_gpu_xxh3_matches_xxhash():
    """The loads' GPU chunk checksum (XXH3-64, inputs over 240 bytes) equals python-xxhash's on
    lengths around every block and stripe boundary, at 8-byte aligned offsets."""
    import numpy as np
    import xxhash
    from ckptzip.kernels import triton_kernels
    tk = triton_kernels(wait=True)
    if tk is None:
        pytest.skip("no Triton")
    rng = np.random.default_rng(0)
    lens = [241, 255, 256, 257, 511, 1023, 1024, 1025, 1087, 1088, 2047, 2048, 2049, 65536, 65537,
            (1 << 20) - 3, 1 << 20, 4 << 20]
    lens += rng.integers(241, 300_000, 40).tolist()
    offs, pos = [], 8
    for n in lens:
        offs.append(pos)
        pos += -(-(n + 8) // 8) * 8
    data = rng.integers(0, 256, pos, dtype=np.uint8)
    got = tk.xxh3_chunks(torch.from_numpy(data).cuda(), np.array(offs), np.array(lens)).cpu().numpy().view(np.uint64)
    want = [xxhash.xxh3_64_intdigest(data[o:o + n].tobytes()) for o, n in zip(offs, lens)]
    assert [int(x) for x in got] == want
    with pytest.raises(ValueError):
        tk.xxh3_chunks(torch.from_numpy(data).cuda(), np.array([0]), np.array([240]))


def test_gpu_hashed_load_reports_damaged_chunks(tmp_path):
    """Once the kernels are ready, GPU loads hash chunks of more than 240 bytes on the GPU: a
    clean file loads bit-exact, and one byte flipped inside a long chunk (checksum left as it
    was) is a ChecksumError naming its offset, not a decode error or wrong data."""
    from conftest import read_parts, write_parts
    from ckptzip.kernels import triton_kernels
    if triton_kernels(wait=True) is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    st = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(3, device="cuda"),
          "m": (torch.randn(300_000, device="cuda") * 1e-3)}
    p = tmp_path / "a.ckz"
    ckptzip.save(st, p)
    back = ckptzip.load(p, map_location="cuda")
    assert all(same_bits(back[k], v) for k, v in st.items())
    data, doc, rows = read_parts(p)
    k = int(np.argmax(rows["stored"]))
    assert rows["stored"][k] > 240
    off = int(rows["offset"][k]) + int(rows["stored"][k]) // 2
    data = data[:off] + bytes([data[off] ^ 0x40]) + data[off + 1:]
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.ChecksumError, match=f"offset {int(rows['offset'][k])}"):
        ckptzip.load(q, map_location="cuda")


@pytest.mark.parametrize("chunk", [65, 1023, 4098])
def test_ans_on_words_rounds_odd_chunk_sizes(tmp_path, chunk):
    """A ``chunk_size`` that is not a multiple of 4 (the API allows 64..16 MiB): the plans that
    code float32 words with ANS (tiny storages, the sampled "words" variant) cut chunks of whole
    words; nvCOMP refuses others. Found by test_expref's round trip run on a GPU machine."""
    g = torch.Generator().manual_seed(chunk)
    st = {"tiny": torch.randn(7, generator=g), "w": torch.randn(64, 48, generator=g),
          "h": torch.randn(300, 129, generator=g).half()}
    p = tmp_path / "odd.ckz"
    ckptzip.save(st, p, chunk_size=chunk)
    back = ckptzip.load(p)
    for k in st:
        assert same_bits(back[k], st[k]), k


@pytest.mark.parametrize("codec", ["zstd", "deflate"])
def test_damaged_chunk_of_a_gpu_zstd_or_deflate_file_is_verified_before_decoding(tmp_path, monkeypatch, codec):
    """nvCOMP's Zstd decoder never returned on a chunk with one flipped bit (the load hung).
    Only codecs whose decoders are bounded on any input (ANS) are decoded before their
    checksums are verified; the chunks of other codecs are verified on the host first, so a
    damaged one is a ChecksumError before it reaches the GPU decoder."""
    from conftest import read_parts, write_parts
    import ckptzip.engine.decode as dec
    from ckptzip.kernels import triton_kernels
    triton_kernels(wait=True)
    g = torch.Generator().manual_seed(3)
    st = {"a": torch.randn(3 << 20, generator=g).cuda(), "b": torch.randn(2 << 20, generator=g).to(torch.bfloat16).cuda()}
    p = tmp_path / "z.ckz"
    ckptzip.save(st, p, codec=codec, chunk_size=1 << 20)
    asked = []
    real = dec.read_stored

    def spy(src, rows, pinned=False, gpu_hash=False, defer=None):
        asked.append(gpu_hash)
        assert defer is None  # (GPU groups: the reader verifies every chunk it does not leave to the GPU)
        return real(src, rows, pinned=pinned, gpu_hash=gpu_hash, defer=defer)
    monkeypatch.setattr(dec, "read_stored", spy)
    back = ckptzip.load(p, map_location="cuda")
    assert all(same_bits(back[k], st[k]) for k in st)
    assert asked and not any(asked)
    data, doc, rows = read_parts(p)
    for k in (0, len(rows) // 2, len(rows) - 1):
        off = int(rows[k]["offset"]) + int(rows[k]["stored"]) // 2
        q = tmp_path / f"bad{k}.ckz"
        write_parts(q, data[:off] + bytes([data[off] ^ 0x01]) + data[off + 1:], doc, rows)
        with pytest.raises(ckptzip.ChecksumError):
            ckptzip.load(q, map_location="cuda")


def test_zstd_files_load_to_the_gpu_through_the_cpu_decoder(tmp_path, monkeypatch):
    """Zstd chunks (files written on a CPU, ``codec="zstd"``) are decoded by the CPU codec in
    GPU loads unless ``decode_device="cuda"`` forces nvCOMP (Codec.safe_on_forged): standalone
    and incremental files land on the GPU bit-exact, and nvCOMP's Zstd decoder is never called."""
    from ckptzip.codecs.gpu import ZstdGPU
    g = torch.Generator().manual_seed(5)
    s1 = {"w": torch.randn(1 << 20, generator=g).cuda(), "h": torch.randn(3 << 18, generator=g).bfloat16().cuda(),
          "n": torch.arange(1000).cuda(), "k": 3}
    s2 = {k: (v + 1e-3 * torch.randn(v.shape, generator=g).to(v.device, v.dtype)
              if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in s1.items()}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a, codec="zstd")
    ckptzip.save(s2, b, codec="zstd", base=a)
    calls = []
    real = ZstdGPU.decode

    def spy(self, *args, **kw):
        calls.append(1)
        return real(self, *args, **kw)
    monkeypatch.setattr(ZstdGPU, "decode", spy)
    for p, st in ((a, s1), (b, s2)):
        back = ckptzip.load(p, map_location="cuda")
        for k, v in st.items():
            if torch.is_tensor(v):
                assert back[k].device.type == "cuda" and same_bits(back[k], v), (p, k)
            else:
                assert back[k] == v
    assert not calls
    back = ckptzip.load(a, map_location="cuda", decode_device="cuda")  # forced: nvCOMP
    assert calls and same_bits(back["w"], s1["w"])


def test_forged_zstd_gpu_load_returns(tmp_path):
    """A zstd chunk with flipped bits and a recomputed checksum (a forged file): a default GPU
    load ends, with data or a named error, never a hang (nvCOMP 6.0's Zstd decoder never returned
    on 2 of 3 such chunks on an H100). Three zstd-coded chunks (not ones stored raw) are forged,
    one file each; each load runs in a subprocess with a time limit, where nvCOMP's Zstd decoder
    must not be called at all."""
    import subprocess
    import sys
    import textwrap
    from ckptzip import format as fmt
    from conftest import read_parts, write_parts
    g = torch.Generator().manual_seed(3)
    st = {"a": torch.randn(3 << 20, generator=g).cuda(), "b": torch.randn(2 << 20, generator=g).bfloat16().cuda()}
    p = tmp_path / "z.ckz"
    ckptzip.save(st, p, codec="zstd", chunk_size=1 << 20)
    data, doc, rows = read_parts(p)
    files = []
    coded = np.nonzero(rows["flags"] == 0)[0]
    assert len(coded) >= 3
    for k in coded[[0, len(coded) // 2, -1]].tolist():
        off = int(rows[k]["offset"]) + int(rows[k]["stored"]) // 2
        bad = bytearray(data)
        bad[off] ^= 0x01
        r = rows.copy()
        a0 = int(r[k]["offset"])
        r[k]["xxh3"] = fmt.checksum(bytes(bad[a0:a0 + int(r[k]["stored"])]))
        q = tmp_path / f"forged{k}.ckz"
        write_parts(q, bytes(bad), doc, r)
        files.append(str(q))
    code = textwrap.dedent(f"""
        import ckptzip
        from ckptzip.codecs.gpu import ZstdGPU

        def refuse(*a, **k):
            raise SystemExit("nvCOMP's Zstd decoder was called")
        ZstdGPU.decode = refuse
        for f in {files!r}:
            try:
                ckptzip.load(f, map_location="cuda")
                print("data", flush=True)
            except ckptzip.CkptzipError as e:
                print("error", type(e).__name__, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.split("\n")) - 1 == len(files), out.stdout


@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (100_003, 4096), (3 << 20, 1 << 20)])
def test_plane_subset_kernel_matches_torch(n, block):
    """The Triton partial decode (planes 0, 2, 3 of a base storage, for hidelta loads) writes the
    words of the torch path, and bits 15..31 equal the original words'."""
    from ckptzip.kernels import triton_kernels
    from ckptzip.transforms.byteplane import BytePlane, PlaneSubset
    tk = triton_kernels(wait=True)
    if tk is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, device="cuda", generator=g)
    bp = BytePlane(4, block)
    enc = bp.encode(x)
    part = torch.cat([enc[o:o + m] for k, (o, m) in enumerate(bp.segments(4 * n)) if k % 4 != 1])
    got, want = torch.zeros_like(x), torch.zeros_like(x)
    tk.decode_part(part, got, block)
    PlaneSubset(block)._decode(part, want, True)
    assert torch.equal(got, want)
    m = 0xFFFF8000 - (1 << 32)
    assert torch.equal(got.view(torch.int32) & m, x.view(torch.int32) & m)


@pytest.mark.parametrize("off", [(), ("decode_multi",), ("decode_multi", "fused")])
def test_hidelta_incremental_on_gpu_bit_exact(tmp_path, monkeypatch, off):
    """An incremental save of CUDA float32 weights uses hidelta; loading it onto the GPU decodes
    the base's planes 0, 2, 3 and the residuals, through the multi-segment kernels (PARTIAL,
    HIDELTA), the one-storage kernels, or torch: bit-exact every way."""
    import ckptzip.kernels as kernels
    kernels.wait_kernels(120)  # (the rotate-16 kernels are compiled after the warm-up's others)
    assert kernels.rot16_ready()
    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(3 << 20, device="cuda", generator=g) * 0.02
    s1 = {"w": w, "small": w[:1000].clone(), "odd": w[:777].clone()}
    s2 = {"w": w + 1e-6 * torch.randn(w.shape, device="cuda", generator=g), "small": w[:1000] * 1.0001,
          "odd": -w[:777]}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    with ckptzip.open(a) as r:  # GPU saves: float32 planes with rotate 16 (format 1.3)
        assert r.storages[0]["transforms"] == [{"id": "byteplane", "width": 4, "block": r.storages[0]["transforms"][0]["block"],
                                                "rotate": 16}]
    with ckptzip.open(b) as r:
        assert r.storages[0]["transforms"][0]["id"] == "hidelta" and "storages" in r.base
    monkeypatch.setattr(kernels, "_OFF", set(off))
    for k, v in ckptzip.load(a, map_location="cuda").items():  # (PLAIN16 through multi, one-storage, torch)
        assert torch.equal(v.view(torch.int32), s1[k].view(torch.int32)), k
    back = ckptzip.load(b, map_location="cuda")  # (the base's planes 2 and 3: PARTIAL16)
    for k in s2:
        assert torch.equal(back[k].view(torch.int32), s2[k].view(torch.int32)), k


@pytest.mark.usefixtures("no_pack")
def test_incremental_gpu_load_locates_expgrid_base_storages(tmp_path, monkeypatch):
    """GPU saves of an Adam state: v is coded ``expgrid`` in the base, and the incremental file
    stores it as ``delta`` against that storage, located by an ``expgrid`` chain in its record
    (format 1.4); m (``expref`` in the base) is stored without the base. The GPU load never
    opens the base as a checkpoint and is bit-exact."""
    import ckptzip.api as api
    from fixtures.make_fixtures import golden_grid_object, golden_grid_object_next
    from fixtures.make_fixtures import to_cuda
    g = torch.Generator(device="cuda").manual_seed(6)
    s1, s2 = to_cuda(golden_grid_object()), to_cuda(golden_grid_object_next())
    s1["w"] = torch.randn(1 << 20, device="cuda", generator=g) * 0.02
    s2["w"] = s1["w"] + 1e-6
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    with ckptzip.open(a) as r:
        assert "expgrid" in [t["id"] for s in r.storages for t in s.get("transforms", [])]
    with ckptzip.open(b) as r:
        assert r.manifest.doc["version"] == [1, 4]
        assert any(t["id"] == "expgrid" for c in r.base["chains"] for t in c["transforms"])
    opened = []
    real = api.open_base
    monkeypatch.setattr(api, "open_base", lambda *x, **k: (opened.append(1), real(*x, **k))[1])
    back = ckptzip.load(b, map_location="cuda")
    assert not opened
    st, want = back["optimizer"]["state"][0], s2["optimizer"]["state"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(st[k].view(torch.int32), want[k].view(torch.int32)), k
    assert torch.equal(back["w"].view(torch.int32), s2["w"].view(torch.int32))


@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (100_003, 4096), (3 << 20, 1 << 20)])
def test_rotate16_kernels_match_cpu(n, block):
    """``byteplane`` ``rotate`` 16: the Triton kernels (one-storage and multi-segment) and the torch
    path on the GPU write and read the bytes of the CPU code."""
    import numpy as np
    from ckptzip import kernels
    from ckptzip.kernels import PLAIN16
    from ckptzip.transforms import BytePlane
    from conftest import check_rotate16_paths
    tk = kernels.wait_kernels(120)
    if tk is None:
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, device="cuda", generator=g)
    bp = BytePlane(4, block, 16)
    want = bp.encode(x.cpu())
    got = bp.encode(x)
    assert torch.equal(got.cpu(), want)
    check_rotate16_paths(bp, x, want)
    # multi-segment: one segment, planes at 0, words at 4n (table as decode_multi documents)
    buf = torch.zeros(8 * n + 64, dtype=torch.uint8, device="cuda")
    buf[:4 * n] = got
    cols = [np.array([c], dtype=np.int64) for c in (0, 4 * n + 32, 4 * n + 32, n, block, 0, 0, 0)]
    tk.decode_multi(buf, *cols, 4, PLAIN16, True)
    assert torch.equal(buf[4 * n + 32:8 * n + 32], x)
    buf[:4 * n] = 0
    tk.encode_multi(buf, *cols, 4, PLAIN16, True)
    assert torch.equal(buf[:4 * n].cpu(), want)


def test_async_save_hashes_gpu_windows_on_the_gpu(tmp_path, monkeypatch):
    """With the kernels ready, an async save's windows kept on the GPU are hashed there: the
    writer hashes on the host only the chunks the kernel does not take (240 bytes or less), and
    every checksum in the file is right (verify() recomputes them on the host)."""
    from ckptzip import kernels
    from ckptzip.io import writer
    if kernels.wait_kernels(120) is None:
        pytest.skip("no Triton")
    s = state()
    sizes = []
    real = writer.checksums

    def spy(b, offs, stored, which=None):
        sizes.extend(stored)
        return real(b, offs, stored, which)
    monkeypatch.setattr(writer, "checksums", spy)
    ckptzip.async_save(s, tmp_path / "a.ckz", device="cuda").wait()
    assert max(sizes, default=0) <= 240
    import xxhash
    data = (tmp_path / "a.ckz").read_bytes()
    with ckptzip.open(tmp_path / "a.ckz") as r:
        rows = r.manifest.rows
    assert len(rows) > len(sizes) + 10
    for o, n, h in zip(rows["offset"].tolist(), rows["stored"].tolist(), rows["xxh3"].tolist()):
        assert xxhash.xxh3_64_intdigest(data[o:o + n]) == h  # (python-xxhash, not the kernel)
    back = ckptzip.load(tmp_path / "a.ckz", map_location="cuda")
    for k, v in s.items():
        assert same_bits(back[k], v), k
