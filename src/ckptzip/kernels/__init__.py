"""GPU kernels (Triton) shared by the transforms and the engine's segment copies.

:func:`triton_kernels` returns the kernel module, or None where Triton cannot run (no CUDA, no
Triton, or ``CKPTZIP_NO_TRITON=1``) or is not ready yet; every caller then uses its torch /
numpy path, which produces the same bytes.

Compiling the kernels takes seconds in a fresh process with an empty Triton cache (measured on
an H100: a first save of the 1.2 GB benchmark state took 4.5 s with them, 1.2 s with the torch
path; torch.save 1.7 s). So the first call starts compiling them in a background thread, on tiny
inputs of every specialization ckptzip launches, and returns None until that is done: the first
save of a process runs on the torch path, later ones on the kernels. ``wait=True`` blocks until
they are ready (tests, benchmarks); ``CKPTZIP_TRITON_WARMUP=0`` compiles on first use instead.
The fused reference kernels of incremental saves and loads (``encode_ref`` / ``decode_ref``, and
the multi-segment kernels, with ``xor`` / ``delta``) are not in the warm-up: they compile on
their first use (the first incremental save or load of a process), so that the warm-up of every
other process stays as short as it was; the modes of every default save (planes, ``expref``,
``expgrid``, ``derived``) are.
"""
from __future__ import annotations

import os
import threading

#: what a byteplane kernel does besides the planes (its MODE, a constexpr: each compiles to its
#: own kernel): nothing, ``xor`` against a reference, ``delta``'s sign-folded difference, or
#: ``expref``'s exponent prediction from a float32 reference (32-bit words only), or (multi-segment
#: kernels only) ``derived``'s bfloat16 rounding of a float32 reference and ``expgrid``'s row +
#: column exponent prediction; ``hidelta``'s difference of the top halves (format 1.3, 32-bit
#: words); (multi-segment decode only) planes 0, 2 and 3 of 32-bit words into bits 15..31;
#: planes alone with ``byteplane``'s ``rotate`` 16 (32-bit words); (multi-segment decode only)
#: planes 2 and 3 of such words into their top halves
PLAIN, XOR, DELTA, EXPREF, DERIVED, EXPGRID, HIDELTA, PARTIAL, PLAIN16, PARTIAL16 = range(10)
#: saves: storages (windows) from this many bytes on go to the one-storage kernels where one
#: exists (byte planes, alone or after xor / delta / expref): their aligned, vectorized accesses
#: run faster than the multi-segment kernel's (measured on an H100: fp32 delta compress 124 GB/s
#: through the multi-segment kernel, 152 through the fused one); smaller ones share one launch.
#: Loads put every storage in the multi-segment launches: decoding ran as fast either way, and
#: each extra launch gives up the GIL, which the load's reader threads then hold
MULTI_MAX = 4 << 20
#: chunks of at least this many bytes are hashed on the GPU (XXH3-64's long-input path; shorter
#: inputs use other formulas: the reader verifies those on the host)
HASH_MIN = 241

_MOD: object = False  # False: not tried; None: unavailable; else the module
_OFF: set[str] = set()  # kernel families that failed to compile in this process (see launch)
_READY = threading.Event()
_READY16 = threading.Event()  # the rotate-16 kernels too (see rot16_ready)
_STOP = threading.Event()  # set at interpreter exit: the warm-up stops after the kernel it compiles
_LOCK = threading.Lock()
_STARTED = False


def _load():
    global _MOD
    if _MOD is False:
        try:
            if os.environ.get("CKPTZIP_NO_TRITON") == "1":
                raise ImportError
            from . import _triton_bp
            _MOD = _triton_bp
        except Exception:
            _MOD = None
    return _MOD


def _warm(device: int) -> None:
    """Compile every kernel specialization ckptzip launches, on tiny inputs, on a side stream."""
    global _MOD
    try:
        import numpy as np
        import torch
        mod = _load()
        if mod is None:
            return
        with torch.cuda.device(device):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for width in (2, 4, 8):
                    for n in (4096, 4100):  # word counts divisible by 16, and not
                        for block in (1 << 20, 4099):
                            if _STOP.is_set():
                                return
                            x = torch.zeros(n * width, dtype=torch.uint8, device="cuda")
                            y = mod.encode(x, width, block)
                            mod.decode(y, torch.empty_like(x), width, block)
                            if width == 4:  # expref (Adam's m against v) is in every default save
                                mod.encode_ref(x, x, y, width, block, EXPREF)
                                mod.decode_ref(y, x, torch.empty_like(x), width, block, EXPREF)
                z = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
                one = np.array([[0], [32768], [16384], [512], [256], [24576], [16], [0]], dtype=np.int64)
                for width, mode, planes in ((2, PLAIN, True), (4, PLAIN, True), (8, PLAIN, True), (4, EXPREF, True),
                                            (4, EXPREF, False), (2, DERIVED, False), (2, DERIVED, True),
                                            (4, EXPGRID, True), (4, EXPGRID, False)):
                    # (saves and loads: one launch per kind of chain)
                    if _STOP.is_set():
                        return
                    mod.encode_multi(z, *one, width, mode, planes)
                    mod.decode_multi(z, *one, width, mode, planes)
                a = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
                offs = np.array([0, 64], dtype=np.int64)
                lens = np.array([32, 17], dtype=np.int64)
                mod.copy_segments(a, offs, a[1 << 15:], offs, lens, (lens + 15) // 16 * 16)
                mod.copy_segments(a, offs + 1, a[(1 << 15) + 1:], offs, lens)
                mod.xxh3_chunks(a, np.array([0, 2048]), np.array([300, 1500]))  # loads' chunk checksums
            s.synchronize()
    except Exception:  # a kernel that fails to compile: every caller keeps the torch path
        _MOD = None
    finally:
        _READY.set()
    _warm16(device)


def _warm16(device: int) -> None:
    """After the rest (so that no save waits longer for the kernels): ``byteplane``'s ``rotate`` 16
    (format 1.3, float32 storages of GPU saves; see :func:`rot16_ready`)."""
    try:
        import numpy as np
        import torch
        mod = _MOD
        if not mod:
            return
        with torch.cuda.device(device):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for n in (4096, 4100):
                    for block in (1 << 20, 4099):
                        if _STOP.is_set():
                            return
                        x = torch.zeros(n * 4, dtype=torch.uint8, device="cuda")
                        y = mod.encode(x, 4, block, rot16=True)
                        mod.decode(y, torch.empty_like(x), 4, block, rot16=True)
                z = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
                one = np.array([[0], [32768], [16384], [512], [256], [24576], [16], [0]], dtype=np.int64)
                mod.encode_multi(z, *one, 4, PLAIN16, True)
                mod.decode_multi(z, *one, 4, PLAIN16, True)
            s.synchronize()
        _READY16.set()
    except Exception:
        pass  # saves keep the whole-word rotation


def rot16_ready() -> bool:
    """Whether GPU saves may write ``byteplane`` ``rotate`` 16: its kernels are compiled (the
    warm-up does them last), or compile on first use (``CKPTZIP_TRITON_WARMUP=0``)."""
    return _READY16.is_set() or (os.environ.get("CKPTZIP_TRITON_WARMUP") == "0" and bool(_load()))


def wait_kernels(timeout: float | None = None):
    """Wait until the warm-up has compiled every kernel, the rotate-16 ones (compiled last)
    included, for at most ``timeout`` seconds of the latter (None: no limit); return the kernel
    module, or None where Triton is unavailable. For what times or checks the warm paths
    (benchmarks, tests, golden files); library calls never wait for them."""
    tk = triton_kernels(wait=True)
    if tk is not None and not rot16_ready():
        _READY16.wait(timeout)
    return tk


def triton_kernels(wait: bool = False, start: bool = True):
    """The Triton kernel module (byteplane encode/decode, segment copies), or None (unavailable,
    or still compiling unless ``wait``). ``start=False`` (the load paths): do not start the
    warm-up if it has not started; a load in a fresh process then runs on the torch path without
    a compile thread competing with it for the GIL, and :func:`ckptzip.load` starts the warm-up
    as it returns."""
    if _READY.is_set():
        return _MOD or None
    if not start and not wait:
        return None
    if os.environ.get("CKPTZIP_TRITON_WARMUP") == "0":
        mod = _load()
        _READY.set()
        return mod
    _start()
    if wait:
        _READY.wait()
        return _MOD or None
    return None


def enabled(family: str) -> bool:
    """Whether the kernels of ``family`` (a name the callers choose: "fused", "encode_multi",
    "decode_multi") may still be launched: False once one of them failed to compile
    (:func:`launch`)."""
    return family not in _OFF


def launch(family: str, kernel, *args) -> bool:
    """Run ``kernel(*args)``, one of the Triton kernels of ``family``; True if it ran. The one policy
    for kernels that fail: Triton raises before anything is launched (compile errors come in
    several kinds), so the family is turned off for the process and False tells the caller to do
    the same work its torch way (same bytes). CUDA running out of memory is not a kernel problem:
    it is raised, and the family stays on."""
    if family in _OFF:
        return False
    import torch
    try:
        kernel(*args)
        return True
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:  # noqa: BLE001 (Triton compile errors of several kinds; nothing launched)
        _OFF.add(family)
        return False


def _start() -> None:
    global _STARTED, _MOD
    with _LOCK:
        if _STARTED:
            return
        _STARTED = True
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError
        dev = torch.cuda.current_device()
    except Exception:
        _MOD = None
        _READY.set()
        return
    # Not a daemon: a daemon thread killed inside CUDA or Triton's C++ code at interpreter exit
    # aborts the process. At exit the hook below stops it after the kernel it is compiling, and
    # the interpreter joins it.
    try:
        threading._register_atexit(_STOP.set)
    except RuntimeError:  # the interpreter is exiting (a pending save finishing): torch path
        _MOD = None
        _READY.set()
        return
    threading.Thread(target=_warm, args=(dev,), name="ckptzip-triton-warmup").start()
