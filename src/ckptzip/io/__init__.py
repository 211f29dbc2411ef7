"""The ``.ckz`` file as bytes on storage: the chunk writer (chunks placed 16-byte aligned,
checksummed, written behind the compression) and the chunk reader (batched reads, every checksum
verified before decoding). The wire format itself is :mod:`ckptzip.format`; where bytes go
(local files, fsspec URLs, atomic writes) is :mod:`ckptzip.storage`."""
from .reader import checksums, read_stored
from .writer import ChunkWriter

__all__ = ["ChunkWriter", "read_stored", "checksums"]
