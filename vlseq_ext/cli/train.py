"""vlseq-train: train a sequence model on variable-length time series on every visible GPU (or the CPU).

`main` is the command: options -> the run's configuration (resolve; [distributed] on rank 0, sent to
the others) -> the run folder's lock -> `train`, which builds or restores the run (run.py), trains it
with the CLI's callbacks (callbacks.py), then writes the plot and the summary.

Exit codes: 0 done; 2 bad input or configuration (one line on stderr: missing or corrupt files,
impossible options or output paths, a full disk, a run folder that holds another run); 1 a failure
across processes; 128 + signal number when SIGINT/SIGTERM stopped training after a checkpoint.

Under torchrun (several processes, one or more machines; docs/multi-node.md) every process trains
its share of each global step; rank 0 alone resolves the configuration and reads a resumed checkpoint
(and sends both to the others), prints, shows progress, writes metrics, the plot and checkpoints.
Checkpoints resume on any world size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch

from .. import distributed, env
from ..data import BUILTIN, DataError
from ..distributed import DistributedError, ProcessGroup
from .callbacks import CLICallbacks, stop_on_signals
from .checks import CLIError, one_line
from .config import PROG, build_parser
from .locks import RunLock
from .metrics import MetricsFile, open_metrics_file
from .reporting import Reporter, describe_model, format_summary, matplotlib_available, one_line_warnings, plural, \
    summary_rows, write_plot
from .resolve import Resolved, resolve
from .run import Run, build_run, remove_replaced_checkpoint, restore_run

__all__ = ["main", "train", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_OK = 0
EXIT_FAILURE = 1  # a failure across processes (DistributedError)
EXIT_USAGE = 2  # bad input, options or paths: one line on stderr
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM gives 143


class _PeerFailed(Exception):
    """[distributed] rank 0 failed before training (and printed why); the other ranks exit quietly."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """vlseq-train; returns the exit code."""
    args = build_parser().parse_args(argv)
    group: ProcessGroup = ProcessGroup()
    lock: Optional[RunLock] = None
    try:
        group = distributed.start()
        with one_line_warnings(PROG):
            resolved, lock = _resolve_on_rank0(args, group)
            with deterministic_mode(resolved.config.deterministic), cpu_threads():
                return train(resolved, group)
    except (DataError, CLIError) as exc:
        print(f"{PROG}: {f'[rank {group.rank}] ' if group.rank else ''}error: {one_line(message(exc))}",
              file=sys.stderr)
        return EXIT_USAGE
    except _PeerFailed:
        return EXIT_USAGE
    except DistributedError as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # before training started (train() reports one that comes later)
        print(f"{PROG}: interrupted before training started: no checkpoint was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if lock is not None:
            lock.release()
        group.close()


# What vlseq-train tells a user to do about the data errors that name a library parameter.
DATA_HINTS = {"drop_nonfinite": "pass --drop-nonfinite to skip such samples",
              "val_fraction": "give a smaller --val-fraction",
              "task": "leave out --task for a built-in set",
              "data": f"--data takes a .npz or .ts file, or one of: {', '.join(BUILTIN)}"}


def message(exc: Exception) -> str:
    """The one line of an error: a data error with vlseq-train's hint for the parameter it names."""
    if isinstance(exc, DataError):
        return exc.with_hint(DATA_HINTS)
    return str(exc)


def _resolve_on_rank0(args: Any, group: ProcessGroup) -> Tuple[Resolved, Optional[RunLock]]:
    """resolve, which takes the lock of the run's folder and files (returned: the caller releases it);
    [distributed] on rank 0 only, which sends the result to the others, so every rank trains the same
    run and only rank 0 needs the files (and holds the lock)."""
    payload: Any = None
    lock: Optional[RunLock] = None
    if group.rank == 0:
        try:
            resolved = resolve(args)
            lock = resolved.lock
            payload = ("ok", dataclasses.replace(resolved, lock=None))
        except (DataError, CLIError) as exc:
            if group.world_size == 1:
                raise
            payload = ("error", message(exc))
    try:
        kind, value = group.broadcast_object(payload)
    except DistributedError:
        if lock is not None:
            lock.release()
        raise
    if kind == "error":
        if group.rank == 0:
            raise CLIError(value)
        raise _PeerFailed(value)
    return value, lock


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms + cuDNN determinism for the duration (restored after)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    if enabled:
        env.require_deterministic_cublas()
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


@contextlib.contextmanager
def cpu_threads() -> Iterator[None]:
    """One intra-op CPU thread unless OMP_NUM_THREADS says otherwise, as torchrun does: the small
    per-sample kernels gain nothing from more, and on a busy machine spinning OpenMP threads slow
    training down many times over. Restored afterwards."""
    saved = torch.get_num_threads()
    if not env.omp_threads_given():
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def train(resolved: Resolved, group: ProcessGroup) -> int:
    """Run (or continue) one training run; returns the exit code."""
    ckpt = resolved.checkpoint
    run = build_run(resolved.config, group, ckpt["data"] if ckpt else None)
    resized_from = restore_run(run, ckpt) if ckpt else None
    if resolved.replaces_old_run:
        remove_replaced_checkpoint(run)
    try:
        return _train(run, resumed=ckpt is not None, resized_from=resized_from)
    except KeyboardInterrupt:  # a second Ctrl-C, or one after training: say what is on disk
        if run.main:
            where = (f"the checkpoint of step {run.saved_step} is in {run.checkpoint_path}"
                     if run.saved_step is not None else "no checkpoint was saved")
            print(f"{PROG}: interrupted: exiting at once; {where}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _train(run: Run, resumed: bool, resized_from: Optional[int]) -> int:
    loop, data, config = run.loop, run.data, run.config
    say = print if run.main else (lambda *a, **k: None)  # [distributed] rank 0 speaks for all
    say(f"{PROG}: {data.name}: {len(data)} train / {len(run.val) if run.val else 0} validation samples, "
        f"{data.num_features} features, lengths {int(data.lengths.min())}-{int(data.lengths.max())}, {data.task}"
        + (f" ({data.output_dim} classes)" if data.task == "classification" else "")
        + (f", from {data.source}" if data.source else ""), file=sys.stderr)
    say(f"{PROG}: {describe_model(run.model)} on {run.devices_text()}, "
        f"{plural(run.samples_per_step, 'sample')} per step; checkpoints in {config.checkpoint_dir}"
        + (f"; resuming at step {loop.step} (epoch {loop.epoch + 1}, batch {loop.position})" if resumed else ""),
        file=sys.stderr)
    if resized_from is not None:
        say(f"{PROG}: the checkpoint was written with {resized_from} samples per step, this run has "
            f"{run.samples_per_step}: the rest of epoch {loop.epoch + 1} ({plural(len(run.sampler), 'step')}) "
            "uses the samples not yet seen, in the same order", file=sys.stderr)
    if loop.done():
        limits = [(f, v) for f, v in (("--epochs", loop.epochs), ("--max-steps", loop.max_steps)) if v]
        say(f"{PROG}: nothing to do: the run is at step {loop.step} after {plural(loop.epoch, 'epoch')} "
            f"({', '.join(f'{f} {v}' for f, v in limits)}); raise {' or '.join(f for f, _ in limits)} to continue",
            file=sys.stderr)
        return EXIT_OK

    metrics = (open_metrics_file(Path(config.metrics), loop.step if resumed else None) if run.main
               else MetricsFile(None, open(os.devnull, "w")))
    rep = Reporter(loop.total_steps(), run.state, run.trainer, metrics, run.main, config.quiet, config.log_interval)
    callbacks = CLICallbacks(run, rep)
    loop.callbacks.append(callbacks)
    t0 = time.perf_counter()
    try:
        with stop_on_signals(loop), warnings.catch_warnings():
            # The trainer warns on every skipped non-finite step; the bar, logs and metrics count them instead.
            warnings.filterwarnings("ignore", message=r"vlseq_ext: .*non-finite gradient")
            reason = loop.run()
    finally:
        rep.close()
        metrics.close()
    wall = time.perf_counter() - t0

    plot_note = _plot(run) if run.main else ""
    sig = _stop_signal(reason)
    if sig is not None:
        say(f"{PROG}: stopped by {signal.Signals(sig).name} after step {loop.step}; checkpoint saved to "
            f"{run.checkpoint_path}. Continue with: {PROG} --resume {config.checkpoint_dir}", file=sys.stderr)
        code = 128 + sig
    else:
        say(format_summary(PROG, summary_rows(run, callbacks.samples_done, wall, plot_note)))
        code = EXIT_OK
    run.group.barrier()  # [distributed] no rank leaves before rank 0 has saved
    return code


def _stop_signal(reason: Any) -> Optional[int]:
    """The signal that stopped the run: this process's, or SIGTERM when another rank's (torchrun
    passes SIGTERM on to every worker)."""
    if isinstance(reason, int):
        return reason
    return int(signal.SIGTERM) if reason == "peer" else None


def _plot(run: Run) -> str:
    """Writes the plot; returns the summary's note. Never raises (but for KeyboardInterrupt)."""
    if not matplotlib_available():
        return "skipped: matplotlib is not installed (pip install 'vlseq_ext[plot]')"
    try:
        return write_plot(Path(run.config.plot), run.state.history, f"{PROG}: {run.data.name}")
    except Exception as exc:  # noqa: BLE001 - the summary must survive any plotting failure
        text = str(exc).strip().splitlines()
        return f"not written: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
