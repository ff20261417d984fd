"""What the estimators do with torch, without aeon: series to tensors (checked), input scaling, the
validation split, the training run on ParallelTrainer (early stopping with the best weights
restored, a learning-rate schedule, tqdm progress) and batched prediction.

Everything here is importable without aeon; vlseq_ext.estimators.base wraps it as aeon estimators.
"""
from __future__ import annotations

import copy
from dataclasses import fields
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

from ..devices import parse_devices
from ..training.loop import Callback, TrainingLoop
from ..data.samplers import LengthBucketSampler
from ..training.options import TrainerOptions
from ..training.trainer import ParallelTrainer

__all__ = ["as_series", "Scaler", "SCALINGS", "LR_SCHEDULES", "validation_folds", "trainer_options",
           "train_network", "predict_outputs", "predict_device"]

SCALINGS = ("standard", "series", None)
LR_SCHEDULES = ("plateau", "cosine", None)
# the estimator's own choices; trainer_kwargs may not set them again
_OWN_TRAINER_ARGS = ("model", "optimizer", "loss_fn", "devices", "samples_per_device", "reduction",
                     "clip_grad_norm")
_TRAINER_ARGS = frozenset({"model", "optimizer", "loss_fn", "devices"} | {f.name for f in fields(TrainerOptions)})


def as_series(X: Sequence[np.ndarray], n_channels: Optional[int] = None) -> List[np.ndarray]:
    """aeon's np-list (each series (channels, length)) -> float32 arrays (length, channels), checked
    after the cast: ValueError naming the first series that is empty, has another channel count,
    or holds a value that is not finite in float32 (NaN, inf, or beyond float32's range)."""
    out = []
    for i, x in enumerate(X):
        a = np.asarray(x)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2:
            raise ValueError(f"X: series {i} has shape {a.shape}; expected (channels, length)")
        if a.shape[1] == 0 or a.shape[0] == 0:
            raise ValueError(f"X: series {i} is empty (shape {a.shape})")
        want = n_channels if n_channels is not None else (out[0].shape[1] if out else a.shape[0])
        if a.shape[0] != want:
            what = "the estimator was fitted on" if n_channels is not None else "series 0 has"
            raise ValueError(f"X: series {i} has {a.shape[0]} channel(s) but {what} {want}")
        with np.errstate(over="ignore", invalid="ignore"):
            f = np.ascontiguousarray(a.T, dtype=np.float32)
        if not np.isfinite(f).all():
            c, t = np.unravel_index(int(np.argmax(~np.isfinite(f.T))), a.shape)
            v = a[c, t]
            why = "overflows float32" if np.isfinite(v) else "is not finite"
            raise ValueError(f"X: series {i} has the value {float(v):g} at channel {c}, step {t}, which {why}")
        out.append(f)
    return out


class Scaler:
    """Input scaling. "standard": each channel shifted and scaled by its mean and standard deviation
    over every step of the training series (fitted once, applied to every later input); "series":
    each series standardised on its own (per channel; nothing to fit); None: inputs as given."""

    def __init__(self, mode: Optional[str]) -> None:
        if mode not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {mode!r}")
        self.mode = mode
        self.mean_: Optional[np.ndarray] = None
        self.scale_: Optional[np.ndarray] = None

    def fit(self, series: Sequence[np.ndarray]) -> "Scaler":
        if self.mode == "standard":
            allv = np.concatenate(series).astype(np.float64)
            self.mean_ = allv.mean(0)
            std = allv.std(0)
            # a constant channel is only shifted (dividing by ~0 would blow its rounding noise up)
            self.scale_ = np.where(std > 1e-12 * np.maximum(1.0, np.abs(self.mean_)), std, 1.0)
        return self

    def transform(self, series: Sequence[np.ndarray]) -> List[np.ndarray]:
        if self.mode == "standard":
            mean, scale = self.mean_.astype(np.float32), self.scale_.astype(np.float32)
            return [(s - mean) / scale for s in series]
        if self.mode == "series":
            out = []
            for s in series:
                std = s.std(0)
                out.append((s - s.mean(0)) / np.where(std > 0, std, 1.0).astype(np.float32))
            return out
        return list(series)


def validation_folds(y: np.ndarray, fraction: float, seed: int, stratify: bool,
                     count: int = 1) -> List[Tuple[np.ndarray, Optional[np.ndarray]]]:
    """(training indices, validation indices or None) for each of `count` networks. The series are
    dealt into K = round(1 / fraction) folds (within each class for classification, so each class
    gives about `fraction` of its series to every fold); network m validates on fold m mod K, so
    K networks together train on every series. No validation when fraction is 0, when there are
    fewer than 4 series, or when a class has a single series (it could not be both trained on and
    validated)."""
    n = len(y)
    every = np.arange(n)
    if not fraction or n < 4 or (stratify and np.unique(y, return_counts=True)[1].min() < 2):
        return [(every, None)] * count
    k = max(2, int(round(1 / fraction)))
    rng = np.random.default_rng(seed)
    fold = np.empty(n, np.int64)
    groups = [np.flatnonzero(y == c) for c in np.unique(y)] if stratify else [every]
    start = 0
    for idx in groups:  # dealt round robin, each class starting where the last one stopped
        fold[rng.permutation(idx)] = (start + np.arange(len(idx))) % k
        start = (start + len(idx)) % k
    out = []
    for m in range(count):
        val = np.flatnonzero(fold == m % k)
        out.append((np.setdiff1d(every, val), val) if 0 < len(val) < n else (every, None))
    return out


def trainer_options(trainer_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """trainer_kwargs checked against ParallelTrainer's signature: ValueError for an unknown name or
    one of the estimator's own parameters."""
    if trainer_kwargs is None:
        return {}
    if not isinstance(trainer_kwargs, dict):
        raise ValueError(f"trainer_kwargs must be a dict of ParallelTrainer arguments or None, "
                         f"got {type(trainer_kwargs).__name__}")
    own = sorted(set(trainer_kwargs) & set(_OWN_TRAINER_ARGS))
    if own:
        raise ValueError(f"trainer_kwargs: {', '.join(own)} are the estimator's own parameters; set them on the "
                         "estimator (devices, samples_per_device, clip_grad_norm)")
    unknown = sorted(set(trainer_kwargs) - _TRAINER_ARGS)
    if unknown:
        raise ValueError(f"trainer_kwargs: unknown ParallelTrainer argument(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(_TRAINER_ARGS - set(_OWN_TRAINER_ARGS)))})")
    return dict(trainer_kwargs)


def augmented(x: Tensor, strength: float, rng: np.random.Generator) -> Tensor:
    """A randomly distorted copy of one (L, C) series, for training on few series: stretched in time
    by exp(N(0, s)) (linear interpolation, so its length changes with it), each channel scaled by
    1 + N(0, s), and N(0, s / 2) noise added per value (the inputs are standardised, so s is in units
    of a channel's spread)."""
    a = x.numpy()
    length = len(a)
    new = max(1, int(round(length * math.exp(rng.normal(0.0, strength)))))
    if new != length:
        pos = np.linspace(0.0, length - 1, new)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, length - 1)
        w = (pos - lo)[:, None]
        a = a[lo] * (1 - w) + a[hi] * w
    a = a * (1.0 + rng.normal(0.0, strength, (1, a.shape[1]))) + rng.normal(0.0, strength / 2, a.shape)
    return torch.from_numpy(a.astype(np.float32))


class _EpochEnd(Callback):
    """Per epoch: the mean training loss, the validation loss, the best weights so far, the
    learning-rate schedule, early stopping and the progress bar."""

    def __init__(self, trainer: ParallelTrainer, val: Optional[Tuple[List[Tensor], List[Tensor]]],
                 scheduler: Any, patience: Optional[int], bar: tqdm, eval_batch: int) -> None:
        self.trainer, self.val, self.scheduler, self.patience, self.bar = trainer, val, scheduler, patience, bar
        self.eval_batch = eval_batch
        self.history: List[Dict[str, float]] = []
        self.best_loss, self.best_epoch, self.best_state = math.inf, -1, None
        self.wait = 0
        self._sum: Optional[Tensor] = None
        self._n = 0

    def on_step(self, loop: TrainingLoop, batch: Sequence[Any], loss: Tensor) -> None:
        part = loss.detach() * len(batch)  # reduction "mean": the step's loss sum
        self._sum = part if self._sum is None else self._sum + part
        self._n += len(batch)

    def on_epoch_end(self, loop: TrainingLoop) -> None:
        train_loss = float(self._sum) / self._n  # one host sync per epoch
        self._sum, self._n = None, 0
        optimizer = self.trainer.optimizer
        rec = {"epoch": loop.epoch, "loss": train_loss, "lr": optimizer.param_groups[0]["lr"]}
        watched = train_loss
        if self.val is not None:
            _, losses = self.trainer.evaluate(self.val[0], self.val[1], batch_size=self.eval_batch)
            watched = rec["val_loss"] = float(losses.mean())
        if watched < self.best_loss:  # NaN never counts as better
            self.best_loss, self.best_epoch, self.wait = watched, loop.epoch, 0
            if self.val is not None:
                self.best_state = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
        else:
            self.wait += 1
        self.history.append(rec)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(watched if math.isfinite(watched) else math.inf)
        elif self.scheduler is not None:
            self.scheduler.step()
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in rec.items() if k != "epoch"}, refresh=False)
        self.bar.update()
        if self.patience is not None and self.val is not None and self.wait >= self.patience:
            loop.request_stop("early_stopping")


def train_network(model: nn.Module, xs: List[Tensor], ys: List[Tensor],
                  val: Optional[Tuple[List[Tensor], List[Tensor]]], loss_fn: nn.Module, *, devices: Any,
                  samples_per_device: Optional[int], batch_size: int, n_epochs: int, lr: float, weight_decay: float,
                  lr_schedule: Optional[str], patience: Optional[int], clip_grad_norm: Optional[float],
                  bucket_batches: int, seed: int, verbose: bool, trainer_kwargs: Optional[Dict[str, Any]],
                  augment: float = 0.0, desc: str = "fit") -> Dict[str, Any]:
    """Trains `model` in place on (xs, ys) with ParallelTrainer and AdamW, steps of samples_per_device
    x devices series (batch_size split over the devices when samples_per_device is None) drawn by
    LengthBucketSampler (each batch sorted by length within groups of `bucket_batches` batches),
    each series distorted afresh at every draw when `augment` > 0 (see `augmented`).
    With `val`, the validation loss drives the schedule and early stopping (`patience` epochs
    without improvement), and the weights of the best epoch are restored at the end. Leaves the
    model on the CPU in eval mode. Returns {history, best_epoch, n_epochs, stop_reason, devices,
    samples_per_device, fit_seconds}."""
    t0 = time.perf_counter()
    options = trainer_options(trainer_kwargs)
    options.setdefault("process_group", None)  # an estimator trains in this process only
    devs = parse_devices(devices)
    k = samples_per_device if samples_per_device is not None else max(1, -(-batch_size // len(devs)))
    model.to(devs[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                  **({"fused": True} if devs[0].type == "cuda" else {}))
    if lr_schedule == "plateau":
        # halve the rate after a third of the patience without improvement, so it drops before stopping
        wait = max(1, (patience if patience is not None else 30) // 3)
        scheduler: Any = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=wait,
                                                                    min_lr=lr * 1e-3)
    elif lr_schedule == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=n_epochs, eta_min=lr * 1e-2)
    else:
        scheduler = None
    trainer = ParallelTrainer(model, optimizer, loss_fn, devices=devs, samples_per_device=k, reduction="mean",
                              clip_grad_norm=clip_grad_norm, **options)
    bar = tqdm(total=n_epochs, desc=desc, unit="epoch", disable=not verbose, leave=False, dynamic_ncols=True)
    end = _EpochEnd(trainer, val, scheduler, patience, bar, eval_batch=256)
    try:
        sampler = LengthBucketSampler([len(x) for x in xs], trainer.samples_per_step, shuffle=True, seed=seed,
                                      bucket_batches=bucket_batches)
        rng = np.random.default_rng([seed, 7])
        get_item = (lambda i: (augmented(xs[i], augment, rng), ys[i])) if augment else (lambda i: (xs[i], ys[i]))
        loop = TrainingLoop(trainer, sampler, get_item, epochs=n_epochs, callbacks=[end])
        stop_reason = loop.run()
    finally:
        bar.close()
        trainer.close()
    if end.best_state is not None:
        model.load_state_dict(end.best_state)
    model.to("cpu").eval()
    if verbose:
        best = f", best epoch {end.best_epoch + 1}" if val is not None else ""
        tqdm.write(f"{desc}: {len(end.history)} epoch(s) on {len(devs)} x {devs[0].type}{best} "
                   f"({stop_reason}), {time.perf_counter() - t0:.1f} s")
    return {"history": end.history, "best_epoch": end.best_epoch, "n_epochs": len(end.history),
            "stop_reason": stop_reason, "devices": [str(d) for d in devs], "samples_per_device": k,
            "fit_seconds": time.perf_counter() - t0}


def predict_device(devices: Any) -> torch.device:
    """Where to predict: the first of `devices` when they exist here, else the CPU (a model fitted
    on a GPU predicts on a machine without one)."""
    try:
        return parse_devices(devices)[0]
    except ValueError:
        return torch.device("cpu")


@torch.no_grad()
def predict_outputs(model: nn.Module, xs: Sequence[np.ndarray], device: torch.device,
                    batch_size: int = 256) -> np.ndarray:
    """The model's outputs (N, O) for each series, in float64, in batches of similar lengths. `model`
    (eval mode, on the CPU) is not changed: a GPU gets a copy."""
    net = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    order = np.argsort([-len(x) for x in xs], kind="stable")
    out = np.empty((len(xs), model.output_dim), dtype=np.float64)
    for s in range(0, len(xs), batch_size):
        idx = order[s:s + batch_size]
        batch = [torch.from_numpy(xs[i]).to(device) for i in idx]
        out[idx] = net(batch).double().cpu().numpy()
    return out
