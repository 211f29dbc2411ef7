"""CheckpointManager on damaged directories: strict markers, concurrent rotation, temp cleanup."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

import ckptzip
from ckptzip.manager import CheckpointManager


def st(v=0.0):
    return {"w": torch.full((64,), float(v))}


def fill(tmp_path, steps=(1, 2, 3), **kw):
    m = CheckpointManager(tmp_path, keep_last=None, **kw)
    for s in steps:
        m.save(s, st(s))
    return m


BAD_MARKERS = [b"[1]", b"5", b"null", b'"x"', b'{"step": "x"}', b"{}", b"\xff\xfe",
               b'{"step": 2, "file": "step-000000002.ckz", "bytes": true}',
               b'{"step": 2, "file": "step-000000002.ckz", "bytes": -1}',
               b'{"step": 2, "file": "../step-000000001.ckz", "bytes": 1}',
               b'{"step": 3, "file": "step-000000002.ckz", "bytes": 1}',
               b'{"step": true, "file": "step-000000002.ckz", "bytes": 1}',
               b"[" * 100_000, b'{"step": 2, "bytes": 1' + b"9" * 5000 + b"}"]


@pytest.mark.parametrize("content", BAD_MARKERS, ids=range(len(BAD_MARKERS)))
def test_marker_of_wrong_shape_is_skipped_and_reported(tmp_path, content):
    m = fill(tmp_path)
    (tmp_path / "step-000000002.commit").write_bytes(content)
    assert m.steps() == [1, 3]
    assert m.latest() == 3
    assert torch.equal(m.load()["w"], st(3)["w"])
    with pytest.raises(FileNotFoundError):
        m.load(2)
    [p] = m.problems()
    assert (p.step, p.status, p.name) == (2, "damaged", "step-000000002.commit") and p.reason
    m.keep_last = 1
    m.save(4, st(4))  # later saves and rotation still work
    assert m.steps() == [4]
    assert [e.status for e in m.entries()] == ["damaged", "committed"]


def test_marker_with_wrong_size_or_missing_file(tmp_path):
    m = fill(tmp_path)
    os.truncate(tmp_path / "step-000000001.ckz", 10)
    os.remove(tmp_path / "step-000000002.ckz")
    assert m.steps() == [3]
    reasons = {e.step: e.reason for e in m.problems()}
    assert "10 bytes" in reasons[1] and "missing" in reasons[2]


@pytest.mark.parametrize("digits", ["\u0660" * 8 + "\u0661",      # Arabic-Indic 000000001
                                    "\uff10" * 8 + "\uff11",      # fullwidth 000000001
                                    "0000000001"])               # 10 digits: not canonical
def test_marker_named_with_other_digits_is_not_a_second_step(tmp_path, digits):
    m = fill(tmp_path, steps=(1,))
    marker = (tmp_path / "step-000000001.commit").read_bytes()
    (tmp_path / f"step-{digits}.commit").write_bytes(marker)
    assert m.steps() == [1]
    [p] = m.problems()
    assert p.status == "damaged" and p.name == f"step-{digits}.commit"


def test_marker_that_is_a_fifo_does_not_hang(tmp_path):
    m = fill(tmp_path, steps=(1,))
    os.mkfifo(tmp_path / "step-000000002.commit")
    assert m.steps() == [1]
    assert "regular file" in m.problems()[0].reason


def test_uncommitted_checkpoint_is_reported(tmp_path):
    m = fill(tmp_path, steps=(1, 2))
    os.remove(tmp_path / "step-000000002.commit")
    assert m.steps() == [1]
    [p] = m.problems()
    assert (p.step, p.status, p.name) == (2, "uncommitted", "step-000000002.ckz") and p.bytes > 0


def test_rotation_tolerates_files_removed_by_another_process(tmp_path):
    a = CheckpointManager(tmp_path, keep_last=1)
    b = CheckpointManager(tmp_path, keep_last=1)
    a.save(1, st(1))
    real_rm = b.fs.rm

    def racing_rm(path, *args, **kw):  # the other process removes it first
        real_rm(path, *args, **kw)
        real_rm(path, *args, **kw)
    b.fs.rm = racing_rm
    b.save(2, st(2))  # was: FileNotFoundError after step 2 was committed
    assert b.steps() == [2]


def test_two_managers_saving_in_turn(tmp_path):
    a = CheckpointManager(tmp_path, keep_last=2)
    b = CheckpointManager(tmp_path, keep_last=2)
    for s in range(1, 7):
        (a if s % 2 else b).save(s, st(s))
    assert a.steps() == [5, 6] and not a.problems()


def _age(p, seconds):
    t = time.time() - seconds
    os.utime(p, (t, t))


def test_stale_temp_files_of_killed_saves_are_removed(tmp_path):
    names = [".step-000000001.ckz.ab_c1x9z.tmp", ".step-000000001.commit.q2w3e4r5.tmp",
             ".step-000000002.ckz.zzzzzzzz.tmp.old"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 100)
        _age(tmp_path / n, 7200)
    fresh = tmp_path / ".step-000000003.ckz.freshfil.tmp"
    fresh.write_bytes(b"x")
    other = tmp_path / ".notes.txt.abcdefgh.tmp"  # not ours
    other.write_bytes(b"x")
    _age(other, 7200)
    m = CheckpointManager(tmp_path, keep_last=2)
    assert m.steps() == [] and all((tmp_path / n).exists() for n in names)  # listing deletes nothing
    m.save(1, st(1))  # cleaned before each save
    assert not any((tmp_path / n).exists() for n in names)
    assert fresh.exists() and other.exists()
    _age(fresh, 7200)
    assert m.clean_stale_temp() == [fresh.name]
    assert not fresh.exists() and other.exists()
    assert m.steps() == [1]


def test_stale_temp_cleanup_can_be_disabled(tmp_path):
    n = tmp_path / ".step-000000001.ckz.abcdefgh.tmp"
    n.write_bytes(b"x")
    _age(n, 10 ** 6)
    m = CheckpointManager(tmp_path, stale_temp_s=None)
    assert n.exists()
    assert m.clean_stale_temp(max_age_s=0) == [n.name] and not n.exists()


def test_keep_last_and_keep_every_semantics(tmp_path):
    m = CheckpointManager(tmp_path, keep_last=2, keep_every=10)
    for s in (5, 10, 15, 20, 25, 30, 35):
        m.save(s, st(s))
    assert m.steps() == [10, 20, 30, 35]
    m0 = CheckpointManager(tmp_path / "z", keep_last=0, keep_every=10)
    for s in (9, 10, 11):
        m0.save(s, st(s))
    assert m0.steps() == [10]
    for bad in ({"keep_last": -1}, {"keep_every": 0}, {"keep_last": True}):
        with pytest.raises(ValueError):
            CheckpointManager(tmp_path, **bad)


def test_entries_of_a_healthy_directory_and_wide_steps(tmp_path):
    m = fill(tmp_path, steps=(3, 1_234_567_890))
    assert [(e.step, e.status, e.name) for e in m.entries()] == [
        (3, "committed", "step-000000003.ckz"), (1_234_567_890, "committed", "step-1234567890.ckz")]
    assert m.latest() == 1_234_567_890 and torch.equal(m.load(3)["w"], st(3)["w"])
    info = json.loads((tmp_path / "step-000000003.commit").read_text())
    assert info == {"step": 3, "file": "step-000000003.ckz", "bytes": os.path.getsize(m.path(3))}


@pytest.mark.parametrize("use_async", [False, True])
def test_incremental_manager_full_every_and_bases_kept(tmp_path, use_async):
    """Deltas refer to the last full checkpoint, a full one every ``full_every`` saves, and
    rotation keeps the base of every kept checkpoint."""
    import ckptzip
    torch.manual_seed(0)
    w = torch.randn(200_000)
    m = ckptzip.CheckpointManager(tmp_path, keep_last=2, incremental=True, full_every=3, async_save=use_async)
    saved = {}
    for step in range(1, 8):
        w += 1e-4 * torch.randn_like(w)
        st = {"w": w.clone(), "w16": w.to(torch.bfloat16), "step": step}
        saved[step] = st
        h = m.save(step, st)
        if use_async:
            h.wait()
    m.wait()
    bases = {s: m.base_of(s) for s in m.steps()}
    assert m.steps() == [4, 6, 7], m.entries()  # 5 rotated out; 4 kept as the base of 6
    assert bases == {4: None, 6: 4, 7: None}
    for s in m.steps():
        got = m.load(s)
        assert torch.equal(got["w"], saved[s]["w"]) and got["step"] == s
        assert torch.equal(got["w16"].view(torch.int16), saved[s]["w16"].view(torch.int16))
    with pytest.raises(ValueError):
        ckptzip.CheckpointManager(tmp_path, incremental=True, full_every=0)


def test_incremental_full_every_counts_saves_not_files_on_disk(tmp_path):
    """With keep_last smaller than full_every, rotation removes older deltas; a full checkpoint
    still comes every full_every saves (the delta index is recorded in each delta)."""
    import ckptzip
    torch.manual_seed(0)
    w = torch.randn(20_000)
    m = ckptzip.CheckpointManager(tmp_path, keep_last=2, incremental=True, full_every=4)
    full = []
    for step in range(10):
        w += 1e-4 * torch.randn_like(w)
        m.save(step, {"w": w.clone()})
        if m.base_of(step) is None:
            full.append(step)
    assert full == [0, 4, 8]
    assert torch.equal(m.load()["w"], w)


def test_distributed_manager_removes_directories_of_killed_saves(tmp_path):
    """A distributed save killed mid-write leaves an uncommitted step-N/ directory: once a later
    step is committed and its newest file is older than stale_temp_s, the coordinator removes
    it; an uncommitted directory newer than every committed step (a save in progress) stays."""
    import time
    m = ckptzip.CheckpointManager(tmp_path, keep_last=None, distributed=True, stale_temp_s=60)
    m.save(2, {"a": torch.ones(3)})
    for step in (1, 5):
        d = tmp_path / f"step-{step:09d}"
        d.mkdir()
        (d / ".__0_0.ckz.abc.tmp").write_bytes(b"x" * 100)
        old = time.time() - 3600
        os.utime(d / ".__0_0.ckz.abc.tmp", (old, old))
        os.utime(d, (old, old))
    (tmp_path / "step-000000001" / "fresh.tmp").write_bytes(b"y")  # touched just now: kept
    assert m.clean_stale_temp() == []
    os.unlink(tmp_path / "step-000000001" / "fresh.tmp")
    old = time.time() - 3600
    os.utime(tmp_path / "step-000000001", (old, old))
    assert m.clean_stale_temp() == ["step-000000001"]
    assert not (tmp_path / "step-000000001").exists() and (tmp_path / "step-000000005").exists()
    assert m.steps() == [2]


def _dstate(step):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=g) * 0.02
    return {"w": w + step * 1e-5 * torch.randn(256, 1024, generator=g), "step": step}


def _rank_base(root, step):
    with ckptzip.open(os.path.join(root, f"step-{step:09d}", "__0_0.ckz")) as r:
        return r.base and r.base["file"]


def test_distributed_incremental_keeps_the_pending_base_and_recovers(tmp_path):
    """Single-process distributed mode (what every rank does): the full checkpoint the next
    delta will use is kept even when keep_last/keep_every alone would drop it; a base removed
    from outside makes the next save full (never a failing save); a rank whose base file is
    damaged saves in full; base= is refused (the manager must record bases itself)."""
    import shutil
    m = ckptzip.CheckpointManager(tmp_path / "a", keep_last=0, keep_every=5, distributed=True, incremental=True)
    for s in (1, 2, 3, 4, 5):
        m.save(s, _dstate(s))
    assert m.steps() == [1, 5] and m.base_of(5) == 1
    assert _rank_base(tmp_path / "a", 5) == "../step-000000001/__0_0.ckz"
    for k, v in _dstate(5).items():
        assert torch.equal(torch.as_tensor(m.load(5)[k]), torch.as_tensor(v))
    m = ckptzip.CheckpointManager(tmp_path / "b", keep_last=3, distributed=True, incremental=True)
    m.save(1, _dstate(1))
    m.save(2, _dstate(2))
    assert m.base_of(2) == 1
    shutil.rmtree(m.dir_path(1))
    os.remove(tmp_path / "b" / "step-000000001.commit")
    m.save(3, _dstate(3))  # its base is gone: full
    m.save(4, _dstate(4))
    assert m.base_of(3) is None and m.base_of(4) == 3 and _rank_base(tmp_path / "b", 3) is None
    assert torch.equal(m.load(4)["w"], _dstate(4)["w"])
    # a damaged base rank file (same size, a flipped byte in its manifest): that rank saves in full
    p = tmp_path / "b" / "step-000000003" / "__0_0.ckz"
    raw = bytearray(p.read_bytes())
    raw[-100] ^= 0xFF
    p.write_bytes(bytes(raw))
    m.save(5, _dstate(5))
    assert _rank_base(tmp_path / "b", 5) is None
    assert torch.equal(m.load(5)["w"], _dstate(5)["w"])
    with pytest.raises(ValueError, match="incremental=True"):
        m.save(6, _dstate(6), base=m.dir_path(4))
