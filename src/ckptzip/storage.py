"""Files: atomic writes (temp in the same directory, fsync, rename, fsync of the directory) and
bounds-checked positional reads."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import BinaryIO

from .errors import NotARegularFileError, TruncatedFileError


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> int:
    """An O_RDONLY descriptor of the regular file ``path``. The open is non-blocking (a FIFO
    with no writer must not hang it) and anything but a regular file (directory, FIFO, socket,
    device) is refused with NotARegularFileError; missing files raise FileNotFoundError."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(f"{path!r} is {_kind(st.st_mode)}, not a checkpoint file")
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~getattr(os, "O_NONBLOCK", 0))
    except BaseException:
        os.close(fd)
        raise
    return fd


#: start the disk write of each written range at once (Linux ``sync_file_range``) instead of
#: leaving it to the final fsync: below the kernel's dirty thresholds nothing reaches the disk
#: until fsync otherwise, so the disk idles while a save compresses and copies
WRITEBACK = os.environ.get("CKPTZIP_WRITEBACK", "1") != "0"
_SYNC_FILE_RANGE_WRITE = 2


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(f, offset: int, length: int) -> None:
    """Ask the kernel to begin writing ``length`` bytes at ``offset`` of the plain file ``f`` to
    the disk without waiting for them (a no-op for anything else, on other systems, or with
    ``CKPTZIP_WRITEBACK=0``); durability still comes from the fsync at the end."""
    if not (WRITEBACK and length > 0 and isinstance(f, io.FileIO)):
        return
    fn = _sync_file_range()
    if fn:
        fn(f.fileno(), offset, length, _SYNC_FILE_RANGE_WRITE)  # errors only lose the head start


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
_READ_POOL_LOCK = threading.Lock()
_PARALLEL_PIECE = 16 << 20
#: threads for large local reads (POSIX threads of :func:`pread_ranges`; the read pool where the
#: C extension is missing) and the reader's host checksums: NVMe drives and the page cache both
#: want several requests in flight (tmpfs on the H100 machine: 16 threads read 37 GB/s; loads
#: with 16 C threads 0.083-0.085 s against 0.099 with 8, docs/benchmarks.md)
READ_THREADS = int(os.environ.get("CKPTZIP_READ_THREADS", str(max(1, min(16, os.cpu_count() or 1)))))
#: bytes of the file after a batch that the kernel is asked to start reading (POSIX_FADV_WILLNEED):
#: a cold disk keeps reading while the batch is decoded
READAHEAD = 256 << 20


def read_pool():
    """The shared thread pool of local reads (``READ_THREADS`` workers). Work given to it must
    not wait on other work of the pool."""
    global _READ_POOL
    if _READ_POOL is None:
        with _READ_POOL_LOCK:  # two first callers at once must not each start a pool
            if _READ_POOL is None:
                from concurrent.futures import ThreadPoolExecutor
                _READ_POOL = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ckptzip-read")
    return _READ_POOL


def run_all(futs: list) -> list:
    """The results of ``futs``, after EVERY one has finished: on a failure the first exception
    is raised only once no other part still writes into a buffer the caller will hand back."""
    from concurrent.futures import wait
    wait(futs)
    return [f.result() for f in futs]


def will_need(fd, offset: int, length: int = READAHEAD) -> None:
    """Ask the kernel to start reading ``length`` bytes of a local file from ``offset`` (a hint:
    no effect on remote sources, tmpfs, or where posix_fadvise is missing)."""
    if isinstance(fd, int) and length > 0 and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


#: the pieces :func:`pread_ranges` cuts ranges into for its C threads (taken in turn; the read
#: pool, where the extension is missing, gets pieces of ``_PARALLEL_PIECE``)
NATIVE_PIECE = 4 << 20


def split_ranges(aoffs, boffs, lens, piece: int):
    """Ranges ``(aoffs[i], boffs[i], lens[i])`` (int64 arrays: a source offset, a destination
    offset, a length) with every one longer than ``piece`` cut into pieces of ``piece`` bytes
    (the last shorter), in order; the arrays themselves where none is."""
    import numpy as np
    cnt = np.maximum(1, -(-lens // piece))
    if not len(cnt) or int(cnt.max()) <= 1:
        return aoffs, boffs, lens
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    within = (np.arange(int(cnt.sum()), dtype=np.int64) - first) * piece
    return (np.repeat(aoffs, cnt) + within, np.repeat(boffs, cnt) + within,
            np.minimum(np.repeat(lens, cnt) - within, piece))


def pread_ranges(fd: int, buf, foffs, boffs, lens) -> None:
    """``buf[boffs[i]:+lens[i]]`` = the bytes of the local file ``fd`` at ``foffs[i]``, for
    every i, by ``READ_THREADS`` threads in C without the GIL (``ckptzip._bpnative``: Python
    read threads each needed the GIL back after every read while the caller's thread held it),
    in pieces of at most 4 MiB; or by the read pool where the extension is missing. Raises
    TruncatedFileError where the file ends inside a range."""
    import numpy as np
    from . import native
    fo, bo, ln = (np.asarray(x, dtype=np.int64) for x in (foffs, boffs, lens))
    fo, bo, ln = split_ranges(fo, bo, ln, NATIVE_PIECE if native.lib is not None else _PARALLEL_PIECE)
    if native.lib is None:
        b = memoryview(buf).cast("B")
        run_all([read_pool().submit(pread_exact, fd, b[o:o + k], f) for f, o, k in zip(fo.tolist(), bo.tolist(), ln.tolist())])
        return
    at = native.lib.pread_many(fd, buf, fo, bo, ln, READ_THREADS)
    if at is not None:
        raise TruncatedFileError(f"file ends inside a declared range (at or before offset {at})")


def pread_into(fd, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of ``fd`` (an OS file descriptor or a :class:`RemoteSource`)
    or raise TruncatedFileError. Large local reads are split into pieces read by
    ``READ_THREADS`` threads (NVMe drives want several requests in flight)."""
    if not isinstance(fd, int):
        return fd.pread_into(buf, offset)
    n = len(buf)
    if n >= 4 * _PARALLEL_PIECE and READ_THREADS > 1:
        pread_ranges(fd, buf, [offset], [0], [n])
        return
    pread_exact(fd, buf, offset)


def pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``offset`` of the OS file descriptor ``fd`` in this thread, or raise
    TruncatedFileError."""
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


class FileObjectSource:
    """Positional reads over a caller's binary file object (anything with ``read``/``readinto``
    and ``seek``, e.g. ``io.BytesIO`` or ``open(p, "rb")``). Serialised; never closes it.

    An ``io.BytesIO`` is read from a snapshot of its bytes instead: ``getvalue()``, which is
    the object's own immutable buffer, not a copy, unless the object is exported or
    over-allocated (later writes to the BytesIO copy it first, as Python's copy-on-write buffer
    does; the snapshot never changes). Its chunks are then decoded where they lie
    (:meth:`view`), with no copy and no read holding the GIL."""

    def __init__(self, f) -> None:
        self.f = f
        self._lock = threading.Lock()
        self._start = f.tell() if hasattr(f, "tell") else 0
        self.size = f.seek(0, os.SEEK_END) - self._start
        f.seek(self._start)
        self.mem = None  # a uint8 tensor over the snapshot's bytes from the start, or None
        if type(f) is io.BytesIO and self.size > 0:  # (a subclass may read otherwise: it reads itself)
            snap = f.getvalue()
            if type(snap) is bytes and len(snap) == self._start + self.size:
                self.mem = _bytes_tensor(snap)[self._start:]

    def view(self, offset: int, n: int):
        """The source's bytes ``offset:offset + n`` as a uint8 tensor that shares them (never
        written), or None where reads must copy; TruncatedFileError past the end."""
        if self.mem is None:
            return None
        if offset < 0 or n < 0 or offset + n > self.size:
            raise TruncatedFileError(f"file ends inside a declared range at offset {min(max(offset, 0), self.size)}")
        return self.mem[offset:offset + n]

    def pread_into(self, buf: memoryview, offset: int) -> None:
        if self.mem is not None:
            n = len(buf)
            src = self.view(offset, n)
            memoryview(buf).cast("B")[:] = memoryview(src.numpy())
            return
        with self._lock:
            self.f.seek(self._start + offset)
            got = 0
            readinto = getattr(self.f, "readinto", None)
            while got < len(buf):
                if readinto is not None:
                    k = readinto(buf[got:])
                else:
                    part = self.f.read(len(buf) - got)
                    k = len(part) if part else 0
                    buf[got:got + k] = part or b""
                if not k:
                    raise TruncatedFileError(f"file ends inside a declared range at offset {offset + got}")
                got += k

    def close(self) -> None:
        pass  # the caller's file stays open (the snapshot goes with this object)


def _bytes_tensor(b: bytes):
    """A uint8 tensor over the bytes of ``b`` (no copy; it keeps ``b`` alive). torch takes only
    writable buffers without a warning, so the tensor is made over a ctypes array at the same
    address (ckptzip never writes a source; silencing the warning instead would change the
    process's warning filters, which is not thread-safe)."""
    import ctypes
    import torch
    arr = (ctypes.c_ubyte * len(b)).from_address(ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value)
    arr._keep = b
    return torch.frombuffer(arr, dtype=torch.uint8)


def is_file_object(x) -> bool:
    """A binary file object a checkpoint can be read from (``read`` and ``seek``)."""
    return hasattr(x, "read") and hasattr(x, "seek") and not isinstance(x, (str, bytes, os.PathLike))


class _Unclosed:
    """The caller's writable file object, with ``close`` made a no-op (flush instead)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, b) -> int:
        n = self._f.write(b)
        return len(memoryview(b)) if n is None else n

    def close(self) -> None:
        self.flush()

    def flush(self) -> None:
        fl = getattr(self._f, "flush", None)
        if fl is not None:
            fl()

    def __getattr__(self, name):
        return getattr(self._f, name)


@contextlib.contextmanager
def open_for_write(path, fsync: bool = True) -> Iterator[BinaryIO]:
    """A file to write a checkpoint to: for local paths an :func:`atomic_write`; for fsspec URLs
    the object itself, which object stores make visible only when the upload completes (multipart
    for large objects) and which is discarded, not committed, if writing fails. A caller's file
    object (anything with ``write``) is written to where it stands and left open: no temporary
    file, no rename, and a failed save leaves what was written so far."""
    if hasattr(path, "write") and not isinstance(path, (str, bytes, os.PathLike)):
        f = _Unclosed(path)
        yield f
        f.flush()
        return
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
