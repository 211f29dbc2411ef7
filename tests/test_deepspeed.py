"""DeepSpeed CheckpointEngine backed by ckptzip (CPU, gloo, one process). Skipped without deepspeed;
install it with ``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8``."""
import argparse
import glob
import os
import socket

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import ckptzip  # noqa: E402
from ckptzip.integrations import deepspeed as ckds  # noqa: E402

MAGIC = b"CKPTZIP\0"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def dist_env():
    """A world of one process over gloo, as ``deepspeed.initialize`` wants it."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # DeepSpeed JIT-compiles a shared-memory allreduce op for the CPU accelerator on first
    # init (minutes with a C++ compiler, and it only speeds up multi-process allreduce): skip it
    ops = deepspeed.ops.__compatible_ops__
    shm = ops.get("deepspeed_shm_comm")
    ops["deepspeed_shm_comm"] = False
    yield
    if torch.distributed.is_initialized():  # (later modules start their own groups, or none)
        torch.distributed.destroy_process_group()
    if shm is not None:
        ops["deepspeed_shm_comm"] = shm
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _engine(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    # a client optimizer: DeepSpeed's config "AdamW" JIT-builds FusedAdam on CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
           "checkpoint": {"use_node_local_storage": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                           dist_init_required=True)
    return engine


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _step(engine, i: int) -> float:
    x, y = _batch(i)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("async_save", [False, True])
def test_zero1_save_load_resume(dist_env, tmp_path, async_save):
    eng = _engine(seed=0)
    ce = ckds.enable(eng, async_save=async_save)
    assert eng.checkpoint_engine is ce
    for i in range(3):
        _step(eng, i)
    eng.save_checkpoint(str(tmp_path), tag="step3", client_state={"epoch": 7})
    assert (tmp_path / "latest").read_text() == "step3"

    files = sorted(glob.glob(str(tmp_path / "step3" / "*.pt")))
    names = sorted(os.path.basename(f) for f in files)
    assert names == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for f in files:
        with open(f, "rb") as fh:
            assert fh.read(8) == MAGIC, f
    # the files load with plain ckptzip too (DeepSpeed's objects as marked dicts, no pickle)
    raw = ckptzip.load(files[1])
    assert raw["optimizer_state_dict"]["zero_stage"][ckds.MARK].endswith(":ZeroStageEnum")

    fresh = _engine(seed=1)  # different initial weights
    ckds.enable(fresh)
    _, client = fresh.load_checkpoint(str(tmp_path))
    assert client["epoch"] == 7

    # bit-exact model and optimizer state
    for (n, a), (_, b) in zip(eng.module.state_dict().items(), fresh.module.state_dict().items()):
        assert _bits_equal(a, b), n
    sa, sb = eng.optimizer.state_dict(), fresh.optimizer.state_dict()
    ta, tb = dict(_tensors(sa)), dict(_tensors(sb))
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert _bits_equal(ta[k], tb[k]), k
    assert type(sb["loss_scaler"]) is type(sa["loss_scaler"])
    assert vars(sb["loss_scaler"]) == vars(sa["loss_scaler"])
    assert sb["zero_stage"] is sa["zero_stage"]
    assert sb["param_slice_mappings"] == sa["param_slice_mappings"]
    assert fresh.global_steps == eng.global_steps == 3
    assert fresh.lr_scheduler.state_dict() == eng.lr_scheduler.state_dict()

    # training continues identically
    for i in range(3, 5):
        assert _step(eng, i) == _step(fresh, i)
    for (n, a), (_, b) in zip(eng.module.state_dict().items(), fresh.module.state_dict().items()):
        assert _bits_equal(a, b), n


def test_unknown_object_refused_with_key_path(dist_env, tmp_path):
    eng = _engine()
    ckds.enable(eng, allow_pickle=True)
    ckds.enable(eng)  # (enabling again checks client_state once, with the new engine)
    _step(eng, 0)
    with pytest.raises(ckptzip.UnsupportedObjectError, match=r"client_state .*args \(argparse.Namespace\)"):
        eng.save_checkpoint(str(tmp_path), tag="t", client_state={"args": argparse.Namespace(lr=1)})
    assert os.listdir(tmp_path) == []  # refused before DeepSpeed wrote anything
    eng.save_checkpoint(str(tmp_path), tag="ok", client_state={"lr": 1.0})  # plain values still save
    assert eng.load_checkpoint(str(tmp_path), tag="ok")[1]["lr"] == 1.0


def _refuse_on_every_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    eng = _engine()
    ckds.enable(eng)
    try:
        eng.save_checkpoint(out, tag="t", client_state={"args": argparse.Namespace(lr=1)})
        got = "saved"
    except ckptzip.UnsupportedObjectError:
        got = "refused"
    torch.distributed.barrier()  # (every rank got here: none waits for one that raised)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(got)
    torch.distributed.destroy_process_group()


def test_client_state_refused_on_every_rank(tmp_path):
    """Only data-parallel rank 0 writes client_state; a value that needs pickle must fail every
    rank before DeepSpeed writes or waits at a barrier (it left rank 1 waiting for rank 0)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_refuse_on_every_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(os.listdir(tmp_path)) == ["rank0.txt", "rank1.txt"]  # no checkpoint file written
    assert [open(tmp_path / f"rank{r}.txt").read() for r in range(2)] == ["refused", "refused"]


# -- the engine class against DeepSpeed's interface, without deepspeed.initialize --------------

def test_engine_interface(tmp_path):
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    ce = ckds.CkptzipCheckpointEngine(async_save=True, portable=True)
    assert isinstance(ce, CheckpointEngine) and ce.name == ckds.ENGINE_NAME
    assert ce.preserves_storage_sharing() and not ce.is_decoupled() and ce.is_data_parallel_writer(0)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    ce.create(info)
    ce.makedirs(str(tmp_path / "t1"), exist_ok=True)
    flat = torch.randn(100)
    state = {"module": collections_odict(w=flat[:60].view(6, 10), b=flat[60:70]),
             "shapes": [{"w": torch.Size([6, 10])}], "betas": (0.9, 0.999),
             "ls": LossScaler(4.0), "dls": DynamicLossScaler(2.0 ** 16, 100, 1.0, 2, False, dtype=torch.bfloat16),
             "stage": ZeroStageEnum.optimizer_states, "frag": {"w": fragment_address(numel=60, start=0)},
             "ds_version": deepspeed.__version__, "n": 3, "x": float("nan")}
    path = str(tmp_path / "t1" / "mp_rank_00_model_states.pt")
    orig = flat.clone()
    ce.save(state, path)
    flat.add_(1)  # async save took its snapshot already
    assert ce.commit(info) is True
    with open(path, "rb") as fh:
        assert fh.read(8) == MAGIC
    got = ce.load(path, map_location=lambda storage, loc: storage)
    assert _bits_equal(got["module"]["w"], orig[:60].view(6, 10))
    assert got["module"]["w"].untyped_storage().data_ptr() == got["module"]["b"].untyped_storage().data_ptr()
    assert type(got["module"]).__name__ == "OrderedDict"
    assert got["shapes"] == [{"w": torch.Size([6, 10])}] and type(got["shapes"][0]["w"]) is torch.Size
    assert got["betas"] == (0.9, 0.999) and type(got["betas"]) is tuple
    assert type(got["ls"]) is LossScaler and vars(got["ls"]) == vars(state["ls"])
    assert type(got["dls"]) is DynamicLossScaler and vars(got["dls"]) == vars(state["dls"])
    assert got["stage"] is ZeroStageEnum.optimizer_states
    assert got["frag"]["w"] == fragment_address(numel=60, start=0)
    assert got["ds_version"] == deepspeed.__version__ and got["n"] == 3
    assert got["x"] != got["x"]
    got2 = ce.load(path, map_location=torch.device("cpu"))
    assert _bits_equal(got2["module"]["b"], orig[60:70])


def test_engine_pickle_option_and_allow_list(tmp_path):
    path = str(tmp_path / "a.pt")
    ce = ckds.CkptzipCheckpointEngine()
    with pytest.raises(ckptzip.UnsupportedObjectError, match=r"cfg\.args \(argparse\.Namespace\)"):
        ce.save({"cfg": {"args": argparse.Namespace(a=1)}}, path)
    assert not os.path.exists(path)
    ce_p = ckds.CkptzipCheckpointEngine(allow_pickle=True)
    ce_p.save({"cfg": {"args": argparse.Namespace(a=1)}}, path)
    assert ce_p.load(path)["cfg"]["args"] == argparse.Namespace(a=1)
    with pytest.raises(ckptzip.PickleNotAllowedError):
        ce.load(path)
    # a marked dict naming a class outside the allow-list is refused on load, nothing imported
    ce.save({"evil": {ckds.MARK: "os:system", "state": {"value": "true"}}}, path)
    with pytest.raises(ckptzip.UnsupportedObjectError, match="allow-list"):
        ce.load(path)


def collections_odict(**kw):
    import collections
    return collections.OrderedDict(kw)
