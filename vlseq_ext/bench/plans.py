"""diag.one_sample_plans: how a one-sample model's k passes per GPU should run (see diag.py)."""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from .baselines import Feeder, _adam, _packed_step, make_pool
from .results import Results, Task, fmt
from .sweep_points import POOL, ModelSpec, make_model
from .timing import Budget, synchronizer, time_loop

MODELS = (ModelSpec("lstm", 256, 2), ModelSpec("lstm", 1024, 1))
METHODS = ("gathered", "sample_graphs", "packed_loop")
K = 32


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> List[Task]:
    out = []
    for spec in MODELS:
        for method in METHODS:
            key = f"diag.one_sample_plans.{spec.name}.{method}"
            if devices[0].type == "cuda":
                out.append(Task("diag", key, lambda spec=spec, method=method: measure(res, devices[0], spec, method,
                                                                                      budget)))
            else:
                res.skip(key, "the plans differ on GPUs only (no graphs, no cluster layouts on the CPU)")
    return out


def measure(res: Results, device: torch.device, spec: ModelSpec, method: str, budget: Budget) -> None:
    """samples/s of one method at K samples per step on `device` (synchronized loops, median)."""
    from ..training.trainer import ParallelTrainer
    pool = make_pool(POOL, pin=True)
    feed = Feeder(pool)
    trainer = None
    if method == "packed_loop":
        model = make_model(spec, "list").to(device)
        step = _packed_step(model, _adam(model), feed, K, device)
    else:
        model = make_model(spec, "one").to(device)
        trainer = ParallelTrainer(model, _adam(model, fused=True), nn.MSELoss(), devices=[device], samples_per_device=K,
                                  pack=method == "gathered", process_group=None)
        trainer.warmup(sorted({x.shape[0] for x in pool[0]}))

        def step() -> None:
            trainer.step(*feed.next(K))
    res.set(f"diag.one_sample_plans.{spec.name}.{method}", samples_per_s(step, device, K, budget, trainer))


def samples_per_s(step: Callable[[], None], device: torch.device, k: int, budget: Budget, trainer: Any = None) -> float:
    """k / the median time of `step` (synchronized loops of ~1 s after 2 warm-up steps); closes
    `trainer`, if given, whatever happens."""
    try:
        ts = time_loop(step, synchronizer([device]), repeats=budget.merge_repeats, warmup=2, target_s=1.0,
                       min_iters=3)
    finally:
        if trainer is not None:
            trainer.close()
    return k / statistics.median(ts)


def markdown_lines(plans: Dict[str, Any]) -> List[str]:
    plans = {m: v for m, v in plans.items() if v}
    if not plans:
        return []
    return (["", f"## Diagnostics: one-sample models at k={K}, one GPU (samples/s)", "",
             "gathered: the passes' recurrent and Linear calls as one batch each (pack=True); sample_graphs: per-sample graphs on "
             "16 lanes (pack=False); packed_loop: the plain one-GPU loop of the list model.", "",
             "| model | " + " | ".join(METHODS) + " |", "|---|" + "---|" * len(METHODS)]
            + [f"| {m} | " + " | ".join(fmt(v.get(x)) for x in METHODS) + " |" for m, v in plans.items()])
