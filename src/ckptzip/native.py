"""The optional C extension, ``ckptzip._bpnative`` (the CPU byteplane transform in one pass, and
segment copies without the GIL). setup.py builds it wherever a C compiler is; without it (or with
``CKPTZIP_NO_NATIVE=1``) the CPU path runs its numpy version of the same steps, which writes and
reads the same bytes, more slowly (docs/benchmarks.md, CPU section). (The one exception: the
planner's sampled plane entropies are summed in another order, so a plane whose entropy lies
within about 1e-13 of the raw-plane threshold could be chosen differently; either choice is a
valid file.)

:data:`lib` is the extension module or None; callers read it at call time. A build made from
another version of ``_bpnative.c`` (an old in-place build left in a checkout) is not used."""
from __future__ import annotations

import os

#: the ``API`` constant of the ``_bpnative.c`` this code calls
API = 18

try:
    if os.environ.get("CKPTZIP_NO_NATIVE") == "1":
        raise ImportError("CKPTZIP_NO_NATIVE=1")
    from . import _bpnative as lib
    if getattr(lib, "API", None) != API:
        lib = None
except ImportError:
    lib = None


def _load_xxh3() -> bool:
    """Whether ``lib`` computes chunk checksums in C (``xxh3_many``, ``planes_fused``'s ``xxh3``):
    XXH3-64 is taken from the xxhash package's extension and must agree with xxhash's own API on
    inputs of every length class XXH3 treats apart (0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes,
    longer ones across stripes and blocks), at odd offsets."""
    if lib is None:
        return False
    try:
        import numpy as np
        import xxhash
        from xxhash import _xxhash
        if not lib.xxh3_load(_xxhash.__file__):
            return False
        data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
        lens = np.array([0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1000, 1024, 1025, 4096,
                         65000], dtype=np.int64)
        offs = np.arange(len(lens), dtype=np.int64) * 7 + 1
        got = np.zeros(len(lens), dtype=np.uint64)
        lib.xxh3_many(data, offs, lens, got)
        mv = memoryview(data)
        return got.tolist() == [xxhash.xxh3_64_intdigest(mv[o:o + n]) for o, n in zip(offs.tolist(), lens.tolist())]
    except Exception:  # (an xxhash without the C API exported: checksums stay in Python)
        return False


#: ``lib`` verifies checksums itself (see :func:`_load_xxh3`)
XXH3 = _load_xxh3()
