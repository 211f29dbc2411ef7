"""Public API: ``save``, ``load`` and the lazy reader ``open``."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import __version__  # noqa: F401  (the CLI reads it from here)
from .engine import (DEFAULT_CHUNK, DEFAULT_WINDOW, Job, decode_jobs, gpu_decode_window, gpu_ok,
                     storage_plan_from_manifest)
from .errors import CorruptFileError, TensorNotFoundError
from .format import FOOTER_SIZE, HEADER_SIZE, check_header, parse_footer, parse_manifest
from .pipeline import prepare, write
from .storage import RemoteSource, is_url, local_path, pread_into
from .tree import Decoder, tensor_paths

Progress = Callable[[int, int], None]  # (bytes just done, total bytes)


def save(obj: Any, path: str | os.PathLike, *, codec: str | dict = "auto", transform: str | None = "auto",
         chunk_size: int = DEFAULT_CHUNK, level: int | None = None, metadata: Mapping[str, str] | None = None,
         allow_pickle: bool = False, fsync: bool = True, progress: Progress | None = None,
         device: str | None = None, portable: bool = False, storage_gbps: float | None = None,
         window: int | None = None) -> dict[str, Any]:
    """Save ``obj`` (a state dict or any nesting of containers, tensors and plain values) to
    ``path`` (a local path, or an fsspec URL such as ``s3://bucket/key.ckz``).

    ``codec``: ``"auto"``, a wire id (``"zstd"``, ``"deflate"``, ``"raw"``, or GPU-only ``"ans"``,
    ``"bitcomp"``, ...) or a wire config dict. ``transform``: ``"auto"`` (byte planes for floats),
    ``"byteplane"`` or ``None``. ``device``: ``"cpu"``, ``"cuda"`` or None (the GPU when nvCOMP is
    usable). ``portable=True`` keeps to codecs any CPU decodes. ``storage_gbps`` (the write
    bandwidth you expect) steers ``auto`` on the GPU. The write is atomic. Returns a summary
    ``{"raw_bytes", "stored_bytes", "path"}``.
    """
    prep = prepare(obj, codec, transform, chunk_size, level, metadata, allow_pickle, device, portable,
                    storage_gbps, window)
    return write(prep, path, fsync, progress)


def _resolve_device(saved: str, map_location: Any) -> torch.device:
    if map_location is None:
        dev = torch.device(saved)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return torch.device("cpu")
        return dev
    if isinstance(map_location, Mapping):
        return torch.device(map_location.get(saved, saved))
    if callable(map_location):
        return torch.device(map_location(saved))
    return torch.device(map_location)


class CheckpointReader:
    """Lazy reader over one .ckz file: keys, metadata and single tensors without reading the rest.

    Use as a context manager: ``with ckptzip.open(path) as r: w = r.get_tensor("model.fc.weight")``.
    """

    def __init__(self, path: str | os.PathLike, *, map_location: Any = None, allow_pickle: bool = False,
                 progress: Progress | None = None, decode_device: str | None = None) -> None:
        self.path = os.fspath(path)
        self.decode_device = decode_device  # "cpu"/"cuda" forces where chunks are decoded
        self.map_location = map_location
        self.allow_pickle = allow_pickle
        self.progress = progress
        self._remote = is_url(self.path)
        self._fd = RemoteSource(self.path) if self._remote else os.open(local_path(self.path), os.O_RDONLY)
        try:
            self._open()
        except BaseException:
            self._fd.close() if self._remote else os.close(self._fd)
            raise
        self._cache: dict[int, torch.Tensor] = {}

    def _open(self) -> None:
        size = self._fd.size if self._remote else os.fstat(self._fd).st_size
        head = bytearray(min(size, HEADER_SIZE))
        if head:
            pread_into(self._fd, memoryview(head), 0)
        check_header(bytes(head))
        if size < HEADER_SIZE + FOOTER_SIZE:
            parse_footer(b"", size)
        foot = bytearray(FOOTER_SIZE)
        pread_into(self._fd, memoryview(foot), size - FOOTER_SIZE)
        off, length, digest = parse_footer(bytes(foot), size)
        raw = bytearray(length)
        pread_into(self._fd, memoryview(raw), off)
        self.manifest = parse_manifest(bytes(raw), digest, off)
        self.file_size = size
        self._paths: dict[str, Any] | None = None

    # -- metadata ---------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.manifest.doc.get("meta", {}))

    @property
    def storages(self) -> list[dict[str, Any]]:
        return self.manifest.doc["storages"]

    def _tensor_nodes(self) -> dict[str, Any]:
        if self._paths is None:
            self._paths = tensor_paths(self.manifest.doc["root"])
        return self._paths

    def keys(self) -> list[str]:
        """Dotted paths of every tensor and numpy array in the checkpoint."""
        return list(self._tensor_nodes())

    def __contains__(self, key: str) -> bool:
        return key in self._tensor_nodes()

    def stored_bytes(self, index: int) -> int:
        first, count = self.storages[index]["rows"]
        return int(self.manifest.rows["stored"][first:first + count].astype(np.int64).sum())

    # -- data -------------------------------------------------------------------------------
    def _storage_index(self, node: dict[str, Any]) -> int:
        s = node.get("s")
        if type(s) is not int or not 0 <= s < len(self.storages):
            raise CorruptFileError(f"tensor refers to storage {s!r}, which does not exist")
        return s

    def _job(self, i: int, t: str = "tensor") -> Job:
        s = self.storages[i]
        dev = _resolve_device(s.get("device", "cpu") if t == "tensor" else "cpu",
                              self.map_location if t == "tensor" else "cpu")
        work = self.decode_device or ("cuda" if dev.type == "cuda" or gpu_ok() else "cpu")
        tf, codec = storage_plan_from_manifest(s, work)
        first, count = s["rows"]
        out = torch.empty(s["nbytes"], dtype=torch.uint8, device=dev)
        return Job(self.manifest.rows[first:first + count], tf, codec, out)

    def _decode(self, jobs: dict[int, Job]) -> None:
        total = self._total_bytes()
        prog = (lambda n: self.progress(n, total)) if self.progress else None
        gpu = any(j.codec.device == "cuda" for j in jobs.values())
        decode_jobs(self._fd, list(jobs.values()), gpu_decode_window() if gpu else DEFAULT_WINDOW, prog)
        self._cache.update({i: j.out for i, j in jobs.items()})

    def _storage(self, node: dict[str, Any]) -> torch.Tensor:
        i = self._storage_index(node)
        if i not in self._cache:
            self._decode({i: self._job(i, node.get("t", "tensor"))})
        return self._cache[i]

    def _prefetch_all(self) -> None:
        """Decode every storage in one pipelined pass (file order), using each storage's first
        referencing node kind to place it (a storage reached by no key is decoded on demand)."""
        kinds: dict[int, str] = {}
        for n in self._tensor_nodes().values():
            if type(n.get("s")) is int:
                kinds.setdefault(n["s"], n["t"])
        jobs = {i: self._job(i, t) for i, t in sorted(kinds.items()) if 0 <= i < len(self.storages)}
        self._decode(jobs)

    def _total_bytes(self) -> int:
        return sum(s["nbytes"] for s in self.storages)

    def get_tensor(self, key: str) -> Any:
        """One tensor (or numpy array) by dotted key, reading only its own chunks."""
        node = self._tensor_nodes().get(key)
        if node is None:
            raise TensorNotFoundError(key)
        return Decoder(self._storage, self.allow_pickle).decode(node)

    def load(self) -> Any:
        """The whole object, as ``ckptzip.load`` returns it."""
        self._prefetch_all()
        obj = Decoder(self._storage, self.allow_pickle).decode(self.manifest.doc["root"])
        self._cache.clear()
        return obj

    def verify(self) -> None:
        """Decode every storage (checking every checksum); raises on the first failure."""
        for i in range(len(self.storages)):
            self._decode({i: self._job(i, "ndarray")})
            self._cache.pop(i, None)

    def close(self) -> None:
        if self._fd is None:
            return
        if self._remote:
            self._fd.close()
        else:
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def open(path: str | os.PathLike, **kwargs: Any) -> CheckpointReader:  # noqa: A001
    """Open a checkpoint lazily (see :class:`CheckpointReader`)."""
    return CheckpointReader(path, **kwargs)


def load(path: str | os.PathLike, *, map_location: Any = None, allow_pickle: bool = False,
         progress: Progress | None = None, decode_device: str | None = None) -> Any:
    """Load what :func:`save` wrote. Tensors come back bit-exact, on their saved device unless
    ``map_location`` (``"cpu"``, ``"cuda"``, a ``torch.device``, a dict or a callable) says
    otherwise. Pickled objects load only with ``allow_pickle=True``."""
    with CheckpointReader(path, map_location=map_location, allow_pickle=allow_pickle,
                          progress=progress, decode_device=decode_device) as r:
        return r.load()
