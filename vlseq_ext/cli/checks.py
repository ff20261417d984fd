"""Checks that run before any training (or prediction) starts, each failing with one line (CLIError,
exit code 2): numbers that make no sense, sizes that cannot fit, output paths that cannot be written,
and a new run that would overwrite an old one. They touch no file: a directory created to prove
that it can be is removed again."""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..checkpoint import CHECKPOINT_NAME
from ..files import is_stream

# The model may not have more parameters than this (8 GiB of float32 weights, and as much again for
# the gradients and twice for Adam's state, per device).
MAX_PARAMETERS = 2 ** 31
# The synthetic set: 36 features, lengths 50..500 (mean 275); building it holds about 3 copies.
SYNTHETIC_BYTES_PER_SAMPLE = 275 * 36 * 4 * 3
FALLBACK_PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                         "tiff", "webp")


class CLIError(Exception):
    """A usage or configuration problem: printed as one line, exit code 2."""


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _gb(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e6:,.1f} MB"


def check_numbers(cfg: Dict[str, Any]) -> None:
    """Every numeric option: finite, and in the range where it means something."""
    for k in ("hidden", "layers", "samples_per_device", "synthetic_samples"):
        if cfg[k] < 1:
            raise CLIError(f"{_flag(k)} must be >= 1, got {cfg[k]}")
    for k in ("epochs", "max_steps"):
        if cfg[k] is not None and cfg[k] < 1:
            raise CLIError(f"{_flag(k)} must be >= 1, got {cfg[k]}")
    if cfg["checkpoint_every"] < 0:
        raise CLIError(f"--checkpoint-every must be >= 0 (0: only at epoch ends), got {cfg['checkpoint_every']}")
    if not 0 <= cfg["seed"] < 2 ** 63:
        raise CLIError(f"--seed must be in [0, 2**63), got {cfg['seed']}")
    positive = {"lr": cfg["lr"], "log_interval": cfg["log_interval"]}
    if cfg["clip_grad"] is not None:
        positive["clip_grad"] = cfg["clip_grad"]
    for k, v in positive.items():
        if not (math.isfinite(v) and v > 0):
            raise CLIError(f"{_flag(k)} must be a finite number > 0, got {v}")
    v = cfg["val_fraction"]
    if not (math.isfinite(v) and 0 <= v < 1):
        raise CLIError(f"--val-fraction must be in [0, 1), got {v}")


def physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def rnn_parameters(rnn: str, input_dim: int, hidden: int, layers: int, output_dim: int) -> int:
    """Parameters of SeqModel (unidirectional): gates x H x (in + H + 2) per layer, plus the head."""
    gates = 4 if rnn == "lstm" else 3
    n = sum(gates * hidden * ((input_dim if layer == 0 else hidden) + hidden + 2) for layer in range(layers))
    return n + hidden * output_dim + output_dim


def check_model_size(rnn: str, input_dim: int, hidden: int, layers: int, output_dim: int, what: str = "") -> None:
    n = rnn_parameters(rnn, input_dim, hidden, layers, output_dim)
    if n > MAX_PARAMETERS:
        raise CLIError(f"{what or f'--hidden {hidden} --layers {layers}'}: the model would have {n:,} parameters "
                       f"({_gb(4 * n)} of float32 weights, about {_gb(16 * n)} with gradients and Adam's state); "
                       f"the limit is {MAX_PARAMETERS:,}")


def check_sizes(cfg: Dict[str, Any], ckpt: Optional[Dict[str, Any]]) -> None:
    """Refuse sizes that cannot fit before anything is allocated: the model (with what is known of the
    data now; the run checks again with the data's real shape) and the synthetic set."""
    meta = (ckpt or {}).get("data") or {}
    features = int(meta.get("num_features", 36 if cfg["data"] == "synthetic" else 1))
    outputs = int(meta.get("output_dim", 1))
    check_model_size(cfg["model"], features, cfg["hidden"], cfg["layers"], outputs)
    if cfg["data"] == "synthetic":
        need, have = cfg["synthetic_samples"] * SYNTHETIC_BYTES_PER_SAMPLE, physical_memory()
        if need > (have or 64 * 2 ** 30):
            raise CLIError(f"--synthetic-samples {cfg['synthetic_samples']}: building the synthetic set needs about "
                           f"{_gb(need)} of memory, this machine has {_gb(have) if have else 'less'}")


# ------------------------------------------------------------------------------------------------
# output paths


def missing_dirs(path: Path) -> List[Path]:
    """path and its ancestors that do not exist yet, deepest first (what mkdir(parents=True) makes)."""
    missing: List[Path] = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_dirs(dirs: Sequence[Path]) -> None:
    """Remove these folders (deepest first, as missing_dirs lists them) while they are empty: undo
    what a check or a run created and left nothing in."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            break


def check_dir(path: Path, flag: str) -> None:
    """`path` is (or can be created as) a directory where files can be written. Creates nothing that
    stays: a missing directory is created and removed again."""
    if path.exists():
        if not path.is_dir():
            raise CLIError(f"{flag} {path}: is a file, not a directory" if path.is_file()
                           else f"{flag} {path}: exists and is not a directory")
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise CLIError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None
        return
    missing = missing_dirs(path)
    p = missing[-1].parent if missing else path
    if p.exists() and not p.is_dir():
        raise CLIError(f"{flag} {path}: cannot be created: {p} is a file, not a directory")
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise CLIError(f"{flag} {path}: cannot be created in {p}: {exc.strerror or exc}") from None
    remove_empty_dirs(missing)  # leave the file system as it was


def check_file(path: Path, flag: str, formats: Optional[Iterable[str]] = None) -> None:
    """`path` can be written as a file: not a directory, its folder usable, its extension one of
    `formats` (when given). An existing file is fine (the caller decides about overwriting)."""
    if formats is not None and not is_stream(path):  # (a stream such as /dev/null needs no extension)
        ext = path.suffix.lower().lstrip(".")
        known = sorted(formats)
        if not ext:
            raise CLIError(f"{flag} {path}: no file extension (use one of: {', '.join('.' + f for f in known)})")
        if ext not in known:
            raise CLIError(f"{flag} {path}: unknown extension .{ext} (use one of: "
                           f"{', '.join('.' + f for f in known)})")
    try:
        path.resolve()
    except (OSError, RuntimeError):
        raise CLIError(f"{flag} {path}: is a symbolic link loop") from None
    if path.is_dir():
        raise CLIError(f"{flag} {path}: is a directory, not a file")
    if path.exists():
        if path.is_file() and not os.access(path, os.W_OK):
            raise CLIError(f"{flag} {path}: the file is not writable")
        return
    check_dir(path.parent if str(path.parent) else Path("."), flag + " folder")


def same_file(a: Path, b: Path) -> bool:
    """a and b name one file: the same path once links are followed, or one inode (a hard link)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # (a symbolic link loop: RuntimeError before Python 3.13)
        return False


def check_outputs_distinct(outputs: Sequence[Tuple[str, Path]], inputs: Sequence[Tuple[str, Path]] = ()) -> None:
    """No output is one of the input files or another output: --overwrite replaces old outputs, never
    the data or checkpoint being read, and two outputs of one run never write the same file."""
    for i, (flag, path) in enumerate(outputs):
        for other_flag, other in inputs:
            if same_file(path, other):
                raise CLIError(f"{flag} {path} is the {other_flag} file, which is read: choose another file")
        for other_flag, other in outputs[:i]:
            if same_file(path, other):
                raise CLIError(f"{flag} {path} is the {other_flag} file: choose another file")


def plot_formats() -> List[str]:
    """The file formats matplotlib can save (a fixed list when matplotlib is not installed)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
        return sorted(FigureCanvasBase.get_supported_filetypes())
    except ImportError:
        return list(FALLBACK_PLOT_FORMATS)


def check_output_paths(cfg: Dict[str, Any], resumed: Optional[Path] = None) -> None:
    """The run's outputs can be written, and none is the data file, the checkpoint resumed from (the
    new checkpoint may replace that one: it continues the run) or another output."""
    check_dir(Path(cfg["checkpoint_dir"]), "--checkpoint-dir")
    check_file(Path(cfg["checkpoint_dir"]) / CHECKPOINT_NAME, "--checkpoint-dir")  # (not a directory: found late)
    check_file(Path(cfg["metrics"]), "--metrics")
    check_file(Path(cfg["plot"]), "--plot", plot_formats())
    outputs = [("--metrics", Path(cfg["metrics"])), ("--plot", Path(cfg["plot"]))]
    data = Path(cfg["data"])
    check_outputs_distinct(outputs + [("--checkpoint-dir", Path(cfg["checkpoint_dir"]) / CHECKPOINT_NAME)],
                           [("--data", data)] if data.exists() else [])
    if resumed is not None:
        check_outputs_distinct(outputs, [("--resume", resumed)])


def _holds_something(path: Path) -> bool:
    """A regular file with content: an output that replacing would lose (an empty one loses nothing)."""
    return path.is_file() and path.stat().st_size > 0


def check_not_a_previous_run(cfg: Dict[str, Any], fork: bool = False) -> None:
    """A new run (or a fork of one into a new folder) must not replace an old run's checkpoint,
    metrics or plot (use --resume or --overwrite)."""
    run_dir = Path(cfg["checkpoint_dir"])
    ckpt = run_dir / CHECKPOINT_NAME
    outputs = [(ckpt, "--checkpoint-dir"), (Path(cfg["metrics"]), "--metrics"), (Path(cfg["plot"]), "--plot")]
    found = [(p, flag) for p, flag in outputs if _holds_something(p)]
    if not found:
        return
    names = ", ".join(str(p) for p, _ in found)
    if fork:  # (--overwrite cannot go with --resume)
        raise CLIError(f"--checkpoint-dir {run_dir} already holds files of another run ({names}): fork into a new "
                       "--checkpoint-dir")
    if ckpt.is_file():
        raise CLIError(f"--checkpoint-dir {run_dir} already holds a run ({names}): continue it with --resume "
                       f"{run_dir}, choose another --checkpoint-dir, or pass --overwrite to replace it")
    explicit = [(p, flag) for p, flag in found if not cfg.get(f"{flag[2:]}_default", True)]
    if explicit:
        path, flag = explicit[0]
        raise CLIError(f"{flag} {path} already exists: choose another {flag} file, or pass --overwrite to replace it")
    raise CLIError(f"--checkpoint-dir {run_dir} holds the outputs of a run that saved no checkpoint ({names}), "
                   "so there is nothing to resume: choose another --checkpoint-dir, or pass --overwrite to replace them")


def check_new_output(path: Path, flag: str) -> None:
    """An output given now to a resumed run, other than the run's own: a file there is another's."""
    if _holds_something(path):
        raise CLIError(f"{flag} {path} already exists and is not this run's {flag[2:]} file: choose another {flag} "
                       "file (a resume continues its own files)")


def check_resume_target(cfg: Dict[str, Any], resumed: Path, ckpt: Dict[str, Any]) -> None:
    """A resume writes its checkpoint to --checkpoint-dir/last.pt. Refused when that file is not the
    one resumed and holds another run, or a later point of this run: the resume would replace it."""
    target = Path(cfg["checkpoint_dir"]) / CHECKPOINT_NAME
    if not target.exists() or same_file(target, resumed):
        return
    from ..checkpoint import CheckpointError, read_checkpoint
    try:
        there = read_checkpoint(target, need=("config", "run"))
        run_id, step = there["config"].get("run_id"), int(there["run"]["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        run_id, step = None, None
    mine = ckpt["config"].get("run_id")
    if mine is not None and run_id == mine and step is not None and step <= int(ckpt["run"]["step"]):
        return  # an earlier point of this very run: continuing from a later copy loses nothing
    what = (f"step {step} of this run, later than the resumed step {int(ckpt['run']['step'])}"
            if mine is not None and run_id == mine else "another run")
    raise CLIError(f"--checkpoint-dir {target.parent}: {target} holds {what}; resuming {resumed} here would "
                   "replace it: give another --checkpoint-dir (a fork of the resumed run)")
