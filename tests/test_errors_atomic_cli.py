"""One test per named error, atomic writes (exception and kill -9 mid-save), and the CLI."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptzip
import ckptzip.cli
from conftest import assert_same
from ckptzip.codecs import get_codec
from conftest import read_parts, same_bits, write_parts


def test_error_hierarchy():
    for e in (ckptzip.CorruptFileError, ckptzip.TruncatedFileError, ckptzip.ChecksumError,
              ckptzip.UnsupportedVersionError, ckptzip.UnknownCodecError, ckptzip.CodecError,
              ckptzip.GPURequiredError, ckptzip.PickleNotAllowedError, ckptzip.UnsupportedObjectError,
              ckptzip.TensorNotFoundError):
        assert issubclass(e, ckptzip.CkptzipError)
    assert issubclass(ckptzip.TruncatedFileError, ckptzip.CorruptFileError)
    assert issubclass(ckptzip.ChecksumError, ckptzip.CorruptFileError)


@pytest.fixture
def ok(tmp_path):
    p = tmp_path / "ok.ckz"
    ckptzip.save({"w": torch.randn(100), "i": torch.arange(10)}, p)
    return p


def test_unsupported_version(ok, tmp_path):
    raw = bytearray(ok.read_bytes())
    raw[8:10] = (2).to_bytes(2, "little")
    q = tmp_path / "v.ckz"
    q.write_bytes(bytes(raw))
    with pytest.raises(ckptzip.UnsupportedVersionError):
        ckptzip.load(q)
    data, doc, rows = read_parts(ok)
    doc["version"] = [9, 0]
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.UnsupportedVersionError):
        ckptzip.load(q)


def test_unknown_codec_and_reserved_transform(ok, tmp_path):
    data, doc, rows = read_parts(ok)
    doc["storages"][1]["codec"] = {"id": "brotli9"}
    q = tmp_path / "u.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.UnknownCodecError):
        ckptzip.load(q)
    data, doc, rows = read_parts(ok)
    # (v1.0 reserved delta/xor/derived; v1.1 defines them: an unknown id is refused the same way)
    doc["storages"][0]["transforms"] = [{"id": "delta9", "ref": {"base": "prev.ckz", "storage": 0}}]
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.UnknownCodecError, match="unknown transform"):
        ckptzip.load(q)
    with pytest.raises(ckptzip.UnknownCodecError):
        ckptzip.save({"a": torch.ones(2)}, tmp_path / "x.ckz", codec="nope")


def test_gpu_required_without_gpu(ok, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    data, doc, rows = read_parts(ok)
    doc["storages"][0]["codec"] = {"id": "ans", "data_type": "|u1"}
    q = tmp_path / "g.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.GPURequiredError, match="ckptzip convert"):
        ckptzip.load(q)
    with pytest.raises(ckptzip.GPURequiredError):
        ckptzip.save({"a": torch.ones(2)}, tmp_path / "x.ckz", codec="ans")
    assert not (tmp_path / "x.ckz").exists()
    with pytest.raises(ckptzip.GPURequiredError):
        get_codec("bitcomp")


def test_codec_error_and_checksum_error(ok, tmp_path):
    raw = bytearray(ok.read_bytes())
    _, _, rows = read_parts(ok)
    raw[int(rows[0]["offset"]) + 1] ^= 4
    q = tmp_path / "c.ckz"
    q.write_bytes(bytes(raw))
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(q)


def test_exception_mid_save_keeps_old_file(tmp_path, monkeypatch):
    p = tmp_path / "a.ckz"
    ckptzip.save({"v": torch.ones(10)}, p)
    old = p.read_bytes()

    class Boom(Exception):
        pass

    def bad(*a, **k):
        raise Boom()
    from ckptzip.io import ChunkWriter
    monkeypatch.setattr(ChunkWriter, "add", bad)
    with pytest.raises(Boom):
        ckptzip.save({"v": torch.zeros(10)}, p)
    assert p.read_bytes() == old
    assert [f.name for f in tmp_path.iterdir()] == ["a.ckz"]  # temp file removed


def test_early_writeback_same_bytes(tmp_path, monkeypatch):
    """Starting the disk write of written ranges at once (``storage.WRITEBACK``, Linux
    ``sync_file_range``) changes when bytes reach the disk, never which bytes: whole pages,
    in order, never twice; not for saves without fsync; other file objects are left alone."""
    import io
    from ckptzip import storage
    import ckptzip.io.writer as writer
    calls = []
    real = storage.start_writeback
    monkeypatch.setattr(writer, "start_writeback", lambda f, o, n: (calls.append((o, n)), real(f, o, n)))
    monkeypatch.setattr(writer, "WRITEBACK_MIN", 4096)
    st = {"a": torch.randn(300_000), "b": torch.arange(1000), "c": torch.randn(70_000).bfloat16()}
    a, b, c = tmp_path / "a.ckz", tmp_path / "b.ckz", tmp_path / "c.ckz"
    ckptzip.save(st, a)
    assert calls and calls[0][0] == 0
    for (o, n), (o2, _n2) in zip(calls, calls[1:] + [(None, None)]):
        assert o % writer._PAGE == 0 and n % writer._PAGE == 0 and n >= 4096
        assert o2 is None or o2 == o + n
    assert sum(n for _o, n in calls) <= a.stat().st_size
    calls.clear()
    ckptzip.save(st, c, fsync=False)
    assert not calls and c.read_bytes() == a.read_bytes()
    monkeypatch.setattr(storage, "WRITEBACK", False)
    ckptzip.save(st, b)
    assert a.read_bytes() == b.read_bytes()
    monkeypatch.setattr(storage, "WRITEBACK", True)
    storage.start_writeback(io.BytesIO(), 0, 10)  # not a plain file: nothing to do, no error


def test_cpu_windows_written_by_thread_and_synced_early(tmp_path, monkeypatch):
    """A CPU save to a local file encodes 8 MiB windows (``pipeline.CPU_FILE_WINDOW``) and the
    writer thread writes each while the next is encoded; with fsync, the flusher thread
    fdatasyncs written windows while the save goes on. The bytes are those of a save written
    by the caller in one window (a file object); without fsync nothing is synced early."""
    import io
    import os
    import threading
    from ckptzip import pipeline
    import ckptzip.io.writer as writer
    monkeypatch.setattr(pipeline, "CPU_FILE_WINDOW", 1 << 20)
    monkeypatch.setattr(writer, "WRITEBACK_MIN", 256 << 10)
    synced, writers = [], set()
    real_sync, real_write = os.fdatasync, writer._write_all
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(threading.current_thread().name), real_sync(fd))[1])
    monkeypatch.setattr(writer, "_write_all", lambda f, parts: (writers.add(threading.current_thread().name),
                                                                real_write(f, parts))[1])
    g = torch.Generator().manual_seed(0)
    st = {"a": [torch.randn(150_000, generator=g) for _ in range(10)], "b": torch.arange(1000),
          "c": torch.randn(300_000, generator=g).bfloat16()}
    a = tmp_path / "a.ckz"
    ckptzip.save(st, a)
    assert writers == {"ckptzip-writer"} and len(synced) >= 2 and set(synced) == {"ckptzip-flusher"}
    buf = io.BytesIO()
    ckptzip.save(st, buf)  # (a file object: the caller writes, no early sync)
    assert a.read_bytes() == buf.getvalue()
    synced.clear()
    ckptzip.save(st, tmp_path / "b.ckz", fsync=False)
    assert not synced and (tmp_path / "b.ckz").read_bytes() == a.read_bytes()
    assert_same(ckptzip.load(a), st)
    assert not [t for t in threading.enumerate() if t.name in ("ckptzip-writer", "ckptzip-flusher")]


def _small_windows_and_an_old_file(tmp_path, monkeypatch):
    """1 MiB CPU windows, early syncs every 256 KiB, and a checkpoint at ``a.ckz`` to protect:
    (its path, its bytes)."""
    from ckptzip import pipeline
    import ckptzip.io.writer as writer
    monkeypatch.setattr(pipeline, "CPU_FILE_WINDOW", 1 << 20)
    monkeypatch.setattr(writer, "WRITEBACK_MIN", 256 << 10)
    p = tmp_path / "a.ckz"
    ckptzip.save({"v": torch.ones(10)}, p)
    return p, p.read_bytes()


@pytest.mark.parametrize("where", ["write", "sync"])
def test_cpu_writer_thread_errors_keep_old_file(tmp_path, monkeypatch, where):
    """An I/O error on the writer thread (a write) or the flusher thread (an early fdatasync)
    fails the save with that error; the previous checkpoint stays, no temp file is left."""
    import os
    import ckptzip.io.writer as writer
    p, old = _small_windows_and_an_old_file(tmp_path, monkeypatch)
    calls = []

    def bad(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "injected I/O error")
        return real(*a, **k)
    if where == "write":
        real = writer._write_all
        monkeypatch.setattr(writer, "_write_all", bad)
    else:
        real = os.fdatasync
        monkeypatch.setattr(os, "fdatasync", bad)
    with pytest.raises(OSError, match="injected"):
        ckptzip.save({"v": [torch.randn(150_000) for _ in range(12)]}, p)
    assert p.read_bytes() == old
    assert [f.name for f in tmp_path.iterdir()] == ["a.ckz"]


def test_early_sync_error_after_the_last_write_fails_the_save(tmp_path, monkeypatch):
    """An early fdatasync that fails after the save's last write (the flusher still running when
    the chunks are done) fails the save through ChunkWriter.close: the old file stays, no temp
    file or thread is left. (An error reported to that fdatasync is not reported again to the
    final fsync of the same file description.)"""
    import os
    import threading
    import time
    p, old = _small_windows_and_an_old_file(tmp_path, monkeypatch)
    calls = []

    def slow_then_fail(fd):
        calls.append(1)
        time.sleep(0.5)  # (longer than the rest of this small save takes)
        raise OSError(5, "injected late I/O error")
    monkeypatch.setattr(os, "fdatasync", slow_then_fail)
    with pytest.raises(OSError, match="injected late"):
        ckptzip.save({"v": [torch.randn(100_000) for _ in range(4)]}, p)
    assert len(calls) == 1
    assert p.read_bytes() == old
    assert [f.name for f in tmp_path.iterdir()] == ["a.ckz"]
    assert not [t for t in threading.enumerate() if t.name in ("ckptzip-writer", "ckptzip-flusher")]


def test_tmpfs_pages_allocated_ahead_and_excess_given_back(monkeypatch):
    """On tmpfs the writer allocates the file's pages ahead of its writes (fallocate, KEEP_SIZE)
    up to the expected size; pages past the complete file's end are given back, the bytes are
    those of a save without it, and no thread is left."""
    import os
    import tempfile
    import threading
    from ckptzip import native, pipeline
    import ckptzip.io.writer as writer
    if native.lib is None or not os.path.isdir("/dev/shm"):
        pytest.skip("no C extension or no /dev/shm")
    fd = os.open("/dev/shm", os.O_RDONLY)
    try:
        if native.lib.fs_type(fd) != writer._TMPFS_MAGIC:
            pytest.skip("/dev/shm is not tmpfs")
        free = os.fstatvfs(fd)
        if free.f_bavail * free.f_frsize < 256 << 20:  # (the reserve below needs twice its size free)
            pytest.skip("less than 256 MiB free in /dev/shm")
    finally:
        os.close(fd)
    monkeypatch.setattr(writer, "PREALLOC_STEP", 1 << 20)
    g = torch.Generator().manual_seed(5)
    st = {"a": torch.randn(2_000_000, generator=g), "b": torch.arange(5000)}
    total = sum(t.numel() * t.element_size() for t in st.values())
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        a, b = os.path.join(d, "a.ckz"), os.path.join(d, "b.ckz")
        monkeypatch.setitem(pipeline._SIZES, total, 4 * total)  # expects far more than it writes
        seen = []
        real = threading.Thread.start

        def start(self):
            seen.append(self.name)
            return real(self)
        monkeypatch.setattr(threading.Thread, "start", start)
        ckptzip.save(st, a)
        assert "ckptzip-prealloc" in seen
        size = os.path.getsize(a)
        assert pipeline._SIZES[total] == size  # remembered for the next save of this size
        assert os.stat(a).st_blocks * 512 <= -(-size // 4096) * 4096 + 4096  # the excess went back
        monkeypatch.setattr(writer, "PREALLOC", False)
        ckptzip.save(st, b)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read()
        assert_same(ckptzip.load(a), st)
    assert not [t for t in threading.enumerate() if t.name == "ckptzip-prealloc"]


KILLER = r"""
import sys, torch, ckptzip
p = sys.argv[1]
x = torch.randn(8_000_000)
print("ready", flush=True)
i = 0
while True:
    ckptzip.save({"x": x, "i": i}, p)
    i += 1
"""


def test_kill_9_mid_save(tmp_path):
    p = tmp_path / "k.ckz"
    ckptzip.save({"x": torch.ones(3), "i": -1}, p)
    proc = subprocess.Popen([sys.executable, "-c", KILLER, str(p)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(1.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    back = ckptzip.load(p)  # the old file or a complete new one, never a torn one
    assert back["i"] == -1 or back["x"].numel() == 8_000_000
    with ckptzip.open(p) as r:
        r.verify()


def test_cli_roundtrip(tmp_path, small_state, capsys):
    pt, ckz, back = tmp_path / "s.pt", tmp_path / "s.ckz", tmp_path / "b.pt"
    torch.save(small_state, pt)
    assert ckptzip.cli.main(["compress", str(pt), str(ckz), "-q"]) == 0
    assert ckptzip.cli.main(["verify", str(ckz), "-q"]) == 0
    assert ckptzip.cli.main(["decompress", str(ckz), str(back), "-q"]) == 0
    b = torch.load(back, weights_only=True)
    for k, v in small_state["model"].items():
        assert same_bits(b["model"][k], v)


def test_cli_info_json(tmp_path, small_state, capsys):
    ckz = tmp_path / "s.ckz"
    ckptzip.save(small_state, ckz)
    capsys.readouterr()
    assert ckptzip.cli.main(["info", str(ckz), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    keys = {t["key"] for t in info["tensors"]}
    assert "model.0.weight" in keys and info["file_bytes"] == os.path.getsize(ckz)
    assert all(t["codec"] for t in info["tensors"])


def test_cli_cost_reproduces_blog(capsys):
    assert ckptzip.cli.main(["cost", "--json", "--ratio", "1.0"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index('{"ratio"'):])
    assert 2100 < data["before"]["idle_gpu_usd"] < 2300


def test_cli_errors_exit_1(tmp_path, capsys):
    q = tmp_path / "bad.ckz"
    q.write_bytes(b"nope")
    assert ckptzip.cli.main(["info", str(q)]) == 1  # a failure; 2 is for usage errors
    assert capsys.readouterr().err == ("error: NotCkptzipFileError: not a ckptzip file (bad magic) (`ckptzip compress` "
                                       "converts a torch.save or safetensors file)\n")
    with pytest.raises(ckptzip.NotCkptzipFileError):  # (a CorruptFileError, as before)
        ckptzip.load(q)
    assert issubclass(ckptzip.NotCkptzipFileError, ckptzip.CorruptFileError)
    q.write_bytes(b"CKPTZ")  # the magic's first bytes: a .ckz cut short
    assert ckptzip.cli.main(["info", str(q)]) == 1
    assert capsys.readouterr().err.startswith("error: TruncatedFileError")


def test_cli_installed_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptzip.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "ckptzip" in r.stdout


def test_demo_runs(tmp_path, capsys):
    from ckptzip.demo import run_demo
    res = run_demo(seconds=1.0, device="cpu", out_dir=str(tmp_path))
    assert res["ckptzip"]["bytes"] < res["torch.save"]["bytes"]
    out = capsys.readouterr().out.replace("\n", "")  # (rich wraps long lines)
    assert str(tmp_path / "demo.ckz") in out and "ckptzip info" in out  # where the files are, and what next
    import ckptzip.cli
    assert ckptzip.cli.main(["verify", str(tmp_path)]) == 1  # the folder: not a DCP save, name a file
    err = capsys.readouterr()
    assert "interrupted" not in err.out + err.err and "'demo.ckz'" in err.out + err.err
