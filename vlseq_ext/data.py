"""Variable-length datasets for vlseq-train and vlseq-predict: ragged .npz files, UEA/UCR .ts files
(through aeon), a deterministic synthetic demo set and input validation. (The samplers that cut
them into steps are in vlseq_ext.samplers.)

Every validation failure raises `DataError` with a one-line message that names the file and the
sample, so the CLI can print it and exit with code 2. Values are checked after the cast to the
training dtype (float32): a finite float64 value beyond float32's range is as bad as an inf.
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DataError", "RaggedDataset", "save_ragged", "load_ragged", "load_ts", "synthetic", "japanese_vowels",
           "open_dataset", "split", "sequence_lengths", "BUILTIN", "MAX_CLASS_LABEL"]

BUILTIN = ("synthetic", "japanese_vowels")
PathLike = Union[str, Path]
# Class labels are indices 0..C-1: the model gets one output per index up to the largest label. A
# label far beyond the number of distinct labels (>= 10 x distinct + 100) or above this bound is
# almost surely an id, not an index, and would build a huge output layer.
MAX_CLASS_LABEL = 1_000_000
F32_MAX = float(np.finfo(np.float32).max)


class DataError(ValueError):
    """Bad input data. The message is one line naming the file or sample and what is wrong."""


class RaggedDataset(Dataset):
    """In-memory variable-length samples: one (total_steps, D) float32 array and per-sample
    start/length, so N samples cost one allocation. `ds[i]` is `(x, y)` with x a (L_i, D) view and
    y a float (O,) target (regression) or a 0-dim int64 class index (classification).

    Attributes: `lengths` (N,) int64 numpy array, `num_features` (D), `task`
    ("regression" | "classification"), `output_dim` (O, or the number of classes), `class_names`
    (classification labels, as strings), `name` (for messages), `source` (the file it came from,
    if any), `dropped` (samples skipped as non-finite when loading), `has_targets` (False for a
    prediction-only file without targets: then every target reads as 0).
    """

    def __init__(self, values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, targets: np.ndarray,
                 task: str, output_dim: int, name: str, class_names: Optional[List[str]] = None,
                 dropped: int = 0, has_targets: bool = True) -> None:
        self.values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        dtype = np.int64 if task == "classification" else np.float32
        self.targets = torch.from_numpy(np.ascontiguousarray(targets, dtype=dtype))
        self.task, self.output_dim, self.name = task, int(output_dim), name
        self.class_names = class_names
        self.dropped = dropped
        self.has_targets = has_targets
        self.source: Optional[str] = None

    @property
    def num_features(self) -> int:
        return int(self.values.shape[1])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        return self.values[s:s + int(self.lengths[i])], self.targets[i]

    def subset(self, index: Sequence[int]) -> "RaggedDataset":
        """The samples at `index`, sharing this dataset's value storage."""
        index = np.asarray(index, dtype=np.int64)
        sub = RaggedDataset.__new__(RaggedDataset)
        sub.__dict__.update(self.__dict__)
        sub.starts, sub.lengths, sub.targets = self.starts[index], self.lengths[index], self.targets[index]
        return sub


# ------------------------------------------------------------------------------------------------
# building and validating


def _from_sequences(sequences: Sequence[np.ndarray], targets: Optional[np.ndarray], name: str, task: Optional[str],
                    drop_nonfinite: bool, class_names: Optional[List[str]] = None,
                    num_classes: Optional[int] = None) -> RaggedDataset:
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([np.asarray(s) for s in sequences]) if sequences else np.zeros((0, 0))
    return _build(values, offsets, targets, name, task, drop_nonfinite, class_names, num_classes)


def _as_float32(values: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """values cast to float32 (the training dtype), and a mask of the elements that were finite
    before the cast and are not after it (they overflow float32), or None when none can."""
    if values.dtype == np.float32:
        return values, None
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np.float32)
    if not np.issubdtype(values.dtype, np.floating) or np.finfo(values.dtype).max <= F32_MAX:
        return out, None
    return out, np.isfinite(values) & ~np.isfinite(out)


def _where(rows: np.ndarray) -> str:
    return f"at step {int(np.argmax(rows))}" if rows.any() else "in its target"


def _build(values: np.ndarray, offsets: np.ndarray, targets: Optional[np.ndarray], name: str, task: Optional[str],
           drop_nonfinite: bool, class_names: Optional[List[str]] = None,
           num_classes: Optional[int] = None) -> RaggedDataset:
    """Checks the ragged layout and targets, drops or rejects non-finite samples (after the cast to
    float32), infers the task. targets None: a prediction-only file (task must be given).
    num_classes: the model's class count (prediction): labels must be below it."""
    if offsets.ndim == 1 and len(offsets) < 2:
        raise DataError(f"{name}: no samples ('offsets' needs N+1 >= 2 entries for N samples, got {len(offsets)})")
    if values.ndim != 2:
        raise DataError(f"{name}: 'values' must have shape (total_steps, features), got {values.shape}")
    if not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
        raise DataError(f"{name}: 'values' must be numeric, got dtype {values.dtype}")
    if values.shape[1] == 0:
        raise DataError(f"{name}: 'values' has 0 features per step")
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise DataError(f"{name}: 'offsets' must be a 1-D integer array, got shape {offsets.shape} "
                        f"dtype {offsets.dtype}")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != len(values):
        raise DataError(f"{name}: 'offsets' must start at 0 and end at total_steps={len(values)}, "
                        f"got {offsets[0]} ... {offsets[-1]}")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise DataError(f"{name}: 'offsets' are not monotone: offsets[{i}]={offsets[i]} > "
                        f"offsets[{i + 1}]={offsets[i + 1]}")
    if (lengths == 0).any():
        i = int(np.argmax(lengths == 0))
        raise DataError(f"{name}: sample {i} has length 0 (offsets[{i}] == offsets[{i + 1}] == {offsets[i]})")
    n = len(lengths)
    has_targets = targets is not None
    if not has_targets:
        if task is None:
            raise DataError(f"{name}: no 'targets' array, and no task to predict was given")
        targets = np.zeros(n, np.int64 if task == "classification" else np.float32)
    if targets.ndim == 0 or targets.shape[0] != n:
        raise DataError(f"{name}: 'targets' must have one row per sample ({n}), got shape {targets.shape}")
    if not (np.issubdtype(targets.dtype, np.floating) or np.issubdtype(targets.dtype, np.integer)
            or targets.dtype == np.bool_):
        raise DataError(f"{name}: 'targets' must be numeric, got dtype {targets.dtype}")
    if targets.size == 0:
        raise DataError(f"{name}: 'targets' has shape {targets.shape}: no target values per sample")

    if task is None:
        task = "classification" if targets.ndim == 1 and not np.issubdtype(targets.dtype, np.floating) else "regression"
    if task not in ("regression", "classification"):
        raise DataError(f"task must be 'regression' or 'classification', got {task!r}")

    # Non-finite values, after the cast to float32: one flag per sample (reduceat is safe: every
    # sample has length >= 1). A finite float64 value beyond float32's range counts too.
    raw_values, raw_targets = values, targets
    values, over = _as_float32(values)
    bad_rows = ~np.isfinite(values).all(axis=1)
    bad = np.add.reduceat(bad_rows, offsets[:-1]) > 0
    t_over = None
    if task == "regression":
        targets, t_over = _as_float32(targets.reshape(n, -1))
        bad |= ~np.isfinite(targets).all(axis=1)
    elif np.issubdtype(targets.dtype, np.floating):
        bad |= ~np.isfinite(targets.reshape(n, -1)).all(axis=1)
    dropped = int(bad.sum())
    if dropped and not drop_nonfinite:
        i = int(np.argmax(bad))
        rows = bad_rows[offsets[i]:offsets[i + 1]]
        more = f" ({dropped} such samples)" if dropped > 1 else ""
        if rows.any():
            s = int(np.argmax(rows))
            flag, raw = (over[offsets[i] + s] if over is not None else None), raw_values[offsets[i] + s]
        else:
            flag, raw = (t_over[i] if t_over is not None else None), raw_targets.reshape(n, -1)[i]
        if flag is not None and flag.any():
            raise DataError(f"{name}: sample {i} has the value {raw[int(np.argmax(flag))]:.4g} {_where(rows)}, "
                            f"which overflows float32 (the training dtype; largest {F32_MAX:.4g}){more}; rescale "
                            "the data, or pass --drop-nonfinite to skip such samples")
        raise DataError(f"{name}: sample {i} has a non-finite value (NaN or inf) {_where(rows)}"
                        f"{more}; pass --drop-nonfinite to skip them")
    if dropped:
        keep = ~bad
        if not keep.any():
            raise DataError(f"{name}: every sample has a non-finite value; nothing left to train on")
        values, targets, lengths = values[np.repeat(keep, lengths)], targets[keep], lengths[keep]
        n = len(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    if task == "classification":
        output_dim = _check_labels(targets, name, class_names, num_classes if has_targets else None)
        if num_classes is not None:
            output_dim = num_classes
        targets = targets.astype(np.int64)
    else:
        output_dim = targets.shape[1]
    return RaggedDataset(values, starts, lengths, targets, task, output_dim, name, class_names, dropped, has_targets)


def _check_labels(targets: np.ndarray, name: str, class_names: Optional[List[str]],
                  num_classes: Optional[int]) -> int:
    """Class labels must be integers 0..C-1; returns C (the class count they imply)."""
    if targets.ndim != 1:
        raise DataError(f"{name}: classification needs one class index per sample, got targets of shape "
                        f"{targets.shape}")
    if np.issubdtype(targets.dtype, np.floating) and (targets != np.round(targets)).any():
        i = int(np.argmax(targets != np.round(targets)))
        raise DataError(f"{name}: sample {i} has class label {targets[i]}, not an integer")
    if (targets < 0).any():
        i = int(np.argmax(targets < 0))
        raise DataError(f"{name}: sample {i} has a negative class label {targets[i]}")
    if class_names:
        return len(class_names)
    i = int(np.argmax(targets))
    top = targets[i].item()
    label = f"{int(top)}" if abs(top) < 1e15 else f"{top:.4g}"
    if num_classes is not None:
        if top >= num_classes:
            raise DataError(f"{name}: sample {i} has class label {label}, but the model has {num_classes} classes "
                            f"(0..{num_classes - 1})")
        return num_classes
    distinct = len(np.unique(targets))
    if top > MAX_CLASS_LABEL or top >= 10 * distinct + 100:
        raise DataError(f"{name}: sample {i} has class label {label}, far beyond the {distinct} distinct labels: "
                        f"the model would need {label} + 1 outputs; remap the labels to 0..{distinct - 1} "
                        "(e.g. np.unique(labels, return_inverse=True)[1])")
    return int(top) + 1


def save_ragged(path: PathLike, sequences: Sequence[Any], targets: Any = None) -> None:
    """Write samples as a ragged .npz: `values` (total_steps, D) float32 (the samples
    concatenated), `offsets` (N+1,) int64 (sample i is values[offsets[i]:offsets[i+1]]) and
    `targets` (N, ...) as given (float for regression, integer class indices for classification).
    `sequences` are (L_i, D) arrays or tensors. targets None writes no `targets` array: a file for
    vlseq-predict only."""
    seqs = [np.asarray(s.detach().cpu() if isinstance(s, Tensor) else s, dtype=np.float32) for s in sequences]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    values = np.concatenate(seqs) if seqs else np.zeros((0, 0), np.float32)
    arrays = {"values": values, "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    if targets is not None:
        arrays["targets"] = np.asarray(targets.detach().cpu() if isinstance(targets, Tensor) else targets)
    np.savez(path, **arrays)


def check_file(path: Path, hint: str = "") -> None:
    """DataError unless `path` is an existing regular file (a directory or a device is named as such)."""
    if path.is_file():
        return
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a data file{hint}")
    if path.exists():
        raise DataError(f"{path}: is not a regular file (a device, pipe or socket){hint}")
    raise DataError(f"{path}: no such file{hint}")


def load_ragged(path: PathLike, task: Optional[str] = None, drop_nonfinite: bool = False,
                targets_required: bool = True, num_classes: Optional[int] = None) -> RaggedDataset:
    """Load and validate a ragged .npz written by `save_ragged` (np.load with allow_pickle=False).
    `task` None infers it: 1-D integer targets mean classification, anything else regression.
    Raises DataError for a missing, corrupt or truncated file, wrong shapes, non-monotone
    offsets, zero-length samples and non-finite values, also values that overflow float32 (unless
    drop_nonfinite, which skips those samples and records the count in `.dropped`), and class
    labels far beyond the number of distinct labels.
    For prediction: targets_required=False accepts a file without `targets` (then `task` must be
    given and `.has_targets` is False); num_classes (the model's) bounds the class labels."""
    path = Path(path)
    check_file(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # np.load would try to unpickle anything else
        raise DataError(f"{path}: not an .npz archive (no zip header): corrupt, or not written by np.savez/save_ragged")
    try:
        with np.load(path, allow_pickle=False) as f:
            need = ("values", "offsets", "targets") if targets_required else ("values", "offsets")
            missing = [k for k in need if k not in f.files]
            if missing:
                raise DataError(f"{path}: missing array(s) {', '.join(missing)} "
                                f"(found: {', '.join(f.files) or 'none'})")
            values, offsets = f["values"], f["offsets"]
            targets = f["targets"] if "targets" in f.files else None
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: cannot read as .npz (corrupt or truncated?): {msg}") from None
    return _build(values, offsets, targets, str(path), task, drop_nonfinite, num_classes=num_classes)


def _has_data_line(path: Path) -> bool:
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        return any(line.strip().lower().startswith("@data") for line in fh)


def load_ts(path: PathLike, task: Optional[str] = None, drop_nonfinite: bool = False,
            targets_required: bool = True, class_names: Optional[List[str]] = None) -> RaggedDataset:
    """Load a UEA/UCR .ts file (equal or unequal length) through aeon's `load_from_ts_file`.
    Class labels become indices into `class_names` (the file's @classLabel order); a
    @targetLabel file gives a regression target. Needs the optional extra: pip install 'vlseq_ext[ts]'.
    For prediction: targets_required=False accepts a file without labels; class_names (the
    trained model's classes, in its order) maps the labels instead of the file's @classLabel list."""
    path = Path(path)
    check_file(path)
    try:
        from aeon.datasets import load_from_ts_file
    except ImportError:
        raise DataError(f"{path}: reading .ts files needs aeon: pip install 'vlseq_ext[ts]' "
                        "(or pip install aeon)") from None
    try:
        X, y, meta = load_from_ts_file(str(path), return_meta_data=True)
    except Exception as exc:  # aeon raises IOError/ValueError/TypeError... on malformed files
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: cannot read as a .ts file: {msg}") from None
    if len(X) == 0:
        if not _has_data_line(path):
            raise DataError(f"{path}: no @data line: a .ts file has a header (@problemName, @univariate, "
                            "@classLabel ...) and then @data, followed by one series per line")
        raise DataError(f"{path}: no series after the @data line")
    seqs = [np.asarray(x).T for x in X]  # aeon gives (channels, time); float32 cast (and check) in _build
    if y is None or len(y) != len(seqs):
        if targets_required:
            raise DataError(f"{path}: the file has no class or target labels")
        return _from_sequences(seqs, None, str(path), task, drop_nonfinite, class_names)
    if meta.get("classlabel") and task != "regression":
        names = class_names or [str(c) for c in (meta.get("class_values") or sorted(set(map(str, y))))]
        index = {c: i for i, c in enumerate(names)}
        unknown = [i for i, v in enumerate(y) if str(v) not in index]
        if unknown:
            which = "the model's classes" if class_names else "@classLabel"
            raise DataError(f"{path}: sample {unknown[0]} has label {str(y[unknown[0]])!r}, "
                            f"not one of {which} {names}")
        targets = np.array([index[str(v)] for v in y], dtype=np.int64)
        return _from_sequences(seqs, targets, str(path), "classification", drop_nonfinite, names)
    try:
        targets = np.asarray(y, dtype=np.float64)
    except ValueError:
        raise DataError(f"{path}: target labels are not numeric") from None
    return _from_sequences(seqs, targets, str(path), task, drop_nonfinite)


def synthetic(num_samples: int = 2000, seed: int = 0, num_features: int = 36, min_length: int = 50,
              max_length: int = 500) -> RaggedDataset:
    """The built-in demo regression set, deterministic given `seed`: lengths uniform in
    [min_length, max_length]; each sequence is a per-sample random level plus unit noise per step;
    the target is a fixed random linear function of the sequence mean plus half a second one of
    the mean of its last 3 steps, plus N(0, 0.05^2) noise. Learnable, so the loss visibly falls."""
    rng = np.random.default_rng([seed, 36])
    lengths = rng.integers(min_length, max_length + 1, num_samples)
    w, v = rng.standard_normal((2, num_features)) / math.sqrt(num_features)
    level = rng.standard_normal((num_samples, num_features)).astype(np.float32)
    noise = rng.standard_normal((int(lengths.sum()), num_features), dtype=np.float32)
    values = np.repeat(level, lengths, axis=0) + noise
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    means = np.add.reduceat(values, offsets[:-1], axis=0) / lengths[:, None]
    last = np.stack([values[e - 3:e].mean(0) for e in offsets[1:]])
    targets = means @ w + 0.5 * (last @ v) + 0.05 * rng.standard_normal(num_samples)
    return _build(values, offsets, targets.astype(np.float32)[:, None], f"synthetic(seed={seed})", "regression", False)


def _aeon_data_dir() -> Path:
    try:
        import aeon.datasets
    except ImportError:
        raise DataError("japanese_vowels: the bundled dataset comes with aeon: pip install 'vlseq_ext[ts]' "
                        "(or pip install aeon)") from None
    return Path(aeon.datasets.__file__).parent / "data"


def japanese_vowels(drop_nonfinite: bool = False) -> Tuple[RaggedDataset, RaggedDataset]:
    """aeon's bundled JapaneseVowels (UCI; 9 speakers, 12 LPC channels, lengths 7-29), read from
    its .ts files: the official split, 270 train and 370 test samples."""
    folder = _aeon_data_dir() / "JapaneseVowels"
    out = []
    for part in ("TRAIN", "TEST"):
        ds = load_ts(folder / f"JapaneseVowels_{part}.ts", drop_nonfinite=drop_nonfinite)
        ds.name, ds.source = f"japanese_vowels[{part.lower()}]", str(folder / f"JapaneseVowels_{part}.ts")
        out.append(ds)
    return out[0], out[1]


def open_dataset(data: str, task: Optional[str] = None, drop_nonfinite: bool = False, seed: int = 0,
                 num_samples: int = 2000) -> Tuple[RaggedDataset, Optional[RaggedDataset]]:
    """What `vlseq-train --data` accepts: "synthetic", "japanese_vowels", a ragged .npz or a .ts
    file. Returns (dataset, validation set or None); only japanese_vowels comes with its own
    validation set (the official test split)."""
    builtin = {"synthetic": "regression", "japanese_vowels": "classification"}
    if data in builtin and task not in (None, builtin[data]):
        raise DataError(f"{data}: a built-in {builtin[data]} dataset, so --task {task} does not apply")
    if data == "synthetic":
        return synthetic(num_samples, seed), None
    if data == "japanese_vowels":
        return japanese_vowels(drop_nonfinite)
    path = Path(data)
    if path.suffix.lower() == ".ts":
        return load_ts(path, task, drop_nonfinite), None
    if path.suffix.lower() == ".npz" or path.exists():
        return load_ragged(path, task, drop_nonfinite), None
    raise DataError(f"{data}: no such file (--data takes a .npz or .ts file, or one of: {', '.join(BUILTIN)})")


def split(ds: RaggedDataset, val_fraction: float, seed: int = 0) -> Tuple[RaggedDataset, Optional[RaggedDataset]]:
    """A deterministic random (train, validation) split; validation is None when val_fraction is 0."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ds) * val_fraction))
    if n_val == 0:
        return ds, None
    if n_val >= len(ds):
        raise DataError(f"{ds.name}: --val-fraction {val_fraction} leaves no training samples out of {len(ds)}")
    perm = np.random.default_rng([seed, 1]).permutation(len(ds))
    return ds.subset(np.sort(perm[n_val:])), ds.subset(np.sort(perm[:n_val]))


def sequence_lengths(ds: Dataset) -> np.ndarray:
    """Per-sample lengths: `ds.lengths` when the dataset has it, else len(x) of every (x, y)."""
    lengths = getattr(ds, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([len(ds[i][0]) for i in range(len(ds))], dtype=np.int64)  # type: ignore[arg-type]
