"""Command line of the benchmark suite: `python -m vlseq_ext.bench` / `vlseq-bench`."""
from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from .. import env
from ..devices import parse_devices
from . import diag, flatten, merge, rnn, sweep, sweep_report, train, tsc
from .processes import run_ddp
from .report import collect_meta, write_outputs
from .results import Results, Skip, Task
from .timing import Budget

TASK_STALL_S = 180  # print every thread's stack when one task runs longer than this


SUITES = ("merge", "flatten", "diag", "train", "sweep", "rnn", "tsc")
# "all": the performance suites. tsc (accuracy against aeon's classifiers; needs aeon, and minutes of
# fits) runs only when named, so "all" keeps its duration.
ALL = ("merge", "flatten", "diag", "train", "sweep", "rnn")


def suite_list(spec: str) -> str:
    """--suite: "all", or suites separated by commas ("merge,flatten,diag,train"); normalised."""
    parts = [p.strip().lower() for p in spec.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("no suite given")
    bad = [p for p in parts if p not in SUITES + ("all",)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown suite(s) {', '.join(bad)} (choose from {', '.join(SUITES)}, all)")
    if "all" in parts:
        return ",".join(["all"] + [s for s in SUITES if s in parts and s not in ALL])
    return ",".join(s for s in SUITES if s in parts)  # in run order, once each


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def bench_devices(spec: Optional[str]) -> List[torch.device]:
    """--devices, parsed by vlseq_ext.devices.parse_devices (the one device parser). Without the
    option: every visible GPU, and on a machine without GPUs two CPU "devices" ("cpu:2"), so the
    multi-device suites still run their CPU versions."""
    if spec is None and not (torch.cuda.is_available() and torch.cuda.device_count()):
        spec = "cpu:2"
    return parse_devices(spec)


def _run_task(task: Task, res: Results, cuda: bool) -> None:
    """Runs one method, recording a skip or an error instead of raising."""
    if task.section != "ddp":  # (the DDP processes have their own timeout)
        faulthandler.dump_traceback_later(TASK_STALL_S)  # a hung task at least says where it hangs
    try:
        task.fn()
    except Skip as exc:
        res.skip(task.key, str(exc))
    except Exception as exc:  # one failing method never costs the rest of the run
        res.error(task.key, exc)
        tqdm.write(f"error in {task.key}: {type(exc).__name__}: {exc}")
        traceback.print_exc(file=sys.stderr)
    finally:
        faulthandler.cancel_dump_traceback_later()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _run_ddp_jobs(ddp_jobs: List[tuple], devices: List[torch.device], res: Results, timeout_s: float) -> None:
    """All jobs of the run's worker processes (DDP, and our trainer one process per device) in one
    spawn: process start and NCCL init are paid once."""
    try:
        results = run_ddp([job for job, _ in ddp_jobs], devices, timeout_s=timeout_s)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        for job, _ in ddp_jobs:
            res.error(job["key"], exc)
        return
    for job, on_result in ddp_jobs:
        r = results[job["key"]]
        if "error" in r:
            res.error(job["key"], r["error"])
            tqdm.write(f"error in {job['key']}: {r['error']}")
        elif "skip" in r:
            res.skip(job["key"], r["skip"])
        else:
            on_result(r)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vlseq-bench",
        description="Benchmarks vlseq_ext's gradient merge, fused flatten and trainer (also over a sweep of model "
                    "sizes, samples per GPU and model forms) against the seed loop, PyTorch's built-ins, NCCL and "
                    "DDP on the devices it finds. Prints the tables; writes bench-results.json, summary.md and plots "
                    "to --out. Without GPUs it runs the CPU versions and lists what it skipped. On 2 GPUs the full "
                    "run takes about 10 minutes (the sweep about 6): split it with --suite where one command may "
                    "not run that long.")
    ap.add_argument("--quick", action="store_true",
                    help="a short run: fewer repeats, the seed model only in the train suite, a subset of the "
                         "sweep (under 3 minutes for --suite sweep on 2 GPUs)")
    ap.add_argument("--suite", type=suite_list, default="all", metavar="SUITE[,SUITE...]",
                    help="one or more of (comma-separated): "
                         "merge: gradient merge and all-reduce (M1, M2); flatten: ops.flatten / unflatten_ on the "
                         "first device (F1); diag: the measurements behind the design choices (kernel vs host "
                         "time, algorithm crossover, optimizer-step options, trainer phases); train: samples/s of "
                         "the seed and a large model (W1, W2); sweep: samples/s over model sizes, samples per GPU "
                         "and model forms against DDP and the best one-GPU loop (W3); rnn: the persistent "
                         "LSTM/GRU kernels against cuDNN, forward and forward + backward; tsc: test accuracy and "
                         "fit time of the aeon estimator SeqClassifier against aeon's 1-NN DTW and RDST on its "
                         "bundled unequal-length sets (needs aeon; only when named); all (the default): every suite "
                         "but tsc")
    ap.add_argument("--only", default=None, metavar="PREFIX[,PREFIX...]",
                    help="run only the measurements of the chosen suites whose result key starts with one of these "
                         "(e.g. diag.one_sample_plans); the others are left out, not recorded as skipped")
    ap.add_argument("--devices", default=None,
                    help='as everywhere in vlseq_ext: "all", "2" (first 2 GPUs), "cuda:0,cuda:1" or "0,1" (these '
                         'GPUs), "cpu:2" (2 CPU devices); default: all GPUs, else cpu:2')
    ap.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per measurement (default 7 merge, flatten and diag / 5 train / 3 sweep; "
                         "quick 5 / 3 / 3)")
    ap.add_argument("--sweep-deadline", type=_positive_seconds, default=None, metavar="SECONDS",
                    help="seconds of sweep measurements after which the remaining points are skipped, each with "
                         "that reason (default 420, quick 150; the worker processes get 5/7 of it): raise it on a "
                         "slow or busy machine")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv

    env.disable_nvls()  # here and in the worker processes
    try:
        devices = bench_devices(args.devices)
    except ValueError as exc:
        ap.error(f"--{exc}")  # "--devices '2': asks for the first 2 GPUs but 0 are visible; ..."
    cuda = devices[0].type == "cuda"
    budget = Budget.make(args.quick, args.repeats, args.sweep_deadline, cpu=not cuda)
    if not cuda:
        # One intra-op thread: the CPU "devices" share the cores anyway (as do the gloo DDP processes,
        # one thread each), and OpenMP regions on a busy machine turn microseconds into milliseconds.
        torch.set_num_threads(1)
    out_dir = Path(args.out)
    try:  # now, not after the first measurements
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        ap.error(f"--out {args.out}: cannot write there: {exc.strerror or exc}")
    res = Results(collect_meta(devices, argv, args.quick, args.suite))
    say = tqdm.write
    say(f"vlseq-bench: {len(devices)} x {devices[0].type} ({', '.join(map(str, devices))}), suite {args.suite}"
        f"{', quick' if args.quick else ''}; results -> {args.out}/")
    if not cuda:
        say("No GPU in use: running the CPU versions (merges over CPU 'devices', the reference all-reduce, "
            "ParallelTrainer on CPU devices, gloo DDP); GPU-only methods are skipped and listed at the end.")

    selected = [s for s in SUITES if s in args.suite.split(",") or (s in ALL and args.suite.startswith("all"))]
    tasks, ddp_jobs = [], []
    mods = {"merge": merge, "flatten": flatten, "diag": diag, "train": train, "sweep": sweep, "rnn": rnn, "tsc": tsc}
    for suite in SUITES:
        if suite in selected:
            t, j = mods[suite].tasks(devices, budget, res)
            tasks += t
            ddp_jobs += j

    # Order: merge, flatten, diag, the seed-model workloads, the worker processes (every suite's jobs
    # in one spawn), the large-model workloads, the sweep; a run cut short still has every target's
    # inputs but the sweep's.
    later = [t for t in tasks if t.key.startswith("train.") and "_large." in t.key] + \
        [t for t in tasks if t.section == "sweep"]
    tasks = [t for t in tasks if t not in later]
    if ddp_jobs:
        timeout_s = (180 if args.quick else 300) + sum(job.get("timeout_s", 0) for job, _ in ddp_jobs)
        tasks.append(Task("ddp", f"ddp ({len(devices)} processes, {len(ddp_jobs)} jobs)",
                          lambda: _run_ddp_jobs(ddp_jobs, devices, res, timeout_s=timeout_s)))
    tasks += later
    if args.only:
        prefixes = tuple(p for p in args.only.split(",") if p)
        tasks = [t for t in tasks if t.key.startswith(prefixes)]
        if not tasks:
            ap.error(f"--only {args.only}: no measurement of suite {args.suite} starts with that")

    t_start = time.perf_counter()
    timings: Dict[str, float] = defaultdict(float)
    res.data["timings_s"] = timings
    res.data["task_s"] = {}
    tty = sys.stderr.isatty()  # in a log, redraw rarely so the bar does not drown the output
    bar = tqdm(total=len(tasks), desc="vlseq-bench", unit="task", dynamic_ncols=True, file=sys.stderr,
               mininterval=0.1 if tty else 30.0)
    for i, task in enumerate(tasks):
        bar.set_postfix_str(task.key, refresh=tty)
        t0 = time.perf_counter()
        _run_task(task, res, cuda)
        res.data["task_s"][task.key] = time.perf_counter() - t0
        timings[task.section] += res.data["task_s"][task.key]
        res.dump(args.out)  # partial results survive a run that is killed later
        bar.update()
        if i + 1 == len(tasks) or tasks[i + 1].section != task.section:
            say(f"[{task.section}] {timings[task.section]:.1f} s")
    bar.close()
    train.add_ratios(res, cuda)
    flatten.add_fractions(res)
    sweep_report.finalize(res)
    rnn.finalize(res)
    tsc.finalize(res)
    timings["total"] = time.perf_counter() - t_start
    md = write_outputs(res, args.out, log=say)
    print(md)
    d = res.data
    print(f"wrote {os.path.join(args.out, 'bench-results.json')} and summary.md; {len(d['skipped'])} skipped, "
          f"{len(d['errors'])} error(s); {timings['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
