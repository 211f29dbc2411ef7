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


def _w_all(rank, world, d):
    _w_async(rank, world, d)
    _w_manager(rank, world, d)


@pytest.fixture(scope="module")
def dist_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcpdist")
    d = {k: str(root / k) for k in ("async1", "async2", "async_fsdp", "mgr", "mgr_async")}
    _spawn(_w_all, 2, d)
    return d


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
def test_distributed_manager_rotation_and_layout(dist_ckpts, name):
    root = dist_ckpts[name]
    assert sorted(os.listdir(root)) == ["step-000000020", "step-000000020.commit",
                                        "step-000000030", "step-000000030.commit"]
    mgr = CheckpointManager(root)  # file-mode manager lists distributed checkpoints too
    es = mgr.entries()
    assert [(e.step, e.status, e.kind) for e in es] == [(20, "committed", "dcp"), (30, "committed", "dcp")]
    assert all(e.bytes and e.bytes > 0 for e in es)
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
