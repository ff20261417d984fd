"""The one device parser of vlseq_ext: ParallelTrainer(devices=...), `vlseq-train --devices`,
`vlseq-predict --devices` and `vlseq-bench --devices` all mean the same thing by the same spec.

Specs (a string, as on the command line, or the same as a Python value):
  - "all" (or None): every visible GPU; the CPU when there is none. Under torchrun with several
    processes per machine, this process's share of the GPUs (by LOCAL_RANK).
  - "N" (or the int N): the first N GPUs.
  - "cuda:0,cuda:1" (or "0,1", or a list such as ["cuda:0", 1, torch.device("cuda", 2)]): those GPUs.
  - "cpu": one CPU device; "cpu:N": N CPU replicas in one process (what CI tests).
"""
from __future__ import annotations

import re
import warnings
from typing import Iterable, List, Optional, Sequence, Union

import torch

from . import env

DeviceLike = Union[str, int, torch.device]
DeviceSpec = Union[None, str, int, torch.device, Sequence[DeviceLike]]

__all__ = ["DeviceLike", "DeviceSpec", "parse_devices", "visible_gpus", "local_share", "MAX_CPU_REPLICAS"]

# CPU replicas run one after another on one thread (they exist to test multi-device training without
# GPUs): more than this only costs memory and time (cpu:1000000 copied the model for minutes).
MAX_CPU_REPLICAS = 1024


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_share() -> Optional[List[torch.device]]:
    """The GPUs of this process when several processes run on one machine (torchrun's
    LOCAL_WORLD_SIZE > 1): process LOCAL_RANK takes its share of the visible GPUs, e.g. cuda:LOCAL_RANK
    for one process per GPU. None for one process per machine."""
    launch = env.launch()
    local_world, local_rank = launch.local_world_size, launch.local_rank
    if local_world <= 1:
        return None
    n = visible_gpus()
    if n == 0:
        return [torch.device("cpu")]
    if n == 1:  # e.g. CUDA_VISIBLE_DEVICES set per process by the launcher
        return [torch.device("cuda", 0)]
    if n < local_world:
        raise ValueError(f"{local_world} processes on this machine (LOCAL_WORLD_SIZE) but only {n} GPUs are visible: "
                         "NCCL needs a distinct GPU per process; start at most one process per GPU")
    share = n // local_world
    if n % local_world:
        warnings.warn(f"vlseq_ext: {n} GPUs for {local_world} processes: each drives {share}, "
                      f"{n % local_world} stay idle", RuntimeWarning)
    return [torch.device("cuda", i) for i in range(local_rank * share, (local_rank + 1) * share)]


def _all() -> List[torch.device]:
    share = local_share()
    if share is not None:
        return share
    n = visible_gpus()
    return [torch.device("cuda", i) for i in range(n)] if n else [torch.device("cpu")]


def _first(n: int, spec: object) -> List[torch.device]:
    have = visible_gpus()
    if n < 1:
        raise ValueError(f"devices {spec!r}: need at least one device")
    if n > have:
        hint = "; use cpu or cpu:N" if have == 0 else ""
        raise ValueError(f"devices {spec!r}: asks for the first {n} GPUs but {have} are visible{hint}")
    return [torch.device("cuda", i) for i in range(n)]


def _one(item: DeviceLike, spec: object) -> torch.device:
    if isinstance(item, torch.device):
        dev = item
    elif isinstance(item, int) and not isinstance(item, bool):
        dev = torch.device("cuda", item)
    elif isinstance(item, str) and re.fullmatch(r"\s*\d+\s*", item):
        dev = torch.device("cuda", int(item))
    elif isinstance(item, str):
        try:
            dev = torch.device(item.strip().lower())
        except RuntimeError:
            raise ValueError(f"devices {spec!r}: cannot parse {item!r} (use all, N, cuda:0,cuda:1, cpu or cpu:N)") \
                from None
    else:
        raise ValueError(f"devices {spec!r}: cannot parse {item!r} as a device")
    if dev.type == "cuda":
        dev = torch.device("cuda", 0 if dev.index is None else dev.index)
        have = visible_gpus()
        if dev.index >= have:
            visible = ", ".join(f"cuda:{i}" for i in range(have)) or "none"
            raise ValueError(f"devices {spec!r}: {dev} does not exist (visible GPUs: {visible})")
    elif dev.type == "cpu":
        if dev.index is not None and len(str(spec).split(",")) > 1:
            raise ValueError(f"devices {spec!r}: {item} in a list; cpu:N alone gives N CPU replicas, a list takes "
                             "cpu (cpu,cpu)")
        dev = torch.device("cpu")
    else:
        raise ValueError(f"devices {spec!r}: only CUDA and CPU devices are supported, got {dev}")
    return dev


def _check(out: List[torch.device], spec: object) -> List[torch.device]:
    if not out:
        raise ValueError(f"devices {spec!r}: empty")
    if len({d.type for d in out}) > 1:
        raise ValueError(f"devices {spec!r}: mixes CPU and CUDA ({', '.join(map(str, out))})")
    gpus = [d for d in out if d.type == "cuda"]
    for i, d in enumerate(gpus):
        if d in gpus[:i]:
            raise ValueError(f"devices {spec!r}: {d} is listed twice")
    return out


def parse_devices(spec: DeviceSpec = None) -> List[torch.device]:
    """A device spec (see the module docstring) -> the list of devices, checked: GPUs that exist,
    none twice, CPU and CUDA not mixed. Raises ValueError naming the problem."""
    if spec is None:
        return _all()
    if isinstance(spec, bool):
        raise ValueError(f"devices {spec!r}: expected all, N, cuda:0,cuda:1, cpu or cpu:N")
    if isinstance(spec, int):
        return _first(spec, spec)
    if isinstance(spec, torch.device):
        return _check([_one(spec, spec)], spec)
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in ("all", "auto", ""):
            return _all()
        if re.fullmatch(r"\d+", s):
            return _first(int(s), spec)
        m = re.fullmatch(r"cpu(?::(\d+))?", s)
        if m:
            n = int(m.group(1) or 1)
            if not 1 <= n <= MAX_CPU_REPLICAS:
                raise ValueError(f"devices {spec!r}: {n} CPU replicas; give 1 to {MAX_CPU_REPLICAS} (they run one "
                                 "after another: more only cost memory)")
            return [torch.device("cpu")] * n
        if s == "cuda":
            if visible_gpus() == 0:
                raise ValueError(f"devices {spec!r}: no CUDA GPU is visible (use cpu)")
            return _first(visible_gpus(), spec)
        return _check([_one(item, spec) for item in s.split(",") if item.strip()], spec)
    if isinstance(spec, Iterable):
        return _check([_one(item, spec) for item in spec], spec)
    raise ValueError(f"devices {spec!r}: expected all, N, cuda:0,cuda:1, cpu or cpu:N")
