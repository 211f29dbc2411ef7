"""ckptzip.dcp under a real ``kill -9`` (issue 18): SIGKILL of one rank in the middle of a save
leaves no committed checkpoint, and the previous checkpoint still loads bit-exact.

The ranks are separate OS processes (``python -c``, gloo, env:// rendezvous), not threads or
``mp.spawn`` children that raise: rank 1 gets SIGKILL while its rank file is being written (its
``atomic_write`` temp file ``.__1_0.ckz.*.tmp`` is in the directory). Every wait is bounded and
every child is killed in ``finally``.
"""
import glob
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckptzip.dcp import COMMIT_NAME, METADATA_NAME, IncompleteCheckpointError, Reader, read_metadata

# ~15-22 s for the module on 2 CPU cores (three 2-process runs, mostly interpreter/torch start-up)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

_OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
_REFUSED = "IncompleteCheckpointError|metadata is None" if _OLD_TORCH else "IncompleteCheckpointError"

WORLD = 2
NUMEL = 4 << 20          # float32 elements per tensor per rank: 16 MiB; 2 tensors -> 32 MiB per rank
SEED_A, SEED_B = 1, 2    # the state of checkpoint A / of the save that gets killed
KEYS = ("w0", "w1")

# Shared by the rank processes (exec'd there) and this test (to regenerate the expected state).
_GEN_SRC = '''
import torch
def local_shard(seed, k, rank, numel):
    g = torch.Generator().manual_seed(seed * 1000 + k * 10 + rank)
    return torch.randn(numel, generator=g)
'''
_gen: dict = {}
exec(_GEN_SRC, _gen)

_RANK_SRC = _GEN_SRC + r'''
import datetime, os, warnings
warnings.simplefilter("ignore")
torch.set_num_threads(1)
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from ckptzip.dcp import Writer

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
seed, numel = int(os.environ["CKZ_SEED"]), int(os.environ["CKZ_NUMEL"])
slow = os.environ.get("CKZ_SLOW_RANK", "")
level = 19 if slow and rank == int(slow) else None  # zstd 19: several seconds for a 32 MiB rank file
model = {f"w{k}": DTensor.from_local(local_shard(seed, k, rank, numel), mesh, [Shard(0)], run_check=False,
                                     shape=torch.Size([world * numel]), stride=(1,))
         for k in range(2)}
for d in os.environ["CKZ_DIRS"].split(os.pathsep):
    dcp.save({"model": model, "step": seed}, storage_writer=Writer(d, codec="zstd", level=level, device="cpu"))
dist.barrier()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(dirs, seed, slow_rank, logdir, tag):
    """Start WORLD rank processes saving the seed's state into each of ``dirs`` in turn;
    ``slow_rank`` (or None) compresses with zstd level 19, the others with zstd's default."""
    port = _free_port()
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env.update(WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CKZ_DIRS=os.pathsep.join(str(d) for d in dirs), CKZ_SEED=str(seed), CKZ_NUMEL=str(NUMEL),
               CKZ_SLOW_RANK="" if slow_rank is None else str(slow_rank), OMP_NUM_THREADS="1")
    procs, logs = [], []
    for r in range(WORLD):
        log = open(os.path.join(logdir, f"{tag}.rank{r}.log"), "wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SRC], env={**env, "RANK": str(r)},
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs, logs


def _kill_all(procs, logs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for f in logs:
        f.close()


def _tail(logdir, tag):
    out = []
    for r in range(WORLD):
        with open(os.path.join(logdir, f"{tag}.rank{r}.log"), "rb") as f:
            out.append(f"--- rank {r} ---\n" + f.read()[-3000:].decode("utf-8", "replace"))
    return "\n".join(out)


def _expected(seed):
    return {f"w{k}": torch.cat([_gen["local_shard"](seed, k, r, NUMEL) for r in range(WORLD)]) for k in range(2)}


def _load_one_process(path):
    state = {"model": {k: torch.zeros(WORLD * NUMEL) for k in KEYS}, "step": 0}
    dcp.load(state, storage_reader=Reader(path))
    return state


def _assert_bit_exact(path, seed):
    state = _load_one_process(path)
    ref = _expected(seed)
    for k in KEYS:
        a, b = state["model"][k], ref[k]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{path}: {k} differs"
    assert state["step"] == seed


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """Checkpoint A (seed SEED_A), saved completely by 2 rank processes into two directories:
    ``keep`` (left alone) and ``over`` (to be overwritten by the killed save)."""
    base = tmp_path_factory.mktemp("dcp_kill")
    dirs = {"keep": base / "A", "over": base / "A_overwritten"}
    procs, logs = _start([dirs["keep"], dirs["over"]], SEED_A, None, base, "save_A")
    try:
        deadline = time.monotonic() + 90
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("save of checkpoint A did not finish in 90 s\n" + _tail(base, "save_A"))
    finally:
        _kill_all(procs, logs)
    assert [p.returncode for p in procs] == [0] * WORLD, _tail(base, "save_A")
    for d in dirs.values():
        assert (d / COMMIT_NAME).is_file() and (d / "__1_0.ckz").is_file()
        read_metadata(d)
    dirs["base"] = base
    return dirs


def _save_and_kill_rank1(target, logdir, tag):
    """Save SEED_B's state into ``target``, rank 1 with slow compression (zstd level 19: seconds
    for its rank file), and SIGKILL rank 1 as soon as its rank file's temp file appears; then
    give rank 0 (which wrote its file quickly and waits in DCP's gather) a bounded time to fail
    on its own, and kill it if it has not. Returns (rank 0's exit code, the temp files rank 1
    left behind)."""
    procs, logs = _start([target], SEED_B, 1, logdir, tag)
    pattern = os.path.join(str(target), ".__1_0.ckz.*.tmp")
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(pattern):
            if any(p.poll() is not None for p in procs):
                pytest.fail(f"a rank exited before rank 1 started writing\n{_tail(logdir, tag)}")
            if time.monotonic() > deadline:
                pytest.fail(f"rank 1's rank file never appeared in {target}\n{_tail(logdir, tag)}")
            time.sleep(0.005)
        os.kill(procs[1].pid, signal.SIGKILL)  # kill -9, mid-write
        assert procs[1].wait(timeout=10) == -signal.SIGKILL
        # rank 0 fails (gloo: connection closed by peer) or hangs in DCP's gather of the results
        try:
            rc0 = procs[0].wait(timeout=20)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            rc0 = procs[0].wait(timeout=10)
    finally:
        _kill_all(procs, logs)
    return rc0, glob.glob(pattern)


def _assert_not_committed(path):
    assert not (path / COMMIT_NAME).exists()
    with pytest.raises(IncompleteCheckpointError):
        read_metadata(path)
    with pytest.raises(CheckpointException, match=_REFUSED):
        _load_one_process(path)


def test_sigkill_rank_mid_save_new_dir(committed):
    """kill -9 of rank 1 while it writes checkpoint B (a new directory): B is not committed and
    not loadable; A, untouched, loads bit-exact in one process."""
    b = committed["base"] / "B"
    rc0, leftovers = _save_and_kill_rank1(b, committed["base"], "save_B")
    assert rc0 != 0, _tail(committed["base"], "save_B")
    assert leftovers, "rank 1 was not killed mid-write"       # its temp file, never renamed
    assert not (b / "__1_0.ckz").exists()
    assert not (b / METADATA_NAME).exists()
    _assert_not_committed(b)
    _assert_bit_exact(committed["keep"], SEED_A)


def test_sigkill_rank_mid_overwrite(committed):
    """kill -9 of rank 1 while a save overwrites checkpoint A's directory in place.

    By design (docs/dcp.md) an overwrite un-commits first: the coordinator deletes ``COMMIT`` and
    ``ckptzip.dcp.json`` in ``prepare_global_plan``, before any rank writes. So after the kill the
    directory holds neither the old checkpoint (no longer committed) nor the new one: it is NOT
    loadable as complete, rather than silently mixing A's and B's rank files. Saving each step
    into a new directory (as ``CheckpointManager`` does) is what keeps the previous checkpoint."""
    over = committed["over"]
    rc0, leftovers = _save_and_kill_rank1(over, committed["base"], "overwrite")
    assert rc0 != 0, _tail(committed["base"], "overwrite")
    assert leftovers, "rank 1 was not killed mid-write"
    # rank 0 already replaced __0_0.ckz with B's data, __1_0.ckz is still A's: a mix that only
    # the missing COMMIT / metadata keeps from being read as a checkpoint
    assert (over / "__0_0.ckz").exists() and (over / "__1_0.ckz").exists()
    assert not (over / METADATA_NAME).exists()
    _assert_not_committed(over)
    # the other copy of A is unaffected
    _assert_bit_exact(committed["keep"], SEED_A)
