"""Packed storages (format 1.5): small storages of one device and element type are stored back to
back as one storage and loaded each into a storage of its own."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip import pipeline
from conftest import assert_same, check_newer_minor, cuda_ok, read_parts, same_bits, write_parts


def _small_state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g)
    return {
        "w": torch.randn(300, 200, generator=g),  # (240 KB: stays on its own)
        "norm": torch.nn.Parameter(torch.randn(256, generator=g)),
        "bias": torch.randn(256, generator=g).requires_grad_(),
        "half": torch.randn(100, generator=g).half(),
        "bf": torch.randn(77, generator=g).bfloat16(),
        "bf2": torch.randn(33, generator=g).bfloat16(),
        "step": torch.tensor(3.0),
        "steps": [torch.tensor(float(k)) for k in range(20)],
        "ints": torch.arange(10),
        "base": base, "view": base[8:40:2], "t": base.view(8, 8).t(),  # one storage, three tensors
        "empty": torch.zeros(0),
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np2": np.ones(5, dtype=np.float32),
    }


def _tensors(o):
    if isinstance(o, torch.Tensor):
        yield o
    elif isinstance(o, dict):
        for v in o.values():
            yield from _tensors(v)
    elif isinstance(o, (list, tuple)):
        for v in o:
            yield from _tensors(v)


def test_packed_round_trip_gives_each_storage_its_own(tmp_path):
    """Small storages are packed (format 1.5), and load bit-exact, each into its own storage of
    its own size: tensors that shared a storage share one again, others never do."""
    state = _small_state()
    p = tmp_path / "a.ckz"
    ckptzip.save(state, p)
    _data, doc, _rows = read_parts(p)
    assert doc["version"] == [1, 5] and open(p, "rb").read()[10] == 5
    packed = [s for s in doc["storages"] if "in" in s]
    assert len(packed) >= 20 and all("rows" not in s and "codec" not in s for s in packed)
    # (numpy arrays pack too; a lone storage of its kind, float16 or int64 here, stays on its own)
    assert {s["elem"] for s in packed} == {"float32", "bfloat16", "<f4"}
    big = [s for s in doc["storages"] if s["nbytes"] == 240_000]
    assert len(big) == 1 and "rows" in big[0]  # (over PACK_MAX: stored on its own)
    out = ckptzip.load(p)
    assert_same(out, state)
    assert isinstance(out["norm"], torch.nn.Parameter) and out["bias"].requires_grad
    ts, orig = list(_tensors(out)), list(_tensors(state))
    for a, b in zip(ts, orig):
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    ids = [t.untyped_storage().data_ptr() for t in _tensors(out)]
    same = {"base", "view", "t"}
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    by_key = dict(zip(keys, [out[k].untyped_storage().data_ptr() for k in keys]))
    assert len({by_key[k] for k in same}) == 1
    others = [by_key[k] for k in keys if k not in same and k != "empty"]
    assert len(set(others)) == len(others) and by_key["base"] not in others
    assert len(set(ids)) == len(ids) - 2  # (view and t share base's storage)
    out["norm"].data.add_(1)  # writing one tensor touches no other
    assert_same({k: out[k] for k in keys if k != "norm"}, {k: state[k] for k in keys if k != "norm"})
    assert out["np"].dtype == np.float32 and out["np"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_packed_storages_read_lazily_and_into_targets(tmp_path):
    """The lazy reader serves a packed tensor alone (its pack decoded for it), read_into fills a
    packed target, verify checks every chunk, and ``info`` names the pack."""
    state = _small_state()
    p = tmp_path / "a.ckz"
    ckptzip.save(state, p)
    with ckptzip.open(p) as r:
        assert same_bits(r.get_tensor("bf"), state["bf"])
        assert same_bits(r.get_tensor("steps.7"), state["steps"][7])
        assert same_bits(r.get_tensor("view"), state["view"])
        tgt = {"half": torch.empty(100, dtype=torch.float16), "bias": torch.empty(256)}
        assert sorted(r.read_into(tgt)) == ["bias", "half"]
        assert same_bits(tgt["half"], state["half"]) and same_bits(tgt["bias"], state["bias"].detach())
        r.verify()
        i = next(t["storage"] for t in r.tensor_info() if t["key"] == "bf")
        assert "in" in r.storages[i] and r.stored_bytes(i) == 0
    out = subprocess.run([sys.executable, "-m", "ckptzip", "info", str(p), "--json"], capture_output=True,
                         text=True, check=True)
    info = json.loads(out.stdout)
    row = next(t for t in info["tensors"] if t["key"] == "bf")
    assert "packed_in" in row and row["stored_bytes"] == 0
    dedup = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(state)}
    assert info["raw_bytes"] == sum(dedup.values()) + state["np"].nbytes + state["np2"].nbytes


def test_packing_groups_by_device_and_element_type_and_caps_pack_size(monkeypatch):
    """Packs hold one device and element type, at most PACK_BYTES each; a lone small storage
    of its kind stays on its own; an unpacked save (PACK_MAX 0) is format 1.4 or older."""
    refs_state = {f"a{k}": torch.randn(1000) for k in range(10)}
    refs_state.update({"h": torch.randn(10).half(), "i": torch.arange(5)})
    b = io.BytesIO()
    monkeypatch.setattr(pipeline, "PACK_BYTES", 10_000)
    ckptzip.save(refs_state, b)
    r = ckptzip.open(io.BytesIO(b.getvalue()))
    packs = {}
    for s in r.storages:
        if "in" in s:
            packs.setdefault(s["in"][0], []).append(s)
    assert len(packs) == 5 and all(len(v) == 2 and {x["elem"] for x in v} == {"float32"} for v in packs.values())
    assert all(r.storages[p]["nbytes"] <= 10_000 for p in packs)
    assert_same(ckptzip.load(io.BytesIO(b.getvalue())), refs_state)
    monkeypatch.setattr(pipeline, "PACK_MAX", 0)
    b = io.BytesIO()
    ckptzip.save(refs_state, b)
    assert b.getvalue()[10] < 5 and not any("in" in s for s in ckptzip.open(io.BytesIO(b.getvalue())).storages)


def test_incremental_save_against_a_packed_base(tmp_path):
    """A base whose small storages are packed: an incremental file against it packs its own
    small storages (no delta against a packed storage) and loads bit-exact; its large storages
    are deltas as before."""
    g = torch.Generator().manual_seed(1)
    st0 = {"w": torch.randn(100_000, generator=g), "b": torch.randn(100, generator=g), "c": torch.randn(50, generator=g)}
    ckptzip.save(st0, tmp_path / "base.ckz")
    st1 = {k: v + 1e-6 for k, v in st0.items()}
    res = ckptzip.save(st1, tmp_path / "incr.ckz", base=tmp_path / "base.ckz")
    assert res["delta_storages"] >= 1
    _data, doc, _rows = read_parts(tmp_path / "incr.ckz")
    assert doc["version"] == [1, 5] and doc["bases"] and sum("in" in s for s in doc["storages"]) == 2
    assert_same(ckptzip.load(tmp_path / "incr.ckz"), st1)


def test_xor_against_a_packed_base_storage_loads(tmp_path, monkeypatch):
    """A file whose xor refers to a packed storage of its base (ckptzip does not write this; a
    valid file may) loads bit-exact: the base storage is copied out of its pack first."""
    g = torch.Generator().manual_seed(2)
    st0 = {"a": torch.randn(100, generator=g), "b": torch.randn(100, generator=g)}
    ckptzip.save(st0, tmp_path / "base.ckz")
    st1 = {"a": st0["a"] + 1, "b": st0["b"].clone(), "w": torch.randn(100_000, generator=g)}
    st0b = dict(st0, w=st1["w"].clone())
    ckptzip.save(st0b, tmp_path / "base.ckz")
    with monkeypatch.context() as mp:  # (the new file's b on its own, to be rewritten below)
        mp.setattr(pipeline, "PACK_MAX", 0)
        ckptzip.save(st1, tmp_path / "incr.ckz", base=tmp_path / "base.ckz")
    data, doc, rows = read_parts(tmp_path / "incr.ckz")
    _bd, bdoc, _br = read_parts(tmp_path / "base.ckz")
    bkeys = {k: n["s"] for k, n in zip(bdoc["root"]["k"], bdoc["root"]["v"])}
    assert "in" in bdoc["storages"][bkeys["b"]]
    # storage "b" of the new file: raw zstd -> an xor against the base's packed "b" (all zero)
    keys = {k: n["s"] for k, n in zip(doc["root"]["k"], doc["root"]["v"])}
    s = doc["storages"][keys["b"]]
    assert "in" not in s
    import zstandard
    z = zstandard.ZstdCompressor().compress(bytes(400))
    off = len(data)
    data2 = data + z
    rows = np.concatenate([rows, rows[:1]])
    rows[-1] = (off, len(z), 400, ckptzip.format.checksum(z), 0)
    s.update(transforms=[{"id": "xor", "ref": {"base": 0, "storage": bkeys["b"]}}], codec={"id": "zstd"},
             rows=[len(rows) - 1, 1])
    doc["n_chunks"] = len(rows)
    doc.get("bases", [{}])[0].pop("storages", None)
    doc.get("bases", [{}])[0].pop("chains", None)
    q = tmp_path / "forged.ckz"
    write_parts(q, data2, doc, rows)
    out = ckptzip.load(q)
    assert same_bits(out["b"], st0["b"]) and same_bits(out["a"], st1["a"])


@pytest.mark.parametrize("edit,match", [
    (lambda st, i, p: st[i].__setitem__("in", [p]), "pack, start"),
    (lambda st, i, p: st[i].__setitem__("in", [p, -1]), "pack, start"),
    (lambda st, i, p: st[i].__setitem__("in", [float(p), 0]), "pack, start"),
    (lambda st, i, p: st[i].__setitem__("in", [True, 0]), "pack, start"),
    (lambda st, i, p: st[i].__setitem__("in", [len(st), 0]), "does not exist"),
    (lambda st, i, p: st[i].__setitem__("in", [i, 0]), "is itself"),
    (lambda st, i, p: st[p].__setitem__("in", [i, 0]), "packed"),
    (lambda st, i, p: st[i].__setitem__("in", [p, st[p]["nbytes"] - 1]), "outside its pack"),
    (lambda st, i, p: st[i].__setitem__("nbytes", st[p]["nbytes"] + 8), "outside its pack"),
    (lambda st, i, p: st[i].__setitem__("rows", [0, 0]), "no rows"),
    (lambda st, i, p: st[i].__setitem__("codec", {"id": "zstd"}), "no rows"),
    (lambda st, i, p: st[i].__setitem__("transforms", []), "no rows"),
    (lambda st, i, p: st[p].__setitem__("transforms", [{"id": "expref", "ref": {"storage": i}}]
                                        + st[p].get("transforms", [])), "refers to another|packed"),
    (lambda st, i, p: st[0 if i else 1].__setitem__("transforms", [{"id": "expref", "ref": {"storage": i}}]), "packed|bytes"),
])
def test_forged_packs_are_refused(tmp_path, edit, match):
    """Every field of a packed storage is checked before anything is allocated or decoded."""
    p = tmp_path / "a.ckz"
    ckptzip.save({"x": torch.randn(100), "y": torch.randn(50), "z": torch.randn(30)}, p)
    data, doc, rows = read_parts(p)
    st = doc["storages"]
    i = next(k for k, s in enumerate(st) if "in" in s)
    edit(st, i, st[i]["in"][0])
    q = tmp_path / "bad.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CorruptFileError, match=match):
        ckptzip.load(q)


def test_packed_storages_count_against_max_bytes(tmp_path):
    """A load's budget counts the packs it decodes for the storages asked for."""
    p = tmp_path / "a.ckz"
    ckptzip.save({"x": torch.randn(1000), "y": torch.randn(1000)}, p)
    with pytest.raises(ckptzip.ResourceLimitError):
        ckptzip.load(p, max_bytes=6000)
    ckptzip.load(p, max_bytes=16000)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8]),
                       min_size=12, max_size=12))
def test_packed_round_trip_any_small_tensors(sizes, dtypes):
    g = torch.Generator().manual_seed(len(sizes))
    state = {}
    for k, n in enumerate(sizes):
        x = torch.randint(0, 255, (n * 4,), generator=g, dtype=torch.uint8)
        d = dtypes[k]
        state[f"t{k}"] = x.view(d)[: n]
    b = io.BytesIO()
    ckptzip.save(state, b)
    out = ckptzip.load(io.BytesIO(b.getvalue()))
    assert_same(out, state)
    ptrs = [out[k].untyped_storage().data_ptr() for k in out if out[k].numel()]
    assert len(set(ptrs)) == len(ptrs)


@pytest.mark.gpu
def test_packed_storages_on_the_gpu_cross_decode(tmp_path):
    """CUDA tensors are packed too; a GPU-written file loads on the CPU and the other way round,
    each tensor in its own storage."""
    if not cuda_ok():
        pytest.skip("needs a CUDA GPU with nvCOMP")
    state = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _small_state().items()
             if k not in ("steps",)}
    state["steps_like"] = torch.tensor(2.0, device="cuda")
    p = tmp_path / "g.ckz"
    ckptzip.save(state, p)
    assert any("in" in s for s in read_parts(p)[1]["storages"])
    on_gpu = ckptzip.load(p)
    assert on_gpu["bf"].is_cuda and on_gpu["bf"].untyped_storage().nbytes() == state["bf"].untyped_storage().nbytes()
    assert_same({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in on_gpu.items()},
                {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    z = tmp_path / "z.ckz"  # (a CPU-decodable codec: its packs decoded on the CPU)
    ckptzip.save(state, z, codec="zstd")
    assert_same(ckptzip.load(z, map_location="cpu", decode_device="cpu")["half"], state["half"].cpu())
    assert_same(ckptzip.load(z, map_location="cpu", decode_device="cpu")["steps_like"], state["steps_like"].cpu())
    q = tmp_path / "c.ckz"
    ckptzip.save({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}, q, device="cpu")
    assert_same(ckptzip.load(q, map_location="cuda")["bf"].cpu(), state["bf"].cpu())


def test_packed_and_unpacked_saves_of_one_structure_keep_their_plans(tmp_path):
    """One structure saved packed (full) and unpacked (incremental) in turn with reuse_plan:
    each save plans its own storages (a plan cached for the other list must not be applied)."""
    g = torch.Generator().manual_seed(4)
    st = {"B": torch.randint(0, 9, (3,), dtype=torch.uint8, generator=g),
          "C": torch.randint(0, 9, (4,), dtype=torch.uint8, generator=g),
          "A": torch.randn(100_000, generator=g), "D": torch.randn(100_000, generator=g),
          "a": torch.randn(256, generator=g), "b": torch.randn(256, generator=g), "c": torch.randn(64, generator=g)}
    ckptzip.save({"x": torch.randn(10)}, tmp_path / "other.ckz")
    for k in range(3):
        ckptzip.save(st, tmp_path / f"full{k}.ckz", reuse_plan=True)
        ckptzip.save(st, tmp_path / f"inc{k}.ckz", base=tmp_path / f"full{k}.ckz", reuse_plan=True)
        ckptzip.save(st, tmp_path / f"odd{k}.ckz", base=tmp_path / "other.ckz", reuse_plan=True)
        for name in (f"full{k}", f"inc{k}", f"odd{k}"):
            assert_same(ckptzip.load(tmp_path / f"{name}.ckz"), st)


def test_incremental_manager_with_a_small_model(tmp_path):
    """CheckpointManager(incremental=True) on a model of small tensors: every step loads back."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mgr = ckptzip.CheckpointManager(tmp_path, incremental=True, full_every=3)
    for step in range(1, 5):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01)
        mgr.save(step, {"model": m.state_dict()})
        assert_same(mgr.load(step)["model"], m.state_dict())


def test_a_pack_is_decoded_once_for_its_members(tmp_path, monkeypatch):
    """Reading a pack's members key by key (get_tensor, with keep or not, read_into) decodes the
    pack once; load() does not keep it."""
    from ckptzip import api
    state = {f"t{k}": torch.randn(500) for k in range(40)}
    p = tmp_path / "a.ckz"
    ckptzip.save(state, p)
    seen = []
    real = api.decode_jobs
    monkeypatch.setattr(api, "decode_jobs", lambda fd, jobs, *a, **k: (seen.append(len(jobs)), real(fd, jobs, *a, **k))[1])
    with ckptzip.open(p) as r:
        tgt = {k: torch.empty(500) for k in list(state)[:5]}
        assert sorted(r.read_into(tgt)) == sorted(tgt)
        assert all(same_bits(tgt[k], state[k]) for k in tgt)
        for keep in (False, True):
            for k in r.keys():
                assert same_bits(r.get_tensor(k, keep=keep), state[k])
    assert sum(seen) == 1, seen
    seen.clear()
    with ckptzip.open(p) as r:  # (members of a kept pack read together: still nothing decoded)
        assert same_bits(r.get_tensor("t3"), state["t3"])
        tgt = {k: torch.empty(500) for k in list(state)[5:12]}
        assert sorted(r.read_into(tgt)) == sorted(tgt) and all(same_bits(tgt[k], state[k]) for k in tgt)
    assert sum(seen) == 1, seen
    with ckptzip.open(p) as r:
        r.load()
        assert not r._packs


def test_newer_minor_with_an_unknown_storage_kind_says_so(tmp_path):
    """A storage record of a kind this reader does not know (no chunk rows, like a 1.5 packed
    storage to a 1.4 reader) in a file of a newer minor is an UnsupportedVersionError naming
    both versions; at this reader's minor it is a CorruptFileError."""
    p = tmp_path / "a.ckz"
    ckptzip.save({"x": torch.randn(100), "y": torch.randn(50)}, p)
    data, doc, rows = read_parts(p)
    i = next(k for k, s in enumerate(doc["storages"]) if "in" in s)
    doc["storages"][i] = {"nbytes": doc["storages"][i]["nbytes"], "elem": "float32", "future": [0, 1]}
    check_newer_minor(tmp_path, data, doc, rows, "rows")


@pytest.fixture(scope="module")
def packed_seed(tmp_path_factory):
    """A file with four packs (float32, float16, bfloat16 and numpy float32 members; views among
    them) and its parts, edited by the fuzzer below."""
    d = tmp_path_factory.mktemp("packfuzz")
    state = _small_state()
    state["more"] = [torch.randn(40 + k) for k in range(6)]
    state["h2"] = torch.randn(50).half()
    ckptzip.save(state, d / "seed.ckz", chunk_size=4096)
    data, doc, rows = read_parts(d / "seed.ckz")
    assert len({s["in"][0] for s in doc["storages"] if "in" in s}) == 4
    return d, data, doc, rows


_EDGE = [0, 1, 2, 3, 7, 8, -1, 2**31, 2**63 - 1, 2**64, "0", 0.0, None, [], True]
_FIELDS = ["pack", "start", "nbytes", "elem", "device", "in", "drop_in", "rows", "pack_nbytes", "pack_rows"]


@settings(max_examples=int(os.environ.get("CKPTZIP_FUZZ_EXAMPLES", 150)), deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(_FIELDS),
                                st.one_of(st.sampled_from(_EDGE), st.integers(-4, 600))), min_size=1, max_size=3))
def test_fuzz_packed_records(packed_seed, edits):
    """Forged packed-storage records (format 1.5), one to three edits at a time with valid
    checksums: a member's pack and start set to any value, its size, element type or device
    changed, ``in`` given to a pack or to a storage with chunks, taken from a member, a pack
    resized or its rows moved. Every reading path (keys, get_tensor, read_into, load, verify)
    gives a named error or tensors that lie inside their own storages."""
    d, data, doc0, rows = packed_seed
    doc = json.loads(json.dumps(doc0))
    st_ = doc["storages"]
    members = [k for k, s in enumerate(st_) if "in" in s]
    packs = sorted({st_[k]["in"][0] for k in members})
    for pick, field, v in edits:
        i = members[pick % len(members)]
        p = packs[pick % len(packs)]
        s = st_[i]
        inn = s.get("in") if isinstance(s.get("in"), list) and len(s["in"]) == 2 else None
        if field == "pack" and inn:
            s["in"] = [v, inn[1]]
        elif field == "start" and inn:
            s["in"] = [inn[0], v]
        elif field == "in":
            st_[pick % len(st_)]["in"] = [p, v] if type(v) is int else v
        elif field == "drop_in":
            s.pop("in", None)
        elif field == "rows":
            s["rows"] = [v, 1] if type(v) is int else v
        elif field == "pack_nbytes":
            st_[p]["nbytes"] = v
        elif field == "pack_rows":
            r = st_[p].get("rows")
            st_[p]["rows"] = [v, r[1]] if type(v) is int and isinstance(r, list) and len(r) == 2 else v
        elif field == "elem":
            s["elem"] = ["float32", "bfloat16", "int64", "uint8", "bogus", v][pick % 6]
        elif field == "device":
            s["device"] = ["cpu", "cuda:0", "meta", "cuda:7", "disk", v][pick % 6]
        else:  # nbytes
            s[field] = v
    q = d / f"fuzzed-{os.getpid()}.ckz"
    write_parts(q, data, doc, rows)

    def well_formed(x):
        for t in _tensors(x):
            if t.numel():
                need = (t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
                assert need <= t.untyped_storage().nbytes()
    steps = [lambda r: [well_formed(r.get_tensor(k)) for k in r.keys()],
             lambda r: r.read_into({k: torch.empty_like(v) for k, v in _tensors_by_key(r)}),
             lambda r: well_formed(r.load()), lambda r: r.verify()]
    for step in steps:
        try:
            with ckptzip.open(q) as r:
                step(r)
        except ckptzip.CkptzipError:
            pass


def _tensors_by_key(r):
    """(key, tensor) of every key that still loads from the fuzzed file as a contiguous tensor:
    targets for read_into."""
    out = []
    for k in r.keys():
        try:
            t = r.get_tensor(k, keep=False)
        except ckptzip.CkptzipError:
            continue
        if isinstance(t, torch.Tensor) and t.is_contiguous():
            out.append((k, t))
    return out
