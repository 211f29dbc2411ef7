"""nvCOMP codec specifics: the C-API path and the binding read each other's bitstreams, and the
option structs passed to the C API have the layout nvCOMP expects (shared codec checks are in
test_conformance.py)."""
import pytest
import torch

import ckptzip
from ckptzip.codecs import get_codec
from conftest import chunks_of, sample_data


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
