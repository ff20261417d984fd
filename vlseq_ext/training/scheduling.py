"""Who runs what: samples to devices by length (longest first), and each process's share of a
global step. Pure functions of lengths: every process computes the same split of the same step.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import torch

__all__ = ["assign_lpt", "lpt_shard", "sample_length"]


def assign_lpt(lengths: Sequence[int], num_devices: int, capacity: int) -> List[List[int]]:
    """Longest-processing-time-first assignment of samples (by length) to devices, at most
    `capacity` per device, so the devices finish together. Returns sample indices per device."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * num_devices
    groups: List[List[int]] = [[] for _ in range(num_devices)]
    for i in order:
        d = min((d for d in range(num_devices) if len(groups[d]) < capacity), key=lambda d: (loads[d], d))
        groups[d].append(i)
        loads[d] += lengths[i]
    return groups


def lpt_shard(lengths: Sequence[int], rank: int, world_size: int, devices_per_rank: int,
              samples_per_device: int) -> List[int]:
    """This rank's share of one global step: the positions (into `lengths`, ascending) of the
    samples that a longest-first assignment over all world_size x devices_per_rank devices, at most
    samples_per_device each, gives to this rank's devices (rank r owns devices r*D .. r*D+D-1).
    Deterministic, so every rank computes the same split of the same global batch."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    cap = devices_per_rank * world_size * samples_per_device
    if len(lengths) > cap:
        raise ValueError(f"a global step takes at most {cap} samples ({world_size} processes x {devices_per_rank} "
                         f"devices x {samples_per_device}), got {len(lengths)}")
    groups = assign_lpt([int(v) for v in lengths], devices_per_rank * world_size, samples_per_device)
    return sorted(i for g in groups[rank * devices_per_rank:(rank + 1) * devices_per_rank] for i in g)


def sample_length(x: Any) -> int:
    """The length L of one sample: (L, D), or (1, L, D) from a DataLoader with batch_size=1."""
    shape = tuple(x.shape) if hasattr(x, "shape") else tuple(torch.as_tensor(x).shape)
    return int(shape[-2]) if len(shape) >= 2 else int(shape[0]) if shape else 1
