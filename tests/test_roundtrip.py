"""Round trips: every dtype, shape, structure, codec and chunk size comes back bit-exact."""
import collections
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip.tree import DTYPES
from conftest import assert_same, nested, same_bits

ALL_DTYPES = sorted(DTYPES.values(), key=str)
CPU_CODECS = ["raw", "zstd", "deflate", "auto"]


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[:n] & 1).bool().reshape(shape)
    if dtype.is_floating_point and dtype.itemsize >= 2 and n:  # mix in realistic values and specials
        vals = torch.randn(n, generator=g).to(dtype)
        keep = torch.rand(n, generator=g) < 0.7
        t = torch.where(keep, vals, raw.view(dtype)) if dtype.itemsize > 1 else raw.view(dtype)
        t = t.clone()
        t.view(-1)[0] = -0.0
        return t.reshape(shape)
    return raw.view(dtype).reshape(shape)


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, codec=st.sampled_from(CPU_CODECS),
       chunk=st.sampled_from([64, 100, 4096, 1 << 20]), seed=st.integers(0, 2**31 - 1),
       transform=st.sampled_from(["auto", None, "byteplane"]))
def test_tensor_roundtrip(tmp_path_factory, dtype, shape, codec, chunk, seed, transform):
    t = random_tensor(dtype, shape, seed)
    before = t.clone()
    p = tmp_path_factory.mktemp("rt") / "t.ckz"
    ckptzip.save({"t": t}, p, codec=codec, chunk_size=chunk, transform=transform, fsync=False)
    assert same_bits(t, before), "save modified the caller's tensor"
    back = ckptzip.load(p)["t"]
    assert same_bits(back, t)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 300_000), chunk=st.sampled_from([64, 1000, 65536]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_large_float_chunks_and_windows(tmp_path_factory, n, chunk, dtype):
    t = torch.randn(n).to(dtype)
    p = tmp_path_factory.mktemp("w") / "t.ckz"
    ckptzip.save([t], p, chunk_size=chunk, window=4096, fsync=False)
    assert same_bits(ckptzip.load(p)[0], t)


leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**200), 2**200), st.floats(allow_nan=True),
    st.text(max_size=20), st.binary(max_size=40),
)
trees = nested(leaves, max_leaves=25)


@settings(max_examples=80, deadline=None)
@given(tree=trees)
def test_structure_roundtrip(tmp_path_factory, tree):
    p = tmp_path_factory.mktemp("s") / "t.ckz"
    ckptzip.save({"x": tree}, p, fsync=False)
    assert_same(ckptzip.load(p), {"x": tree})


def test_state_dict_and_leaves(tmp_path, small_state):
    x = torch.randn(6, 5)
    obj = {
        **small_state,
        "view": x[:, 1], "x": x, "t": x.t(), "slice": x[2:4],
        "bf16": torch.randn(33).bfloat16(), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
        "int_keys": {0: "a", 7: "b"}, "size": torch.Size([2, 3]), "dtype": torch.float8_e4m3fn,
        "device": torch.device("cpu"), "nan": float("nan"), "neg0": -0.0, "inf": float("inf"),
        "big": 3**90, "bytes": b"\x00\xff", "np_arr": np.arange(12, dtype=np.float32).reshape(3, 4),
        "np_int": np.int64(7), "np_f": np.float16(1.5), "np_bool": np.bool_(True),
        "np_fortran": np.asfortranarray(np.ones((3, 2))),
        "py_rng": random.getstate(), "np_rng": np.random.get_state(),
        "np_gen": np.random.default_rng(3).bit_generator.state, "torch_rng": torch.get_rng_state(),
        "param": torch.nn.Parameter(torch.ones(3)), "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "complex": torch.randn(4, dtype=torch.complex64), "conj": torch.randn(3, dtype=torch.complex64).conj(),
    }
    obj["np_fortran"] = np.ascontiguousarray(obj["np_fortran"])
    p = tmp_path / "s.ckz"
    ckptzip.save(obj, p)
    back = ckptzip.load(p)
    obj["conj"] = obj["conj"].resolve_conj()
    assert_same(back, obj)
    # storage sharing survives: the view is a view of x, as with torch.save
    assert back["view"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
    assert back["t"].untyped_storage().data_ptr() == back["x"].untyped_storage().data_ptr()
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert not back["frozen"].requires_grad
    # RNG states restore the generators exactly
    random.setstate(back["py_rng"])
    np.random.set_state(back["np_rng"])
    torch.set_rng_state(back["torch_rng"])


def test_optimizer_state_loads_into_optimizer(tmp_path, small_state):
    p = tmp_path / "o.ckz"
    ckptzip.save(small_state, p)
    back = ckptzip.load(p)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    m.load_state_dict(back["model"])
    opt = torch.optim.AdamW(m.parameters())
    opt.load_state_dict(back["optimizer"])
    assert back["optimizer"]["param_groups"] == small_state["optimizer"]["param_groups"]


def test_lazy_reader_reads_one_tensor(tmp_path, small_state):
    p = tmp_path / "l.ckz"
    ckptzip.save(small_state, p, metadata={"run": "abc"})
    with ckptzip.open(p) as r:
        assert r.metadata == {"run": "abc"}
        assert "model.0.weight" in r.keys()
        assert "optimizer.state.0.exp_avg" in r.keys()
        w = r.get_tensor("model.2.bias")
        assert same_bits(w, small_state["model"]["2.bias"])
        assert len(r._cache) == 1  # only that tensor's storage was decoded
        w2 = r.get_tensor("model.0.weight", keep=False)  # returned, not kept by the reader
        assert same_bits(w2, small_state["model"]["0.weight"]) and len(r._cache) == 1
        with pytest.raises(ckptzip.TensorNotFoundError):
            r.get_tensor("nope")


def test_unsupported_objects_need_pickle(tmp_path):
    class Thing:
        pass
    with pytest.raises(ckptzip.UnsupportedObjectError):
        ckptzip.save({"x": Thing()}, tmp_path / "a.ckz")
    assert not (tmp_path / "a.ckz").exists()
    ckptzip.save({"x": collections.Counter("aab")}, tmp_path / "b.ckz", allow_pickle=True)
    with pytest.raises(ckptzip.PickleNotAllowedError):
        ckptzip.load(tmp_path / "b.ckz")
    assert ckptzip.load(tmp_path / "b.ckz", allow_pickle=True)["x"] == collections.Counter("aab")


def test_map_location(tmp_path):
    ckptzip.save({"a": torch.ones(3)}, tmp_path / "m.ckz")
    assert ckptzip.load(tmp_path / "m.ckz", map_location="cpu")["a"].device.type == "cpu"
    assert ckptzip.load(tmp_path / "m.ckz", map_location={"cpu": "cpu"})["a"].device.type == "cpu"


def test_compresses_trained_floats(tmp_path, small_state):
    p = tmp_path / "c.ckz"
    r = ckptzip.save(small_state, p)
    assert r["stored_bytes"] < 0.95 * r["raw_bytes"]


def test_unsupported_object_error_names_where_it_is(tmp_path):
    with pytest.raises(ckptzip.UnsupportedObjectError, match=r"\['model'\]\['a'\]\[1\]"):
        ckptzip.save({"model": {"a": [1, object()]}}, tmp_path / "x.ckz")
    assert not (tmp_path / "x.ckz").exists()


def test_read_into_fills_whole_storages_only(tmp_path):
    """CheckpointReader.read_into decodes a key into the caller's tensor only where the stored
    tensor is its storage's whole contiguous content with the target's dtype and shape."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 5, generator=g)
    st = {"w": w, "row": w[1], "h": torch.randn(3, generator=g).half(), "t": torch.randn(3, 2, generator=g).t()}
    p = tmp_path / "r.ckz"
    ckptzip.save(st, p)
    with ckptzip.open(p) as r:
        tg = {"row": torch.empty(5), "w": torch.empty(4, 5), "h": torch.empty(3, dtype=torch.float32),
              "t": torch.empty(2, 3), "missing": torch.empty(1)}
        got = r.read_into(tg)
        assert got == ["w"]
        assert torch.equal(tg["w"], w)
        assert torch.equal(r.get_tensor("row"), w[1]) and torch.equal(r.get_tensor("t"), st["t"])
        h = torch.empty(3, dtype=torch.float16)
        assert r.read_into({"h": h}) == ["h"] and torch.equal(h, st["h"])
