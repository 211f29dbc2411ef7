"""The checkpoint cost model from NVIDIA's nvCOMP blog: idle-GPU dollars while a checkpoint is
written, plus storage dollars for the checkpoints kept."""
from __future__ import annotations

from dataclasses import dataclass

HOURS_PER_MONTH = 730.0


@dataclass
class CostInputs:
    checkpoint_gb: float = 782.0        # bytes of one checkpoint, GB (1e9)
    write_gbps: float = 5.0             # storage write bandwidth, GB/s
    interval_min: float = 30.0          # one checkpoint every N minutes
    gpus: int = 8
    gpu_hour_usd: float = 4.40
    retained: int = 10                  # checkpoints kept
    storage_gb_month_usd: float = 0.023


def monthly_cost(c: CostInputs, ratio: float = 1.0) -> dict[str, float]:
    """Monthly dollars at compression ``ratio`` (stored/raw; 1.0 = uncompressed)."""
    size = c.checkpoint_gb * ratio
    per_month = HOURS_PER_MONTH * 60.0 / c.interval_min
    stall_s = size / c.write_gbps
    idle = c.gpus * stall_s / 3600.0 * per_month * c.gpu_hour_usd
    storage = size * c.retained * c.storage_gb_month_usd
    return {"checkpoint_gb": size, "write_s": stall_s, "checkpoints_per_month": per_month,
            "idle_gpu_usd": idle, "storage_usd": storage, "total_usd": idle + storage}
