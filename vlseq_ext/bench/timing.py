"""The one timing helper every benchmark uses: warm-up, calibration, synchronized repeats (and
which profiler events are GPU work).

Timing is by synchronized loops: synchronize every device involved, run `fn` `iters` times with
no synchronization inside the loop, synchronize again; the time per call is the wall time over
`iters`. For multi-device work this is what a training loop sees (it includes host overhead and
cross-device waits), and a loop of many calls hides the cost of the two syncs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

Stat = Dict[str, float]


def stats(values: Sequence[float]) -> Stat:
    """{median, min, max, n} of the repeats."""
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def is_kernel(event: Any) -> bool:
    """A torch.profiler event that is GPU work (a kernel, copy or set), not the GPU-side copy of a
    record_function range: those span whole phases and would count as kernel time."""
    return (getattr(getattr(event, "device_type", None), "name", "") == "CUDA"
            and not getattr(event, "is_user_annotation", False))


def device_time_us(event: Any) -> float:
    return float(getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0))


def synchronizer(devices: Sequence[torch.device]) -> Callable[[], None]:
    """A function that waits for all queued work on every CUDA device of `devices` (no-op on CPU)."""
    cuda = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})

    def sync() -> None:
        for i in cuda:
            torch.cuda.synchronize(i)

    return sync


def time_loop(fn: Callable[[], object], sync: Callable[[], None], *, repeats: int = 5, warmup: int = 2,
              iters: Optional[int] = None, target_s: float = 0.2, min_iters: int = 1, max_iters: int = 100_000,
              agree: Optional[Callable[[int], int]] = None) -> List[float]:
    """Seconds per call of `fn`, one value per repeat.

    `warmup` untimed calls first. Unless `iters` is given, a calibration (doubling batches until one
    takes >= target_s/8) picks `iters` so that one repeat lasts about `target_s`, clamped to
    [min_iters, max_iters]. `agree(n)` must return the max of n over all processes that run `fn`
    together (collectives inside fn): they then take the same calibration and loop counts.
    """
    for _ in range(warmup):
        fn()
    sync()
    if iters is None:
        n = 1
        while True:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            dt = time.perf_counter() - t0
            per = dt / n
            more = int(dt < target_s / 8 and n < max_iters)
            if not (agree(more) if agree is not None else more):
                break
            n *= 2
        iters = int(min(max(target_s / max(per, 1e-9), min_iters), max_iters))
    if agree is not None:
        iters = int(agree(iters))
    out: List[float] = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters)
    return out


CPU_TIME_SCALE = 0.2


@dataclass
class Budget:
    """Repeat counts and per-repeat durations: the knobs that set how long a run takes."""
    quick: bool
    merge_repeats: int     # the merge and flatten suites
    train_repeats: int
    seed_target_s: float   # per repeat of a seed-model merge or flatten loop (at least `seed_merges` calls)
    flat_target_s: float   # per repeat of a flat-buffer all-reduce or many-tensor flatten loop
    train_target_s: float  # per repeat of a training loop
    seed_merges: int = 500
    # The sweep (many points, each measured by several methods): per method and point, `sweep_repeats`
    # timed repeats of about `sweep_target_s` each (at least one step), after a warm-up of at most
    # `sweep_warmup_s` (one pass over the pool). Past `sweep_deadline_s` seconds of in-process sweep
    # work, or `sweep_mp_deadline_s` in the worker processes, the remaining points are skipped with
    # that reason: a guard at about twice the expected time, not a planned cut.
    sweep_repeats: int = 3
    sweep_target_s: float = 0.15
    sweep_warmup_s: float = 1.5
    sweep_deadline_s: float = 420.0
    sweep_mp_deadline_s: float = 300.0

    @classmethod
    def make(cls, quick: bool, repeats: Optional[int] = None, sweep_deadline_s: Optional[float] = None,
             cpu: bool = False) -> "Budget":
        """cpu: the CPU versions of the suites, smoke runs of the machinery on tiny models (no target
        is measured on a CPU): a fifth of the seconds per repeat and of the sweep's warm-up."""
        if quick:
            b = cls(True, 5, 3, 0.02, 0.02, 0.2, sweep_repeats=3, sweep_target_s=0.1, sweep_warmup_s=1.0,
                    sweep_deadline_s=150.0, sweep_mp_deadline_s=100.0)
        else:
            b = cls(False, 7, 5, 0.1, 0.05, 0.8)
        if cpu:
            for name in ("seed_target_s", "flat_target_s", "train_target_s", "sweep_target_s", "sweep_warmup_s"):
                setattr(b, name, getattr(b, name) * CPU_TIME_SCALE)
        if repeats:
            b.merge_repeats = b.train_repeats = b.sweep_repeats = repeats
        if sweep_deadline_s is not None:  # a slow or shared machine: the guard moves, the worker share stays 5/7
            b.sweep_deadline_s, b.sweep_mp_deadline_s = sweep_deadline_s, sweep_deadline_s * 5 / 7
        return b
