"""Golden files of format v1: every future version of ckptzip must keep reading them bit-exact.
Files written on a GPU with standard codecs (zstd, deflate) must decode on this CPU; files with
GPU-only codecs must raise GPURequiredError here (and decode on a GPU)."""
import glob
import json
import os

import pytest

import ckptzip
from conftest import assert_same, cuda_ok
from fixtures.make_fixtures import HERE, digests, golden_object

FILES = sorted(glob.glob(os.path.join(HERE, "*.ckz")))
GPU_ONLY = ("ans", "bitcomp", "gdeflate", "lz4", "auto_gpu")


def test_fixtures_present():
    names = {os.path.basename(f) for f in FILES}
    assert {"v1_auto_cpu.ckz", "v1_zstd_cpu.ckz", "v1_raw.ckz", "v1_deflate_cpu.ckz"} <= names


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
    assert_same(back, golden_object())
    with ckptzip.open(path) as r:
        assert r.metadata["fixture"] == name[:-4]
        r.verify()
