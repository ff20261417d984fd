"""vlseq-train's options: the parser, the defaults, and the run's configuration (defaults, a resumed
checkpoint's configuration and the options given now), checked before anything is built."""
from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..checkpoint import CHECKPOINT_NAME, CheckpointError, find_checkpoint, read_checkpoint
from ..data import BUILTIN
from . import checks
from .checks import CLIError
from .reporting import matplotlib_available

from .._version import __version__

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
# Options that belong to this invocation only, never to the saved configuration.
NOT_SAVED = ("resume", "overwrite", "claimed_dirs", "replaces_old_run")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of vlseq-train (every default is None; see DEFAULTS)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train an LSTM/GRU on variable-length time series on every visible GPU (or the CPU), with "
                    "exact multi-device gradients, progress, metrics, a loss plot and exactly resumable checkpoints.\n"
                    "With no arguments: the seed's model on a built-in synthetic regression set (about a minute).\n"
                    "Predict with the trained model: vlseq-predict (or python -m vlseq_ext predict).",
        epilog="examples:\n"
               f"  {PROG}                                   # demo on synthetic data, all GPUs\n"
               f"  {PROG} --data japanese_vowels --epochs 10 --lr 3e-3  # aeon's JapaneseVowels: ~96% accuracy\n"
               f"  {PROG} --data my.npz --devices cuda:0,cuda:1 --samples-per-device 8 --amp bf16\n"
               f"  {PROG} --resume runs/vlseq-20261130-120000 --epochs 10   # continue a run\n\n"
               "A ragged .npz holds values (total_steps, D) float, offsets (N+1,) int64 from 0 to total_steps\n"
               "and targets (N, ...); write one with vlseq_ext.data.save_ragged(path, sequences, targets).\n"
               "Class labels are indices 0..C-1. Values are checked after the cast to float32.\n"
               "Ctrl-C or SIGTERM: the current step finishes, a checkpoint is saved, and the run exits with\n"
               "code 130 (SIGINT) or 143 (SIGTERM); a second Ctrl-C exits at once without saving.\n"
               "Bad input (missing or corrupt files, bad shapes, NaN, unknown GPUs, impossible output paths,\n"
               "a full disk, a run folder that already holds a run) exits with code 2 and one line.\n"
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
                   help=f"share of the samples held out for validation, in [0, 1) (default: {d['val_fraction']}; "
                        "japanese_vowels uses its official test split)")
    g.add_argument("--drop-nonfinite", action="store_true", default=None,
                   help="skip samples with NaN/inf values, or values that overflow float32 (and say how many), "
                        "instead of stopping with an error")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["lstm", "gru"], help=f"recurrent layer (default: {d['model']})")
    g.add_argument("--hidden", type=int, metavar="H", help=f"hidden size (default: {d['hidden']})")
    g.add_argument("--layers", type=int, metavar="N", help=f"stacked recurrent layers (default: {d['layers']})")
    g = p.add_argument_group("training")
    g.add_argument("--devices", metavar="SPEC",
                   help="'all' (every visible GPU, or the CPU when there is none), 'N' (the first N GPUs), "
                        f"'cuda:0,cuda:1', 'cpu', or 'cpu:N' for N CPU replicas (default: {d['devices']})")
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
                   help=f"the run folder: where {CHECKPOINT_NAME} (and, by default, metrics.jsonl and loss.png) go "
                        "(default: runs/vlseq-<date>-<time>, or the --resume directory). A folder that already "
                        "holds a run is refused unless --resume or --overwrite is given")
    g.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                   help="also checkpoint every STEPS steps (default: at the end of every epoch and of the run)")
    g.add_argument("--resume", metavar="DIR",
                   help="continue the run checkpointed in DIR (or a checkpoint file) with its configuration; "
                        "options given now override it, except model, data order and seed")
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --checkpoint-dir (or over a --metrics file) that holds an old run, "
                        "replacing it")
    g.add_argument("--metrics", metavar="PATH", help="JSON Lines metrics, one record per step and per epoch "
                                                     "(default: DIR/metrics.jsonl)")
    g.add_argument("--plot", metavar="PATH", help="the training and validation loss curves, written at the end; "
                                                  "the extension picks the format: .png, .pdf, .svg... "
                                                  "(default: DIR/loss.png; needs matplotlib)")
    g.add_argument("--quiet", action="store_true", default=None,
                   help="no progress bar: periodic log lines instead (as when stderr is not a terminal)")
    g.add_argument("--log-interval", type=float, metavar="SECONDS",
                   help=f"seconds between log lines without a progress bar (default: {d['log_interval']})")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _load_resumed(spec: str) -> Dict[str, Any]:
    try:
        return read_checkpoint(spec)
    except FileNotFoundError:
        raise CLIError(f"--resume {spec}: no checkpoint there (expected {CHECKPOINT_NAME} in a directory, "
                       "or a checkpoint file)") from None
    except CheckpointError as exc:
        raise CLIError(f"--resume: {exc}") from None


def resolve_config(args: argparse.Namespace) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Merge defaults, a resumed checkpoint's configuration and the options given now, and check
    the result: numbers, sizes, output paths, and that a new run does not reuse an old run's folder
    (nor a resume another run's, or a later point of its own). Returns (config, checkpoint or None).
    Touches no file but the default run folder, which it creates (empty) to claim its name."""
    given = {k: v for k, v in vars(args).items() if v is not None and k not in NOT_SAVED}
    overwrite = bool(getattr(args, "overwrite", False))
    ckpt = None
    if args.resume:
        if overwrite:
            raise CLIError("--overwrite starts a new run and --resume continues one: give one of them")
        ckpt = _load_resumed(args.resume)
        saved = {k: v for k, v in ckpt["config"].items() if k not in NOT_SAVED}
        for k in FIXED_ON_RESUME:
            if k in given and given[k] != saved.get(k):
                raise CLIError(f"--{k.replace('_', '-')} {given[k]} differs from the checkpoint's {saved.get(k)}; "
                               "a resumed run keeps its model, seed and data split")
        cfg = {**DEFAULTS, **saved, **given}
        if "data" not in given and cfg["data"] not in BUILTIN and not Path(cfg["data"]).exists():
            raise CLIError(f"--resume: the run's data {cfg['data']} (saved in the checkpoint, relative to the folder "
                           f"the run started in) is not there from {Path.cwd()}: run from that folder, or pass --data")
        resumed = find_checkpoint(args.resume)  # (read_checkpoint found it)
        resumed_dir = resumed.parent
        fork = "checkpoint_dir" in given and not checks.same_file(Path(given["checkpoint_dir"]), resumed_dir)
        if "checkpoint_dir" not in given:
            cfg["checkpoint_dir"] = str(resumed_dir)
        if fork:  # a run of its own from here on: its checkpoints must not pass for the original's
            cfg["run_id"], cfg["forked_from"] = uuid.uuid4().hex, saved.get("run_id")
        for k in ("metrics", "plot"):  # follow the checkpoint directory unless a path was given now
            if k not in given and (saved.get(f"{k}_default") or fork):  # a fork leaves the original's files alone
                cfg[k] = None
            elif k in given and not fork and saved.get(k) and not checks.same_file(Path(given[k]), Path(saved[k])):
                # another file than the run's own: it starts afresh, so it must not be another run's
                checks.check_new_output(Path(given[k]), f"--{k}")
    else:
        cfg = {**DEFAULTS, **given, "run_id": uuid.uuid4().hex}  # tells this run's checkpoints from others'
        for k in ("metrics", "plot"):  # absolute: a resume from another folder must find the same files
            if cfg[k] is not None:
                cfg[k] = os.path.abspath(cfg[k])  # (also "other/../m.jsonl" -> m.jsonl: no empty other/ made)
        fork, resumed = False, None
    if ("max_steps" in given) != ("epochs" in given):  # one limit given alone replaces both
        cfg["epochs" if "max_steps" in given else "max_steps"] = None
    if cfg["amp"] == "none":
        cfg["amp"] = None
    checks.check_numbers(cfg)
    checks.check_sizes(cfg, ckpt)
    if cfg["checkpoint_dir"]:
        cfg["checkpoint_dir"] = os.path.normpath(cfg["checkpoint_dir"])
    claimed = [] if cfg["checkpoint_dir"] else _claim_run_folder()
    if claimed:
        cfg["checkpoint_dir"] = str(claimed[0])
        cfg["claimed_dirs"] = claimed  # (not saved) the run's lock removes them again if it leaves them empty
    try:
        for k, name in (("metrics", "metrics.jsonl"), ("plot", "loss.png")):
            cfg[f"{k}_default"] = cfg[k] is None
            if cfg[k] is None:
                cfg[k] = str(Path(cfg["checkpoint_dir"]) / name)
        if not cfg["plot_default"] and not matplotlib_available():
            raise CLIError(f"--plot {cfg['plot']}: matplotlib is not installed (pip install 'vlseq_ext[plot]')")
        checks.check_output_paths(cfg, resumed)
        if (ckpt is None and not overwrite) or fork:
            checks.check_not_a_previous_run(cfg, fork)
        if ckpt is not None:
            checks.check_resume_target(cfg, resumed, ckpt)
    except BaseException:
        checks.remove_empty_dirs(claimed)  # nothing was written in them
        raise
    return cfg, ckpt


def _claim_run_folder() -> List[Path]:
    """A new folder runs/vlseq-<time>[-N], created here so that runs started in the same second each
    get their own (mkdir either creates it or fails: no two runs can both take one name). Returns the
    folders created, deepest (the run folder) first, as checks.missing_dirs lists them."""
    base = Path("runs") / time.strftime("vlseq-%Y%m%d-%H%M%S")
    created = checks.missing_dirs(base.parent)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CLIError(f"--checkpoint-dir: cannot create {base.parent}: {exc.strerror or exc}") from None
    for i in range(1, 10_000):
        run_dir = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            run_dir.mkdir()
            return [run_dir] + created
        except FileExistsError:
            continue
        except OSError as exc:
            raise CLIError(f"--checkpoint-dir: cannot create {run_dir}: {exc.strerror or exc}") from None
    raise CLIError(f"cannot find a free run folder name beside {base}: pass --checkpoint-dir")
