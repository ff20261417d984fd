"""From the command line to a run: the configuration (defaults, a resumed checkpoint's configuration
and the options given now), checked before anything is built, and the run folder claimed."""
from __future__ import annotations

import argparse
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..checkpoint import CHECKPOINT_NAME, DAMAGED, CheckpointError, find_checkpoint, read_checkpoint
from ..checkpoint_fields import FieldError
from ..data import BUILTIN
from . import checks, file_rules
from .checks import CLIError
from .config import RunConfig, flag, given_options
from .locks import RunLock
from .reporting import RunState, matplotlib_available

__all__ = ["Resolved", "resolve"]


@dataclass(frozen=True)
class Resolved:
    """A run to start or continue: its configuration, the checkpoint it resumes (None for a new run),
    whether it replaces an old run in its folder (--overwrite), and the lock that holds its folder
    and files (the caller releases it; None in what is sent to other processes)."""
    config: RunConfig
    checkpoint: Optional[Dict[str, Any]]
    replaces_old_run: bool = False
    lock: Optional[RunLock] = field(default=None, compare=False)


def _load_resumed(spec: str) -> Dict[str, Any]:
    try:
        return read_checkpoint(spec)
    except FileNotFoundError:
        raise CLIError(f"--resume {spec}: no checkpoint there (expected {CHECKPOINT_NAME} in a directory, "
                       "or a checkpoint file)") from None
    except CheckpointError as exc:
        raise CLIError(f"--resume: {exc}") from None


def resolve(args: argparse.Namespace) -> Resolved:
    """Merge defaults, a resumed checkpoint's configuration and the options given now, and check the
    result: numbers, sizes, output paths and the file rules (file_rules.RULES). Touches no file but
    the default run folder, which it creates (empty) to claim its name, and what the lock takes: the
    run folder and its output files (created empty until written; the file rules that read them run
    under the lock, so no other run can come between the check and the writing)."""
    given = given_options(args)
    for k in ("metrics", "plot"):  # absolute-outputs
        if given.get(k) is not None:
            given[k] = os.path.abspath(given[k])
    ckpt, resumed, fork, others = None, None, False, []
    if args.resume:
        if args.overwrite:
            file_rules.refuse("overwrite-or-resume")
        checks.check_path(Path(args.resume), "--resume")
        ckpt = _load_resumed(args.resume)
        values, resumed, fork, others = _continued(given, ckpt, find_checkpoint(args.resume))
    else:
        values = {**RunConfig.defaults(), **given, "run_id": uuid.uuid4().hex}
    if ("max_steps" in given) != ("epochs" in given):  # one limit given alone replaces both
        values["epochs" if "max_steps" in given else "max_steps"] = None
    given_now = RunConfig(**values)
    given_now.check()
    if values["data"] not in BUILTIN:
        checks.check_path(Path(values["data"]), "--data")
    checks.check_sizes(given_now, ckpt)
    claimed: List[Path] = []
    if values["checkpoint_dir"]:
        values["checkpoint_dir"] = os.path.normpath(values["checkpoint_dir"])
    else:
        claimed = _claim_run_folder()
        values["checkpoint_dir"] = str(claimed[0])
    values["run_dir"] = os.path.abspath(values["checkpoint_dir"])
    try:
        for k in ("metrics", "plot"):
            values[f"{k}_default"] = values[k] is None
            if values[k] is None:
                values[k] = str(Path(values["checkpoint_dir"]) / file_rules.OUTPUT_NAMES[flag(k)])
        config = RunConfig(**values)
        if not config.plot_default and not matplotlib_available():
            raise CLIError(f"--plot {config.plot}: matplotlib is not installed (pip install 'vlseq_ext[plot]')")
        file_rules.check_output_paths(config, resumed)
        outputs = [("--metrics", Path(config.metrics))] + ([("--plot", Path(config.plot))] if matplotlib_available()
                                                           else [])
        lock = RunLock(Path(config.checkpoint_dir), claimed, outputs)
    except BaseException:
        checks.remove_empty_dirs(claimed)  # nothing was written in them
        raise
    try:
        for path, flag_ in others:
            file_rules.check_new_output(path, flag_)
        if (ckpt is None and not args.overwrite) or fork:
            file_rules.check_not_a_previous_run(config, fork)
        if ckpt is not None:
            file_rules.check_resume_target(config, resumed, ckpt)
    except BaseException:
        lock.release()
        raise
    return Resolved(config, ckpt, bool(args.overwrite), lock)


def _continued(given: Dict[str, Any], ckpt: Dict[str, Any],
               resumed: Path) -> Tuple[Dict[str, Any], Path, bool, List[Tuple[Path, str]]]:
    """The configuration of a resumed run: the checkpoint's, with the options given now (but for the
    fixed ones). Returns (values, the resumed checkpoint file, whether the run forks into a new folder,
    the outputs given now that are not the run's own: (path, flag))."""
    saved = RunConfig.from_saved(ckpt["config"])
    kept = {**RunConfig.defaults(), **saved}
    try:
        RunConfig(**kept).check()
        RunState.check_saved(ckpt["run"])
    except (CLIError, FieldError) as exc:
        raise CLIError(f"--resume: {resumed}: its saved run: {exc}; {DAMAGED}") from None
    inferred = kept["task"] is None  # the task the run's data implied
    if inferred:
        kept["task"] = ckpt["data"]["task"]
    for k in RunConfig.fixed_on_resume():
        if k in given and given[k] != kept[k]:
            was = f"{kept[k]}{' (inferred from its data)' if k == 'task' and inferred else ''}"
            raise CLIError(f"{flag(k)} {given[k]}: the resumed run has {flag(k)} {was}, and a resumed run keeps its "
                           f"model, seed and data split: leave out {flag(k)}, or start a new run without --resume")
    values = {**RunConfig.defaults(), **saved, **given}
    if "data" not in given and values["data"] not in BUILTIN and not os.path.lexists(values["data"]):
        file_rules.refuse("resumed-data-path", data=values["data"], cwd=Path.cwd())
    fork = "checkpoint_dir" in given and not file_rules.same_file(Path(given["checkpoint_dir"]), resumed.parent)
    if "checkpoint_dir" not in given:
        values["checkpoint_dir"] = str(resumed.parent)
    if fork:  # a run of its own from here on: its checkpoints must not pass for the original's
        values["run_id"], values["forked_from"] = uuid.uuid4().hex, saved.get("run_id")
    # Where the run folder was when last saved (a checkpoint of 0.2.0 knows it when it saved it absolute).
    then = saved.get("run_dir") or (saved["checkpoint_dir"] if os.path.isabs(saved.get("checkpoint_dir") or "")
                                    else None)
    others = []
    for k in ("metrics", "plot"):  # follow the run folder unless a path was given now
        if k not in given and (saved.get(f"{k}_default") or fork):  # a fork leaves the original's files alone
            values[k] = None
        elif k not in given and then and saved.get(k) and _inside(saved[k], then):  # it moves with the run folder
            values[k] = os.path.join(os.path.abspath(values["checkpoint_dir"]), os.path.relpath(saved[k], then))
        elif k in given and not fork and saved.get(k) and not file_rules.same_file(Path(given[k]), Path(saved[k])):
            others.append((Path(given[k]), flag(k)))  # it starts afresh: it must not be another's
    return values, resumed, fork, others


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


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
