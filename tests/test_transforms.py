"""The byteplane transform's own properties (its conformance is in test_conformance.py)."""
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
    piece, bpm._TORCH_PIECE = bpm._TORCH_PIECE, 3 * block * width + 1  # pieces of 3 whole blocks
    try:
        assert torch.equal(bp._torch_encode(raw, torch.empty_like(raw)), a)
    finally:
        bpm._TORCH_PIECE = piece
    x, y = torch.empty_like(raw), torch.empty_like(raw)
    bp.decode(a, x)
    bp._torch_decode(a, y)
    assert torch.equal(x, raw) and torch.equal(y, raw)
