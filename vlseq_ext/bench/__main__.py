"""Command line of the benchmark suite: `python -m vlseq_ext.bench` / `vlseq-bench`."""
from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time
import traceback
from collections import defaultdict
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from . import flatten, merge, train
from .baselines import run_ddp
from .report import Results, Skip, Task, collect_meta, write_outputs
from .timing import Budget

TASK_STALL_S = 180  # print every thread's stack when one task runs longer than this


def parse_devices(spec: Optional[str]) -> List[torch.device]:
    """None: every GPU, else two CPU "devices". "2": the first 2 GPUs; "0,1" / "cuda:0,cuda:1":
    those GPUs; "cpu:2": two CPU devices (replicas in one process, for machines without GPUs)."""
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec is None:
        return [torch.device("cuda", i) for i in range(ngpu)] if ngpu else [torch.device("cpu")] * 2
    spec = spec.strip()
    if spec.startswith("cpu"):
        n = int(spec.partition(":")[2] or 1)
        if n < 1:
            raise ValueError("cpu:N needs N >= 1")
        return [torch.device("cpu")] * n
    if "," in spec or spec.startswith("cuda"):
        idx = [int(s.strip().replace("cuda:", "")) for s in spec.split(",") if s.strip()]
    else:
        idx = list(range(int(spec)))
    if not idx:
        raise ValueError("no devices")
    bad = [i for i in idx if not 0 <= i < ngpu]
    if bad or len(set(idx)) != len(idx):
        hint = "" if ngpu else "; use --devices cpu:2"
        raise ValueError(f"GPU indices {idx} do not fit the {ngpu} GPU(s) visible{hint}")
    return [torch.device("cuda", i) for i in idx]


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
    """All DDP jobs of the run in one spawn (process start and NCCL init are paid once)."""
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
        else:
            on_result(r)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vlseq-bench",
        description="Benchmarks vlseq_ext's gradient merge, fused flatten and trainer against the seed loop, PyTorch's "
                    "built-ins, NCCL and DDP on the devices it finds. Prints the tables; writes "
                    "bench-results.json, summary.md and plots to --out. Without GPUs it runs the CPU versions "
                    "and lists what it skipped.")
    ap.add_argument("--quick", action="store_true",
                    help="a short run (under 2 minutes): fewer repeats, seed model only")
    ap.add_argument("--suite", choices=("merge", "train", "flatten", "all"), default="all",
                    help="merge: gradient merge and all-reduce (M1, M2); train: samples/s (W1, W2); flatten: "
                         "ops.flatten / unflatten_ on the first device (F1); default all")
    ap.add_argument("--devices", default=None,
                    help='"2" (first 2 GPUs), "0,1" (these GPUs), "cpu:2" (2 CPU devices); '
                         'default: all GPUs, else cpu:2')
    ap.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per measurement (default 7 merge and flatten / 5 train; quick 5 / 3)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast, here and in the DDP processes (DESIGN.md §5)
    try:
        devices = parse_devices(args.devices)
    except ValueError as exc:
        ap.error(f"--devices {args.devices}: {exc}")
    cuda = devices[0].type == "cuda"
    if not cuda:
        # One intra-op thread: the CPU "devices" share the cores anyway (as do the gloo DDP processes,
        # one thread each), and OpenMP regions on a busy machine turn microseconds into milliseconds.
        torch.set_num_threads(1)
    budget = Budget.make(args.quick, args.repeats)
    res = Results(collect_meta(devices, argv, args.quick, args.suite))
    say = tqdm.write
    say(f"vlseq-bench: {len(devices)} x {devices[0].type} ({', '.join(map(str, devices))}), suite {args.suite}"
        f"{', quick' if args.quick else ''}; results -> {args.out}/")
    if not cuda:
        say("No GPU in use: running the CPU versions (merges over CPU 'devices', the reference all-reduce, "
            "ParallelTrainer on CPU devices, gloo DDP); GPU-only methods are skipped and listed at the end.")

    tasks, ddp_jobs = [], []
    for suite, mod in (("merge", merge), ("flatten", flatten), ("train", train)):
        if args.suite in (suite, "all"):
            t, j = mod.tasks(devices, budget, res)
            tasks += t
            ddp_jobs += j

    if ddp_jobs:  # after the seed-model workloads, so a run cut short still has every target's inputs
        ddp = Task("ddp", f"ddp ({len(devices)} processes, {len(ddp_jobs)} jobs)",
                   lambda: _run_ddp_jobs(ddp_jobs, devices, res, timeout_s=180 if args.quick else 300))
        extra = [t for t in tasks if t.key.startswith("train.") and "_large." in t.key]
        tasks = [t for t in tasks if t not in extra] + [ddp] + extra

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
    timings["total"] = time.perf_counter() - t_start
    md = write_outputs(res, args.out, log=say)
    print(md)
    d = res.data
    print(f"wrote {os.path.join(args.out, 'bench-results.json')} and summary.md; {len(d['skipped'])} skipped, "
          f"{len(d['errors'])} error(s); {timings['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
