"""Whether a parameter is held in shards by a ZeRO-3 engine, for code that must leave such weights alone (the
oneDNN linear layers of `accel/cpu_linear.py`). DeepSpeed marks the parameters it partitions with `ds_id`."""

from __future__ import annotations

import torch


def is_partitioned(weight: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (a shard, or gathered for the moment)."""
    return hasattr(weight, "ds_id")


def is_whole(weight: torch.Tensor) -> bool:
    """A plain weight, or a ZeRO-3 one gathered in full right now (generation under `engine.gathered`), whose
    values stay put while it is gathered."""
    if not is_partitioned(weight):
        return True
    status = getattr(getattr(weight, "ds_status", None), "name", "")
    return status == "AVAILABLE" and tuple(weight.shape) == tuple(getattr(weight, "ds_shape", ()))
