"""Format 1.2: ``expref`` (Adam's first moment stored with its exponent predicted from the second
moment): pairing by key, bit-exact round trips (whole loads, single tensors, read_into, async,
incremental, DCP), the header's minor version, plan reuse, validation of hostile references."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip import format as fmt
from ckptzip.engine.refplan import find_expref
from ckptzip.tree import Encoder
from conftest import assert_same, read_parts, write_parts


def adam_state(seed=0, rows=256, cols=256, layers=3):
    """An AdamW-like state whose gradient scale varies by octaves across rows (as in a trained
    model), so that the exponent of m follows the exponent of v: expref pays here."""
    g = torch.Generator().manual_seed(seed)
    w, state = {}, {}
    for i in range(layers):
        w[f"l{i}.weight"] = torch.randn(rows, cols, generator=g) * 0.02
        scale = torch.exp2(-torch.randint(4, 20, (rows, 1), generator=g).float())
        grads = torch.randn(8, rows, cols, generator=g) * scale
        v = (grads ** 2).mean(0)
        m = grads[:4].mean(0)
        state[i] = {"step": torch.tensor(10.0), "exp_avg": m, "exp_avg_sq": v}
    return {"model": w, "optimizer": {"state": state, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]}}


def transforms_by_key(path):
    with ckptzip.open(path) as r:
        s_of = {t["key"]: t["storage"] for t in r.tensor_info()}
        return {k: [t["id"] for t in r.storages[i].get("transforms", [])] for k, i in s_of.items()}


def test_pairs_found_by_key_only_for_float32_same_size():
    st_ = adam_state()
    st_["optimizer"]["state"][1]["exp_avg_sq"] = st_["optimizer"]["state"][1]["exp_avg_sq"].double()
    st_["optimizer"]["state"][2]["exp_avg"] = st_["optimizer"]["state"][2]["exp_avg"][:10].clone()
    st_["extra"] = {"exp_avg": torch.ones(4)}  # no exp_avg_sq beside it
    enc = Encoder()
    root = enc.encode(st_)
    found = find_expref(root, enc.storages, skip=set())
    assert len(found) == 1
    (i, t), = found.items()
    assert enc.storages[i].data.data_ptr() == st_["optimizer"]["state"][0]["exp_avg"].data_ptr()
    assert enc.storages[t.storage].data.data_ptr() == st_["optimizer"]["state"][0]["exp_avg_sq"].data_ptr()


def test_dcp_style_keys_pair():
    m, v = torch.randn(64), torch.rand(64)
    st_ = {"optim.state.fc.weight.exp_avg@0,0": m, "optim.state.fc.weight.exp_avg_sq@0,0": v,
           "optim.state.fc.weight.exp_avg@64,0": torch.randn(64)}
    enc = Encoder()
    root = enc.encode(st_)
    found = find_expref(root, enc.storages, skip=set())
    assert list(found) == [0] and found[0].storage == 1


@pytest.mark.usefixtures("no_pack")
def test_round_trip_minor_version_and_partial_reads(tmp_path):
    st_ = adam_state()
    p = tmp_path / "a.ckz"
    info = ckptzip.save(st_, p)
    assert info["expref_storages"] >= 2
    tf = transforms_by_key(p)
    assert tf["optimizer.state.0.exp_avg"][0] == "expref" and "expref" not in tf["optimizer.state.0.exp_avg_sq"]
    raw = open(p, "rb").read(16)
    assert fmt.HEADER.unpack(raw)[1:3] == (1, 2)
    with ckptzip.open(p) as r:
        assert r.manifest.doc["version"] == [1, 2]
        # one tensor alone: its reference is decoded into a temporary
        assert torch.equal(r.get_tensor("optimizer.state.0.exp_avg"), st_["optimizer"]["state"][0]["exp_avg"])
    with ckptzip.open(p) as r:
        out = torch.empty_like(st_["optimizer"]["state"][1]["exp_avg"])
        assert r.read_into({"optimizer.state.1.exp_avg": out}) == ["optimizer.state.1.exp_avg"]
        assert torch.equal(out, st_["optimizer"]["state"][1]["exp_avg"])
    assert_same(ckptzip.load(p), st_)
    # without expref the same state is larger (the sampling kept it because it pays)
    q = tmp_path / "b.ckz"
    plain = ckptzip.save(st_, q, derive=False)
    assert info["stored_bytes"] < plain["stored_bytes"]
    assert fmt.HEADER.unpack(open(q, "rb").read(16))[1:3] == (1, 0)


def test_not_kept_where_it_does_not_pay(tmp_path):
    st_ = adam_state()
    for s in st_["optimizer"]["state"].values():  # v unrelated to m: no gain, no expref
        s["exp_avg_sq"] = torch.rand(s["exp_avg_sq"].shape) * 3 + 1
    p = tmp_path / "a.ckz"
    info = ckptzip.save(st_, p)
    assert not info.get("expref_storages")
    assert_same(ckptzip.load(p), st_)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 10**6), special=st.booleans())
def test_any_bits_round_trip(tmp_path_factory, n, seed, special):
    """NaNs, infinities, subnormals, negative zeros and random bit patterns on both sides."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    v = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    if special:
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3e38])
        m[::3] = vals[torch.randint(0, 6, (len(m[::3]),), generator=g)]
        v[1::4] = vals[torch.randint(0, 6, (len(v[1::4]),), generator=g)]
    from ckptzip.engine.plan import Plan
    from ckptzip.transforms import ExpRef
    t = ExpRef(1).bind(v.view(torch.uint8))
    raw = m.view(torch.uint8)
    out = torch.empty_like(raw)
    t.decode(t.encode(raw), out)
    assert torch.equal(out, raw)
    p = tmp_path_factory.mktemp("h") / "a.ckz"
    st_ = {"s": {"exp_avg": m, "exp_avg_sq": v}}
    ckptzip.save(st_, p)
    back = ckptzip.load(p)
    assert torch.equal(back["s"]["exp_avg"].view(torch.int32), m.view(torch.int32))
    assert torch.equal(back["s"]["exp_avg_sq"].view(torch.int32), v.view(torch.int32))


def test_async_and_reused_plans_stay_exact(tmp_path):
    """async_save takes the residual at the call (the caller may change m and v right after);
    later saves reuse the plan (bound to the new tensors), and stay exact."""
    from ckptzip.engine import planner
    st_ = grid_state(seed=3)
    paths = [tmp_path / f"{i}.ckz" for i in range(3)]
    want, cached = [], []
    for i, p in enumerate(paths):
        snap = {k: {n: (x.clone() if isinstance(x, torch.Tensor) else x) for n, x in d.items()}
                for k, d in st_["optimizer"]["state"].items()}
        h = ckptzip.async_save(st_, p)
        for s in st_["optimizer"]["state"].values():  # the training step goes on
            s["exp_avg"].mul_(0.9)
            s["exp_avg_sq"].mul_(0.81)
        h.wait()
        want.append(snap)
        cached.append(list(planner._PLAN_CACHE))
    for p, snap in zip(paths, want):
        back = ckptzip.load(p)
        for k, d in snap.items():
            for n, x in d.items():
                assert torch.equal(back["optimizer"]["state"][k][n].view(-1).view(torch.uint8),
                                   x.view(-1).view(torch.uint8)), (p, k, n)
    assert "expgrid" in transforms_by_key(paths[2])["optimizer.state.0.exp_avg_sq"]
    assert cached[1] == cached[2]  # the third save reused the second's plan (fits differ, layout not)


def test_incremental_v_delta_m_expref(tmp_path):
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    s1 = adam_state(seed=1)
    ckptzip.save(s1, a)
    s2 = adam_state(seed=1)
    for s in s2["optimizer"]["state"].values():
        s["exp_avg_sq"].mul_(1.0001)
    ckptzip.save(s2, b, base=a)
    tf = transforms_by_key(b)
    assert tf["optimizer.state.0.exp_avg"][0] == "expref"
    assert tf["optimizer.state.0.exp_avg_sq"][0] in ("delta", "xor")
    assert_same(ckptzip.load(b), s2)
    with ckptzip.open(b) as r:
        assert torch.equal(r.get_tensor("optimizer.state.2.exp_avg"), s2["optimizer"]["state"][2]["exp_avg"])


def test_dcp_writer_uses_expref(tmp_path):
    import torch.distributed.checkpoint as dcp
    from ckptzip import dcp as cdcp
    st_ = {"optim": {"fc": {"exp_avg": adam_state()["optimizer"]["state"][0]["exp_avg"],
                            "exp_avg_sq": adam_state()["optimizer"]["state"][0]["exp_avg_sq"]}}}
    d = tmp_path / "ck"
    dcp.save(st_, storage_writer=cdcp.Writer(str(d)))
    files = sorted(p for p in d.iterdir() if p.suffix == ".ckz")
    ids = [t for f in files for ts in transforms_by_key(f).values() for t in ts]
    assert "expref" in ids
    out = {"optim": {"fc": {k: torch.zeros_like(v) for k, v in st_["optim"]["fc"].items()}}}
    dcp.load(out, storage_reader=cdcp.Reader(str(d)))
    for k, v in st_["optim"]["fc"].items():
        assert torch.equal(out["optim"]["fc"][k], v)


def _expref_file(tmp_path):
    p = tmp_path / "e.ckz"
    ckptzip.save(adam_state(), p)
    data, doc, rows = read_parts(p)
    i = next(k for k, s in enumerate(doc["storages"]) if s["transforms"] and s["transforms"][0]["id"] == "expref")
    return p, data, rows, i


@pytest.mark.parametrize("edit,err,exc", [
    (lambda s, i: s[i]["transforms"][0]["ref"].update(storage=10**6), "does not exist", ckptzip.CorruptFileError),
    (lambda s, i: s[i]["transforms"][0]["ref"].update(storage=i), "itself", ckptzip.CorruptFileError),
    (lambda s, i: s[i]["transforms"][0]["ref"].update(storage=0), "bytes, expected", ckptzip.CorruptFileError),
    (lambda s, i: s[i]["transforms"][0]["ref"].update(storage=True), "non-negative", ckptzip.CorruptFileError),
    (lambda s, i: s[i]["transforms"][0].update(extra=1), "unknown options", ckptzip.UnknownCodecError),
    (lambda s, i: s[i]["transforms"].reverse(), "only be the first|starts with", ckptzip.CorruptFileError),
])
@pytest.mark.usefixtures("no_pack")
def test_validation_of_expref(tmp_path, edit, err, exc):
    p, data, rows, i = _expref_file(tmp_path)
    _, doc, _ = read_parts(p)
    if "bytes, expected" in err:  # storage 0 is a weight of the same size in adam_state: use the step
        i0 = next(k for k, s in enumerate(doc["storages"]) if s["nbytes"] == 4)
        edit = lambda s, i: s[i]["transforms"][0]["ref"].update(storage=i0)  # noqa: E731
    edit(doc["storages"], i)
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(exc, match=err):
        ckptzip.load(q)


def test_cycle_of_expref_and_derived_refused(tmp_path):
    st_ = {"a": torch.zeros(0), "b": torch.zeros(0)}
    p = tmp_path / "c.ckz"
    ckptzip.save(st_, p)
    data, doc, rows = read_parts(p)
    for i in (0, 1):
        doc["storages"][i]["transforms"] = [{"id": "expref", "ref": {"storage": 1 - i}}]
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CorruptFileError, match="cycle"):
        ckptzip.load(q)


def test_reference_temporary_is_within_max_bytes(tmp_path):
    """Reading m alone decodes v into a temporary: counted against max_bytes."""
    st_ = adam_state()
    p = tmp_path / "a.ckz"
    ckptzip.save(st_, p)
    n = st_["optimizer"]["state"][0]["exp_avg"].numel() * 4
    with ckptzip.open(p, max_bytes=n + n // 2) as r:
        with pytest.raises(ckptzip.ResourceLimitError):
            r.get_tensor("optimizer.state.0.exp_avg")


# -- expgrid: Adam's v, exponent predicted by a row term plus a column term ---------------------
def grid_state(seed=0, rows=256, cols=384, layers=3):
    """Adam's v of linear layers: squared gradients whose scale is a row factor times a column
    factor (as for a linear layer's weight gradient), m as in adam_state."""
    g = torch.Generator().manual_seed(seed)
    st_ = adam_state(seed, rows, cols, layers)
    for s in st_["optimizer"]["state"].values():
        rs = torch.exp2(-torch.randint(0, 12, (rows, 1), generator=g).float())
        cs = torch.exp2(-torch.randint(0, 12, (1, cols), generator=g).float())
        s["exp_avg_sq"] = (torch.randn(rows, cols, generator=g) * rs * cs) ** 2
    return st_


@pytest.mark.usefixtures("no_pack")
def test_expgrid_used_for_v_and_round_trips(tmp_path):
    st_ = grid_state()
    p = tmp_path / "g.ckz"
    info = ckptzip.save(st_, p)
    assert info["expgrid_storages"] == 3
    tf = transforms_by_key(p)
    assert tf["optimizer.state.0.exp_avg_sq"][0] == "expgrid"
    assert fmt.HEADER.unpack(open(p, "rb").read(16))[1:3] == (1, 2)
    assert_same(ckptzip.load(p), st_)
    with ckptzip.open(p) as r:
        assert torch.equal(r.get_tensor("optimizer.state.1.exp_avg_sq"), st_["optimizer"]["state"][1]["exp_avg_sq"])
        assert torch.equal(r.get_tensor("optimizer.state.1.exp_avg"), st_["optimizer"]["state"][1]["exp_avg"])
    plain = ckptzip.save(st_, tmp_path / "n.ckz", derive=False)
    assert info["stored_bytes"] < plain["stored_bytes"]


def test_expgrid_fits_reused_by_later_saves_stay_exact(tmp_path, monkeypatch):
    """Saves with ``reuse_plan`` (async saves, the manager) take the expgrid fits of an earlier
    save of the same layout for REFIT_EVERY saves, then refit; with v changed in between (a
    stale fit) every file still loads bit-exact."""
    from ckptzip.engine import refplan
    from ckptzip.transforms.refs import ExpGrid
    monkeypatch.setattr(refplan, "_GRIDS", type(refplan._GRIDS)())
    fits = []
    real = ExpGrid.fit_many.__func__
    monkeypatch.setattr(ExpGrid, "fit_many", classmethod(lambda cls, items: fits.append(1) or real(cls, items)))
    st_ = grid_state()
    for k in range(refplan.REFIT_EVERY + 1):
        for s in st_["optimizer"]["state"].values():
            s["exp_avg_sq"].mul_(1.5 + k)  # drift: the reused fit is stale
        p = tmp_path / f"a{k}.ckz"
        ckptzip.async_save(st_, p).wait()
        assert_same(ckptzip.load(p), st_)
    assert len(fits) == 2  # the first save and the one after REFIT_EVERY saves
    ckptzip.save(st_, tmp_path / "plain.ckz")  # no reuse: fits again
    assert len(fits) == 3


def test_expgrid_windows_and_torch_path_match_numpy():
    """Any window (partial rows at both ends) transforms as the whole storage does; the torch
    path (used on CUDA) writes the same bytes as the numpy path (CPU)."""
    from ckptzip.transforms import ExpGrid
    from ckptzip.transforms import refs
    v = grid_state(rows=37, cols=53, layers=1)["optimizer"]["state"][0]["exp_avg_sq"]
    raw = v.reshape(-1).view(torch.uint8)
    t = ExpGrid.fit(raw, 37, 53)
    whole = t.encode(raw)
    for a, b in ((0, 40), (28, 800), (212, 424), (400, raw.numel()), (4 * 53 * 36, raw.numel())):
        part = t.encode(raw[a:b], start=a)
        assert torch.equal(part, whole[a:b]), (a, b)
        out = torch.empty_like(part)
        t.decode(part, out, start=a)
        assert torch.equal(out, raw[a:b])
    r, c = t._pred(torch.device("cpu"), 0, 37)
    for sign, src, want in ((-1, raw, whole), (1, whole, raw)):
        got = torch.empty_like(raw)
        refs._torch_exp_add(src.view(torch.int32).view(37, 53), got.view(torch.int32).view(37, 53),
                            r[:, None] + c[None, :], sign)
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows,cols", [(37, 53), (600, 300), (300, 700), (2, 2)])
def test_expgrid_native_fit_matches_numpy(monkeypatch, rows, cols):
    """The C fit (native.lib.exp_fit) and the numpy fit sample the same rows and columns and give
    the same prediction (within a rounding step of the 8.8 fixed point, from float64 sums taken
    in another order), so either writes a valid, equally good file."""
    from ckptzip import native
    from ckptzip.transforms import ExpGrid
    if native.lib is None:
        pytest.skip("the C extension is not built")
    g = torch.Generator().manual_seed(rows)
    v = (torch.rand(rows, 1, generator=g) * torch.rand(1, cols, generator=g) * 1e-6
         * torch.exp(torch.randn(rows, cols, generator=g)))
    raw = v.reshape(-1).view(torch.uint8)
    fast = ExpGrid.fit(raw, rows, cols)
    monkeypatch.setattr(native, "lib", None)
    slow = ExpGrid.fit(raw, rows, cols)
    assert np.abs(fast.r.astype(np.int64) - slow.r.astype(np.int64)).max() <= 1
    assert np.abs(fast.c.astype(np.int64) - slow.c.astype(np.int64)).max() <= 1
    assert (fast.r == slow.r).mean() > 0.99 and (fast.c == slow.c).mean() > 0.99


def test_expgrid_in_incremental_saves_best_of_delta_and_grid(tmp_path):
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    s1 = grid_state(seed=2)
    ckptzip.save(s1, a)
    s2 = grid_state(seed=2)
    s2["optimizer"]["state"][0]["exp_avg_sq"].mul_(1.0001)  # tiny drift: delta wins
    s2["optimizer"]["state"][1]["exp_avg_sq"] = grid_state(seed=9)["optimizer"]["state"][1]["exp_avg_sq"]  # new: grid
    ckptzip.save(s2, b, base=a)
    tf = transforms_by_key(b)
    assert tf["optimizer.state.0.exp_avg_sq"][0] == "delta"
    assert tf["optimizer.state.1.exp_avg_sq"][0] == "expgrid"
    assert_same(ckptzip.load(b), s2)


@pytest.mark.parametrize("edit,err,exc", [
    (lambda t: t.update(rows=t["rows"] + 1), "fit|values", ckptzip.CorruptFileError),
    (lambda t: t.update(rows=0), "positive", ckptzip.CorruptFileError),
    (lambda t: t.update(cols=2.0), "positive", ckptzip.CorruptFileError),
    (lambda t: t.update(r=t["r"][:-4]), "base64", ckptzip.CorruptFileError),
    (lambda t: t.update(c="!!!!" + t["c"][4:]), "base64", ckptzip.CorruptFileError),
    (lambda t: t.update(c=5), "base64", ckptzip.CorruptFileError),
    (lambda t: t.update(extra=1), "unknown options", ckptzip.UnknownCodecError),
])
def test_validation_of_expgrid(tmp_path, edit, err, exc):
    p = tmp_path / "g.ckz"
    ckptzip.save(grid_state(layers=1), p)
    data, doc, rows = read_parts(p)
    i = next(k for k, s in enumerate(doc["storages"]) if s["transforms"] and s["transforms"][0]["id"] == "expgrid")
    edit(doc["storages"][i]["transforms"][0])
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(exc, match=err):
        ckptzip.load(q)


def test_expgrid_second_in_chain_refused(tmp_path):
    p = tmp_path / "g.ckz"
    ckptzip.save(grid_state(layers=1), p)
    data, doc, rows = read_parts(p)
    i = next(k for k, s in enumerate(doc["storages"]) if s["transforms"] and s["transforms"][0]["id"] == "expgrid")
    doc["storages"][i]["transforms"].reverse()
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CorruptFileError, match="first|starts with"):
        ckptzip.load(q)


@pytest.mark.usefixtures("no_pack")
def test_long_reference_chain_refused_quickly(tmp_path):
    """A chain of in-file references (same-size expref storages can chain without growing) is
    refused at open in linear time, with a named error."""
    import time
    st_ = {f"t{i}": torch.zeros(1) for i in range(3000)}
    p = tmp_path / "a.ckz"
    ckptzip.save(st_, p, derive=False)
    data, doc, rows = read_parts(p)
    for i in range(1, 3000):
        doc["storages"][i]["transforms"] = [{"id": "expref", "ref": {"storage": i - 1}}]
    q = tmp_path / "b.ckz"
    write_parts(q, data, doc, rows)
    t0 = time.perf_counter()
    with pytest.raises(ckptzip.CorruptFileError, match="more than 4"):
        ckptzip.load(q)
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("wire", ["expgrid", "expref"])
def test_word_transforms_on_unaligned_chunks_and_slices(tmp_path, wire):
    """Any chunk sizes and storage placement are valid: decode batches end on whole words, and
    a storage's slice of a group stream that starts off a word boundary is copied first."""
    import base64
    import numpy as np
    R, C = 300, 4096
    st_ = {"a": torch.zeros(3, dtype=torch.uint8), "v": torch.rand(R, C), "w": torch.rand(R, C)}
    p = tmp_path / "a.ckz"
    ckptzip.save(st_, p, derive=False, transform=None, codec="zstd", chunk_size=(1 << 18) - 1)
    data, doc, rows = read_parts(p)
    with ckptzip.open(p) as r:
        idx = {t["key"]: t["storage"] for t in r.tensor_info()}
    tf = ({"id": "expgrid", "rows": R, "cols": C, "r": base64.b64encode(np.full(R, 300, "<u2").tobytes()).decode(),
           "c": base64.b64encode(np.zeros(C, "<i2").tobytes()).decode()} if wire == "expgrid"
          else {"id": "expref", "ref": {"storage": idx["w"]}})
    doc["storages"][idx["v"]]["transforms"] = [tf]
    q = tmp_path / "b.ckz"
    write_parts(q, data, doc, rows)
    from ckptzip.transforms import get_transform
    t = get_transform(tf).bind(st_["w"].reshape(-1).view(torch.uint8))
    want = torch.empty(R * C * 4, dtype=torch.uint8)
    t.decode(st_["v"].reshape(-1).view(torch.uint8).clone(), want)  # what the stored bytes decode to
    back = ckptzip.load(q)
    assert torch.equal(back["v"].reshape(-1).view(torch.uint8), want)
    assert torch.equal(back["w"], st_["w"]) and torch.equal(back["a"], st_["a"])


@pytest.mark.usefixtures("no_pack")
def test_noncanonical_base64_refused(tmp_path):
    p = tmp_path / "g.ckz"
    ckptzip.save(grid_state(rows=33, cols=67, layers=1), p)
    data, doc, rows = read_parts(p)
    i = next(k for k, s in enumerate(doc["storages"]) if s["transforms"] and s["transforms"][0]["id"] == "expgrid")
    c = doc["storages"][i]["transforms"][0]["c"]  # 67 x 2 = 134 bytes: 2 unused bits before "="
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = c.rstrip("=")[-1]
    doc["storages"][i]["transforms"][0]["c"] = c.rstrip("=")[:-1] + alphabet[alphabet.index(last) ^ 1] + "=" * (len(c) - len(c.rstrip("=")))
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CorruptFileError, match="canonical"):
        ckptzip.load(q)


@pytest.mark.parametrize("wire", ["expref", "expgrid"])
def test_torch_path_writes_the_numpy_bytes(wire, monkeypatch):
    """The torch code path (the one CUDA runs) gives the same bytes as the numpy one, for whole
    storages and windows starting mid-row, both ways."""
    from ckptzip.transforms import ExpGrid, ExpRef, refs
    st_ = grid_state(rows=37, cols=53, layers=1)["optimizer"]["state"][0]
    m, v = (st_[k].reshape(-1).view(torch.uint8) for k in ("exp_avg", "exp_avg_sq"))
    t = ExpGrid.fit(v, 37, 53) if wire == "expgrid" else ExpRef(1).bind(v)
    x = v if wire == "expgrid" else m
    for a, b in ((0, x.numel()), (28, 800), (212, 4 * 53 * 20 + 8)):
        monkeypatch.setattr(refs, "_TORCH_ON_CPU", False)
        want = t.encode(x[a:b], start=a)
        monkeypatch.setattr(refs, "_TORCH_ON_CPU", True)
        t2 = ExpGrid(t.rows, t.cols, t.r, t.c) if wire == "expgrid" else ExpRef(1).bind(v)
        got = t2.encode(x[a:b], start=a)
        assert torch.equal(got, want), (a, b)
        back = torch.empty_like(got)
        t2.decode(got, back, start=a)
        assert torch.equal(back, x[a:b])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), shapes=st.lists(st.sampled_from([(), (1,), (7,), (3, 5), (64, 48), (2, 3, 40), (0, 4), (300, 129)]),
                                                  min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64]),
       chunk=st.sampled_from([None, 64, 65, 4099]), view=st.booleans(), use_async=st.booleans())
def test_optimizer_states_of_any_layout_round_trip(tmp_path_factory, seed, shapes, dtype, chunk, view, use_async):
    """Adam-like states of any shape, dtype, view and chunk size: whatever the planner picks
    (expref, expgrid, nothing), the load is bit-exact."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, shp in enumerate(shapes):
        scale = torch.exp2(-torch.randint(0, 20, shp[:1] + (1,) * max(0, len(shp) - 1), generator=g).float()) if shp else 1.0
        v = ((torch.randn(shp, generator=g) * scale) ** 2).to(dtype)
        m = (torch.randn(shp, generator=g) * scale).to(dtype)
        if view and len(shp) == 2 and shp[0] > 1:
            m, v = m[1:], v.t()  # a view into a larger storage, a transposed one
        state[k] = {"step": torch.tensor(float(k)), "exp_avg": m, "exp_avg_sq": v}
    obj = {"optimizer": {"state": state}}
    p = tmp_path_factory.mktemp("any") / "a.ckz"
    kw = {} if chunk is None else {"chunk_size": chunk}
    if use_async:
        ckptzip.async_save(obj, p, **kw).wait()
    else:
        ckptzip.save(obj, p, **kw)
    assert_same(ckptzip.load(p), obj)


def test_pipeline_with_the_torch_code_paths(tmp_path, monkeypatch):
    """A whole save and load through the torch (CUDA) code paths of expref and expgrid, run on
    CPU tensors, windows smaller than the storages: bit-exact, and the same file as numpy's."""
    from ckptzip.transforms import refs
    st_ = grid_state(seed=4, rows=512, cols=300)
    for s in st_["optimizer"]["state"].values():  # m follows v here, so expref is chosen too
        s["exp_avg"] = s["exp_avg_sq"].sqrt() * torch.randn(s["exp_avg_sq"].shape, generator=torch.Generator().manual_seed(1))
    a, b = tmp_path / "np.ckz", tmp_path / "torch.ckz"
    ckptzip.save(st_, a, chunk_size=1 << 16)
    monkeypatch.setattr(refs, "_TORCH_ON_CPU", True)
    info = ckptzip.save(st_, b, chunk_size=1 << 16)
    assert info["expref_storages"] and info["expgrid_storages"]
    assert_same(ckptzip.load(b), st_)
    monkeypatch.setattr(refs, "_TORCH_ON_CPU", False)
    assert open(a, "rb").read() == open(b, "rb").read()


@pytest.mark.usefixtures("no_pack")
def test_level_break_survives_an_empty_first_storage(tmp_path, monkeypatch):
    """A file whose reference level starts with an empty storage (valid, though ckptzip never
    writes one): the next storage of that level still starts a new decode group, so a CPU group
    never undoes ``expref`` in parallel with the decode of its reference (found by a review:
    the break sat on the empty storage's batches, of which there are none)."""
    from ckptzip.engine import decode as D
    from ckptzip.transforms.refs import ExpRef
    g = torch.Generator().manual_seed(0)
    v = torch.rand(4096, generator=g) + 0.5
    m = torch.randn(4096, generator=g) * v.sqrt()
    res = ExpRef(3).bind(v.view(torch.uint8)).encode(m.view(torch.uint8).clone())
    p = tmp_path / "a.ckz"
    ckptzip.save({"a0": torch.empty(0), "a1": torch.empty(0), "m": res.view(torch.float32), "v": v}, p,
                 codec="zstd", transform=None, derive=False)
    data, doc, rows = read_parts(p)
    with ckptzip.open(p) as r:
        s_of = {t["key"]: t["storage"] for t in r.tensor_info()}
    assert s_of["v"] == 3
    doc["storages"][s_of["m"]]["transforms"] = [{"id": "expref", "ref": {"storage": s_of["v"]}}]
    doc["storages"][s_of["a1"]]["transforms"] = [{"id": "expref", "ref": {"storage": s_of["a0"]}}]
    doc["version"] = [1, 2]
    q = tmp_path / "b.ckz"
    write_parts(q, data, doc, rows)
    grouped = []
    real = D.decode_group

    def spy(src, soffs, rows_, grp, work, *rest):
        grouped.append({type(j.ref).__name__ if j.ref else "plain" for j, *_ in grp})
        return real(src, soffs, rows_, grp, work, *rest)
    monkeypatch.setattr(D, "decode_group", spy)
    back = ckptzip.load(q)
    assert torch.equal(back["m"].view(torch.int32), m.view(torch.int32))
    assert all(not ("ExpRef" in gs and "plain" in gs) for gs in grouped), grouped


def test_sync_save_reuses_plans_only_when_asked(tmp_path, monkeypatch):
    """ckptzip.save samples every time unless ``reuse_plan=True``; the manager's synchronous
    saves reuse (as async saves do). Every file loads bit-exact."""
    from ckptzip.engine import planner
    calls = []
    real = planner.Planner._plan_all

    def spy(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(planner.Planner, "_plan_all", spy)
    planner._PLAN_CACHE.clear()
    st_ = grid_state(seed=4)
    for i in range(2):
        ckptzip.save(st_, tmp_path / f"plain{i}.ckz")
    assert len(calls) == 2
    for i in range(2):
        ckptzip.save(st_, tmp_path / f"reuse{i}.ckz", reuse_plan=True)
    assert len(calls) == 3  # the first reusing save samples and fills the cache
    for i in range(2):
        assert_same(ckptzip.load(tmp_path / f"reuse{i}.ckz"), st_)
    mgr = ckptzip.CheckpointManager(tmp_path / "run")
    for step in range(2):
        for s in st_["optimizer"]["state"].values():
            s["exp_avg_sq"].mul_(0.9)
        mgr.save(step, st_)
    assert len(calls) == 3
    back = mgr.load()
    for k, s in st_["optimizer"]["state"].items():
        assert torch.equal(back["optimizer"]["state"][k]["exp_avg_sq"], s["exp_avg_sq"])


@pytest.mark.parametrize("fused", [True, False, "one call per piece"])
def test_expgrid_and_expref_fused_cpu_decode(tmp_path, monkeypatch, fused):
    """CPU loads undo ``expgrid`` and ``expref`` in place on each piece of a fused byteplane
    batch (pieces split between threads, each with its own start offset: in the C queue with
    its post steps, or one call each and the step in Python), or in two steps: bit-exact either
    way, and the fused path really takes these storages."""
    from ckptzip import native
    from ckptzip.engine import decode as dec
    if fused and (native.lib is None or not native.lib.zstd_version()):
        pytest.skip("no C extension or no system libzstd")
    monkeypatch.setattr(dec, "FUSED", bool(fused))
    monkeypatch.setattr(dec, "QUEUE_PIECES", fused is True)
    monkeypatch.setattr(dec, "FUSED_MIN", 1 << 16)
    monkeypatch.setattr(dec.ccpu, "PARALLEL_BYTES", 1 << 18)  # pieces of 128 KiB and up
    st_ = grid_state(rows=512, cols=768, layers=2)
    st_["opt2"] = adam_state(1, rows=512, cols=768, layers=1)["optimizer"]  # (m against v: expref)
    p = tmp_path / "g.ckz"
    info = ckptzip.save(st_, p, device="cpu", chunk_size=1 << 16)
    assert info["expgrid_storages"] >= 2
    tf = transforms_by_key(p)
    assert tf["opt2.state.0.exp_avg"][0] == "expref" and tf["optimizer.state.0.exp_avg_sq"][0] == "expgrid"
    calls = []
    if fused:
        real = native.lib

        from conftest import FusedSpy
        monkeypatch.setattr(native, "lib", FusedSpy(real, lambda *a: calls.append((a[8], a[9]))))
        posts = []
        real_post = dec._queue_post
        monkeypatch.setattr(dec, "_queue_post", lambda *a: posts.append(real_post(*a)) or posts[-1])
    assert_same(ckptzip.load(p), st_)
    if fused:
        assert any(w0 > 0 for w0, _w1 in calls)  # a batch cut into pieces
    if fused is True:  # (both steps went to the queue)
        assert {p[0] for p in posts if p} == {"grid", "ref"}


def test_exponent_entropy_native_equals_numpy():
    """The CPU planner's exponent entropy (``refplan._exp_bits``) is the same through the C
    extension's plane_entropy as through numpy, for any words."""
    import numpy as np
    from ckptzip import native
    from ckptzip.engine import refplan
    if native.lib is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(5)
    for words in (rng.integers(0, 2**32, 5000, dtype=np.uint64).astype(np.uint32),
                  (rng.standard_normal(16384) * 1e-3).astype(np.float32).view(np.uint32),
                  np.zeros(7, np.uint32), np.full(100, 0x7F800000, np.uint32)):
        got = refplan._exp_bits(words)
        lib, native.lib = native.lib, None
        try:
            want = refplan._exp_bits(words)
        finally:
            native.lib = lib
        assert abs(got - want) < 1e-9


def test_states_without_float32_skip_the_adam_key_search(monkeypatch):
    """``expref`` and ``expgrid`` take float32 moments only: a save with no float32 storage
    does not build the tensors' dotted keys to look for them (13 us per tensor), and a float32
    one still finds its Adam pairs."""
    import io
    import ckptzip
    from ckptzip import pipeline
    calls = []
    real = pipeline.tensor_keys
    monkeypatch.setattr(pipeline, "tensor_keys", lambda root, **kw: calls.append(1) or real(root, **kw))
    g = torch.Generator().manual_seed(0)
    m = torch.randn(256, 64, generator=g) * 1e-3
    st = {"state": {0: {"exp_avg": m, "exp_avg_sq": m * m}}}
    bf = {"state": {0: {k: v.to(torch.bfloat16) for k, v in st["state"][0].items()}}}
    ckptzip.save(bf, io.BytesIO(), device="cpu")
    assert not calls
    ckptzip.save(st, io.BytesIO(), device="cpu")
    assert calls


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([4, 8]), st.integers(1, 4500), st.integers(1, 5000), st.integers(0, 9000),
       st.integers(0, 9000), st.integers(0, 2**32 - 1))
def test_encode_pre_step_equals_residual_then_planes(width, n, block, a, b, seed):
    """``_bpnative.encode``'s pre step (expgrid's or expref's residual made word by word inside
    the planes' pass) writes the planes of the residual that ``exp_grid`` / ``exp_ref`` make
    first, for words of 4 or 8 bytes, any block and word range, and leaves the source as it was."""
    from ckptzip import native
    if native.lib is None:
        pytest.skip("the C extension is not built")
    lib = native.lib
    rng = np.random.default_rng(seed)
    q = n * width // 4  # float32 words
    src = (rng.standard_normal(q) * 1e-3).astype(np.float32).view(np.uint8)
    keep = src.copy()
    w0, w1 = sorted((a % (n + 1), b % (n + 1)))
    rr = rng.integers(0, 40000, 97).astype(np.int32)
    cc = rng.integers(-3000, 3000, 101).astype(np.int32)
    g0 = int(rng.integers(0, 97 * 101 - q + 1)) if q <= 97 * 101 else None
    ref = (rng.standard_normal(q) * 1e-2).astype(np.float32).view(np.uint8)
    for pre in ([("grid", rr, cc, g0)] if g0 is not None else []) + [("ref", ref)]:
        res = np.empty_like(src)
        if pre[0] == "grid":
            lib.exp_grid(src, res, rr, cc, g0, -1)
        else:
            lib.exp_ref(src, res, ref, -1)
        want = np.zeros_like(src)
        lib.encode(res, want, width, block, w0, w1)
        got = np.zeros_like(src)
        lib.encode(src, got, width, block, w0, w1, pre)
        assert bytes(got) == bytes(want)
        assert bytes(src) == bytes(keep)


def test_encode_pre_step_refused_when_it_does_not_fit():
    """A pre step of an unknown kind, on 2-byte words, past the grid, or with a reference of
    another length or over the destination is a ValueError (nothing written)."""
    from ckptzip import native
    if native.lib is None:
        pytest.skip("the C extension is not built")
    lib = native.lib
    src = np.arange(4000, dtype=np.uint8)
    out = np.zeros(4000, np.uint8)
    rr, cc = np.zeros(10, np.int32), np.zeros(10, np.int32)
    for w, pre in [(4, ("nope",)), (4, 3), (2, ("ref", src.copy())), (8, ("grid", rr, cc, 0)),
                   (4, ("grid", rr, cc, 1)), (4, ("grid", rr, cc, -1)), (4, ("ref", src[:40].copy())),
                   (4, ("ref", out))]:
        with pytest.raises((ValueError, TypeError)):
            lib.encode(src, out, w, 100, 0, 4000 // w, pre)
    assert not out.any()


def test_cpu_saves_make_the_residual_in_the_planes_pass(tmp_path, monkeypatch):
    """CPU saves of expgrid / expref storages under byte planes make the residual inside the
    planes' C pass (no residual tensor): the file is byte for byte the one the residual made
    first gives, the caller's tensors are untouched, and the load is bit-exact."""
    from ckptzip import native
    from ckptzip.engine import encode as enc
    if native.lib is None:
        pytest.skip("the C extension is not built")
    st_ = grid_state(rows=512, cols=768, layers=2)
    st_["opt2"] = adam_state(1, rows=512, cols=768, layers=1)["optimizer"]  # (m against v: expref)
    before = {k: v.clone() for k, v in _tensors(st_).items()}
    seen = []
    real = enc._pre_step
    monkeypatch.setattr(enc, "_pre_step", lambda u: seen.append(real(u)) or seen[-1])
    a, b = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save(st_, a, device="cpu", chunk_size=1 << 16)
    assert {p[0] for p in seen if p} == {"grid", "ref"}
    monkeypatch.setattr(enc, "_pre_step", lambda u: None)
    ckptzip.save(st_, b, device="cpu", chunk_size=1 << 16)
    assert a.read_bytes() == b.read_bytes()
    for k, v in _tensors(st_).items():
        assert torch.equal(v, before[k]), k
    assert_same(ckptzip.load(a), st_)


def _tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if isinstance(obj, dict):
        return {k: v for key, x in obj.items() for k, v in _tensors(x, f"{path}.{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, x in enumerate(obj) for k, v in _tensors(x, f"{path}.{i}").items()}
    return {}


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6000), st.integers(0, 2**32 - 1), st.sampled_from([1e-8, 1e-3, 1.0]))
def test_top_entropy_step_equals_the_residual_tensor(n, seed, scale):
    """The exponent predictors' choice (``cpu_choose``) takes the residual's exponent entropy
    from ``top_entropy``'s step, without a residual tensor: exactly the value the residual tensor
    gives, for expgrid and expref."""
    from ckptzip import native
    from ckptzip.engine import refplan
    from ckptzip.transforms.refs import ExpGrid, ExpRef
    if native.lib is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(seed)
    x = torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32)).view(torch.uint8)
    rows = max(1, int(rng.integers(1, 50)))
    cols = -(-n // rows)
    grid = ExpGrid(rows, cols, rng.integers(0, 40000, rows).astype("<u2"), rng.integers(-3000, 3000, cols).astype("<i2"))
    ref = ExpRef(0).bind(torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32)).view(torch.uint8))
    for rt in (grid, ref):
        step = refplan._residual_step(rt, x)
        assert step is not None
        want = refplan._exp_bits(rt.encode(x, start=0).numpy().view(np.uint32))
        assert native.lib.top_entropy(x.numpy(), step) + 0.0 == want
