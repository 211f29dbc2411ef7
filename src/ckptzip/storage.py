"""Files: atomic writes (temp in the same directory, fsync, rename, fsync of the directory) and
bounds-checked positional reads."""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from typing import BinaryIO

from .errors import TruncatedFileError


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, fsync: bool = True) -> Iterator[BinaryIO]:
    """Yield a file opened for writing beside ``path``; on success it replaces ``path`` in one
    rename, on any exception (or a crash) ``path`` is untouched and the temp file is removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # the permissions a plain open() would give
        with os.fdopen(fd, "wb", buffering=0) as f:
            yield f
            if fsync:
                os.fsync(f.fileno())
        # keep the replaced file linked until after the rename, so that freeing its blocks
        # (slow for multi-GB files) happens in the background instead of inside the rename
        old = tmp + ".old"
        try:
            os.link(path, old)
        except OSError:
            old = None
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(directory)
    if old:
        threading.Thread(target=_unlink_quietly, args=(old,), name="ckptzip-unlink").start()


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_READ_POOL = None
_PARALLEL_PIECE = 16 << 20


def pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of ``fd`` or raise TruncatedFileError. Large reads are split
    into 16 MiB pieces read by four threads (NVMe drives want several requests in flight)."""
    n = len(buf)
    if n >= 4 * _PARALLEL_PIECE:
        global _READ_POOL
        if _READ_POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _READ_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptzip-read")
        futs = [_READ_POOL.submit(_pread_all, fd, buf[a:a + _PARALLEL_PIECE], offset + a)
                for a in range(0, n, _PARALLEL_PIECE)]
        for f in futs:
            f.result()
        return
    _pread_all(fd, buf, offset)


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    n = len(buf)
    while got < n:
        k = os.preadv(fd, [buf[got:]], offset + got)
        if k <= 0:
            raise TruncatedFileError(f"file ends inside a declared range at offset {offset + got}")
        got += k
