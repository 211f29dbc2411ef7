"""Conformance tests shared by every implementation of the two extension points (numcodecs/zarr
style). Codecs: each registered (wire id, device) pair that can run here must round-trip, keep its
wire config through get_config -> get_codec, reject lies, never touch its input, and decode what
every other implementation of its wire id wrote. Transforms: each registered wire id must invert
on CPU (and CUDA where present), keep its config, never touch its input, and write the same bytes
on every device. A new codec or transform is covered by registering it (and, for a transform,
adding example configs to TRANSFORM_EXAMPLES)."""
import base64

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip.codecs import get_codec, registered
from ckptzip import transforms
from conftest import chunks_of, cuda_ok, sample_data

IMPLS = [(w, d) for w, devs in registered().items() for d in devs]


def usable(device):
    return device == "cpu" or cuda_ok()


@pytest.mark.parametrize("wire,device", IMPLS, ids=[f"{w}-{d}" for w, d in IMPLS])
def test_roundtrip_and_input_untouched(wire, device):
    if not usable(device):
        pytest.skip("needs a CUDA GPU with nvCOMP")
    c = get_codec(wire, device)
    data = sample_data().to(device)
    before = data.clone()
    offs, sizes = chunks_of(data, 8192)
    dst, doffs, dsizes = c.encode(data, offs, sizes)
    assert torch.equal(data, before)
    out = torch.zeros_like(data)
    c.decode(dst, doffs, dsizes, out, offs, sizes)
    assert torch.equal(out, data)
    assert c.get_config()["id"] == wire


@pytest.mark.parametrize("wire,device", IMPLS, ids=[f"{w}-{d}" for w, d in IMPLS])
def test_decode_rejects_wrong_declared_size(wire, device):
    if not usable(device) or wire == "raw":
        pytest.skip("n/a")
    c = get_codec(wire, device)
    data = sample_data(20_000).to(device)
    offs, sizes = chunks_of(data, 4096)
    dst, doffs, dsizes = c.encode(data, offs, sizes)
    out = torch.zeros(data.numel() * 2, dtype=torch.uint8, device=device)
    with pytest.raises(ckptzip.CodecError):
        c.decode(dst, doffs, dsizes, out, [o * 2 for o in offs], [s * 2 for s in sizes])


CROSS = [w for w, devs in registered().items() if len(devs) > 1]


@pytest.mark.gpu
@pytest.mark.parametrize("wire", CROSS)
def test_cross_device_bitstreams(wire):
    g, c = get_codec(wire, "cuda"), get_codec(wire, "cpu")
    data = sample_data(100_003)
    offs, sizes = chunks_of(data, 16384)
    for enc, dec in ((g, c), (c, g)):
        src = data.to(enc.device)
        dst, doffs, dsizes = enc.encode(src, offs, sizes)
        out = torch.zeros(data.numel(), dtype=torch.uint8, device=dec.device)
        dec.decode(dst.to(dec.device), doffs, dsizes, out, offs, sizes)
        assert torch.equal(out.cpu(), data)


@pytest.mark.parametrize("wire,device", IMPLS, ids=[f"{w}-{d}" for w, d in IMPLS])
def test_codec_config_round_trip(wire, device):
    if not usable(device):
        pytest.skip("needs a CUDA GPU with nvCOMP")
    c = get_codec(wire, device)
    again = get_codec(c.get_config(), device)
    assert again.get_config() == c.get_config() and type(again) is type(c)


#: example wire configs per registered transform id (a transform without examples fails below)
TRANSFORM_EXAMPLES = {
    "byteplane": [{"id": "byteplane", "width": w, "block": b} for w in (2, 4, 8) for b in (1, 7, 700)]
    + [{"id": "byteplane", "width": 4, "block": b, "rotate": 16} for b in (1, 700)],
    # format 1.1 reference transforms: bound to a random reference (float32 bytes with NaNs, -0.0,
    # infinities for derived) by test_transform_inverts_and_keeps_input
    "xor": [{"id": "xor", "ref": {"base": 0, "storage": s}} for s in (0, 3)],
    "delta": [{"id": "delta", "ref": {"base": 0, "storage": 2}, "width": w} for w in (2, 4, 8)],
    "hidelta": [{"id": "hidelta", "ref": {"base": 0, "storage": s}} for s in (0, 4)],
    "derived": [{"id": "derived", "ref": {"storage": 1}, "from": "float32", "to": to}
                for to in ("bfloat16", "float16")],
    "expref": [{"id": "expref", "ref": {"storage": s}} for s in (0, 5)],
    # expgrid fixes the storage size (rows x cols float32 words): random predictions of that shape
    "expgrid": [{"id": "expgrid", "rows": r, "cols": c,
                 "r": base64.b64encode(np.random.default_rng(r).integers(0, 65536, r, dtype="<u2").tobytes()).decode(),
                 "c": base64.b64encode(np.random.default_rng(c).integers(-32768, 32768, c, dtype="<i2").tobytes()).decode()}
                for r, c in ((1, 1), (3, 5), (64, 33), (7, 1000))],
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the GPU suite (-m gpu) runs the CUDA half


def test_every_transform_has_examples():
    assert set(transforms.registered()) <= set(TRANSFORM_EXAMPLES)


@pytest.mark.parametrize("cfg", [c for cs in TRANSFORM_EXAMPLES.values() for c in cs],
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_transform_config_round_trip(cfg):
    t = transforms.get_transform(cfg)
    assert t.get_config() == cfg
    with pytest.raises(ckptzip.UnknownCodecError):
        transforms.get_transform({**cfg, "bogus_option": 1})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", sorted(TRANSFORM_EXAMPLES))
@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), k=st.integers(0, 100))
def test_transform_inverts_and_keeps_input(wire, device, n, k):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    cfgs = TRANSFORM_EXAMPLES[wire]
    t = transforms.get_transform(cfgs[k % len(cfgs)])
    g = torch.Generator().manual_seed(n * 101 + k)
    size = getattr(t, "fixed_nbytes", n * 8)  # a transform of one storage size gets that size
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    if getattr(t, "needs_ref", False):
        ref = torch.randint(0, 256, (t.ref_nbytes(raw.numel()),), dtype=torch.uint8, generator=g)
        t = t.bind(ref.to(device))
    assert t.accepts(raw.numel())
    before = raw.clone()
    enc = t.encode(raw.to(device))
    assert torch.equal(raw, before) and enc.numel() == raw.numel()
    if device == "cuda":  # same wire format as the CPU implementation
        assert torch.equal(enc.cpu(), t.encode(raw))
    out = torch.empty_like(enc)
    t.decode(enc, out)
    assert torch.equal(out.cpu(), raw)


@pytest.mark.parametrize("planes,fast", [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("multi", [True, False])
def test_zstd_cpu_paths_bounded_and_standard(planes, fast, multi, monkeypatch):
    """The CPU zstd codec's paths (multi-buffer C threads, per-chunk Python, byte planes through
    the system's libzstd with FAST_PLANE_PARAMS) and parameter sets write standard frames with a
    content size that any zstd decoder reads, and refuse frames whose declared or decoded size
    differs from the chunk table's."""
    import zstandard
    from ckptzip.codecs import cpu
    monkeypatch.setattr(cpu, "FAST_PLANES", fast)
    if fast and not cpu._fast_planes():
        pytest.skip("no C extension or no system libzstd")
    if not multi:
        monkeypatch.setattr(cpu.ZstdCPU, "_multi", staticmethod(lambda sizes: 0))
    c = get_codec("zstd", "cpu", planes=planes)
    data = sample_data()
    offs, sizes = chunks_of(data, 8192)
    dst, doffs, dsizes = c.encode(data, offs, sizes)
    raw = dst.numpy().tobytes()
    for o, n, so, sn in zip(doffs, dsizes, offs, sizes):
        frame = raw[o:o + n]
        assert zstandard.frame_content_size(frame) == sn
        assert zstandard.ZstdDecompressor().decompress(frame) == data[so:so + sn].numpy().tobytes()
    out = torch.zeros_like(data)
    c.decode(dst, doffs, dsizes, out, offs, sizes)
    assert torch.equal(out, data)
    # a frame declaring another size than its row, and frames without a content size that
    # decode to more or fewer bytes than their row, are refused
    chunk = data[:sizes[0]].numpy().tobytes()
    cases = [(zstandard.ZstdCompressor().compress(chunk), sizes[0] - 1),
             (zstandard.ZstdCompressor(write_content_size=False).compress(chunk), sizes[0] - 1),
             (zstandard.ZstdCompressor(write_content_size=False).compress(chunk), sizes[0] + 1)]
    for frame, n in cases:
        src = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        with pytest.raises(ckptzip.CodecError):
            c.decode(src, [0], [len(frame)], torch.zeros(n, dtype=torch.uint8), [0], [n])


def test_python_path_and_c_extension_read_each_others_files(tmp_path):
    """Without the C extension (``CKPTZIP_NO_NATIVE=1``: a machine without a compiler), a CPU
    save of a mixed state (fp32 with Adam-like moments, bf16, ints, small storages) loads back
    bit-exact, a damaged chunk is a ChecksumError, and each path reads the other's file (both
    write standard zstd frames): run in a fresh process, as the choice is made at import."""
    import os
    import subprocess
    import sys
    from conftest import read_parts, same_bits, write_parts
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200_000, generator=g)
    state = {"w": w, "m": w * 1e-3 + torch.randn(200_000, generator=g) * 1e-5, "v": (w * 1e-3) ** 2 + 1e-9,
             "h": torch.randn(70_001, generator=g).bfloat16(), "i": torch.arange(5000), "step": torch.tensor(7.0),
             "b": torch.randn(33, generator=g)}
    ref = tmp_path / "ref.pt"
    torch.save(state, ref)
    native_file = tmp_path / "native.ckz"
    ckptzip.save(state, native_file, device="cpu")
    code = f"""
import sys, torch, ckptzip, io
from ckptzip import native
assert native.lib is None
state = torch.load({str(ref)!r}, weights_only=True)
def same(a, b):
    return all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
ckptzip.save(state, {str(tmp_path / 'python.ckz')!r}, device="cpu")
assert same(state, ckptzip.load({str(tmp_path / 'python.ckz')!r}))
assert same(state, ckptzip.load({str(native_file)!r}))
bad = open({str(tmp_path / 'bad.ckz')!r}, 'rb').read()
try:
    ckptzip.load(io.BytesIO(bad))
except ckptzip.ChecksumError:
    print("ok")
"""
    data, doc, rows = read_parts(native_file)
    k = int(np.argmax(rows["stored"]))
    off = int(rows[k]["offset"]) + 9
    write_parts(tmp_path / "bad.ckz", data[:off] + bytes([data[off] ^ 0x21]) + data[off + 1:], doc, rows)
    env = {**os.environ, "CKPTZIP_NO_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    got = ckptzip.load(tmp_path / "python.ckz")
    assert all(same_bits(got[k], state[k]) for k in state)
