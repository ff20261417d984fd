"""The training loop over a dataset: what ParallelTrainer.fit runs.

(Being unified with vlseq-train's resumable loop: see the CLI package.)
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .scheduling import sample_length


def fit(trainer, data, epochs: int = 1, max_steps: Optional[int] = None, shuffle: bool = False,
        seed: int = 0, val_data=None, log_every: int = 0) -> List[Dict[str, float]]:
    """See ParallelTrainer.fit."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    history: List[Dict[str, float]] = []
    steps_done = 0
    for epoch in range(epochs):
        order = None
        if shuffle and hasattr(data, "__len__") and hasattr(data, "__getitem__"):
            g = torch.Generator().manual_seed(seed + epoch)
            order = torch.randperm(len(data), generator=g).tolist()
        it = (data[i] for i in order) if order is not None else iter(data)
        t0 = time.perf_counter()
        total = torch.zeros((), device=trainer.master_device)
        n = steps = 0
        batch: List[Tuple[Any, Any]] = []
        stop = False
        for item in it:
            batch.append(item)
            if len(batch) == trainer.samples_per_step * trainer.world_size:  # [distributed] a global step
                total += _fit_step(trainer, batch)
                n, steps, batch = n + len(batch), steps + 1, []
                if max_steps is not None and steps_done + steps >= max_steps:
                    stop = True
                    break
        if batch and not stop:
            total += _fit_step(trainer, batch)
            n, steps = n + len(batch), steps + 1
        if n == 0:
            raise ValueError("empty dataset: no samples to train on")
        if trainer.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        steps_done += steps
        rec = {"epoch": epoch, "loss": float(total) / n, "samples": n, "steps": steps,
               "samples_per_s": n / elapsed if elapsed > 0 else math.inf, "skipped_steps": trainer.skipped_steps}
        if val_data is not None:
            vx, vy = zip(*[(x, y) for x, y in val_data])
            _, losses = trainer.evaluate(list(vx), list(vy))
            rec["val_loss"] = float(losses.mean())
        history.append(rec)
        if stop:
            break
    return history


def _fit_step(trainer, batch: List[Tuple[Any, Any]]) -> Tensor:
    mine = batch
    if trainer.world_size > 1:  # [distributed] this rank's longest-first share of the global step
        mine = [batch[i] for i in trainer.shard([sample_length(b[0]) for b in batch])]
    loss = trainer.step([b[0] for b in mine], [b[1] for b in mine])  # the global loss: sum, or mean
    return loss * len(batch) if trainer.reduction == "mean" else loss
