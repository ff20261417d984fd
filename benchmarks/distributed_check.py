"""Multi-process training on 2 GPUs (nvidia-h200-x2): correctness against one process, and W2 throughput.

    python benchmarks/distributed_check.py --out bench-out/dist

runs, on the seed model (LSTM(36 -> 64) + Linear(64 -> 1), Adam, reduction="mean"):
  1. one process driving both GPUs (ParallelTrainer(devices=["cuda:0", "cuda:1"])), and
  2. `torchrun --standalone --nproc-per-node 2` of this file: one process per GPU, NCCL across them,
on the same data and seed, step by step: k=1 sample per GPU (per-length CUDA graphs) and k=32,
each ending in a tail step (k=1: one sample, so rank 1 has none; k=32: 7 samples). Every step's
global loss and the final weights must agree within rtol 1e-5 (exit code 1 otherwise).
Then the W2 workload (k=32 per GPU, reduction="sum", as vlseq_ext.bench's train suite) is timed
in both modes and, in the same run, with DDP (one process per GPU, packed batches: the bench's
DDP baseline): samples/s for BENCHMARKS.md.

Writes OUT/results.json and OUT/summary.md; prints the summary. Each subprocess is bounded by
--timeout seconds. NCCL_NVLS_ENABLE=0 is set (NVLink multicast stays off on the lent GPU machines).
VLSEQ_CHECK_CPU=1 runs the same on CPU (2 processes, gloo, a hidden-8 model, fewer steps, k=4 for
k=32): what tests/test_distributed.py runs on every machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vlseq_ext import ParallelTrainer, SeqModel, distributed, env  # noqa: E402
from vlseq_ext.devices import parse_devices  # noqa: E402
from vlseq_ext.bench.baselines import make_pool  # noqa: E402
from vlseq_ext.bench.processes import run_ddp  # noqa: E402

CHECKS = {"k1": {"k": 1, "steps": 60, "tail": 1}, "k32": {"k": 32, "steps": 12, "tail": 7}}


CPU = os.environ.get("VLSEQ_CHECK_CPU") == "1"  # a smoke test of this script without GPUs (gloo, tiny sizes)
if CPU:
    CHECKS = {"k1": {"k": 1, "steps": 6, "tail": 1}, "k32": {"k": 4, "steps": 3, "tail": 3}}


def build(devices: Optional[List[str]], k: int, reduction: str, group: Any) -> ParallelTrainer:
    torch.manual_seed(0)
    model = SeqModel(hidden_dim=8) if CPU else SeqModel()
    if devices is None and CPU:
        devices = ["cpu"]
    model.to(parse_devices(devices)[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return ParallelTrainer(model, opt, nn.MSELoss(), devices=devices, samples_per_device=k, reduction=reduction,
                           process_group=group)


def global_steps(n_global: int, steps: int, tail: int):
    """The data (pinned, like a DataLoader's) and its global steps: steps-1 full ones, then the tail."""
    n = n_global * (steps - 1) + tail
    xs, ys = make_pool(n, seed=1, pin=not CPU)
    return xs, ys, [list(range(s, min(s + n_global, n))) for s in range(0, n, n_global)]


def local_part(tr: ParallelTrainer, xs, gs: List[int]) -> List[int]:
    """This process's share of the global step `gs` (all of it in one process)."""
    return [gs[i] for i in tr.shard([xs[i].shape[0] for i in gs])]


def check(devices: Optional[List[str]], group: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, c in CHECKS.items():
        tr = build(devices, c["k"], "mean", group)
        n_global = tr.samples_per_step * tr.group.world_size
        xs, ys, steps = global_steps(n_global, c["steps"], c["tail"])
        losses, counts = [], []
        for gs in steps:
            mine = local_part(tr, xs, gs)
            counts.append(len(mine))
            losses.append(tr.step([xs[i] for i in mine], [ys[i] for i in mine]))
        params = torch.cat([p.detach().reshape(-1).double().cpu() for p in tr.model.parameters()])
        out[name] = {"losses": torch.stack(losses).tolist(), "local_counts": counts,
                     "params": params.tolist(), "graphs": tr.graph_stats()}
    return out


def throughput(devices: Optional[List[str]], group: Any, k: int, iters: int, repeats: int) -> Dict[str, Any]:
    """W2: samples/s of k samples per GPU per step (reduction="sum"), timed over `iters` steps per repeat."""
    tr = build(devices, k, "sum", group)
    n_global = tr.samples_per_step * tr.group.world_size
    xs, ys, steps = global_steps(n_global, 8, n_global)
    parts = [local_part(tr, xs, gs) for gs in steps]
    feed = [([xs[i] for i in p], [ys[i] for i in p]) for p in parts]
    t0 = time.perf_counter()
    tr.warmup(sorted({x.shape[0] for x in xs}))
    for bx, by in feed:  # one untimed pass: cuDNN plans, graph captures
        tr.step(bx, by)

    def sync() -> None:
        for d in tr.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        tr.group.barrier()

    sync()
    setup_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for i in range(iters):
            tr.step(*feed[i % len(feed)])
        sync()
        times.append(time.perf_counter() - t)
    per_step = [t / iters for t in times]
    return {"k": k, "samples_per_step": n_global, "iters": iters, "s_per_step": per_step,
            "samples_per_s": n_global / statistics.median(per_step), "setup_s": setup_s,
            "processes": tr.group.world_size, "devices_per_process": len(tr.devices)}


def worker(args) -> None:
    """Under torchrun: one process per GPU (devices=None: its share of the GPUs, cuda:LOCAL_RANK), NCCL;
    gloo on CPU."""
    first = parse_devices(["cpu"] if CPU else None)[0]
    with distributed.start(first) as group:
        res = {"check": check(None, group), "w2": throughput(None, group, 4 if CPU else 32, args.iters, args.repeats)}
        if group.rank == 0:
            Path(args.out, "dist.json").write_text(json.dumps(res))


def single(args) -> None:
    devices = [("cpu" if CPU else f"cuda:{i}") for i in range(args.gpus)]
    res = {"check": check(devices, None), "w2": throughput(devices, None, 4 if CPU else 32, args.iters, args.repeats)}
    Path(args.out, "single.json").write_text(json.dumps(res))


def run(cmd: List[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\n[distributed_check] killed after {timeout} s\n")
            return 124


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="driver", choices=["driver", "single", "worker"])
    ap.add_argument("--out", default="bench-out/dist")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40, help="timed steps per repeat (W2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=500, help="seconds allowed per subprocess")
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()
    env.disable_nvls()  # inherited by every process started below
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.mode == "worker":
        worker(args)
        return 0
    if args.mode == "single":
        single(args)
        return 0

    if torch.cuda.device_count() < args.gpus and not CPU:
        print(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
        return 2
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--out", args.out, "--gpus", str(args.gpus), "--iters", str(args.iters), "--repeats", str(args.repeats)]
    out = Path(args.out)
    rc1 = run(me + ["single"] + common, out / "single.log", args.timeout)
    rc2 = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
               *me[1:], "worker", *common], out / "dist.log", args.timeout)
    if rc1 or rc2:
        for name, rc in (("single", rc1), ("dist", rc2)):
            if rc:
                print(f"{name} failed (exit {rc}); last lines of {out / (name + '.log')}:")
                print("".join(open(out / f"{name}.log").readlines()[-30:]))
        return 1
    a = json.loads((out / "single.json").read_text())
    b = json.loads((out / "dist.json").read_text())
    k = 4 if CPU else 32
    devs = [torch.device("cpu")] * args.gpus if CPU else [torch.device("cuda", i) for i in range(args.gpus)]
    job = {"key": "w2_ddp", "kind": "train", "model": {"hidden_dim": 8} if CPU else {}, "k": k,
           "pool": k * args.gpus * 8, "timing": {"repeats": args.repeats, "iters": args.iters}}
    ddp = run_ddp([job], devs, timeout_s=args.timeout)["w2_ddp"]
    if "error" in ddp:
        print(f"DDP baseline failed: {ddp['error']}")
        return 1
    sd = k * args.gpus / statistics.median(ddp["times"])
    ok = True
    dev, comm, merge = ("CPU device", "gloo", "in-process merge") if CPU else ("GPU", "NCCL", "P2P merge")
    lines = [f"# {args.gpus} processes x 1 {dev} ({comm}) vs 1 process x {args.gpus} {dev}s",
             "", f"torch {torch.__version__}, {'CPU smoke test' if CPU else torch.cuda.get_device_name(0)}", "",
             "| check | steps | max rel. diff of step losses | max rel. diff of final weights | rank-1 samples in last step | ok |",
             "|---|---|---|---|---|---|"]
    results: Dict[str, Any] = {"check": {}, "w2": {"single": a["w2"], "dist": b["w2"], "ddp": ddp}}
    for name in CHECKS:
        la, lb = np.array(a["check"][name]["losses"]), np.array(b["check"][name]["losses"])
        pa, pb = np.array(a["check"][name]["params"]), np.array(b["check"][name]["params"])
        dl = float(np.max(np.abs(la - lb) / np.abs(la)))
        dp = float(np.max(np.abs(pa - pb) / np.maximum(np.abs(pa), 1e-3)))
        good = bool(np.allclose(lb, la, rtol=args.rtol, atol=0) and np.allclose(pb, pa, rtol=args.rtol, atol=1e-6))
        ok &= good
        rank0_counts = b["check"][name]["local_counts"]
        results["check"][name] = {"max_rel_loss": dl, "max_rel_param": dp, "ok": good, "steps": len(la)}
        lines.append(f"| {name} | {len(la)} | {dl:.2e} | {dp:.2e} | {CHECKS[name]['tail'] - rank0_counts[-1]} | "
                     f"{'yes' if good else 'NO'} |")
    sa, sb = a["w2"]["samples_per_s"], b["w2"]["samples_per_s"]
    lines += ["", f"W2 ({'hidden 8' if CPU else 'seed'} model, k={k} samples per {dev} per step, reduction=sum), "
              f"median of {args.repeats} x {args.iters} steps:", "",
              "| mode | samples/s |", "|---|---|",
              f"| 1 process x {args.gpus} {dev}s ({merge}) | {sa:,.0f} |",
              f"| {args.gpus} processes x 1 {dev} ({comm} all-reduce) | {sb:,.0f} |",
              f"| DDP, {args.gpus} processes, packed batches | {sd:,.0f} |"]
    md = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
