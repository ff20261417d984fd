"""`vlseq-bench --suite tsc` without its minutes of fits: the suite's recording and targets on tiny
stand-in data (the real estimators and aeon's 1-NN DTW), the target logic on GPU-shaped results,
the suite list, and the skip without aeon."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from vlseq_ext.bench import tsc
from vlseq_ext.bench.__main__ import suite_list
from vlseq_ext.bench.results import Results
from vlseq_ext.bench.timing import Budget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _results() -> Results:
    return Results({"date": "d", "command": "vlseq-bench --suite tsc", "argv": [], "quick": True, "suite": "tsc",
                    "devices": ["cpu"], "device_type": "cpu", "num_devices": 1})


def test_suite_list_names_tsc_only_on_request():
    assert suite_list("tsc") == "tsc" and suite_list("tsc,all") == "all,tsc" and suite_list("all") == "all"
    assert suite_list("merge,tsc") == "merge,tsc"


def test_tsc_suite_records_every_method_and_the_targets(monkeypatch):
    pytest.importorskip("aeon", reason="the tsc suite needs aeon (pip install 'vlseq_ext[ts]')")
    from aeon.classification.distance_based import KNeighborsTimeSeriesClassifier

    from vlseq_ext.estimators import SeqClassifier

    rng = np.random.default_rng(0)

    def fake_load(name):  # two easy ragged classes instead of the bundled sets
        def part(n):
            y = np.array(["a", "b"] * (n // 2))
            X = [rng.standard_normal((2, int(rng.integers(5, 15)))) + (3.0 if c == "b" else 0.0) for c in y]
            return X, y
        (X, y), (Xt, yt) = part(20), part(10)
        return {"X": X, "y": y, "Xt": Xt, "yt": yt, "info": {"n_train": 20, "n_test": 10, "channels": 2, "classes": 2,
                                                           "min_length": 5, "max_length": 14}}

    small = dict(hidden_size=4, n_epochs=3, n_networks=2, devices="cpu")
    builders = {"vlseq_cpu": (lambda seed: SeqClassifier(random_state=seed, **small), "cpu"),
                "knn_dtw": (lambda seed: KNeighborsTimeSeriesClassifier(n_neighbors=1, distance="dtw"), "cpu"),
                "rdst": (lambda seed: KNeighborsTimeSeriesClassifier(n_neighbors=3), "cpu")}
    monkeypatch.setattr(tsc, "_load", fake_load)
    monkeypatch.setattr(tsc, "_builders", lambda spec: builders)
    res = _results()
    tasks, ddp = tsc.tasks([torch.device("cpu")], Budget.make(True), res)
    assert ddp == [] and {t.key for t in tasks} == {f"tsc.{d}.{m}" for d in tsc.DATASETS
                                                    for m in ("vlseq_cpu", "knn_dtw", "rdst")}
    assert res.data["skipped"] == {f"tsc.{d}.vlseq_gpu": "no GPU in this run" for d in tsc.DATASETS}
    for t in tasks:
        t.fn()
    tsc.finalize(res)
    for name in tsc.DATASETS:
        d = res.data["tsc"][name]
        assert set(d["accuracy"]) == {"vlseq_cpu", "knn_dtw", "rdst"} and d["n_train"] == 20
        runs = d["runs"]["vlseq_cpu"]
        assert len(runs) == 1 and runs[0]["seed"] == 0 and len(runs[0]["epochs"]) == 2  # --quick: one seed
        assert d["accuracy"]["vlseq_cpu"] == runs[0]["accuracy"] and 0.0 <= runs[0]["accuracy"] <= 1.0
        assert d["fit_s"]["vlseq_cpu"] > 0 and d["accuracy_spread"]["knn_dtw"]["n"] == 1
        assert d["accuracy"]["knn_dtw"] >= 0.9  # 1-NN on two shifted classes
    t1 = res.data["tsc"]["targets"]["T1"]
    assert t1["status"] == "not run" and "vlseq_cpu: median accuracy" in t1["detail"] and "needs a GPU" in t1["detail"]
    md = "\n".join(tsc.markdown_lines(res.data))
    assert "| knn_dtw |" in md and "target T2 (PickupGestureWiimoteZ): **not run**" in md


def test_tsc_methods_from_the_environment(monkeypatch):
    pytest.importorskip("aeon", reason="the tsc suite needs aeon (pip install 'vlseq_ext[ts]')")
    monkeypatch.setenv("VLSEQ_TSC_METHODS", "knn_dtw, rdst")
    res = _results()
    tasks, _ = tsc.tasks([torch.device("cpu")], Budget.make(True), res)
    assert sorted(t.key for t in tasks) == sorted(f"tsc.{d}.{m}" for d in tsc.DATASETS for m in ("knn_dtw", "rdst"))
    assert res.data["skipped"]["tsc.JapaneseVowels.vlseq_cpu"] == "not in VLSEQ_TSC_METHODS"
    monkeypatch.setenv("VLSEQ_TSC_METHODS", "rdst,dtw")
    res = _results()
    assert tsc.tasks([torch.device("cpu")], Budget.make(True), res) == ([], [])
    assert res.data["errors"]["tsc"] == ("VLSEQ_TSC_METHODS: unknown method(s) dtw (choose from vlseq_gpu, vlseq_cpu, "
                                         "knn_dtw, rdst)")


def test_tsc_targets_on_gpu_shaped_results():
    res = _results()
    for name, acc, fits in (("JapaneseVowels", [0.99, 0.985, 0.97], [12.0, 14.0, 11.0]),
                            ("PickupGestureWiimoteZ", [0.84, 0.82, 0.80], [20.0, 31.0, 25.0])):
        res.record(f"tsc.{name}.accuracy", "vlseq_gpu", acc)
        res.node(f"tsc.{name}.runs")["vlseq_gpu"] = [{"accuracy": a, "fit_s": f} for a, f in zip(acc, fits)]
        res.node(f"tsc.{name}.devices")["vlseq_gpu"] = "cuda:0"
    tsc.finalize(res)
    t = res.data["tsc"]["targets"]
    assert t["T1"]["status"] == "met" and "median accuracy 0.985" in t["T1"]["detail"]
    assert t["T2"]["status"] == "missed" and "slowest fit 31.0 s (no: < 30 s on one GPU)" in t["T2"]["detail"]


def test_tsc_suite_without_aeon_is_skipped_with_the_reason(tmp_path):
    code = ("import sys; sys.modules['aeon'] = None\n"
            "from vlseq_ext.bench.__main__ import main\n"
            f"sys.exit(main(['--suite', 'tsc', '--devices', 'cpu', '--out', {str(tmp_path)!r}]))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads((tmp_path / "bench-results.json").read_text())
    assert d["skipped"]["tsc"].startswith("aeon is not installed") and d["errors"] == {}
