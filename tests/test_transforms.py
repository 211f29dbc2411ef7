"""The byteplane transform's own properties (its conformance is in test_conformance.py)."""
import os
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptzip.transforms import BytePlane


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
    import ckptzip.transforms.byteplane as bpm
    from ckptzip import native
    piece, bpm._TORCH_PIECE = bpm._TORCH_PIECE, 3 * block * width + 1  # pieces of 3 whole blocks
    try:
        assert torch.equal(bp._torch_encode(raw, torch.empty_like(raw)), a)
    finally:
        bpm._TORCH_PIECE = piece
    x, y = torch.empty_like(raw), torch.empty_like(raw)
    bp.decode(a, x)
    bp._torch_decode(a, y)
    assert torch.equal(x, raw) and torch.equal(y, raw)


def test_native_extension_is_built():
    """setup.py builds ckptzip._bpnative wherever a C compiler is (CI has one): a failed build
    must not pass unnoticed as the slower numpy path."""
    import os
    import ckptzip.transforms.byteplane as bpm
    from ckptzip import native
    if os.environ.get("CKPTZIP_NO_NATIVE") == "1":
        return
    assert native.lib is not None


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([2, 4, 8]), n=st.integers(0, 5000), block=st.integers(1, 900),
       cut=st.floats(0, 1), fold=st.sampled_from(["xor", "delta"]), inplace=st.booleans(),
       skew=st.integers(0, 7))
def test_byteplane_native_and_numpy_paths_agree(width, n, block, cut, fold, inplace, skew):
    """The C version (ckptzip._bpnative) writes and reads the numpy version's bytes, over any
    split of the words between threads, on buffers of any alignment (``skew``), and undoes
    xor / delta against a reference as the numpy pass does (also in place)."""
    import numpy as np
    import ckptzip.transforms.byteplane as bpm
    from ckptzip import native
    if native.lib is None:
        return  # (test_native_extension_is_built says why)
    C = native.lib
    rng = np.random.default_rng(n * 7 + block)

    def buf(a=None):  # a buffer starting ``skew`` bytes into an allocation (unaligned words)
        b = np.zeros(n * width + skew, np.uint8)[skew:]
        if a is not None:
            b[:] = a
        return b
    x = buf(rng.integers(0, 256, n * width, dtype=np.uint8))
    want = np.empty_like(x)
    bpm._numpy_encode(x, want, width, block)
    got = buf()
    k = int(cut * n)
    C.encode(x, got, width, block, 0, k)
    C.encode(x, got, width, block, k, n)
    assert (got == want).all()
    back = buf()
    C.decode(want, back, width, block, k, n)
    C.decode(want, back, width, block, 0, k)
    assert (back == x).all()
    ref = buf(rng.integers(0, 256, n * width, dtype=np.uint8))
    w1 = np.empty_like(x)
    native.lib = None
    try:
        bpm.np_decode_onto(want, w1, ref, width, block, fold)
    finally:
        native.lib = C
    w2 = buf(ref) if inplace else buf()
    C.decode_onto(want, w2, w2 if inplace else ref, width, block, 1 if fold == "xor" else 2, 0, n)
    assert (w1 == w2).all()


def test_native_refuses_bad_calls():
    """Sizes, widths, word ranges and overlaps are checked in C: a wrong call is a Python
    exception, never a stray write."""
    import numpy as np
    import pytest
    import ckptzip.transforms.byteplane as bpm
    from ckptzip import native
    if native.lib is None:
        return
    C, z = native.lib, np.zeros(64, np.uint8)
    for call in (lambda: C.encode(z, np.zeros(64, np.uint8), 3, 4, 0, 1),
                 lambda: C.encode(z, np.zeros(60, np.uint8), 4, 4, 0, 1),
                 lambda: C.decode(z, np.zeros(64, np.uint8), 4, 4, 0, 17),
                 lambda: C.decode(z, np.zeros(64, np.uint8), 4, 4, -1, 2),
                 lambda: C.decode(z, np.zeros(64, np.uint8), 4, 0, 0, 2),
                 lambda: C.encode(z, z, 4, 4, 0, 2),
                 lambda: C.encode(z[:32], z[16:48], 4, 4, 0, 2),
                 lambda: C.decode_onto(z[:32], np.zeros(32, np.uint8), z[:32], 4, 4, 1, 0, 2),
                 lambda: C.decode_onto(z[:32], np.zeros(32, np.uint8), np.zeros(32, np.uint8), 4, 4, 3, 0, 2),
                 # a reference that partly overlaps the destination (the result would depend on
                 # the thread split)
                 lambda: (lambda b: C.decode_onto(z[:32], b[:32], b[4:36], 4, 4, 1, 0, 8))(np.zeros(64, np.uint8)),
                 # expgrid: word indices past the grid, also where rows x cols or w0 + n overflow
                 lambda: C.exp_grid(z[:16], np.zeros(16, np.uint8), np.zeros(2, np.int32), np.zeros(2, np.int32), 1, 1),
                 lambda: C.exp_grid(z[:16], np.zeros(16, np.uint8), np.zeros(1, np.int32), np.zeros(3, np.int32),
                                    2**63 - 1, 1),
                 lambda: C.exp_ref(z[:16], np.zeros(16, np.uint8), z[:12], 1),
                 lambda: C.plane_entropy(z, np.zeros(4), 4, np.array([2**62], np.int64), 1)):
        with pytest.raises(ValueError):
            call()
    ro = np.zeros(64, np.uint8)
    ro.setflags(write=False)
    with pytest.raises(TypeError):  # the destination must be writable
        C.decode(z, ro, 4, 4, 0, 2)


def test_native_copy_segments():
    """The CPU groups' raw-chunk copies in C: the Python loop's result; a segment outside either
    buffer is refused before anything is copied."""
    import numpy as np
    import pytest
    from ckptzip import native
    from ckptzip.engine import decode
    if native.lib is None:
        return
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    lens = rng.integers(0, 300, 50).astype(np.int64)
    soffs = rng.integers(0, (1 << 16) - 300, 50).astype(np.int64)
    doffs = np.cumsum(lens + 3) - lens - 3  # disjoint destinations, some adjacent after merging
    want = np.zeros(int(doffs[-1] + lens[-1]) + 8, np.uint8)
    for s, d, n in zip(soffs, doffs, lens):
        want[d:d + n] = src[s:s + n]
    from ckptzip.codecs import cpu as ccpu
    for parallel in (ccpu.PARALLEL_BYTES, 0):  # one call, and split between threads
        got = np.zeros_like(want)
        saved, ccpu.PARALLEL_BYTES = ccpu.PARALLEL_BYTES, parallel
        try:
            decode._np_copy_segments(src, soffs, got, doffs, lens)
        finally:
            ccpu.PARALLEL_BYTES = saved
        assert (got == want).all()
    # adjacent chunks merge into one long run, which is cut into per-thread shares
    lens2 = np.full(40, 1000, np.int64)
    so2 = 7 + np.arange(40, dtype=np.int64) * 1000
    do2 = 3 + np.arange(40, dtype=np.int64) * 1000
    want2 = np.zeros(40_010, np.uint8)
    want2[3:40_003] = src[7:40_007]
    for threads in (1, 3):
        got2 = np.zeros_like(want2)
        saved = ccpu.PARALLEL_BYTES, decode.cpu_threads
        ccpu.PARALLEL_BYTES, decode.cpu_threads = 0, (lambda: threads)
        try:
            decode._np_copy_segments(src, so2, got2, do2, lens2)
        finally:
            ccpu.PARALLEL_BYTES, decode.cpu_threads = saved
        assert (got2 == want2).all(), threads
    before = got.copy()
    with pytest.raises(ValueError):
        native.lib.copy_segments(src, got, np.array([0, 1 << 16], np.int64), np.array([0, 0], np.int64),
                                 np.array([4, 1], np.int64))
    assert (got == before).all()
    with pytest.raises(ValueError):
        native.lib.copy_segments(src, got, np.array([0], np.int64), np.array([len(got) - 2], np.int64),
                                 np.array([4], np.int64))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 70), a=st.floats(0, 1), b=st.floats(0, 1),
       sign=st.sampled_from([1, -1]), seed=st.integers(0, 99))
def test_native_exponent_predictors_match_numpy(rows, cols, a, b, sign, seed):
    """expgrid's and expref's CPU passes in C give the numpy passes' words, on any run of words
    of the grid (a window starting mid-row), both directions."""
    import numpy as np
    import torch as T
    from ckptzip import native
    from ckptzip.transforms.refs import ExpGrid, ExpRef
    if native.lib is None:
        return
    rng = np.random.default_rng(seed)
    n = rows * cols
    lo, hi = sorted((int(a * n), int(b * n)))
    x = T.from_numpy(rng.integers(0, 2**32, n, dtype=np.uint32).view(np.int32).copy()).view(T.uint8)
    grid = ExpGrid(rows, cols, rng.integers(0, 2**16, rows).astype(np.uint16),
                   rng.integers(0, 2**16, cols).astype(np.uint16))
    ref = T.from_numpy(rng.integers(0, 2**32, n, dtype=np.uint32).view(np.int32).copy()).view(T.uint8)
    er = ExpRef(0).bind(ref)
    for t in (grid, er):
        src = x[4 * lo:4 * hi]
        outs = []
        for lib in (native.lib, None):
            saved, native.lib = native.lib, lib
            try:
                o = T.empty_like(src)
                t._apply(src, o, 4 * lo, sign)
                outs.append(o)
            finally:
                native.lib = saved
        assert T.equal(outs[0], outs[1]), type(t).__name__


def test_native_plane_entropies_match_numpy():
    """The CPU planner's sampled plane entropies: the same raw planes with and without C."""
    import numpy as np
    import torch as T
    from ckptzip import native
    from ckptzip.engine import planner
    if native.lib is None:
        return
    rng = np.random.default_rng(3)
    for dt in (T.float32, T.bfloat16, T.float64):
        for data in (T.randn(50_000).to(dt), T.zeros(50_000, dtype=dt), (T.randn(60_000) * 1e-3).to(dt)):
            flat = data.view(T.uint8)
            got = planner.cpu_raw_planes(flat, data.element_size())
            saved, native.lib = native.lib, None
            try:
                want = planner.cpu_raw_planes(flat, data.element_size())
            finally:
                native.lib = saved
            assert got == want, (dt, got, want)
    bits = np.zeros(4, np.float64)
    import pytest
    with pytest.raises(ValueError):
        native.lib.plane_entropy(np.zeros(64, np.uint8), bits, 4, np.array([10], np.int64), 8)
    native.lib.plane_entropy(np.arange(64, dtype=np.uint8), bits, 4, np.array([0, 8], np.int64), 8)
    assert bits[0] == 4.0  # 16 distinct low bytes (rotated), equally often
    _ = rng


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=12), piece=st.sampled_from([4096, 1 << 20, 4 << 20]),
       threads=st.integers(1, 9))
def test_native_pread_ranges(tmp_path_factory, sizes, piece, threads):
    """Ranges read by threads in C (``pread_ranges``, any piece size and thread count) land
    where the Python reads put them; gaps in the buffer stay untouched."""
    import numpy as np
    from ckptzip import native, storage
    if native.lib is None:
        return
    p = tmp_path_factory.mktemp("pr") / "f.bin"
    data = np.random.default_rng(len(sizes)).integers(0, 256, sum(sizes) + 100, dtype=np.uint8)
    p.write_bytes(data.tobytes())
    fo = np.cumsum([0] + sizes[:-1]) + 7
    bo = np.cumsum([0] + [s + 3 for s in sizes[:-1]])
    buf = np.full(int(bo[-1] + sizes[-1] + 5), 0xAA, np.uint8)
    want = buf.copy()
    for f, b, n in zip(fo, bo, sizes):
        want[b:b + n] = data[f:f + n]
    saved = storage.NATIVE_PIECE, storage.READ_THREADS
    storage.NATIVE_PIECE, storage.READ_THREADS = piece, threads
    fd = os.open(p, os.O_RDONLY)
    try:
        storage.pread_ranges(fd, buf, fo, bo, sizes)
    finally:
        os.close(fd)
        storage.NATIVE_PIECE, storage.READ_THREADS = saved
    assert (buf == want).all()


def test_native_pread_many_refuses_and_reports(tmp_path):
    """A range past the file's end is where the file ended (TruncatedFileError from
    pread_ranges); a range outside the buffer is refused before any read; a bad descriptor is
    an OSError."""
    import numpy as np
    import pytest
    import ckptzip
    from ckptzip import native, storage
    if native.lib is None:
        return
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.zeros(1 << 16, np.uint8)
        a = lambda *v: np.asarray(v, np.int64)  # noqa: E731
        assert native.lib.pread_many(fd, buf, a(0, 8192), a(0, 8192), a(8192, 8192), 4) is None
        assert native.lib.pread_many(fd, buf, a(0, 12000), a(0, 20000), a(100, 8192), 3) == 16384
        with pytest.raises(ckptzip.TruncatedFileError):
            storage.pread_ranges(fd, buf, [10000], [0], [10000])
        for bad in ((a(0), a(1 << 16), a(1)), (a(-1), a(0), a(1)), (a(0), a(0), a(-1)), (a(0), a(0, 1), a(1))):
            with pytest.raises(ValueError):
                native.lib.pread_many(fd, buf, *bad, 2)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.lib.pread_many(fd, buf, a(0), a(0), a(10), 2)  # closed descriptor


def test_plane_entropy_many_equals_the_planner_estimate_per_storage():
    """``plane_entropy_many`` (a save's estimates in one call, without the GIL) gives for every
    buffer the entropies ``cpu_raw_planes`` computes one storage at a time, -1 for buffers of
    fewer than 4 runs, and refuses bad widths and output sizes."""
    import numpy as np
    import pytest
    from ckptzip import native
    from ckptzip.engine import planner as P
    if native.lib is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(9)
    run = P.CPU_ENTROPY_RUN
    bufs = [(rng.standard_normal(4 * run + 17) * 1e-2).astype(np.float32).view(np.uint8),
            (rng.standard_normal(9 * run)).astype(np.float16).view(np.uint8),
            rng.integers(0, 256, 8 * (5 * run + 3), dtype=np.uint8),
            np.zeros(4 * (4 * run - 1), np.uint8)]
    widths = np.array([4, 2, 8, 4], np.int64)
    bits = np.zeros((4, 8))
    native.lib.plane_entropy_many(bufs, widths, bits, run)
    for b, w, got in zip(bufs, widths.tolist(), bits):
        n = len(b) // w
        if n < 4 * run:
            assert (got == -1).all()
            continue
        want = np.empty(w)
        native.lib.plane_entropy(b, want, w, np.asarray([i * (n - run) // 3 for i in range(4)], np.int64), run)
        assert np.array_equal(got[:w], want) and (got[w:] == -1).all()
        assert P.cpu_raw_planes(torch.from_numpy(b), w) == frozenset(int(p) for p in np.nonzero(got[:w] > 8 * P.CPU_RAW_ENTROPY)[0])
    # widths in the output's own memory: the checked copy is used, not what the call overwrites
    shared = np.zeros(32, np.float64)
    ws = shared[8:11].view(np.int64)
    ws[:] = 4
    native.lib.plane_entropy_many([np.zeros(16, np.uint8)] * 3, ws, shared[:24], 1)
    assert (shared[:24].reshape(3, 8)[:, :4] == 0).all()
    for bad in ((bufs, np.array([4, 2, 3, 4], np.int64), bits, run), (bufs, widths, np.zeros((4, 7)), run),
                (bufs, widths, bits, 0), ([1, 2, 3, 4], widths, bits, run)):
        with pytest.raises((ValueError, TypeError)):
            native.lib.plane_entropy_many(*bad)


def test_top_entropy_is_plane_entropys_top_plane():
    """``top_entropy`` (the exponent predictors' choice) counts the top plane alone: the same
    value as ``plane_entropy``'s plane 3 over the same words, 0 for no words."""
    import numpy as np
    import pytest
    from ckptzip import native
    if native.lib is None:
        pytest.skip("the C extension is not built")
    rng = np.random.default_rng(11)
    for words in (rng.integers(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32),
                  (rng.standard_normal(16384) * 1e-3).astype(np.float32).view(np.uint32),
                  np.full(7, 0x7F800000, np.uint32), np.zeros(1, np.uint32)):
        h = np.empty(4)
        native.lib.plane_entropy(words.view(np.uint8), h, 4, np.zeros(1, np.int64), words.size)
        assert abs(native.lib.top_entropy(words.view(np.uint8)) - h[3]) < 1e-12
    assert native.lib.top_entropy(np.zeros(3, np.uint8)) == 0.0
