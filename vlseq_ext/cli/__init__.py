"""vlseq-train (and vlseq-predict): train a sequence model on variable-length time series on every
visible GPU, and predict with what was trained.

With no arguments `vlseq-train` trains the seed's model (LSTM(36 -> 64) + Linear(64 -> 1)) on a
built-in synthetic dataset, on all GPUs (or the CPU), and prints a summary. See `vlseq-train --help`
and `vlseq-predict --help`. `python -m vlseq_ext [train] ...` is vlseq-train, `python -m vlseq_ext
predict ...` is vlseq-predict.

Modules: config (options, defaults, the run's configuration), checks (what is refused before
anything starts), run (building, restoring and saving a run), training (the training loop's callbacks,
signals, plot and summary), reporting (progress, metrics, plot, summary), predict (vlseq-predict).

Exit codes: 0 done; 2 bad input or configuration (one line on stderr: missing or corrupt files,
impossible options or output paths, a full disk, a run folder that holds another run); 1 a failure
across processes; 128 + signal number when SIGINT/SIGTERM stopped training after a checkpoint.

Under torchrun (several processes, one or more machines; docs/multi-node.md) every process trains
its share of each global step (vlseq_ext.distributed); rank 0 alone resolves the configuration and
reads a resumed checkpoint (and sends both to the others), prints, shows progress, writes metrics,
the plot and checkpoints. Checkpoints resume on any world size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import distributed
from ..data import DataError
from ..distributed import DistributedError
from .checks import CLIError
from .config import DEFAULTS, PROG, build_parser, resolve_config
from .reporting import Reporter, RunState, matplotlib_available, one_line_warnings, open_metrics, write_plot
from .run import Run, RunFolderLock, evaluate_split
from .training import cpu_threads, deterministic_mode, train

__all__ = ["main", "train_main", "CLIError", "PROG", "DEFAULTS", "build_parser", "resolve_config", "Run",
           "evaluate_split", "Reporter", "RunState", "open_metrics", "matplotlib_available", "write_plot",
           "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_OK = 0
EXIT_FAILURE = 1  # a failure across processes (DistributedError)
EXIT_USAGE = 2  # bad input, options or paths: one line on stderr
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM gives 143


class _PeerFailed(Exception):
    """[distributed] rank 0 failed before training (and printed why); the other ranks exit quietly."""


def _resolve_and_lock(args: argparse.Namespace) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]], RunFolderLock]:
    cfg, ckpt = resolve_config(args)
    lock = RunFolderLock(Path(cfg["checkpoint_dir"]), cfg.pop("claimed_dirs", ()))
    cfg["replaces_old_run"] = bool(getattr(args, "overwrite", False))  # (not saved) see training.train
    return cfg, ckpt, lock


def resolve_everywhere(args: argparse.Namespace, group: distributed.ProcessGroup) -> Tuple[
        Dict[str, Any], Optional[Dict[str, Any]], Optional[RunFolderLock]]:
    """resolve_config, then the run folder's lock (the caller releases it); [distributed] on rank 0
    only, which sends the configuration and the resumed checkpoint to the others, so every rank
    trains the same run and only rank 0 needs the files (and holds the lock)."""
    if group.world_size == 1:
        return _resolve_and_lock(args)
    payload: Any = None
    lock: Optional[RunFolderLock] = None
    if group.rank == 0:
        try:
            cfg, ckpt, lock = _resolve_and_lock(args)
            payload = ("ok", (cfg, ckpt))
        except (DataError, CLIError) as exc:
            payload = ("error", str(exc))
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
    return (*value, lock)


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    """vlseq-train; returns the exit code."""
    args = build_parser().parse_args(argv)
    group: distributed.ProcessGroup = distributed.ProcessGroup()
    lock: Optional[RunFolderLock] = None
    try:
        group = distributed.start()
        with one_line_warnings(PROG):
            cfg, ckpt, lock = resolve_everywhere(args, group)
            with deterministic_mode(bool(cfg["deterministic"])), cpu_threads():
                return train(cfg, ckpt, group)
    except (DataError, CLIError) as exc:
        print(f"{PROG}: {f'[rank {group.rank}] ' if group.rank else ''}error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _PeerFailed:
        return EXIT_USAGE
    except DistributedError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # before training started (train() reports one that comes later)
        print(f"{PROG}: interrupted before training started: no checkpoint was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if lock is not None:
            lock.release()
        group.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `vlseq-train` and `python -m vlseq_ext`: `predict ...` runs vlseq-predict,
    `train ...` or anything else vlseq-train. Returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "predict":
        from .predict import main as predict_main
        return predict_main(args[1:])
    if args and args[0] == "train":
        args = args[1:]
    return train_main(args)


if __name__ == "__main__":
    sys.exit(main())
