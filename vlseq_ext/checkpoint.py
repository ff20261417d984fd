"""Crash-safe checkpoints and exact RNG state capture for vlseq-train.

Writes are atomic: the state goes to a temporary file in the checkpoint's directory, which is
flushed and fsync'ed, then renamed over the old checkpoint with os.replace (atomic on POSIX and
Windows), and the directory is fsync'ed so the rename itself survives a power loss. A crash at any
moment leaves either the previous checkpoint or the new one, never a torn file.

Checkpoints hold only tensors and plain Python values, so they load with
torch.load(weights_only=True): no arbitrary code runs when a checkpoint is opened.
"""
from __future__ import annotations

import io
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

import numpy as np
import torch

__all__ = ["CHECKPOINT_NAME", "save_checkpoint", "load_checkpoint", "find_checkpoint", "capture_rng_state",
           "restore_rng_state"]

CHECKPOINT_NAME = "last.pt"
PathLike = Union[str, Path]

# Test hook: VLSEQ_TEST_HANG_IN_CHECKPOINT_WRITE=k makes the k-th save of this process stop halfway
# through writing its temporary file and hang, so a test can SIGKILL it mid-write.
_HANG_ENV = "VLSEQ_TEST_HANG_IN_CHECKPOINT_WRITE"
_saves = 0


def capture_rng_state() -> Dict[str, Any]:
    """Every RNG the training loop may draw from: Python's `random`, NumPy's global generator,
    torch's CPU generator and the generator of every CUDA device. Only tensors, ints, floats and
    strings, so it survives torch.load(weights_only=True)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Inverse of capture_rng_state. CUDA states are restored for the devices both runs have."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), int(nps["pos"]), int(nps["has_gauss"]),
                         float(nps["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        for i in range(n):
            torch.cuda.set_rng_state(cuda[i], i)


def _fsync_dir(folder: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows; os.replace is enough there
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(state: Dict[str, Any], path: PathLike) -> Path:
    """Atomically write `state` (tensors, dicts, lists, numbers, strings) to `path`: serialise it,
    write a temporary file in the same directory, flush + fsync, os.replace over `path`, fsync the
    directory. Creates the directory if needed; removes temporaries left by a killed writer."""
    global _saves
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()
    _saves += 1
    hang = os.environ.get(_HANG_ENV) == str(_saves)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if hang:
                f.write(data[:len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                print(f"vlseq-test: hanging in checkpoint write of {tmp}", file=sys.stderr, flush=True)
                while True:
                    time.sleep(60)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def find_checkpoint(path: PathLike) -> Optional[Path]:
    """The checkpoint file for `path`: the file itself, or DIR/last.pt for a directory; None if absent."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    return path if path.is_file() else None


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Load a checkpoint file (or DIR/last.pt) with torch.load(weights_only=True).
    Raises FileNotFoundError when there is none."""
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no checkpoint (expected a file or a directory holding {CHECKPOINT_NAME})")
    return torch.load(found, map_location=map_location, weights_only=True)
