"""Conformance tests shared by every codec implementation (numcodecs/zarr style): each registered
(wire id, device) pair that can run here must round-trip, reject lies, never touch its input, and
decode what every other implementation of its wire id wrote."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip.codecs import get_codec, registered
from ckptzip.transforms import BytePlane
from conftest import cuda_ok

IMPLS = [(w, d) for w, devs in registered().items() for d in devs]


def usable(device):
    return device == "cpu" or cuda_ok()


def chunks_of(data: torch.Tensor, chunk: int):
    offs = list(range(0, data.numel(), chunk))
    return offs, [min(chunk, data.numel() - o) for o in offs]


def sample_data(n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n // 4, generator=g)
    return torch.cat([x.view(torch.uint8), torch.zeros(n - x.numel() * 4, dtype=torch.uint8)])


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


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.integers(0, 3000), block=st.integers(1, 700))
def test_byteplane_inverse(width, n, block):
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    bp = BytePlane(width, block)
    before = raw.clone()
    enc = bp.encode(raw)
    assert torch.equal(raw, before)
    assert sum(s for _, s in bp.segments(raw.numel())) == raw.numel()
    out = torch.empty_like(raw)
    bp.decode(enc, out)
    assert torch.equal(out, raw)


def test_byteplane_puts_exponent_in_one_plane():
    x = torch.randn(4096)
    enc = BytePlane(4, 4096).encode(x.view(torch.uint8))
    top = enc[3 * 4096:]
    assert torch.unique(top).numel() < 40  # exponents of N(0,1) samples: few distinct values
    # the sign moved to bit 0 of the lowest plane
    low = enc[:4096]
    assert torch.equal((low & 1).bool(), x < 0)


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.integers(0, 5000), block=st.integers(1, 900))
def test_byteplane_numpy_and_torch_paths_agree(width, n, block):
    """The CPU (numpy) and torch implementations write the same wire format (the Triton one is
    checked against the CPU one in the GPU tests)."""
    g = torch.Generator().manual_seed(n + block)
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    bp = BytePlane(width, block)
    a = bp.encode(raw)
    b = bp._torch_encode(raw, torch.empty_like(raw))
    assert torch.equal(a, b)
    x, y = torch.empty_like(raw), torch.empty_like(raw)
    bp.decode(a, x)
    bp._torch_decode(a, y)
    assert torch.equal(x, raw) and torch.equal(y, raw)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [{"data_type": "|u1"}, {"data_type": "<f2"}, {"data_type": "<f4"}, {"data_type": "|f1"},
                                 {"data_type": "<f4", "max_sub_chunk_count": 16}])
@pytest.mark.parametrize("wire", ["ans", "zstd"])
def test_c_api_and_binding_read_each_other(monkeypatch, wire, cfg):
    """ANS and Zstd go through nvCOMP's C API (ctypes); the Python binding (CKPTZIP_NVCOMP_CAPI=0)
    must read what it writes and the other way round, with deferred and immediate checks."""
    from ckptzip.codecs import _capi
    from ckptzip.codecs.gpu import SMALL_CHUNK
    cfg = cfg if wire == "ans" else {}
    data = sample_data(3_000_000).cuda()
    offs, sizes = chunks_of(data, 1 << 20)
    offs2, sizes2 = chunks_of(data[:SMALL_CHUNK * 3], SMALL_CHUNK // 2)  # a second, small-chunk call
    offs, sizes = offs + offs2, sizes + sizes2
    both = []
    for flag in ("1", "0"):
        monkeypatch.setenv("CKPTZIP_NVCOMP_CAPI", flag)
        c = get_codec({"id": wire, **cfg}, "cuda")
        assert (c._c is not None) == (flag == "1")
        both.append(c)
    for enc, dec in ((both[0], both[1]), (both[1], both[0]), (both[0], both[0])):
        dst, doffs, dsizes = enc.encode(data, offs, sizes)
        out = torch.zeros(sum(sizes), dtype=torch.uint8, device="cuda")
        outs = [sum(sizes[:i]) for i in range(len(sizes))]
        with _capi.deferred_checks():
            dec.decode(dst, doffs, dsizes, out, outs, sizes)
        assert torch.equal(out, torch.cat([data[o:o + n] for o, n in zip(offs, sizes)]))
        # a declared size that is wrong is an exception, deferred or not
        bad = list(sizes)
        bad[0] -= 16
        for deferred in (False, True):
            with pytest.raises(ckptzip.CodecError):
                if deferred:
                    with _capi.deferred_checks():
                        dec.decode(dst, doffs, dsizes, out, outs, bad)
                else:
                    dec.decode(dst, doffs, dsizes, out, outs, bad)


def test_c_api_options_layout():
    """The option structs handed to nvCOMP's C API by value: 64 bytes, fields where ans.h puts
    them (type, data_type as 4-byte enums, then max_sub_chunk_count), the rest zero. Runs
    without a GPU: nothing is loaded until a call."""
    import ctypes
    import struct
    from ckptzip.codecs import _capi
    comp, dec = _capi.ans_opts("<f4", 16)
    assert ctypes.sizeof(comp) == ctypes.sizeof(dec) == 64 and ctypes.alignment(comp) == 4
    raw = bytes(comp)
    assert struct.unpack_from("<iiB", raw) == (0, 11, 16) and not any(raw[9:])
    assert struct.unpack_from("<iI", bytes(dec)) == (0, 0xFF) and not any(bytes(dec)[8:])
    assert struct.unpack_from("<i", bytes(_capi.ans_opts("|u1")[0]), 4) == (1,)
    assert not any(bytes(_capi.zstd_opts()[0])) and not any(bytes(_capi.zstd_opts()[1]))
    with pytest.raises(ckptzip.CodecError):
        _capi.ans_opts("<f8")
    with _capi.deferred_checks():  # nothing pending: nothing to check, nesting is fine
        with _capi.deferred_checks():
            pass
    _capi.check_decodes()
