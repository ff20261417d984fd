"""One vlseq-train run: its parts built from the configuration (build_run), restored from a checkpoint
when resuming (restore_run) and saved to one (save_run); the run folder's lock; validation.

Under torchrun every process builds the same run; rank 0 alone prints, writes metrics, the plot and
checkpoints (the master's model and optimizer are identical on every rank)."""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .._version import __version__
from ..checkpoint import CHECKPOINT_NAME, FORMAT, CheckpointWriteError, build_model, capture_rng_state, \
    restore_rng_state, save_checkpoint
from ..data import DataError, RaggedDataset, open_dataset, split
from ..data.samplers import DistributedLengthSampler
from ..devices import parse_devices
from ..distributed import ProcessGroup
from ..training.loop import TrainingLoop
from ..training.trainer import ParallelTrainer
from . import file_rules
from .checks import CLIError, check_model_size, devices_error
from .config import PROG, RunConfig
from .reporting import RunState

__all__ = ["Run", "build_run", "restore_run", "save_run", "evaluate_split"]


@dataclass
class Run:
    """The parts of one run. `meta` describes the training data (saved in checkpoints, so a resume can
    check it gets the same data); `state` holds the counters and history; `saved_step` is the step of
    the checkpoint on disk (None before the first)."""
    config: RunConfig
    group: ProcessGroup
    data: RaggedDataset
    val: Optional[RaggedDataset]
    meta: Dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    trainer: ParallelTrainer
    sampler: DistributedLengthSampler
    loop: TrainingLoop
    state: RunState
    saved_step: Optional[int] = None

    @property
    def main(self) -> bool:
        """[distributed] rank 0, which alone prints, writes metrics, the plot and checkpoints."""
        return self.group.rank == 0

    @property
    def samples_per_step(self) -> int:
        """Samples of one global step (every process's devices x samples per device)."""
        return self.sampler.batch_size

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.config.checkpoint_dir) / CHECKPOINT_NAME

    def devices_text(self) -> str:
        devs = self.trainer.devices
        text = str(devs[0]) if len(devs) == 1 else (
            f"{devs[0]} x{len(devs)}" if len(set(devs)) == 1 else ", ".join(map(str, devs)))
        return f"{self.group.world_size} processes x ({text})" if self.group.world_size > 1 else text


def say(main: bool, line: str) -> None:
    if main:
        print(f"{PROG}: {line}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# build


def build_run(config: RunConfig, group: ProcessGroup, resumed_data: Optional[Dict[str, Any]] = None) -> Run:
    """Data, model, optimizer, ParallelTrainer, sampler and TrainingLoop of `config`, seeded. With
    `resumed_data` (a checkpoint's data description) the data must be the resumed run's."""
    seed = config.seed
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    try:
        devices = parse_devices(config.devices)
    except ValueError as exc:
        raise devices_error(config.devices, exc) from None
    data, val = _open_data(config, group.rank == 0)
    meta = {"name": data.name, "num_features": data.num_features, "task": data.task, "output_dim": data.output_dim,
            "num_train": len(data), "class_names": data.class_names, "fingerprint": data.fingerprint()}
    if resumed_data is not None:
        _check_same_data(data, meta, resumed_data)
    check_model_size(config.model, data.num_features, config.hidden, config.layers, data.output_dim,
                     f"{data.name} ({data.num_features} features, {data.output_dim} outputs) with --hidden "
                     f"{config.hidden} --layers {config.layers}", len(devices) if devices[0].type == "cpu" else 1)
    model = build_model(config.saved(), meta)
    on_gpu = devices[0].type == "cuda"
    if on_gpu:
        model.to(devices[0])
    # Fused Adam on GPUs: one kernel per step, and the trainer's non-finite guard then skips bad steps
    # on the device without a host sync.
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=on_gpu or None)
    loss_fn = nn.CrossEntropyLoss() if data.task == "classification" else nn.MSELoss()
    try:
        trainer = ParallelTrainer(model, optimizer, loss_fn, devices=devices, nonfinite="skip", track_grad_norm=True,
                                  process_group=group, **config.trainer_options())
    except ValueError as exc:
        raise CLIError(f"cannot train on --devices {config.devices}: {exc}") from None
    try:  # [distributed] every rank read its own copy of the data: the same copy?
        trainer.group.check_same("training samples", len(data))
        trainer.group.check_same("training data (same size, other values, lengths or targets)",
                                 int(meta["fingerprint"][:15], 16), show=False)
    except ValueError as exc:
        raise DataError(f"{data.name}: {exc}") from None
    # Global steps (processes x devices x k samples), the same on every rank; each trains its share.
    sampler = DistributedLengthSampler(data.lengths, trainer.samples_per_device, len(trainer.devices),
                                       trainer.group.world_size, seed=seed)
    loop = TrainingLoop(trainer, sampler, data.__getitem__, max_steps=config.max_steps, epochs=config.epochs)
    return Run(config, trainer.group, data, val, meta, model, optimizer, trainer, sampler, loop, RunState())


def _open_data(config: RunConfig, main: bool) -> Tuple[RaggedDataset, Optional[RaggedDataset]]:
    data, val = open_dataset(config.data, config.task, config.drop_nonfinite, config.seed, config.synthetic_samples)
    for ds in (data, val):
        if ds is not None and ds.dropped:
            say(main, f"{ds.name}: dropped {ds.dropped} of {len(ds) + ds.dropped} samples with NaN/inf values or "
                      "values that overflow float32")
    if val is None:
        data, val = split(data, config.val_fraction, config.seed)
    if val is not None and (val.num_features, val.task) != (data.num_features, data.task):
        raise DataError(f"{val.name}: {val.num_features} features ({val.task}), but {data.name} has "
                        f"{data.num_features} ({data.task})")
    if data.task == "classification":
        labels = np.unique(data.targets.numpy())
        if len(labels) == 1:
            say(main, f"warning: {data.name}: every training sample has class {int(labels[0])}: a classifier "
                      "trained on a single class learns nothing useful")
    return data, val


def _check_same_data(data: RaggedDataset, meta: Dict[str, Any], old: Dict[str, Any]) -> None:
    if old["num_features"] != data.num_features:
        raise DataError(f"{data.name}: {data.num_features} features per step, but the checkpoint's model was "
                        f"trained on {old['num_features']} ({old.get('name')})")
    if (old["task"], old["output_dim"]) != (data.task, data.output_dim):
        what = "classes" if data.task == "classification" else "target values"
        raise DataError(f"{data.name}: {data.task} with {data.output_dim} {what}, but the checkpoint's model "
                        f"does {old['task']} with {old['output_dim']}")
    if old.get("num_train") != len(data):
        raise DataError(f"{data.name}: {len(data)} training samples, the checkpoint's run had "
                        f"{old.get('num_train')}; resume on the same data")
    if old.get("fingerprint") not in (None, meta["fingerprint"]):  # None: a checkpoint written before fingerprints
        raise DataError(f"{data.name}: not the data of the checkpoint's run (as many training samples, other "
                        "values, lengths or targets); resume on the same data")


# ------------------------------------------------------------------------------------------------
# restore and save


def restore_run(run: Run, ckpt: Dict[str, Any]) -> Optional[int]:
    """Model, optimizer, trainer, loop, sampler, counters and RNGs from a checkpoint (built on the same
    data: build_run(resumed_data=...)). Returns the checkpoint's step size when it differs from this
    run's (the rest of the epoch is cut anew), else None."""
    run.model.load_state_dict(ckpt["model"])
    try:
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CLIError(f"--resume: {run.checkpoint_path}: inconsistent: the optimizer state does not fit the model "
                       f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    for group in run.optimizer.param_groups:  # an --lr given now wins over the saved one
        group["lr"] = run.config.lr
    run.trainer.load_state_dict(ckpt["trainer"])  # after model and optimizer: it re-syncs the replicas
    # Checkpoints written before the loop's own state had the step in "run" only.
    loop_state = ckpt.get("loop") or {"step": int(ckpt["run"]["step"]), "sampler": ckpt["sampler"]}
    try:
        run.loop.load_state_dict({**loop_state, "sampler": ckpt["sampler"]})
    except (ValueError, KeyError) as exc:
        raise CLIError(f"--resume: {exc}") from None
    run.state = RunState(ckpt.get("run"))
    run.state.step = run.saved_step = run.loop.step
    restore_rng_state(ckpt["rng"])  # last: building the model drew from the RNGs
    saved_step_size = int(ckpt["sampler"].get("batch_size", run.samples_per_step))
    return saved_step_size if saved_step_size != run.samples_per_step else None


def save_run(run: Run) -> None:
    """Atomically checkpoint everything a resume needs to continue exactly here (rank 0 only: the
    master's model and optimizer are identical on every rank). A failed write keeps the previous
    checkpoint and stops the run (CLIError)."""
    if not run.main:
        return
    run.state.step = run.loop.step
    try:
        save_checkpoint({"format": FORMAT, "version": __version__, "config": run.config.saved(), "data": run.meta,
                         "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                         "trainer": run.trainer.state_dict(), "sampler": run.sampler.state_dict(),
                         "loop": run.loop.state_dict(), "run": run.state.state_dict(), "rng": capture_rng_state()},
                        run.checkpoint_path)
    except CheckpointWriteError as exc:
        kept = (f"the checkpoint of step {run.saved_step} there is kept" if run.saved_step is not None
                else "no checkpoint was written")
        raise CLIError(f"cannot save the checkpoint of step {run.loop.step} to {run.checkpoint_path}: "
                       f"{exc.reason}; {kept}") from None
    run.saved_step = run.loop.step


def remove_replaced_checkpoint(run: Run) -> None:
    """--overwrite, once the data, devices and model checked out (file rule "overwrite")."""
    if not run.main:
        return
    try:
        run.checkpoint_path.unlink(missing_ok=True)
    except OSError as exc:
        file_rules.refuse("overwrite", path=run.checkpoint_path, reason=exc.strerror or exc)


# ------------------------------------------------------------------------------------------------
# validation


def evaluate_split(trainer: ParallelTrainer, val: RaggedDataset, chunk: int = 256) -> Dict[str, float]:
    """Mean per-sample loss (and accuracy for classification) of the master model on a held-out split.
    [distributed] Every rank evaluates every world_size-th sample; one sum across ranks."""
    order = np.argsort(-val.lengths, kind="stable")  # similar lengths together: cheaper packed batches
    group = trainer.group
    order = order[group.rank::group.world_size]
    master = trainer.master_device
    totals = torch.zeros(2, dtype=torch.float64, device=master)  # [loss sum, correct]
    for s in range(0, len(order), chunk):
        items = [val[int(i)] for i in order[s:s + chunk]]
        out, losses = trainer.evaluate([x for x, _ in items], [y for _, y in items])
        totals[0] += losses.double().sum().to(master)
        if val.task == "classification":
            totals[1] += (out.argmax(1) == torch.stack([y for _, y in items]).to(out.device)).sum().to(master)
    loss_sum, hits = group.sum_(totals).tolist()
    res = {"val_loss": loss_sum / len(val)}
    if val.task == "classification":
        res["val_accuracy"] = hits / len(val)
    return res
