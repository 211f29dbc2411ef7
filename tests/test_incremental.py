"""Format 1.1: derived tensors (a cast of another storage) and incremental checkpoints (delta/xor
against a base file): detection, bit-exact round trips, choices, base errors, chains, validation."""
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip.engine.refplan import find_derived
from ckptzip.transforms.refs import cast16
from ckptzip.tree import Encoder
from conftest import assert_same, check_newer_minor, check_rotate16_paths, read_parts, write_parts


def transforms_of(path):
    with ckptzip.open(path) as r:
        return [[t["id"] for t in s.get("transforms", [])] for s in r.storages]


def mixed_state(seed=0, n=4, d=64):
    g = torch.Generator().manual_seed(seed)
    w = {f"l{i}.w": torch.randn(d, d, generator=g) * 0.02 for i in range(n)}
    w["b"] = torch.zeros(d)
    m = {k: torch.randn(v.shape, generator=g) * 1e-3 for k, v in w.items()}
    return {"model": w, "model_bf16": {k: v.to(torch.bfloat16) for k, v in w.items()},
            "optimizer": {"m": m, "v": {k: (x * x) for k, x in m.items()}}, "step": 7}


def nudge(state, seed, scale=1e-4):
    g = torch.Generator().manual_seed(seed)
    w = {k: v + torch.randn(v.shape, generator=g) * scale for k, v in state["model"].items()}
    return {"model": w, "model_bf16": {k: v.to(torch.bfloat16) for k, v in w.items()},
            "optimizer": {k: {n: x * 0.99 for n, x in d.items()} for k, d in state["optimizer"].items()},
            "step": state["step"] + 1}


# -- casts and derived detection --------------------------------------------------------------
def test_cast16_matches_torch_except_nan():
    x = torch.randn(1 << 16) * torch.logspace(-45, 38, 1 << 16)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), dtype=torch.int32).view(torch.float32)
    for src in (x, bits, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 1e-45, 65520.0])):
        for to, dt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            got = cast16(src.view(torch.uint8), to)
            want = src.to(dt).view(torch.int16)
            ok = ~torch.isnan(src)
            assert torch.equal(got[ok], want[ok])
            assert (got[~ok] == (0x7FC0 if to == "bfloat16" else 0x7E00)).all()


def test_cast16_bfloat16_in_c_matches_the_formula(monkeypatch):
    """The C cast (_bpnative.cast_bf16) gives the numpy formula's bits on every high half-word
    with the low halves that decide rounding (ties, carries into the exponent, overflow to
    infinity, subnormals, NaN payloads), on random words, and from an unaligned source; it
    refuses a wrong output size and overlapping buffers."""
    from ckptzip import native
    from ckptzip.transforms import refs
    if native.lib is None:
        pytest.skip("the C extension is not built")
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x7FFE, 0x4000], dtype=np.uint32)
    u = np.concatenate([(hi[:, None] | lows[None, :]).reshape(-1),
                        np.random.default_rng(3).integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)])
    buf = np.zeros(u.nbytes + 1, dtype=np.uint8)
    buf[1:] = u.view(np.uint8)
    for src in (u.view(np.uint8), buf[1:]):  # (aligned, and one byte off)
        got = refs._np_cast16(src, "bfloat16")
        with monkeypatch.context() as m:
            m.setattr(native, "lib", None)
            want = refs._np_cast16(src, "bfloat16")
        assert got.dtype == want.dtype and np.array_equal(got, want)
    with pytest.raises(ValueError):
        native.lib.cast_bf16(u.view(np.uint8), np.empty(len(u) - 1, dtype=np.uint16))
    with pytest.raises(ValueError):
        native.lib.cast_bf16(u.view(np.uint8)[:3], np.empty(1, dtype=np.uint16))
    with pytest.raises(ValueError):  # out inside src
        native.lib.cast_bf16(buf[:16], buf[:16].view(np.uint8)[:8])
    with pytest.raises(ValueError):  # other of another length than out
        native.lib.cast_bf16(u.view(np.uint8), np.empty(len(u), dtype=np.uint16), np.empty(len(u) - 1, dtype=np.uint16))


def _edge_floats(n: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    """``n`` float32 values over every magnitude (subnormals to overflow) with NaNs, infinities
    and rounding ties to bfloat16; and the generator, for more."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(n, generator=g) * torch.logspace(-44, 38, n)
    f[::97] = float("nan")
    f[1::89] = float("inf")
    f[2::83] = torch.tensor(1.0).view(torch.int32).add(0x8000).view(torch.float32)  # a tie
    return f, g


def test_derived_in_one_c_pass_matches_the_prediction(monkeypatch):
    """``derived`` to bfloat16 on the host (the cast and the xor in one C pass) encodes and decodes
    the same bytes as the prediction then the xor, in place too, on values with NaNs, infinities,
    ties and subnormals."""
    from ckptzip import native
    from ckptzip.transforms.refs import Derived
    if native.lib is None:
        pytest.skip("the C extension is not built")
    f, g = _edge_floats(5000, 11)
    ref = f.view(torch.uint8)
    data = (f + torch.randn(5000, generator=g) * 1e-3).bfloat16().view(torch.uint8)
    tf = Derived(0).bind(ref)
    res = tf.encode(data)
    back = torch.empty_like(data)
    tf.decode(res, back)
    assert torch.equal(back, data)
    inplace = res.clone()
    tf.decode(inplace, inplace)  # (other is out)
    assert torch.equal(inplace, data)
    with monkeypatch.context() as m:
        m.setattr(native, "lib", None)
        assert torch.equal(Derived(0).bind(ref).encode(data), res)
    for start in (0, 1234):  # a piece of the storage: words from ``start``
        piece = torch.empty(2000, dtype=torch.uint8)
        tf.decode(res[2 * start:2 * start + 2000], piece, start=2 * start)
        assert torch.equal(piece, data[2 * start:2 * start + 2000])


def test_derived_pair_mismatches_counted_in_c_match_torch(monkeypatch):
    """The planner's count of words where a bfloat16 storage differs from the cast of its float32
    source (one C pass per pair on the CPU pool) equals torch's count, pairs of float16 and of
    other sizes beside them, on values with NaNs and infinities."""
    from ckptzip import native
    from ckptzip.engine import refplan
    if native.lib is None:
        pytest.skip("the C extension is not built")
    f, g = _edge_floats(3000, 5)
    b = f.bfloat16()
    b.view(torch.int16)[::37] ^= 1  # 82 words changed
    small = torch.randn(40, generator=g)
    st = {"f": f, "b": b, "h": f.half(), "s": small, "sb": small.bfloat16()}
    enc = Encoder()
    enc.encode(st)
    refs = enc.storages
    pairs = [(1, 0, "bfloat16"), (2, 0, "float16"), (4, 3, "bfloat16")]
    got = refplan._mismatches_many(refs, pairs)
    with monkeypatch.context() as m:
        m.setattr(native, "lib", None)
        want = refplan._mismatches_many(refs, pairs)
    # (the changed words, and the NaNs: torch's CPU cast made them 0xFFFF, the prediction 0x7FC0)
    assert got == want and got[0] >= len(range(0, 3000, 37)) and got[2] == 0
    u = f.view(torch.uint8).numpy()
    assert native.lib.cast_bf16_diff(u, cast16(f.view(torch.uint8), "bfloat16").numpy()) == 0
    with pytest.raises(ValueError):
        native.lib.cast_bf16_diff(u, np.zeros(10, dtype=np.uint16))


def test_derived_detection_pairs_by_values():
    st = mixed_state()
    st["half"] = {k: v.half() for k, v in st["model"].items()}
    st["other_bf16"] = torch.randn(64, 64).bfloat16()  # same numel, no source
    enc = Encoder()
    enc.encode(st)
    found = find_derived(enc.storages)
    keys = list(st["model"])
    nsrc = len(keys)
    # model storages are 0..n-1; bf16 copies n..2n-1; optimizer m/v 2n..4n-1; half 4n..5n-1
    for j in range(nsrc):
        assert found[nsrc + j].storage == j and found[nsrc + j].to == "bfloat16"
        assert found[4 * nsrc + j].storage == j and found[4 * nsrc + j].to == "float16"
    assert 5 * nsrc not in found  # other_bf16


@pytest.mark.parametrize("slice_", [1 << 24, 300])
def test_batched_mismatch_counts_equal_per_pair_counts(monkeypatch, slice_):
    """find_derived counts the differing elements of all candidate pairs of one size and cast
    together (stacked slices; pairs above the slice size one by one): the same counts as pair
    by pair, NaNs and float16 included."""
    from ckptzip.engine import refplan
    monkeypatch.setattr(refplan, "VERIFY_SLICE", slice_)
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(n, generator=g) for n in (100, 100, 100, 1000, 7)]
    srcs[1][3] = float("nan")
    tgts = []
    for k, s in enumerate(srcs):
        to = torch.float16 if k == 2 else torch.bfloat16
        t = s.to(to).clone()
        t.view(torch.int16)[: k * 3] ^= 1  # k*3 differing elements
        tgts.append(t)
    enc = Encoder()
    enc.encode({"s": srcs, "t": tgts})
    pairs = [(5 + k, k, "float16" if k == 2 else "bfloat16") for k in range(5)] + [(5, 1, "bfloat16")]
    got = refplan._mismatches_many(enc.storages, pairs)
    want = [int(refplan._mismatches(enc.storages[t].data, enc.storages[s].data, to)) for t, s, to in pairs]
    assert got == want and got[0] == 0 and got[3] == 9


@pytest.mark.usefixtures("no_pack")
def test_reused_derived_pairs_and_plans_stay_exact(tmp_path):
    """Saves that reuse plans (async_save, the manager) keep the derived pairs found for the same
    layout while the sampled elements still match; a copy that drifted, even everywhere but on
    the sampled elements, still comes back bit-exact (the residual is exact), and a copy that no
    longer matches is detected again."""
    from ckptzip.engine import refplan
    st = mixed_state(seed=5)
    paths = [tmp_path / f"{i}.ckz" for i in range(4)]
    ckptzip.async_save(st, paths[0]).wait()
    assert_same(ckptzip.load(paths[0]), st)
    assert "derived" in sum(transforms_of(paths[0]), [])
    nxt = nudge(st, 1)
    ckptzip.async_save(nxt, paths[1]).wait()
    assert_same(ckptzip.load(paths[1]), nxt)
    # drift everywhere except the probed elements: the pair is kept, the data stays exact
    bf = nxt["model_bf16"]["l0.w"].view(-1)
    keep = refplan._probe_idx(bf.numel(), bf.device)
    mask = torch.ones(bf.numel(), dtype=torch.bool)
    mask[keep] = False
    bf[mask] = torch.randn(int(mask.sum())).to(torch.bfloat16)
    ckptzip.async_save(nxt, paths[2]).wait()
    assert_same(ckptzip.load(paths[2]), nxt)
    # no longer a cast at all: detected again, exact
    nxt["model_bf16"]["l1.w"] = torch.randn(64, 64).to(torch.bfloat16)
    ckptzip.async_save(nxt, paths[3]).wait()
    assert_same(ckptzip.load(paths[3]), nxt)
    with ckptzip.open(paths[3]) as r:
        keys = r.keys()
        s_of = {t["key"]: t["storage"] for t in r.tensor_info()}
        tf = [[t["id"] for t in r.storages[s_of[k]].get("transforms", [])] for k in ("model_bf16.l1.w", "model_bf16.l2.w")]
    assert "derived" not in tf[0] and "derived" in tf[1], (keys, tf)


def test_reused_pairs_are_probed_in_turn():
    """With more pairs than ``PROBE_PAIRS``, each reuse probes the next ones in turn, so a copy
    that stopped being a cast is found within ``ceil(pairs / PROBE_PAIRS)`` saves."""
    from ckptzip.engine import refplan
    torch.manual_seed(7)
    n = refplan.PROBE_PAIRS * 2 + 5
    w = {f"w{i}": torch.randn(256 + i) for i in range(n)}
    st = {"w": w, "bf": {k: v.bfloat16() for k, v in w.items()}}

    def found():
        enc = Encoder()
        enc.encode(st)
        return refplan.find_derived(enc.storages, reuse=True)
    assert len(found()) == n
    st["bf"]["w3"] = torch.randn(259).bfloat16()  # same size, no longer a cast
    rounds = 0
    while len(found()) == n:
        rounds += 1
        assert rounds <= -(-n // refplan.PROBE_PAIRS)
    assert len(found()) == n - 1


@pytest.mark.usefixtures("no_pack")
def test_derived_round_trip_with_exceptions(tmp_path):
    st = mixed_state()
    bf = st["model_bf16"]["l1.w"]
    bf.view(-1)[:4] = torch.tensor([float("nan"), -0.0, 5.0, float("inf")], dtype=torch.bfloat16)
    st["model"]["l2.w"].view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    st["model"]["l2.w"].view(-1)[3:5].view(torch.int32)[:] = torch.tensor([0x7F800001, -0x7FFFFF])  # NaN payloads
    st["model_bf16"]["l2.w"] = st["model"]["l2.w"].to(torch.bfloat16)
    st["fp16"] = st["model"]["l3.w"].half()
    p = tmp_path / "d.ckz"
    info = ckptzip.save(st, p)
    assert info["derived_storages"] == len(st["model"]) + 1
    assert_same(ckptzip.load(p), st)
    raw = open(p, "rb").read()
    assert raw[8:12] == b"\x01\x00\x01\x00"  # header version 1.1
    plain = tmp_path / "plain.ckz"
    ckptzip.save(st, plain, derive=False)
    assert os.path.getsize(p) < os.path.getsize(plain) - st["model_bf16"]["l0.w"].numel()
    with ckptzip.open(p) as r:  # lazy access resolves the source too
        assert_same(r.get_tensor("model_bf16.l1.w"), st["model_bf16"]["l1.w"])
    # a file without derived/base stays a 1.0 file
    ckptzip.save({"a": torch.ones(3)}, tmp_path / "v10.ckz")
    assert open(tmp_path / "v10.ckz", "rb").read()[8:12] == b"\x01\x00\x00\x00"


def test_derived_not_used_when_copy_differs(tmp_path):
    st = mixed_state()
    st["model_bf16"]["l0.w"] = (st["model"]["l0.w"] * 1.5).bfloat16()
    p = tmp_path / "d.ckz"
    ckptzip.save(st, p)
    tfs = transforms_of(p)
    assert tfs[len(st["model"])][:1] != ["derived"]
    assert_same(ckptzip.load(p), st)


# -- incremental ----------------------------------------------------------------------------
def test_incremental_round_trip_and_gain(tmp_path):
    s1 = mixed_state(d=256)
    s2 = nudge(s1, 1)
    a, b, full = tmp_path / "a.ckz", tmp_path / "b.ckz", tmp_path / "full.ckz"
    ckptzip.save(s1, a)
    info = ckptzip.save(s2, b, base=a)
    ckptzip.save(s2, full)
    assert info["base"] == "a.ckz" and info["delta_storages"] > 0
    assert os.path.getsize(b) < 0.9 * os.path.getsize(full)
    assert_same(ckptzip.load(b), s2)
    assert ckptzip.base_chain(b) == [str(a)]
    assert ckptzip.base_chain(a) == []
    with ckptzip.open(b) as r:
        assert r.base["file"] == "a.ckz" and r.base["depth"] == 1
        assert_same(r.get_tensor("model.l0.w"), s2["model"]["l0.w"])
        r.verify()
    tfs = transforms_of(b)
    assert ["hidelta", "byteplane"] in tfs  # float32 against plain byteplane base storages (format 1.3)


def test_delta_only_where_it_pays(tmp_path):
    g = torch.Generator().manual_seed(3)
    s1 = {"same": torch.randn(300_000, generator=g) * 0.01, "noise": torch.randn(300_000, generator=g),
          "ints": torch.arange(1000)}
    s2 = {"same": s1["same"] + 1e-7 * torch.randn(300_000, generator=g),
          "noise": torch.randn(300_000, generator=g), "ints": torch.arange(1000) + 1}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    tfs = transforms_of(b)
    assert tfs[0][0] == "hidelta"       # slowly changing float32 weights: hidelta (format 1.3)
    assert tfs[1][:1] not in (["delta"], ["hidelta"])  # unrelated values: no reference
    assert_same(ckptzip.load(b), s2)


def test_xor_for_non_float_storages(tmp_path):
    s1 = {"ids": torch.arange(100_000, dtype=torch.int64) * 3}
    s2 = {"ids": s1["ids"].clone()}
    s2["ids"][::1000] += 1
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    assert transforms_of(b)[0] == ["xor"]
    assert_same(ckptzip.load(b), s2)


def _elem_tensor(dt, n, g):
    if dt.is_floating_point:
        x = torch.randn(n, generator=g).to(dt)
        return x
    return torch.randint(-1000, 1000, (n,), generator=g).to(dt)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 3000),
       dts=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                                     torch.uint8]), min_size=1, max_size=4),
       change=st.floats(0, 1), extra=st.booleans())
def test_incremental_hypothesis(tmp_path_factory, seed, n, dts, change, extra):
    tmp = tmp_path_factory.mktemp("h")
    g = torch.Generator().manual_seed(seed)
    s1 = {f"t{i}": _elem_tensor(dt, n + i, g) for i, dt in enumerate(dts)}
    s2 = {}
    for k, v in s1.items():
        w = v.clone()
        if w.numel():
            mask = torch.rand(w.shape, generator=g) < change
            w[mask] = _elem_tensor(v.dtype, int(mask.sum()), g)
        s2[k] = w
    if extra:  # a new key, a key whose shape changed, a view sharing storage
        s2["new"] = torch.randn(17, generator=g)
        s2["t0"] = torch.cat([s2["t0"], s2["t0"][:3]])
        s2["view"] = s2["t0"][1:]
    a, b = tmp / "a.ckz", tmp / "b.ckz"
    ckptzip.save(s1, a, chunk_size=1024)
    ckptzip.save(s2, b, base=a, chunk_size=1024)
    assert_same(ckptzip.load(b), s2)


def save_chain(tmp_path, name: str, seed: int, n: int = 4):
    """States ``s[0..n-1]`` (each nudged from the one before) saved as a chain: ``paths[0]``
    standalone, each later file against the one before. Returns (states, paths)."""
    s = [mixed_state(d=128)]
    for k in range(n - 1):
        s.append(nudge(s[-1], k + seed))
    paths = [tmp_path / f"{name}{k}.ckz" for k in range(n)]
    ckptzip.save(s[0], paths[0])
    for k in range(1, n):
        ckptzip.save(s[k], paths[k], base=paths[k - 1])
    return s, paths


@pytest.mark.usefixtures("no_pack")
def test_chain_of_three_and_moved_bases(tmp_path):
    s, paths = save_chain(tmp_path, "s", 10)
    for k in range(4):
        assert_same(ckptzip.load(paths[k]), s[k])
    assert ckptzip.base_chain(paths[3]) == [str(p) for p in paths[2::-1]]
    with ckptzip.open(paths[3]) as r:
        assert r.base["depth"] == 3
    # move the whole chain: found by relative paths
    moved = tmp_path / "moved"
    moved.mkdir()
    for p in paths:
        shutil.move(p, moved / p.name)
    assert_same(ckptzip.load(moved / "s3.ckz"), s[3])
    # move only the bases: base_dir finds them by file name, base_path names the nearest one
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(moved / "s3.ckz", other / "s3.ckz")
    with pytest.raises(ckptzip.BaseCheckpointError, match="s2.ckz"):
        ckptzip.load(other / "s3.ckz")
    assert_same(ckptzip.load(other / "s3.ckz", base_dir=moved), s[3])
    # base_path names the nearest base; its own bases are found relative to it
    assert_same(ckptzip.load(other / "s3.ckz", base_path=moved / "s2.ckz"), s[3])
    shutil.move(moved / "s1.ckz", other / "s1.ckz")
    with pytest.raises(ckptzip.BaseCheckpointError, match="s1.ckz"):
        ckptzip.load(other / "s3.ckz", base_path=moved / "s2.ckz")


@pytest.mark.usefixtures("no_pack")
def test_chain_loads_in_one_pipelined_pass(tmp_path, monkeypatch):
    """A chain of three incremental files loads in one decode pass (the bases' storages are read
    by jobs of the same pipeline, from their own files, ahead of the deltas), bit-exact, and
    progress counts this file's bytes only."""
    import ckptzip.api as api
    s, paths = save_chain(tmp_path, "c", 20)
    calls = []
    real = api.decode_jobs

    def spy(fd, jobs, *a, **k):
        calls.append({id(j.fd) if j.fd is not None else None for j in jobs})
        return real(fd, jobs, *a, **k)
    monkeypatch.setattr(api, "decode_jobs", spy)
    seen = []
    assert_same(ckptzip.load(paths[3], progress=lambda done, total: seen.append((done, total))), s[3])
    assert len(calls) == 1 and len(calls[0]) == 4  # this file (None) and its three bases
    assert seen and max(d for d, _t in seen) <= seen[0][1]


@pytest.mark.usefixtures("no_pack")
def test_base_missing_altered_replaced(tmp_path):
    s1 = mixed_state()
    s2 = nudge(s1, 5)
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    # replaced by another valid checkpoint
    ckptzip.save(nudge(s1, 6), a)
    with pytest.raises(ckptzip.BaseCheckpointError, match="a.ckz.*altered or replaced"):
        ckptzip.load(b)
    with pytest.raises(ckptzip.BaseCheckpointError, match="a.ckz"):
        ckptzip.base_chain(b)
    # missing
    os.remove(a)
    with pytest.raises(ckptzip.BaseCheckpointError, match="a.ckz.*missing"):
        ckptzip.load(b)
    with ckptzip.open(b) as r:  # metadata and keys stay readable without the base
        assert "model.l0.w" in r.keys()
        with pytest.raises(ckptzip.BaseCheckpointError):
            r.get_tensor("model.l0.w")
    # altered in place (same size): the manifest hash catches a changed chunk table
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    data, doc, rows = read_parts(a)
    doc["meta"]["x"] = "y"
    write_parts(a, data, doc, rows)
    with pytest.raises(ckptzip.BaseCheckpointError, match="altered"):
        ckptzip.load(b)
    # a flipped data byte keeps the manifest: the chunk checksum refuses it (never wrong data)
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    raw = bytearray(open(a, "rb").read())
    _, _, rows = read_parts(a)
    raw[int(rows["offset"][0])] ^= 0xFF
    open(a, "wb").write(bytes(raw))
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(b)


@pytest.mark.usefixtures("no_pack")
def test_base_is_not_a_checkpoint(tmp_path):
    s1 = mixed_state()
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(nudge(s1, 1), b, base=a)
    open(a, "wb").write(b"not a checkpoint at all" * 10)
    with pytest.raises(ckptzip.BaseCheckpointError, match="a.ckz"):
        ckptzip.load(b)


# -- manifest validation ----------------------------------------------------------------------
@pytest.fixture
def incr(tmp_path):
    s1 = mixed_state()
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(nudge(s1, 1), b, base=a)
    return b


@pytest.mark.parametrize("edit, err", [
    (lambda d: d["bases"][0].update(depth=0), "depth"),
    (lambda d: d["bases"][0].update(depth=65), "depth"),
    (lambda d: d["bases"][0].update(sha256="zz"), "sha256"),
    (lambda d: d["bases"][0].update(file="/etc/passwd"), "relative"),
    (lambda d: d["bases"][0].pop("size"), "must have file, sha256, size and depth"),
    (lambda d: d["bases"][0].pop("chains"), "storages with chains"),
    (lambda d: d["bases"][0].update(extra=1), "must have file"),
    (lambda d: d["bases"][0]["chains"][0].update(transforms=[{"id": "xor", "ref": {"base": 0, "storage": 0}}]),
     "only expgrid and/or byteplane"),
    (lambda d: d["bases"][0]["chains"][0].update(transforms=[{"id": "expref", "ref": {"storage": 0}}]),
     "only expgrid and/or byteplane"),
    (lambda d: d["bases"][0]["chains"][0].update(transforms=d["bases"][0]["chains"][0]["transforms"] * 2),
     "only expgrid and/or byteplane"),
    (lambda d: d["bases"][0]["chains"][0].update(transforms=d["bases"][0]["chains"][0]["transforms"] * 3),
     "chain 0"),
    (lambda d: d["bases"][0]["chains"][0].update(codec={"id": "zstd", "level": 3}), "zstd"),
    (lambda d: d["bases"][0]["storages"][0].__setitem__(3, 99), "storages entry"),
    (lambda d: d["bases"][0]["storages"].append(d["bases"][0]["storages"][0]), "storages entry"),
    (lambda d: d["bases"][0]["storages"][0].__setitem__(1, -1), "storages entry"),
    (lambda d: d.update(bases=[d["bases"][0], d["bases"][0]]), "at most"),
    (lambda d: d.pop("bases"), "base 0, which does not exist"),
])
@pytest.mark.usefixtures("no_pack")
def test_validation_of_bases(incr, tmp_path, edit, err):
    data, doc, rows = read_parts(incr)
    edit(doc)
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises((ckptzip.CorruptFileError, ckptzip.UnknownCodecError), match=err):
        ckptzip.open(q)


def test_located_base_storages_are_checked_against_the_base(tmp_path):
    """Format 1.3 base records locate the base storages the file needs (no parse of the base's
    document); a location beyond the base's chunk table, or chunks that do not add up to the
    storage, is a CorruptFileError; a missing or replaced base is still a BaseCheckpointError."""
    import ckptzip.api as api
    g = torch.Generator().manual_seed(2)
    w = torch.randn(100_000, generator=g) * 0.02
    s1, s2 = {"w": w, "v": w.clone()}, {"w": w + 1e-6, "v": w * 1.00001}
    a, b, q = tmp_path / "a.ckz", tmp_path / "b.ckz", tmp_path / "q.ckz"
    ckptzip.save(s1, a)
    ckptzip.save(s2, b, base=a)
    data, doc, rows = read_parts(b)
    assert [r[0] for r in doc["bases"][0]["storages"]] == [0, 1] and doc["version"] == [1, 3]
    opened = []
    real = api.open_base
    try:
        api.open_base = lambda *x, **k: (opened.append(1), real(*x, **k))[1]
        assert_same(ckptzip.load(b), s2)
    finally:
        api.open_base = real
    assert not opened  # the base's document was not read
    for edit in (lambda h: h.__setitem__(1, 10_000), lambda h: h.__setitem__(2, h[2] - 1)):
        _, doc, _ = read_parts(b)
        edit(doc["bases"][0]["storages"][0])
        write_parts(q, data, doc, rows)
        with pytest.raises(ckptzip.CorruptFileError, match="base storage 0"):
            ckptzip.load(q)
    shutil.copy(a, tmp_path / "a.bak")
    ckptzip.save({"w": w * 2, "v": w}, a)
    with pytest.raises(ckptzip.BaseCheckpointError, match="altered or replaced"):
        ckptzip.load(b)
    os.remove(a)
    with pytest.raises(ckptzip.BaseCheckpointError, match="missing"):
        ckptzip.load(b)
    assert_same(ckptzip.load(b, base_path=tmp_path / "a.bak"), s2)


def _derived_file(tmp_path):
    p = tmp_path / "d.ckz"
    ckptzip.save(mixed_state(), p)
    return p


@pytest.mark.usefixtures("no_pack")
def test_validation_of_derived_refs(tmp_path):
    p = _derived_file(tmp_path)
    data, doc, rows = read_parts(p)
    n = len(mixed_state()["model"])
    q = tmp_path / "bad.ckz"
    cases = [
        (lambda s: s[n]["transforms"][0]["ref"].update(storage=999), "does not exist"),
        (lambda s: s[n]["transforms"][0]["ref"].update(storage=n), "itself"),
        (lambda s: s[n]["transforms"][0]["ref"].update(storage=n + 1), "bytes, expected"),
        (lambda s: s[n]["transforms"][0]["ref"].update(storage=-1), "non-negative"),
        (lambda s: s[n]["transforms"].insert(0, {"id": "byteplane", "width": 2, "block": 8}), "starts with"),
        (lambda s: s[n]["transforms"].append({"id": "derived", "ref": {"storage": 0}, "from": "float32",
                                              "to": "bfloat16"}), "at most two|only be the first"),
    ]
    for edit, err in cases:
        _, doc, _ = read_parts(p)
        edit(doc["storages"])
        write_parts(q, data, doc, rows)
        with pytest.raises(ckptzip.CorruptFileError, match=err):
            ckptzip.open(q)


def test_validation_refuses_derived_cycle(tmp_path):
    st = {"a": torch.zeros(0, dtype=torch.bfloat16), "b": torch.zeros(0, dtype=torch.bfloat16)}
    p = tmp_path / "c.ckz"
    ckptzip.save(st, p)
    data, doc, rows = read_parts(p)
    for i in (0, 1):  # zero-byte storages satisfy the size rule: only the cycle check refuses them
        doc["storages"][i]["transforms"] = [{"id": "derived", "ref": {"storage": 1 - i}, "from": "float32",
                                             "to": "bfloat16"}]
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CorruptFileError, match="cycle"):
        ckptzip.load(q)


@pytest.mark.usefixtures("no_pack")
def test_unknown_reference_options_refused(tmp_path):
    p = _derived_file(tmp_path)
    data, doc, rows = read_parts(p)
    n = len(mixed_state()["model"])
    doc["storages"][n]["transforms"][0]["to"] = "float8"
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.UnknownCodecError):
        ckptzip.load(q)


def test_base_with_url_target_refused(tmp_path):
    a = tmp_path / "a.ckz"
    ckptzip.save({"x": torch.ones(4)}, a)
    with pytest.raises(ValueError, match="local paths"):
        ckptzip.save({"x": torch.ones(4)}, "memory://x.ckz", base=a)


def test_base_cannot_be_the_target(tmp_path):
    a = tmp_path / "a.ckz"
    ckptzip.save({"x": torch.ones(4)}, a)
    with pytest.raises(ValueError, match="its own base"):
        ckptzip.save({"x": torch.ones(4)}, a, base=a)
    assert_same(ckptzip.load(a), {"x": torch.ones(4)})


# -- the CPU decode of byteplane + delta/xor in one pass ------------------------------------
@pytest.mark.parametrize("width,block,n", [(2, 64, 1000), (4, 4096, 70_000), (8, 100, 999), (4, 1 << 22, 5)])
@pytest.mark.parametrize("kind", ["delta", "xor"])
@pytest.mark.parametrize("in_place", [True, False])
def test_fused_planes_ref_matches_two_steps(width, block, n, kind, in_place):
    from ckptzip.engine.decode import _fused
    from ckptzip.transforms.byteplane import BytePlane, np_decode_onto
    from ckptzip.transforms.refs import Delta, Xor
    g = torch.Generator().manual_seed(width * n)
    base = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    new = base.clone()
    new[::7] = torch.randint(0, 256, new[::7].shape, dtype=torch.uint8, generator=g)
    ref = (Delta(0, 0, width) if kind == "delta" else Xor(0, 0)).bind(base)
    bp = BytePlane(width, block)
    coded = bp.encode(ref.encode(new))
    # the unfused reference
    tmp = torch.empty_like(coded)
    bp.decode(coded, tmp)
    want = torch.empty_like(new)
    ref.decode(tmp, want)
    assert torch.equal(want, new)
    dst = base.clone() if in_place else torch.empty_like(base)
    bound = ref.bind(dst if in_place else base)
    assert _fused(bp, bound)
    np_decode_onto(coded.numpy(), dst.numpy(), bound.base_slice(0, coded.numel()).numpy(), width, block, kind)
    assert torch.equal(dst, new)
    assert not _fused(bp, Delta(0, 0, width * 2 if width < 8 else 2).bind(base))  # widths differ


def test_incremental_mixed_chain_many_windows(tmp_path, monkeypatch):
    """Deltas, xors, plain (new or changed-shape) and derived storages in one file, a chain of
    three, storages spread over many chunks, blocks and decode groups: bit-exact loads, through
    load, get_tensor and verify."""
    import ckptzip.engine.decode as dec
    monkeypatch.setattr(dec, "CPU_GROUP", 64 << 10)  # many decode groups, mixed ones included
    monkeypatch.setattr(dec, "CPU_GROUP_PER_THREAD", 0)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200_000, generator=g) * 0.02
    s = [{"w": w, "w_bf16": w.bfloat16(), "h": (torch.randn(30_000, generator=g) * 0.1).half(),
          "d": torch.randn(20_000, generator=g).double(), "ids": torch.arange(50_000) * 3,
          "noise": torch.randn(40_000, generator=g), "step": 0}]
    for k in range(1, 3):
        p = s[-1]
        nw = p["w"] + 1e-5 * torch.randn(p["w"].shape, generator=g)
        ids = p["ids"].clone()
        ids[::997] += 1
        s.append({"w": nw, "w_bf16": nw.bfloat16(), "h": p["h"] + (1e-3 * torch.randn(p["h"].shape, generator=g)).half(),
                  "d": p["d"] + 1e-9 * torch.randn(p["d"].shape, generator=g).double(), "ids": ids,
                  "noise": torch.randn(40_000, generator=g), f"new{k}": torch.randn(1000 * k, generator=g),
                  "step": k})
    paths = [tmp_path / f"s{k}.ckz" for k in range(3)]
    ckptzip.save(s[0], paths[0], chunk_size=16 << 10)
    for k in (1, 2):
        ckptzip.save(s[k], paths[k], base=paths[k - 1], chunk_size=16 << 10)
    tfs = transforms_of(paths[2])
    firsts = [t[0] for t in tfs if t]
    assert {"delta", "xor", "derived"} <= set(firsts)
    assert any(not t or t[0] not in ("delta", "xor") for t in tfs)  # some storages need no base
    for k in range(3):
        assert_same(ckptzip.load(paths[k]), s[k])
    with ckptzip.open(paths[2]) as r:
        for key in ("w", "w_bf16", "ids", "d", "h", "noise", "new2"):
            assert_same(r.get_tensor(key), s[2][key])
        r.verify()


# -- hidelta (format 1.3): float32 deltas that need planes 0, 2 and 3 of their base ----------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**31), scale=st.sampled_from([0.0, 1e-7, 1e-3, 1.0]))
def test_hidelta_inverts_and_needs_only_the_top_half(n, seed, scale):
    """numpy and torch paths write the same residual; decoding restores every bit pattern (NaN,
    infinities, signed zeros, sign flips), whatever bits 0..15 of the reference hold."""
    from ckptzip.transforms import refs
    from ckptzip.transforms.refs import HiDelta
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 2**32, n, dtype=np.uint32)
    with np.errstate(all="ignore"):  # (random bit patterns: NaN and infinity included)
        x = (b.view(np.float32) * np.float32(1 + scale * rng.standard_normal(n))).view(np.uint32).copy()
    x[::5] = rng.integers(0, 2**32, x[::5].shape, dtype=np.uint32)
    bt, xt = torch.from_numpy(b.view(np.uint8).copy()), torch.from_numpy(x.view(np.uint8).copy())
    enc = HiDelta(0, 0).bind(bt).encode(xt)
    refs._TORCH_ON_CPU = True
    try:
        enc_t = HiDelta(0, 0).bind(bt).encode(xt)
        back_t = torch.empty_like(xt)
        HiDelta(0, 0).bind(bt).decode(enc, back_t)
    finally:
        refs._TORCH_ON_CPU = False
    assert torch.equal(enc, enc_t) and torch.equal(back_t, xt)
    noisy = torch.from_numpy(((b & np.uint32(0xFFFF0000)) | rng.integers(0, 1 << 16, n, dtype=np.uint32))
                             .view(np.uint8).copy())
    back = torch.empty_like(xt)
    HiDelta(0, 0).bind(noisy).decode(enc, back)
    assert torch.equal(back, xt)


def test_plane_subset_and_plane_rows():
    """PlaneSubset rebuilds bits 15..31 of every word from planes 0, 2, 3 (numpy and torch
    paths); plane_rows picks those planes' chunks, and refuses chunks that span two planes."""
    from ckptzip.format import ROW
    from ckptzip.transforms.byteplane import BytePlane, PlaneSubset, plane_rows
    g = torch.Generator().manual_seed(7)
    n, block = 10_000, 4096
    x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, generator=g)
    bp = BytePlane(4, block)
    enc = bp.encode(x)
    segs = bp.segments(4 * n)
    part = torch.cat([enc[o:o + m] for k, (o, m) in enumerate(segs) if k % 4 != 1])
    for torch_ops in (False, True):
        dst = torch.zeros_like(x)
        PlaneSubset(block)._decode(part, dst, torch_ops)
        mask = np.uint32(0xFFFF8000)
        assert ((dst.numpy().view(np.uint32) ^ x.numpy().view(np.uint32)) & mask == 0).all()
    bp16 = BytePlane(4, block, 16)
    enc16 = bp16.encode(x)
    part16 = torch.cat([enc16[o:o + m] for k, (o, m) in enumerate(segs) if k % 4 >= 2])
    for torch_ops in (False, True):
        dst = torch.zeros_like(x)
        PlaneSubset(block, 16)._decode(part16, dst, torch_ops)
        assert (dst.numpy().view(np.uint32) == x.numpy().view(np.uint32) & np.uint32(0xFFFF0000)).all()
    # chunks: each plane of each block in two pieces
    sizes = [p for _o, m in segs for p in (m // 2, m - m // 2)]
    rows = np.zeros(len(sizes), ROW)
    rows["raw"] = sizes
    rows["offset"] = np.arange(len(sizes))
    got = plane_rows(rows, bp, 4 * n, PlaneSubset(block).planes)
    assert got["raw"].sum() == 3 * n and len(got) == 2 * 3 * len(segs) // 4
    assert (got["offset"] // 2 % 4 != 1).all()
    bad = np.zeros(2, ROW)
    bad["raw"] = [segs[0][1] + 1, 4 * n - segs[0][1] - 1]
    assert plane_rows(bad, bp, 4 * n, PlaneSubset(block).planes) is None


def _chunk_planes(path) -> tuple[np.ndarray, np.ndarray]:
    """File offsets of storage 0's chunks and the byte plane each holds (byteplane width 4)."""
    with ckptzip.open(path) as r:
        s = r.storages[0]
        block, n = s["transforms"][0]["block"], s["nbytes"] // 4
        first, count = s["rows"]
        rows = r.manifest.rows[first:first + count]
    raw = rows["raw"].astype(np.int64)
    starts = np.cumsum(raw) - raw
    span = block * 4
    return rows["offset"].astype(np.int64), (starts % span) // np.minimum(block, n - starts // span * block)


def test_hidelta_load_reads_three_planes_of_its_base(tmp_path, monkeypatch):
    """An incremental load decodes the base's float32 storages from planes 0, 2 and 3 only: a
    damaged plane-1 chunk of the base is not read (the base's own verify() finds it), a damaged
    plane-3 chunk is a ChecksumError; the result is bit-exact."""
    from ckptzip.transforms import byteplane
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300_000, generator=g) * 0.02
    s1 = {"w": w}
    s2 = {"w": w + 1e-6 * torch.randn(300_000, generator=g)}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a, codec="zstd")
    ckptzip.save(s2, b, base=a)
    assert transforms_of(b)[0][0] == "hidelta"
    used = []
    orig = byteplane.PlaneSubset.decode
    monkeypatch.setattr(byteplane.PlaneSubset, "decode", lambda self, s, d: (used.append(s.numel()), orig(self, s, d)))
    assert_same(ckptzip.load(b), s2)
    with ckptzip.open(a) as r:  # (a GPU machine's save: rotate 16, planes 2 and 3 read)
        tf = r.storages[0]["transforms"][0]
    assert sum(used) == (2 if tf.get("rotate") == 16 else 3) * 300_000
    offsets, plane = _chunk_planes(a)
    data = bytearray(a.read_bytes())
    data[offsets[plane == 1][0]] ^= 0xFF
    a.write_bytes(bytes(data))
    assert_same(ckptzip.load(b), s2)  # plane 1 is not read
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.open(a).verify()
    data[offsets[plane == 3][0]] ^= 0xFF
    a.write_bytes(bytes(data))
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(b)


def test_hidelta_base_storage_another_base_storage_refers_to(tmp_path, monkeypatch):
    """A base float32 storage that the base's own bf16 copy is derived from is decoded whole
    (not from three planes) when the incremental file needs both: bit-exact. (ckptzip's writer
    keeps a delta against a derived base storage only where the base is itself incremental;
    here it is made to keep it, as another writer may.)"""
    import ckptzip.api as api
    import ckptzip.incremental as inc
    g = torch.Generator().manual_seed(12)
    w = torch.randn(200_000, generator=g) * 0.02
    s1 = {"w": w, "w_bf16": w.bfloat16()}
    s2 = {"w": w + 1e-6 * torch.randn(200_000, generator=g),
          "w_bf16": (w.bfloat16().float() + 1e-4 * torch.randn(200_000, generator=g)).bfloat16()}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    assert transforms_of(a)[1][0] == "derived"
    ckptzip.save(s2, b, base=a)  # the derived base storage cannot be located: bf16 standalone
    tfs = transforms_of(b)
    assert tfs[0][0] == "hidelta" and tfs[1][0] == "byteplane"
    opened = []
    real = api.open_base
    monkeypatch.setattr(api, "open_base", lambda *x, **k: (opened.append(1), real(*x, **k))[1])
    assert_same(ckptzip.load(b), s2)
    assert not opened
    monkeypatch.setattr(inc, "against_base", lambda s: True)  # as if the base were incremental
    ckptzip.save(s2, b, base=a)
    tfs = transforms_of(b)
    assert tfs[0][0] == "hidelta" and tfs[1][0] == "delta"
    assert_same(ckptzip.load(b), s2)
    assert opened


def test_newer_minor_that_this_reader_cannot_validate_says_so(tmp_path):
    """A file of a newer minor version whose document uses something this reader refuses (here a
    base record chain it does not accept) is an UnsupportedVersionError naming both versions,
    not a CorruptFileError; the same document at this reader's minor is corrupt."""
    from fixtures.make_fixtures import HERE
    data, doc, rows = read_parts(os.path.join(HERE, "v14_expgrid_incr_cpu.ckz"))
    doc["bases"][0]["chains"][0]["transforms"].insert(0, {"id": "future", "x": 1})
    check_newer_minor(tmp_path, data, doc, rows, "chain 0")


@pytest.mark.parametrize("edit", ["chain", "rows"])
def test_record_that_contradicts_its_base_is_refused(edit, tmp_path, monkeypatch):
    """A base record whose located storage names a chain or chunk rows other than the base's own
    (forged: the base's SHA-256 still matches): verify() and a load that parses the base's
    document raise CorruptFileError instead of decoding the file another way."""
    import shutil
    import ckptzip.api as api
    from fixtures.make_fixtures import HERE
    shutil.copy(os.path.join(HERE, "v12_expgrid_cpu.ckz"), tmp_path)
    data, doc, rows = read_parts(os.path.join(HERE, "v14_expgrid_incr_cpu.ckz"))
    rec = doc["bases"][0]
    hint = [h for h in rec["storages"] if rec["chains"][h[3]]["transforms"][0]["id"] == "expgrid"][0]
    if edit == "chain":  # the grid dropped: the base's planes read as if they held plain words
        rec["chains"][hint[3]]["transforms"] = rec["chains"][hint[3]]["transforms"][1:]
    else:  # another storage's rows of the same size
        other = [i for i, s in enumerate(read_parts(os.path.join(HERE, "v12_expgrid_cpu.ckz"))[1]["storages"])
                 if i != hint[0] and s["nbytes"] == 48 * 80 * 4][0]
        hint[1:3] = read_parts(os.path.join(HERE, "v12_expgrid_cpu.ckz"))[1]["storages"][other]["rows"]
    q = tmp_path / "v14_expgrid_incr_cpu.ckz"
    write_parts(q, data, doc, rows)
    with ckptzip.open(q) as r, pytest.raises(ckptzip.CorruptFileError, match="locates base storage"):
        r.verify()
    monkeypatch.setattr(api, "open_base_file", lambda *a, **k: None)  # (a base the record cannot use)
    with pytest.raises(ckptzip.CorruptFileError, match="locates base storage"):
        ckptzip.load(q)


@pytest.mark.usefixtures("no_pack")
def test_unlocatable_base_storages_are_stored_standalone(tmp_path, monkeypatch):
    """Base storages coded ``expgrid`` (Adam v) are located by the file's record (format 1.4),
    so v is stored against its base; a storage whose base storage refers to another one
    (``expref``: Adam m) is stored without the base, so that a load never parses the base's
    document (for ``derived``, and the writer keeping every pair where the base is itself
    incremental: test_hidelta_base_storage_another_base_storage_refers_to)."""
    import ckptzip.api as api
    from fixtures.make_fixtures import golden_grid_object, golden_grid_object_next
    g = torch.Generator().manual_seed(4)
    s1 = golden_grid_object()
    s1["model"] = {"w": torch.randn(100_000, generator=g) * 0.02}
    s2 = golden_grid_object_next()
    s2["model"] = {"w": s1["model"]["w"] + 1e-6}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a, device="cpu")  # (the CPU planner's choice: expgrid on byte planes)
    with ckptzip.open(a) as r:
        first = {k: r.storages[x["s"]]["transforms"][0]["id"] for k, x in r._tensor_nodes().items()
                 if "exp_avg" in k}
    assert sorted(first.values()) == ["expgrid", "expref"], first

    def ids_of(path):
        with ckptzip.open(path) as r:
            return {k: (r.storages[x["s"]].get("transforms") or [{}])[0].get("id") for k, x in r._tensor_nodes().items()}
    ckptzip.save(s2, b, base=a, device="cpu")
    ids = ids_of(b)
    v = [k for k in ids if k.endswith("exp_avg_sq")][0]
    m = [k for k in ids if k.endswith("exp_avg")][0]
    assert ids["model.w"] == "hidelta" and ids[v] in ("delta", "xor") and ids[m] not in ("delta", "xor"), ids
    opened = []
    real = api.open_base
    monkeypatch.setattr(api, "open_base", lambda *x, **k: (opened.append(1), real(*x, **k))[1])
    assert_same(ckptzip.load(b), s2)
    assert not opened


@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (70_001, 4096)])
def test_byteplane_rotate16_layout(n, block, monkeypatch):
    """``byteplane`` ``rotate`` 16 (format 1.3): plane 3 holds the exponent, plane 2 the sign
    beside the 7 upper mantissa bits, planes 1 and 0 the low mantissa bytes; the numpy (C) path
    and the torch path's transposition write and read the same bytes, special values included,
    the input untouched (the torch branches of the word turning run in the GPU suite)."""
    from ckptzip.transforms.byteplane import BytePlane
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, generator=g)
    if n >= 8:
        x[:32] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e38, 1.5],
                              dtype=torch.float32).view(torch.uint8)
    before = x.clone()
    bp = BytePlane(4, block, 16)
    assert bp.get_config() == {"id": "byteplane", "width": 4, "block": block, "rotate": 16} and bp.minor == 3
    enc = bp.encode(x)
    assert torch.equal(x, before)
    u = x.numpy().view(np.uint32)
    m = min(block, n)
    planes = enc.numpy()[:4 * m].reshape(4, m)
    assert (planes[3] == ((u[:m] >> 23) & 0xFF)).all()
    assert (planes[2] == ((((u[:m] >> 16) & 0x7F) << 1) | (u[:m] >> 31))).all()
    assert (planes[1] == ((u[:m] >> 8) & 0xFF)).all() and (planes[0] == (u[:m] & 0xFF)).all()
    check_rotate16_paths(bp, x, enc)


def test_rotate16_base_incremental_reads_two_planes(tmp_path, monkeypatch):
    """A base written with rotate 16 (what GPU saves write; forced here on the CPU): the
    incremental load decodes its float32 weights from planes 2 and 3, bit-exact."""
    from ckptzip.engine import planner
    from ckptzip.transforms import byteplane
    monkeypatch.setattr(planner, "ROT16_ON_CPU", True)
    g = torch.Generator().manual_seed(21)
    w = torch.randn(300_000, generator=g) * 0.02
    s1, s2 = {"w": w}, {"w": w + 1e-6 * torch.randn(300_000, generator=g)}
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(s1, a)
    assert transforms_of(a)[0] == ["byteplane"]
    with ckptzip.open(a) as r:
        assert r.storages[0]["transforms"][0]["rotate"] == 16 and r.manifest.doc["version"] == [1, 3]
    assert_same(ckptzip.load(a), s1)
    ckptzip.save(s2, b, base=a)
    seen = []
    real = byteplane.PlaneSubset.decode
    monkeypatch.setattr(byteplane.PlaneSubset, "decode", lambda self, s, d: (seen.append((self.planes, s.numel())), real(self, s, d)))
    assert_same(ckptzip.load(b), s2)
    assert seen and all(p == (2, 3) for p, _ in seen) and sum(k for _, k in seen) == 2 * 300_000


@pytest.mark.parametrize("cfg, err", [
    ({"id": "byteplane", "width": 4, "block": 8, "rotate": 15}, ckptzip.UnknownCodecError),
    ({"id": "byteplane", "width": 2, "block": 8, "rotate": 16}, ckptzip.UnknownCodecError),
    ({"id": "byteplane", "width": 4, "block": 8, "rotate": "16"}, ckptzip.CorruptFileError),
    ({"id": "byteplane", "width": 4, "block": 8, "rotate": True}, ckptzip.CorruptFileError),
])
def test_byteplane_rotate_values_checked(tmp_path, cfg, err):
    """Only ``rotate`` 16 at width 4 is valid; a file with anything else is refused when opened."""
    p = tmp_path / "a.ckz"
    ckptzip.save({"w": torch.randn(2000)}, p)
    data, doc, rows = read_parts(p)
    doc["storages"][0]["transforms"] = [dict(cfg, block=doc["storages"][0]["transforms"][0]["block"])]
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(err):
        ckptzip.open(q)


def test_hidelta_against_a_base_storage_that_is_itself_a_delta(tmp_path, monkeypatch):
    """A file (of another writer) whose hidelta refers to a base storage stored as delta against
    the base's own base: that base's base storage is decoded whole (the delta is applied onto it
    in place), not from three planes; bit-exact. verify() reads every plane of the base storages
    an incremental file needs: a damaged plane-1 chunk of a base passes a load, not verify()."""
    from ckptzip import incremental
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(300_000, generator=g) * 0.02
    w1 = w0 + 1e-4 * torch.randn(300_000, generator=g)
    w2 = w1 + 1e-6 * torch.randn(300_000, generator=g)
    a, b, c = tmp_path / "a.ckz", tmp_path / "b.ckz", tmp_path / "c.ckz"
    ckptzip.save({"w": w0}, a, device="cpu")
    monkeypatch.setattr(incremental, "plain_planes", lambda s, w: False)  # b stores w as delta
    ckptzip.save({"w": w1}, b, base=a, device="cpu")
    monkeypatch.setattr(incremental, "plain_planes", lambda s, w: True)   # c: hidelta against it anyway
    ckptzip.save({"w": w2}, c, base=b, device="cpu")
    assert transforms_of(b)[0][0] == "delta" and transforms_of(c)[0][0] == "hidelta"
    assert torch.equal(ckptzip.load(c)["w"].view(torch.int32), w2.view(torch.int32))
    # verify reads all planes: damage a plane-1 chunk of a plain base
    d, e = tmp_path / "d.ckz", tmp_path / "e.ckz"
    ckptzip.save({"w": w0}, d, device="cpu")
    monkeypatch.undo()
    ckptzip.save({"w": w1}, e, base=d, device="cpu")
    assert transforms_of(e)[0][0] == "hidelta"
    offsets, plane = _chunk_planes(d)
    data = bytearray(d.read_bytes())
    data[offsets[plane == 1][0]] ^= 0xFF
    d.write_bytes(bytes(data))
    assert torch.equal(ckptzip.load(e)["w"].view(torch.int32), w1.view(torch.int32))
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.open(e).verify()
