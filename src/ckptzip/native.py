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
API = 12

try:
    if os.environ.get("CKPTZIP_NO_NATIVE") == "1":
        raise ImportError("CKPTZIP_NO_NATIVE=1")
    from . import _bpnative as lib
    if getattr(lib, "API", None) != API:
        lib = None
except ImportError:
    lib = None
