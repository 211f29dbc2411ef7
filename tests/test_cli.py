"""The command line (issue 12): no pickle unless asked, file strings printed as data, ordinary
training checkpoints and safetensors as input, one-line errors, help text, safetensors output."""
import glob
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import ckptzip
import ckptzip.cli
from ckptzip import torchfile
from conftest import assert_same, same_bits

SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src")


def cli(*args):
    return ckptzip.cli.main([str(a) for a in args])


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


class Evil:
    """Unpickling this runs ``touch <path>``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# -- item 2: pickle only with --allow-pickle ---------------------------------------------------

def test_convert_and_decompress_refuse_pickle(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    src = tmp_path / "evil.ckz"
    ckptzip.save({"w": torch.ones(3), "e": Evil(marker)}, src, allow_pickle=True)
    for cmd, out in (("convert", "o.ckz"), ("decompress", "o.pt"), ("decompress", "o.safetensors")):
        assert cli(cmd, src, tmp_path / out, "-q") == 1
        err = one_error_line(capsys.readouterr().err)
        assert "PickleNotAllowedError" in err and "--allow-pickle" in err
        assert not marker.exists() and not (tmp_path / out).exists()
    assert cli("convert", src, tmp_path / "o.ckz", "-q", "--allow-pickle") == 0
    assert marker.exists()  # the user asked for it


def test_compress_refuses_pickle(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    pt = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "e": Evil(marker)}, pt)
    assert cli("compress", pt, tmp_path / "o.ckz", "-q") == 1
    err = one_error_line(capsys.readouterr().err)
    assert "PickleNotAllowedError" in err and "--allow-pickle" in err
    assert not marker.exists() and not (tmp_path / "o.ckz").exists()
    assert cli("compress", pt, tmp_path / "o.ckz", "-q", "--allow-pickle") == 0
    assert marker.exists()


# -- item 9: strings from files are data -------------------------------------------------------

def test_file_strings_printed_as_data(tmp_path, capsys):
    p = tmp_path / "keys.ckz"
    state = {"layer[/x].weight": torch.ones(3), "evil\x1b[31mRED\x1b[0m\n": torch.zeros(2),
             "[bold]b[/bold]": torch.ones(1)}
    ckptzip.save(state, p, metadata={"note[/x]": "v\x1b]0;title\x07"})
    capsys.readouterr()
    assert cli("info", p) == 0
    out = capsys.readouterr().out
    assert "layer[/x].weight" in out and "[bold]b[/bold]" in out and "note[/x]" in out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b" in out
    # a damaged file whose error names a key, through verify and decompress
    assert cli("verify", p, "-q") == 0
    assert "\x1b" not in capsys.readouterr().out
    odd = tmp_path / "odd[bold]"
    odd.mkdir()
    assert cli("decompress", p, odd / "b.pt", "-q") == 0
    out = capsys.readouterr().out
    assert "odd[bold]" in out
    assert cli("info", odd / "missing\x1b[2J.ckz") == 1
    err = one_error_line(capsys.readouterr().err)
    assert "\x1b" not in err and "\\x1b[2J" in err


def test_clean_escapes_controls():
    assert ckptzip.cli.clean("a[/b]") == "a[/b]"
    assert ckptzip.cli.clean("x\x1b[0m\n\t\u202e") == "x\\x1b[0m\\x0a\\x09\\u202e"
    assert ckptzip.cli.text("[/x]").plain == "[/x]"


# -- item 10: ordinary training checkpoints ----------------------------------------------------

def training_state():
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    return {"model": {"w": torch.randn(64, 64), "b": torch.zeros(64)},
            "np_array": np.arange(10.0), "np_int": np.int64(7), "np_float": np.float32(0.5),
            "np_bool": np.bool_(True), "epoch": 3, "lr": 1e-3, "name": "run",
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "numpy_gen": np.random.default_rng(3).bit_generator.state,
                    "torch": torch.get_rng_state()}}


def test_compress_reads_training_checkpoint(tmp_path, capsys):
    state = training_state()
    pt, ckz = tmp_path / "train.pt", tmp_path / "train.ckz"
    torch.save(state, pt)
    assert cli("compress", pt, ckz, "-q") == 0, capsys.readouterr().err
    back = ckptzip.load(ckz)
    assert_same(back, state)
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])


def test_load_torch_file_keeps_global_allowlist(tmp_path):
    pt = tmp_path / "a.pt"
    torch.save({"a": np.arange(3)}, pt)
    before = sorted(map(repr, torch.serialization.get_safe_globals()))  # the set; torch may reorder it
    assert torchfile.load_torch_file(pt)["a"].tolist() == [0, 1, 2]
    assert sorted(map(repr, torch.serialization.get_safe_globals())) == before


@pytest.mark.parametrize("content", [os.urandom(3000), b"hello, world\n", b"", b"PK\x03\x04broken zip"],
                         ids=["random", "text", "empty", "broken-zip"])
def test_compress_non_torch_input(tmp_path, capsys, content):
    f = tmp_path / "in.bin"
    f.write_bytes(content)
    assert cli("compress", f, tmp_path / "o.ckz", "-q") == 1
    assert "InputFormatError" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o.ckz").exists()


def test_compress_refuses_ckz_input(tmp_path, capsys):
    p = tmp_path / "a.ckz"
    ckptzip.save({"a": torch.ones(2)}, p)
    assert cli("compress", p, tmp_path / "b.ckz") == 1
    assert "convert" in one_error_line(capsys.readouterr().err)


# -- item 11: one-line errors, no tracebacks ---------------------------------------------------

@pytest.fixture
def pt(tmp_path):
    p = tmp_path / "s.pt"
    torch.save({"w": torch.randn(100)}, p)
    return p


@pytest.mark.parametrize("args,code", [
    (["compress", "{d}", "{d}/o.ckz"], 1),                     # directory as input
    (["compress", "{pt}", "{d}"], 1),                           # directory as output
    (["compress", "{pt}", "{d}/nodir/o.ckz"], 1),               # missing output directory
    (["compress", "{d}/missing.pt", "{d}/o.ckz"], 1),           # missing input
    (["compress", "{pt}", "{d}/o.ckz", "--codec", "{{bad"], 2),  # bad JSON
    (["compress", "{pt}", "{d}/o.ckz", "--codec", "[1]"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--codec", "nope"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--level", "99"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--codec", "raw", "--level", "3"], 2),
    (["convert", "{pt}", "{d}/o.ckz", "--codec", "deflate", "--level", "12"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--chunk-size", "0"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--chunk-size", "lots"], 2),
    (["compress", "{pt}", "{d}/o.ckz", "--level", "x"], 2),
    (["compress", "{pt}"], 2),
    (["frobnicate"], 2),
    (["info", "{d}"], 1),
    (["cost", "--gpus", "0"], 2),
])
def test_user_errors_one_line(tmp_path, pt, capsys, args, code):
    args = [a.format(d=tmp_path, pt=pt) for a in args]
    assert ckptzip.cli.main(args) == code
    cap = capsys.readouterr()
    one_error_line(cap.err)
    assert cap.out == ""
    assert not (tmp_path / "o.ckz").exists()


def test_device_cuda_without_cuda(tmp_path, pt, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for args in (["compress", pt, tmp_path / "o.ckz", "--device", "cuda"], ["demo", "--device", "cuda"]):
        assert cli(*args) == 1
        assert "CUDA" in one_error_line(capsys.readouterr().err)


def test_input_equals_output_refused(tmp_path, pt, capsys):
    before = pt.read_bytes()
    os.symlink(pt, tmp_path / "link.pt")
    for out in (pt, tmp_path / "." / pt.name, tmp_path / "link.pt"):
        assert cli("compress", pt, out, "-q") == 2
        assert "is the input" in one_error_line(capsys.readouterr().err)
    ckz = tmp_path / "a.ckz"
    ckptzip.save({"a": torch.ones(2)}, ckz)
    os.link(ckz, tmp_path / "hard.ckz")
    assert cli("convert", ckz, tmp_path / "hard.ckz") == 2
    assert cli("decompress", ckz, ckz) == 2
    capsys.readouterr()
    assert pt.read_bytes() == before


def test_no_arguments_prints_usage(capsys):
    assert ckptzip.cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ckptzip") and "compress" in err


def test_internal_error_one_line_unless_debug(tmp_path, capsys, monkeypatch):
    def boom(a):
        raise RuntimeError("kaboom")
    monkeypatch.setattr(ckptzip.cli, "cmd_info", boom)
    monkeypatch.delenv("CKPTZIP_DEBUG", raising=False)
    assert cli("info", tmp_path / "x.ckz") == 1
    err = one_error_line(capsys.readouterr().err)
    assert "internal error" in err and "kaboom" in err and "CKPTZIP_DEBUG=1" in err
    monkeypatch.setenv("CKPTZIP_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli("info", tmp_path / "x.ckz")


def test_signal_handlers_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    cli("info", tmp_path / "x.ckz")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.slow
def test_sigterm_mid_write_removes_temp_file(tmp_path):
    pt, out = tmp_path / "big.pt", tmp_path / "big.ckz"
    torch.manual_seed(0)
    torch.save({"x": torch.randn(4_000_000)}, pt)  # 16 MB: seconds at zstd level 19
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "ckptzip", "compress", str(pt), str(out), "--codec",
                          "zstd", "--level", "19", "--device", "cpu"], stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.time()
    while not glob.glob(str(tmp_path / ".big.ckz.*.tmp")):
        assert p.poll() is None and time.time() - t0 < 60, "no temp file appeared"
        time.sleep(0.02)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=60)
    err = p.stderr.read()
    assert rc == 128 + signal.SIGTERM, err
    one_error_line(err)
    assert "SIGTERM" in err
    assert sorted(os.listdir(tmp_path)) == ["big.pt"]


def test_python_m_ckptzip(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "ckptzip", "info", str(tmp_path)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and r.stdout == ""
    one_error_line(r.stderr)


# -- item 12: help, shared options, JSON only, ls ----------------------------------------------

def test_every_option_has_help():
    p = ckptzip.cli.build_parser()
    subs = next(a for a in p._actions if a.dest == "cmd").choices
    for name, sp in subs.items():
        for act in sp._actions:
            assert act.help and act.help.strip(), f"{name} {act.option_strings or act.dest}"
        help_text = sp.format_help()
        assert "exit status" in help_text
    comp = subs["compress"].format_help()
    assert "bytes" in comp and "1 to 22" in comp and "0 to 9" in comp and "default: 1048576" in comp


def test_convert_has_save_options(tmp_path, capsys):
    src, dst = tmp_path / "a.ckz", tmp_path / "b.ckz"
    ckptzip.save({"w": torch.randn(1000)}, src)
    assert cli("convert", src, dst, "--codec", "deflate", "--level", "9", "--chunk-size", "1K",
               "--portable", "-q") == 0
    with ckptzip.open(dst) as r:
        assert r.storages[0]["codec"]["id"] == "deflate"
        first, count = r.storages[0]["rows"]
        assert count >= 4  # 4000 bytes in 1 KiB chunks
    assert same_bits(ckptzip.load(dst)["w"], ckptzip.load(src)["w"])


def test_cost_json_is_only_json(capsys):
    assert cli("cost", "--json", "--ratio", "0.5") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ratio"] == 0.5


def test_ls_missing_directory_is_an_error(tmp_path, capsys):
    assert cli("ls", tmp_path / "nope") == 1
    one_error_line(capsys.readouterr().err)
    f = tmp_path / "file"
    f.write_text("x")
    assert cli("ls", f) == 1
    one_error_line(capsys.readouterr().err)
    assert cli("ls", tmp_path, "--json") == 0
    assert json.loads(capsys.readouterr().out)["steps"] == []


def test_no_progress_when_stderr_not_a_tty(tmp_path, pt, capsys):
    assert cli("compress", pt, tmp_path / "o.ckz") == 0  # no -q: stderr is captured, not a TTY
    assert capsys.readouterr().err == ""


# -- item 14: safetensors in and out -----------------------------------------------------------

def st_file(path, entries, meta=None, header_override=None):
    """A safetensors file written by hand: entries = {name: tensor}."""
    header, bufs, pos = {}, [], 0
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
             torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}
    for k, t in entries.items():
        b = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(b)]}
        bufs.append(b)
        pos += len(b)
    if meta is not None:
        header["__metadata__"] = meta
    raw = header_override if header_override is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(bufs))


def test_compress_safetensors(tmp_path, capsys):
    torch.manual_seed(0)
    ts = {"a.weight": torch.randn(8, 4), "a.bias": torch.randn(4).half(),
          "b": torch.randn(3).bfloat16(), "ids": torch.arange(5), "mask": torch.tensor([True, False]),
          "f8": torch.randn(4).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 3)}
    st = tmp_path / "model.safetensors"
    st_file(st, ts, meta={"format": "pt"})
    assert torchfile.sniff(st) == "safetensors"
    assert cli("compress", st, tmp_path / "m.ckz", "-q") == 0
    with ckptzip.open(tmp_path / "m.ckz") as r:
        assert r.metadata == {"format": "pt"}
        back = r.load()
    assert list(back) == list(ts)
    for k in ts:
        assert same_bits(back[k], ts[k]), k


@pytest.mark.parametrize("entry,why", [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 17]}}, "outside"),
    ({"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, "needs"),
    ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, "dtype"),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, "shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}}, "overlap"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "trailing"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "x": 1}}, "exactly"),
    ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, "metadata"),
    (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
     b'"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', "duplicate"),
    (b'{"w": nope}', "JSON"),
])
def test_hostile_safetensors(tmp_path, capsys, entry, why):
    st = tmp_path / "x.safetensors"
    raw = entry if isinstance(entry, bytes) else json.dumps(entry).encode()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    assert cli("compress", st, tmp_path / "o.ckz") == 1
    err = one_error_line(capsys.readouterr().err)
    assert "InputFormatError" in err and why in err, err


def test_safetensors_huge_header_length(tmp_path, capsys):
    st = tmp_path / "x.safetensors"
    st.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    assert cli("compress", st, tmp_path / "o.ckz") == 1  # not sniffed as safetensors: not a torch file
    one_error_line(capsys.readouterr().err)
    with pytest.raises(torchfile.InputFormatError, match="exceeds"):
        torchfile.read_safetensors(st)


def test_decompress_to_safetensors(tmp_path, capsys):
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    state = {"model": {"w": base, "wt": base.t(), "half": base[:3], "h": torch.randn(3).half()},
             "opt": [torch.ones(2)]}
    ckz = tmp_path / "a.ckz"
    ckptzip.save(state, ckz, metadata={"step": "5"})
    out = tmp_path / "a.safetensors"
    assert cli("decompress", ckz, out, "-q") == 0
    # parse by hand (not with our reader)
    raw = out.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"step": "5"}
    assert list(header) == ["model.w", "model.wt", "model.half", "model.h", "opt.0"]
    data = raw[8 + n:]
    e = header["model.wt"]
    assert e["dtype"] == "F32" and e["shape"] == [4, 6]
    got = torch.frombuffer(bytearray(data[e["data_offsets"][0]:e["data_offsets"][1]]), dtype=torch.float32)
    assert torch.equal(got.reshape(4, 6), base.t())
    tensors, meta = torchfile.read_safetensors(out)
    assert meta == {"step": "5"} and same_bits(tensors["model.half"], base[:3])
    # --format forces it whatever the extension; torch.save stays the default elsewhere
    assert cli("decompress", ckz, tmp_path / "x.bin", "--format", "safetensors", "-q") == 0
    assert torchfile.sniff(tmp_path / "x.bin") == "safetensors"
    assert cli("decompress", ckz, tmp_path / "y.pt", "-q") == 0
    assert torchfile.sniff(tmp_path / "y.pt") == "torch-zip"


def test_decompress_safetensors_refuses_non_tensors(tmp_path, capsys):
    ckz = tmp_path / "a.ckz"
    ckptzip.save({"w": torch.ones(2), "step": 3, "cfg": {"lr": 0.1}, "name": "x"}, ckz)
    out = tmp_path / "a.safetensors"
    assert cli("decompress", ckz, out, "-q") == 1
    err = one_error_line(capsys.readouterr().err)
    assert "'step' (int)" in err and "'cfg.lr' (float)" in err and "--format torch" in err
    assert not out.exists()
    assert cli("decompress", ckz, tmp_path / "a.bin", "--format", "torch", "-q") == 0
    assert torch.load(tmp_path / "a.bin", weights_only=True)["step"] == 3


def test_safetensors_roundtrip_through_cli(tmp_path, capsys):
    ts = {"a": torch.randn(5, 5), "b": torch.arange(4, dtype=torch.uint8)}
    st = tmp_path / "in.safetensors"
    st_file(st, ts, meta={"k": "v"})
    assert cli("compress", st, tmp_path / "m.ckz", "-q") == 0
    assert cli("decompress", tmp_path / "m.ckz", tmp_path / "out.safetensors", "-q") == 0
    back, meta = torchfile.read_safetensors(tmp_path / "out.safetensors")
    assert meta == {"k": "v"} and all(same_bits(back[k], ts[k]) for k in ts)


# ------------------------------------------------------------------ DCP directories, ls, --max-bytes
def _dcp_dir(path):
    import torch.distributed.checkpoint as dcp
    from ckptzip.dcp import Writer
    state = {"model": {"w": torch.randn(6, 4), "b": torch.arange(5)}, "step": 7}
    dcp.save(state, storage_writer=Writer(path))
    return state


def test_dcp_directory_info_verify_consolidate(tmp_path, capsys):
    d = tmp_path / "dcp"
    state = _dcp_dir(d)
    assert cli("info", d, "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "ckptzip-dcp" and [f["name"] for f in info["files"]] == ["__0_0.ckz"]
    fq = {r["fqn"]: r for r in info["items"]}
    assert fq["model.w"]["sizes"] == [6, 4] and fq["model.w"]["file"] == "__0_0.ckz" and fq["step"]["dtype"] == "bytes"
    assert cli("info", d) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "__0_0.ckz" in out
    assert cli("verify", d) == 0 and capsys.readouterr().out.startswith("OK")
    out_ckz = tmp_path / "full.ckz"
    assert cli("consolidate", d, out_ckz) == 0
    cap = capsys.readouterr()
    assert cap.err == ""  # no progress bar when stderr is not a terminal
    got = ckptzip.load(out_ckz)
    assert_same(got["model"], state["model"]) and got["step"] == 7
    # damage: a rank file's bytes flipped (same size) -> verify fails; missing dir -> one error line
    rank = d / "__0_0.ckz"
    raw = bytearray(rank.read_bytes())
    raw[100] ^= 0xFF
    rank.write_bytes(bytes(raw))
    assert cli("verify", d) == 1 and "FAILED" in capsys.readouterr().out
    os.unlink(d / "COMMIT")
    assert cli("verify", d) == 1 and "IncompleteCheckpointError" in capsys.readouterr().out
    assert cli("consolidate", d, tmp_path / "x.ckz") == 1
    one_error_line(capsys.readouterr().err)
    assert cli("consolidate", tmp_path / "nope", tmp_path / "x.ckz") == 1
    one_error_line(capsys.readouterr().err)


def test_consolidate_never_writes_into_its_source(tmp_path, capsys):
    """An output inside the checkpoint directory could replace a rank file or the commit marker:
    a usage error (exit 2), the directory untouched; a missing output directory fails before
    the checkpoint is read."""
    d = tmp_path / "dcp"
    _dcp_dir(d)
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    for out in (d / "__0_0.ckz", d / "COMMIT", d / "new.ckz", d / "." / "x.ckz"):
        assert cli("consolidate", d, out) == 2, out
        one_error_line(capsys.readouterr().err)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before
    assert cli("consolidate", d, tmp_path / "missing" / "x.ckz") == 1
    err = capsys.readouterr().err
    one_error_line(err)
    assert "does not exist" in err
    from ckptzip.dcp import consolidate
    with pytest.raises(ValueError, match="inside the checkpoint directory"):
        consolidate(d, d / "__0_0.ckz")
    assert (d / "__0_0.ckz").read_bytes() == before["__0_0.ckz"]


def test_dropped_snapshot_fails_its_save_instead_of_writing_live_tensors(tmp_path):
    """A second stage() before the first save wrote drops the first snapshot: that save's
    write_data must fail, not fall back to reading the (changed) live tensors."""
    from torch.distributed.checkpoint.planner import SavePlan
    from ckptzip.dcp import Writer
    w = Writer(tmp_path / "ck")
    sd = {"w": torch.ones(4)}
    w.stage(sd)
    with pytest.raises(RuntimeError, match="previous dcp.async_save"):
        w.stage(sd)
    with pytest.raises(RuntimeError, match="dropped"):
        w.write_data(SavePlan([]), None)
    fut = w.write_data(SavePlan([]), None)  # the flag is spent: the next save is a normal one
    assert fut.wait() == []


def test_ls_shows_status_and_distributed_entries(tmp_path, capsys):
    from ckptzip import CheckpointManager
    m = CheckpointManager(tmp_path, keep_last=None)
    m.save(1, {"a": torch.ones(3)})
    md = CheckpointManager(tmp_path, keep_last=None, distributed=True)  # no process group: 1 rank
    md.save(2, {"a": torch.ones(3)})
    (tmp_path / "step-000000003.ckz").write_bytes(b"partial")        # uncommitted
    (tmp_path / "step-000000004.commit").write_text("{not json")      # damaged
    assert cli("ls", tmp_path, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == [1, 2] and doc["latest"] == 2
    st = {e["step"]: (e["status"], e["kind"]) for e in doc["entries"]}
    assert st == {1: ("committed", "file"), 2: ("committed", "dcp"), 3: ("uncommitted", "file"),
                  4: ("damaged", "file")}
    # a committed entry names the checkpoint itself (what `ckptzip info` takes), a damaged one its marker
    assert {e["step"]: e["name"] for e in doc["entries"]} == {
        1: "step-000000001.ckz", 2: "step-000000002", 3: "step-000000003.ckz", 4: "step-000000004.commit"}
    assert cli("info", tmp_path / doc["entries"][0]["name"], "--json") == 0
    capsys.readouterr()
    assert cli("ls", tmp_path) == 0
    out = capsys.readouterr().out
    for word in ("committed", "uncommitted", "damaged", "dcp", "step-000000001.ckz", "step-000000002/"):
        assert word in out
    assert "not UTF-8 JSON" in [e for e in doc["entries"] if e["step"] == 4][0]["reason"]
    assert md.load(2, state={"a": torch.zeros(3)})["a"].sum() == 3


def test_max_bytes_option(tmp_path, capsys):
    p = tmp_path / "a.ckz"
    ckptzip.save({"a": torch.zeros(1000)}, p)
    assert cli("info", p, "--max-bytes", 10) == 0  # the manifest only: nothing decoded
    capsys.readouterr()
    for cmd in (("verify", p), ("decompress", p, tmp_path / "a.pt"),
                ("convert", p, tmp_path / "b.ckz")):
        assert cli(*cmd, "--max-bytes", 10) == 1, cmd
        cap = capsys.readouterr()
        assert "FAILED" in cap.out if cmd[0] == "verify" else one_error_line(cap.err)
        assert cli(*cmd, "--max-bytes", 1 << 20) == 0, cmd
        capsys.readouterr()
    assert cli("info", p, "--max-bytes", "-1") == 2


def test_export_command_and_info_says_lossy(tmp_path, capsys):
    torch.manual_seed(0)
    sd = {"model": {"w": torch.randn(64, 128), "b": torch.randn(64)}, "optimizer": {"state": {}}}
    src, dst = tmp_path / "s.ckz", tmp_path / "lossy.ckz"
    ckptzip.save(sd, src)
    capsys.readouterr()
    assert cli("export", src, dst, "--scheme", "int4", "--json") == 0
    rep = json.loads(capsys.readouterr().out)
    assert "w" in rep["quantized"] and "b" in rep["kept"]
    assert cli("info", dst) == 0 and "LOSSY" in capsys.readouterr().out
    assert cli("export", src, dst, "--scheme", "int4") == 1  # DST exists, no --force
    one_error_line(capsys.readouterr().err)
    assert cli("export", src, tmp_path / "x.ckz", "--eval", "nomodule") == 2
    one_error_line(capsys.readouterr().err)


def test_export_eval_module_from_the_current_directory(tmp_path, monkeypatch):
    """The `ckptzip` script's sys.path lacks the current directory (`python -m` has it): --eval
    finds a module there all the same, and so do the imports its function makes when it runs."""
    import sys
    from ckptzip.cli import _import_eval
    (tmp_path / "evalmod_s31.py").write_text("def heldout(w):\n    import evalhelper_s31\n    return evalhelper_s31.X\n")
    (tmp_path / "evalhelper_s31.py").write_text("X = 1.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # (restored after)
    assert _import_eval("evalmod_s31:heldout")({}) == 1.5


def test_incremental_chain_in_ls_info_and_convert_full(tmp_path, capsys):
    torch.manual_seed(0)
    w = torch.randn(100_000)
    m = ckptzip.CheckpointManager(tmp_path / "run", incremental=True, full_every=4, keep_last=None)
    for step in (1, 2):
        w += 1e-4 * torch.randn_like(w)
        m.save(step, {"w": w.clone()})
    capsys.readouterr()
    assert cli("ls", tmp_path / "run", "--json") == 0
    ent = {e["step"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert ent[1]["base"] is None and ent[2]["base"] == 1
    assert cli("info", m.path(2)) == 0 and "incremental" in capsys.readouterr().out
    out = tmp_path / "full.ckz"
    assert cli("convert", m.path(2), out, "--full", "-q") == 0
    with ckptzip.open(out) as r:
        assert r.base is None
    assert torch.equal(ckptzip.load(out)["w"], w)


def test_directories_that_are_not_ckptzip_checkpoints_are_named(tmp_path, capsys):
    """info / verify / consolidate on a directory say what it is instead: torch's own DCP format
    (never unpickled), a CheckpointManager directory, an interrupted ckptzip save, missing."""
    import torch.distributed.checkpoint as dcp
    dcp.save({"a": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchdcp")))
    (tmp_path / "mgr" / "step-000000001").mkdir(parents=True)
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / ".__0_0.ckz.x.tmp").write_bytes(b"")
    cases = {"torchdcp": "torch.distributed.checkpoint's own writer", "mgr": "CheckpointManager directory",
             "part": "still running or was interrupted", "nope": "No such"}
    for name, words in cases.items():
        for cmd in (("info", tmp_path / name), ("verify", tmp_path / name),
                    ("consolidate", tmp_path / name, tmp_path / "o.ckz")):
            assert cli(*cmd) == 1, cmd
            err = capsys.readouterr()
            msg = err.err or err.out
            assert words in msg, (cmd, msg)
            assert msg.count("Error:") <= 1, msg  # the error's name once


def test_not_a_checkpoint_on_an_fsspec_url():
    """The same naming for a URL directory (it lists through fsspec)."""
    import fsspec
    from ckptzip.dcp import not_a_checkpoint
    fs = fsspec.filesystem("memory")
    fs.pipe("/nac/torchdcp/.metadata", b"pickle")
    assert "own writer" in str(not_a_checkpoint("memory://nac/torchdcp"))
