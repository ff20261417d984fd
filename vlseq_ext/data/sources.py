"""Variable-length datasets for vlseq-train and vlseq-predict: ragged .npz files, UEA/UCR .ts files
(through aeon), a deterministic synthetic demo set, the train/validation split. The dataset class
and the checks every sample passes are in vlseq_ext.ragged (re-exported here); the samplers that
cut datasets into steps are in vlseq_ext.samplers.

Every failure raises `DataError` with a one-line message that names the file and the sample.
"""
from __future__ import annotations

import math
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from ..files import path_problem
from .ragged import MAX_CLASS_LABEL, DataError, RaggedDataset, build_dataset, float32_values, from_sequences

__all__ = ["DataError", "RaggedDataset", "save_ragged", "load_ragged", "load_ts", "synthetic", "japanese_vowels",
           "open_dataset", "split", "sequence_lengths", "BUILTIN", "MAX_CLASS_LABEL"]

BUILTIN = ("synthetic", "japanese_vowels")
PathLike = Union[str, Path]


def save_ragged(path: PathLike, sequences: Sequence[Any], targets: Any = None) -> None:
    """Write samples as a ragged .npz: `values` (total_steps, D) float32 (the samples
    concatenated), `offsets` (N+1,) int64 (sample i is values[offsets[i]:offsets[i+1]]) and
    `targets` (N, ...) as given (float for regression, integer class indices for classification).
    `sequences` are (L_i, D) arrays or tensors. targets None writes no `targets` array: a file for
    vlseq-predict only.
    Refuses (DataError) what load_ragged would refuse in the written file, or could not see there:
    complex or time values (a cast drops the imaginary part, or the unit), values that overflow
    float32 (they would be written as inf); warns when integers beyond 2**24 round in the cast."""
    seqs = [np.asarray(s.detach().cpu() if isinstance(s, Tensor) else s) for s in sequences]
    for i, s in enumerate(seqs):
        if s.dtype.kind in "cmM":
            raise DataError(f"{path}: sample {i}: 'values' must be numeric, got dtype {s.dtype}")
        if s.dtype.kind not in "biuf":  # e.g. an object array of numbers: cast as before, float64 to check the range
            seqs[i] = np.asarray(s, dtype=np.float64)
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(seqs) if seqs else np.zeros((0, 0), np.float32)
    if values.ndim == 2:  # other shapes are written as they are, for load_ragged to name
        values = float32_values(values, offsets, str(path))
    arrays = {"values": values.astype(np.float32, copy=False), "offsets": offsets}
    if targets is not None:
        arrays["targets"] = np.asarray(targets.detach().cpu() if isinstance(targets, Tensor) else targets)
        if arrays["targets"].dtype.kind not in "biuf":  # load_ragged refuses it (an object array cannot even be read)
            raise DataError(f"{path}: 'targets' must be numeric, got dtype {arrays['targets'].dtype}")
    np.savez(path, **arrays)


def check_file(path: Path) -> None:
    """DataError unless `path` is an existing regular file (a directory or a device is named as such)."""
    problem = path_problem(path)
    if problem:
        raise DataError(f"{path}: {problem}", "data")
    if path.is_file():
        return
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a data file", "data")
    if path.exists():
        raise DataError(f"{path}: is not a regular file (a device, pipe or socket)", "data")
    raise DataError(f"{path}: no such file", "data")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# what a damaged member's decompressor raises besides zlib.error (bz2 raises OSError)
try:
    import lzma
    _DECOMPRESS_ERRORS: Tuple[type, ...] = (lzma.LZMAError,)
except ImportError:  # Python built without lzma: zipfile cannot read such members either
    _DECOMPRESS_ERRORS = ()


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
            arrays = {k: f[k] for k in ("values", "offsets", "targets") if k in f.files}
    except DataError:
        raise
    except NotImplementedError as exc:  # zipfile: an unknown compression method (before RuntimeError: a subclass)
        raise DataError(f"{path}: cannot read as .npz: {_first_line(exc)} (np.savez writes stored or deflated "
                        "members)") from None
    except RuntimeError as exc:  # zipfile: "File 'values.npy' is encrypted, password required for extraction"
        raise DataError(f"{path}: cannot read as .npz: {_first_line(exc)} (np.savez writes no password)") from None
    except MemoryError as exc:  # an array header may claim any shape; numpy allocates it before reading
        raise DataError(f"{path}: cannot read as .npz: {_first_line(exc)} (a corrupt array header, or an array "
                        "too large for this machine's memory)") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, zlib.error) + _DECOMPRESS_ERRORS as exc:
        raise DataError(f"{path}: cannot read as .npz (corrupt or truncated?): {_first_line(exc)}") from None
    for k, a in arrays.items():
        if not isinstance(a, np.ndarray):  # np.load gives a member named without .npy as raw bytes
            raise DataError(f"{path}: member {k!r} is not a .npy array (np.savez names it {k}.npy)")
    values, offsets, targets = arrays["values"], arrays["offsets"], arrays.get("targets")
    return build_dataset(values, offsets, targets, str(path), task, drop_nonfinite, num_classes=num_classes)


def _has_data_line(path: Path) -> bool:
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        return any(line.strip().lower().startswith("@data") for line in fh)


def _raw_class_labels(path: Path) -> List[str]:
    """The @classLabel list as the file writes it (aeon lowercases it); the last one wins, as in aeon."""
    labels: List[str] = []
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            tokens = line.split()
            if tokens and tokens[0].lower() == "@data":
                break
            if tokens and tokens[0].lower() == "@classlabel":
                labels = tokens[2:]
    return labels


def _check_class_header(path: Path, header: List[str]) -> None:
    """aeon lowercases class labels: 'A' and 'a' would become one class, and a repeated label a
    phantom one (an index no sample has, after which every later label shifts)."""
    if len(set(header)) == len(header):
        return
    twice = next(c for i, c in enumerate(header) if c in header[:i])
    raw = _raw_class_labels(path)
    same = [r for r in raw if r.lower() == twice] if len(raw) == len(header) else []
    if len(set(same)) > 1:
        raise DataError(f"{path}: @classLabel labels {', '.join(map(repr, same))} differ only in case, and aeon "
                        "(the .ts reader) lowercases labels: rename them so they stay distinct")
    raise DataError(f"{path}: @classLabel lists the label {(same or [twice])[0]!r} more than once")


def _labels_by_value(path: Path, y: np.ndarray) -> np.ndarray:
    """Labels "0", "1", ... as class indices: for a model trained without class names (on a .npz's
    indices 0..C-1), which the file's @classLabel order says nothing about."""
    for i, v in enumerate(y):
        if not re.fullmatch(r"[+-]?[0-9]{1,18}", str(v)):  # 18 digits: an int64 (beyond, far too large anyway)
            raise DataError(f"{path}: sample {i} has label {str(v)!r}, but the model was trained without class "
                            "names (on class indices 0..C-1), so only integer labels can be matched to its classes")
    return np.array([int(str(v)) for v in y], dtype=np.int64)


def load_ts(path: PathLike, task: Optional[str] = None, drop_nonfinite: bool = False,
            targets_required: bool = True, class_names: Optional[List[str]] = None,
            num_classes: Optional[int] = None) -> RaggedDataset:
    """Load a UEA/UCR .ts file (equal or unequal length) through aeon's `load_from_ts_file`.
    Class labels become indices into `class_names` (the file's @classLabel order); a
    @targetLabel file gives a regression target. Needs the optional extra: pip install 'vlseq_ext[ts]'.
    aeon lowercases class labels: labels that then collide are refused.
    For prediction: targets_required=False accepts a file without labels; class_names (the
    trained model's classes, in its order) maps the labels instead of the file's @classLabel list.
    A prediction without class_names (the model was trained on class indices, e.g. from a .npz)
    maps integer labels by value ("2" is class 2, whatever the @classLabel order) and refuses
    named ones; num_classes (the model's) bounds them."""
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
    seqs = [np.asarray(x).T for x in X]  # aeon gives (channels, time); float32 cast (and check) in build_dataset
    if y is None or len(y) != len(seqs):
        if targets_required:
            raise DataError(f"{path}: the file has no class or target labels")
        return from_sequences(seqs, None, str(path), task, drop_nonfinite, class_names)
    if meta.get("classlabel") and task != "regression":
        header = [str(c) for c in (meta.get("class_values") or [])]
        _check_class_header(path, header)
        if not class_names and not targets_required:  # no names to map by: the model knows indices only
            return from_sequences(seqs, _labels_by_value(path, y), str(path), "classification", drop_nonfinite,
                                  num_classes=num_classes)
        names = class_names or header or sorted(set(map(str, y)))
        index = {c: i for i, c in enumerate(names)}
        unknown = [i for i, v in enumerate(y) if str(v) not in index]
        if unknown:
            which = "the model's classes" if class_names else "@classLabel"
            raise DataError(f"{path}: sample {unknown[0]} has label {str(y[unknown[0]])!r}, "
                            f"not one of {which} {names}")
        targets = np.array([index[str(v)] for v in y], dtype=np.int64)
        return from_sequences(seqs, targets, str(path), "classification", drop_nonfinite, names)
    try:
        targets = np.asarray(y, dtype=np.float64)
    except ValueError:
        raise DataError(f"{path}: target labels are not numeric") from None
    return from_sequences(seqs, targets, str(path), task, drop_nonfinite)


def synthetic(num_samples: int = 2000, seed: int = 0, num_features: int = 36, min_length: int = 50,
              max_length: int = 500) -> RaggedDataset:
    """The built-in demo regression set, deterministic given `seed`: lengths uniform in
    [min_length, max_length]; each sequence is a per-sample random level plus unit noise per step;
    the target is a random linear function of the sequence mean plus half a second one of the mean
    of its last 3 steps, plus N(0, 0.05^2) noise. Learnable, so the loss visibly falls. The functions
    are drawn from the same generator after the lengths: another seed, sample count or length range
    gives another task, not new samples of this one."""
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
    return build_dataset(values, offsets, targets.astype(np.float32)[:, None], f"synthetic(seed={seed})", "regression", False)


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
    """A data set by name ("synthetic", "japanese_vowels") or file (a ragged .npz or a .ts file).
    Returns (dataset, validation set or None); only japanese_vowels comes with its own validation set
    (the official test split)."""
    builtin = {"synthetic": "regression", "japanese_vowels": "classification"}
    if data in builtin and task not in (None, builtin[data]):
        raise DataError(f"{data}: a built-in {builtin[data]} dataset: it cannot be trained as {task}", "task",
                        "leave task at None for a built-in set")
    if data == "synthetic":
        return synthetic(num_samples, seed), None
    if data == "japanese_vowels":
        return japanese_vowels(drop_nonfinite)
    path = Path(data)
    if path.suffix.lower() == ".ts":
        return load_ts(path, task, drop_nonfinite), None
    if path.suffix.lower() == ".npz" or os.path.lexists(path) or path_problem(path):  # (check_file says what)
        return load_ragged(path, task, drop_nonfinite), None
    raise DataError(f"{data}: no such file", "data", f"data is a .npz or .ts file, or one of: {', '.join(BUILTIN)}")


def split(ds: RaggedDataset, val_fraction: float, seed: int = 0) -> Tuple[RaggedDataset, Optional[RaggedDataset]]:
    """A deterministic random (train, validation) split; validation is None when val_fraction is 0."""
    if not 0 <= val_fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ds) * val_fraction))
    if n_val == 0:
        return ds, None
    if n_val >= len(ds):
        raise DataError(f"{ds.name}: a validation fraction of {val_fraction} leaves no training samples out of "
                        f"{len(ds)}", "val_fraction", "give a smaller val_fraction")
    perm = np.random.default_rng([seed, 1]).permutation(len(ds))
    return ds.subset(np.sort(perm[n_val:])), ds.subset(np.sort(perm[:n_val]))


def sequence_lengths(ds: Dataset) -> np.ndarray:
    """Per-sample lengths: `ds.lengths` when the dataset has it, else len(x) of every (x, y)."""
    lengths = getattr(ds, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.array([len(ds[i][0]) for i in range(len(ds))], dtype=np.int64)  # type: ignore[arg-type]
