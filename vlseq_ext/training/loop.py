"""The one training loop of vlseq_ext: `TrainingLoop`, resumable, used by ParallelTrainer.fit (through
`fit` below) and by vlseq-train.

A loop walks a resumable batch sampler: every batch it yields is one *global* step (the same on every
process under torchrun), which the loop cuts with `trainer.shard(lengths)` into this process's share
(longest first over every process's devices) before `trainer.step`. It stops after `max_steps` steps
in total, after `epochs` epochs, or after the step at which a stop was requested (`request_stop`, e.g.
from a signal handler; with several processes every rank stops after the same step: the request rides
in the step's all-reduce, and `trainer.group.stop_agreed` gives every rank the same answer).

Its state (`state_dict`: step, epoch, position within the epoch, and the sampler's own state) saved
after any step resumes exactly there: a resumed loop runs the same steps, in the same order, as one
that was never interrupted.

Sampler protocol (vlseq_ext.data.samplers: LengthBucketSampler, DistributedLengthSampler,
OrderedBatches, IterableBatches): attributes `epoch` and `position` (batches of this epoch already handed out),
`__iter__` yielding the rest of the current epoch's batches, `set_epoch(e)`, `state_dict()` /
`load_state_dict()`, and `__len__` (batches per epoch) or `epoch_over()` when the length is unknown
up front. A batch is a list of keys; `get_item(key)` returns the sample (x, y).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..data.samplers import IterableBatches, OrderedBatches
from .scheduling import sample_length

__all__ = ["TrainingLoop", "Callback", "fit"]


class Callback:
    """Hooks of a TrainingLoop; override any. All get the loop (`loop.step`, `loop.epoch`,
    `loop.position`, `loop.sampler`, `loop.trainer`)."""

    def on_step(self, loop: "TrainingLoop", batch: Sequence[Any], loss: Tensor) -> None:
        """After every step. `batch`: the global step's keys; `loss`: trainer.step's return value
        (the step's global loss, sum or mean per trainer.reduction)."""

    def on_epoch_end(self, loop: "TrainingLoop") -> None:
        """After the last step of an epoch, before the sampler moves on: `loop.epoch` is still the
        finished epoch's index."""

    def on_step_end(self, loop: "TrainingLoop", epoch_end: bool, stopping: bool) -> None:
        """Last thing of every step, after the move to the next epoch (when `epoch_end`) and the
        decision to stop (`stopping`, with `loop.stop_reason`): where a checkpoint belongs."""


class TrainingLoop:
    """Trains `trainer` on the batches of `sampler`; see the module docstring.

    Args:
        trainer: a ParallelTrainer (or anything with step, shard and a process group `group`).
        sampler: a resumable batch sampler (module docstring); each batch is one global step.
        get_item: key -> (x, y).
        max_steps, epochs: stop after this many steps in total / once `sampler.epoch` reaches this
            many epochs (None: no such limit; at least one must be given).
        callbacks: Callback instances, called in order.

    `run()` returns `stop_reason`: "max_steps", "epochs" or, after `request_stop(reason)`, that
    reason ("peer" when only another process asked).
    """

    def __init__(self, trainer: Any, sampler: Any, get_item: Callable[[Any], Tuple[Any, Any]],
                 max_steps: Optional[int] = None, epochs: Optional[int] = None,
                 callbacks: Sequence[Callback] = ()) -> None:
        if max_steps is None and epochs is None:
            raise ValueError("TrainingLoop: give max_steps or epochs (or both)")
        for name, v in (("max_steps", max_steps), ("epochs", epochs)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if _known_len(sampler) == 0:
            raise ValueError("empty dataset: no samples to train on")
        self.trainer, self.sampler, self.get_item = trainer, sampler, get_item
        self.max_steps, self.epochs = max_steps, epochs
        self.callbacks = list(callbacks)
        self.step = 0
        self.stop_reason: Optional[str] = None
        self._requested: Optional[Any] = None

    # -- state ----------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self.sampler.epoch)

    @property
    def position(self) -> int:
        return int(self.sampler.position)

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "position": self.position,
                "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue at the saved step (the sampler may reject a state that does not fit it: ValueError)."""
        self.sampler.load_state_dict(state["sampler"] if "sampler" in state else
                                     {"epoch": state["epoch"], "position": state["position"]})
        self.step = int(state["step"])
        self.stop_reason = None

    # -- stopping -------------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether a limit (max_steps, epochs) is reached."""
        return self._limit() is not None

    def _limit(self) -> Optional[str]:
        if self.max_steps is not None and self.step >= self.max_steps:
            return "max_steps"
        if self.epochs is not None and self.epoch >= self.epochs:
            return "epochs"
        return None

    def request_stop(self, reason: Any = "requested") -> None:
        """Stop after the current (or next) step; safe to call from a signal handler. With several
        processes every rank stops after the same step, once the request has reached all of them."""
        if self._requested is None:
            self._requested = reason
            self.trainer.group.request_stop()

    def total_steps(self) -> Optional[int]:
        """Steps of the whole run, when known: min(max_steps, epochs x steps per epoch)."""
        n = _known_len(self.sampler)
        limits = [t for t in (self.max_steps, self.epochs * n if self.epochs and n is not None else None) if t]
        return min(limits) if limits else None

    def _should_stop(self) -> bool:
        reason = self._limit()
        if reason is None and self.trainer.group.stop_agreed(self._requested is not None):
            reason = self._requested if self._requested is not None else "peer"  # "peer": another rank asked
        if reason is not None:
            self.stop_reason = reason
        return reason is not None

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> Optional[str]:
        """Train until a limit or a stop request; returns stop_reason."""
        trainer, sampler = self.trainer, self.sampler
        self.stop_reason = self._limit()
        while self.stop_reason is None:
            if _epoch_over(sampler):  # never saved so; be safe anyway
                sampler.set_epoch(self.epoch + 1)
                self.stop_reason = self._limit()
                continue
            stepped = False
            for batch in sampler:
                stepped = True
                items = [self.get_item(k) for k in batch]
                if trainer.group.world_size > 1:  # this process's longest-first share of the global step
                    items = [items[i] for i in trainer.shard([sample_length(x) for x, _ in items])]
                loss = trainer.step([x for x, _ in items], [y for _, y in items])
                self.step += 1
                for cb in self.callbacks:
                    cb.on_step(self, batch, loss)
                epoch_end = _epoch_over(sampler)
                if epoch_end:
                    self._end_epoch()
                stopping = self._should_stop()
                for cb in self.callbacks:
                    cb.on_step_end(self, epoch_end, stopping)
                if stopping:
                    return self.stop_reason
            if not stepped:
                if self.step == 0 and self.position == 0:
                    raise ValueError("empty dataset: no samples to train on")
                if self.position == 0:  # an epoch that gave nothing after one that gave samples
                    raise ValueError(f"epoch {self.epoch + 1}: the data gave no samples, after {self.step} steps "
                                     "of earlier epochs (an iterable that can be read only once?); pass data that "
                                     "gives its samples every epoch")
                sampler.set_epoch(self.epoch + 1)
                self.stop_reason = self._limit()
        return self.stop_reason

    def _end_epoch(self) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(self)
        self.sampler.set_epoch(self.epoch + 1)


def _known_len(sampler: Any) -> Optional[int]:
    try:
        return len(sampler)
    except TypeError:
        return None


def _epoch_over(sampler: Any) -> bool:
    over = getattr(sampler, "epoch_over", None)
    if over is not None:
        return bool(over())
    return sampler.position >= len(sampler)


# ------------------------------------------------------------------------------------------------
# ParallelTrainer.fit


class _FitHistory(Callback):
    """fit's per-epoch records: loss (per-sample mean), samples, steps, samples/s, skipped steps,
    val_loss."""

    def __init__(self, trainer: Any, val_data: Any) -> None:
        self.trainer, self.val_data = trainer, val_data
        self.history: List[Dict[str, float]] = []
        self._open = False

    def _start(self) -> None:
        self._open = True
        self.total: Optional[Tensor] = None
        self.n = self.steps = 0
        self.t0 = time.perf_counter()

    def on_step(self, loop: TrainingLoop, batch: Sequence[Any], loss: Tensor) -> None:
        if not self._open:
            self._start()
        part = loss * len(batch) if self.trainer.reduction == "mean" else loss  # the step's loss sum
        self.total = part if self.total is None else self.total + part
        self.n, self.steps = self.n + len(batch), self.steps + 1

    def on_epoch_end(self, loop: TrainingLoop) -> None:
        self._close(loop.epoch)

    def on_step_end(self, loop: TrainingLoop, epoch_end: bool, stopping: bool) -> None:
        if stopping and self._open:  # max_steps in the middle of an epoch: a record of its part
            self._close(loop.epoch)

    def _close(self, epoch: int) -> None:
        self._open = False
        if any(d.type == "cuda" for d in self.trainer.devices):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        rec = {"epoch": epoch, "loss": float(self.total) / self.n, "samples": self.n, "steps": self.steps,
               "samples_per_s": self.n / elapsed if elapsed > 0 else math.inf,
               "skipped_steps": self.trainer.skipped_steps}
        if self.val_data is not None:
            pairs = [(x, y) for x, y in self.val_data]
            if not pairs:
                raise ValueError(f"fit: val_data gave no samples for epoch {epoch + 1} (an iterator read in an earlier "
                                 "epoch?); pass a list or a Dataset")
            vx, vy = zip(*pairs)
            _, losses = self.trainer.evaluate(list(vx), list(vy))
            rec["val_loss"] = float(losses.mean())
        self.history.append(rec)


def fit(trainer: Any, data: Any, epochs: int = 1, max_steps: Optional[int] = None, shuffle: bool = False,
        seed: int = 0, val_data: Any = None) -> List[Dict[str, float]]:
    """See ParallelTrainer.fit: a TrainingLoop over `data` in order (or shuffled per epoch with
    seed + epoch), global steps of world_size x samples_per_step samples, the last one of an epoch
    possibly short. `data` with __len__ and __getitem__ is read by index; anything else (a
    DataLoader) is iterated once per epoch. Returns one record per epoch (the last one covers the
    part trained before max_steps)."""
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    for name, given in (("data", data), ("val_data", val_data)):
        if epochs > 1 and isinstance(given, Iterator):  # a generator or other iterator: read once, then empty
            raise ValueError(f"fit: {name} is an iterator ({type(given).__name__}), which gives its samples once, so "
                             f"it cannot give epoch 2 of {epochs}: pass a list, a Dataset or a DataLoader, or epochs=1")
    if val_data is not None and hasattr(val_data, "__len__") and len(val_data) == 0:
        raise ValueError("fit: val_data is empty; pass validation samples, or leave it out")
    step_size = trainer.samples_per_step * trainer.group.world_size  # [distributed] a global step
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        trainer.group.check_same("training samples", len(data))  # else steps would pair other samples
        sampler: Any = OrderedBatches(len(data), step_size, shuffle=shuffle, seed=seed)
        get_item: Callable[[Any], Any] = data.__getitem__
    else:
        sampler, get_item = IterableBatches(data, step_size), (lambda item: item)
    history = _FitHistory(trainer, val_data)
    TrainingLoop(trainer, sampler, get_item, max_steps=max_steps, epochs=epochs, callbacks=[history]).run()
    return history.history
