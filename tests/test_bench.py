"""The benchmark suite on CPU: the quick run end to end (subprocess), its JSON schema, the DDP
worker under gloo, and the report/target logic on GPU-shaped results (which CI cannot produce)."""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from vlseq_ext.bench import sweep, sweep_points, sweep_report
from vlseq_ext.bench.__main__ import bench_devices
from vlseq_ext.bench.processes import run_ddp
from vlseq_ext.bench.report import evaluate_targets, schema_problems, write_outputs
from vlseq_ext.bench.results import Results
from vlseq_ext.bench.timing import stats, time_loop

from helpers import once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _have(module: str) -> bool:
    """Whether an optional package imports (the bench subprocesses use this same interpreter)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


HAVE_MPL = _have("matplotlib")
# What a run records as skipped when matplotlib is absent (the plots), and nothing otherwise.
PLOT_SKIPS = {} if HAVE_MPL else {"plots": "matplotlib is not installed"}


def _env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", NCCL_NVLS_ENABLE="0")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _bench(out, *args):
    """Runs `python -m vlseq_ext.bench --out out *args` on CPU; returns (results dict, stdout)."""
    proc = subprocess.run([sys.executable, "-m", "vlseq_ext.bench", *args, "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=1800)  # a hang guard, not a speed check: 40 s alone on a 2-core machine
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "stdout.txt").write_text(proc.stdout)
    with open(out / "bench-results.json") as f:
        return json.load(f), proc.stdout


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory):
    """One quick CPU run for the whole session: its tests may land on several xdist workers."""
    # No sweep guard of the default size: on a loaded machine (xdist workers on a GPU host) it cut points.
    out = once(tmp_path_factory, "bench-quick", lambda folder: _bench(folder, "--quick", "--devices", "cpu:2",
                                                                      "--sweep-deadline", "3600"))
    return out, json.loads((out / "bench-results.json").read_text()), (out / "stdout.txt").read_text()


def test_quick_cpu_run_writes_valid_results(quick_run):
    out, d, stdout = quick_run
    assert schema_problems(d) == []
    assert d["errors"] == {}
    meta = d["meta"]
    assert meta["device_type"] == "cpu" and meta["num_devices"] == 2 and meta["quick"] is True
    assert "--quick" in meta["command"]
    seed = d["merge"]["seed_model"]
    assert seed["numel"] == 26177 and seed["tensors"] == 6
    assert {"seed_style", "reference", "vlseq", "vlseq_unfused", "ddp_gloo"} <= set(seed["us_per_merge"])
    flat = d["merge"]["flat_fp32"]["1MB"]
    assert {"seed_style", "reference", "vlseq", "ddp_gloo"} <= set(flat["algbw_gbps"])
    assert flat["bytes"] == 1 << 20 and "vlseq" in d["merge"]["flat_bf16"]["1MB"]["algbw_gbps"]
    flat = d["flatten"]  # --suite all includes it
    assert set(flat["seed_model"]["us_per_call"]) == {"vlseq", "flatten_dense_tensors", "cat", "vlseq_unflatten"}
    assert flat["many_tensors"]["fraction_of_copy"]["copy"] == pytest.approx(1.0)
    w1 = d["train"]["w1_k1_seed"]
    assert {"one_gpu", "vlseq", "vlseq_1gpu"} <= set(w1["samples_per_s"])
    assert w1["num_devices"]["vlseq"] == 2 and w1["ratios"]["vs_one_gpu"]["one_gpu"] == pytest.approx(1.0)
    # GPU-only parts are skipped with a reason, and the targets say they were not run.
    assert "CUDA" in d["skipped"]["merge.seed_model.cat_nccl"]
    assert "merge.p2p_copy_gbps" in d["skipped"] and "train.w1_k1_seed.seed_style" in d["skipped"]
    assert {t["status"] for t in d["targets"].values()} == {"not run"}
    assert set(d["timings_s"]) >= {"merge", "flatten", "train", "ddp", "total"}
    summary = (out / "summary.md").read_text()
    assert "## Targets" in summary and "not run" in summary and "## Skipped" in summary
    assert "## Fused flatten" in summary
    assert "| vlseq |" in stdout  # the tables are printed too
    if HAVE_MPL:
        assert (out / "merge_time.png").exists() and (out / "train_samples_per_s.png").exists()
    else:
        assert "plots" in d["skipped"]


def test_flatten_suite_on_one_cpu_device(tmp_path):
    d, stdout = _bench(tmp_path, "--quick", "--suite", "flatten", "--devices", "cpu:1")
    assert schema_problems(d) == [] and d["errors"] == {} and d["skipped"] == PLOT_SKIPS  # (the suite needs no plot)
    assert d["meta"]["suite"] == "flatten" and d["merge"] == {} and d["train"] == {}
    f = d["flatten"]
    assert f["device"] == "cpu"
    seed = f["seed_model"]
    assert seed["numel"] == 26177 and seed["tensors"] == 6 and seed["min_calls_per_repeat"] == 500
    assert set(seed["us_per_call"]) == {"vlseq", "flatten_dense_tensors", "cat", "vlseq_unflatten"}
    many = f["many_tensors"]
    assert many["size"] == "16MB" and many["tensors"] == 200 and many["bytes"] == 4 * many["numel"]
    methods = {"vlseq", "vlseq_unflatten", "cat", "foreach_copy", "copy"}
    assert set(many["gbps_rw"]) == set(many["us"]) == set(many["fraction_of_copy"]) == methods
    bw = many["gbps_rw"]
    assert many["fraction_of_copy"]["vlseq"] == pytest.approx(bw["vlseq"] / bw["copy"])
    # GB/s counts every byte read and written: 2 x bytes per call
    assert bw["cat"] == pytest.approx(2 * many["bytes"] / many["us"]["cat"] / 1e3)
    assert d["targets"]["F1"]["status"] == "not run" and "CUDA" in d["targets"]["F1"]["detail"]
    assert set(d["timings_s"]) == {"flatten", "total"}
    summary = (tmp_path / "summary.md").read_text()
    assert "## Fused flatten" in summary and "16MB over 200 fp32 tensors" in summary and "| copy |" in summary
    assert "| vlseq_unflatten |" in stdout


def test_ddp_worker_gloo_survives_a_failing_job():
    timing = {"repeats": 2, "target_s": 0.01, "min_iters": 2}
    late = {"kind": "sweep", "method": "ddp", "form": "one", "spec": {"rnn": "lstm", "hidden": 4, "layers": 1},
            "k": 2, "fused": False, "pool": {"n": 4, "seed": 0, "min_len": 5, "max_len": 9}, "warm_steps": 2,
            "timing": timing}
    jobs = [{"key": "flat", "kind": "merge_flat", "numel": 1000, "dtype": "bfloat16", "timing": timing},
            {"key": "bad", "kind": "no_such_job", "timing": timing},
            {"key": "late", **late, "deadline_s": -1.0},  # past the sweep's deadline: every rank skips it
            {"key": "one_ddp", **late, "deadline_s": 600.0},
            {"key": "seed", "kind": "merge_seed", "timing": timing},
            {"key": "train", "kind": "train", "model": {}, "k": 2, "pool": 4, "timing": dict(timing, min_iters=1)}]
    res = run_ddp(jobs, [torch.device("cpu")] * 2, timeout_s=120)
    assert "no_such_job" in res["bad"]["error"]
    assert "time budget" in res["late"]["skip"]
    for key in ("flat", "seed", "train", "one_ddp"):
        assert "error" not in res[key], res[key]
        assert len(res[key]["times"]) == 2 and all(t > 0 for t in res[key]["times"])
    assert res["train"]["setup_s"] > 0


def test_suite_list():
    import argparse

    from vlseq_ext.bench.__main__ import suite_list
    assert suite_list("all") == "all" and suite_list("merge, all") == "all"
    assert suite_list("sweep,merge,sweep") == "merge,sweep"  # run order, once each
    with pytest.raises(argparse.ArgumentTypeError, match="bogus"):
        suite_list("merge,bogus")


def test_bench_devices_use_the_one_device_parser():
    from vlseq_ext import devices
    from vlseq_ext.bench import __main__ as bench_main
    assert bench_main.parse_devices is devices.parse_devices  # no parser of its own
    assert bench_devices("cpu:2") == [torch.device("cpu")] * 2
    assert bench_devices("cpu") == [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.device_count():
        assert bench_devices(None) == devices.parse_devices(None)
    else:  # the bench's default without GPUs: two CPU "devices", so the multi-device suites run
        assert bench_devices(None) == [torch.device("cpu")] * 2
        with pytest.raises(ValueError, match="cpu"):
            bench_devices("2")
        with pytest.raises(ValueError):
            bench_devices("0,1")


def test_time_loop_and_stats():
    calls = []
    ts = time_loop(lambda: calls.append(1), lambda: None, repeats=5, warmup=2, target_s=0.001, min_iters=10)
    assert len(ts) == 5 and all(t > 0 for t in ts) and len(calls) >= 2 + 5 * 10
    ts = time_loop(lambda: None, lambda: None, repeats=3, warmup=0, iters=7, agree=lambda n: n + 1)
    assert len(ts) == 3
    assert stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}


def _two_gpu_results(suite: str) -> Results:
    """Empty Results with the meta of a `--suite suite` run on 2 x H200."""
    return Results({"date": "d", "command": "vlseq-bench", "argv": [], "quick": False, "suite": suite,
                    "devices": ["cuda:0", "cuda:1"], "device_type": "cuda", "num_devices": 2, "gpu_count": 2,
                    "gpu_names": ["NVIDIA H200"] * 2, "peer_access": [[True, True], [True, True]], "torch": "2.11",
                    "cuda": "13.0", "cudnn": 9, "nccl": "2.27", "driver": "580"})


def _gpu_shaped_results() -> Results:
    r = _two_gpu_results("all")
    r.set("merge.devices", r.data["meta"]["devices"])
    r.set("merge.seed_model", {"numel": 26177, "tensors": 6, "bytes": 104708, "min_merges_per_repeat": 500})
    for name, us in {"seed_style": 248.0, "cat_nccl": 59.0, "vlseq": 12.0, "ddp_nccl": 40.0}.items():
        r.record("merge.seed_model.us_per_merge", name, [us, us * 0.9, us * 1.1])
    for size, nbytes in {"1MB": 1 << 20, "256MB": 256 << 20}.items():
        r.set(f"merge.flat_fp32.{size}.bytes", nbytes)
        for name, gbps in {"cat_nccl": 290.0, "vlseq": 330.0, "vlseq_two_shot": 335.0}.items():
            r.record(f"merge.flat_fp32.{size}.us", name, [nbytes / gbps / 1e3] * 3)
            r.record(f"merge.flat_fp32.{size}.algbw_gbps", name, [gbps, gbps - 1, gbps + 1])
    r.set("merge.p2p_copy_gbps", 381.0)
    r.set("merge.p2p_copy_gbps_spread", stats([380.0, 381.0, 382.0]))
    r.set("merge.p2p_copy_bidir_gbps", 364.0)
    r.set("merge.p2p_copy_bidir_gbps_spread", stats([363.0, 364.0, 365.0]))
    for wl, k, sps in (("w1_k1_seed", 1, {"one_gpu": 467.0, "seed_style": 384.0, "vlseq": 1500.0}),
                       ("w2_k32_seed", 32, {"one_gpu_packed": 1715.0, "vlseq_1gpu": 2000.0, "vlseq": 3900.0})):
        r.set(f"train.{wl}", {"model": {"name": "seed"}, "params": 26177, "k": k, "pool_samples": 64,
                              "num_devices": {}, "notes": {}})
        for name, v in sps.items():
            r.record(f"train.{wl}.samples_per_s", name, [v, v * 0.95, v * 1.05])
            r.node(f"train.{wl}.num_devices")[name] = 1 if name in ("one_gpu", "one_gpu_packed", "vlseq_1gpu") else 2
    r.error("train.w2_k32_seed.ddp_nccl", "RuntimeError: NCCL error")
    r.set("flatten.device", "cuda:0")
    r.set("flatten.seed_model", {"numel": 26177, "tensors": 6, "bytes": 104708, "min_calls_per_repeat": 500})
    for name, us in {"vlseq": 11.4, "flatten_dense_tensors": 17.5, "cat": 24.9, "vlseq_unflatten": 10.0}.items():
        r.record("flatten.seed_model.us_per_call", name, [us, us * 0.9, us * 1.1])
    r.set("flatten.many_tensors", {"size": "256MB", "tensors": 200, "numel": 67108800, "bytes": 268435200})
    for name, gbps in {"copy": 3972.0, "vlseq": 3272.0, "vlseq_unflatten": 3700.0, "cat": 2900.0}.items():
        r.record("flatten.many_tensors.us", name, [2 * 268435200 / gbps / 1e3] * 3)
        r.record("flatten.many_tensors.gbps_rw", name, [gbps, gbps - 1, gbps + 1])
    return r


def test_targets_and_report_on_gpu_shaped_results(tmp_path):
    from vlseq_ext.bench import flatten
    from vlseq_ext.bench.train import add_ratios
    r = _gpu_shaped_results()
    add_ratios(r, cuda=True)
    t = evaluate_targets(r)
    assert t["M1"]["status"] == "met" and t["M1"]["ratio"] == pytest.approx(248 / 12)
    assert t["M2"]["status"] == "missed"  # 330/381 = 87% < 90%
    assert t["M2"]["checks"]["x_cat_nccl"]["ok"] and not t["M2"]["checks"]["fraction_of_p2p_copy"]["ok"]
    assert t["M2"]["best_variant"]["method"] == "vlseq_two_shot"  # reported beside the default's status
    assert t["M2"]["fraction_of_bidir_copy"] == pytest.approx(330 / 364) and "bidirectional ceiling" in t["M2"]["detail"]
    assert "W3" not in t  # no sweep in these results
    assert t["W1"]["status"] == "met" and not t["W1"]["checks"]["goal"]["ok"]
    assert t["W2"]["status"] == "not run" and "ddp_nccl" in t["W2"]["detail"]
    assert t["F1"]["status"] == "missed" and t["F1"]["ratio"] == pytest.approx(3272 / 3972)  # 82% < 85%
    assert "best_variant" not in t["F1"]  # the faster unflatten is another op, not a flatten variant
    assert "target is for" not in t["F1"]["detail"]  # one-GPU target, measured on the first of the 2
    flatten.add_fractions(r)
    md = write_outputs(r, str(tmp_path), log=lambda s: None)
    d = json.loads((tmp_path / "bench-results.json").read_text())
    assert schema_problems(d) == []
    assert d["train"]["w1_k1_seed"]["ratios"]["vs_one_gpu"]["vlseq"] == pytest.approx(1500 / 467)
    assert "**met**" in md and "**missed**" in md and "381" in md and "NCCL error" in md
    assert d["flatten"]["many_tensors"]["fraction_of_copy"]["vlseq"] == pytest.approx(3272 / 3972)
    assert "## Fused flatten (cuda:0" in md and "| vlseq | 3,272 |" in md and "82.4%" in md
    r.record("flatten.many_tensors.gbps_rw", "vlseq", [3500.0])  # 88%
    assert evaluate_targets(r)["F1"]["status"] == "met"


def test_schema_problems_are_reported():
    r = _gpu_shaped_results()
    d = json.loads(json.dumps(r.data))
    d["merge"]["seed_model"]["us_per_merge"]["vlseq"] = -1
    del d["train"]["w1_k1_seed"]["samples_per_s_spread"]["vlseq"]
    d["flatten"]["seed_model"]["us_per_call"]["cat"] = "fast"
    d["flatten"]["many_tensors"]["size"] = "3MB"
    d["flatten"]["many_tensors"]["fraction_of_copy"] = {"vlseq": 0.8, "not_measured": 1.0}
    problems = schema_problems(d)
    assert any("us_per_merge.vlseq" in p for p in problems)
    assert any("samples_per_s_spread.vlseq" in p for p in problems)
    assert any("us_per_call.cat" in p for p in problems)
    assert any("many_tensors.size" in p for p in problems)
    assert any("fraction_of_copy" in p for p in problems)
    assert schema_problems({}) != []


def test_every_training_loop_runs_with_cpu_stand_ins(monkeypatch):
    """The GPU-only loops (seed-style replicate, DataParallel, trainer variants) cannot run in CI;
    run their Python paths with CPU stand-ins for replicate/parallel_apply so a typo cannot wait
    for the GPU run to show up."""
    import copy

    from torch.nn import parallel

    from vlseq_ext.bench import baselines, train
    from vlseq_ext.bench.timing import Budget

    monkeypatch.setattr(baselines, "_need_gpus", lambda devices, what: None)
    # nn.DataParallel wraps a CPU model only when it sees no CUDA (it then just calls the module);
    # with CUDA visible it insists on GPU device ids. Hide CUDA from it, so the loop runs here as
    # it does on a machine without GPUs.
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.data_parallel"), "_get_available_device_type",
                        lambda: None)
    monkeypatch.setattr(parallel, "replicate", lambda model, ids: [copy.deepcopy(model) for _ in ids])
    monkeypatch.setattr(parallel, "parallel_apply",
                        lambda mods, inputs, devices=None: [m(*i) for m, i in zip(mods, inputs)])
    res = Results({})
    budget = Budget(True, 2, 2, 0.01, 0.01, 0.01)
    pool = baselines.make_pool(16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the bench does on CPU: tiny ops, no OpenMP overhead
    try:
        for name in baselines.BUILDERS:
            res.set("train.x", {"num_devices": {}, "notes": {}})
            train._run_method(res, "train.x", name, {"hidden_dim": 8}, 4, [torch.device("cpu")] * 2, pool, budget)
            assert res.get("train.x.samples_per_s")[name] > 0, name
    finally:
        torch.set_num_threads(threads)


def test_gpu_plan_has_every_method_and_target_input():
    """What a 2-GPU run would measure (planning only: nothing touches a GPU)."""
    from vlseq_ext import ops
    from vlseq_ext.bench import flatten, merge, train
    from vlseq_ext.bench.timing import Budget

    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    res = Results({})
    m_tasks, m_jobs = merge.tasks(devs, Budget.make(False), res)
    t_tasks, t_jobs = train.tasks(devs, Budget.make(False), res)
    f_tasks, f_jobs = flatten.tasks(devs, Budget.make(False), res)
    assert f_jobs == [] and res.get("flatten.device") == "cuda:0" and res.get("flatten.many_tensors.size") == "256MB"
    keys = {t.key for t in m_tasks + t_tasks + f_tasks} | {j["key"] for j, _ in m_jobs + t_jobs}
    ours = {"merge.seed_model.vlseq", "merge.flat_fp32.256MB.vlseq", "flatten.seed_model.vlseq",
            "flatten.many_tensors.vlseq", "flatten.many_tensors.vlseq_unflatten"} if ops.has_cuda_kernels() else set()
    assert ours | {"merge.seed_model.seed_style", "merge.seed_model.reduce_add_coalesced", "merge.seed_model.cat_nccl",
                   "merge.seed_model.ddp_nccl", "merge.flat_fp32.256MB.cat_nccl", "merge.flat_bf16.1MB.ddp_nccl",
                   "merge.p2p_copy_gbps", "merge.p2p_copy_bidir_gbps", "train.w1_k1_seed.one_gpu", "train.w1_k1_seed.seed_style",
                   "train.w1_k1_seed.vlseq", "train.w2_k32_seed.vlseq_1gpu", "train.w2_k32_seed.ddp_nccl",
                   "train.w2_k32_seed.data_parallel", "train.w2_k32_large.one_gpu_packed",
                   "flatten.seed_model.cat", "flatten.seed_model.flatten_dense_tensors", "flatten.many_tensors.copy",
                   "flatten.many_tensors.cat", "flatten.many_tensors.foreach_copy"} <= keys
    skipped = dict(res.data["skipped"])
    if not ops.has_cuda_kernels():  # a CPU-only build: our kernels' methods are planned, and skipped by name
        ours = {k for k, why in skipped.items() if why == "the extension was built without CUDA kernels"}
        assert ours and all(k.rsplit(".", 1)[1].startswith("vlseq") for k in ours)
        assert {"merge.seed_model.vlseq", "merge.flat_fp32.256MB.vlseq", "flatten.many_tensors.vlseq"} <= ours
        skipped = {k: why for k, why in skipped.items() if k not in ours}
    assert set(skipped) == {f"train.{w}.{m}" for w in ("w1_k1_large", "w2_k32_large")
                            for m in train.VARIANTS if m != "vlseq_eager" or w.startswith("w1")}


# ------------------------------------------------------------------------------------------------
# the sweep (target W3) and the diagnostics suite
SWEEP_METHODS = {"vlseq", "vlseq_1gpu", "vlseq_mp", "ddp_gloo", "one_gpu_packed", "one_gpu", "one_gpu_best"}


def test_quick_cpu_run_sweeps_every_point_and_method(quick_run):
    out, d, stdout = quick_run
    plan = sweep_points.plan_for(cuda=False, quick=True)
    points = d["train"]["sweep"]
    assert set(points) == {sweep_points.point_name(f, m, k) for m in plan.models for k in plan.ks for f in sweep_points.FORMS}
    assert len(points) == 12 and "list_lstm_h16_l2_k4" in points and "one_bigru_h8_l2_k1" in points
    assert not [k for k in d["errors"] if k.startswith("train.sweep")], d["errors"]
    assert "gloo" in d["skipped"]["train.sweep.ddp_nccl"]  # the methods that do not run on CPU, and why
    assert "torch's RNN already" in d["skipped"]["train.sweep.one_gpu_cudnn"]
    for name, p in points.items():
        sps = p["samples_per_s"]
        assert set(sps) == set(p["setup_s"]) == SWEEP_METHODS, name
        assert all(v > 0 for v in list(sps.values()) + list(p["setup_s"].values())), name
        assert sps["one_gpu_best"] == max(sps["one_gpu_packed"], sps["one_gpu"])  # (no cuDNN loop on a CPU)
        assert p["num_devices"]["vlseq"] == p["num_devices"]["vlseq_mp"] == 2 and p["num_devices"]["vlseq_1gpu"] == 1
        r = p["ratio"]
        assert set(r) == {"vs_ddp", "vs_1gpu", "vs_one_gpu_best", "vs_best", "vs_mp", "1gpu_vs_one_gpu_best"}
        assert r["1gpu_vs_one_gpu_best"] == pytest.approx(sps["vlseq_1gpu"] / sps["one_gpu_best"])
        assert r["vs_best"] == pytest.approx(sps["vlseq"] / max(sps["ddp_gloo"], sps["one_gpu_best"]))
        assert r["vs_ddp"] == pytest.approx(sps["vlseq"] / sps["ddp_gloo"])
        checks = p["target"]["checks"]
        assert set(checks) == {"vs_ddp", "vs_1gpu", "vs_one_gpu_best"}
        assert checks["vs_1gpu"]["threshold"] == 1.8 and checks["vs_ddp"]["threshold"] == 1.3
        assert p["target"]["status"] == ("met" if all(c["ok"] for c in checks.values()) else "missed")
    for m in plan.models:  # the one-GPU loops are measured once per model and k, for both forms
        for k in plan.ks:
            a, b = (points[sweep_points.point_name(f, m, k)]["samples_per_s"] for f in sweep_points.FORMS)
            assert a["one_gpu"] == b["one_gpu"] and a["one_gpu_packed"] == b["one_gpu_packed"]
    info = d["train"]["sweep_info"]
    assert info["ddp_method"] == "ddp_gloo" and set(info["optimizer"].values()) == {"Adam(lr=1e-3)"}
    assert d["targets"]["W3"]["status"] == "not run" and "12 points" in d["targets"]["W3"]["detail"]
    assert d["timings_s"]["sweep"] > 0
    summary = (out / "summary.md").read_text()
    assert "## Training sweep" in summary and "| list_lstm_h8_l1_k1 |" in summary and "| LSTM h8 l1 | one |" in summary


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed: the heat map is not drawn")
def test_quick_cpu_run_draws_the_sweep_heat_map(quick_run):
    out, d, _ = quick_run
    assert (out / sweep_report.PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({sweep_report.PLOT_FILE})" in (out / "summary.md").read_text()


def test_quick_cpu_run_diagnostics(quick_run):
    out, d, _ = quick_run
    diag = d["diag"]
    assert set(diag["step_options"]["us_per_step"]) == {"master_step_broadcast", "replicated_step"}
    assert {"empty_loop", "tiny_op", "dispatcher_round_trip"} <= set(diag["host"]["us_per_call"])
    assert set(diag["trainer_phases"]) == {"k1", "k4"}
    for p in diag["trainer_phases"].values():
        assert p["wall_us_per_step"] > 0 and p["steps"] >= 1
    for key in ("diag.kernels", "diag.crossover", "diag.host.launch"):
        assert key in d["skipped"]
    assert not [k for k in d["errors"] if k.startswith("diag")], d["errors"]
    assert "## Diagnostics: merge + optimizer + sync per step" in (out / "summary.md").read_text()
    assert "GPUs only" in d["skipped"]["diag.limits"]


def test_sweep_and_diag_gpu_plans():
    """What a 2-GPU run would measure (planning only: nothing touches a GPU)."""
    from vlseq_ext import ops
    from vlseq_ext.bench import diag
    from vlseq_ext.bench.timing import Budget

    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    for quick, n_points in ((False, 42), (True, 12)):
        res = Results({})
        tasks, jobs = sweep.tasks(devs, Budget.make(quick), res)
        points = res.get("train.sweep")
        assert len(points) == n_points and res.data["skipped"] == {}
        keys = {t.key for t in tasks} | {j["key"] for j, _ in jobs}
        for name in points:
            assert {f"train.sweep.{name}.{m}" for m in ("vlseq", "vlseq_1gpu", "vlseq_mp", "ddp_nccl")} <= keys
        assert sum(k.endswith(".one_gpu_packed") for k in keys) == sum(k.endswith(".one_gpu") for k in keys) \
            == sum(k.endswith(".one_gpu_cudnn") for k in keys) == n_points // 2  # once per model and k
        assert all(k.startswith("train.sweep.list_") for k in keys if k.endswith(".one_gpu_cudnn"))
        assert len(jobs) == 2 * n_points and all(j["fused"] and j["kind"] == "sweep" for j, _ in jobs)
        opt = res.get("train.sweep_info.optimizer")
        assert {m: opt[m] for m in ("vlseq", "vlseq_1gpu", "vlseq_mp", "ddp_nccl")} == dict.fromkeys(
            ("vlseq", "vlseq_1gpu", "vlseq_mp", "ddp_nccl"), "Adam(lr=1e-3, fused=True)")
        assert opt["one_gpu"] == opt["one_gpu_packed"] == opt["one_gpu_cudnn"] == (
            "Adam(lr=1e-3, fused=True)" if sweep.ONE_GPU_LOOPS_FUSED
                                                            else "Adam(lr=1e-3)")
        budget = Budget.make(quick)
        assert sum(j["timeout_s"] for j, _ in jobs) == pytest.approx(budget.sweep_mp_deadline_s + 10 * len(jobs))
    res = Results({})
    sweep.tasks(devs, Budget.make(False), res)
    assert {"list_lstm_h256_l2_k32", "one_lstm_h1024_l2_k8", "one_bigru_h256_l2_k1"} <= set(res.get("train.sweep"))
    assert res.get("train.sweep.one_bigru_h256_l2_k1.params") == sum(
        p.numel() for p in sweep_points.make_model(sweep_points.ModelSpec("bigru", 256, 2), "one").parameters())

    res = Results({})
    tasks, jobs = diag.tasks(devs, Budget.make(False), res)
    keys = {t.key for t in tasks}
    assert jobs == [] and {"diag.step_options.master_step_broadcast", "diag.step_options.replicated_step",
                           "diag.host.launch", "diag.trainer_phases.k1", "diag.trainer_phases.k32"} <= keys
    if ops.has_cuda_kernels():
        assert {"diag.kernels.flatten_256MB_200", "diag.kernels.unflatten_256MB_200", "diag.kernels.copy_256MB",
                "diag.kernels.merge_seed", "diag.kernels.two_shot_256MB", "diag.crossover.1MB.nccl",
                "diag.crossover.64KB.vlseq"} <= keys
    else:
        assert "CUDA kernels" in res.data["skipped"]["diag.kernels"]
    assert {"diag.limits.list_bigru_h256_l2_k32", "diag.limits.one_lstm_h1024_l1_k32", "diag.limits.list_lstm_h1024_l1_k32",
            "diag.limits.launch_ceiling.streams1", "diag.limits.launch_ceiling.streams8",
            "diag.limits.batch_scaling.lstm_h1024_l1.B128", "diag.limits.launch_threads.threads4"} <= keys


def test_limits_union_of_kernel_intervals_and_table():
    from vlseq_ext.bench import limits
    # overlapping, nested, touching and disjoint intervals, unsorted
    assert limits._union_us([(5, 7), (0, 2), (1, 3), (1.5, 2.5), (3, 4), (10, 11)]) == pytest.approx(7.0)
    assert limits._union_us([]) == 0.0
    table = limits.markdown_lines({
        "one_lstm_h256_l2_k32": {"plan": "per_sample", "wall_us_per_step": 80_000.0, "kernels_per_step": 80_000.0,
                                 "busy_us_per_step": 150_000.0, "active_us_per_step": 70_000.0,
                                 "kernels_in_flight": 2.14, "active_share_of_wall": 0.875, "kernels_per_s": 1e6,
                                 "span_us_per_step": 75_000.0, "active_share_of_span": 0.933,
                                 "mean_kernel_us": 1.9, "top_kernels": [
                                     {"name": "RNN_blockPersist_fp", "per_step": 40_000.0, "mean_us": 20.0,
                                      "share_of_busy": 0.64}],
                                 "graph_launches_per_step": 32.0, "host_us_per_graph_launch": 2500.0,
                                 "host_launch_share_of_wall": 0.98},
        "list_lstm_h1024_l1_k32": {"plan": "padded", "wall_us_per_step": 18_000.0, "kernels_per_step": 3000.0,
                                   "busy_us_per_step": 17_000.0, "active_us_per_step": 17_000.0,
                                   "kernels_in_flight": 1.0, "active_share_of_wall": 0.94, "kernels_per_s": 1.6e5,
                                   "mean_kernel_us": 5.7, "padding_share": 0.41},
        "batch_scaling": {"lstm_h1024_l1": {"B1": 20_000.0, "B32": 21_000.0}},
        "launch_threads": {"threads1": 400.0, "threads4": 1100.0},
        "launch_ceiling": {"streams1": 4e5, "streams4": 1.2e6}})
    text = "\n".join(table)
    assert "| one_lstm_h256_l2_k32 | per_sample | 80,000 | 80,000 | 150,000 | 70,000 | 88% | 93% | 2.14 |" in text
    assert "| list_lstm_h1024_l1_k32 | padded | 18,000 | 3,000 | 17,000 | 17,000 | 94% | - | 1 |" in text
    assert "| 41% |" in text and "| 1.9 | - |" in text
    assert "1 stream(s) 400,000, 4 stream(s) 1,200,000" in text
    assert "- one_lstm_h256_l2_k32, host: 32.0 graph launches per step, 2,500 µs each, 98% of the wall" in text
    assert "- one_lstm_h256_l2_k32, most busy time: `RNN_blockPersist_fp` 40,000/step × 20.0 µs (64%)" in text
    assert "- lstm_h1024_l1, every sample 480 steps, µs per step by samples per step: B=1 20,000, B=32 21,000" in text
    assert "samples/s by issuing host threads: 1 thread(s) 400, 4 thread(s) 1,100" in text
    assert limits.markdown_lines({}) == []
    only_threads = "\n".join(limits.markdown_lines({"launch_threads": {"threads1": 400.0}}))
    assert "| point |" not in only_threads and "1 thread(s) 400" in only_threads


def test_one_sample_model_is_seq_model_that_takes_one_sample():
    x = torch.randn(7, 36)
    for spec in (sweep_points.ModelSpec("lstm", 8, 2), sweep_points.ModelSpec("bigru", 8, 2)):
        a, b = sweep_points.make_model(spec, "list"), sweep_points.make_model(spec, "one")
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        assert list(pa) == list(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)  # same layout, same weights
        torch.testing.assert_close(b(x), a(x))
        with pytest.raises(AttributeError):  # a list of samples: no unsqueeze
            b([x, x])


def _sweep_results() -> Results:
    r = _two_gpu_results("sweep")
    r.set("train.sweep_info", {"devices": r.data["meta"]["devices"], "ddp_method": "ddp_nccl", "pool_samples": 16,
                               "lengths": [50, 500], "optimizer": {"vlseq": "Adam(lr=1e-3, fused=True)"}})
    for name, form, k, sps in (
            ("list_lstm_h64_l1_k1", "list", 1, {"vlseq": 4000.0, "vlseq_1gpu": 2000.0, "vlseq_mp": 3000.0,
                                                "ddp_nccl": 900.0, "one_gpu_packed": 400.0, "one_gpu": 450.0}),
            ("one_lstm_h64_l1_k1", "one", 1, {"vlseq": 3000.0, "vlseq_1gpu": 2000.0, "ddp_nccl": 900.0,
                                              "one_gpu_packed": 400.0, "one_gpu": 450.0}),
            ("list_lstm_h64_l1_k32", "list", 32, {"vlseq": 5000.0, "vlseq_1gpu": 2500.0, "one_gpu_packed": 1500.0,
                                                  "one_gpu_cudnn": 1250.0, "one_gpu": 1000.0})):
        r.set(f"train.sweep.{name}", {"form": form, "rnn": "lstm", "hidden": 64, "layers": 1, "k": k, "params": 26177,
                                      "pool_samples": 16, "num_devices": {}, "notes": {}, "setup_s": {"vlseq": 1.5}})
        for m, v in sps.items():
            r.record(f"train.sweep.{name}.samples_per_s", m, [v, v * 0.9, v * 1.1])
    return r


def test_sweep_ratios_marks_and_report_on_gpu_shaped_results(tmp_path):
    r = _sweep_results()
    sweep_report.finalize(r)
    met, missed, partial = (r.get(f"train.sweep.{n}") for n in
                            ("list_lstm_h64_l1_k1", "one_lstm_h64_l1_k1", "list_lstm_h64_l1_k32"))
    assert met["samples_per_s"]["one_gpu_best"] == 450 and met["one_gpu_best_method"] == "one_gpu"
    assert met["samples_per_s_spread"]["one_gpu_best"]["min"] == pytest.approx(405)
    assert met["ratio"]["vs_best"] == pytest.approx(4000 / 900) and met["ratio"]["vs_mp"] == pytest.approx(4 / 3)
    assert met["target"]["status"] == "met"
    assert missed["target"]["status"] == "missed" and not missed["target"]["checks"]["vs_1gpu"]["ok"]  # 1.5 < 1.8
    assert partial["target"]["status"] == "incomplete" and partial["one_gpu_best_method"] == "one_gpu_packed"
    assert "vs_best" not in partial["ratio"] and partial["ratio"]["vs_one_gpu_best"] == pytest.approx(5000 / 1500)
    assert partial["ratio"]["vs_cudnn_loop"] == pytest.approx(5000 / 1250)  # the loop users write with nn.LSTM
    assert partial["ratio"]["1gpu_vs_cudnn_loop"] == pytest.approx(2) and "vs_cudnn_loop" not in met["ratio"]
    t = evaluate_targets(r)["W3"]
    assert t["status"] == "missed" and t["ratio"] == pytest.approx(3000 / 900)
    assert "1 of 3 points met, 1 incomplete" in t["detail"] and "missed: one_lstm_h64_l1_k1" in t["detail"]
    md = write_outputs(r, str(tmp_path), log=lambda s: None)
    assert schema_problems(json.loads((tmp_path / "bench-results.json").read_text())) == []
    assert "## Training sweep" in md and "| LSTM h64 l1 | list | 4.44 met | incomplete |" in md
    assert "| one_lstm_h64_l1_k1 | 3,000 | 2,000 | - | 900 | 450 (per-sample) |" in md
    assert "| list_lstm_h64_l1_k32 | 5,000 | 2,500 | - | - | 1,500 (packed) | 1,250 |" in md
    if HAVE_MPL:
        assert (tmp_path / sweep_report.PLOT_FILE).exists()
    d = json.loads((tmp_path / "bench-results.json").read_text())
    d["train"]["sweep"]["one_lstm_h64_l1_k1"]["target"]["status"] = "fine"
    d["train"]["sweep"]["one_lstm_h64_l1_k1"]["ratio"]["vs_ddp"] = -1
    problems = schema_problems(d)
    assert any("target.status" in p for p in problems) and any("one_lstm_h64_l1_k1.ratio" in p for p in problems)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_profiler_kernel_events_leave_out_record_function_ranges(device):
    """The GPU-side copy of a record_function range spans a whole phase: counted as a kernel it
    would double the busy time (and fill the gaps between kernels)."""
    from torch.profiler import ProfilerActivity, profile

    from vlseq_ext.bench.timing import is_kernel
    x = torch.ones(1 << 20, device=device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        with torch.profiler.record_function("vlseq::test_range"):
            for _ in range(3):
                x.add_(1)
        if device == "cuda":
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if is_kernel(e)]
    assert not any("vlseq::test_range" in e.name for e in kernels)
    assert len(kernels) == (3 if device == "cuda" else 0)
    if device == "cuda":  # the range is there on the GPU side too: the filter is what leaves it out
        assert any(e.name == "vlseq::test_range" and e.device_type.name == "CUDA" for e in prof.events())


def test_only_runs_the_chosen_measurements(tmp_path):
    d, _ = _bench(tmp_path / "a", "--quick", "--devices", "cpu:2", "--suite", "diag", "--only", "diag.host")
    assert set(d["diag"]) == {"host"} and d["errors"] == {}
    proc = subprocess.run([sys.executable, "-m", "vlseq_ext.bench", "--suite", "diag", "--only", "train.",
                           "--out", str(tmp_path / "b")], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0 and "no measurement of suite diag starts with that" in proc.stderr


def _rnn_point(r: Results, name: str, auto, cudnn_ms: float, ours_ms: float) -> None:
    """A measured rnn-suite point: forward + backward medians, and what `auto` runs there (None: not asked)."""
    from dataclasses import asdict

    from vlseq_ext.bench import rnn
    r.set(f"rnn.points.{name}.config", asdict(next(p for p in rnn.POINTS if p.name == name)))
    if auto is not None:
        r.set(f"rnn.points.{name}.auto", auto)
    r.record(f"rnn.points.{name}.fwdbwd_ms", "cudnn", [cudnn_ms])
    r.record(f"rnn.points.{name}.fwdbwd_ms", "vlseq", [ours_ms])


def test_rnn_report_holds_auto_against_the_measured_ratio_and_judges_targets():
    from vlseq_ext.bench import rnn
    r = _two_gpu_results("rnn")
    _rnn_point(r, "lstm64_b1", "cudnn", 0.575, 0.701)     # ours 0.82x, cuDNN kept: "never slower" met by auto
    _rnn_point(r, "lstm64_b32", "cudnn", 0.692, 0.688)    # parity: no verdict against keeping cuDNN
    _rnn_point(r, "lstm128_b1", "vlseq", 1.74, 0.826)     # ours 2.1x, run: met
    _rnn_point(r, "lstm256x2_b1", "cudnn", 5.58, 1.36)    # a rule that kept cuDNN where ours measured 4.1x
    _rnn_point(r, "gru128_b32", "vlseq", 1.0, 1.2)        # ours run where it measured slower (0.83x)
    _rnn_point(r, "lstm1024_b32", "cudnn", 32.7, 17.0)    # 1.92x under a target of 2: auto cannot meet that
    _rnn_point(r, "lstm256x2_b8", None, 8.86, 2.27)       # no target, auto not recorded
    rnn.finalize(r)
    pts = r.get("rnn.points")
    status = {name: node.get("target", {}).get("status") for name, node in pts.items()}
    assert status == {"lstm64_b1": "met under auto (cuDNN kept)", "lstm64_b32": "met", "lstm128_b1": "met",
                      "lstm256x2_b1": "met", "gru128_b32": "missed", "lstm1024_b32": "missed", "lstm256x2_b8": None}
    picked = {name: node.get("auto_check", {}).get("picked") for name, node in pts.items()}
    assert picked == {"lstm64_b1": "the faster or at parity", "lstm64_b32": "the faster or at parity",
                      "lstm128_b1": "the faster or at parity", "lstm256x2_b1": "the slower",
                      "gru128_b32": "the slower", "lstm1024_b32": "the slower", "lstm256x2_b8": None}
    assert pts["lstm64_b1"]["auto_check"]["ratio"] == 1.0 and pts["lstm128_b1"]["auto_check"]["ratio"] > 2
    rows = {line.split(" | ")[0].lstrip("| "): line for line in rnn.markdown_lines(r.data) if line.startswith("| ")}
    assert "| cuDNN | ≥ 1: met under auto (cuDNN kept) |" in rows["lstm64_b1"]
    assert "| cuDNN (**the slower**) | ≥ 3: met |" in rows["lstm256x2_b1"]
    assert "| ours (**the slower**) | ≥ 1: missed |" in rows["gru128_b32"]
    assert "| ours | ≥ 1: met |" in rows["lstm128_b1"]
    assert rows["lstm256x2_b8"].count("|  |") == 2  # neither auto nor a target to show


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_rnn_suite_asks_auto_what_it_runs(device):
    """What the rnn suite records as `auto`'s choice is the modules' own: cuDNN on the CPU (no kernels
    there) and, on a GPU with the kernels, cuDNN only for unpadded hidden 64."""
    from vlseq_ext import ops
    from vlseq_ext.bench import rnn
    point = {p.name: p for p in rnn.POINTS}
    names = ("lstm64_b1", "lstm64_b32_var", "lstm256x2_b1", "gru256x2bi_b32", "lstm1024_b32_bf16")
    runs = {name: rnn._auto_runs(point[name], torch.device(device)) for name in names}
    if device == "cpu" or not ops.has_rnn_kernels():
        assert set(runs.values()) == {"cudnn"}
    else:
        assert runs == {"lstm64_b1": "cudnn", "lstm64_b32_var": "vlseq", "lstm256x2_b1": "vlseq",
                        "gru256x2bi_b32": "vlseq", "lstm1024_b32_bf16": "vlseq"}
