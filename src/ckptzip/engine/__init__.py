"""The compression engine: storages -> compressed chunks, and chunks -> storages.

* :mod:`.plan`     windows, units and groups (how storages are cut into bounded work);
* :mod:`.planner`  what ``codec="auto"`` decides per storage (transform, codec, chunking);
* :mod:`.encode`   transform + codec + pack of one group, on the codec's device;
* :mod:`.decode`   read batches, decode into destination tensors;
* :mod:`.memory`   the pinned host pool, chunk alignment, segment copies.

The engine knows nothing about files: :mod:`ckptzip.io` places chunks in a ``.ckz`` file and
reads them back, :mod:`ckptzip.pipeline` runs the save stages, and integrations (a DCP storage
writer, say) call the same pipeline for their own files.
"""
from .decode import (Job, batches, decode_group, decode_jobs, storage_chain,
                     storage_plan_from_manifest)
from .encode import Encoded, encode_group_arrays, gather_gpu, pack, stage_encoded
from .memory import (ALIGN, PINNED, PinnedPool, ceil_align, copy_segments, empty_bytes, free_gpu_bytes,
                     pinned_empty)
from .plan import (DEFAULT_CHUNK, DEFAULT_WINDOW, Plan, Unit, codec_key, gpu_decode_window, gpu_window,
                   groups, units_of, windows)
from .planner import Planner, gpu_ok

__all__ = [
    "Job", "batches", "decode_group", "decode_jobs", "storage_chain", "storage_plan_from_manifest",
    "Encoded", "encode_group_arrays", "gather_gpu", "pack", "stage_encoded",
    "ALIGN", "PINNED", "PinnedPool", "ceil_align", "copy_segments", "empty_bytes", "free_gpu_bytes",
    "pinned_empty",
    "DEFAULT_CHUNK", "DEFAULT_WINDOW", "Plan", "Unit", "codec_key", "gpu_decode_window", "gpu_window",
    "groups", "units_of", "windows", "Planner", "gpu_ok",
]
