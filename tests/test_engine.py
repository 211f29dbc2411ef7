"""The engine's parts on their own: planning (windows, units, groups), memory (pinned pool,
segment copies), packing. End-to-end behaviour is in test_roundtrip.py and test_gpu.py."""
import io
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip.errors
from ckptzip import engine
from ckptzip.transforms import BytePlane


@settings(max_examples=60, deadline=None)
@given(words=st.integers(0, 5000), width=st.sampled_from([2, 4, 8]), block=st.integers(1, 600),
       chunk=st.integers(64, 5000), window=st.integers(1, 40000), tf=st.booleans())
def test_windows_tile_the_storage(words, width, block, chunk, window, tf):
    """Windows cover the storage exactly, end on transform block boundaries, and their chunks tile
    each window's stream without gaps; no chunk exceeds the chunk size."""
    t = BytePlane(width, block) if tf else None
    n = words * width
    pos = 0
    for a, b, offs, sizes, planes in engine.windows(n, t, chunk, window):
        assert a == pos and b > a
        pos = b
        if t is not None and b != n:
            assert a % (block * width) == 0 and b % (block * width) == 0
        assert int(sizes.sum()) == b - a and (sizes <= chunk).all() and (sizes > 0).all()
        assert (np.diff(offs) == sizes[:-1]).all() if len(offs) > 1 else True
    assert pos == n


def test_groups_bound_bytes_and_chunks():
    plan = engine.Plan(None, __import__("ckptzip").codecs.get_codec("zstd"), 1024)
    units = [u for i in range(50) for u in engine.units_of(i, torch.zeros(10_000, dtype=torch.uint8), plan, 1 << 20)]
    gs = list(engine.groups(units, 64_000, max_chunks=30))
    assert sum(len(g) for g in gs) == len(units)
    for g in gs:
        assert sum(u.data.numel() for u in g) <= 64_000 or len(g) == 1
        assert sum(len(u.sizes) for u in g) <= 30 or len(g) == 1


def test_copy_segments_cpu_merges_and_pads():
    src = torch.arange(200, dtype=torch.uint8)
    soffs = np.array([0, 10, 20, 100], dtype=np.int64)
    lens = np.array([10, 10, 5, 7], dtype=np.int64)
    ends = np.array([10, 10, 16, 16], dtype=np.int64)
    doffs = np.array([0, 10, 20, 36], dtype=np.int64)
    dst = torch.full((52,), 0xAB, dtype=torch.uint8)
    engine.copy_segments(src, soffs, dst, doffs, lens, ends)
    want = np.full(52, 0xAB, dtype=np.uint8)
    for s, d, n, e in zip(soffs, doffs, lens, ends):
        want[d:d + n] = np.arange(s, s + n)
        want[d + n:d + e] = 0
    assert np.array_equal(dst.numpy(), want)


def test_pinned_pool_leases_reuse_and_bound():
    from ckptzip.engine import PinnedPool
    pool = PinnedPool()
    a = pool.acquire(100)
    b = pool.acquire(3 << 20)
    assert a.numel() == 100 and b.numel() == 3 << 20
    pa = a.data_ptr()
    pool.release(a)
    pool.release(a)  # a second release is ignored
    c = pool.acquire(50)
    assert c.data_ptr() == pa  # the smallest free buffer that fits is reused
    d = pool.acquire(200)  # a is leased again: a new buffer
    assert d.data_ptr() not in (pa, b.data_ptr())
    big = [pool.acquire((9 << 20) + k) for k in range(8)]
    assert all(x.untyped_storage().nbytes() == 16 << 20 for x in big)  # rounded up to 8 MiB grains
    for x in big + [b, c, d]:
        pool.release(x)
    assert len(pool._free) == PinnedPool.MAX_FREE
    assert min(x.numel() for x in pool._free) >= 16 << 20  # the smallest were dropped
    del big
    e = pool.acquire(40 << 20)
    del e  # a lease dropped without release (an error path) is not kept alive by the pool
    assert all(r() is None or r().numel() != 40 << 20 for r in pool._leased.values())
    pool.release(torch.empty(1))  # unknown buffers are ignored


@pytest.mark.gpu
def test_copy_segments_zero_pads_and_matches_reference():
    import numpy as np
    from ckptzip.engine import copy_segments
    src = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, device="cuda")
    lens = np.array([5, 16, 1 << 20, (1 << 20) + 3, 1000, 32, 32, 17, 2 << 20, 7], dtype=np.int64)
    ends = (lens + 15) // 16 * 16
    doffs = np.concatenate([[0], np.cumsum(ends)[:-1]]).astype(np.int64)
    soffs = np.array([100, 105, 121, (1 << 20) + 121, 5 << 20, (6 << 20), (6 << 20) + 32, 9 << 20, 3 << 20, 17],
                     dtype=np.int64)  # some runs adjacent in src (merged when nothing pads between)
    total = int(ends.sum())
    want = np.zeros(total, dtype=np.uint8)
    s = src.cpu().numpy()
    for a, d, n in zip(soffs, doffs, lens):
        want[d:d + n] = s[a:a + n]
    for dev in ("cuda", "cpu"):
        dst = torch.full((total,), 0xAB, dtype=torch.uint8, device=dev)
        copy_segments(src.to(dev), soffs, dst, doffs, lens, ends)
        assert np.array_equal(dst.cpu().numpy(), want), dev



@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_copy_segments_random_layouts(seed):
    """Random segments (aligned and not, lengths around word and tile edges, padding or none, a
    misaligned source view): the Triton tile kernel's word and byte paths agree with a numpy
    reference, and nothing outside the segments' ranges is written."""
    import numpy as np
    from ckptzip import engine
    rng = np.random.default_rng(seed)
    src_all = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8, device="cuda")
    src = src_all[seed:]  # seeds 1-3: a source whose first byte is not 16-byte aligned
    k = 60
    choices = [1, 3, 4, 15, 16, 17, 4095, 4096, 4097, 65535, 65536, 65537, 200_000, 1 << 20, (1 << 20) + 5]
    lens = rng.choice(choices, k).astype(np.int64)
    aligned = rng.random(k) < 0.6
    pad = rng.random(k) < 0.5
    ends = np.where(pad, (lens + 15) // 16 * 16, lens)
    gaps = np.where(aligned, 0, rng.integers(1, 15, k))
    doffs = np.zeros(k, dtype=np.int64)
    pos = 0
    for i in range(k):
        pos = (pos + 15) // 16 * 16 + gaps[i]
        doffs[i] = pos
        pos += ends[i] + 5  # 5 untouched bytes after each segment
    soffs = np.array([(rng.integers(0, src.numel() - n) // 16 * 16 + (0 if a else rng.integers(1, 15)))
                      for n, a in zip(lens, aligned)], dtype=np.int64)
    soffs = np.minimum(soffs, src.numel() - lens)
    total = pos + 16
    s = src.cpu().numpy()
    want = np.full(total, 0xAB, dtype=np.uint8)
    for a, d, n, e in zip(soffs, doffs, lens, ends):
        want[d:d + n] = s[a:a + n]
        want[d + n:d + e] = 0
    dst = torch.full((total,), 0xAB, dtype=torch.uint8, device="cuda")
    engine.copy_segments(src, soffs, dst, doffs, lens, ends)
    assert np.array_equal(dst.cpu().numpy(), want)


@pytest.mark.gpu
def test_pack_gathers_from_several_tensors():
    """pack() on CUDA gathers chunks of the stream and of the codec outputs in one launch."""
    import numpy as np
    from ckptzip.engine import Encoded, pack
    a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    b = torch.randint(0, 256, (300_000,), dtype=torch.uint8, device="cuda")
    c = torch.randint(0, 256, (70_000,), dtype=torch.uint8, device="cuda")
    tensors = [a, b, c]
    src = np.array([0, 1, 2, 1, 0], dtype=np.int64)
    soff = np.array([16, 0, 32, 131072, 500_000], dtype=np.int64)
    stored = np.array([1000, 70_001, 5, 65536, 3], dtype=np.int64)
    enc = Encoded(tensors, src, soff, stored, stored.copy(), np.zeros(5, np.uint8), [5])
    offs, total = enc.packed()
    out = torch.full((total,), 0xAB, dtype=torch.uint8, device="cuda")
    pack(enc, out, offs)
    want = np.zeros(total, dtype=np.uint8)
    for t, so, n, o in zip(src, soff, stored, offs):
        want[o:o + n] = tensors[t].cpu().numpy()[so:so + n]
    assert np.array_equal(out.cpu().numpy(), want)


def test_loads_do_not_start_the_kernel_warmup(monkeypatch):
    """triton_kernels(start=False) (the load paths) returns None without starting the compile
    thread when the kernels are not ready; the default call starts it."""
    import threading
    from ckptzip import kernels
    monkeypatch.setattr(kernels, "_READY", threading.Event())
    started = []
    monkeypatch.setattr(kernels, "_start", lambda: started.append(1))
    monkeypatch.delenv("CKPTZIP_TRITON_WARMUP", raising=False)
    assert kernels.triton_kernels(start=False) is None and started == []
    assert kernels.triton_kernels() is None and started == [1]


def test_scratch_heavy_codecs_get_smaller_gpu_windows():
    """GPU zstd / deflate saves (portable, slow storage, or named) plan half-size windows, and
    their compress calls are cut so that nvCOMP's scratch stays bounded (its zstd asked for
    1,488 MiB for one 256 MiB window of 1 MiB chunks)."""
    from ckptzip.codecs.gpu import _split_calls
    from ckptzip.engine.planner import Planner
    assert engine.gpu_window(1 << 30) == 256 << 20
    assert engine.gpu_window(1 << 30, scratch_heavy=True) == 128 << 20
    assert engine.gpu_window(1 << 20, scratch_heavy=True) == 1 << 20
    heavy = [Planner("auto", device="cuda", portable=True), Planner("zstd", device="cuda"),
             Planner("auto", device="cuda", storage_gbps=1.0)]
    light = [Planner("auto", device="cuda"), Planner("ans", device="cuda"), Planner("zstd", device="cpu")]
    assert all(p.scratch_heavy for p in heavy) and not any(p.scratch_heavy for p in light)
    arr = np.array([1 << 20] * 100 + [5000] * 7, dtype=np.int64)
    calls = [np.arange(100, 107), np.arange(100)]
    runs = _split_calls(calls, arr, 32 << 20, 1 << 30)
    assert sorted(np.concatenate(runs).tolist()) == list(range(107))
    assert all(len(r) * arr[r].max() <= (32 << 20) for r in runs) and len(runs) == 5
    mixed = np.array([1 << 20] + [100] * 99, dtype=np.int64)  # scratch follows count x largest
    assert [len(r) for r in _split_calls([slice(None)], mixed, 32 << 20, 1 << 30)] == [32, 32, 32, 4]
    assert [len(r) for r in _split_calls([np.arange(1, 100)], mixed, 32 << 20, 40)] == [40, 40, 19]
    assert _split_calls([slice(None)], arr[:10], 32 << 20, 1 << 30) == [slice(None)]


def test_portable_gpu_saves_use_deflate_entropy_only(monkeypatch):
    """``portable`` on a GPU: deflate (CPU-decodable), algorithm 0 (entropy coding only, no
    nvCOMP scratch, so no call splitting) for byte planes; named GPU zstd in 16 KiB chunks.
    Through the Python binding (no C API), which ignores the algorithm, calls are cut."""
    from ckptzip.codecs import _capi, gpu
    from ckptzip.engine.planner import Planner
    assert Planner("auto", device="cuda", portable=True).codec_id == "deflate"
    assert Planner("auto", device="cuda", storage_gbps=1.0).codec_id == "zstd"
    assert Planner("auto", device="cuda").codec_id == "ans"
    assert Planner("auto", device="cpu", portable=True).codec_id == "zstd"
    monkeypatch.setattr(_capi, "available", lambda: True)
    assert gpu.DeflateGPU(algorithm=0).call_limits() is None
    assert gpu.DeflateGPU().call_limits() == (16 << 20, 1 << 30)
    monkeypatch.setenv("CKPTZIP_NVCOMP_CAPI", "0")
    assert gpu.DeflateGPU(algorithm=0).call_limits() == (16 << 20, 1 << 30)
    assert gpu.DeflateGPU(algorithm=0).get_config() == {"id": "deflate"}  # encoder-only
    assert "algorithm" not in dict(gpu.DeflateGPU(algorithm=0)._opts())
    assert gpu.ZstdGPU.preferred_chunk == 16 << 10 and gpu.ZstdGPU().call_limits() == (32 << 20, 1 << 30)
    for bad in (6, -1, True, "0"):
        with pytest.raises(ckptzip.errors.CkptzipError):
            gpu.DeflateGPU(algorithm=bad)
        with pytest.raises(ckptzip.errors.CkptzipError):
            _capi.deflate_opts(bad)
    comp, dec = _capi.deflate_opts(0)
    assert bytes(comp)[:4] == b"\0\0\0\0" and bytes(_capi.deflate_opts(2)[0])[:4] == b"\2\0\0\0"


def test_nvcomp_scratch_grows_in_steps_and_is_released():
    """The cached nvCOMP scratch is replaced (never two held) when a call needs more, grows in
    16 MiB steps, and is handed back at the end of a save or load."""
    from ckptzip.codecs import _capi, gpu
    dev = torch.device("cpu")
    _capi.release_scratch()
    a = _capi._temp(dev, 7, 5 << 20)
    assert a.numel() == 16 << 20 and _capi._temp(dev, 7, 16 << 20) is a
    b = _capi._temp(dev, 7, (16 << 20) + 1)
    assert b.numel() == 32 << 20 and list(_capi._TEMP.values()) == [b]
    gpu.release_scratch()
    assert not _capi._TEMP


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 1 << 20), max_size=300), most=st.integers(1, 16))
def test_cpu_untransform_runs_cover_every_storage_once(sizes, most):
    """The CPU inverse transforms go to the pool in at most ``most`` consecutive runs (one task
    per storage when there are few): every storage exactly once, in order."""
    from ckptzip.codecs.cpu import runs as make_runs
    runs = make_runs(sizes, most)
    assert [k for r in runs for k in r] == list(range(len(sizes)))
    assert all(len(r) for r in runs) and len(runs) <= most


def test_decode_group_starts_every_storage_aligned(tmp_path, monkeypatch):
    """A storage of a few bytes (an optimizer's step count) does not misalign the chunks after
    it in a decode group: every batch starts 16-byte aligned (nvCOMP decodes misaligned outputs
    aside and copies them), and the load stays bit-exact."""
    import ckptzip
    from ckptzip.codecs import cpu as ccpu
    torch.manual_seed(0)
    state = {"a_step": torch.tensor(3.0), "b": torch.randn(4096), "c_step": torch.tensor(7, dtype=torch.int64),
             "d": torch.randn(3, 1000).bfloat16(), "e": torch.randn(777)}
    p = tmp_path / "s.ckz"
    # the CPU decoder under test on every machine (a GPU machine would save and decode on the GPU)
    ckptzip.save(state, p, codec="zstd", transform=None, device="cpu")
    seen = []
    orig = ccpu.ZstdCPU.decode

    def spy(self, src, so, ss, dst, do, ds):
        seen.extend(int(x) for x in do)
        return orig(self, src, so, ss, dst, do, ds)
    monkeypatch.setattr(ccpu.ZstdCPU, "decode", spy)
    back = ckptzip.load(p, decode_device="cpu")
    assert all(torch.equal(back[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)) for k, v in state.items())
    assert seen and all(o % 16 == 0 for o in seen), seen



def test_host_scratch_reuses_only_buffers_nobody_holds():
    """HostScratch hands a buffer out again only once every tensor, slice and numpy view of the
    previous one is gone; small requests are plain allocations; the cache stays under its cap,
    and buffers taken at once never share memory."""
    import gc
    from ckptzip.engine.memory import HostScratch
    h = HostScratch()
    a = h.take(3 << 20)
    pa = a.data_ptr()
    part = a[100:200]  # a slice keeps the buffer taken
    del a
    gc.collect()
    b = h.take(3 << 20)
    pb = b.data_ptr()
    assert pb != pa
    del part, b
    gc.collect()
    c = h.take(3 << 20)
    assert c.data_ptr() in (pa, pb)  # a free buffer is reused
    view = c.numpy()[5:]  # a numpy view keeps it taken too
    pc = c.data_ptr()
    del c
    gc.collect()
    d = h.take(3 << 20)
    assert d.data_ptr() != pc
    del view, d
    assert h.take(100).numel() == 100
    h2 = HostScratch()
    h2.MAX_BYTES = 8 << 20
    keep = [h2.take(4 << 20) for _ in range(4)]
    assert sum(e[0].size for e in h2._bufs) <= 8 << 20
    for k, t in enumerate(keep):
        t.fill_(k)
    assert [int(t[-1]) for t in keep] == [0, 1, 2, 3]


def test_host_scratch_evicts_free_buffers_when_full():
    """At its cap, the cache drops free buffers (smallest first, whichever their place in the
    list) to make room, and keeps every buffer still held; a save / load / save round of many
    storages with the default cache runs through (a removal by equality once raised numpy's
    ambiguous-truth error here)."""
    import gc
    from ckptzip.engine.memory import HostScratch
    h = HostScratch()
    h.MAX_BYTES = 24 << 20
    held = h.take(8 << 20)
    t1, t2 = h.take(4 << 20), h.take(8 << 20)
    del t1, t2
    gc.collect()
    big = h.take(12 << 20)  # needs both free buffers dropped, one not first in the list
    assert sum(e[0].size for e in h._bufs) <= h.MAX_BYTES
    assert any(e[0].size >= 12 << 20 for e in h._bufs)
    assert held.data_ptr() in [e[0].ctypes.data for e in h._bufs]
    del big, held



@pytest.mark.parametrize("split,fused,pieces", [(True, False, True), (False, False, True), (True, True, True),
                                                (False, True, True), (True, True, False), (False, True, False)])
def test_cpu_groups_read_raw_chunks_into_place(tmp_path, monkeypatch, split, fused, pieces):
    """CPU loads of local files read raw chunks straight into the decode stream (or the
    destination) and the coded ones into a buffer (io.reader.read_split); with the switch off,
    all into the buffer and copied. Byte-plane batches of zstd and stored chunks are decoded in
    one pass from the read buffer (``FUSED``), or in two steps through the stream; their chunks'
    checksums are verified by the decoding threads (``VERIFY_IN_PIECES``) or by the reader.
    Either way the state is bit-exact, and a damaged raw or coded chunk is a ChecksumError."""
    from conftest import read_parts, write_parts
    from ckptzip.engine import decode
    from ckptzip.format import FLAG_STORED_RAW
    monkeypatch.setattr(decode, "SPLIT_READS", split)
    monkeypatch.setattr(decode, "FUSED", fused)
    monkeypatch.setattr(decode, "VERIFY_IN_PIECES", pieces)
    g = torch.Generator().manual_seed(1)
    st = {"w": torch.randn(3 << 20, generator=g), "noise": torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, generator=g),
          "h": torch.randn(1 << 20, generator=g).half(), "n": 3}
    p = tmp_path / "s.ckz"
    ckptzip.save(st, p, device="cpu", chunk_size=1 << 20)
    back = ckptzip.load(p)
    for k in ("w", "noise", "h"):
        assert torch.equal(back[k].view(torch.uint8), st[k].view(torch.uint8)), k
    data, doc, rows = read_parts(p)
    raw = np.nonzero(rows["flags"] == FLAG_STORED_RAW)[0]
    coded = np.nonzero(rows["flags"] != FLAG_STORED_RAW)[0]
    assert len(raw) and len(coded)
    for k in (int(raw[len(raw) // 2]), int(coded[0])):
        off = int(rows[k]["offset"]) + 7
        q = tmp_path / f"bad{k}.ckz"
        write_parts(q, data[:off] + bytes([data[off] ^ 0x10]) + data[off + 1:], doc, rows)
        with pytest.raises(ckptzip.ChecksumError):
            ckptzip.load(q)


@pytest.mark.usefixtures("no_pack")
@pytest.mark.parametrize("small,parallel", [(64 << 10, False), (64 << 10, True), (-1, False)])
def test_small_byteplane_batches_load_bit_exact(tmp_path, monkeypatch, small, parallel):
    """Many small float storages of every byteplane width (a model's norms, biases and
    counters), mixed with a large one and with ones that carry a reference transform, load
    bit-exact on the CPU whether their planes are undone in the decoding thread's one loop
    (``SMALL_INVERSE``; split between the pool's threads where they hold enough bytes) or on
    the general path, and their planes are written alike by the
    encoder's loop for small units (``SMALL_PLANES``) and its general path; a damaged small
    storage's chunk is a ChecksumError."""
    from conftest import read_parts, write_parts
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import decode
    monkeypatch.setattr(decode, "SMALL_INVERSE", small)
    if parallel:  # (the loops over small storages split between the pool's threads)
        monkeypatch.setattr(ccpu, "PARALLEL_BYTES", 1 << 10)
    g = torch.Generator().manual_seed(3)
    st = {f"t{i}": torch.randn(17 * (i + 1), generator=g).to(dt)
          for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float64, torch.float16] * 12)}
    st["big"] = torch.randn(300_000, generator=g)
    st["step"] = torch.tensor(7.0)
    p = tmp_path / "s.ckz"
    ckptzip.save(st, p, device="cpu")
    from ckptzip.engine import encode
    monkeypatch.setattr(encode, "SMALL_PLANES", -1)  # the general path writes the same bytes
    ckptzip.save(st, tmp_path / "general.ckz", device="cpu")
    assert (tmp_path / "general.ckz").read_bytes() == p.read_bytes()
    back = ckptzip.load(p)
    assert back.keys() == st.keys()
    for k, v in st.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    data, doc, rows = read_parts(p)
    first = doc["storages"][0]["rows"][0]
    off = int(rows[first]["offset"]) + 3
    q = tmp_path / "bad.ckz"
    write_parts(q, data[:off] + bytes([data[off] ^ 0x01]) + data[off + 1:], doc, rows)
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(q)


def test_streamed_save_plans_while_writing(tmp_path, monkeypatch):
    """A streamed save (GPU saves to local files; here on the CPU) plans its storages a window
    at a time as the writer asks for their groups: every batch is planned after the previous
    batch's chunks were written, the file loads bit-exact, verifies, and its header carries the
    same minor as its manifest (written again at the end: 1.3 here, from byteplane rotate 16)."""
    import ckptzip
    from ckptzip import pipeline
    from ckptzip.engine import planner as planner_mod
    from ckptzip.format import HEADER
    from ckptzip.io import writer
    monkeypatch.setattr(pipeline, "STREAM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(planner_mod, "ROT16_ON_CPU", True)
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(60_000 + 1000 * i, generator=g) * 0.02 for i in range(6)}
    state["step"] = torch.tensor(7)
    state["w0_bf16"] = state["w0"].to(torch.bfloat16)  # derived from w0, planned in a later batch
    events = []
    real_plan, real_add = planner_mod.Planner.plan_all, writer.ChunkWriter.add

    def plan_all(self, refs, *a, **k):
        events.append(("plan", len(refs)))
        return real_plan(self, refs, *a, **k)

    def add(self, enc):
        events.append(("write", len(enc.counts)))
        return real_add(self, enc)
    monkeypatch.setattr(planner_mod.Planner, "plan_all", plan_all)
    monkeypatch.setattr(writer.ChunkWriter, "add", add)
    p = tmp_path / "s.ckz"
    ckptzip.save(state, p, window=500_000)
    kinds = [e[0] for e in events]
    assert kinds.count("plan") >= 3 and kinds[0] == "plan" and "write" in kinds[:kinds.index("plan", 1) + 1]
    assert sum(n for e, n in events if e == "plan") == len(state)
    out = ckptzip.load(p)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    with ckptzip.open(p) as r:
        r.verify()
        assert r.manifest.doc["version"] == [1, 3]
        assert r.storages[-1]["transforms"][0]["id"] == "derived"
    assert HEADER.unpack(p.read_bytes()[:HEADER.size])[2] == 3
    # file objects and reuse_plan keep planning everything first
    events.clear()
    ckptzip.save(state, p, window=500_000, reuse_plan=True)
    assert [e[0] for e in events][:1] == ["plan"] and [e[0] for e in events].count("plan") == 1
    import io
    buf = io.BytesIO()
    events.clear()
    ckptzip.save(state, buf, window=500_000)
    assert [e[0] for e in events].count("plan") == 1
    assert HEADER.unpack(buf.getvalue()[:HEADER.size])[2] == 3

    class Flip:  # a rotate-16 answer that changes at every question (kernels ready mid-save)
        n = 0

        def __bool__(self):
            self.n += 1
            return self.n % 2 == 1
    monkeypatch.setattr(planner_mod, "ROT16_ON_CPU", Flip())
    ckptzip.save(state, p, window=500_000)
    with ckptzip.open(p) as r:
        rot = [t.get("rotate") for s in r.storages for t in s.get("transforms", []) if t["id"] == "byteplane"
               and s["elem"] == "float32"]
    assert len(rot) == 6 and len(set(rot)) == 1  # one choice for every batch


def test_writer_keeps_checksums_computed_on_the_gpu(tmp_path):
    """A pooled window whose rows already hold some chunks' checksums (an async save hashes
    its packed GPU windows on the GPU) is written with those values as given; the writer
    hashes only the other chunks (so a wrong given value would stand: the GPU suite checks the
    kernel's values against xxhash)."""
    import xxhash
    from ckptzip.engine.memory import PINNED
    from ckptzip.format import ROW
    from ckptzip.io import ChunkWriter
    g = torch.Generator().manual_seed(4)
    stored = np.array([300, 17, 1000, 5000], dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum((stored + 15) // 16 * 16)[:-1]])
    host = PINNED.acquire(int(offs[-1] + stored[-1]))
    host.copy_(torch.randint(0, 256, (host.numel(),), dtype=torch.uint8, generator=g))
    rel = np.zeros(len(stored), ROW)
    rel["offset"], rel["stored"], rel["raw"] = offs, stored, stored
    h = host.numpy()
    want = [xxhash.xxh3_64_intdigest(h[o:o + n].tobytes()) for o, n in zip(offs, stored)]
    rel["xxh3"][[0, 2]] = [want[0], 12345]  # chunk 2: a given value, kept as given
    with open(tmp_path / "w.bin", "wb", buffering=0) as f:
        f.write(bytes(16))
        w = ChunkWriter(f, 16, writeback=False)
        w.add_pooled(host, rel, np.array([0, 2]))
        rows = w.finish()
    assert rows["xxh3"].tolist() == [want[0], want[1], 12345, want[3]]
    assert rows["offset"].tolist() == (offs + 16).tolist()


def test_load_builds_the_tree_while_the_reader_reads(tmp_path, monkeypatch):
    """ckptzip.load builds the object tree (views of the output storages) on the caller's thread
    while the reader thread reads the first groups; the decoded tensors then fill those views:
    same values, Parameters, shared storages and numpy arrays as before. An error raised while
    building ends the load with that error and stops the reader thread."""
    import threading
    import ckptzip
    from ckptzip import api
    from ckptzip.errors import CorruptFileError
    seen = []
    real = api.decode_jobs

    def spy(*a, **k):
        seen.append(a[5] if len(a) > 5 else k.get("idle"))
        return real(*a, **k)
    monkeypatch.setattr(api, "decode_jobs", spy)
    g = torch.Generator().manual_seed(8)
    w = torch.nn.Parameter(torch.randn(300, 300, generator=g))
    state = {"w": w, "tied": w, "rows": w.data[1:], "i": torch.arange(5), "a": np.arange(6.0).reshape(2, 3),
             "h": torch.randn(1000, generator=g).half()}
    p = tmp_path / "t.ckz"
    ckptzip.save(state, p)
    out = ckptzip.load(p)
    assert seen and seen[0] is not None
    assert isinstance(out["w"], torch.nn.Parameter) and out["w"].requires_grad
    assert torch.equal(out["w"].detach(), w.detach()) and torch.equal(out["rows"], w.data[1:])
    assert out["rows"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert torch.equal(out["i"], state["i"]) and torch.equal(out["h"], state["h"])
    assert np.array_equal(out["a"], state["a"])
    from ckptzip.tree import Decoder
    before = sum(t.name == "ckptzip-reader" for t in threading.enumerate())

    def bad(self, n, depth=0):
        raise CorruptFileError("invalid object tree: test")
    monkeypatch.setattr(Decoder, "decode", bad)
    with pytest.raises(CorruptFileError, match="test"):
        ckptzip.load(p)
    assert sum(t.name == "ckptzip-reader" and t.is_alive() for t in threading.enumerate()) <= before


def _fused_lib():
    from ckptzip import native
    if native.lib is None or not native.lib.zstd_version():
        pytest.skip("no C extension or no system libzstd (the two-step decode runs)")
    return native.lib


def _fused_case(seed: int, width: int, nwords: int, block: int, chunk: int, coded_share: float):
    """Words, and a read buffer with their byteplane stream cut into chunks (each plane of each
    block into chunks of ``chunk`` words), a share of them zstd frames, the rest stored, at
    gappy offsets; the rows (structured ROW array) and each chunk's offset in the buffer."""
    import zstandard
    from ckptzip.format import FLAG_STORED_RAW, ROW
    rng = np.random.default_rng(seed)
    words = (rng.standard_normal(nwords) * 0.02).astype({2: np.float16, 4: np.float32, 8: np.float64}[width])
    stream = BytePlane(width, block).encode(torch.from_numpy(words.view(np.uint8).copy())).numpy()
    raws = []
    for s0 in range(0, nwords, block):
        m = min(block, nwords - s0)
        for _plane in range(width):
            raws.extend(min(chunk, m - c) for c in range(0, m, chunk))
    parts, rows, soffs, pos, at = [], np.zeros(len(raws), ROW), [], 0, 0
    for i, r in enumerate(raws):
        piece = stream[pos:pos + r].tobytes()
        pos += r
        coded = rng.random() < coded_share
        data = zstandard.ZstdCompressor(write_content_size=bool(i % 2)).compress(piece) if coded else piece
        gap = int(rng.integers(0, 20))
        parts.append(bytes(gap) + data)
        soffs.append(at + gap)
        at += gap + len(data)
        rows[i]["raw"], rows[i]["stored"] = r, len(data)
        rows[i]["flags"] = 0 if coded else FLAG_STORED_RAW
    src = np.frombuffer(b"".join(parts) + bytes(8), dtype=np.uint8)
    return words, src, rows, np.asarray(soffs, dtype=np.int64)


def _fused_table(rows, tf, nbytes):
    """One batch's planes_fused table (engine.decode._fused_tables of that batch alone), or None
    where the batch cannot be decoded so."""
    from ckptzip.engine.decode import _fused_tables
    if not len(rows):
        return None
    cols, ok = _fused_tables(rows, *(np.asarray([x], dtype=np.int64) for x in (len(rows), tf.width, tf.block, nbytes)))
    return cols if bool(ok[0]) else None


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(1, 3000), st.integers(1, 1200), st.integers(1, 700),
       st.floats(0, 1), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_fused_planes_decode_equals_the_words(width, nwords, block, chunk, coded_share, parts, seed):
    """``planes_fused`` (byteplane inverse and zstd in one pass, stored planes read in place)
    gives back the words for any block and chunk sizes and any mix of stored and zstd chunks,
    decoded in any number of word ranges (the pool's threads split large batches); words
    outside a call's range are not written."""
    lib = _fused_lib()
    words, src, rows, soffs = _fused_case(seed, width, nwords, block, chunk, coded_share)
    t = _fused_table(rows, BytePlane(width, block), nwords * width)
    assert t is not None
    t = [*t[:3], soffs, t[3]]  # (planes_fused's columns: the source offsets before the sizes)
    dst = np.full(nwords * width, 0xA5, dtype=np.uint8)
    cuts = sorted({0, nwords, *np.random.default_rng(seed).integers(0, nwords + 1, parts - 1).tolist()})
    for w0, w1 in zip(cuts, cuts[1:]):
        assert lib.planes_fused(src, dst, width, *t, w0, w1) is None
        assert bytes(dst[w1 * width:]) == b"\xa5" * (len(dst) - w1 * width)
    assert bytes(dst) == words.view(np.uint8).tobytes()


def test_fused_planes_refuses_bad_tables_and_frames():
    """Tables are checked before anything is decoded (ValueError: a chunk outside the source,
    a gap, overlap or disorder in a plane, a stored chunk whose size is not its words', an
    unknown kind, buffers that overlap, a word range outside dst); a frame that is not one
    zstd frame of exactly its words is (index, message), as the zstd decoder reports it."""
    lib = _fused_lib()
    words, src, rows, soffs = _fused_case(5, 4, 1000, 400, 150, 0.5)
    t = _fused_table(rows, BytePlane(4, 400), 4000)
    t = [*t[:3], soffs, t[3]]
    dst = np.zeros(4000, np.uint8)
    assert lib.planes_fused(src, dst, 4, *t, 0, 1000) is None
    stored = np.nonzero(t[0] < 256)[0]
    coded = np.nonzero(t[0] >= 256)[0]
    assert len(stored) and len(coded)

    def changed(col, i, v):
        u = [c.copy() for c in t]
        u[col][i] = v
        return u
    k = int(stored[1])
    for col, i, v in [(3, k, len(src)), (3, k, -1), (4, k, t[4][k] + 1), (1, k, t[1][k] + 1), (2, k, t[2][k] - 1),
                      (0, k, 2 * 256 + t[0][k]), (0, k, 4), (0, k, -1), (2, k, 0)]:
        with pytest.raises(ValueError):
            lib.planes_fused(src, dst, 4, *changed(col, i, v), 0, 1000)
    swap = [c.copy() for c in t]
    for c in swap:
        c[[k, k + 1]] = c[[k + 1, k]]
    with pytest.raises(ValueError):
        lib.planes_fused(src, dst, 4, *swap, 0, 1000)
    with pytest.raises(ValueError):
        lib.planes_fused(src, dst, 4, *[c[:-1] for c in t], 0, 1000)  # the last plane falls short
    for w0, w1 in [(-1, 10), (10, 5), (0, 1001)]:
        with pytest.raises(ValueError):
            lib.planes_fused(src, dst, 4, *t, w0, w1)
    with pytest.raises(ValueError):
        lib.planes_fused(src, dst, 3, *t, 0, 1000)
    with pytest.raises(ValueError, match="overlap"):
        both = np.zeros(len(src) + 4000, np.uint8)
        both[:len(src)] = src
        lib.planes_fused(both, both[len(src) - 8:len(src) + 3992], 4, *t, 0, 1000)
    c = int(coded[0])
    bad = src.copy()
    bad[t[3][c]:t[3][c] + 4] = 0  # not a zstd frame any more
    got = lib.planes_fused(bad, dst, 4, *t, 0, 1000)
    assert got is not None and got[0] == c and "not a zstd frame" in got[1]
    short = changed(4, c, t[4][c] - 1)  # the frame cut short
    got = lib.planes_fused(src, dst, 4, *short, 0, 1000)
    assert got is not None and got[0] == c


def _fused_queue_case(seed: int, cases: list):
    """Several planes_fused pieces over one shared source: (source, [(words, width, table)])."""
    srcs, got, base = [], [], 0
    for k, (w, nw, block, chunk, share) in enumerate(cases):
        words, src, rows, soffs = _fused_case(seed + k, w, nw, block, chunk, share)
        t = _fused_table(rows, BytePlane(w, block), nw * w)
        got.append((words, w, [*t[:3], (soffs + base).astype(np.int64), t[3]]))
        srcs.append(src)
        base += len(src)
    return np.concatenate(srcs), got


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 4, 8]), st.integers(1, 2000), st.integers(1, 800),
                          st.integers(1, 500), st.floats(0, 1)), min_size=1, max_size=6),
       st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_fused_queue_decodes_every_piece_once_across_threads(cases, threads, seed):
    """``planes_fused_many``: threads sharing one queue (order, counter) decode every piece
    exactly as ``planes_fused`` does, in any order, each piece once (the counter ends past the
    last item)."""
    import threading
    lib = _fused_lib()
    src, pieces = _fused_queue_case(seed, cases)
    dsts = [np.full(words.nbytes, 0xA5, np.uint8) for words, _w, _t in pieces]
    items = [(d, w, *t, 0, words.size, None) for d, (words, w, t) in zip(dsts, pieces)]
    order = np.random.default_rng(seed).permutation(len(items)).astype(np.int64)
    counter = np.zeros(2, np.int64)
    res = []
    ths = [threading.Thread(target=lambda: res.append(lib.planes_fused_many(src, items, order, counter)))
           for _ in range(threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert res == [None] * threads and counter[0] >= len(items) and counter[1] == 0
    for d, (words, _w, _t) in zip(dsts, pieces):
        assert bytes(d) == words.view(np.uint8).tobytes()


def test_fused_planes_verify_every_chunk_they_read():
    """A word range that starts inside a chunk (callers cut where every plane's chunks start,
    but the C code does not rely on it) verifies that chunk too: a damaged one is reported, not
    decoded."""
    from ckptzip import native
    from ckptzip.format import checksum
    lib = _fused_lib()
    if not native.XXH3:
        pytest.skip("XXH3 is not available to the C extension")
    words, src, rows, soffs = _fused_case(9, 4, 4096, 4096, 1024, 0.5)
    t = _fused_table(rows, BytePlane(4, 4096), 4 * 4096)
    t = [*t[:3], soffs, t[3]]
    sums = np.array([checksum(memoryview(src)[o:o + n]) for o, n in zip(soffs.tolist(), t[4].tolist())], dtype=np.uint64)
    bad = src.copy()
    bad[soffs[0]] ^= 1  # plane 0's first chunk: words 0..1023
    dst = np.zeros(4 * 4096, np.uint8)
    assert lib.planes_fused(bad, dst, 4, *t, 512, 4096, sums) == (0, "checksum")
    assert not dst.any()
    assert lib.planes_fused(bad, dst, 4, *t, 1024, 4096, sums) is None


def test_fused_queue_refuses_bad_input_before_decoding():
    """Every item of a queue is checked before any is decoded (a bad table in the last item, an
    order that is not a permutation, an item that is not a tuple: nothing written); a damaged
    chunk is (item, chunk, "checksum") and stops the other takers (counter[1])."""
    from ckptzip import native
    from ckptzip.format import checksum
    lib = _fused_lib()
    src, pieces = _fused_queue_case(11, [(4, 900, 300, 100, 0.5), (2, 700, 200, 90, 0.5), (4, 500, 500, 120, 0.3)])
    dsts = [np.zeros(words.nbytes, np.uint8) for words, _w, _t in pieces]
    items = [(d, w, *t, 0, words.size, None) for d, (words, w, t) in zip(dsts, pieces)]
    order = np.arange(3, dtype=np.int64)
    bad = list(items)
    last = list(bad[2])
    last[4] = last[4].copy()
    last[4][0] += 1  # (a gap in a plane)
    bad[2] = tuple(last)
    with pytest.raises(ValueError):
        lib.planes_fused_many(src, bad, order, np.zeros(2, np.int64))
    for o in (np.array([0, 1, 3], np.int64), np.array([0, 1], np.int64), np.array([0, -1, 2], np.int64)):
        with pytest.raises(ValueError):
            lib.planes_fused_many(src, items, o, np.zeros(2, np.int64))
    for o in (np.array([0, 0, 2], np.int64), np.array([2, 2, 2], np.int64)):  # (not a permutation)
        with pytest.raises(ValueError):
            lib.planes_fused_many(src, items, o, np.zeros(2, np.int64))
    with pytest.raises(ValueError):
        lib.planes_fused_many(src, items, order, np.zeros(1, np.int64))
    with pytest.raises(ValueError):  # (the shared counter must start at a position, not before)
        lib.planes_fused_many(src, items, order, np.array([-1, 0], np.int64))
    with pytest.raises(TypeError):
        lib.planes_fused_many(src, [items[0], list(items[1]), items[2]], order, np.zeros(2, np.int64))
    assert not any(d.any() for d in dsts)
    # items parsed from a snapshot: Python code run while parsing (a width's __index__) may
    # change the caller's list without the parse reading freed items
    mutable = list(items)

    class Width:
        def __index__(self):
            mutable.clear()
            return 4
    mutable[0] = (items[0][0], Width(), *items[0][2:])
    assert lib.planes_fused_many(src, mutable, order, np.zeros(2, np.int64)) is None
    for d, (words, _w, _t) in zip(dsts, pieces):
        assert bytes(d) == words.view(np.uint8).tobytes()
        d[:] = 0
    if not native.XXH3:
        return
    sums = [np.array([checksum(memoryview(src)[o:o + n]) for o, n in zip(t[3].tolist(), t[4].tolist())],
                     dtype=np.uint64) for _words, _w, t in pieces]
    items = [(d, w, *t, 0, words.size, x) for d, (words, w, t), x in zip(dsts, pieces, sums)]
    broken = src.copy()
    k = int(pieces[1][2][3][2])  # item 1's third chunk
    broken[k] ^= 1
    counter = np.zeros(2, np.int64)
    assert lib.planes_fused_many(broken, items, order, counter) == (1, 2, "checksum")
    assert counter[1] == 1
    counter = np.zeros(2, np.int64)
    assert lib.planes_fused_many(src, items, order, counter) is None
    for d, (words, _w, _t) in zip(dsts, pieces):
        assert bytes(d) == words.view(np.uint8).tobytes()


def test_fused_queue_post_steps_equal_the_python_inverses():
    """A queued piece's post step (expgrid's and expref's inverse on its words once decoded)
    gives what ``planes_fused`` then ``exp_grid`` / ``exp_ref`` give, on pieces starting
    anywhere in the grid; bad steps (an unknown kind, words past the grid, a reference of
    another length or overlapping dst, 2-byte words) are refused before anything is written."""
    lib = _fused_lib()
    src, pieces = _fused_queue_case(4, [(4, 3000, 700, 150, 0.6), (8, 1000, 300, 120, 0.5)])
    rng = np.random.default_rng(4)
    rr = rng.integers(0, 40000, 60).astype(np.int32)
    cc = rng.integers(-3000, 3000, 130).astype(np.int32)
    refw = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32)
    for (words, w, t) in pieces:
        nb, nw = words.nbytes, words.size
        for post in (("grid", rr, cc, 17), ("ref", refw.view(np.uint8)[:nb])):
            want = np.zeros(nb, np.uint8)
            assert lib.planes_fused(src, want, w, *t, 0, nw) is None
            if post[0] == "grid":
                lib.exp_grid(want.copy(), want, rr, cc, 17, 1)
            else:
                lib.exp_ref(want.copy(), want, post[1], 1)
            got = np.zeros(nb, np.uint8)
            cut = nw // 3
            items = [(got, w, *t, 0, cut, None, post), (got, w, *t, cut, nw, None, post)]
            assert lib.planes_fused_many(src, items, np.arange(2, dtype=np.int64), np.zeros(2, np.int64)) is None
            assert bytes(got) == bytes(want)
    words, w, t = pieces[0]
    dst = np.zeros(words.nbytes, np.uint8)
    for post in (("nope", rr), ("grid", rr, cc, 60 * 130 - 10), ("grid", rr[:2], cc[:3], 0), ("ref", refw.view(np.uint8)[:8]),
                 ("ref", dst), ("grid", rr, cc), 5):
        with pytest.raises((ValueError, TypeError)):
            lib.planes_fused_many(src, [(dst, w, *t, 0, words.size, None, post)], np.zeros(1, np.int64),
                                  np.zeros(2, np.int64))
    w2, _w, t2 = _fused_queue_case(5, [(2, 400, 100, 50, 0.5)])[1][0]
    src2 = _fused_queue_case(5, [(2, 400, 100, 50, 0.5)])[0]
    with pytest.raises(ValueError):
        lib.planes_fused_many(src2, [(np.zeros(800, np.uint8), 2, *t2, 0, 400, None, ("ref", np.zeros(800, np.uint8)))],
                              np.zeros(1, np.int64), np.zeros(2, np.int64))
    assert not dst.any()


@pytest.mark.parametrize("via", ["path", "bytesio"])
def test_damaged_fused_chunk_reported_before_a_forged_small_one(tmp_path, via):
    """A group whose fused pieces hold a damaged chunk and whose small storages hold a forged
    frame (checksum recomputed) reports the ChecksumError, as when the small storages were
    decoded after the pieces (now they are decoded beside them)."""
    import io
    from conftest import read_parts, write_parts
    from ckptzip import format as fmt
    g = torch.Generator().manual_seed(0)
    st = {"big": torch.randn(1 << 20, generator=g) * 1e-3, "small": torch.randn(8000, generator=g) * 1e-3}
    p = tmp_path / "p.ckz"
    ckptzip.save(st, p, device="cpu", chunk_size=1 << 16)
    data, doc, rows = read_parts(p)
    d = bytearray(data)
    d[int(rows[0]["offset"]) + 3] ^= 0xFF  # the big storage's first chunk, checksum left
    k = int(np.nonzero(rows["flags"] != fmt.FLAG_STORED_RAW)[0][-1])  # the small storage's frame
    o, n = int(rows[k]["offset"]), int(rows[k]["stored"])
    d[o + 4:o + n] = bytes(n - 4)
    rows[k]["xxh3"] = fmt.checksum(bytes(d[o:o + n]))
    q = tmp_path / "q.ckz"
    write_parts(q, bytes(d), doc, rows)
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(io.BytesIO(q.read_bytes()) if via == "bytesio" else q)


@pytest.mark.parametrize("queue", [True, False])
def test_fused_queue_and_one_call_per_piece_load_alike(tmp_path, monkeypatch, queue):
    """Loads with the pieces in one C queue or one call each are the same, and a damaged chunk
    in a queued piece is a ChecksumError either way."""
    import io
    from conftest import read_parts, write_parts
    from ckptzip.engine import decode
    monkeypatch.setattr(decode, "QUEUE_PIECES", queue)
    st, p = _mixed_small_file(tmp_path, monkeypatch)
    for src in (p, io.BytesIO(p.read_bytes())):
        back = ckptzip.load(src)
        for k, v in st.items():
            assert torch.equal(back[k], v), k
    data, doc, rows = read_parts(p)
    k = int(np.argmax(rows["stored"]))
    off = int(rows[k]["offset"]) + 5
    q = tmp_path / "bad.ckz"
    write_parts(q, data[:off] + bytes([data[off] ^ 1]) + data[off + 1:], doc, rows)
    for src in (q, io.BytesIO(q.read_bytes())):
        with pytest.raises(ckptzip.ChecksumError):
            ckptzip.load(src)


def test_fused_planes_verify_their_chunks_first():
    """With the chunk table's checksums, ``planes_fused`` verifies every chunk whose words start
    in its range before it decodes anything: a damaged stored or zstd chunk is (index,
    "checksum") and the destination is left as it was; a checksum column of another length is
    a ValueError."""
    from ckptzip import native
    from ckptzip.format import checksum
    lib = _fused_lib()
    if not native.XXH3:
        pytest.skip("XXH3 is not available to the C extension")
    words, src, rows, soffs = _fused_case(7, 4, 1000, 400, 150, 0.5)
    t = _fused_table(rows, BytePlane(4, 400), 4000)
    t = [*t[:3], soffs, t[3]]
    sums = np.array([checksum(memoryview(src)[o:o + n]) for o, n in zip(soffs.tolist(), t[4].tolist())],
                    dtype=np.uint64)
    dst = np.zeros(4000, np.uint8)
    assert lib.planes_fused(src, dst, 4, *t, 0, 1000, sums) is None
    assert bytes(dst) == words.view(np.uint8).tobytes()
    for kind in (0, 1):
        i = int(np.nonzero((t[0] >> 8) == kind)[0][-1])
        bad = src.copy()
        bad[soffs[i]] ^= 1
        dst = np.full(4000, 7, np.uint8)
        assert lib.planes_fused(bad, dst, 4, *t, 0, 1000, sums) == (i, "checksum")
        assert bytes(dst) == b"\x07" * 4000
        # a range whose words do not start that chunk does not verify it
        w0 = int(t[1][i])
        if w0 > 0:
            assert lib.planes_fused(bad, dst, 4, *t, 0, w0, sums) is None
    with pytest.raises(ValueError):
        lib.planes_fused(src, dst, 4, *t, 0, 1000, sums[:-1])


@given(st.lists(st.integers(0, 5000), min_size=0, max_size=20), st.integers(0, 2**32 - 1))
def test_native_xxh3_equals_xxhash(lens, seed):
    """``xxh3_many`` (XXH3-64 taken from the xxhash package's extension) gives xxhash's own
    checksums for chunks of any length at any offset; chunks outside the buffer are refused."""
    from ckptzip import native
    from ckptzip.format import checksum
    if not native.XXH3:
        pytest.skip("XXH3 is not available to the C extension")
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, sum(lens) + len(lens) * 3 + 1, dtype=np.uint8)
    offs = np.array([sum(lens[:k]) + 3 * k + int(rng.integers(0, 3)) for k in range(len(lens))], dtype=np.int64)
    z = np.array(lens, dtype=np.int64)
    got = np.zeros(len(lens), dtype=np.uint64)
    native.lib.xxh3_many(buf, offs, z, got)
    assert got.tolist() == [checksum(memoryview(buf)[o:o + n]) for o, n in zip(offs.tolist(), lens)]
    with pytest.raises(ValueError):
        native.lib.xxh3_many(buf, np.array([len(buf) - 1], np.int64), np.array([2], np.int64), got[:1])


def test_checksums_in_c_equal_python(monkeypatch):
    """The reader's checksums (any subset of the chunks, large batches in parts on the read pool)
    are the same in C and in Python."""
    from ckptzip import native
    from ckptzip.io import reader
    if not native.XXH3:
        pytest.skip("XXH3 is not available to the C extension")
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    sizes = rng.integers(0, 5000, 150)
    offs = np.cumsum(sizes) - sizes
    which = rng.random(150) < 0.6
    for parallel in (False, True):
        monkeypatch.setattr(reader, "HASH_PARALLEL_MIN", 0 if parallel else 1 << 40)
        for w in (None, which):
            c = reader.checksums(buf, offs, sizes, w)
            monkeypatch.setattr(native, "XXH3", False)
            py = reader.checksums(buf, offs, sizes, w)
            monkeypatch.setattr(native, "XXH3", True)
            assert c == py


@pytest.mark.parametrize("run", [64, 2 << 20])
def test_cpu_encoding_checksums_equal_the_writers(tmp_path, monkeypatch, run):
    """CPU groups' chunks are hashed by the encoding (in C, in runs on the pool) into
    ``Encoded.xxh3``, which the writer takes: every chunk's checksum equals xxhash's of its
    bytes, and the file is byte for byte the one written with the checksums computed by the
    writer in Python (small and large storages, raw and coded chunks, several codec calls)."""
    from ckptzip import native
    from ckptzip.engine import encode as E
    from ckptzip.format import checksum
    if not native.XXH3:
        pytest.skip("XXH3 is not available to the C extension")
    monkeypatch.setattr(E, "HASH_RUN", run)
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(300_000, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
             "i": torch.arange(5000), "z": torch.zeros(4096), "step": torch.tensor(3.0)}
    seen = []
    real = E.encode_group_arrays

    def spy(units):
        enc = real(units)
        seen.append(enc)
        return enc
    monkeypatch.setattr("ckptzip.pipeline.encode_group_arrays", spy)
    ckptzip.save(state, tmp_path / "c.ckz", device="cpu")
    assert seen and all(e.xxh3 is not None for e in seen)
    for e in seen:
        views = [memoryview(t.numpy().reshape(-1)) for t in e.tensors]
        want = [checksum(views[t][o:o + n]) for t, o, n in zip(e.src.tolist(), e.soff.tolist(), e.stored.tolist())]
        assert e.xxh3.tolist() == want
    monkeypatch.setattr(native, "XXH3", False)
    seen.clear()
    ckptzip.save(state, tmp_path / "p.ckz", device="cpu")
    assert seen and all(e.xxh3 is None for e in seen)
    assert (tmp_path / "c.ckz").read_bytes() == (tmp_path / "p.ckz").read_bytes()
    out = ckptzip.load(tmp_path / "c.ckz")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_fused_table_falls_back_for_chunks_across_planes():
    """A batch whose chunks span two planes (valid, never written by ckptzip) gets no fused
    table: the two-step decode takes it, and the file loads bit-exact either way."""
    from ckptzip.format import ROW
    rows = np.zeros(3, ROW)
    rows["raw"] = [600, 600, 400]  # planes of 400 bytes (block 400 words of width 4)
    assert _fused_table(rows, BytePlane(4, 400), 1600) is None
    rows = np.zeros(4, ROW)
    rows["raw"] = 400
    assert _fused_table(rows, BytePlane(4, 400), 1600) is not None


def test_huge_pages_advise_whole_pages_only():
    """New load outputs ask for 2 MiB pages: only whole 2 MiB pages inside the buffer are
    advised (none for small buffers), the buffer's bytes are the caller's, and the switch
    turns it off."""
    from ckptzip import native
    from ckptzip.engine import memory
    if native.lib is None:
        pytest.skip("no C extension")
    a = np.empty(9 << 20, np.uint8)
    got = native.lib.huge_pages(a)
    assert got % (2 << 20) == 0 and got <= a.nbytes
    assert native.lib.huge_pages(np.empty(1 << 20, np.uint8)) == 0
    t = memory.empty_bytes(40 << 20)
    t.fill_(7)
    assert int(t.sum()) == 7 * (40 << 20)


def _craft_planes(path, words: np.ndarray, block: int, per_plane):
    """A one-storage file of ``words`` (float32 or float64) under ``byteplane`` with chunk sizes
    chosen per plane (``per_plane(plane, m)``: raw sizes of that plane's chunks in a block of
    ``m`` words), every chunk a zstd frame (stored raw where it does not shrink)."""
    import json
    import zstandard
    from ckptzip import format as fmt
    w = words.dtype.itemsize
    stream = BytePlane(w, block).encode(torch.from_numpy(words.view(np.uint8).copy())).numpy().tobytes()
    data, rows_all, pos = bytearray(fmt.pack_header(0)), [], 0
    n = len(words)
    for s0 in range(0, n, block):
        m = min(block, n - s0)
        for k in range(w):
            sizes = per_plane(k, m)
            assert sum(sizes) == m
            for r in sizes:
                piece = stream[pos:pos + r]
                pos += r
                blob = zstandard.ZstdCompressor(level=1).compress(piece)
                coded = len(blob) < r
                blob = blob if coded else piece
                while len(data) % 16:
                    data.append(0)
                rows_all.append((len(data), len(blob), r, fmt.checksum(blob), 0 if coded else fmt.FLAG_STORED_RAW))
                data += blob
    while len(data) % 16:
        data.append(0)
    rows = np.zeros(len(rows_all), fmt.ROW)
    for k, r in enumerate(rows_all):
        rows[k] = r
    dt = str(words.dtype)
    doc = {"format": "ckz", "version": [1, 0], "created_by": "test", "meta": {}, "n_chunks": len(rows),
           "storages": [{"nbytes": words.nbytes, "elem": dt, "device": "cpu",
                         "transforms": [{"id": "byteplane", "width": w, "block": block}], "codec": {"id": "zstd"},
                         "rows": [0, len(rows)]}],
           "root": {"t": "dict", "k": ["x"], "v": [{"t": "tensor", "s": 0, "dtype": dt, "shape": [n], "stride": [1],
                                                  "offset": 0}]}}
    manifest = fmt.pack_manifest(doc, rows)
    with open(path, "wb") as f:
        f.write(bytes(data) + manifest + fmt.pack_footer(len(data), manifest))


def test_fused_pieces_cut_only_where_every_plane_starts_a_chunk(tmp_path, monkeypatch):
    """A batch is cut between threads only where all its planes start a chunk, so no chunk is
    decoded twice and a call's scratch covers its own words (planes in one 2 MiB frame each
    beside a plane in 64 KiB chunks: one piece); the file loads bit-exact."""
    from ckptzip import native
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import decode
    lib = _fused_lib()
    monkeypatch.setattr(decode, "FUSED_MIN", 1 << 10)
    monkeypatch.setattr(ccpu, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(decode, "cpu_threads", lambda: 8)
    rng = np.random.default_rng(3)
    n = 1 << 21
    words = (rng.standard_normal(n) * 0.02).astype(np.float32)
    calls = []

    from conftest import FusedSpy
    hashed = []  # (whether each piece's call verified its chunks itself: native.XXH3)
    monkeypatch.setattr(native, "lib", FusedSpy(lib, lambda *a: calls.append((a[8], a[9])) or hashed.append(
        a[10] is not None)))
    cases = {"uneven": lambda k, m: [m] if k < 3 else [1 << 16] * (m >> 16),
             "even": lambda k, m: [1 << 18] * (m >> 18)}
    for name, per_plane in cases.items():
        p = tmp_path / f"{name}.ckz"
        _craft_planes(p, words, n, per_plane)
        calls.clear()
        back = ckptzip.load(p)["x"]
        assert bytes(back.numpy().view(np.uint8)) == bytes(words.view(np.uint8))
        if name == "uneven":
            assert calls == [(0, n)]
        else:
            assert len(calls) > 1 and all(w0 % (1 << 18) == 0 for w0, _w1 in calls)
    # a damaged chunk in a later piece (its checksum is verified by the thread that decodes the
    # piece, just before, in Python or inside planes_fused): ChecksumError, and that piece is
    # never handed to planes_fused without its checksums
    from conftest import read_parts, write_parts
    for pieces, c_hash in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(decode, "VERIFY_IN_PIECES", pieces)
        monkeypatch.setattr(native, "XXH3", native.XXH3 and c_hash)
        data, doc, rows = read_parts(p)
        k = len(rows) - 2  # plane 3's next-to-last chunk: words 1.5-1.75 Mi
        off = int(rows[k]["offset"]) + int(rows[k]["stored"]) // 2
        q = tmp_path / f"bad{pieces}{c_hash}.ckz"
        write_parts(q, data[:off] + bytes([data[off] ^ 0x40]) + data[off + 1:], doc, rows)
        calls.clear()
        hashed.clear()
        with pytest.raises(ckptzip.ChecksumError):
            ckptzip.load(q)
        assert not any(w0 <= 3 << 19 < w1 and not h for (w0, w1), h in zip(calls, hashed))


def test_fused_skips_reference_words_wider_than_the_planes_words():
    """An ``expgrid``/``expref`` storage under byteplane width 2 (valid, never written) is not
    fused: a piece could start inside one of the reference transform's 4-byte words."""
    from ckptzip.codecs.cpu import ZstdCPU
    from ckptzip.engine.decode import Job, _fusable

    class InPlace:
        in_place, word = True, 4
    out = torch.empty(16, dtype=torch.uint8)
    assert not _fusable(Job(None, BytePlane(2, 4), ZstdCPU(), out, InPlace()))
    assert _fusable(Job(None, BytePlane(4, 4), ZstdCPU(), out, InPlace())) == _fusable(Job(None, BytePlane(4, 4), ZstdCPU(), out))


def test_fused_scratch_freed_when_its_thread_exits():
    """The decoding context and scratch kept per thread go when the thread exits (a caller's
    short-lived threads decode small batches inline): 40 threads, each decoding 4 MiB of zstd
    planes, leave resident memory within 64 MiB of where it was."""
    import threading
    lib = _fused_lib()
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc")
    words, src, rows, soffs = _fused_case(9, 4, 1 << 20, 1 << 20, 1 << 20, 1.0)
    t = _fused_table(rows, BytePlane(4, 1 << 20), 4 << 20)
    t = [*t[:3], soffs, t[3]]
    dst = np.empty(4 << 20, np.uint8)

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def one():
        assert lib.planes_fused(src, dst, 4, *t, 0, 1 << 20) is None
    one()
    before = rss()
    for _ in range(40):
        th = threading.Thread(target=one)
        th.start()
        th.join()
    assert rss() - before < 64 << 20
    assert bytes(dst) == words.view(np.uint8).tobytes()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 4, 8]), st.integers(1, 400), st.integers(1, 120), st.integers(1, 90),
                          st.booleans()), min_size=1, max_size=6), st.integers(0, 2**32 - 1))
def test_fused_tables_of_many_batches_equal_one_by_one(batches, seed):
    """The tables of a group's batches, built in one numpy pass, are each batch's own table; a
    batch whose chunks span planes is refused alone, its neighbours keep theirs."""
    from ckptzip.engine.decode import _fused_tables
    from ckptzip.format import FLAG_STORED_RAW, ROW

    def _fused_table(rows, tf, nbytes):  # the per-batch code _fused_tables replaced, frozen here
        w, blk = tf.width, tf.block
        raws = rows["raw"].astype(np.int64)
        if nbytes % w or not len(raws) or bool((raws <= 0).any()):
            return None
        pos = np.cumsum(raws) - raws
        bi = pos // (blk * w)
        m = np.minimum(blk, nbytes // w - bi * blk)
        within = pos - bi * (blk * w)
        plane = within // m
        off = within - plane * m
        if bool((off + raws > m).any()):
            return None
        kind = (rows["flags"] != FLAG_STORED_RAW).astype(np.int64)
        return [plane + 256 * kind, bi * blk + off, raws, rows["stored"].astype(np.int64)]
    parts, alone, meta = [], [], []
    for k, (width, nwords, block, chunk, across) in enumerate(batches):
        _w, _s, rows, _o = _fused_case(seed + k, width, nwords, block, chunk, 0.5)
        if across and len(rows) > 1:  # two chunks merged: spans planes where they are in two
            merged = np.zeros(len(rows) - 1, ROW)
            merged[:] = rows[1:]
            merged["raw"][0] += rows["raw"][0]
            rows = merged
        parts.append(rows)
        alone.append(_fused_table(rows, BytePlane(width, block), nwords * width))
        meta.append((len(rows), width, block, nwords * width))
    counts, widths, blocks, nbytes = (np.asarray(c, dtype=np.int64) for c in zip(*meta))
    cols, ok = _fused_tables(np.concatenate(parts), counts, widths, blocks, nbytes)
    at = 0
    for rows, one, good in zip(parts, alone, ok.tolist()):
        assert good == (one is not None)
        if good:
            for a, b in zip(one, cols):
                assert np.array_equal(a, b[at:at + len(rows)])
        at += len(rows)


@pytest.mark.parametrize("balanced", [False, True])
def test_pmap_returns_or_raises_only_when_every_item_is_done(balanced):
    """The CPU pool's maps (``pmap``; ``pmap_balanced``, which the calling thread works in too)
    raise an item's error only after every other item has finished: a decode that fails on one
    piece never leaves another still writing into the caller's tensors."""
    import time
    from ckptzip.codecs.cpu import pmap, pmap_balanced
    done = []

    def fn(i):
        if i == 0:
            raise ValueError("piece 0")
        time.sleep(0.2)
        done.append(i)
    with pytest.raises(ValueError, match="piece 0"):
        if balanced:
            pmap_balanced(fn, [9.0, 1.0, 1.0, 1.0], 0.0)
        else:
            pmap(fn, 4)
    assert sorted(done) == [1, 2, 3]


def test_pmap_balanced_runs_every_item_once_costliest_first(monkeypatch):
    """The fused decode's scheduler: every item runs exactly once, the costliest first, and the
    calling thread takes tasks too (errors: see the test above)."""
    import threading
    import time
    from ckptzip.codecs import cpu as ccpu
    costs = [5.0, 1.0, 9.0, 1.0, 1.0, 7.0, 0.5, 0.5]
    ran, who, lock = [], set(), threading.Lock()

    def fn(k):
        time.sleep(0.01)
        with lock:
            ran.append(k)
            who.add(threading.current_thread().name)
    monkeypatch.setattr(ccpu, "cpu_threads", lambda: 2)
    ccpu.pmap_balanced(fn, costs, least=2.0)
    assert sorted(ran) == list(range(len(costs)))
    assert "MainThread" in who and any(n.startswith("ckptzip_") for n in who)
    monkeypatch.setattr(ccpu, "cpu_threads", lambda: 1)  # (one thread: the order itself)
    ran.clear()
    ccpu.pmap_balanced(fn, costs, least=2.0)
    assert ran == [2, 5, 0, 1, 3, 4, 6, 7]


@pytest.mark.parametrize("threads", [1, 2])
def test_pmap_balanced_first_runs_on_the_caller_and_its_error_waits_for_the_items(monkeypatch, threads):
    """``first`` runs once, on the calling thread, before the caller takes items (the pool's
    threads start on the costliest meanwhile); its error is raised only once every item has
    finished, and before an item's."""
    import threading
    import time
    from ckptzip.codecs import cpu as ccpu
    monkeypatch.setattr(ccpu, "cpu_threads", lambda: threads)
    log, lock = [], threading.Lock()

    bad = []

    def fn(k):
        time.sleep(0.02)
        with lock:
            log.append((k, threading.current_thread().name))
        if k in bad:
            raise KeyError("item")

    def first():
        time.sleep(0.05)
        with lock:
            log.append(("first", threading.current_thread().name))
        raise ValueError("first")
    with pytest.raises(ValueError, match="first"):
        ccpu.pmap_balanced(fn, [3.0, 2.0, 1.0], 0.0, first)
    assert sorted(str(k) for k, _n in log) == ["0", "1", "2", "first"]
    assert ("first", "MainThread") in log
    if threads == 1:
        assert log[0][0] == "first"
    else:  # (the pool's thread began on the costliest meanwhile)
        assert log[0][0] == 0 and log[0][1].startswith("ckptzip_")
    log.clear()  # (an item's error alone; on one thread the items stop at it)
    bad.append(1)
    with pytest.raises(KeyError):
        ccpu.pmap_balanced(fn, [3.0, 2.0, 1.0], 0.0, lambda: log.append(("first", threading.current_thread().name)))
    assert "first" in [k for k, _n in log] and 1 in [k for k, _n in log]
    log.clear()  # (both: first's)
    with pytest.raises(ValueError, match="first"):
        ccpu.pmap_balanced(fn, [3.0, 2.0, 1.0], 0.0, first)


@pytest.mark.usefixtures("no_pack")
def test_in_memory_load_builds_the_tree_while_the_pool_decodes(tmp_path, monkeypatch):
    """From memory, the caller's work (``idle``: the object tree) runs on the calling thread
    inside the first group's decode while the pool's threads take its fused pieces; an error
    it raises comes once every piece is done, and the load is bit-exact either way."""
    import io
    import time
    from ckptzip.engine import decode
    st, p = _mixed_small_file(tmp_path, monkeypatch)
    data = p.read_bytes()
    for k, v in ckptzip.load(io.BytesIO(data)).items():
        assert torch.equal(v, st[k]), k
    real, seen = decode.decode_group, []

    def spy(*a, **kw):
        first = a[8] if len(a) > 8 else kw.get("first")
        seen.append(first is not None)
        return real(*a, **kw)
    monkeypatch.setattr(decode, "decode_group", spy)
    for k, v in ckptzip.load(io.BytesIO(data)).items():
        assert torch.equal(v, st[k]), k
    assert seen and seen[0] and not any(seen[1:])
    from ckptzip import native
    if native.lib is None:  # (no fused pieces: idle runs before the group's two-step decode)
        return
    # an error in idle: raised once the group's pieces are done (nothing still writing: the
    # fused storage is whole when the error arrives)
    r = ckptzip.open(io.BytesIO(data))
    jobs = {i: r._job(i) for i in range(len(r.storages))}
    outs = {i: j.out for i, j in jobs.items()}
    for o in outs.values():
        o.zero_()
    batch, breaks, _copies, _fresh = r._plan_fill(outs, jobs)
    big = r._storage_index(r._node("big"))

    def idle():
        time.sleep(0.05)
        raise RuntimeError("tree")
    with pytest.raises(RuntimeError, match="tree"):
        decode.decode_jobs(r._fd, batch, breaks=breaks, idle=idle)
    assert bytes(outs[big].numpy()) == bytes(st["big"].numpy().view(np.uint8))
    r.close()


def test_raw_plane_estimates_made_ahead_give_the_same_file(monkeypatch):
    """CPU saves estimate their raw planes on a pool thread while planning goes on: the file is
    byte for byte the one the estimates made in turn give, and every estimate is used."""
    from ckptzip import native
    from ckptzip.engine import planner as P
    if native.lib is None:
        pytest.skip("the estimates are made ahead only with the C extension")
    g = torch.Generator().manual_seed(2)
    obj = {f"w{i}": torch.randn(70_000 + 1000 * i, generator=g) * (i + 1) for i in range(4)}
    obj["h"] = torch.randn(80_000, generator=g).bfloat16()
    obj["small"] = torch.randn(100, generator=g)
    obj["zeros"] = torch.zeros(90_000)
    used = []
    real = P.Planner._raw_planes

    def spy(self, ref, width):
        if self._ahead is not None and self._ahead[0] is not None:  # (finished first: halves
            for f in self._ahead[0]:                                 # still queued are made inline)
                f.result()
        used.append(self._ahead is not None and id(ref) in self._ahead[1])
        return real(self, ref, width)
    monkeypatch.setattr(P.Planner, "_raw_planes", spy)
    a = io.BytesIO()
    ckptzip.save(obj, a, device="cpu")
    assert used and sum(used) == 6  # (the 100-element storage is not estimated)
    monkeypatch.setattr(P.Planner, "estimate_ahead", lambda self, refs: None)
    b = io.BytesIO()
    ckptzip.save(obj, b, device="cpu")
    assert a.getvalue() == b.getvalue()


def test_raw_plane_estimates_queued_behind_other_work_are_not_waited_for(monkeypatch):
    """Estimates still queued when planning needs them (the CPU pool busy with another save or
    load) are cancelled and made on the planning thread, each half in the one call the pool
    would have made (not storage by storage): the save does not wait for the pool's queue, and
    writes the same file."""
    import threading
    import time
    from ckptzip import native
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import planner as P
    if native.lib is None:
        pytest.skip("the estimates are made ahead only with the C extension")
    one_by_one = []
    real = P.cpu_raw_planes
    monkeypatch.setattr(P, "cpu_raw_planes", lambda *a: one_by_one.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    obj = {f"w{i}": torch.randn(70_000, generator=g) for i in range(3)}
    want = io.BytesIO()
    ckptzip.save(obj, want, device="cpu")
    gate = threading.Event()
    busy = [ccpu._pool().submit(gate.wait, 5) for _ in range(ccpu.cpu_threads())]
    try:
        t = time.perf_counter()
        got = io.BytesIO()
        ckptzip.save(obj, got, device="cpu")
        took = time.perf_counter() - t
    finally:
        gate.set()
        for f in busy:
            f.result()
    assert took < 2.5 and got.getvalue() == want.getvalue()
    assert not one_by_one


def test_raw_plane_estimates_split_between_the_pool_and_the_planner(monkeypatch):
    """The estimates go to the pool in two halves; each still queued when planning needs it is
    made on the planning thread in one call (while the other may run on the pool): with the
    pool's threads all busy, both halves are made there, every storage exactly once, and the
    file is the same."""
    import threading
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import planner as P
    from ckptzip import native
    if native.lib is None:
        pytest.skip("the estimates are made ahead only with the C extension")
    g = torch.Generator().manual_seed(8)
    obj = {f"w{i}": torch.randn(70_000, generator=g) for i in range(5)}
    want = io.BytesIO()
    monkeypatch.setattr(P.Planner, "estimate_ahead", lambda self, refs: None)
    ckptzip.save(obj, want, device="cpu")
    monkeypatch.undo()
    calls = []
    real = native.lib.plane_entropy_many

    class Lib:
        def __getattr__(self, name):
            return getattr(lib, name)

        def plane_entropy_many(self, srcs, *a):
            calls.append((threading.current_thread().name, len(srcs)))
            return real(srcs, *a)
    lib = native.lib
    monkeypatch.setattr(native, "lib", Lib())
    gate = threading.Event()
    busy = [ccpu._pool().submit(gate.wait, 5) for _ in range(ccpu.cpu_threads())]
    try:
        got = io.BytesIO()
        ckptzip.save(obj, got, device="cpu")
    finally:
        gate.set()
        for f in busy:
            f.result()
    assert got.getvalue() == want.getvalue()
    assert sorted(n for _t, n in calls) == [2, 3]  # (5 storages: halves of 2 and 3, each made once)
    assert all(t == threading.current_thread().name for t, _n in calls)


def test_cpu_save_pieces_and_runs_give_the_same_file(monkeypatch):
    """A CPU save cuts its byteplane transforms into pieces (TF_PIECE) and its zstd calls into
    runs (ZSTD_RUNS_PER_THREAD), taken by whichever thread is free: the file is byte for byte the
    same however they are cut, and loads back exactly."""
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import encode as E
    g = torch.Generator().manual_seed(4)
    obj = {"w": torch.randn(700_000, generator=g), "h": torch.randn(300_001, generator=g).bfloat16(),
           "m": torch.randn(5000, generator=g), "i": torch.arange(100_000)}
    monkeypatch.setattr(ccpu, "ZSTD_PARALLEL_BYTES", 1 << 16)
    outs = []
    for piece, per in ((1 << 30, 1), (4096 + 8, 4), (1 << 16, 16)):
        monkeypatch.setattr(E, "TF_PIECE", piece)
        monkeypatch.setattr(ccpu, "ZSTD_RUNS_PER_THREAD", per)
        b = io.BytesIO()
        ckptzip.save(obj, b, device="cpu", chunk_size=64 << 10)
        outs.append(b.getvalue())
    assert outs[0] == outs[1] == outs[2]
    got = ckptzip.load(io.BytesIO(outs[1]))
    assert all(torch.equal(got[k].view(torch.uint8) if got[k].is_floating_point() else got[k],
                           obj[k].view(torch.uint8) if obj[k].is_floating_point() else obj[k]) for k in obj)


def test_load_outputs_are_freed_without_the_garbage_collector(tmp_path):
    """A load leaves no reference cycle holding its jobs or tensors: the caller's ``del`` frees
    the loaded storages at once (a recursive closure in the job planning kept every job, and so
    every output, alive until the collector ran; the next load faulted in new memory)."""
    import gc
    from ckptzip.engine import Job
    g = torch.Generator().manual_seed(1)
    obj = {"w": torch.randn(200_000, generator=g), "v": torch.randn(9, generator=g).bfloat16(), "i": torch.arange(9)}
    p = tmp_path / "c.ckz"
    ckptzip.save(obj, p)
    b = io.BytesIO()
    ckptzip.save(obj, b)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for src in (p, io.BytesIO(b.getvalue())):
            out = ckptzip.load(src)
            del out
            gc.collect()
            held = [x for x in gc.garbage if isinstance(x, (Job, torch.Tensor))]
            gc.garbage.clear()
            assert not held
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()


def _mixed_small_file(tmp_path, monkeypatch):
    """A CPU-written file of small storages (two steps), a 60 KB one, fused ones cut into pieces
    (FUSED_MIN 32 KiB, 8 threads, 64 KiB chunks) and raw chunks: ``(state, path)``."""
    from ckptzip.codecs import cpu as ccpu
    from ckptzip.engine import decode
    monkeypatch.setattr(decode, "FUSED_MIN", 32 << 10)
    monkeypatch.setattr(ccpu, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(decode, "cpu_threads", lambda: 8)
    g = torch.Generator().manual_seed(5)
    st = {f"s{i}": torch.randn(40 * (i + 1), generator=g) for i in range(20)}
    st["mid"] = torch.randn(30_000, generator=g).half()
    st["big"] = torch.randn(600_000, generator=g)
    st["big8"] = torch.randn(200_000, generator=g).double()
    st["noise"] = torch.randint(0, 255, (300_000,), dtype=torch.uint8, generator=g)
    p = tmp_path / "m.ckz"
    ckptzip.save(st, p, device="cpu", chunk_size=1 << 16)
    return st, p


@pytest.mark.parametrize("via", ["path", "bytesio"])
@pytest.mark.parametrize("split", [True, False])
def test_every_fused_chunk_is_verified_before_it_is_decoded(tmp_path, monkeypatch, via, split):
    """Whoever verifies a chunk (the reader, or the thread that decodes its piece), every chunk
    ``planes_fused`` reads for a piece's words has passed its checksum before the call: files
    and file objects, split reads on and off, batches cut into pieces."""
    import io
    import threading
    from ckptzip import native
    if native.lib is None:
        pytest.skip("fused batches are decoded by the C extension")
    from ckptzip.engine import decode
    from ckptzip.format import checksum
    from ckptzip.io import reader
    verified, calls, lock = set(), [], threading.Lock()
    real_verify, lib = reader._verify, native.lib

    def spy_verify(batch, ks, got):
        real_verify(batch, ks, got)
        with lock:
            verified.update(int(x) for x in batch["xxh3"][ks].astype(np.uint64).tolist())

    def pf(s, dst, w, planes, ws, wn, so, ss, w0, w1, xxh):
        hit = (ws < w1) & (ws + wn > w0)  # the chunks the C code reads for w0..w1
        with lock:
            for i in np.nonzero(hit)[0].tolist():
                got = checksum(memoryview(s)[so[i]:so[i] + ss[i]])
                if xxh is not None:  # verified by the call itself: every chunk it reads
                    assert int(xxh[i]) == got, "a chunk decoded unverified"
                else:
                    assert got in verified, "a chunk decoded before its checksum"
            calls.append(w0)
    from conftest import FusedSpy
    monkeypatch.setattr(reader, "_verify", spy_verify)
    monkeypatch.setattr(native, "lib", FusedSpy(lib, pf))
    monkeypatch.setattr(decode, "SPLIT_READS", split)
    st, p = _mixed_small_file(tmp_path, monkeypatch)
    back = ckptzip.load(io.BytesIO(p.read_bytes()) if via == "bytesio" else p)
    for k, v in st.items():
        assert torch.equal(back[k], v), k
    assert any(w0 > 0 for w0 in calls)  # (batches were cut into pieces)


@pytest.mark.parametrize("c_hash", [True, False])
@pytest.mark.parametrize("pieces", [True, False, "large groups"])
def test_each_damaged_chunk_of_a_mixed_state_is_a_checksum_error(tmp_path, monkeypatch, pieces, c_hash):
    """One byte changed in any chunk (small two-step storages, fused pieces, raw chunks) is a
    ChecksumError, whether the decoding threads or the reader verify the fused batches (the
    reader does for groups it hashes on the read pool's threads: ``large groups``), with the
    checksums computed in C or by xxhash's Python API."""
    import io
    from conftest import read_parts, write_parts
    from ckptzip import native
    from ckptzip.engine import decode
    monkeypatch.setattr(native, "XXH3", native.XXH3 and c_hash)
    monkeypatch.setattr(decode, "VERIFY_IN_PIECES", bool(pieces))
    if pieces == "large groups":
        monkeypatch.setattr(decode, "HASH_PARALLEL_MIN", 0)
    st, p = _mixed_small_file(tmp_path, monkeypatch)
    plans = []
    real_plan = decode._fused_plan
    monkeypatch.setattr(decode, "_fused_plan", lambda rows, grp, **kw: plans.append(real_plan(rows, grp, **kw)) or plans[-1])
    assert torch.equal(ckptzip.load(p)["big"], st["big"])
    if native.lib is not None:  # (fused batches are the C extension's; without it, two steps)
        assert any(pl is not None for pl in plans)
        assert all(pl.verify == (pieces is True) for pl in plans if pl is not None)
    data, doc, rows = read_parts(p)
    q = tmp_path / "bad.ckz"
    for k in range(0, len(rows), 3):
        off = int(rows[k]["offset"]) + int(rows[k]["stored"]) // 2
        write_parts(q, data[:off] + bytes([data[off] ^ 0x5A]) + data[off + 1:], doc, rows)
        with pytest.raises(ckptzip.ChecksumError):
            ckptzip.load(io.BytesIO(q.read_bytes()) if k % 2 else q)


def test_fused_plans_whole_batch_costs_are_the_piece_costs(tmp_path, monkeypatch):
    """A fused plan's per-batch costs, made in one numpy pass, equal :func:`_piece_cost` over
    each batch's words (coded and stored planes, batches cut into pieces or not)."""
    from ckptzip import native
    from ckptzip.engine import decode
    st, p = _mixed_small_file(tmp_path, monkeypatch)
    plans = []
    real_plan = decode._fused_plan
    monkeypatch.setattr(decode, "_fused_plan", lambda rows, grp, **kw: plans.append(real_plan(rows, grp, **kw)) or plans[-1])
    assert torch.equal(ckptzip.load(p)["big8"], st["big8"])
    if native.lib is None:
        pytest.skip("fused batches are the C extension's")
    seen = 0
    for pl in filter(None, plans):
        assert len(pl.costs) == len(pl.items)
        for it, cost in zip(pl.items, pl.costs):
            job, a, b = it[:3]
            assert cost == decode._piece_cost(it, 0, (b - a) // job.tf.width)
            seen += cost > b - a  # (a batch with coded planes)
    assert seen


@pytest.mark.usefixtures("no_pack")
def test_small_cpu_float_storages_skip_the_byteplane_transform():
    """CPU saves store float storages under CPU_MIN_TRANSFORMED bytes (biases, norms, Adam's step
    counters) as one zstd frame of whole words, not one frame per byte plane; larger ones keep
    their byte planes; both load back bit for bit, and with transform="byteplane" asked for, small
    ones keep it too."""
    from ckptzip.engine import planner as P
    g = torch.Generator().manual_seed(7)
    n = P.CPU_MIN_TRANSFORMED // 4
    obj = {"step": torch.tensor(3.0), "bias": torch.randn(n - 1, generator=g), "w": torch.randn(n, generator=g),
           "h": torch.randn(2 * n, generator=g).bfloat16()}
    for tf, small_planes in (("auto", False), ("byteplane", True)):
        b = io.BytesIO()
        ckptzip.save(obj, b, device="cpu", transform=tf)
        with ckptzip.open(io.BytesIO(b.getvalue())) as r:
            ids = {k: [t["id"] for t in r.storages[x["s"]].get("transforms", [])] for k, x in r._tensor_nodes().items()}
            rows = {k: r.storages[x["s"]]["rows"][1] for k, x in r._tensor_nodes().items()}
        assert ids["w"] == ["byteplane"] and ids["h"] == ["byteplane"] and rows["w"] >= 4
        assert (ids["step"] == ids["bias"] == ["byteplane"]) if small_planes else (ids["step"] == ids["bias"] == [])
        assert small_planes or rows["step"] == rows["bias"] == 1
        got = ckptzip.load(io.BytesIO(b.getvalue()))
        assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), obj[k].reshape(-1).view(torch.uint8)) for k in obj)


@pytest.mark.usefixtures("no_pack")
def test_small_storages_without_planes_keep_whole_words_per_chunk():
    """The plan of a small storage without byte planes rounds an odd ``chunk_size`` down to whole
    words, so a bf16 copy of a float32 storage is still stored as ``derived`` (its words may not
    be split between chunks)."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, generator=g)
    obj = {"w": w, "h": w.bfloat16()}
    for cs in (64, 65, 67):
        b = io.BytesIO()
        ckptzip.save(obj, b, device="cpu", chunk_size=cs)
        with ckptzip.open(io.BytesIO(b.getvalue())) as r:
            ids = {k: [t["id"] for t in r.storages[x["s"]].get("transforms", [])] for k, x in r._tensor_nodes().items()}
        assert ids["h"] == ["derived"], (cs, ids)
        got = ckptzip.load(io.BytesIO(b.getvalue()))
        assert torch.equal(got["h"].view(torch.int16), obj["h"].view(torch.int16)) and torch.equal(got["w"], w)


def test_rotate16_keeps_a_constant_sign_coded(monkeypatch):
    """Raw planes chosen on the whole-word rotation, then moved to ``rotate`` 16: the sign moves
    from plane 0 to plane 2, so a float32 storage whose sign never changes (Adam's v without
    expgrid) keeps plane 2 coded, and stores no more than under the whole-word rotation."""
    import io
    import ckptzip
    from ckptzip.engine import planner as planner_mod
    from ckptzip.engine.planner import rot16_raw_planes
    assert rot16_raw_planes(frozenset({1, 2})) == frozenset({1})
    assert rot16_raw_planes(frozenset({0, 1, 2})) == frozenset({0, 1, 2})
    assert rot16_raw_planes(frozenset({0, 1})) == frozenset({0, 1})
    g = torch.Generator().manual_seed(0)
    v = {"v": (torch.randn(400_000, generator=g) * 1e-3) ** 2}  # (positive: a constant sign bit)
    sizes = {}
    for rot in (False, True):
        monkeypatch.setattr(planner_mod, "ROT16_ON_CPU", rot)
        b = io.BytesIO()
        ckptzip.save(v, b, device="cpu")
        sizes[rot] = len(b.getvalue())
        assert torch.equal(ckptzip.load(io.BytesIO(b.getvalue()))["v"], v["v"])
    assert sizes[True] <= sizes[False] * 1.001, sizes
