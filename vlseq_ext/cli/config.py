"""vlseq-train's run configuration: one typed, frozen record (RunConfig), saved in every checkpoint,
and the parser built from it.

Every field is one of:
  - an option (`--hidden`, ...): its default, help, accepted values and check sit on the field;
    `fixed` ones define the model, the data and its order, and a resume must keep them; `trainer`
    names the ParallelTrainer option a field sets;
  - private: saved, never given on the command line (the run id, what followed the run folder).
What belongs to one invocation only (--resume, --overwrite, folders made for the run) is not in it:
see resolve.Resolved. Adding an option is one line in RunConfig.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .._version import __version__
from ..checkpoint import CHECKPOINT_NAME
from ..data import BUILTIN
from .checks import CLIError

__all__ = ["PROG", "RunConfig", "build_parser", "flag"]

PROG = "vlseq-train"

Check = Tuple[Callable[[Any], bool], str]  # (accepts the value, what it accepts: for the message)


def _at_least(n: int, note: str = "") -> Check:
    return (lambda v: v >= n), f">= {n}{note}"


def _none_or_at_least(n: int) -> Check:
    return (lambda v: v is None or v >= n), f">= {n}"


def _finite_positive(optional: bool = False) -> Check:
    return (lambda v: (optional and v is None) or (math.isfinite(v) and v > 0)), "a finite number > 0"


FLOAT32_MAX = 3.4028234663852886e38


def _float32_positive() -> Check:
    """A number the float32 weights' optimizer can hold (--lr 1e300 overflowed in the first step)."""
    return (lambda v: 0 < v <= FLOAT32_MAX), "a number > 0 that float32 holds (at most 3.4e+38)"


def option(default: Any, group: str, help: str, *, metavar: Optional[str] = None, choices: Optional[List[str]] = None,
           check: Optional[Check] = None, fixed: bool = False, trainer: Optional[str] = None,
           flag_value: Optional[Callable[[Any], Any]] = None) -> Any:
    """A command-line option. help may use {default}; flag_value maps the parsed flag to the field's value."""
    return field(default=default, metadata=dict(kind="option", group=group, help=help, metavar=metavar,
                                                choices=choices, check=check, fixed=fixed, trainer=trainer,
                                                flag_value=flag_value))


def private(default: Any) -> Any:
    return field(default=default, metadata=dict(kind="private"))


@dataclass(frozen=True)
class RunConfig:
    """One vlseq-train run's configuration, as a checkpoint saves it."""

    data: str = option("synthetic", "data", "a ragged .npz or UEA/UCR .ts file, or a built-in set: "
                       f"{' | '.join(BUILTIN)} (default: {{default}}; japanese_vowels needs aeon: pip install "
                       "'vlseq_ext[ts]')", metavar="PATH|NAME")
    synthetic_samples: int = option(2000, "data", "number of sequences of the synthetic set (default: {default})",
                                    metavar="N", check=_at_least(1), fixed=True)
    task: Optional[str] = option(None, "data", "default: classification for integer class labels (and .ts class "
                                 "labels), else regression", choices=["regression", "classification"], fixed=True)
    val_fraction: float = option(0.1, "data", "share of the samples held out for validation, in [0, 1) (default: "
                                 "{default}; japanese_vowels uses its official test split)", metavar="F",
                                 check=((lambda v: math.isfinite(v) and 0 <= v < 1), "in [0, 1)"), fixed=True)
    drop_nonfinite: bool = option(False, "data", "skip samples with NaN/inf values, or values that overflow float32 "
                                  "(and say how many), instead of stopping with an error")
    model: str = option("lstm", "model", "recurrent layer (default: {default})", choices=["lstm", "gru"], fixed=True)
    hidden: int = option(64, "model", "hidden size (default: {default})", metavar="H", check=_at_least(1), fixed=True)
    layers: int = option(1, "model", "stacked recurrent layers (default: {default})", metavar="N", check=_at_least(1),
                         fixed=True)
    devices: str = option("all", "training", "'all' (every visible GPU, or the CPU when there is none), 'N' (the first "
                          "N GPUs), 'cuda:0,cuda:1', 'cpu', or 'cpu:N' for N CPU replicas (default: {default})",
                          metavar="SPEC")
    samples_per_device: int = option(1, "training", "samples per device per step: CUDA-graph replays of one sample "
                                     "each on GPUs, one packed batch on CPU; same gradient either way (default: "
                                     "{default}, the seed's one sample per GPU)", metavar="K", check=_at_least(1),
                                     trainer="samples_per_device")
    epochs: Optional[int] = option(3, "training", "passes over the training set (default: {default}; unlimited when "
                                   "only --max-steps is given)", metavar="N", check=_none_or_at_least(1))
    max_steps: Optional[int] = option(None, "training", "stop after N optimizer steps in total", metavar="N",
                                      check=_none_or_at_least(1))
    lr: float = option(1e-3, "training", "Adam learning rate (default: {default})", check=_float32_positive())
    reduction: str = option("mean", "training", "step loss: mean or sum (the seed's) of the per-sample losses "
                            "(default: {default})", choices=["mean", "sum"], trainer="reduction")
    clip_grad: Optional[float] = option(None, "training", "clip the global gradient L2 norm to NORM", metavar="NORM",
                                        check=_finite_positive(optional=True), trainer="clip_grad_norm")
    amp: Optional[str] = option(None, "training", "bf16 autocast for the forward pass (default: none)",
                                choices=["bf16", "none"], trainer="amp",
                                flag_value=lambda v: None if v == "none" else v)
    rnn_kernels: str = option("auto", "training", "how the LSTM/GRU runs: auto (the persistent kernels where they "
                              "measured faster than cuDNN), vlseq (the kernels wherever they can run) or cudnn "
                              "(default: {default})", choices=["auto", "vlseq", "cudnn"], trainer="rnn_kernels")
    seed: int = option(0, "training", "seed of the synthetic data, the split, the order and the model (default: "
                       "{default})", check=((lambda v: 0 <= v < 2 ** 63), "in [0, 2**63)"), fixed=True)
    deterministic: bool = option(False, "training", "deterministic kernels only (torch.use_deterministic_algorithms): "
                                 "bit-identical runs, and a resumed run repeats the uninterrupted run's losses exactly")
    checkpoint_dir: Optional[str] = option(None, "checkpoints and output", f"the run folder: where {CHECKPOINT_NAME} "
                                           "(and, by default, metrics.jsonl and loss.png) go (default: "
                                           "runs/vlseq-<date>-<time>, or the --resume directory). A folder that "
                                           "already holds a run is refused unless --resume or --overwrite is given",
                                           metavar="DIR")
    checkpoint_every: int = option(0, "checkpoints and output", "also checkpoint every STEPS steps (default: at the "
                                   "end of every epoch and of the run)", metavar="STEPS",
                                   check=_at_least(0, " (0: only at epoch ends)"))
    metrics: Optional[str] = option(None, "checkpoints and output", "JSON Lines metrics, one record per step and per "
                                    "epoch (default: DIR/metrics.jsonl)", metavar="PATH")
    plot: Optional[str] = option(None, "checkpoints and output", "the training and validation loss curves, written at "
                                 "the end; the extension picks the format: .png, .pdf, .svg... (default: DIR/loss.png; "
                                 "needs matplotlib)", metavar="PATH")
    quiet: bool = option(False, "checkpoints and output", "no progress bar: periodic log lines instead (as when stderr "
                         "is not a terminal)")
    log_interval: float = option(10.0, "checkpoints and output", "seconds between log lines without a progress bar "
                                 "(default: {default})", metavar="SECONDS", check=_finite_positive())

    run_id: Optional[str] = private(None)  # tells this run's checkpoints from others' (None: written before run ids)
    forked_from: Optional[str] = private(None)  # the run id of the run this one was forked from
    metrics_default: Optional[bool] = private(None)  # metrics was not given: it follows the run folder
    plot_default: Optional[bool] = private(None)  # the same for the plot
    run_dir: Optional[str] = private(None)  # the run folder, absolute, when saved: outputs in it move with it

    # -- the fields by kind -----------------------------------------------------------------------
    @classmethod
    def options(cls) -> List[Any]:
        return [f for f in fields(cls) if f.metadata["kind"] == "option"]

    @classmethod
    def fixed_on_resume(cls) -> List[str]:
        return [f.name for f in cls.options() if f.metadata["fixed"]]

    @classmethod
    def defaults(cls) -> Dict[str, Any]:
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> Dict[str, Any]:
        """The fields a checkpoint's configuration holds (a key this version does not know is left out)."""
        names = {f.name for f in fields(cls)}
        return {k: v for k, v in saved.items() if k in names}

    def saved(self) -> Dict[str, Any]:
        """What a checkpoint saves: every field."""
        return asdict(self)

    def trainer_options(self) -> Dict[str, Any]:
        """The ParallelTrainer options the configuration sets."""
        return {f.metadata["trainer"]: getattr(self, f.name) for f in self.options() if f.metadata["trainer"]}

    def check(self) -> None:
        """Every field's type, and every option's value, each refused by its flag (CLIError) when it
        makes no sense (a value read from a checkpoint passes the same checks as one given now)."""
        for f in fields(self):
            value, m = getattr(self, f.name), f.metadata
            name = flag(f.name) if m["kind"] == "option" else f.name
            if not _has_type(value, str(f.type)):
                raise CLIError(f"{name} must be {_TYPE_NAMES[str(f.type)]}, got {value!r}")
            if m.get("choices") and value is not None and value not in m["choices"]:
                raise CLIError(f"{name} must be one of {', '.join(m['choices'])}, got {value!r}")
            if m.get("check") is not None:
                accepts, expected = m["check"]
                if not accepts(value):
                    raise CLIError(f"{name} must be {expected}, got {value}")


_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
_TYPE_NAMES.update({f"Optional[{k}]": f"{v} or nothing" for k, v in list(_TYPE_NAMES.items())})


def _has_type(value: Any, annotation: str) -> bool:
    """value fits a field annotated `annotation` ("int", "Optional[float]", ...); a bool is no number."""
    optional = annotation.startswith("Optional[")
    base = annotation[len("Optional["):-1] if optional else annotation
    if value is None:
        return optional
    if isinstance(value, bool):
        return base == "bool"
    if base == "float" and isinstance(value, int):
        return abs(value) <= 2 ** 53  # (a larger int is no float torch takes)
    return isinstance(value, {"int": int, "float": float, "str": str, "bool": bool}[base])


def flag(name: str) -> str:
    """The command-line flag of a field: samples_per_device -> --samples-per-device."""
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of vlseq-train: one flag per RunConfig option, plus --resume and --overwrite.
    Every default is None, so that what was given can be told from what was not (it overrides a
    resumed checkpoint's configuration)."""
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
    groups: Dict[str, Any] = {}
    for f in RunConfig.options():
        m = f.metadata
        g = groups.get(m["group"]) or groups.setdefault(m["group"], p.add_argument_group(m["group"]))
        kw: Dict[str, Any] = {"help": m["help"].format(default=f.default)}
        if f.default is False:  # a switch
            kw.update(action="store_true", default=None)
        else:
            kw.update(metavar=m["metavar"], choices=m["choices"])
            if m["choices"] is None:
                kw["type"] = type(f.default) if f.default is not None else _type_of(f)
        g.add_argument(flag(f.name), **kw)
    out = groups["checkpoints and output"]
    out.add_argument("--resume", metavar="DIR",
                     help="continue the run checkpointed in DIR (or a checkpoint file) with its configuration; "
                          "options given now override it, except model, data order and seed")
    out.add_argument("--overwrite", action="store_true",
                     help="start a new run in a --checkpoint-dir (or over a --metrics file) that holds an old run, "
                          "replacing it")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _type_of(f: Any) -> type:
    """The parse type of an Optional[...] option (its default None says nothing)."""
    return {"Optional[int]": int, "Optional[float]": float, "Optional[str]": str}[str(f.type)]


def given_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The options given on the command line, as field values."""
    out = {}
    for f in RunConfig.options():
        value = getattr(args, f.name, None)
        if value is not None:
            convert = f.metadata["flag_value"]
            out[f.name] = convert(value) if convert else value
    return out
