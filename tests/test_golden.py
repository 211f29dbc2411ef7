"""Golden files of format v1: every future version of ckptzip must keep reading them bit-exact.
Files written on a GPU with standard codecs (zstd, deflate) must decode on this CPU; files with
GPU-only codecs must raise GPURequiredError here (and decode on a GPU)."""
import glob
import json
import os

import pytest

import ckptzip
from conftest import assert_same, cuda_ok
from fixtures.make_fixtures import (HERE, digests, golden_grid_object, golden_grid_object_next, golden_object,
                                    golden_object_next)

FILES = sorted(glob.glob(os.path.join(HERE, "*.ckz")))
GPU_ONLY = ("ans", "bitcomp", "gdeflate", "lz4", "auto_gpu")


def test_fixtures_present():
    names = {os.path.basename(f) for f in FILES}
    assert {"v1_auto_cpu.ckz", "v1_zstd_cpu.ckz", "v1_raw.ckz", "v1_deflate_cpu.ckz",
            "v11_base_cpu.ckz", "v11_incr_cpu.ckz", "v12_expref_cpu.ckz", "v12_expref_ans_gpu.ckz",
            "v12_expgrid_cpu.ckz", "v12_expgrid_ans_gpu.ckz", "v12_portable_gpu.ckz",
            "v13_hidelta_cpu.ckz", "v13_rot16_cpu.ckz", "v13_rot16_incr_cpu.ckz", "v13_hidelta_zstd_gpu.ckz",
            "v13_rot16_zstd_gpu.ckz", "v13_rot16_incr_zstd_gpu.ckz", "v14_expgrid_incr_cpu.ckz",
            "v14_expgrid_zstd_gpu.ckz", "v14_expgrid_incr_zstd_gpu.ckz", "v15_packed_cpu.ckz"} <= names


def test_expected_digests_match_generator():
    with open(os.path.join(HERE, "expected.json")) as f:
        assert json.load(f) == digests(golden_object())


@pytest.mark.parametrize("path", FILES, ids=[os.path.basename(f) for f in FILES])
def test_golden_file(path):
    name = os.path.basename(path)
    needs_gpu = any(f"_{g}" in name for g in GPU_ONLY)
    if needs_gpu and not cuda_ok():
        with pytest.raises(ckptzip.GPURequiredError):
            ckptzip.load(path, map_location="cpu")
        return
    back = ckptzip.load(path, map_location="cpu")
    if "_expgrid" in name:
        want = golden_grid_object_next() if "_incr" in name else golden_grid_object()
    else:
        want = golden_object_next() if "_incr" in name or "_hidelta" in name else golden_object()
    assert_same(back, want)
    with ckptzip.open(path) as r:
        assert r.metadata["fixture"] == name[:-4]
        r.verify()


def test_v11_pair_uses_the_new_transforms(tmp_path):
    """The 1.1 fixtures hold derived storages (bf16 and fp16 casts of the weights) and delta
    storages against their base, recorded by relative path; moved away from the base, the
    incremental file is a BaseCheckpointError unless base_dir points to it."""
    import shutil
    base, incr = os.path.join(HERE, "v11_base_cpu.ckz"), os.path.join(HERE, "v11_incr_cpu.ckz")
    for p in (base, incr):
        assert open(p, "rb").read(12)[8:12] == b"\x01\x00\x01\x00"
    with ckptzip.open(base) as r:
        ids = [t["id"] for s in r.storages for t in s.get("transforms", [])]
        assert ids.count("derived") == 2 and r.base is None
    with ckptzip.open(incr) as r:
        ids = [t["id"] for s in r.storages for t in s.get("transforms", [])]
        assert "delta" in ids and r.base["file"] == "v11_base_cpu.ckz" and r.base["depth"] == 1
    assert ckptzip.base_chain(incr) == [base]
    shutil.copy(incr, tmp_path / "incr.ckz")
    with pytest.raises(ckptzip.BaseCheckpointError, match="v11_base_cpu.ckz"):
        ckptzip.load(tmp_path / "incr.ckz")
    assert_same(ckptzip.load(tmp_path / "incr.ckz", base_dir=HERE), golden_object_next())


@pytest.mark.parametrize("name", ["v13_hidelta_cpu.ckz", "v13_hidelta_zstd_gpu.ckz"])
def test_v13_files_use_hidelta(name, monkeypatch):
    """Format 1.3 (written on a CPU, and on a GPU by the Triton kernel, both zstd): the float32
    weights as ``hidelta`` against the 1.1 base's plain byteplane storage, decoded on the CPU
    from the base's planes 0, 2 and 3, the base's document unread (located storages)."""
    import ckptzip.api as api
    from ckptzip.transforms import byteplane
    path = os.path.join(HERE, name)
    assert open(path, "rb").read(12)[8:12] == b"\x01\x00\x03\x00"
    with ckptzip.open(path) as r:
        ids = [[t["id"] for t in s.get("transforms", [])] for s in r.storages]
        assert ["hidelta", "byteplane"] in ids and r.base["file"] == "v11_base_cpu.ckz"
    seen, opened = [], []
    real, real_open = byteplane.PlaneSubset.decode, api.open_base
    monkeypatch.setattr(byteplane.PlaneSubset, "decode", lambda self, s, d: (seen.append(self.planes), real(self, s, d)))
    monkeypatch.setattr(api, "open_base", lambda *a, **k: (opened.append(1), real_open(*a, **k))[1])
    assert_same(ckptzip.load(path, map_location="cpu"), golden_object_next())
    assert seen and set(seen) == {(0, 2, 3)} and not opened


@pytest.mark.parametrize("base", ["v13_rot16_cpu.ckz", "v13_rot16_zstd_gpu.ckz"])
def test_v13_rotate16_pair(base, monkeypatch):
    """Format 1.3 ``byteplane`` ``rotate`` 16 (the float32 weights of GPU saves): the standalone
    file loads bit-exact, and its incremental twin decodes the base's weights from planes 2 and 3
    only (on the CPU here)."""
    from ckptzip.transforms import byteplane
    path = os.path.join(HERE, base)
    with ckptzip.open(path) as r:
        assert {"id": "byteplane", "width": 4, "block": 4194304, "rotate": 16} in [
            t for s in r.storages for t in s.get("transforms", [])]
    assert_same(ckptzip.load(path, map_location="cpu"), golden_object())
    seen = []
    real = byteplane.PlaneSubset.decode
    monkeypatch.setattr(byteplane.PlaneSubset, "decode", lambda self, s, d: (seen.append(self.planes), real(self, s, d)))
    assert_same(ckptzip.load(os.path.join(HERE, base.replace("rot16", "rot16_incr")), map_location="cpu"),
                golden_object_next())
    assert seen and set(seen) == {(2, 3)}


@pytest.mark.parametrize("name, base", [("v14_expgrid_incr_cpu.ckz", "v12_expgrid_cpu.ckz"),
                                        ("v14_expgrid_incr_zstd_gpu.ckz", "v14_expgrid_zstd_gpu.ckz")])
def test_v14_expgrid_base_storage_is_located(name, base, tmp_path, monkeypatch):
    """Format 1.4: Adam v stored as ``delta`` against the base's ``expgrid`` storage, which the
    file's base record locates with its ``expgrid`` chain: the load plans it without reading
    the base's document; a record whose grid does not fit the storage is a CorruptFileError."""
    import ckptzip.api as api
    from conftest import read_parts, write_parts
    path = os.path.join(HERE, name)
    assert open(path, "rb").read(12)[8:12] == b"\x01\x00\x04\x00"
    with ckptzip.open(path) as r:
        assert "delta" in [t["id"] for s in r.storages for t in s.get("transforms", [])]
        k = [c for c, ch in enumerate(r.base["chains"])
             if ch["transforms"] and ch["transforms"][0]["id"] == "expgrid"][0]
    opened = []
    real = api.open_base
    monkeypatch.setattr(api, "open_base", lambda *a, **k: (opened.append(1), real(*a, **k))[1])
    assert_same(ckptzip.load(path, map_location="cpu"), golden_grid_object_next())
    assert not opened
    data, doc, rows = read_parts(path)
    doc["bases"][0]["chains"][k]["transforms"][0]["rows"] = 40  # (48 x 80 words in the base)
    q = tmp_path / name
    write_parts(q, data, doc, rows)
    import shutil
    shutil.copy(os.path.join(HERE, base), tmp_path)
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.load(q)


@pytest.mark.parametrize("name", ["v12_expgrid_cpu.ckz", "v12_expgrid_ans_gpu.ckz"])
def test_v12_grid_file_uses_expgrid(name):
    """CPU (zstd on byte planes) and GPU (ANS on whole words, written on an H100) twins of one
    state: exp_avg_sq stored as ``expgrid``, exp_avg as ``expref`` against it."""
    with ckptzip.open(os.path.join(HERE, name)) as r:
        ids = [[t["id"] for t in s.get("transforms", [])] for s in r.storages]
        if "_gpu" in name:
            assert ["expgrid"] in ids and ["expref"] in ids
        else:
            assert ["expgrid", "byteplane"] in ids and ["expref", "byteplane"] in ids


@pytest.mark.parametrize("name", ["v12_expref_cpu.ckz", "v12_expref_ans_gpu.ckz"])
def test_v12_files_use_expref(name):
    """The 1.2 fixtures (written on a CPU with zstd and on a GPU with ANS) store Adam's exp_avg
    as ``expref`` against exp_avg_sq and say minor version 2 in header and document."""
    p = os.path.join(HERE, name)
    assert open(p, "rb").read(12)[8:12] == b"\x01\x00\x02\x00"
    with ckptzip.open(p) as r:
        assert r.manifest.doc["version"] == [1, 2]
        ids = [t["id"] for s in r.storages for t in s.get("transforms", [])]
        assert ids.count("expref") == 1


@pytest.mark.parametrize("name", ["v15_packed_cpu.ckz", "v15_packed_zstd_gpu.ckz"])
def test_v15_files_pack_small_storages(name):
    """Format 1.5: the golden object's small storages packed (written on a CPU, and on a GPU in
    zstd); each tensor loads into a storage of its own, the view sharing w's."""
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is written on a GPU machine (make_fixtures.py --v15 --gpu)")
    assert open(path, "rb").read(12)[8:12] == b"\x01\x00\x05\x00"
    with ckptzip.open(path) as r:
        assert sum("in" in s for s in r.storages) >= 6
    back = ckptzip.load(path, map_location="cpu")
    assert_same(back, golden_object())
    m = back["model"]
    assert back["view"].untyped_storage().data_ptr() == m["w"].untyped_storage().data_ptr()
    assert m["w"].untyped_storage().nbytes() == m["w"].numel() * 4
    assert len({t.untyped_storage().data_ptr() for t in (m["w"], m["b"], m["emb"], back["optimizer"]["state"][0]["step"])}) == 4
