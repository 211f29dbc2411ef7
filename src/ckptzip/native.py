"""The optional C extension, ``ckptzip._bpnative`` (the CPU byteplane transform in one pass, and
segment copies without the GIL). setup.py builds it wherever a C compiler is; without it (or with
``CKPTZIP_NO_NATIVE=1``) the CPU path runs its numpy version of the same steps, which writes and
reads the same bytes, more slowly (docs/benchmarks.md, CPU section).

:data:`lib` is the extension module or None; callers read it at call time."""
from __future__ import annotations

import os

try:
    if os.environ.get("CKPTZIP_NO_NATIVE") == "1":
        raise ImportError("CKPTZIP_NO_NATIVE=1")
    from . import _bpnative as lib
except ImportError:
    lib = None
