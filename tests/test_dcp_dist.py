"""ckptzip.dcp async staging (dcp.async_save with Writer.stage) and CheckpointManager's distributed
mode, on 2 gloo ranks (CPU). One 2-rank job runs every scenario (process start-up dominates);
the tests then check what it recorded and wrote."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptzip
from ckptzip import CheckpointManager
from ckptzip.dcp import COMMIT_NAME, Reader, Writer, read_metadata
from test_dcp import _dtensor_state, _fsdp, _full_tensors, _local, _same, _spawn, _train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _mutate(st):
    """Change every value of the state in place (what training does after async_save returns)."""
    for t in st["tensors"].values():
        t.to_local().add_(1000)
    st["plain"].mul_(-3)
    st["cfg"]["lr"] = 9.0
    st["step"] = 0


def _w_async(rank, world, d):
    from torch.distributed.tensor import DTensor
    from torch.distributed.checkpoint.staging import AsyncStager
    assert isinstance(Writer(d["async1"]), AsyncStager)
    w = Writer(d["async1"])
    calls = []
    orig = w.stage
    w.stage = lambda sd: calls.append(1) or orig(sd)
    st = _dtensor_state(world)
    fut = dcp.async_save(st, storage_writer=w)
    _mutate(st)  # the checkpoint must hold the state at the call
    fut = getattr(fut, "upload_completion", fut)
    fut.result()
    assert calls == [1]
    # the same writer again (pooled arena), another checkpoint of the mutated state
    fut = dcp.async_save(st, checkpoint_id=d["async2"], storage_writer=w)
    getattr(fut, "upload_completion", fut).result()
    w.close()
    for path, shift in ((d["async1"], 0), (d["async2"], 1000)):
        ref = _dtensor_state(world)
        for t in ref["tensors"].values():
            t.to_local().zero_()
        dcp.load(ref, storage_reader=Reader(path))
        full = _full_tensors()
        for k, t in ref["tensors"].items():
            assert isinstance(t, DTensor)
            want = full[k] + shift if shift else full[k]
            _same(t.full_tensor(), want.to(full[k].dtype))
        _same(ref["plain"], torch.arange(6.0) * (-3 if shift else 1))
        assert ref["step"] == (0 if shift else 42) and ref["cfg"]["lr"] == (9.0 if shift else 0.5)

    # FSDP2 model + optimizer through get_state_dict, async, trained on after the call
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m, opt = _fsdp(0, world)
    _train(m, opt, rank, 2, 0)
    msd, osd = get_state_dict(m, opt)
    want_p = {n: _local(p).detach().clone() for n, p in m.named_parameters()}
    want_o = {n: {k: _local(v).clone() for k, v in opt.state[p].items()} for n, p in m.named_parameters()}
    # training runs FSDP collectives while the save's run in the background: a separate group
    ckpt_pg = dist.new_group(backend="gloo")
    fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=Writer(d["async_fsdp"]),
                         process_group=ckpt_pg)
    _train(m, opt, rank, 2, 2)
    getattr(fut, "upload_completion", fut).result()
    m2, opt2 = _fsdp(5, world)
    msd2, osd2 = get_state_dict(m2, opt2)
    st2 = {"model": msd2, "optim": osd2}
    dcp.load(st2, storage_reader=Reader(d["async_fsdp"]))
    set_state_dict(m2, opt2, model_state_dict=st2["model"], optim_state_dict=st2["optim"])
    for n, p in m2.named_parameters():
        _same(_local(p).detach(), want_p[n])
        for k, v in opt2.state[p].items():
            _same(_local(v), want_o[n][k])


def _w_manager(rank, world, d):
    for mode, root in (("sync", d["mgr"]), ("async", d["mgr_async"])):
        mgr = CheckpointManager(root, keep_last=2, distributed=True, async_save=mode == "async")
        st = _dtensor_state(world)
        for step in (10, 20, 30):
            for t in st["tensors"].values():
                t.to_local().fill_(step)
            h = mgr.save(step, st)
            if mode == "async":
                for t in st["tensors"].values():  # after the call: not in the checkpoint
                    t.to_local().fill_(-1)
                h.wait()
        dist.barrier()
        assert mgr.steps() == [20, 30] and mgr.latest() == 30, mgr.entries()
        ref = _dtensor_state(world)
        for t in ref["tensors"].values():
            t.to_local().zero_()
        assert mgr.load(state=ref) is ref
        for k, t in ref["tensors"].items():
            full = _full_tensors()[k]
            _same(t.full_tensor(), torch.full_like(full, 30))
        mgr.load(20, state=ref)
        _same(ref["tensors"]["w"].full_tensor(), torch.full((7, 5), 20.0))
        dist.barrier()


def _big_full(step):
    """Global tensors large enough for deltas to pay, changed a little at every step."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 1024, generator=g) * 0.02
    drift = torch.randn(256, 1024, generator=g) * 1e-5
    w = w + step * drift
    return {"w": w, "m": w * 1e-3, "w16": w.to(torch.bfloat16)}


def _big_state(world, step):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    return {"t": {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in _big_full(step).items()}, "step": step}


def _check_big(path, step, world):
    ref = _big_state(world, 0)
    for t in ref["t"].values():
        t.to_local().zero_()
    dcp.load(ref, storage_reader=Reader(path))
    for k, t in _big_full(step).items():
        _same(ref["t"][k].full_tensor(), t)
    assert ref["step"] == step


def _w_incremental(rank, world, d):
    # Writer(base=): dcp.save, then dcp.async_save with one writer whose base changes
    dcp.save(_big_state(world, 1), storage_writer=Writer(d["inc_a"]))
    dcp.save(_big_state(world, 2), storage_writer=Writer(d["inc_b"], base=d["inc_a"]))
    _check_big(d["inc_b"], 2, world)
    w = Writer(d["inc_c"])
    fut = dcp.async_save(_big_state(world, 1), storage_writer=w)
    getattr(fut, "upload_completion", fut).result()
    w.base = d["inc_c"]
    w.reset(d["inc_d"])  # the path must be known when async_save stages
    st = _big_state(world, 3)
    fut = dcp.async_save(st, checkpoint_id=d["inc_d"], storage_writer=w)
    for t in st["t"].values():
        t.to_local().fill_(-1)  # after the call: not in the checkpoint
    getattr(fut, "upload_completion", fut).result()
    w.close()
    _check_big(d["inc_d"], 3, world)
    # the manager: full, delta, delta, full, delta (full_every=3), sync and async
    for mode, root in (("sync", d["mgr_inc"]), ("async", d["mgr_inc_async"])):
        mgr = CheckpointManager(root, keep_last=2, distributed=True, incremental=True, full_every=3,
                                async_save=mode == "async")
        for step in (1, 2, 3, 4, 5):
            h = mgr.save(step, _big_state(world, step))
            if mode == "async":
                h.wait()
            dist.barrier()
            if step == 3:  # 2 and 3 kept, and 1: their base
                assert mgr.steps() == [1, 2, 3], mgr.entries()
                assert [mgr.base_of(s) for s in (1, 2, 3)] == [None, 1, 1]
                _check_big(mgr.dir_path(2), 2, world)
        assert mgr.steps() == [4, 5] and mgr.base_of(5) == 4 and mgr.base_of(4) is None, mgr.entries()
        ref = _big_state(world, 0)
        mgr.load(state=ref)
        for k, t in _big_full(5).items():
            _same(ref["t"][k].full_tensor(), t)
        dist.barrier()


def _w_all(rank, world, d):
    _w_async(rank, world, d)
    _w_manager(rank, world, d)
    _w_incremental(rank, world, d)


@pytest.fixture(scope="module")
def dist_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcpdist")
    d = {k: str(root / k) for k in ("async1", "async2", "async_fsdp", "mgr", "mgr_async", "inc_a", "inc_b",
                                    "inc_c", "inc_d", "mgr_inc", "mgr_inc_async")}
    _spawn(_w_all, 2, d)
    return d


@pytest.mark.parametrize("full,incr", [("inc_a", "inc_b"), ("inc_c", "inc_d")])
def test_incremental_rank_files_store_deltas_against_the_base(dist_ckpts, tmp_path, full, incr):
    """Writer(base=) with dcp.save and with dcp.async_save: each rank file records the same
    rank's file of the base by relative path, is smaller than a full one, loads in one process
    and consolidates bit-exact; without its base it is a BaseCheckpointError naming it."""
    import shutil
    from ckptzip.dcp import consolidate
    step = 2 if incr == "inc_b" else 3
    for r in (0, 1):
        name = f"__{r}_0.ckz"
        with ckptzip.open(os.path.join(dist_ckpts[incr], name)) as f:
            assert f.base["file"] == f"../{full}/{name}" and f.base["depth"] == 1
            assert any(t["id"] in ("delta", "hidelta", "xor") for s in f.storages for t in s.get("transforms", []))
        assert os.path.getsize(os.path.join(dist_ckpts[incr], name)) < \
            0.8 * os.path.getsize(os.path.join(dist_ckpts[full], name))
    out = tmp_path / "one.ckz"
    consolidate(dist_ckpts[incr], out)
    sd = ckptzip.load(out)
    for k, t in _big_full(step).items():
        _same(sd["t"][k], t)
    moved = tmp_path / "moved"
    shutil.copytree(dist_ckpts[incr], moved)  # its base is not next to it any more
    with pytest.raises(ckptzip.BaseCheckpointError, match=f"{full}/__0_0.ckz"):
        consolidate(moved, tmp_path / "two.ckz")


@pytest.mark.parametrize("name", ["mgr_inc", "mgr_inc_async"])
def test_distributed_incremental_manager_markers_and_rotation(dist_ckpts, name):
    root = dist_ckpts[name]
    assert sorted(os.listdir(root)) == ["step-000000004", "step-000000004.commit",
                                        "step-000000005", "step-000000005.commit"]
    m4 = json.loads(open(os.path.join(root, "step-000000004.commit")).read())
    m5 = json.loads(open(os.path.join(root, "step-000000005.commit")).read())
    assert "base" not in m4 and m5["base"] == 4 and m5["delta_index"] == 1
    with ckptzip.open(os.path.join(root, "step-000000005", "__1_0.ckz")) as f:
        assert f.base["file"] == "../step-000000004/__1_0.ckz"
    full = CheckpointManager(root).load(5)
    for k, t in _big_full(5).items():
        _same(full["t"][k], t)
    from ckptzip.cli import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ls", root, "--json"]) == 0
    got = {e["step"]: e["base"] for e in json.loads(out.getvalue())["entries"] if e["step"] is not None}
    assert got == {4: None, 5: 4}


def test_distributed_marker_with_bad_base_is_damaged(dist_ckpts, tmp_path):
    import shutil
    root = tmp_path / "run"
    shutil.copytree(dist_ckpts["mgr_inc"], root)
    p = root / "step-000000005.commit"
    m = json.loads(p.read_text())
    for bad in ({"base": "4", "delta_index": 1}, {"base": 4}, {"base": 5, "delta_index": 1},
                {"base": 4, "delta_index": 0}):
        p.write_text(json.dumps({**{k: v for k, v in m.items() if k not in ("base", "delta_index")}, **bad}))
        got = {e.step: e.status for e in CheckpointManager(root).entries()}
        assert got[5] == "damaged", bad


def test_async_save_stages_with_writer_and_holds_state_at_call(dist_ckpts):
    # the rank files hold the staged snapshot (keys "<path>@s<n>"); bytes items in __i_1.ckz
    md = read_metadata(dist_ckpts["async1"])
    files = {s.file for s in md.storage_data.values()}
    assert "__0_0.ckz" in files and "__1_0.ckz" in files
    keys = {s.key for s in md.storage_data.values() if s.file.endswith("_0.ckz")}
    assert all("@s" in k for k in keys), keys
    assert any(s.file.endswith("_1.ckz") for s in md.storage_data.values())  # step, cfg: bytes items
    with ckptzip.open(os.path.join(dist_ckpts["async1"], "__0_0.ckz")) as r:
        assert r.metadata.get("ckptzip.dcp") == "rank file (staged)"


def test_async_save_consolidates_without_process_group(dist_ckpts, tmp_path):
    from ckptzip.dcp import consolidate
    out = tmp_path / "full.ckz"
    consolidate(dist_ckpts["async1"], out)
    sd = ckptzip.load(out)
    for k, t in _full_tensors().items():
        _same(sd["tensors"][k], t)
    assert sd["step"] == 42


def test_async_fsdp2_model_and_optimizer(dist_ckpts):
    read_metadata(dist_ckpts["async_fsdp"])  # committed; compared bit-exact inside the ranks


@pytest.mark.parametrize("name", ["mgr", "mgr_async"])
def test_distributed_manager_rotation_and_layout(dist_ckpts, name, monkeypatch):
    import ckptzip.dcp
    root = dist_ckpts[name]
    assert sorted(os.listdir(root)) == ["step-000000020", "step-000000020.commit",
                                        "step-000000030", "step-000000030.commit"]
    mgr = CheckpointManager(root)  # file-mode manager lists distributed checkpoints too
    reads = []
    real = ckptzip.dcp.read_metadata
    monkeypatch.setattr(ckptzip.dcp, "read_metadata", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    es = mgr.entries()
    assert len(reads) == 2  # each step's metadata read once: checked, then its bytes summed
    monkeypatch.undo()
    assert [(e.step, e.status, e.kind, e.name) for e in es] == [(20, "committed", "dcp", "step-000000020"),
                                                               (30, "committed", "dcp", "step-000000030")]
    assert all(e.bytes and e.bytes > 0 for e in es)
    assert [e.bytes for e in es] == [mgr._dcp_bytes(20), mgr._dcp_bytes(30)]
    marker = json.loads(open(os.path.join(root, "step-000000030.commit")).read())
    dcp_marker = json.loads(open(os.path.join(root, "step-000000030", COMMIT_NAME)).read())
    assert marker == {"step": 30, "dir": "step-000000030", "metadata_sha256": dcp_marker["metadata_sha256"]}
    full = mgr.load()  # no state: the whole state, read in this process
    _same(full["tensors"]["v"], torch.full((3, 10), 30, dtype=torch.bfloat16))


def test_distributed_manager_incomplete_dirs_not_committed(dist_ckpts, tmp_path):
    import shutil
    root = tmp_path / "run"
    shutil.copytree(dist_ckpts["mgr"], root)
    os.unlink(root / "step-000000030" / "__1_0.ckz")             # a rank file missing
    shutil.copytree(root / "step-000000020", root / "step-000000040")  # no manager marker
    mgr = CheckpointManager(root, distributed=True)
    got = {e.step: (e.status, e.reason) for e in mgr.entries()}
    assert got[30][0] == "damaged" and "__1_0.ckz" in got[30][1]
    assert got[40][0] == "uncommitted"
    assert mgr.steps() == [20] and mgr.latest() == 20
    with pytest.raises(FileNotFoundError):
        mgr.load(30)
    # a DCP COMMIT from another save than the manager marker's
    os.unlink(root / "step-000000020" / COMMIT_NAME)
    assert mgr.steps() == [] and "COMMIT" in mgr.entries()[0].reason
