import collections
import os
import struct

import numpy as np
import pytest
import torch

from hypothesis import settings

from ckptzip import format as fmt

# CI runs must be reproducible: same examples every run (HYPOTHESIS_PROFILE=explore for random ones)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def cuda_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from ckptzip.codecs.gpu import gpu_available
    return gpu_available()


@pytest.fixture(autouse=True, scope="session")
def _triton_ready():
    """GPU tests exercise the Triton kernels, not the torch path a process uses while they compile."""
    if cuda_ok():
        from ckptzip.kernels import triton_kernels
        triton_kernels(wait=True)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU with nvCOMP")
    if not cuda_ok():
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


def chunks_of(data: torch.Tensor, chunk: int):
    offs = list(range(0, data.numel(), chunk))
    return offs, [min(chunk, data.numel() - o) for o in offs]


def sample_data(n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n // 4, generator=g)
    return torch.cat([x.view(torch.uint8), torch.zeros(n - x.numel() * 4, dtype=torch.uint8)])


def same_bits(a, b) -> bool:
    """Bit-exact tensor (or ndarray) comparison: NaN payloads and -0.0 count."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if ac.numel() == 0:
        return True
    return bytes(ac.view(-1).view(torch.uint8).numpy()) == bytes(bc.view(-1).view(torch.uint8).numpy()) \
        if ac.dtype != torch.bool else torch.equal(ac, bc)


def assert_same(a, b, path="root"):
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), \
        f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert same_bits(a, b), path
        if isinstance(a, torch.Tensor):
            assert a.stride() == b.stride() or a.numel() <= 1, f"{path}: stride"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


def check_rotate16_paths(bp, x: torch.Tensor, want: torch.Tensor) -> None:
    """``byteplane`` ``rotate`` 16 (``bp``) on words ``x`` (flat uint8, any device): the torch
    path writes ``want`` (the expected planes), and the default and torch decodes restore ``x``."""
    from ckptzip.transforms.byteplane import _post16
    planes = want.to(x.device)
    t = torch.empty_like(x)
    bp._torch_encode(x, t)  # (the torch path turns the words itself, piece by piece)
    assert torch.equal(t, planes)
    back = torch.empty_like(x)
    bp.decode(planes, back)
    assert torch.equal(back, x)
    back_t = torch.empty_like(x)
    bp._torch_decode(planes, back_t)
    _post16(back_t)
    assert torch.equal(back_t, x)


def read_parts(path):
    """(header+data bytes, manifest doc, rows) of a .ckz file."""
    raw = open(path, "rb").read()
    off, length, digest = fmt.parse_footer(raw[-fmt.FOOTER_SIZE:], len(raw))
    man = fmt.parse_manifest(raw[off:off + length], digest, off)
    return raw[:off], man.doc, man.rows.copy()


def write_parts(path, data: bytes, doc, rows):
    """Write a file with a valid manifest checksum and footer around a (possibly lying) manifest."""
    manifest = fmt.pack_manifest(doc, rows)
    with open(path, "wb") as f:
        f.write(data + manifest + fmt.pack_footer(len(data), manifest))


def check_newer_minor(tmp_path, data: bytes, doc, rows, corrupt_match: str) -> None:
    """An edited document is an UnsupportedVersionError naming both versions at a newer minor,
    and a CorruptFileError (matching ``corrupt_match``) at this reader's own."""
    import ckptzip
    for minor, err in ((fmt.VERSION[1] + 1, ckptzip.UnsupportedVersionError), (fmt.VERSION[1], ckptzip.CorruptFileError)):
        doc["version"] = [1, minor]
        q = tmp_path / f"m{minor}.ckz"
        write_parts(q, data, doc, rows)
        with pytest.raises(err, match=f"1.{fmt.VERSION[1] + 1} is newer" if minor > fmt.VERSION[1] else corrupt_match):
            ckptzip.open(q)


@pytest.fixture
def no_pack(monkeypatch):
    """Saves that store every storage on its own (no packs, format 1.5): for tests of what
    happens to a small storage itself (its transform, chunks, references), which packing would
    otherwise take over."""
    from ckptzip import pipeline
    monkeypatch.setattr(pipeline, "PACK_MAX", 0)


@pytest.fixture
def small_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(m.parameters())
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 64)).sum().backward()
        opt.step()
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 3}


class FusedSpy:
    """A stand-in for ``native.lib`` that shows every ``planes_fused`` piece to ``see(src, *args)``
    (the call's arguments; ``args[9]``, the checksums, is None where the call does not verify)
    before the real call, whether the piece comes alone or in a ``planes_fused_many`` queue
    (each queue's pieces once, whichever thread calls first)."""

    def __init__(self, lib, see):
        self._lib, self._see, self._queues = lib, see, set()

    def __getattr__(self, k):
        f = getattr(self._lib, k)
        if k == "planes_fused":
            def pf(src, *args):
                self._see(src, *args, *(() if len(args) > 9 else (None,)))
                return f(src, *args)
            return pf
        if k == "planes_fused_many":
            def many(src, items, order, counter):
                if id(counter) not in self._queues:
                    self._queues.add(id(counter))
                    for it in items:
                        self._see(src, *it[:10])  # (without a post step)
                return f(src, items, order, counter)
            return many
        return f


def nested(leaves, max_leaves: int):
    """A hypothesis strategy: trees of ``leaves`` in lists, tuples, dicts (str and int keys) and
    OrderedDicts."""
    from hypothesis import strategies as st
    return st.recursive(
        leaves,
        lambda ch: st.one_of(
            st.lists(ch, max_size=4), st.lists(ch, max_size=4).map(tuple),
            st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-5, 1000)), ch, max_size=4),
            st.dictionaries(st.text(max_size=5), ch, max_size=3).map(collections.OrderedDict),
        ),
        max_leaves=max_leaves,
    )
