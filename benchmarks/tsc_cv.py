"""How the estimators' defaults were chosen: repeated stratified k-fold cross-validation on the
TRAINING split only of aeon's bundled unequal-length sets (the test splits are never read here).

    python benchmarks/tsc_cv.py --data PickupGestureWiimoteZ --folds 5 --repeats 3 \
        --config base --config 'base,length_feature=False' --out cv.jsonl

Each --config is "base" (SeqClassifier's defaults) followed by comma-separated overrides
name=value (Python literals). Prints and appends one JSON line per config: mean and standard
deviation of the fold accuracies, mean fit seconds and epochs. CPU, one torch thread per process.
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time

import numpy as np
import torch


def parse_config(text: str) -> dict:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or parts[0] != "base":
        raise SystemExit(f"--config {text!r}: start with 'base'")
    out = {}
    for p in parts[1:]:
        name, _, value = p.partition("=")
        try:
            out[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[name.strip()] = value.strip()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--devices", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from aeon.datasets import load_classification
    from sklearn.model_selection import StratifiedKFold

    from vlseq_ext.estimators import SeqClassifier

    X, y = load_classification(args.data, split="train")
    for text in args.config:
        params = parse_config(text)
        accs, secs, epochs = [], [], []
        for r in range(args.repeats):
            folds = StratifiedKFold(args.folds, shuffle=True, random_state=1000 + r).split(np.zeros(len(y)), y)
            for f, (tr, te) in enumerate(folds):
                clf = SeqClassifier(devices=args.devices, random_state=100 * r + f, **params)
                t0 = time.perf_counter()
                clf.fit([X[i] for i in tr], y[tr])
                secs.append(time.perf_counter() - t0)
                epochs.append(statistics.mean(len(h) for h in clf.histories_))
                accs.append(float(np.mean(clf.predict([X[i] for i in te]) == y[te])))
        rec = {"data": args.data, "config": text, "folds": args.folds, "repeats": args.repeats,
               "cv_acc": statistics.mean(accs), "cv_acc_sd": statistics.pstdev(accs),
               "fit_s": statistics.mean(secs), "epochs": statistics.mean(epochs), "accs": accs}
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k != "accs"}),
              flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
