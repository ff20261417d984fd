"""vlseq-predict: predict with a model trained by vlseq-train, on every visible GPU (or the CPU).

    vlseq-predict --checkpoint runs/x --data new.npz --out preds.csv [--metrics m.json]

Batched and exact: samples run longest first in packed batches (no padding enters the RNN), so each
prediction equals a forward pass of the saved model on that sample alone (up to float32 rounding).
Also `python -m vlseq_ext predict ...`; the model itself: vlseq_ext.checkpoint.load_model.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint import CHECKPOINT_NAME, MODEL_KEYS, CheckpointError, build_model, find_checkpoint, read_checkpoint
from ..data import DataError, RaggedDataset, check_file as check_data_file, load_ragged, load_ts
from ..devices import parse_devices
from ..files import is_stream, write_atomically
from .._version import __version__
from .checks import CLIError, check_file, check_path, devices_error, one_line
from .file_rules import check_outputs_distinct, check_outputs_replaceable, refuse
from .locks import check_not_held
from .reporting import one_line_warnings

PROG = "vlseq-predict"
OUT_FORMATS = ("npy", "csv")
# What vlseq-predict tells a user to do about the data errors that name a library parameter: training
# may skip a sample, a prediction needs every row.
DATA_HINTS = {"drop_nonfinite": "every sample to predict needs finite values",
              "data": "--data takes a .npz or .ts file"}

LAYOUT = """output layouts (row i is sample i of --data, in file order):
  regression       .npy: float32 array (N, O), the predicted values
                   .csv: index,prediction              (O = 1)
                         index,prediction_0,...,prediction_{O-1}
  classification   .npy: structured array of N records: 'class' (int64, the predicted class index),
                         'prob' (float32 (C,), softmax probabilities), and 'label' (the class name,
                         when the training data had names, e.g. a .ts file's @classLabel)
                         read with np.load(path): preds['class'], preds['prob']
                   .csv: index,class[,label],p_0,...,p_{C-1}
--metrics PATH (the data must have targets): JSON with samples, loss (mean squared error for
regression, cross-entropy for classification, as in training) and accuracy (classification)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Predict with a model trained by vlseq-train, batched on every visible GPU (or the CPU). "
                    "Each prediction equals a single-sample forward pass of the saved model.",
        epilog=LAYOUT + "\n\nexamples:\n"
                        f"  {PROG} --checkpoint runs/vlseq-20261130-120000 --data new.npz --out preds.npy\n"
                        f"  {PROG} --checkpoint runs/x/last.pt --data test.ts --out preds.csv --metrics test.json\n\n"
                        "The .npz is a ragged file as for vlseq-train (vlseq_ext.data.save_ragged); its 'targets' "
                        "array is optional\nhere. Bad input exits with code 2 and one line; an existing --out or "
                        "--metrics is never replaced\nunless --overwrite is given.")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help=f"a vlseq-train checkpoint file, or its run folder (holding {CHECKPOINT_NAME})")
    p.add_argument("--data", required=True, metavar="PATH", help="a ragged .npz (targets optional) or a .ts file")
    p.add_argument("--out", required=True, metavar="PATH", help="predictions: .npy or .csv (layouts below)")
    p.add_argument("--devices", default="all", metavar="SPEC",
                   help="'all' (every visible GPU, or the CPU), 'N', 'cuda:0,cuda:1' or 'cpu' (default: all)")
    p.add_argument("--batch-size", type=int, default=256, metavar="N",
                   help="samples per forward pass (default: 256)")
    p.add_argument("--metrics", metavar="PATH", help="write loss (and accuracy) as JSON; needs targets in --data")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (and --metrics)")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output problem, before anything is loaded or computed."""
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_path(Path(args.checkpoint), "--checkpoint")
    check_path(Path(args.data), "--data")
    out = Path(args.out)
    check_file(out, "--out", OUT_FORMATS)
    paths = [("--out", out)]
    if args.metrics:
        metrics = Path(args.metrics)
        check_file(metrics, "--metrics")
        paths.append(("--metrics", metrics))
    checkpoint = find_checkpoint(args.checkpoint)
    check_outputs_distinct(paths, [("--data", Path(args.data))]
                           + ([("--checkpoint", checkpoint)] if checkpoint is not None else []))
    check_outputs_replaceable(paths)
    check_not_held(paths)
    for flag, path in paths:
        if path.exists() and not args.overwrite and not is_stream(path):  # (a stream is appended to)
            refuse("predict-outputs", flag=flag, path=path)


def _load_data(args: argparse.Namespace, meta: Dict[str, Any]) -> RaggedDataset:
    path = Path(args.data)
    check_data_file(path)
    task, classes = meta["task"], int(meta["output_dim"])
    if path.suffix.lower() == ".ts":
        names = meta.get("class_names") if task == "classification" else None
        ds = load_ts(path, task=task, targets_required=False, class_names=list(names) if names else None,
                     num_classes=classes if task == "classification" else None)
    else:
        ds = load_ragged(path, task=task, targets_required=False,
                         num_classes=classes if task == "classification" else None)
    if ds.num_features != int(meta["num_features"]):
        raise DataError(f"{path}: {ds.num_features} features per step, but the checkpoint's model takes "
                        f"{meta['num_features']} (trained on {meta.get('name')})")
    if ds.has_targets and task == "classification" and ds.output_dim > classes:
        raise DataError(f"{path}: {ds.output_dim} classes, but the checkpoint's model has {classes}")
    if ds.has_targets and task == "regression" and ds.targets.shape[1] != classes:
        raise DataError(f"{path}: {ds.targets.shape[1]} target values per sample, but the checkpoint's model "
                        f"predicts {classes}")
    return ds


def predict_outputs(model: torch.nn.Module, ds: RaggedDataset, devices: Sequence[torch.device], batch_size: int,
                    progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
    """Outputs (N, O) float32 on the CPU, row i for sample i: batches of similar lengths (longest
    first), spread round-robin over `devices` (one model copy each), as packed lists."""
    devs = list(dict.fromkeys(devices))  # "cpu:4": one CPU model is as fast
    models = [model.to(devs[0])] + [_copy_to(model, d) for d in devs[1:]]
    order = np.argsort(-ds.lengths, kind="stable")
    parts: List[List[Any]] = [[] for _ in devs]
    with torch.inference_mode():
        for b, s in enumerate(range(0, len(order), batch_size)):
            idx = order[s:s + batch_size]
            d = b % len(devs)
            xs = [ds[int(i)][0].to(devs[d], non_blocking=True) for i in idx]
            parts[d].append((idx, models[d](xs) if len(xs) > 1 else models[d](xs[0])))
            if progress is not None:
                progress(len(idx))
    out = torch.empty(len(ds), models[0].output_dim, dtype=torch.float32)
    for dev_parts in parts:
        for idx, y in dev_parts:
            out[torch.from_numpy(idx)] = y.float().cpu()
    return out


def _copy_to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    import copy
    return copy.deepcopy(model).to(device)


def _metrics(out: torch.Tensor, ds: RaggedDataset) -> Dict[str, Any]:
    res: Dict[str, Any] = {"samples": len(ds), "task": ds.task}
    if ds.task == "classification":
        y = ds.targets
        res["loss"] = float(F.cross_entropy(out, y))
        res["loss_fn"] = "cross_entropy"
        res["accuracy"] = float((out.argmax(1) == y).double().mean())
    else:
        res["loss"] = float(((out - ds.targets) ** 2).mean(1).double().mean())
        res["loss_fn"] = "mse"
    return res


def _atomic_write(path: Path, write: Callable[[Any], None], text: bool, flag: str) -> None:
    try:
        write_atomically(path, write, text=text)
    except OSError as exc:
        raise CLIError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None


def _write_predictions(path: Path, out: torch.Tensor, ds: RaggedDataset, class_names: Optional[List[str]]) -> None:
    fmt = path.suffix.lower().lstrip(".")
    n, width = out.shape
    if ds.task == "classification":
        prob = torch.softmax(out, dim=1).numpy().astype(np.float32)
        cls = out.argmax(1).numpy().astype(np.int64)
        names = [str(c) for c in class_names] if class_names and len(class_names) == width else None
    if fmt == "npy":
        if ds.task == "classification":
            fields = [("class", np.int64), ("prob", np.float32, (width,))]
            if names:
                fields.append(("label", f"U{max(1, max(len(c) for c in names))}"))
            arr = np.zeros(n, dtype=fields)
            arr["class"], arr["prob"] = cls, prob
            if names:
                arr["label"] = np.array(names)[cls]
        else:
            arr = out.numpy().astype(np.float32)
        _atomic_write(path, lambda fh: np.save(fh, arr, allow_pickle=False), False, "--out")
        return

    def write_csv(fh: Any) -> None:
        w = csv.writer(fh)
        if ds.task == "classification":
            w.writerow(["index", "class"] + (["label"] if names else []) + [f"p_{c}" for c in range(width)])
            for i in range(n):
                w.writerow([i, int(cls[i])] + ([names[cls[i]]] if names else []) + [f"{v:.9g}" for v in prob[i]])
        else:
            w.writerow(["index"] + (["prediction"] if width == 1 else [f"prediction_{j}" for j in range(width)]))
            values = out.numpy()
            for i in range(n):
                w.writerow([i] + [f"{v:.9g}" for v in values[i]])

    _atomic_write(path, write_csv, True, "--out")


def predict(args: argparse.Namespace) -> int:
    _check_outputs(args)
    try:
        devices = parse_devices(args.devices)
    except ValueError as exc:
        raise devices_error(args.devices, exc) from None
    try:
        ckpt = read_checkpoint(args.checkpoint, need=MODEL_KEYS)
    except FileNotFoundError:
        raise CLIError(f"--checkpoint {args.checkpoint}: no checkpoint there (expected a checkpoint file, or a run "
                       f"folder holding {CHECKPOINT_NAME})") from None
    except CheckpointError as exc:
        raise CLIError(f"--checkpoint: {exc}") from None
    meta = ckpt["data"]
    ds = _load_data(args, meta)
    if args.metrics and not ds.has_targets:
        raise CLIError(f"--metrics needs targets, and {args.data} has none")
    model = build_model(ckpt["config"], meta)
    model.load_state_dict(ckpt["model"])
    model.eval()
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm.auto import tqdm
        bar = tqdm(total=len(ds), unit="sample", dynamic_ncols=True, file=sys.stderr)
    try:
        out = predict_outputs(model, ds, devices, args.batch_size, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    _write_predictions(Path(args.out), out, ds, meta.get("class_names"))
    print(f"{PROG}: {len(ds)} predictions ({ds.task}) of {args.checkpoint} on {args.data} written to {args.out}",
          file=sys.stderr)
    if args.metrics:
        res = {"checkpoint": str(args.checkpoint), "data": str(args.data), **_metrics(out, ds)}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in res.items()}
        _atomic_write(Path(args.metrics), lambda fh: fh.write(json.dumps(clean, indent=2) + "\n"), True, "--metrics")
        acc = f", accuracy {100 * res['accuracy']:.2f}%" if "accuracy" in res else ""
        print(f"{PROG}: {res['samples']} samples: {res['loss_fn']} loss {res['loss']:.6g}{acc} (in {args.metrics})")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `vlseq-predict` and `python -m vlseq_ext predict`; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        with one_line_warnings(PROG):
            return predict(args)
    except CLIError as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"{PROG}: error: {one_line(exc.with_hint(DATA_HINTS))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted: {args.out} was not written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
