"""TSC suite (`vlseq-bench --suite tsc`): test accuracy and fit time of SeqClassifier with its default
settings against aeon's 1-NN DTW and RDST on aeon's two bundled unequal-length problems, in one run.

Data sets: JapaneseVowels (12 channels, 9 classes, 270 / 370 series of 7-29 steps) and
PickupGestureWiimoteZ (1 channel, 10 classes, 50 / 50 series of 29-361 steps), the official splits.
Methods:
  - vlseq_gpu: SeqClassifier() on the run's GPUs (--devices), one fit per seed 0..4 (1 with --quick);
  - vlseq_cpu: the same on one CPU device (the machine's torch threads);
  - knn_dtw: aeon KNeighborsTimeSeriesClassifier(n_neighbors=1, distance="dtw") (fit stores the data;
    the work is in predict);
  - rdst: aeon RDSTClassifier(random_state=0), one run.
VLSEQ_TSC_METHODS (comma-separated) runs a subset, e.g. to split a GPU host's run into two calls of
under 10 minutes: the GPU and the baselines, then vlseq_cpu (docs/environment.md).
Every fit and predict is timed by the wall clock. Before each method's timed runs, an untimed fit
and predict on two series per class warms it up (numba's compilation of aeon's distances and
shapelets; for SeqClassifier, 1 epoch: the CUDA context, cuDNN, the process's first graph
captures), so the timings are what a fit costs in a running session.

Targets (issue 23): median test accuracy over the seeds >= 0.98 (JapaneseVowels) and >= 0.80
(PickupGestureWiimoteZ) with the defaults, each fit on one GPU under 30 s. Checked on vlseq_gpu
(accuracy also on vlseq_cpu) and written to tsc.targets.

Results (bench-results.json, "tsc"): per data set {n_train, n_test, channels, classes, min_length,
max_length, accuracy.<method>, accuracy_spread.<method>, fit_s.<method>, fit_s_spread.<method>,
predict_s.<method>, predict_s_spread.<method>, runs.<method>: [{seed, accuracy, fit_s, predict_s,
epochs?, best_epochs? (per network)}], devices.<method>, notes.<method>}; targets: {<data set>: {accuracy_target,
fit_s_target, status: "met"|"missed"|"not run", detail}} under
T1 (JapaneseVowels) and T2 (PickupGestureWiimoteZ).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from .. import env
from .results import Results, Skip, Task, fmt
from .timing import Budget

DATASETS = ("JapaneseVowels", "PickupGestureWiimoteZ")
METHODS = ("vlseq_gpu", "vlseq_cpu", "knn_dtw", "rdst")
ACCURACY_TARGETS = {"JapaneseVowels": 0.98, "PickupGestureWiimoteZ": 0.80}
TARGET_IDS = {"JapaneseVowels": "T1", "PickupGestureWiimoteZ": "T2"}  # docs/design.md, "Targets"
FIT_S_TARGET = 30.0
SEEDS = 5
NOTES = {
    "vlseq_gpu": "SeqClassifier() defaults on the run's GPUs; median of the seeds",
    "vlseq_cpu": "SeqClassifier() defaults on one CPU device; median of the seeds",
    "knn_dtw": "aeon 1-NN DTW (full window); fit stores the data, predict does the work",
    "rdst": "aeon RDSTClassifier(random_state=0)",
}


def _have_aeon() -> bool:
    try:
        import aeon.datasets  # noqa: F401
    except ImportError:
        return False
    return True


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    if not _have_aeon():
        res.skip("tsc", "aeon is not installed (pip install 'vlseq_ext[ts]'): the data sets and baselines come with it")
        return [], []
    asked = env.tsc_methods() or list(METHODS)
    unknown = [m for m in asked if m not in METHODS]
    if unknown:
        res.error("tsc", f"VLSEQ_TSC_METHODS: unknown method(s) {', '.join(unknown)} "
                         f"(choose from {', '.join(METHODS)})")
        return [], []
    cuda = devices[0].type == "cuda"
    seeds = list(range(1 if budget.quick else SEEDS))
    gpu_spec = ",".join(str(d) for d in devices)
    out: List[Task] = []
    for name in DATASETS:
        for method in METHODS:
            key = f"tsc.{name}.{method}"
            if method not in asked:
                res.skip(key, "not in VLSEQ_TSC_METHODS")
                continue
            if method == "vlseq_gpu" and not cuda:
                res.skip(key, "no GPU in this run")
                continue

            def run(name: str = name, method: str = method) -> None:
                _run(res, name, method, seeds, gpu_spec)
            out.append(Task("tsc", key, run))
    return out, []


def _load(name: str) -> Dict[str, Any]:
    from aeon.datasets import load_classification
    X, y = load_classification(name, split="train")
    Xt, yt = load_classification(name, split="test")
    lengths = [x.shape[-1] for x in list(X) + list(Xt)]
    return {"X": X, "y": y, "Xt": Xt, "yt": yt,
            "info": {"n_train": len(y), "n_test": len(yt), "channels": int(X[0].shape[0]),
                     "classes": int(len(np.unique(y))), "min_length": min(lengths), "max_length": max(lengths)}}


def _builders(gpu_spec: str) -> Dict[str, Tuple[Callable[[int], Any], str]]:
    from aeon.classification.distance_based import KNeighborsTimeSeriesClassifier
    from aeon.classification.shapelet_based import RDSTClassifier

    from ..estimators import SeqClassifier
    return {
        "vlseq_gpu": (lambda seed: SeqClassifier(devices=gpu_spec, random_state=seed), gpu_spec),
        "vlseq_cpu": (lambda seed: SeqClassifier(devices="cpu", random_state=seed), "cpu"),
        "knn_dtw": (lambda seed: KNeighborsTimeSeriesClassifier(n_neighbors=1, distance="dtw"), "cpu"),
        "rdst": (lambda seed: RDSTClassifier(random_state=seed), "cpu"),
    }


def _run(res: Results, name: str, method: str, seeds: List[int], gpu_spec: str) -> None:
    try:
        data = _load(name)
    except Exception as exc:  # not bundled with this aeon, say
        raise Skip(f"cannot load {name} from aeon's bundled data: {type(exc).__name__}: {exc}") from None
    path = f"tsc.{name}"
    res.node(path).update(data["info"])
    make, where = _builders(gpu_spec)[method]
    ours = method.startswith("vlseq")
    few = np.concatenate([np.flatnonzero(data["y"] == c)[:2] for c in np.unique(data["y"])])
    warm = make(0).set_params(n_epochs=1) if ours else make(0)  # untimed: compilation, the device's first use
    warm.fit([data["X"][i] for i in few], data["y"][few]).predict([data["Xt"][i] for i in range(2)])
    runs = []
    for seed in (seeds if ours else [0]):
        clf = make(seed)
        t0 = time.perf_counter()
        clf.fit(data["X"], data["y"])
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pred = clf.predict(data["Xt"])
        predict_s = time.perf_counter() - t0
        run = {"seed": seed, "accuracy": float(np.mean(pred == data["yt"])), "fit_s": fit_s, "predict_s": predict_s}
        if ours:
            run.update(epochs=[len(h) for h in clf.histories_], best_epochs=clf.best_epochs_)
        runs.append(run)
    for metric in ("accuracy", "fit_s", "predict_s"):
        res.record(f"{path}.{metric}", method, [r[metric] for r in runs])
    res.node(f"{path}.runs")[method] = runs
    res.node(f"{path}.devices")[method] = where
    res.node(f"{path}.notes")[method] = NOTES[method]


def finalize(res: Results) -> None:
    """tsc.targets: each data set's accuracy target on vlseq_gpu (or vlseq_cpu when no GPU ran), and
    every GPU fit under FIT_S_TARGET."""
    tsc = res.data.get("tsc")
    if not tsc:
        return
    targets: Dict[str, Any] = {}
    for name in DATASETS:
        d = tsc.get(name) or {}
        entry: Dict[str, Any] = {"data": name, "accuracy_target": ACCURACY_TARGETS[name], "fit_s_target": FIT_S_TARGET}
        targets[TARGET_IDS[name]] = entry
        acc = d.get("accuracy", {})
        method = "vlseq_gpu" if "vlseq_gpu" in acc else "vlseq_cpu" if "vlseq_cpu" in acc else None
        if method is None:
            entry.update(status="not run", detail="SeqClassifier did not run (see errors/skipped)")
            continue
        ok_acc = acc[method] >= ACCURACY_TARGETS[name]
        detail = (f"{method}: median accuracy {acc[method]:.3f} "
                  f"({'ok' if ok_acc else 'no'}: >= {ACCURACY_TARGETS[name]})")
        if method == "vlseq_gpu":
            slowest = max(r["fit_s"] for r in d["runs"][method])
            ok_fit = slowest < FIT_S_TARGET
            gpus = len(str(d["devices"][method]).split(","))
            on = f"; measured on {gpus} GPUs" if gpus > 1 else ""
            verdict = "ok" if ok_fit else "no"
            detail += f"; slowest fit {slowest:.1f} s ({verdict}: < {FIT_S_TARGET:.0f} s on one GPU{on})"
            entry.update(status="met" if ok_acc and ok_fit else "missed", detail=detail)
        else:
            entry.update(status="not run", detail=detail + "; the fit-time target needs a GPU run")
    tsc["targets"] = targets


def markdown_lines(d: Dict[str, Any]) -> List[str]:
    tsc = d.get("tsc")
    if not tsc:
        return []
    L = ["", "## Time series classification (aeon's bundled unequal-length sets; test accuracy, official splits)", ""]
    header = ["data set", "method", "device", "accuracy", "min–max", "runs", "fit s", "predict s", "note"]
    rows = []
    for name in DATASETS:
        ds = tsc.get(name)
        if not ds or not ds.get("accuracy"):
            continue
        for method, acc in sorted(ds["accuracy"].items(), key=lambda kv: -kv[1]):
            sp = ds["accuracy_spread"][method]
            rows.append([f"{name} ({ds['n_train']}/{ds['n_test']}, {ds['min_length']}–{ds['max_length']} steps)",
                         method, str(ds["devices"].get(method, "")), f"{acc:.3f}", f"{sp['min']:.3f}–{sp['max']:.3f}",
                         str(sp["n"]), fmt(ds["fit_s"][method]), fmt(ds["predict_s"][method]),
                         ds["notes"].get(method, "")])
    L += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    L += ["| " + " | ".join(r) + " |" for r in rows]
    for tid, t in (tsc.get("targets") or {}).items():
        L.append(f"- target {tid} ({t['data']}): **{t['status']}** ({t['detail']})")
    return L
