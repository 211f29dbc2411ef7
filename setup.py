"""Build of the optional C extension ``ckptzip._bpnative`` (the CPU byteplane transform in one
pass); everything else is in pyproject.toml. Without a C compiler the extension is skipped and
ckptzip uses its numpy version of the same transform (same bytes, about 3x slower on a CPU)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptzip._bpnative", ["src/ckptzip/_bpnative.c"], optional=True,
                             extra_compile_args=["-O3"], libraries=["m", "dl", "pthread"])])
