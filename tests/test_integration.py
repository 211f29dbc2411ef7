"""Training-loop integration: async_save, CheckpointManager, resume, Lightning, object stores,
faults (write errors, disk full, kill -9)."""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptzip
from ckptzip import asyncsave, storage
from conftest import same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def state(n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(n // 10, generator=g).bfloat16(), "step": seed}


def test_async_save_snapshot_is_consistent(tmp_path):
    s = state()
    expect = s["w"].clone()
    h = ckptzip.async_save(s, tmp_path / "a.ckz")
    s["w"].add_(1.0)  # training goes on right away
    res = h.wait()
    assert h.done() and res["stored_bytes"] == os.path.getsize(tmp_path / "a.ckz")
    assert same_bits(ckptzip.load(tmp_path / "a.ckz")["w"], expect)


def test_async_save_error_surfaces_on_wait(tmp_path):
    h = ckptzip.async_save(state(), tmp_path / "missing-dir" / "a.ckz")
    with pytest.raises(FileNotFoundError):
        h.wait()


def test_async_staging_memory_does_not_grow(tmp_path):
    s = state(300_000)
    caps = []
    for i in range(100):
        s["w"][0] = float(i)
        ckptzip.async_save(s, tmp_path / "a.ckz").wait()
        caps.append(asyncsave.ARENA.capacity)
    assert caps[1] == caps[-1], f"arena grew from {caps[1]} to {caps[-1]}"
    assert ckptzip.load(tmp_path / "a.ckz")["w"][0] == 99.0


@pytest.mark.parametrize("use_async", [False, True])
def test_manager_rotation_and_listing(tmp_path, use_async):
    m = ckptzip.CheckpointManager(tmp_path, keep_last=2, keep_every=10, async_save=use_async)
    for step in (5, 10, 15, 20, 25, 30):
        r = m.save(step, state(1000, step))
        if use_async:
            assert isinstance(r, ckptzip.SaveHandle)
    m.wait()
    assert m.steps() == [10, 20, 25, 30]
    assert m.latest() == 30
    assert m.load()["step"] == 30 and m.load(20)["step"] == 20
    assert sorted(p for p in os.listdir(tmp_path)) == sorted(
        [f"step-{s:09d}.{e}" for s in (10, 20, 25, 30) for e in ("ckz", "commit")])


def test_manager_ignores_incomplete_checkpoints(tmp_path):
    m = ckptzip.CheckpointManager(tmp_path, keep_last=3)
    m.save(1, state(1000, 1))
    (tmp_path / "step-000000002.ckz").write_bytes(b"partial")           # data without marker
    (tmp_path / "step-000000003.commit").write_text('{"bytes": 5}')       # marker without data
    assert m.steps() == [1] and m.load()["step"] == 1
    with pytest.raises(FileNotFoundError):
        m.load(2)


class FaultyFile:
    """A file that fails after ``limit`` bytes, as a full disk or a failing device would."""

    def __init__(self, f, limit, err):
        self.f, self.left, self.err = f, limit, err

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if n > self.left:
            raise OSError(self.err, os.strerror(self.err))
        self.left -= n
        return self.f.write(b)

    def __getattr__(self, k):
        return getattr(self.f, k)


@pytest.fixture
def faulty(monkeypatch):
    def arm(limit, err=errno.ENOSPC):
        real = storage.atomic_write

        import contextlib

        @contextlib.contextmanager
        def wrapped(path, fsync=True):
            with real(path, fsync) as f:
                yield FaultyFile(f, limit, err)
        monkeypatch.setattr(storage, "atomic_write", wrapped)
    return arm


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("use_async", [False, True])
def test_write_fault_leaves_previous_checkpoint(tmp_path, faulty, err, use_async):
    m = ckptzip.CheckpointManager(tmp_path, keep_last=2, async_save=use_async)
    m.save(1, state(50_000, 1))
    m.wait()
    faulty(100_000, err)
    with pytest.raises(OSError) as e:
        m.save(2, state(200_000, 2))
        m.wait()
    assert e.value.errno == err
    assert m.steps() == [1] and m.load()["step"] == 1
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


KILLER = r"""
import sys, torch, ckptzip
m = ckptzip.CheckpointManager(sys.argv[1], keep_last=2, async_save=True)
x = torch.randn(4_000_000)
print("ready", flush=True)
step = 100
while True:
    m.save(step, {"x": x, "step": step})
    step += 1
"""


def test_kill_9_during_async_saves(tmp_path):
    m = ckptzip.CheckpointManager(tmp_path, keep_last=2)
    m.save(1, {"x": torch.ones(3), "step": 1})
    p = subprocess.Popen([sys.executable, "-c", KILLER, str(tmp_path)], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ready"
    time.sleep(2.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    latest = m.latest()
    s = m.load()
    assert s["step"] == latest
    with ckptzip.open(m.path(latest)) as r:
        r.verify()


def test_resume_reproduces_losses_bit_exactly(tmp_path):
    from train_resume import run
    full = run(str(tmp_path / "a"), 200)
    first = run(str(tmp_path / "b"), 200, stop_at=131)  # last checkpoint: step 119
    rest = run(str(tmp_path / "b"), 200)
    assert len(first) == 131 and len(rest) == 80
    assert rest[:50] == full[120:170]  # the 50 steps after the resume point, bit for bit


def test_cli_ls(tmp_path, capsys):
    from ckptzip.cli import main
    m = ckptzip.CheckpointManager(tmp_path)
    m.save(7, state(100, 7))
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    assert '"steps": [7]' in capsys.readouterr().out


# -- object stores ---------------------------------------------------------------------------

def test_fsspec_memory_url(tmp_path):
    pytest.importorskip("fsspec")
    s = state(10_000)
    ckptzip.save(s, "memory://bucket/a.ckz")
    assert same_bits(ckptzip.load("memory://bucket/a.ckz")["w"], s["w"])
    with ckptzip.open("memory://bucket/a.ckz") as r:
        assert same_bits(r.get_tensor("b"), s["b"])
    m = ckptzip.CheckpointManager("memory://runs/x", keep_last=1)
    m.save(1, s)
    m.save(2, state(10_000, 2))
    assert m.steps() == [2] and m.load()["step"] == 2


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import fsspec
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1")
    conf = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "default_block_size": 5 * 2**20}
    old = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = conf
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("ckz")
    yield fs
    if old is None:
        fsspec.config.conf.pop("s3", None)
    else:
        fsspec.config.conf["s3"] = old
    server.stop()


def test_s3_multipart_save_load_and_manager(s3):
    big = state(6_000_000)  # ~27 MB of tensors: a multipart upload at 5 MiB parts
    res = ckptzip.save(big, "s3://ckz/big.ckz")
    assert res["stored_bytes"] > 10 * 2**20
    back = ckptzip.load("s3://ckz/big.ckz")
    assert same_bits(back["w"], big["w"]) and same_bits(back["b"], big["b"])
    m = ckptzip.CheckpointManager("s3://ckz/run", keep_last=2, async_save=True)
    for step in range(3):
        m.save(step, state(100_000, step))
    m.wait()
    assert m.steps() == [1, 2] and m.load()["step"] == 2


def test_s3_failed_upload_is_not_visible(s3, monkeypatch):
    m = ckptzip.CheckpointManager("s3://ckz/faulty", keep_last=2)
    m.save(1, state(1000, 1))
    from ckptzip.io import ChunkWriter

    def boom(*a, **k):
        raise OSError(errno.EIO, "injected")
    monkeypatch.setattr(ChunkWriter, "add", boom)
    with pytest.raises(OSError):
        m.save(2, state(3_000_000, 2))
    assert m.steps() == [1]
    assert not s3.exists("ckz/faulty/step-000000002.ckz")


# -- Lightning -------------------------------------------------------------------------------

def test_lightning_fit_stop_resume(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from ckptzip.lightning import AsyncCkptzipCheckpointIO, CkptzipCheckpointIO

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)

    def trainer(epochs, io, d):
        return L.Trainer(max_epochs=epochs, plugins=[io], default_root_dir=str(d), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         callbacks=[L.callbacks.ModelCheckpoint(dirpath=str(d), save_last=True)])

    L.seed_everything(0)
    full = Model()
    trainer(4, CkptzipCheckpointIO(), tmp_path / "full").fit(full, data())
    for io in (CkptzipCheckpointIO(), AsyncCkptzipCheckpointIO()):
        d = tmp_path / type(io).__name__
        L.seed_everything(0)
        m = Model()
        trainer(2, io, d).fit(m, data())
        last = d / "last.ckpt"
        with ckptzip.open(last) as r:  # a real ckptzip file
            assert any(k.startswith("state_dict") for k in r.keys())
        m2 = Model()
        trainer(4, io, d).fit(m2, data(), ckpt_path=str(last))
        assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), m2.state_dict().values()))
