"""The in-memory variable-length dataset and the checks every sample and target passes on the way
in, whatever file it came from (vlseq_ext.data reads the files).

Every validation failure raises `DataError` with a one-line message that names the file and the
sample, so the CLI can print it and exit with code 2. Values are checked after the cast to the
training dtype (float32): a finite float64 value beyond float32's range is as bad as an inf.
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DataError", "RaggedDataset", "build_dataset", "from_sequences", "float32_values", "MAX_CLASS_LABEL"]

# Class labels are indices 0..C-1: the model gets one output per index up to the largest label. A
# label far beyond the number of distinct labels (>= 10 x distinct + 100) or above this bound is
# almost surely an id, not an index, and would build a huge output layer.
MAX_CLASS_LABEL = 1_000_000
F32_MAX = float(np.finfo(np.float32).max)
F32_EXACT_INT = 2 ** 24  # float32 holds every integer up to this exactly; beyond, it rounds


class DataError(ValueError):
    """Bad input data: one line naming the file or sample and what is wrong (`problem`). `option`: the
    keyword argument the problem is about, when one would change the outcome ("drop_nonfinite",
    "val_fraction", "task", "data"); str() then ends with `hint`, the library's advice in its terms, and a
    command gives its own advice in its terms instead (with_hint)."""

    def __init__(self, problem: str, option: Optional[str] = None, hint: str = "") -> None:
        super().__init__(f"{problem}; {hint}" if hint else problem)
        self.problem, self.option, self.hint = problem, option, hint

    def with_hint(self, hints: Mapping[str, str]) -> str:
        """The message with the caller's advice for `option` (hints[option]) in place of the library's."""
        if self.option in hints:
            return f"{self.problem}; {hints[self.option]}"
        return str(self)


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

    def fingerprint(self) -> str:
        """A hash of everything these samples are: the value buffer, each sample's place in it and its
        target. A resumed run compares it with its checkpoint's, so other data of the same size is
        not taken for the run's own."""
        h = hashlib.blake2b(digest_size=16)
        for a in (self.values.numpy(), self.starts, self.lengths, self.targets.numpy()):
            a = np.ascontiguousarray(a)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(a.view(np.uint8).data)
        return h.hexdigest()

    def subset(self, index: Sequence[int]) -> "RaggedDataset":
        """The samples at `index` (integer indices, or a boolean mask of len(self)), sharing this
        dataset's value storage."""
        index = np.asarray(index)
        n = len(self)
        if index.dtype == np.bool_:
            if index.shape != (n,):
                raise ValueError(f"{self.name}: a boolean mask must have one entry per sample ({n}), "
                                 f"got shape {index.shape}")
            index = np.flatnonzero(index)
        elif index.size == 0:
            index = np.zeros(0, np.int64)  # np.asarray([]) is float64
        elif index.dtype.kind not in "iu":  # a cast would truncate 1.7 to 1 (and timedelta64 is an integer to numpy)
            raise TypeError(f"{self.name}: subset indices must be integers or a boolean mask, got dtype {index.dtype}")
        if index.ndim != 1:
            raise ValueError(f"{self.name}: subset indices must be 1-D, got shape {index.shape}")
        out = (index >= n) | ((index < -n) if index.dtype.kind == "i" else False)  # before the cast: uint64 wraps
        if out.any():
            raise IndexError(f"{self.name}: subset index {int(index[np.argmax(out)])} is out of range for {n} samples")
        index = index.astype(np.int64)
        sub = RaggedDataset.__new__(RaggedDataset)
        sub.__dict__.update(self.__dict__)
        sub.starts, sub.lengths, sub.targets = self.starts[index], self.lengths[index], self.targets[index]
        return sub


def from_sequences(sequences: Sequence[np.ndarray], targets: Optional[np.ndarray], name: str, task: Optional[str],
                    drop_nonfinite: bool, class_names: Optional[List[str]] = None,
                    num_classes: Optional[int] = None) -> RaggedDataset:
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([np.asarray(s) for s in sequences]) if sequences else np.zeros((0, 0))
    return build_dataset(values, offsets, targets, name, task, drop_nonfinite, class_names, num_classes)


def _real(dtype: np.dtype, bool_ok: bool = False) -> bool:
    """Integer or float (or bool). Not timedelta64, which numpy counts as an integer (NaT would read
    as -9.2e18 and the unit would be lost), nor complex (the imaginary part would be dropped)."""
    return dtype.kind in ("iufb" if bool_ok else "iuf")


def _as_float32(values: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """values cast to float32 (the training dtype), and a mask of the elements that were finite
    before the cast and are not after it (they overflow float32), or None when none can."""
    if values.dtype == np.float32:
        return values, None
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np.float32)
    # float(): finfo(float16).max compared with a Python float is cast to float16 (and overflows)
    if not np.issubdtype(values.dtype, np.floating) or float(np.finfo(values.dtype).max) <= F32_MAX:
        return out, None
    return out, np.isfinite(values) & ~np.isfinite(out)


def _int_rounding(values: np.ndarray, out: np.ndarray) -> Tuple[int, int, int]:
    """For integer `values` and `out`, their float32 cast: how many values changed, the largest
    change and its flat position ((0, 0, -1) when none did)."""
    if values.dtype.kind not in "iu" or values.dtype.itemsize < 4:
        return 0, 0, -1
    flat = values.reshape(-1)
    big = np.flatnonzero((flat > F32_EXACT_INT) | ((flat < -F32_EXACT_INT) if flat.dtype.kind == "i" else False))
    if not len(big):
        return 0, 0, -1
    raw, got = flat[big], out.reshape(-1)[big].astype(np.float64)
    # float32 may round up to 2**63 (2**31, 2**64), which the integer type cannot hold: a cast back
    # would wrap, so those changes are computed from the type's maximum
    top = np.iinfo(values.dtype).max
    over = got >= float(top) + 1
    change = np.zeros(len(raw), np.uint64)
    back = got[~over].astype(values.dtype)
    change[~over] = np.maximum(raw[~over], back) - np.minimum(raw[~over], back)  # no negative uint
    change[over] = (top - raw[over]) + 1
    k = int(np.argmax(change))
    return int((change > 0).sum()), int(change[k]), int(big[k])


def _warn_int_rounding(raw: np.ndarray, out: np.ndarray, name: str, what: str,
                       sample_of: Callable[[int], int]) -> None:
    """A warning (not an error: the data is usable, only less exact) when integers beyond 2**24 change
    in the cast to float32. sample_of maps a flat position to its sample index."""
    count, largest, pos = _int_rounding(raw, out)
    if count:
        many = f"{count} integer values change" if count > 1 else "1 integer value changes"
        warnings.warn(f"{name}: '{what}': {many} when cast to float32 (the training dtype; largest change "
                      f"{largest} at sample {sample_of(pos)}); scale or offset them first", UserWarning, stacklevel=3)


def _overflow_message(name: str, i: int, value: float, where: str, more: str = "") -> str:
    return (f"{name}: sample {i} has the value {value:.4g} {where}, which overflows float32 (the training dtype; "
            f"largest {F32_MAX:.4g}){more}; rescale the data")


def float32_values(values: np.ndarray, offsets: np.ndarray, name: str) -> np.ndarray:
    """`values` (total_steps, D) cast to float32 as the loader casts them, for writing: DataError when
    one is not a real number or overflows float32 (as loading would), a warning when integers round."""
    if not _real(values.dtype, bool_ok=True):
        raise DataError(f"{name}: 'values' must be numeric, got dtype {values.dtype}")
    out, over = _as_float32(values)
    if over is not None and over.any():
        row, col = np.unravel_index(int(np.argmax(over)), over.shape)
        i = _sample_of_step(offsets, row)
        raise DataError(_overflow_message(name, i, values[row, col], f"at step {row - int(offsets[i])}"))
    _warn_int_rounding(values, out, name, "values", lambda pos: _sample_of_step(offsets, pos // values.shape[1]))
    return out


def _sample_of_step(offsets: np.ndarray, row: int) -> int:
    return int(np.searchsorted(offsets, row, side="right")) - 1


def _where(rows: np.ndarray) -> str:
    return f"at step {int(np.argmax(rows))}" if rows.any() else "in its target"


def build_dataset(values: np.ndarray, offsets: np.ndarray, targets: Optional[np.ndarray], name: str, task: Optional[str],
           drop_nonfinite: bool, class_names: Optional[List[str]] = None,
           num_classes: Optional[int] = None) -> RaggedDataset:
    """Checks the ragged layout and targets, drops or rejects non-finite samples (after the cast to
    float32), infers the task. targets None: a prediction-only file (task must be given).
    num_classes: the model's class count (prediction): labels must be below it."""
    if offsets.ndim == 1 and len(offsets) < 2:
        raise DataError(f"{name}: no samples ('offsets' needs N+1 >= 2 entries for N samples, got {len(offsets)})")
    if values.ndim != 2:
        raise DataError(f"{name}: 'values' must have shape (total_steps, features), got {values.shape}")
    if not _real(values.dtype):
        raise DataError(f"{name}: 'values' must be numeric, got dtype {values.dtype}")
    if values.shape[1] == 0:
        raise DataError(f"{name}: 'values' has 0 features per step")
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
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
    if not _real(targets.dtype, bool_ok=True):
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
    _warn_int_rounding(raw_values, values, name, "values", lambda pos: _sample_of_step(offsets, pos // values.shape[1]))
    bad_rows = ~np.isfinite(values).all(axis=1)
    bad = np.add.reduceat(bad_rows, offsets[:-1]) > 0
    t_over = None
    if task == "regression":
        targets, t_over = _as_float32(targets.reshape(n, -1))
        _warn_int_rounding(raw_targets, targets, name, "targets", lambda pos: pos // targets.shape[1])
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
            problem = _overflow_message(name, i, raw[int(np.argmax(flag))], _where(rows), more)
        else:
            problem = f"{name}: sample {i} has a non-finite value (NaN or inf) {_where(rows)}{more}"
        raise DataError(problem, "drop_nonfinite", "pass drop_nonfinite=True to skip such samples")
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
