"""Crash-safe checkpoints, exact RNG state capture, and reading back what vlseq-train saved.

Writes are atomic: the state goes to a temporary file in the checkpoint's directory, which is
flushed and fsync'ed, then renamed over the old checkpoint with os.replace (atomic on POSIX and
Windows), and the directory is fsync'ed so the rename itself survives a power loss. A crash at any
moment leaves either the previous checkpoint or the new one, never a torn file; a failed write (a
full disk) removes its temporary file, leaves the previous checkpoint as it was and raises
`CheckpointWriteError` (an OSError) naming the path.

Checkpoints hold only tensors and plain Python values, so they load with
torch.load(weights_only=True): no arbitrary code runs when a checkpoint is opened.

Reading: `read_checkpoint` tells a vlseq checkpoint from a foreign, truncated, damaged (a member
failing its zip CRC-32: torch.load never checks them) or inconsistent file (`CheckpointError`, one
line), and `load_model` returns the trained model of a vlseq-train run.
"""
from __future__ import annotations

import io
import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from .checkpoint_fields import FieldError, check_model_fields, check_training_fields
from .files import write_atomically

__all__ = ["CHECKPOINT_NAME", "FORMAT", "CheckpointError", "CheckpointWriteError", "save_checkpoint",
           "load_checkpoint", "find_checkpoint", "read_checkpoint", "build_model", "load_model",
           "capture_rng_state", "restore_rng_state"]

CHECKPOINT_NAME = "last.pt"
FORMAT = "vlseq_ext.checkpoint/1"
PathLike = Union[str, Path]
# What vlseq-train saves; a resume needs all of it, a prediction the first three.
MODEL_KEYS = ("config", "data", "model")
RESUME_KEYS = MODEL_KEYS + ("optimizer", "trainer", "sampler", "run", "rng")
DAMAGED = "the checkpoint is damaged or was not written by vlseq-train: use another copy of it"


class CheckpointError(ValueError):
    """A file that is not a usable vlseq checkpoint: foreign, truncated or corrupt, damaged (a member
    fails its zip CRC-32), or inconsistent (its configuration does not match its weights). The
    message is one line naming the file."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full). The previous checkpoint at that
    path, if any, is unchanged and no temporary file is left. Attributes: `path`, `reason` (the
    original error's text, e.g. "No space left on device") and `errno` (the original error's)."""

    def __init__(self, path: Path, reason: str, errno: Optional[int]) -> None:
        super().__init__(f"{path}: cannot write the checkpoint: {reason}"
                         + (f" [Errno {errno}]" if errno else "")
                         + "; the previous checkpoint there (if any) is unchanged")
        self.path, self.reason = path, reason
        self.errno = errno


def capture_rng_state() -> Dict[str, Any]:
    """Every RNG the training loop may draw from: Python's `random`, NumPy's global generator,
    torch's CPU generator and, once this process has initialized CUDA, the generator of every CUDA device
    (a process that has not used it drew from none, and reading them would initialize CUDA: a context on every
    GPU of a CPU run). Only tensors, ints, floats and strings, so it survives torch.load(weights_only=True)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
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


def _write_bytes(f: Any, data: memoryview) -> None:
    """Write the serialised checkpoint to the open temporary file (a seam the tests patch)."""
    f.write(data)


def save_checkpoint(state: Dict[str, Any], path: PathLike) -> Path:
    """Atomically write `state` (tensors, dicts, lists, numbers, strings) to `path`: serialise it,
    write a temporary file in the same directory, flush + fsync, os.replace over `path`, fsync the
    directory (files.write_atomically). Creates the directory if needed; removes temporaries left
    by a killed writer. Raises CheckpointWriteError when the file cannot be written; `path` is then
    untouched."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()
    try:
        write_atomically(path, lambda f: _write_bytes(f, data), durable=True, clear_stale=True)
    except OSError as exc:
        raise CheckpointWriteError(path, exc.strerror or str(exc) or type(exc).__name__, exc.errno) from exc
    return path


def find_checkpoint(path: PathLike) -> Optional[Path]:
    """The checkpoint file for `path`: the file itself, or DIR/last.pt for a directory; None if absent."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    return path if path.is_file() else None


def load_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """Load a checkpoint file (or DIR/last.pt) with torch.load(weights_only=True), unchecked.
    Raises FileNotFoundError when there is none."""
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no checkpoint (expected a file or a directory holding {CHECKPOINT_NAME})")
    return torch.load(found, map_location=map_location, weights_only=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


_CRC_CHUNK = 16 << 20  # bytes per read while checking a member: bounded extra memory for any size
# torch.save's legacy (non-zip) format opens with its magic number, pickled as a 10-byte LONG1 right
# after the protocol (and, from protocol 4 on, a frame header): any other file that starts with a
# pickle's first byte is not a torch checkpoint.
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _check_crcs(raw: bytes, found: Path) -> bool:
    """Every member of the zip archive `raw` (the bytes of `found`) must match its stored CRC-32:
    torch.load does not check them, so a bit flipped on disk or in transfer would otherwise load
    as silently wrong weights. False when zipfile cannot open `raw` as an archive (a truncated
    file has no central directory): that is left to torch.load and its usual errors."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False
    except Exception as exc:  # NotImplementedError: a damaged "version needed to extract", and the like
        raise CheckpointError(f"{found}: truncated or corrupt ({len(raw)} bytes): {_first_line(exc)}") from None
    with zf:
        infos = zf.infolist()
        for info in infos:
            # torch.save writes no directories; torch's reader returns garbage for a member flagged as one
            # (the MS-DOS directory bit of its attributes), which zipfile itself ignores
            if info.is_dir() or info.external_attr & 0x10:
                raise CheckpointError(f"{found}: the checkpoint is damaged: member {info.filename!r} is marked as a "
                                      "directory in the zip directory; use an earlier copy")
        # torch.serialization.set_crc32_options(False) writes 0 for every CRC: nothing to check.
        if all(info.CRC == 0 for info in infos if info.file_size):
            return True
        for info in infos:
            try:
                with zf.open(info) as member:  # zipfile checks the CRC-32 once a member is read to its end
                    while member.read(_CRC_CHUNK):
                        pass
            except zipfile.BadZipFile as exc:
                if "CRC" in str(exc):
                    raise CheckpointError(f"{found}: the checkpoint is damaged: member {info.filename!r} fails its "
                                          "CRC check (a bit flipped on disk or in transfer); use an earlier "
                                          "copy") from None
                raise CheckpointError(f"{found}: truncated or corrupt ({len(raw)} bytes): member "
                                      f"{info.filename!r}: {_first_line(exc)}") from None
            except Exception as exc:  # zlib.error, EOFError, NotImplementedError (an unknown compression)...
                raise CheckpointError(f"{found}: truncated or corrupt ({len(raw)} bytes): member "
                                      f"{info.filename!r}: {_first_line(exc)}") from None
    return True


def read_checkpoint(path: PathLike, map_location: Union[str, torch.device] = "cpu",
                    need: Sequence[str] = RESUME_KEYS) -> Dict[str, Any]:
    """Load and check a vlseq-train checkpoint (a file, or a run folder holding last.pt).
    `need`: the entries it must have (RESUME_KEYS to continue training, MODEL_KEYS to predict).
    Raises FileNotFoundError when there is none, CheckpointError (one line) when the file is not
    a vlseq checkpoint, is truncated or corrupt, is damaged (a member's bytes fail the CRC-32 the
    zip archive stores for them, checked before anything is unpickled), or its configuration
    disagrees with its weights."""
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no checkpoint there (expected {CHECKPOINT_NAME} in a run folder, "
                                "or a checkpoint file)")
    # Read once: the CRCs are checked and torch.load reads from the same bytes (no second pass over
    # the disk, and no window in which the file could change between the check and the load).
    raw = found.read_bytes()
    size = len(raw)
    if size == 0:
        raise CheckpointError(f"{found}: truncated or corrupt: the file is empty (0 bytes)")
    head = raw[:4]
    # torch.save writes a zip archive (its legacy format, a pickle with a magic number, long ago)
    if head != b"PK\x03\x04" and not (head[:1] == b"\x80" and _LEGACY_MAGIC in raw[:32]):
        raise CheckpointError(f"{found}: truncated or corrupt, or another kind of file: {size} bytes without the zip "
                              "(or pickle) header of a torch checkpoint")
    # A checked archive loads from the bytes in memory; anything else (a truncated archive, an old
    # pickle) from the path, as before, so its errors read as they always did.
    checked = head == b"PK\x03\x04" and _check_crcs(raw, found)
    # torch's warnings about a file it then refuses (an unknown pickle protocol, say) would be a second
    # line beside the one error that says what is wrong: kept only when the load succeeds.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckpt = torch.load(io.BytesIO(raw) if checked else found, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            if "weights only" in str(exc).lower() or "weights_only" in str(exc).lower():
                raise CheckpointError(f"{found}: not a vlseq checkpoint: it holds Python objects that vlseq "
                                      "checkpoints never contain (refused by torch.load(weights_only=True))") from None
            raise CheckpointError(f"{found}: truncated or corrupt ({size} bytes): {_first_line(exc)}") from None
        except Exception as exc:  # RuntimeError (zip reader), EOFError, OSError [Errno 22], ValueError...
            raise CheckpointError(f"{found}: truncated or corrupt ({size} bytes): {_first_line(exc)}") from None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{found}: not a vlseq checkpoint: it holds a {type(ckpt).__name__}, not the dict "
                              "that vlseq-train writes")
    missing = [k for k in need if k not in ckpt]
    if missing:
        what = "a model state_dict, " if all(isinstance(v, torch.Tensor) for v in ckpt.values()) else ""
        raise CheckpointError(f"{found}: not a vlseq checkpoint: {what}no {', '.join(repr(k) for k in missing)} "
                              f"entr{'y' if len(missing) == 1 else 'ies'} (a vlseq-train checkpoint holds "
                              f"{', '.join(RESUME_KEYS)})")
    if ckpt.get("format", FORMAT) != FORMAT:
        raise CheckpointError(f"{found}: format {ckpt['format']!r}, not {FORMAT!r}: written by another version of "
                              "vlseq_ext, which this one cannot read")
    shapes = _check_consistent(ckpt, found)
    if all(k in need for k in RESUME_KEYS):
        try:
            check_training_fields(ckpt, shapes)
        except FieldError as exc:
            raise CheckpointError(f"{found}: cannot be resumed: {exc}; {DAMAGED}") from None
    return ckpt


def build_model(config: Dict[str, Any], data: Dict[str, Any]) -> nn.Module:
    """The (untrained) model vlseq-train builds for a run's configuration and data description."""
    from .models import SeqModel
    return SeqModel(input_dim=int(data["num_features"]), hidden_dim=int(config["hidden"]),
                    output_dim=int(data["output_dim"]), num_layers=int(config["layers"]), rnn=str(config["model"]))


def _check_consistent(ckpt: Dict[str, Any], found: Path) -> List[Tuple[int, ...]]:
    """The saved configuration must describe a model vlseq-train builds (field by field, its size
    counted before anything is built) and the saved weights (shapes compared on the meta device:
    nothing is allocated). Returns the model's parameter shapes, in the optimizer's order."""
    cfg, data, weights = ckpt.get("config"), ckpt.get("data"), ckpt.get("model")
    if not isinstance(cfg, dict) or not isinstance(data, dict) or not isinstance(weights, dict):
        raise CheckpointError(f"{found}: not a vlseq checkpoint: 'config', 'data' and 'model' must be dicts")
    try:
        check_model_fields(cfg, data)
    except FieldError as exc:
        raise CheckpointError(f"{found}: inconsistent: {exc}; {DAMAGED}") from None
    with torch.device("meta"):
        meta = build_model(cfg, data)
    expected = meta.state_dict()
    for name, t in expected.items():
        w = weights.get(name)
        if not isinstance(w, torch.Tensor):
            raise CheckpointError(f"{found}: inconsistent: the saved configuration ({_describe(cfg, data)}) has "
                                  f"{name}, which the saved weights lack")
        if tuple(w.shape) != tuple(t.shape):
            raise CheckpointError(f"{found}: inconsistent: the saved configuration ({_describe(cfg, data)}) gives "
                                  f"{name} the shape {tuple(t.shape)}, the saved weights have {tuple(w.shape)}")
        # load_state_dict would cast any dtype silently (a complex weight loses its imaginary part)
        if w.dtype != t.dtype:
            raise CheckpointError(f"{found}: inconsistent: the saved weight {name} is {w.dtype}; vlseq-train saves "
                                  f"{t.dtype}")
        if not bool(torch.isfinite(w).all()):  # vlseq-train skips non-finite steps: its weights never are
            raise CheckpointError(f"{found}: the saved weight {name} holds NaN or inf; the checkpoint is damaged or "
                                  "was not written by vlseq-train")
    extra = sorted(str(k) for k in set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"{found}: inconsistent: the saved weights have {extra[0]}, which the saved "
                              f"configuration ({_describe(cfg, data)}) does not")
    return [tuple(p.shape) for p in meta.parameters()]


def _describe(cfg: Dict[str, Any], data: Dict[str, Any]) -> str:
    return (f"{cfg.get('model')}, {data.get('num_features')} features, hidden {cfg.get('hidden')}, "
            f"layers {cfg.get('layers')}, {data.get('output_dim')} outputs")


def load_model(checkpoint_path: PathLike, map_location: Union[str, torch.device] = "cpu") -> nn.Module:
    """The trained model of a vlseq-train run (its checkpoint file or run folder), in eval mode, on
    `map_location`. Raises FileNotFoundError or CheckpointError (see read_checkpoint)."""
    ckpt = read_checkpoint(checkpoint_path, map_location="cpu", need=MODEL_KEYS)
    model = build_model(ckpt["config"], ckpt["data"])
    model.load_state_dict(ckpt["model"])
    return model.to(map_location).eval()
