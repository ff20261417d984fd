"""Every environment variable the vlseq_ext package reads or sets, and nowhere else in it.

docs/environment.md lists them with the ones setup.py, the C++ code, the tests and the benchmark
scripts read. Bad values raise ValueError naming the variable; callers add their context.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["DIST_TIMEOUT", "DEFAULT_DIST_TIMEOUT_S", "Launch", "launch", "dist_timeout", "omp_threads_given",
           "require_deterministic_cublas", "disable_nvls", "bench_snapshot"]

DIST_TIMEOUT = "VLSEQ_DIST_TIMEOUT"
DEFAULT_DIST_TIMEOUT_S = 600.0


def _int(name: str, default: int, least: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < least:
        raise ValueError(f"{name}={value} must be >= {least}")
    return value


@dataclass(frozen=True)
class Launch:
    """What torchrun (or a launcher doing as it does) told this process. Alone: world_size 1, rank 0,
    one process on this machine."""
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: str
    missing: Tuple[str, ...]  # of RANK, MASTER_ADDR, MASTER_PORT: what a group of several processes lacks


def launch() -> Launch:
    """torchrun's WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    missing = tuple(k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k, "").strip())
    return Launch(world_size=_int("WORLD_SIZE", 1, 1), rank=_int("RANK", 0, 0), local_rank=_int("LOCAL_RANK", 0, 0),
                  local_world_size=_int("LOCAL_WORLD_SIZE", 1, 1), master_addr=os.environ.get("MASTER_ADDR", ""),
                  master_port=os.environ.get("MASTER_PORT", ""), missing=missing)


def dist_timeout() -> datetime.timedelta:
    """The timeout of the process groups vlseq_ext creates: VLSEQ_DIST_TIMEOUT seconds (default 600)."""
    raw = os.environ.get(DIST_TIMEOUT, "").strip()
    if not raw:
        return datetime.timedelta(seconds=DEFAULT_DIST_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{DIST_TIMEOUT}={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def omp_threads_given() -> bool:
    """Whether OMP_NUM_THREADS is set (torchrun sets it): then the user chose the CPU thread count."""
    return "OMP_NUM_THREADS" in os.environ


def require_deterministic_cublas() -> None:
    """cuBLAS is deterministic only with a fixed workspace (torch.use_deterministic_algorithms asks for
    it); a value the user set is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def disable_nvls() -> None:
    """NCCL's NVLink multicast (NVLS) off, here and in the processes started from here: it stays off on
    the lent GPU machines."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def tsc_methods() -> list:
    """VLSEQ_TSC_METHODS: the tsc bench suite's methods to run (comma-separated), empty for all."""
    return [m.strip() for m in os.environ.get("VLSEQ_TSC_METHODS", "").split(",") if m.strip()]


def bench_snapshot() -> Dict[str, Optional[str]]:
    """The variables a benchmark result depends on, as they are set (for its metadata)."""
    return {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES") if k in os.environ}
