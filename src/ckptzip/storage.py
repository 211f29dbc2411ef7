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
_READ_THREADS = int(os.environ.get("CKPTZIP_READ_THREADS", "4"))


def pread_into(fd, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of ``fd`` (an OS file descriptor or a :class:`RemoteSource`)
    or raise TruncatedFileError. Large local reads are split into 16 MiB pieces read by four
    threads (NVMe drives want several requests in flight)."""
    if not isinstance(fd, int):
        return fd.pread_into(buf, offset)
    n = len(buf)
    if n >= 4 * _PARALLEL_PIECE and _READ_THREADS > 1:
        global _READ_POOL
        if _READ_POOL is None:
            from concurrent.futures import ThreadPoolExecutor
            _READ_POOL = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="ckptzip-read")
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


def is_url(path) -> bool:
    """True for fsspec URLs (s3://, gs://, memory://, ...); local paths and file:// are local."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def local_path(path) -> str:
    p = os.fspath(path)
    return p[len("file://"):] if p.startswith("file://") else p


class RemoteSource:
    """Positional reads over an fsspec file (serialised: fsspec files are not thread-safe)."""

    def __init__(self, url: str) -> None:
        import fsspec
        self.fs, self.path = fsspec.core.url_to_fs(url)
        self.f = self.fs.open(self.path, "rb")
        self.size = self.fs.size(self.path)
        self._lock = threading.Lock()

    def pread_into(self, buf: memoryview, offset: int) -> None:
        with self._lock:
            self.f.seek(offset)
            got = 0
            while got < len(buf):
                k = self.f.readinto(buf[got:])
                if not k:
                    raise TruncatedFileError(f"object ends inside a declared range at offset {offset + got}")
                got += k

    def close(self) -> None:
        self.f.close()


@contextlib.contextmanager
def open_for_write(path, fsync: bool = True) -> Iterator[BinaryIO]:
    """A file to write a checkpoint to: for local paths an :func:`atomic_write`; for fsspec URLs
    the object itself, which object stores make visible only when the upload completes (multipart
    for large objects) and which is discarded, not committed, if writing fails."""
    if not is_url(path):
        with atomic_write(local_path(path), fsync=fsync) as f:
            yield f
        return
    import fsspec
    fs, p = fsspec.core.url_to_fs(os.fspath(path))
    f = fs.open(p, "wb")
    try:
        yield f
    except BaseException:
        discard = getattr(f, "discard", None)
        with contextlib.suppress(Exception):
            if discard:
                discard()  # abort the upload (no object appears)
                f.closed = True  # and keep the file object from completing it when collected
            else:
                f.close()
        with contextlib.suppress(Exception):
            if discard is None and fs.exists(p):
                fs.rm(p)
        raise
    f.close()
