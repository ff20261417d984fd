"""One vlseq-train run built from its configuration: data, model, optimizer, ParallelTrainer, sampler
and TrainingLoop, restored from a checkpoint when resuming, and saved to one.

Under torchrun every process builds the same run; rank 0 alone prints, writes metrics, the plot and
checkpoints (the master's model and optimizer are identical on every rank)."""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .. import distributed
from ..checkpoint import CHECKPOINT_NAME, FORMAT, CheckpointWriteError, build_model, capture_rng_state, \
    restore_rng_state, save_checkpoint
from ..data import DataError, RaggedDataset, open_dataset, split
from ..data.samplers import DistributedLengthSampler
from ..devices import parse_devices
from ..training.loop import TrainingLoop
from ..training.trainer import ParallelTrainer
from .checks import CLIError, check_model_size, missing_dirs, remove_empty_dirs
from .config import NOT_SAVED, PROG, __version__
from .reporting import RunState


class RunFolderLock:
    """An exclusive lock on the run folder, from the checks to the end of the run: a second vlseq-train
    on the same folder (with --overwrite or --resume too) stops with one line instead of interleaving
    its checkpoints and metrics with the live run's. flock on the directory itself, so no lock file is
    left behind, and the lock dies with the process however it ends. A folder created for the lock is
    removed again on release when the run left nothing in it. Where flock is missing (Windows, some
    network file systems) runs are not guarded."""

    def __init__(self, path: Path, created: Sequence[Path] = ()) -> None:
        """created: folders the configuration made for this run already (deepest first)."""
        self.fd: Optional[int] = None
        self.created: List[Path] = list(created)
        try:
            import fcntl
        except ImportError:
            return
        self.created += missing_dirs(path)
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CLIError(f"--checkpoint-dir {path}: another vlseq-train run is using this folder now; wait for it "
                           "to finish, or choose another --checkpoint-dir") from None
        except OSError:
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        remove_empty_dirs(self.created)


def evaluate_split(trainer: ParallelTrainer, val: RaggedDataset, chunk: int = 256) -> Dict[str, float]:
    """Mean per-sample loss (and accuracy for classification) of the master model on a held-out split.
    [distributed] Every rank evaluates every world_size-th sample; one sum across ranks."""
    order = np.argsort(-val.lengths, kind="stable")  # similar lengths together: cheaper packed batches
    group = trainer.group
    order = order[group.rank::group.world_size]
    master = next(trainer.model.parameters()).device
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


def _say(main: bool, line: str) -> None:
    if main:
        print(f"{PROG}: {line}", file=sys.stderr)


class Run:
    """Data, model, optimizer, ParallelTrainer, sampler, TrainingLoop and counters of one run,
    restored from `ckpt` when resuming."""

    def __init__(self, cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]], group: distributed.ProcessGroup) -> None:
        self.cfg = cfg
        seed = int(cfg["seed"])
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            devices = parse_devices(cfg["devices"])
        except ValueError as exc:
            raise CLIError(f"--devices {cfg['devices']}: {exc}") from None
        # [distributed] under torchrun rank 0 alone prints, writes metrics, plots and checkpoints
        self.main = group.rank == 0
        self._open_data(cfg, seed)
        data = self.data
        if ckpt is not None:
            self._check_resumable(ckpt["data"])
        check_model_size(cfg["model"], data.num_features, int(cfg["hidden"]), int(cfg["layers"]), data.output_dim,
                         f"{data.name} ({data.num_features} features, {data.output_dim} outputs) with --hidden "
                         f"{cfg['hidden']} --layers {cfg['layers']}")

        self.model = build_model(cfg, self.meta)
        on_gpu = devices[0].type == "cuda"
        if on_gpu:
            self.model.to(devices[0])
        # Fused Adam on GPUs: one kernel per step, and the trainer's non-finite guard then skips
        # bad steps on the device without a host sync.
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=float(cfg["lr"]), fused=on_gpu or None)
        loss_fn = nn.CrossEntropyLoss() if data.task == "classification" else nn.MSELoss()
        try:
            self.trainer = ParallelTrainer(self.model, self.optimizer, loss_fn, devices=devices,
                                           samples_per_device=int(cfg["samples_per_device"]),
                                           reduction=cfg["reduction"], clip_grad_norm=cfg["clip_grad"],
                                           amp=cfg["amp"], nonfinite="skip", track_grad_norm=True,
                                           process_group=group)
        except ValueError as exc:
            raise CLIError(f"cannot train on --devices {cfg['devices']}: {exc}") from None
        tr = self.trainer
        try:  # [distributed] every rank read its own copy of the data: the same copy?
            tr.group.check_same("training samples", len(data))
            tr.group.check_same("training data (same size, other values, lengths or targets)",
                                int(self.meta["fingerprint"][:15], 16), show=False)
        except ValueError as exc:
            raise DataError(f"{data.name}: {exc}") from None
        # Global steps (world_size x devices x k samples), the same on every rank; each trains its share.
        self.samples_per_step = tr.samples_per_step * tr.group.world_size
        self.sampler = DistributedLengthSampler(data.lengths, tr.samples_per_device, len(tr.devices),
                                                tr.group.world_size, seed=seed)
        self.loop = TrainingLoop(tr, self.sampler, data.__getitem__, max_steps=cfg["max_steps"],
                                 epochs=cfg["epochs"])
        self.resized_from: Optional[int] = None
        self.state = RunState(ckpt.get("run") if ckpt else None)
        self.ckpt_path = Path(cfg["checkpoint_dir"]) / CHECKPOINT_NAME
        self.saved_step: Optional[int] = None  # the step of the checkpoint on disk, when there is one
        if ckpt is not None:
            self._restore(ckpt)
            self.saved_step = self.loop.step
        devs = tr.devices
        self.devices_desc = str(devs[0]) if len(devs) == 1 else (
            f"{devs[0]} x{len(devs)}" if len(set(devs)) == 1 else ", ".join(map(str, devs)))
        if tr.group.world_size > 1:
            self.devices_desc = f"{tr.group.world_size} processes x ({self.devices_desc})"
        self.last_val: Dict[str, float] = {}
        self.samples_done = 0

    def _open_data(self, cfg: Dict[str, Any], seed: int) -> None:
        data, val = open_dataset(cfg["data"], cfg["task"], bool(cfg["drop_nonfinite"]), seed,
                                 int(cfg["synthetic_samples"]))
        for ds in (data, val):
            if ds is not None and ds.dropped:
                _say(self.main, f"{ds.name}: dropped {ds.dropped} of {len(ds) + ds.dropped} samples with NaN/inf "
                                "values or values that overflow float32")
        if val is None:
            data, val = split(data, float(cfg["val_fraction"]), seed)
        if val is not None and (val.num_features, val.task) != (data.num_features, data.task):
            raise DataError(f"{val.name}: {val.num_features} features ({val.task}), but {data.name} has "
                            f"{data.num_features} ({data.task})")
        if data.task == "classification":
            labels = np.unique(data.targets.numpy())
            if len(labels) == 1:
                _say(self.main, f"warning: {data.name}: every training sample has class {int(labels[0])}: a "
                                "classifier trained on a single class learns nothing useful")
        self.data, self.val = data, val
        self.meta = {"name": data.name, "num_features": data.num_features, "task": data.task,
                     "output_dim": data.output_dim, "num_train": len(data), "class_names": data.class_names,
                     "fingerprint": data.fingerprint()}

    def _check_resumable(self, old: Dict[str, Any]) -> None:
        data = self.data
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
        if old.get("fingerprint") not in (None, self.meta["fingerprint"]):  # (older checkpoints have none)
            raise DataError(f"{data.name}: not the data of the checkpoint's run (as many training samples, "
                            "other values, lengths or targets); resume on the same data")

    def _restore(self, ckpt: Dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model"])
        try:
            self.optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CLIError(f"--resume: {self.ckpt_path}: inconsistent: the optimizer state does not fit the model "
                           f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        for group in self.optimizer.param_groups:  # an --lr given now wins over the saved one
            group["lr"] = float(self.cfg["lr"])
        self.trainer.load_state_dict(ckpt["trainer"])  # after model and optimizer: it re-syncs the replicas
        # Any world size: another step size re-cuts the rest of the epoch (DistributedLengthSampler).
        loop_state = ckpt.get("loop") or {"step": int(ckpt["run"]["step"]), "sampler": ckpt["sampler"]}
        try:
            self.loop.load_state_dict({**loop_state, "sampler": ckpt["sampler"]})
        except (ValueError, KeyError) as exc:
            raise CLIError(f"--resume: {exc}") from None
        self.state.step = self.loop.step
        saved_bs = int(ckpt["sampler"].get("batch_size", self.samples_per_step))
        if saved_bs != self.samples_per_step:
            self.resized_from = saved_bs
        restore_rng_state(ckpt["rng"])  # last: building the model above drew from the RNGs

    def save(self) -> None:
        """Atomically checkpoint everything a resume needs to continue exactly here (rank 0 only: the
        master's model and optimizer are identical on every rank). A failed write keeps the
        previous checkpoint and stops the run (CLIError)."""
        if not self.main:
            return
        self.state.step = self.loop.step
        cfg = {k: v for k, v in self.cfg.items() if k not in NOT_SAVED}
        try:
            save_checkpoint({"format": FORMAT, "version": __version__, "config": cfg,
                             "data": self.meta, "model": self.model.state_dict(),
                             "optimizer": self.optimizer.state_dict(), "trainer": self.trainer.state_dict(),
                             "sampler": self.sampler.state_dict(), "loop": self.loop.state_dict(),
                             "run": self.state.state_dict(), "rng": capture_rng_state()}, self.ckpt_path)
        except CheckpointWriteError as exc:
            kept = (f"the checkpoint of step {self.saved_step} there is kept" if self.saved_step is not None
                    else "no checkpoint was written")
            raise CLIError(f"cannot save the checkpoint of step {self.loop.step} to {self.ckpt_path}: "
                           f"{exc.reason}; {kept}") from None
        self.saved_step = self.loop.step

    def run_validation(self) -> Dict[str, float]:
        if self.val is None:
            return {}
        self.last_val = evaluate_split(self.trainer, self.val)
        h = self.state.history
        h["val_step"].append(self.loop.step)
        h["val_loss"].append(self.last_val["val_loss"])
        h["val_accuracy"].append(self.last_val.get("val_accuracy"))
        return self.last_val
