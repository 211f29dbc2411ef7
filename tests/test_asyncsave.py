"""async_save: pending saves survive the end of the script, failures are never silent."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptzip
from ckptzip import asyncsave

SRC = str(Path(__file__).resolve().parents[1] / "src")
N = 16_000_000  # 64 MB of float32: the background write is certainly still running at exit


def big_state():
    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(N, generator=g), "step": 7}


def run_script(body: str, *args) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import sys, torch, ckptzip
        def big_state():
            g = torch.Generator().manual_seed(1234)
            return {"w": torch.randn(%d, generator=g), "step": 7}
    """ % N) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


def assert_bit_exact(path):
    got, want = ckptzip.load(path), big_state()
    assert got["step"] == want["step"]
    assert torch.equal(got["w"].view(torch.int32), want["w"].view(torch.int32))


def test_script_ending_without_wait_keeps_the_checkpoint(tmp_path):
    p = tmp_path / "a.ckz"
    r = run_script("""
        ckptzip.async_save(big_state(), sys.argv[1])
        print("end of script", flush=True)
    """, p)
    assert r.returncode == 0, r.stderr
    assert "end of script" in r.stdout
    assert "cannot schedule" not in r.stderr
    assert_bit_exact(p)


def test_exception_after_async_save_keeps_the_checkpoint_and_the_traceback(tmp_path):
    p = tmp_path / "a.ckz"
    r = run_script("""
        ckptzip.async_save(big_state(), sys.argv[1])
        raise RuntimeError("training diverged")
    """, p)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "RuntimeError: training diverged" in r.stderr
    assert "CHECKPOINT NOT SAVED" not in r.stderr
    assert_bit_exact(p)


def test_sys_exit_keeps_the_checkpoint_and_the_status(tmp_path):
    p = tmp_path / "a.ckz"
    r = run_script("""
        ckptzip.async_save(big_state(), sys.argv[1])
        sys.exit(3)
    """, p)
    assert r.returncode == 3, r.stderr
    assert_bit_exact(p)


def test_manager_async_save_then_exit_is_committed(tmp_path):
    r = run_script("""
        m = ckptzip.CheckpointManager(sys.argv[1], keep_last=2, async_save=True)
        m.save(100, big_state())
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "step-000000100.commit").is_file()
    m = ckptzip.CheckpointManager(tmp_path)
    assert m.steps() == [100]
    assert_bit_exact(m.path(100))


def test_manager_async_save_then_exception_is_committed(tmp_path):
    r = run_script("""
        m = ckptzip.CheckpointManager(sys.argv[1], keep_last=2, async_save=True)
        m.save(5, big_state())
        raise KeyError("boom")
    """, tmp_path)
    assert r.returncode == 1 and "KeyError: 'boom'" in r.stderr
    assert ckptzip.CheckpointManager(tmp_path).steps() == [5]


def test_failed_save_nobody_waited_for_is_loud_at_exit(tmp_path):
    r = run_script("""
        ckptzip.async_save({"w": torch.ones(10)}, sys.argv[1])
        print("end of script", flush=True)
    """, tmp_path / "missing-dir" / "a.ckz")
    assert "end of script" in r.stdout
    assert r.returncode == 1
    assert "CHECKPOINT NOT SAVED" in r.stderr and "missing-dir" in r.stderr
    assert "FileNotFoundError" in r.stderr


def test_failed_save_that_was_waited_for_does_not_change_the_exit_status(tmp_path):
    r = run_script("""
        h = ckptzip.async_save({"w": torch.ones(10)}, sys.argv[1])
        try:
            h.wait()
        except FileNotFoundError:
            print("handled", flush=True)
    """, tmp_path / "missing-dir" / "a.ckz")
    assert r.returncode == 0, r.stderr
    assert "handled" in r.stdout and "CHECKPOINT NOT SAVED" not in r.stderr


def test_next_async_save_raises_the_unseen_error_of_the_previous_one(tmp_path):
    asyncsave.async_save({"w": torch.ones(10)}, tmp_path / "missing-dir" / "a.ckz")
    with pytest.raises(FileNotFoundError):
        ckptzip.async_save({"w": torch.ones(10)}, tmp_path / "b.ckz")
    assert not (tmp_path / "b.ckz").exists()  # not started: the caller knows it must retry
    # reported once: the retry goes ahead
    ckptzip.async_save({"w": torch.ones(10)}, tmp_path / "b.ckz").wait()
    assert torch.equal(ckptzip.load(tmp_path / "b.ckz")["w"], torch.ones(10))
    assert not asyncsave._PENDING


def test_error_already_seen_on_wait_is_not_raised_again_by_the_next_save(tmp_path):
    h = ckptzip.async_save({"w": torch.ones(10)}, tmp_path / "missing-dir" / "a.ckz")
    with pytest.raises(FileNotFoundError):
        h.wait()
    with pytest.raises(FileNotFoundError):
        h.wait()  # wait() may be called again
    ckptzip.async_save({"w": torch.ones(3)}, tmp_path / "b.ckz").wait()
    assert not asyncsave._PENDING


def test_handle_timeout_and_summary(tmp_path):
    h = ckptzip.async_save({"w": torch.arange(1000)}, tmp_path / "a.ckz")
    res = h.wait(timeout=60)
    assert h.done() and res["path"].endswith("a.ckz") and res["raw_bytes"] == 8000
    assert h.stall_s >= 0 and h.path == str(tmp_path / "a.ckz")


def test_cpu_async_snapshot_of_a_derived_copy_holds_the_state_at_the_call(tmp_path):
    """A bf16 copy stored as ``derived`` from its fp32 master: the CPU snapshot takes the
    residual at the call, so changing the master afterwards does not change the checkpoint."""
    torch.manual_seed(0)
    w = torch.randn(300_000)
    st = {"w": w, "w16": w.to(torch.bfloat16)}
    want = {k: v.clone() for k, v in st.items()}
    h = ckptzip.async_save(st, tmp_path / "a.ckz", device="cpu")
    w.fill_(-1.0)
    st["w16"].fill_(3.0)
    h.wait()
    got = ckptzip.load(tmp_path / "a.ckz")
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["w16"].view(torch.int16), want["w16"].view(torch.int16))
    with ckptzip.open(tmp_path / "a.ckz") as r:
        assert any(t.get("id") == "derived" for s in r.storages for t in s["transforms"])
