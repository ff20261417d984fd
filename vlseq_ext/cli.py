"""vlseq-train: train a sequence model on variable-length time series on every visible GPU.

With no arguments it trains the seed's model (LSTM(36 -> 64) + Linear(64 -> 1)) on a built-in
synthetic dataset, on all GPUs (or the CPU), and prints a summary. See `vlseq-train --help`.

The training loop lives here (not in ParallelTrainer.fit) so that a checkpoint can capture exactly
where it is: model, optimizer, trainer counters, the sampler's (epoch, position), every RNG state
and the run's configuration. With --deterministic, a resumed run repeats the per-step losses of a
run that was never interrupted.

Under torchrun (several processes, one or more machines; docs/multi-node.md) every process trains
its share of each global step (vlseq_ext.distributed); rank 0 alone resolves the configuration and
reads a resumed checkpoint (and sends both to the others), prints, shows progress, writes metrics,
the plot and checkpoints. Checkpoints resume on any world size.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import random
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

import numpy as np
import torch
from torch import Tensor, nn

try:
    from . import __version__
except ImportError:  # an editable install that maps vlseq_ext as a namespace package skips __init__
    __version__ = "0+unknown"
from .checkpoint import CHECKPOINT_NAME, capture_rng_state, find_checkpoint, load_checkpoint, restore_rng_state, \
    save_checkpoint
from . import distributed
from .data import BUILTIN, DataError, RaggedDataset, open_dataset, split
from .distributed import DistributedError, DistributedLengthSampler
from .models import SeqModel
from .trainer import ParallelTrainer

PROG = "vlseq-train"

# Defaults of every option; argparse's own defaults are None so that we can tell which options were
# given on the command line (they override a resumed checkpoint's configuration).
DEFAULTS: Dict[str, Any] = dict(
    data="synthetic", synthetic_samples=2000, task=None, val_fraction=0.1, drop_nonfinite=False,
    model="lstm", hidden=64, layers=1, devices="all", samples_per_device=1, epochs=3, max_steps=None,
    lr=1e-3, reduction="mean", clip_grad=None, amp=None, seed=0, deterministic=False,
    checkpoint_dir=None, checkpoint_every=0, metrics=None, plot=None, quiet=False, log_interval=10.0)
# What a resumed run must keep: these define the model and the data order.
FIXED_ON_RESUME = ("model", "hidden", "layers", "task", "seed", "val_fraction", "synthetic_samples")


class CLIError(Exception):
    """A usage or configuration problem: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of vlseq-train (every default is None; see DEFAULTS)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train an LSTM/GRU on variable-length time series on every visible GPU (or the CPU), with "
                    "exact multi-device gradients, progress, metrics, a loss plot and exactly resumable checkpoints.\n"
                    "With no arguments: the seed's model on a built-in synthetic regression set (about a minute).",
        epilog="examples:\n"
               f"  {PROG}                                   # demo on synthetic data, all GPUs\n"
               f"  {PROG} --data japanese_vowels --epochs 10 --lr 3e-3  # aeon's JapaneseVowels: ~96% accuracy\n"
               f"  {PROG} --data my.npz --devices cuda:0,cuda:1 --samples-per-device 8 --amp bf16\n"
               f"  {PROG} --resume runs/vlseq-20261130-120000 --epochs 10   # continue a run\n\n"
               "A ragged .npz holds values (total_steps, D) float, offsets (N+1,) int64 from 0 to total_steps\n"
               "and targets (N, ...); write one with vlseq_ext.data.save_ragged(path, sequences, targets).\n"
               "Ctrl-C or SIGTERM: the current step finishes, a checkpoint is saved, and the run exits with\n"
               "code 130 (SIGINT) or 143 (SIGTERM); a second Ctrl-C exits at once without saving.\n"
               "Bad input (missing or corrupt files, bad shapes, NaN, unknown GPUs) exits with code 2.\n"
               "CPU work uses one intra-op thread unless OMP_NUM_THREADS is set (as under torchrun).")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH|NAME",
                   help=f"a ragged .npz or UEA/UCR .ts file, or a built-in set: {' | '.join(BUILTIN)} "
                        f"(default: {d['data']}; japanese_vowels needs aeon: pip install 'vlseq_ext[ts]')")
    g.add_argument("--synthetic-samples", type=int, metavar="N",
                   help=f"number of sequences of the synthetic set (default: {d['synthetic_samples']})")
    g.add_argument("--task", choices=["regression", "classification"],
                   help="default: classification for integer class labels (and .ts class labels), else regression")
    g.add_argument("--val-fraction", type=float, metavar="F",
                   help=f"share of the samples held out for validation (default: {d['val_fraction']}; "
                        "japanese_vowels uses its official test split)")
    g.add_argument("--drop-nonfinite", action="store_true", default=None,
                   help="skip samples with NaN/inf values (and say how many) instead of stopping with an error")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["lstm", "gru"], help=f"recurrent layer (default: {d['model']})")
    g.add_argument("--hidden", type=int, metavar="H", help=f"hidden size (default: {d['hidden']})")
    g.add_argument("--layers", type=int, metavar="N", help=f"stacked recurrent layers (default: {d['layers']})")
    g = p.add_argument_group("training")
    g.add_argument("--devices", metavar="SPEC",
                   help="'all' (every visible GPU, or the CPU when there is none), 'cuda:0,cuda:1', 'cpu', or "
                        f"'cpu:N' for N CPU replicas (default: {d['devices']})")
    g.add_argument("--samples-per-device", type=int, metavar="K",
                   help=f"samples per device per step: CUDA-graph replays of one sample each on GPUs, one packed "
                        f"batch on CPU; same gradient either way (default: {d['samples_per_device']}, the seed's one "
                        "sample per GPU)")
    g.add_argument("--epochs", type=int, metavar="N",
                   help=f"passes over the training set (default: {d['epochs']}; unlimited when only --max-steps "
                        "is given)")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps in total")
    g.add_argument("--lr", type=float, help=f"Adam learning rate (default: {d['lr']})")
    g.add_argument("--reduction", choices=["mean", "sum"],
                   help=f"step loss: mean or sum (the seed's) of the per-sample losses (default: {d['reduction']})")
    g.add_argument("--clip-grad", type=float, metavar="NORM", help="clip the global gradient L2 norm to NORM")
    g.add_argument("--amp", choices=["bf16", "none"], help="bf16 autocast for the forward pass (default: none)")
    g.add_argument("--seed", type=int, help=f"seed of the synthetic data, the split, the order and the model "
                                            f"(default: {d['seed']})")
    g.add_argument("--deterministic", action="store_true", default=None,
                   help="deterministic kernels only (torch.use_deterministic_algorithms): bit-identical runs, "
                        "and a resumed run repeats the uninterrupted run's losses exactly")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help=f"where {CHECKPOINT_NAME} (and, by default, metrics.jsonl and loss.png) go "
                        "(default: runs/vlseq-<date>-<time>, or the --resume directory)")
    g.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                   help="also checkpoint every STEPS steps (default: at the end of every epoch and of the run)")
    g.add_argument("--resume", metavar="DIR",
                   help="continue the run checkpointed in DIR (or a checkpoint file) with its configuration; "
                        "options given now override it, except model, data order and seed")
    g.add_argument("--metrics", metavar="PATH", help="JSON Lines metrics, one record per step and per epoch "
                                                     "(default: DIR/metrics.jsonl)")
    g.add_argument("--plot", metavar="PATH", help="PNG of the training and validation loss curves, written at the "
                                                  "end (default: DIR/loss.png; needs matplotlib)")
    g.add_argument("--quiet", action="store_true", default=None,
                   help="no progress bar: periodic log lines instead (as when stderr is not a terminal)")
    g.add_argument("--log-interval", type=float, metavar="SECONDS",
                   help=f"seconds between log lines without a progress bar (default: {d['log_interval']})")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


# ------------------------------------------------------------------------------------------------
# configuration


def resolve_config(args: argparse.Namespace) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Merge defaults, a resumed checkpoint's configuration and the options given now.
    Returns (config, checkpoint or None)."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    ckpt = None
    if args.resume:
        found = find_checkpoint(args.resume)
        if found is None:
            raise CLIError(f"--resume {args.resume}: no checkpoint there (expected {CHECKPOINT_NAME} in a directory, "
                           "or a checkpoint file)")
        try:
            ckpt = load_checkpoint(found)
            saved = dict(ckpt["config"])
        except Exception as exc:  # a torn or foreign file: say so in one line
            why = str(exc).split(". ")[0].splitlines()[0] if str(exc) else type(exc).__name__
            raise CLIError(f"--resume: cannot load {found}: {why}") from None
        for k in FIXED_ON_RESUME:
            if k in given and given[k] != saved.get(k):
                raise CLIError(f"--{k.replace('_', '-')} {given[k]} differs from the checkpoint's {saved.get(k)}; "
                               "a resumed run keeps its model, seed and data split")
        cfg = {**DEFAULTS, **saved, **given}
        if "checkpoint_dir" not in given:
            cfg["checkpoint_dir"] = str(found.parent)
        for k in ("metrics", "plot"):  # follow the checkpoint directory unless a path was given now
            if k not in given and saved.get(f"{k}_default"):
                cfg[k] = None
    else:
        cfg = {**DEFAULTS, **given}
    if ("max_steps" in given) != ("epochs" in given):  # one limit given alone replaces both
        cfg["epochs" if "max_steps" in given else "max_steps"] = None
    if cfg["amp"] == "none":
        cfg["amp"] = None
    for k in ("hidden", "layers", "samples_per_device", "synthetic_samples"):
        if cfg[k] < 1:
            raise CLIError(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    for k in ("epochs", "max_steps"):
        if cfg[k] is not None and cfg[k] < 1:
            raise CLIError(f"--{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    if cfg["clip_grad"] is not None and not cfg["clip_grad"] > 0:
        raise CLIError(f"--clip-grad must be > 0, got {cfg['clip_grad']}")
    if not cfg["lr"] > 0:
        raise CLIError(f"--lr must be > 0, got {cfg['lr']}")
    if cfg["checkpoint_every"] < 0:
        raise CLIError(f"--checkpoint-every must be >= 0, got {cfg['checkpoint_every']}")
    if not cfg["checkpoint_dir"]:
        base = Path("runs") / time.strftime("vlseq-%Y%m%d-%H%M%S")
        run_dir, i = base, 1
        while run_dir.exists():
            i += 1
            run_dir = base.with_name(f"{base.name}-{i}")
        cfg["checkpoint_dir"] = str(run_dir)
    for k, name in (("metrics", "metrics.jsonl"), ("plot", "loss.png")):
        cfg[f"{k}_default"] = cfg[k] is None
        if cfg[k] is None:
            cfg[k] = str(Path(cfg["checkpoint_dir"]) / name)
    return cfg, ckpt


def parse_devices(spec: str) -> Optional[List[str]]:
    """--devices -> a device list for ParallelTrainer (None = every visible GPU, or the CPU)."""
    s = spec.strip().lower()
    if s in ("all", "auto"):
        return None
    if s == "cpu":
        return ["cpu"]
    m = re.fullmatch(r"cpu:(\d+)", s)
    if m:
        if int(m.group(1)) < 1:
            raise CLIError(f"--devices {spec}: need at least one CPU replica")
        return ["cpu"] * int(m.group(1))
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = ", ".join(f"cuda:{i}" for i in range(n)) or "none"
    if s == "cuda":
        if n == 0:
            raise CLIError(f"--devices {spec}: no CUDA GPU is visible (use --devices cpu)")
        return [f"cuda:{i}" for i in range(n)]
    out: List[str] = []
    for item in s.split(","):
        m = re.fullmatch(r"(?:cuda:)?(\d+)", item.strip())
        if not m:
            raise CLIError(f"--devices {spec}: cannot parse {item.strip()!r} (use all, cpu, cpu:N or cuda:0,cuda:1)")
        dev = f"cuda:{int(m.group(1))}"
        if int(m.group(1)) >= n:
            raise CLIError(f"--devices {spec}: {dev} does not exist (visible GPUs: {visible})")
        if dev in out:
            raise CLIError(f"--devices {spec}: {dev} is listed twice")
        out.append(dev)
    return out


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms + cuDNN determinism for the duration (restored after)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


@contextlib.contextmanager
def cpu_threads() -> Iterator[None]:
    """One intra-op CPU thread unless OMP_NUM_THREADS says otherwise, as torchrun does: the
    small per-sample kernels gain nothing from more, and on a busy machine spinning OpenMP
    threads slow training down many times over. Restored afterwards."""
    saved = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[List[int]]:
    """SIGINT/SIGTERM set a flag (the yielded list gets the signal number) so the loop can finish
    its step and checkpoint; a second SIGINT raises KeyboardInterrupt at once."""
    received: List[int] = []

    def handler(signum: int, frame: Any) -> None:
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        received.append(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------
# output: progress, logs, metrics, plot


class Reporter:
    """Progress bar (a TTY and not --quiet) or periodic log lines, plus the JSON Lines metrics file.
    Step losses stay on the device until a flush, so the hot loop has no host sync of its own."""

    def __init__(self, cfg: Dict[str, Any], total: Optional[int], state: "RunState", trainer: ParallelTrainer,
                 metrics: TextIO, main: bool = True) -> None:
        self.state, self.trainer, self.metrics = state, trainer, metrics
        self.main = main  # [distributed] only rank 0 shows progress and writes log lines
        self.log_interval = float(cfg["log_interval"])
        self.total = total
        self.bar = None
        if main and not cfg["quiet"] and sys.stderr.isatty():
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=state.step, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.pending: List[Tuple[int, int, Tensor, Optional[Tensor], int, float]] = []
        self.last_flush = self.last_log = time.perf_counter()
        self.window_samples = 0
        self.recent: List[float] = []
        self.samples_per_s = 0.0
        self.grad_norm: Optional[float] = None

    def write(self, line: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def add(self, step: int, epoch: int, loss: Tensor, grad_norm: Optional[Tensor], n: int, lr: float) -> None:
        """Queue one step's record; its tensors are read at the next flush."""
        gn = None if grad_norm is None else grad_norm.detach().clone()
        self.pending.append((step, epoch, loss.detach().clone(), gn, n, lr))
        self.window_samples += n
        if time.perf_counter() - self.last_flush >= 0.5 or len(self.pending) >= 256:
            self.flush()

    def flush(self) -> None:
        """Read the pending losses (one sync), record them in the run's history and the metrics
        file, and update the bar or write a log line."""
        if not self.pending:
            return
        losses = torch.stack([p[2].float() for p in self.pending]).tolist()
        norms = [p[3] for p in self.pending]
        if all(g is not None for g in norms):
            norms = torch.stack([g.float() for g in norms]).tolist()
        else:
            norms = [None if g is None else float(g) for g in norms]
        now = time.perf_counter()
        self.samples_per_s = self.window_samples / max(now - self.last_flush, 1e-9)
        skipped_total, elapsed = self.trainer.skipped_steps, round(self.state.elapsed(), 3)
        recs = []
        for (step, epoch, _, _, n, lr), loss, gn in zip(self.pending, losses, norms):
            # The trainer (nonfinite="skip") skips exactly the steps whose gradient norm is not finite.
            recs.append({"type": "step", "step": step, "epoch": epoch, "loss": loss, "grad_norm": gn, "samples": n,
                         "skipped": gn is not None and not math.isfinite(gn), "skipped_steps": skipped_total, "lr": lr,
                         "samples_per_s": round(self.samples_per_s, 2), "time": elapsed})
            self.state.record_step(recs[-1])
        self.write_records(recs)
        self.recent = (self.recent + [r["loss"] for r in recs if math.isfinite(r["loss"])])[-50:]
        self.grad_norm = norms[-1]
        self.pending, self.window_samples, self.last_flush = [], 0, now
        last = recs[-1]
        loss_s = f"{np.mean(self.recent):.4g}" if self.recent else "nan"
        if self.bar is not None:
            self.bar.set_postfix_str(f"epoch {last['epoch']} loss {loss_s} {self.samples_per_s:,.0f} samples/s"
                                     + (f" skipped {skipped_total}" if skipped_total else ""), refresh=False)
            self.bar.update(last["step"] - self.bar.n)
        elif now - self.last_log >= self.log_interval:
            self.last_log = now
            of = f"/{self.total}" if self.total else ""
            gn = "n/a" if self.grad_norm is None else f"{self.grad_norm:.3g}"
            self.write(f"step {last['step']}{of} (epoch {last['epoch']}) loss {loss_s} | "
                       f"{self.samples_per_s:,.0f} samples/s | grad-norm {gn}"
                       + (f" | skipped {skipped_total}" if skipped_total else ""))

    def write_records(self, recs: Sequence[Dict[str, Any]]) -> None:
        """Append records as strict JSON: a non-finite number becomes null (skipped steps say why)."""
        for r in recs:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
            self.metrics.write(json.dumps(clean, allow_nan=False) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunState:
    """Counters and history of a run, saved in every checkpoint (plain lists and numbers)."""

    EPOCH_ZERO = {"samples": 0, "loss_sum": 0.0, "loss_samples": 0, "grad_norm_sum": 0.0, "grad_norm_steps": 0,
                  "grad_norm_max": 0.0, "train_time": 0.0}

    def __init__(self, saved: Optional[Dict[str, Any]] = None) -> None:
        s = saved or {}
        self.step = int(s.get("step", 0))
        # Running totals of the current epoch; steps with a non-finite loss or gradient norm (skipped
        # by the trainer) count towards throughput only.
        self.epoch: Dict[str, float] = {**self.EPOCH_ZERO, **s.get("epoch", {})}
        self.prior_time = float(s.get("elapsed", 0.0))
        self.history: Dict[str, List[Any]] = {"step": [], "loss": [], "val_step": [], "val_loss": [],
                                               "val_accuracy": [], "epoch_loss": []}
        for k, v in s.get("history", {}).items():
            self.history[k] = v.tolist() if isinstance(v, Tensor) else list(v)
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return self.prior_time + time.perf_counter() - self.start

    def record_step(self, r: Dict[str, Any]) -> None:
        self.history["step"].append(r["step"])
        self.history["loss"].append(r["loss"])
        e = self.epoch
        e["samples"] += r["samples"]
        if math.isfinite(r["loss"]):
            e["loss_sum"] += r["loss"] * r["samples"]
            e["loss_samples"] += r["samples"]
        if r["grad_norm"] is not None and math.isfinite(r["grad_norm"]):
            e["grad_norm_sum"] += r["grad_norm"]
            e["grad_norm_steps"] += 1
            e["grad_norm_max"] = max(e["grad_norm_max"], r["grad_norm"])

    def end_epoch(self) -> Dict[str, Any]:
        """The finished epoch's train loss, gradient norms and throughput; resets the totals."""
        e, self.epoch = self.epoch, dict(self.EPOCH_ZERO)
        return {"train_loss": e["loss_sum"] / e["loss_samples"] if e["loss_samples"] else None,
                "grad_norm": e["grad_norm_sum"] / e["grad_norm_steps"] if e["grad_norm_steps"] else None,
                "grad_norm_max": e["grad_norm_max"] if e["grad_norm_steps"] else None,
                "samples_per_s": round(e["samples"] / max(e["train_time"], 1e-9), 2)}

    def state_dict(self) -> Dict[str, Any]:
        h = dict(self.history)  # the per-step series as tensors: compact and fast to save
        h["step"], h["loss"] = torch.tensor(h["step"], dtype=torch.int64), torch.tensor(h["loss"], dtype=torch.float64)
        return {"step": self.step, "epoch": dict(self.epoch), "elapsed": self.elapsed(), "history": h}


def open_metrics(path: Path, resume_step: Optional[int]) -> TextIO:
    """Open the metrics file for appending. On resume, records after the checkpoint's step are
    dropped first (atomically), so the file reads as one uninterrupted run; otherwise it starts empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume_step is None or not path.exists():
        return open(path, "w", encoding="utf-8")
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= resume_step:
                keep.append(line + "\n")
        except ValueError:  # a line torn by a crash
            pass
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    return open(path, "a", encoding="utf-8")


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: Path, history: Dict[str, List[Any]], title: str) -> None:
    """PNG of the per-step training loss (raw and smoothed) and the validation loss (and accuracy)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    steps, loss = np.array(history["step"]), np.array(history["loss"], dtype=float)
    acc = [(s, a) for s, a in zip(history["val_step"], history["val_accuracy"]) if a is not None]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    axes = fig.subplots(1, 2 if acc else 1, squeeze=False)[0]
    ax = axes[0]
    finite = loss[np.isfinite(loss)]
    if len(finite):
        ax.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
        w = max(1, len(loss) // 40)
        c = np.cumsum(np.concatenate([[0.0], np.where(np.isfinite(loss), loss, np.nanmedian(finite))]))
        i = np.arange(1, len(loss) + 1)
        smooth = (c[i] - c[np.maximum(i - w, 0)]) / np.minimum(i, w)  # trailing mean of up to w steps
        if w > 1:
            ax.plot(steps, smooth, color="tab:blue", label=f"train (mean of {w} steps)")
        # Per-step losses of a few samples are spiky: scale the axis to the smoothed curve.
        top = np.nanmax([np.percentile(finite, 98), *history["val_loss"]])
        if smooth.min() > 0 and smooth.max() / smooth.min() > 30:
            ax.set_yscale("log")
            ax.set_ylim(0.5 * smooth.min(), 1.5 * top)
        else:
            ax.set_ylim(0, 1.05 * top)
    if history["val_step"]:
        ax.plot(history["val_step"], history["val_loss"], "o-", color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if acc:
        axes[1].plot([s for s, _ in acc], [a * 100 for _, a in acc], "o-", color="tab:green")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("validation accuracy (%)")
        axes[1].grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------
# training


def validate(trainer: ParallelTrainer, val: RaggedDataset, chunk: int = 256) -> Dict[str, float]:
    """Mean per-sample validation loss (and accuracy for classification) of the master model.
    [distributed] Every rank evaluates every world_size-th sample; one sum across ranks."""
    order = np.argsort(-val.lengths, kind="stable")  # similar lengths together: cheaper packed batches
    xp = trainer.cross_process
    if xp is not None:
        order = order[xp.rank::xp.world_size]
        master = trainer.devices[trainer.master_index]
        totals = torch.zeros(2, dtype=torch.float64, device=master)
        for s in range(0, len(order), chunk):
            items = [val[int(i)] for i in order[s:s + chunk]]
            out, losses = trainer.evaluate([x for x, _ in items], [y for _, y in items])
            totals[0] += losses.double().sum()
            if val.task == "classification":
                totals[1] += (out.argmax(1) == torch.stack([y for _, y in items]).to(out.device)).sum()
        loss_sum, hit_sum = xp.sum_(totals).tolist()
        res = {"val_loss": loss_sum / len(val)}
        if val.task == "classification":
            res["val_accuracy"] = hit_sum / len(val)
        return res
    sums, hits = [], []
    for s in range(0, len(order), chunk):
        items = [val[int(i)] for i in order[s:s + chunk]]
        out, losses = trainer.evaluate([x for x, _ in items], [y for _, y in items])
        sums.append(losses.double().sum())
        if val.task == "classification":
            hits.append((out.argmax(1) == torch.stack([y for _, y in items]).to(out.device)).sum())
    res = {"val_loss": torch.stack(sums).sum().item() / len(val)}
    if hits:
        res["val_accuracy"] = torch.stack(hits).sum().item() / len(val)
    return res


def describe_model(model: SeqModel) -> str:
    """E.g. "LSTM(36 -> 64) + Linear(64 -> 1), 26,177 parameters"."""
    rnn = model.recurrent
    layers = f" x{rnn.num_layers}" if rnn.num_layers > 1 else ""
    n = sum(p.numel() for p in model.parameters())
    return (f"{model.rnn_type.upper()}({model.input_dim} -> {rnn.hidden_size}{layers}) + "
            f"Linear({model.fc.in_features} -> {model.output_dim}), {n:,} parameters")


def _num(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _finite_mean(values: Sequence[float]) -> Optional[float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Run:
    """One training run built from its configuration: data, model, optimizer, ParallelTrainer,
    sampler and counters, restored from `ckpt` when resuming."""

    def __init__(self, cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]]) -> None:
        self.cfg = cfg
        seed = int(cfg["seed"])
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        devices = parse_devices(cfg["devices"])
        # [distributed] under torchrun rank 0 alone prints, writes metrics, plots and checkpoints
        rank, world = distributed.rank_and_world()
        self.main = rank == 0
        if devices is None and world > 1:  # --devices all: this process's share of the machine's GPUs
            try:
                devices = distributed.default_local_devices()
            except ValueError as exc:
                raise CLIError(f"--devices {cfg['devices']}: {exc}") from None
        if not cfg["plot_default"] and not matplotlib_available():
            raise CLIError(f"--plot {cfg['plot']}: matplotlib is not installed (pip install 'vlseq_ext[plot]')")

        data, val = open_dataset(cfg["data"], cfg["task"], bool(cfg["drop_nonfinite"]), seed,
                                 int(cfg["synthetic_samples"]))
        for ds in (data, val):
            if ds is not None and ds.dropped and self.main:
                print(f"{PROG}: {ds.name}: dropped {ds.dropped} of {len(ds) + ds.dropped} samples with NaN/inf values",
                      file=sys.stderr)
        if val is None:
            data, val = split(data, float(cfg["val_fraction"]), seed)
        if val is not None and (val.num_features, val.task) != (data.num_features, data.task):
            raise DataError(f"{val.name}: {val.num_features} features ({val.task}), but {data.name} has "
                            f"{data.num_features} ({data.task})")
        self.data, self.val = data, val
        self.meta = {"name": data.name, "num_features": data.num_features, "task": data.task,
                     "output_dim": data.output_dim, "num_train": len(data), "class_names": data.class_names}
        if ckpt is not None:
            self._check_resumable(ckpt["data"])

        self.model = SeqModel(input_dim=data.num_features, hidden_dim=int(cfg["hidden"]), output_dim=data.output_dim,
                              num_layers=int(cfg["layers"]), rnn=cfg["model"])
        first = (devices or (["cuda:0"] if torch.cuda.is_available() and torch.cuda.device_count() else ["cpu"]))[0]
        on_gpu = first.startswith("cuda")
        if on_gpu:
            self.model.to(first)
        # Fused Adam on GPUs: one kernel per step, and the trainer's non-finite guard then skips
        # bad steps on the device without a host sync.
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=float(cfg["lr"]), fused=on_gpu or None)
        loss_fn = nn.CrossEntropyLoss() if data.task == "classification" else nn.MSELoss()
        try:
            self.trainer = ParallelTrainer(self.model, self.optimizer, loss_fn, devices=devices,
                                           samples_per_device=int(cfg["samples_per_device"]),
                                           reduction=cfg["reduction"], clip_grad_norm=cfg["clip_grad"],
                                           amp=cfg["amp"], nonfinite="skip", track_grad_norm=True)
        except ValueError as exc:
            raise CLIError(f"--devices {cfg['devices']}: {exc}") from None
        # Global steps (world_size x devices x k samples), the same on every rank; each trains its share.
        self.samples_per_step = self.trainer.samples_per_step * self.trainer.world_size
        self.sampler = DistributedLengthSampler(data.lengths, self.trainer.samples_per_device, len(self.trainer.devices),
                                                self.trainer.rank, self.trainer.world_size, seed=seed)
        self.resized_from: Optional[int] = None
        self.stop_signal: Optional[int] = None
        self.state = RunState(ckpt.get("run") if ckpt else None)
        if ckpt is not None:
            self._restore(ckpt)
        self.ckpt_path = Path(cfg["checkpoint_dir"]) / CHECKPOINT_NAME
        self.epochs, self.max_steps = cfg["epochs"], cfg["max_steps"]
        devs = self.trainer.devices
        self.devices_desc = str(devs[0]) if len(devs) == 1 else (
            f"{devs[0]} x{len(devs)}" if len(set(devs)) == 1 else ", ".join(map(str, devs)))
        if self.trainer.world_size > 1:
            self.devices_desc = f"{self.trainer.world_size} processes x ({self.devices_desc})"
        self.last_val: Dict[str, float] = {}
        self.samples_done = 0

    def _check_resumable(self, old: Dict[str, Any]) -> None:
        data = self.data
        if old["num_features"] != data.num_features:
            raise DataError(f"{data.name}: {data.num_features} features per step, but the checkpoint's model was "
                            f"trained on {old['num_features']} ({old['name']})")
        if (old["task"], old["output_dim"]) != (data.task, data.output_dim):
            what = "classes" if data.task == "classification" else "target values"
            raise DataError(f"{data.name}: {data.task} with {data.output_dim} {what}, but the checkpoint's model "
                            f"does {old['task']} with {old['output_dim']}")
        if old["num_train"] != len(data):
            raise DataError(f"{data.name}: {len(data)} training samples, the checkpoint's run had {old['num_train']}; "
                            "resume on the same data")

    def _restore(self, ckpt: Dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        for group in self.optimizer.param_groups:  # an --lr given now wins over the saved one
            group["lr"] = float(self.cfg["lr"])
        self.trainer.load_state_dict(ckpt["trainer"])  # after model and optimizer: it re-syncs the replicas
        try:  # any world size: another step size re-cuts the rest of the epoch (DistributedLengthSampler)
            self.sampler.load_state_dict(ckpt["sampler"])
        except ValueError as exc:
            raise CLIError(f"--resume: {exc}") from None
        saved_bs = int(ckpt["sampler"].get("batch_size", self.samples_per_step))
        if saved_bs != self.samples_per_step:
            self.resized_from = saved_bs
        restore_rng_state(ckpt["rng"])  # last: building the model above drew from the RNGs

    # -- pieces of the loop ---------------------------------------------------------------------
    def done(self) -> bool:
        return ((self.max_steps is not None and self.state.step >= self.max_steps)
                or (self.epochs is not None and self.sampler.epoch >= self.epochs))

    def total_steps(self) -> Optional[int]:
        limits = [t for t in (self.max_steps, self.epochs * len(self.sampler) if self.epochs else None) if t]
        return min(limits) if limits else None

    def save(self) -> None:
        """Atomically checkpoint everything a resume needs to continue exactly here (rank 0 only: the
        master's model and optimizer are identical on every rank)."""
        if not self.main:
            return
        save_checkpoint({"format": "vlseq_ext.checkpoint/1", "version": __version__, "config": self.cfg,
                         "data": self.meta, "model": self.model.state_dict(),
                         "optimizer": self.optimizer.state_dict(), "trainer": self.trainer.state_dict(),
                         "sampler": self.sampler.state_dict(), "run": self.state.state_dict(),
                         "rng": capture_rng_state()}, self.ckpt_path)

    def run_validation(self) -> Dict[str, float]:
        if self.val is None:
            return {}
        self.last_val = validate(self.trainer, self.val)
        h = self.state.history
        h["val_step"].append(self.state.step)
        h["val_loss"].append(self.last_val["val_loss"])
        h["val_accuracy"].append(self.last_val.get("val_accuracy"))
        return self.last_val

    def _val_text(self) -> str:
        v = self.last_val
        return ((f", val loss {v['val_loss']:.4g}" if v else "")
                + (f", val accuracy {100 * v['val_accuracy']:.1f}%" if "val_accuracy" in v else ""))

    def end_epoch(self, rep: Reporter) -> None:
        """Validation, the epoch record and log line, and the move to the next epoch."""
        st, epoch = self.state, self.sampler.epoch + 1
        self.run_validation()
        rec = {"type": "epoch", "epoch": epoch, "step": st.step,
               **st.end_epoch(), **self.last_val, "skipped_steps": self.trainer.skipped_steps,
               "time": round(st.elapsed(), 3)}
        st.history["epoch_loss"].append(rec["train_loss"])
        rep.write_records([rec])
        rep.write(f"epoch {epoch}{f'/{self.epochs}' if self.epochs else ''} (step {st.step}): "
                  f"train loss {_num(rec['train_loss'])}{self._val_text()}, {rec['samples_per_s']:,.0f} samples/s"
                  + (f", {self.trainer.skipped_steps} non-finite steps skipped" if self.trainer.skipped_steps else ""))
        self.sampler.set_epoch(epoch)  # before any save: a checkpoint never sits at the end of an epoch

    def _check_stop(self, received: List[int]) -> bool:
        """Whether a signal stops the run after this step. In one process: whether one arrived. With
        several, only once every rank knows (the request rides in the step's all-reduce, and all ranks
        read it after the same step): a rank that stopped alone would leave the others waiting."""
        if self.stop_signal is None:
            xp = self.trainer.cross_process
            if xp is None:
                if received:
                    self.stop_signal = received[0]
            elif xp.stop_requested():
                self.stop_signal = received[0] if received else int(signal.SIGTERM)
        return self.stop_signal is not None

    def fit(self, rep: Reporter, received: List[int]) -> None:
        """The training loop: until done() or a signal arrives (then after finishing the step)."""
        st, sampler, trainer, every = self.state, self.sampler, self.trainer, int(self.cfg["checkpoint_every"])
        xp = trainer.cross_process
        while not self.done() and self.stop_signal is None:
            if sampler.position >= len(sampler):  # never saved so; be safe anyway
                sampler.set_epoch(sampler.epoch + 1)
                continue
            t_mark = time.perf_counter()
            for batch in sampler:  # a global step; this process trains its share
                if received and xp is not None:
                    xp.request_stop()
                items = [self.data[i] for i in sampler.shard(batch)]
                loss = trainer.step([x for x, _ in items], [y for _, y in items])
                st.step += 1
                self.samples_done += len(batch)
                rep.add(st.step, sampler.epoch + 1, loss / len(batch) if trainer.reduction == "sum" else loss,
                        trainer.last_grad_norm, len(batch), self.optimizer.param_groups[0]["lr"])
                epoch_end = sampler.position == len(sampler)
                stop = self.done() or self._check_stop(received)
                save = epoch_end or stop or (every > 0 and st.step % every == 0)
                if not save:
                    continue
                rep.flush()
                st.epoch["train_time"] += time.perf_counter() - t_mark
                if epoch_end:
                    self.end_epoch(rep)
                    stop = self.done() or self._check_stop(received)
                elif stop and self.stop_signal is None:  # a run ending mid-epoch gets a last validation
                    if self.run_validation():
                        rep.write_records([{"type": "val", "step": st.step, "epoch": sampler.epoch + 1,
                                            **self.last_val}])
                        rep.write(f"validation at step {st.step}:{self._val_text()[1:]}")
                self.save()
                t_mark = rep.last_flush = time.perf_counter()  # validating and saving are not training time
                if stop:
                    break

    def summary(self, wall: float, plot_note: str) -> str:
        st, h, data = self.state, self.state.history, self.data
        rows = [("data", f"{data.name}: {len(data)} train / {len(self.val) if self.val else 0} validation samples"),
                ("model", describe_model(self.model)),
                ("devices", f"{self.devices_desc}, {_plural(self.samples_per_step, 'sample')} per step"),
                ("steps", f"{st.step} ({_plural(self.sampler.epoch, 'epoch')}"
                          f"{f' + {self.sampler.position} batches' if self.sampler.position else ''}), "
                          f"{self.trainer.skipped_steps} skipped as non-finite")]
        if h["epoch_loss"]:
            rows.append(("train loss by epoch", " -> ".join(_num(v) for v in h["epoch_loss"][-6:])))
        if h["loss"]:
            k = max(1, min(50, len(h["loss"]) // 5))
            rows.append((f"train loss, first/last {k} steps",
                         f"{_num(_finite_mean(h['loss'][:k]))} -> {_num(_finite_mean(h['loss'][-k:]))}"))
        if h["val_loss"]:
            best = int(np.nanargmin(h["val_loss"])) if not np.isnan(h["val_loss"]).all() else -1
            rows.append(("val loss", f"{h['val_loss'][-1]:.4g} "
                                     f"(best {h['val_loss'][best]:.4g} at step {h['val_step'][best]})"))
        if h["val_accuracy"] and h["val_accuracy"][-1] is not None:
            rows.append(("val accuracy", f"{100 * h['val_accuracy'][-1]:.1f}% (chance {100 / data.output_dim:.1f}%)"))
        rows += [("throughput", f"{self.samples_done / max(wall, 1e-9):,.0f} samples/s ({wall:.1f} s this session)"),
                 ("checkpoint", str(self.ckpt_path)), ("metrics", self.cfg["metrics"]), ("plot", plot_note)]
        width = max(len(k) for k, _ in rows)
        return f"\n{PROG} summary\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def train(cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]]) -> int:
    """Run (or continue) one training run; returns the exit code."""
    run = Run(cfg, ckpt)
    st, data = run.state, run.data
    say = print if run.main else (lambda *a, **k: None)  # [distributed] rank 0 speaks for all
    say(f"{PROG}: {data.name}: {len(data)} train / {len(run.val) if run.val else 0} validation samples, "
          f"{data.num_features} features, lengths {int(data.lengths.min())}-{int(data.lengths.max())}, {data.task}"
          + (f" ({data.output_dim} classes)" if data.task == "classification" else "")
          + (f", from {data.source}" if data.source else ""), file=sys.stderr)
    say(f"{PROG}: {describe_model(run.model)} on {run.devices_desc}, "
        f"{_plural(run.samples_per_step, 'sample')} per step; checkpoints in {cfg['checkpoint_dir']}"
        + (f"; resuming at step {st.step} (epoch {run.sampler.epoch + 1}, batch {run.sampler.position})"
           if ckpt else ""),
        file=sys.stderr)
    if run.resized_from is not None:
        say(f"{PROG}: the checkpoint was written with {run.resized_from} samples per step, this run has "
            f"{run.samples_per_step}: the rest of epoch {run.sampler.epoch + 1} ({_plural(len(run.sampler), 'step')}) "
            "uses the samples not yet seen, in the same order", file=sys.stderr)
    if run.done():
        say(f"{PROG}: nothing to do: the run is at step {st.step} after {_plural(run.sampler.epoch, 'epoch')} "
              f"(--epochs {run.epochs}, --max-steps {run.max_steps}); raise --epochs or --max-steps to continue",
              file=sys.stderr)
        return 0

    metrics = open_metrics(Path(cfg["metrics"]), st.step if ckpt else None) if run.main else open(os.devnull, "w")
    rep = Reporter(cfg, run.total_steps(), st, run.trainer, metrics, main=run.main)
    t0 = time.perf_counter()
    try:
        with stop_on_signals() as received, warnings.catch_warnings():
            # The trainer warns on every skipped non-finite step; the bar, logs and metrics count them instead.
            warnings.filterwarnings("ignore", message=r"vlseq_ext: .*non-finite gradient")
            run.fit(rep, received)
    finally:
        rep.close()
        metrics.close()
    wall = time.perf_counter() - t0

    plot_note = str(cfg["plot"])
    if not run.main:
        pass
    elif matplotlib_available():
        write_plot(Path(cfg["plot"]), st.history, f"{PROG}: {data.name}")
    else:
        plot_note = "skipped: matplotlib is not installed (pip install 'vlseq_ext[plot]')"
    if run.stop_signal is not None:
        say(f"{PROG}: stopped by {signal.Signals(run.stop_signal).name} after step {st.step}; checkpoint saved to "
            f"{run.ckpt_path}. Continue with: {PROG} --resume {cfg['checkpoint_dir']}", file=sys.stderr)
        code = 128 + run.stop_signal
    else:
        say(run.summary(wall, plot_note))
        code = 0
    if run.trainer.cross_process is not None:  # [distributed] no rank leaves before rank 0 has saved
        run.trainer.cross_process.barrier()
    return code


class _PeerFailed(Exception):
    """[distributed] rank 0 failed before training (and printed why); the other ranks exit quietly."""


def resolve_everywhere(args: argparse.Namespace) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """resolve_config; [distributed] on rank 0 only, which sends the configuration and the resumed
    checkpoint to the others, so every rank trains the same run and only rank 0 needs the files."""
    rank, world = distributed.rank_and_world()
    if world == 1:
        return resolve_config(args)
    payload: List[Any] = [None]
    if rank == 0:
        try:
            payload = [("ok", resolve_config(args))]
        except (DataError, CLIError) as exc:
            payload = [("error", str(exc))]
    try:
        torch.distributed.broadcast_object_list(payload, src=0)
    except Exception as exc:
        raise DistributedError(f"rank {rank}: could not receive the configuration from rank 0: "
                               f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc
    kind, value = payload[0]
    if kind == "error":
        if rank == 0:
            raise CLIError(value)
        raise _PeerFailed(value)
    return value


def _start_distributed() -> bool:
    """[distributed] Under torchrun (WORLD_SIZE > 1): initialise the default process group, gloo for
    CPU tensors and NCCL for CUDA ones, with the VLSEQ_DIST_TIMEOUT timeout. True when this call did."""
    if (distributed.env_world_size() == 1 or not torch.distributed.is_available()
            or torch.distributed.is_initialized()):
        return False
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    return distributed.init_from_env(backend)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `vlseq-train` and `python -m vlseq_ext`; returns the exit code."""
    args = build_parser().parse_args(argv)
    started = False
    try:
        started = _start_distributed()
        cfg, ckpt = resolve_everywhere(args)
        with deterministic_mode(bool(cfg["deterministic"])), cpu_threads():
            return train(cfg, ckpt)
    except (DataError, CLIError) as exc:
        rank, world = distributed.rank_and_world()
        print(f"{PROG}: {f'[rank {rank}] ' if rank else ''}error: {exc}", file=sys.stderr)
        return 2
    except _PeerFailed:
        return 2
    except DistributedError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: exiting without saving a checkpoint", file=sys.stderr)
        return 130
    finally:
        if started and torch.distributed.is_initialized():
            gc.collect()  # the finished run's trainer first (see distributed._close_at_exit), then the group
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
