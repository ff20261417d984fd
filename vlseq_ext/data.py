"""Variable-length datasets for vlseq-train: ragged .npz files, UEA/UCR .ts files (through aeon),
a deterministic synthetic demo set, input validation, and a resumable length-bucketed sampler.

Every validation failure raises `DataError` with a one-line message that names the file and the
sample, so the CLI can print it and exit with code 2.
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

__all__ = ["DataError", "RaggedDataset", "save_ragged", "load_ragged", "load_ts", "synthetic", "japanese_vowels",
           "open_dataset", "split", "sequence_lengths", "LengthBucketSampler", "BUILTIN"]

BUILTIN = ("synthetic", "japanese_vowels")
PathLike = Union[str, Path]


class DataError(ValueError):
    """Bad input data. The message is one line naming the file or sample and what is wrong."""


class RaggedDataset(Dataset):
    """In-memory variable-length samples: one (total_steps, D) float32 array and per-sample
    start/length, so N samples cost one allocation. `ds[i]` is `(x, y)` with x a (L_i, D) view and
    y a float (O,) target (regression) or a 0-dim int64 class index (classification).

    Attributes: `lengths` (N,) int64 numpy array, `num_features` (D), `task`
    ("regression" | "classification"), `output_dim` (O, or the number of classes), `class_names`
    (classification labels, as strings), `name` (for messages), `source` (the file it came from,
    if any), `dropped` (samples skipped as non-finite when loading).
    """

    def __init__(self, values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, targets: np.ndarray,
                 task: str, output_dim: int, name: str, class_names: Optional[List[str]] = None,
                 dropped: int = 0) -> None:
        self.values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        dtype = np.int64 if task == "classification" else np.float32
        self.targets = torch.from_numpy(np.ascontiguousarray(targets, dtype=dtype))
        self.task, self.output_dim, self.name = task, int(output_dim), name
        self.class_names = class_names
        self.dropped = dropped
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


def _from_sequences(sequences: Sequence[np.ndarray], targets: np.ndarray, name: str, task: Optional[str],
                    drop_nonfinite: bool, class_names: Optional[List[str]] = None) -> RaggedDataset:
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([np.asarray(s, dtype=np.float32) for s in sequences]) if sequences else np.zeros((0, 0))
    return _build(values, offsets, targets, name, task, drop_nonfinite, class_names)


def _build(values: np.ndarray, offsets: np.ndarray, targets: np.ndarray, name: str, task: Optional[str],
           drop_nonfinite: bool, class_names: Optional[List[str]] = None) -> RaggedDataset:
    """Checks the ragged layout and targets, drops or rejects non-finite samples, infers the task."""
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
    if targets.ndim == 0 or targets.shape[0] != n:
        raise DataError(f"{name}: 'targets' must have one row per sample ({n}), got shape {targets.shape}")
    if not (np.issubdtype(targets.dtype, np.floating) or np.issubdtype(targets.dtype, np.integer)
            or targets.dtype == np.bool_):
        raise DataError(f"{name}: 'targets' must be numeric, got dtype {targets.dtype}")

    if task is None:
        task = "classification" if targets.ndim == 1 and not np.issubdtype(targets.dtype, np.floating) else "regression"
    if task not in ("regression", "classification"):
        raise DataError(f"task must be 'regression' or 'classification', got {task!r}")

    # Non-finite values: one flag per sample (reduceat is safe: every sample has length >= 1).
    floating = np.issubdtype(values.dtype, np.floating)
    bad_rows = ~np.isfinite(values).all(axis=1) if floating else np.zeros(len(values), bool)
    bad = np.add.reduceat(bad_rows, offsets[:-1]) > 0
    if np.issubdtype(targets.dtype, np.floating):
        bad |= ~np.isfinite(targets.reshape(n, -1)).all(axis=1)
    dropped = int(bad.sum())
    if dropped and not drop_nonfinite:
        i = int(np.argmax(bad))
        rows = bad_rows[offsets[i]:offsets[i + 1]]
        where = f"at step {int(np.argmax(rows))}" if rows.any() else "in its target"
        raise DataError(f"{name}: sample {i} has a non-finite value (NaN or inf) {where}"
                        f"{f' ({dropped} such samples)' if dropped > 1 else ''}; pass --drop-nonfinite to skip them")
    if dropped:
        keep = ~bad
        if not keep.any():
            raise DataError(f"{name}: every sample has a non-finite value; nothing left to train on")
        values, targets, lengths = values[np.repeat(keep, lengths)], targets[keep], lengths[keep]
        n = len(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])

    if task == "classification":
        if targets.ndim != 1:
            raise DataError(f"{name}: classification needs one class index per sample, got targets of shape "
                            f"{targets.shape}")
        if np.issubdtype(targets.dtype, np.floating) and (targets != np.round(targets)).any():
            i = int(np.argmax(targets != np.round(targets)))
            raise DataError(f"{name}: sample {i} has class label {targets[i]}, not an integer")
        if (targets < 0).any():
            i = int(np.argmax(targets < 0))
            raise DataError(f"{name}: sample {i} has a negative class label {targets[i]}")
        targets = targets.astype(np.int64)
        output_dim = len(class_names) if class_names else int(targets.max()) + 1
    else:
        targets = targets.reshape(n, -1).astype(np.float32)
        output_dim = targets.shape[1]
    return RaggedDataset(values, starts, lengths, targets, task, output_dim, name, class_names, dropped)


def save_ragged(path: PathLike, sequences: Sequence[Any], targets: Any) -> None:
    """Write samples as a ragged .npz: `values` (total_steps, D) float32 (the samples
    concatenated), `offsets` (N+1,) int64 (sample i is values[offsets[i]:offsets[i+1]]) and
    `targets` (N, ...) as given (float for regression, integer class indices for classification).
    `sequences` are (L_i, D) arrays or tensors."""
    seqs = [np.asarray(s.detach().cpu() if isinstance(s, Tensor) else s, dtype=np.float32) for s in sequences]
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    values = np.concatenate(seqs) if seqs else np.zeros((0, 0), np.float32)
    targets = np.asarray(targets.detach().cpu() if isinstance(targets, Tensor) else targets)
    np.savez(path, values=values, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), targets=targets)


def load_ragged(path: PathLike, task: Optional[str] = None, drop_nonfinite: bool = False) -> RaggedDataset:
    """Load and validate a ragged .npz written by `save_ragged` (np.load with allow_pickle=False).
    `task` None infers it: 1-D integer targets mean classification, anything else regression.
    Raises DataError for a missing, corrupt or truncated file, wrong shapes, non-monotone
    offsets, zero-length samples and non-finite values (unless drop_nonfinite, which skips those
    samples and records the count in `.dropped`)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # np.load would try to unpickle anything else
        raise DataError(f"{path}: not an .npz archive (no zip header): corrupt, or not written by np.savez/save_ragged")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("values", "offsets", "targets") if k not in f.files]
            if missing:
                raise DataError(f"{path}: missing array(s) {', '.join(missing)} "
                                f"(found: {', '.join(f.files) or 'none'})")
            values, offsets, targets = f["values"], f["offsets"], f["targets"]
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{path}: cannot read as .npz (corrupt or truncated?): {msg}") from None
    return _build(values, offsets, targets, str(path), task, drop_nonfinite)


def load_ts(path: PathLike, task: Optional[str] = None, drop_nonfinite: bool = False) -> RaggedDataset:
    """Load a UEA/UCR .ts file (equal or unequal length) through aeon's `load_from_ts_file`.
    Class labels become indices into `class_names` (the file's @classLabel order); a
    @targetLabel file gives a regression target. Needs the optional extra: pip install 'vlseq_ext[ts]'."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
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
    seqs = [np.asarray(x, dtype=np.float32).T for x in X]  # aeon gives (channels, time)
    if y is None or len(y) != len(seqs):
        raise DataError(f"{path}: the file has no class or target labels")
    class_names = None
    if meta.get("classlabel") and task != "regression":
        class_names = [str(c) for c in (meta.get("class_values") or sorted(set(map(str, y))))]
        index = {c: i for i, c in enumerate(class_names)}
        unknown = [i for i, v in enumerate(y) if str(v) not in index]
        if unknown:
            raise DataError(f"{path}: sample {unknown[0]} has label {y[unknown[0]]!r}, "
                            f"not one of @classLabel {class_names}")
        targets = np.array([index[str(v)] for v in y], dtype=np.int64)
        task = "classification"
    else:
        try:
            targets = np.asarray(y, dtype=np.float32)
        except ValueError:
            raise DataError(f"{path}: target labels are not numeric") from None
    return _from_sequences(seqs, targets, str(path), task, drop_nonfinite, class_names)


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


# ------------------------------------------------------------------------------------------------
# sampling


class LengthBucketSampler(Sampler[List[int]]):
    """Batches of `batch_size` sample indices with similar lengths, for steps of one trainer.step.

    Each epoch (order fixed by (seed, epoch)): shuffle all indices, cut them into buckets of
    `batch_size * bucket_batches` ("sortish": sorted within a bucket only, so batches still vary
    from epoch to epoch), sort each bucket by length, cut it into batches, shuffle the batch order,
    and put the batch holding the longest sample first, so an out-of-memory shows up at once.

    The sampler is resumable: `position` counts the batches of `epoch` already handed out, and
    iterating continues from there; `state_dict()` / `load_state_dict()` save and restore both,
    so a resumed run continues at exactly the next batch. Call `set_epoch(e)` to start epoch e.
    (As a DataLoader's batch_sampler, use num_workers=0: workers prefetch batches, so `position`
    would run ahead of the batches actually trained on.)
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, shuffle: bool = True, seed: int = 0,
                 bucket_batches: int = 50, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("LengthBucketSampler: no samples")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.bucket_batches, self.drop_last = bucket_batches, drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int) -> List[List[int]]:
        """Every batch of `epoch`, in order."""
        n, bs = len(self.lengths), self.batch_size
        if not self.shuffle:  # longest first, e.g. for evaluation
            order = np.argsort(-self.lengths, kind="stable")
            return [order[i:i + bs].tolist() for i in range(0, len(self) * bs, bs)]
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(n)
        out: List[List[int]] = []
        chunk = bs * self.bucket_batches
        for s in range(0, n, chunk):
            bucket = perm[s:s + chunk]
            bucket = bucket[np.argsort(-self.lengths[bucket], kind="stable")]
            out += [bucket[i:i + bs].tolist() for i in range(0, len(bucket), bs)]
        if self.drop_last:
            out = [b for b in out if len(b) == bs][:len(self)]
        out = [out[i] for i in rng.permutation(len(out))]
        longest = max(range(len(out)), key=lambda i: (int(self.lengths[out[i]].max()), -i))
        out.insert(0, out.pop(longest))
        return out

    def __iter__(self) -> Iterator[List[int]]:
        epoch = self.epoch
        batches = self.batches(epoch)
        # Stops early if set_epoch/load_state_dict is called while iterating.
        while self.epoch == epoch and self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "num_samples": len(self.lengths), "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore epoch and position; the batch size and sample count must match, or the
        position would point at different samples."""
        for key, mine in (("batch_size", self.batch_size), ("num_samples", len(self.lengths))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {mine}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
