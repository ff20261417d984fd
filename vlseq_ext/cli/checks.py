"""Checks that run before any training (or prediction) starts, each failing with one line (CLIError,
exit code 2): sizes that cannot fit, and paths that cannot be written (what may be written where is
file_rules). They touch no file: a directory created to prove that it can be is removed again."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from ..checkpoint_fields import MAX_PARAMETERS, rnn_parameters
from ..files import descriptor_problem, is_stream, path_problem

# The synthetic set: 36 features, lengths 50..500 (mean 275); building it holds about 3 copies.
SYNTHETIC_BYTES_PER_SAMPLE = 275 * 36 * 4 * 3
FALLBACK_PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif",
                         "tiff", "webp")


class CLIError(Exception):
    """A usage or configuration problem: printed as one line, exit code 2."""


def one_line(text: object) -> str:
    """`text` as one line: a control character (a newline in a file name, an escape sequence) or a
    surrogate of a name that is not UTF-8 is written as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def _gb(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e6:,.1f} MB"


def physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_model_size(rnn: str, input_dim: int, hidden: int, layers: int, output_dim: int, what: str = "",
                     cpu_replicas: int = 1) -> None:
    """The model fits the parameter limit, and its cpu_replicas copies (weights and gradients each, and
    Adam's state once) fit in this machine's memory."""
    n = rnn_parameters(rnn, input_dim, hidden, layers, output_dim)
    if n > MAX_PARAMETERS:
        raise CLIError(f"{what or f'--hidden {hidden} --layers {layers}'}: the model would have {n:,} parameters "
                       f"({_gb(4 * n)} of float32 weights, about {_gb(16 * n)} with gradients and Adam's state); "
                       f"the limit is {MAX_PARAMETERS:,}")
    need, have = 4 * n * (2 * cpu_replicas + 2), physical_memory()
    if cpu_replicas > 1 and have and need > have:
        raise CLIError(f"--devices cpu:{cpu_replicas}: {cpu_replicas} CPU replicas of a model of {n:,} parameters "
                       f"need about {_gb(need)} of memory, this machine has {_gb(have)}: give fewer replicas")


def devices_error(spec: str, exc: ValueError) -> CLIError:
    """parse_devices' error as the --devices flag's (its text starts with "devices '<spec>': ")."""
    text = str(exc)
    return CLIError(f"--devices {spec}: {text.split(': ', 1)[1] if text.startswith('devices ') else text}")


def check_sizes(config: Any, ckpt: Optional[Dict[str, Any]]) -> None:
    """Refuse sizes that cannot fit before anything is allocated: the model (with what is known of the
    data now; the run checks again with the data's real shape) and the synthetic set."""
    meta = (ckpt or {}).get("data") or {}
    features = int(meta.get("num_features", 36 if config.data == "synthetic" else 1))
    outputs = int(meta.get("output_dim", 1))
    check_model_size(config.model, features, config.hidden, config.layers, outputs)
    if config.data == "synthetic":
        need, have = config.synthetic_samples * SYNTHETIC_BYTES_PER_SAMPLE, physical_memory()
        if need > (have or 64 * 2 ** 30):
            raise CLIError(f"--synthetic-samples {config.synthetic_samples}: building the synthetic set needs about "
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


def check_path(path: Path, flag: str, dangling_ok: bool = False) -> None:
    """A path given for `flag` can be looked up (files.path_problem: no name too long, no symbolic link
    loop, no link to nothing on the way, unless dangling_ok for the link at its end)."""
    problem = path_problem(path, dangling_ok)
    if problem:
        raise CLIError(f"{flag} {path}: {problem}")


def check_dir(path: Path, flag: str) -> None:
    """`path` is (or can be created as) a directory where files can be written. Creates nothing that
    stays: a missing directory is created and removed again."""
    check_path(path, flag)
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
    """`path` can be written as a file: not a directory, its folder usable (a symbolic link to nothing
    is written through: its target's), its extension one of `formats` (when given). An existing file
    is fine (the caller decides about overwriting)."""
    check_path(path, flag, dangling_ok=True)
    problem = descriptor_problem(path)
    if problem:
        raise CLIError(f"{flag} {path}: {problem}")
    if formats is not None and not is_stream(path):  # (a stream such as /dev/null needs no extension)
        ext = path.suffix.lower().lstrip(".")
        known = sorted(formats)
        if not ext:
            raise CLIError(f"{flag} {path}: no file extension (use one of: {', '.join('.' + f for f in known)})")
        if ext not in known:
            raise CLIError(f"{flag} {path}: unknown extension .{ext} (use one of: "
                           f"{', '.join('.' + f for f in known)})")
    if path.is_symlink() and not path.exists():
        path = Path(os.path.realpath(path))
    if path.is_dir():
        raise CLIError(f"{flag} {path}: is a directory, not a file")
    if path.exists():
        if path.is_file() and not os.access(path, os.W_OK):
            raise CLIError(f"{flag} {path}: the file is not writable")
        return
    check_dir(path.parent if str(path.parent) else Path("."), flag + " folder")


def plot_formats() -> List[str]:
    """The file formats matplotlib can save (a fixed list when matplotlib is not installed)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
        return sorted(FigureCanvasBase.get_supported_filetypes())
    except ImportError:
        return list(FALLBACK_PLOT_FORMATS)
