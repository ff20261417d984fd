"""Diagnostics suite: the measurements behind the design choices that BENCHMARKS.md explains.

Sections (results under `diag.`; a section that does not apply is skipped with the reason):
  kernels (GPUs): per operation, its kernel time from torch.profiler beside the wall time of a
      synchronized loop and the host time per call while the GPU is kept busy, so it is clear
      whether the op is bound by the kernel or by the host: a 256 MB same-device copy (the F1
      ceiling); flatten_ / unflatten_ of 256 MB over 200 fp32 tensors (F1); flatten of the seed
      model's grads; on >= 2 GPUs the seed-model merge (M1) and the 256 MB two_shot all-reduce
      (M2). {name: {kernel_us, wall_us, host_us, kernel_share_of_wall}}.
  crossover (>= 2 GPUs): all_reduce_ bandwidth of every algorithm and of torch.cuda.nccl at 64 KB,
      256 KB, 1 MB and 4 MB fp32, around the 1 MB where algo="auto" switches from root to two_shot.
      {<size>: {bytes, algbw_gbps.<method>, algbw_gbps_spread.<method>}}.
  step_options (>= 2 devices): merge + optimizer + parameter sync per step for the seed model,
      option 1 (reduce into the master, one optimizer step there, broadcast the parameters: what the
      trainer does) against option 2 (all-reduce, an optimizer step on every replica); fused Adam
      on GPUs. {us_per_step.<option>, us_per_step_spread.<option>}.
  host: host cost of an empty Python loop iteration, a tiny torch op, a kernel launch
      (torch.cuda._sleep(0), GPUs) and a dispatcher round trip to a vlseq_ext op (p2p_status).
      {us_per_call.<name>, us_per_call_spread.<name>}.
  trainer_phases: ParallelTrainer on every device, seed model (fused Adam on GPUs), k=1 and k=32
      per device (k=4 on CPU), profiled over a few steps after warm-up: host time per step in each
      of the trainer's profiler ranges (vlseq::*), wall time per step and, on GPUs, each device's
      busy time per step. {k<K>: {steps, wall_us_per_step, host_us_per_step: {range: us},
      busy_us_per_step: {device: us}}}.
  lanes (GPUs): one-sample LSTM (hidden 256, 2 layers; the seed's forward(x) style) at k=32 on one
      GPU, with 1, 4, 8 and 16 lanes (concurrent per-sample graph replays on their own streams),
      after warm-up over a pool of 8 lengths. {lanes<N>: samples_per_s}.
  one_sample_plans (GPUs): one-sample LSTMs (hidden 256 x 2 layers, whose one-sample recurrence runs
      in a cluster, and 1024 x 1, a grid) at k=32 on one GPU: their passes gathered (pack=True: one
      batch per recurrent and per Linear call) against per-sample graphs on 16 lanes (pack=False) and
      the plain packed one-GPU loop of the same model as a list model; pack="auto" takes the graphs
      for a cluster and gathers for a grid. {<model>: {gathered, sample_graphs, packed_loop}} samples/s.
  limits (GPUs): what limits the sweep's hardest points: their profiles, step time against batch
      size, host threads issuing one GPU's graph launches, the GPU's rate of tiny kernels (limits.py).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.cuda.nccl  # noqa: F401  (not imported by `import torch`)
from torch import nn

from .. import ops
from ..training.replicas import GradientMerger
from ..models import SeqModel
from . import limits, plans
from .baselines import Feeder, make_pool
from .merge import accepted_algos
from .results import SIZES, Results, Skip, Task, fmt
from .timing import Budget, device_time_us, is_kernel, synchronizer, time_loop

CROSSOVER = {"64KB": 64 << 10, "256KB": 256 << 10, "1MB": 1 << 20, "4MB": 4 << 20}
HOST_CALLS = 50             # calls per host-time measurement
BUSY_CYCLES = int(2e8)      # torch.cuda._sleep cycles (~0.1 s) that keep the GPU busy while the host is timed
PROFILED_CALLS = 10


# ------------------------------------------------------------------------------------------------
# helpers
def kernel_us(fn: Callable[[], object], sync: Callable[[], None], match: Callable[[str], bool],
              calls: int = PROFILED_CALLS) -> Optional[float]:
    """GPU time per call of the kernels whose name `match`es (torch.profiler), None when none ran."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    times = [device_time_us(e) for e in prof.events() if is_kernel(e) and match(e.name)]
    return sum(times) / calls if times else None


def host_us(fn: Callable[[], object], sync: Callable[[], None], devices: Sequence[torch.device],
            calls: int = HOST_CALLS) -> float:
    """Host time per call while every GPU of `devices` is busy with a long sleep kernel queued
    first: what the caller pays whatever the kernels take."""
    fn()
    sync()
    for d in {torch.device(x) for x in devices if torch.device(x).type == "cuda"}:
        with torch.cuda.device(d):
            torch.cuda._sleep(BUSY_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    sync()
    return dt / calls * 1e6


def _ours(name: str) -> bool:
    return "vlseq" in name


def _seed_replicas(devices: Sequence[torch.device]) -> List[List[nn.Parameter]]:
    """One seed model per device (the same weights), random grads, as a trainer's replicas hold."""
    torch.manual_seed(0)
    master = SeqModel()
    lists = []
    for i, d in enumerate(devices):
        m = SeqModel().to(d)
        m.load_state_dict(master.state_dict())
        torch.manual_seed(i + 1)
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        lists.append(list(m.parameters()))
    return lists


# ------------------------------------------------------------------------------------------------
def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    """The diag suite's tasks (it has no jobs for the worker processes)."""
    cuda = devices[0].type == "cuda"
    n = len(devices)
    have_kernels = not cuda or ops.has_cuda_kernels()
    dev = devices[0]
    sync0, sync_all = synchronizer([dev]), synchronizer(devices)
    out: List[Task] = []

    def add(key: str, fn: Callable[[], None]) -> None:
        out.append(Task("diag", key, fn))

    # -- kernels ---------------------------------------------------------------------------------
    def kernel_entry(name: str, fn: Callable[[], object], sync: Callable[[], None], match: Callable[[str], bool],
                     devs: Sequence[torch.device]) -> None:
        wall = statistics.median(time_loop(fn, sync, repeats=budget.merge_repeats, warmup=3,
                                           target_s=budget.flat_target_s, min_iters=3)) * 1e6
        k = kernel_us(fn, sync, match)
        res.set(f"diag.kernels.{name}", {"kernel_us": k, "wall_us": wall, "host_us": host_us(fn, sync, devs),
                                         "kernel_share_of_wall": k / wall if k else None})

    if not cuda:
        res.skip("diag.kernels", "kernel times come from the CUDA profiler: GPU runs only")
    elif not have_kernels:
        res.skip("diag.kernels", "the extension was built without CUDA kernels")
    else:
        numel = SIZES["256MB"] // 4
        each = numel // 200

        def copy() -> None:
            src = torch.randn(numel, device=dev)
            dst = torch.empty_like(src)
            kernel_entry("copy_256MB", lambda: dst.copy_(src), sync0, lambda s: "Memcpy" in s or "copy" in s.lower(),
                         [dev])
        add("diag.kernels.copy_256MB", copy)

        def many(name: str) -> None:
            ts = [torch.randn(each, device=dev) for _ in range(200)]
            flat = torch.randn(each * 200, device=dev)
            fn = (lambda: ops.flatten(ts, out=flat)) if name == "flatten" else (lambda: ops.unflatten_(flat, ts))
            kernel_entry(f"{name}_256MB_200", fn, sync0, _ours, [dev])
        for name in ("flatten", "unflatten"):
            add(f"diag.kernels.{name}_256MB_200", lambda name=name: many(name))

        def seed_flatten() -> None:
            grads = [p.grad for p in _seed_replicas([dev])[0]]
            flat = torch.empty(sum(g.numel() for g in grads), device=dev)
            kernel_entry("flatten_seed", lambda: ops.flatten(grads, out=flat), sync0, _ours, [dev])
        add("diag.kernels.flatten_seed", seed_flatten)
        if n >= 2:
            def merge_seed() -> None:
                merger = GradientMerger(_seed_replicas(devices))
                kernel_entry("merge_seed", merger.merge, sync_all, _ours, devices)
            add("diag.kernels.merge_seed", merge_seed)

            def two_shot() -> None:
                if "two_shot" not in accepted_algos(lambda b, a: ops.all_reduce_(b, "sum", a)):
                    raise Skip("this build has no two_shot algorithm")
                bufs = [torch.ones(numel, device=d) for d in devices]
                kernel_entry("two_shot_256MB", lambda: ops.all_reduce_(bufs, "sum", "two_shot"), sync_all, _ours,
                             devices)
            add("diag.kernels.two_shot_256MB", two_shot)

    # -- crossover -------------------------------------------------------------------------------
    if not cuda or n < 2:
        res.skip("diag.crossover", "needs >= 2 CUDA devices (the algorithms differ on GPUs only)")
    elif not have_kernels:
        res.skip("diag.crossover", "the extension was built without CUDA kernels")
    else:
        algos = [a for a in accepted_algos(lambda b, a: ops.all_reduce_(b, "sum", a)) if a != "auto"]
        for size, nbytes in CROSSOVER.items():
            path = f"diag.crossover.{size}"
            res.set(path + ".bytes", nbytes)
            for method in ["vlseq"] + [f"vlseq_{a}" for a in algos] + ["nccl"]:
                def run(method=method, nbytes=nbytes, path=path) -> None:
                    bufs = [torch.ones(nbytes // 4, device=d) for d in devices]
                    if method == "nccl":
                        fn = lambda: torch.cuda.nccl.all_reduce(bufs)  # noqa: E731
                    else:
                        algo = "auto" if method == "vlseq" else method[len("vlseq_"):]
                        fn = lambda: ops.all_reduce_(bufs, "sum", algo)  # noqa: E731
                    ts = time_loop(fn, sync_all, repeats=budget.merge_repeats, warmup=3, target_s=budget.seed_target_s,
                                   min_iters=20)
                    res.record(path + ".algbw_gbps", method, [nbytes / t / 1e9 for t in ts])
                add(f"{path}.{method}", run)

    # -- step options ----------------------------------------------------------------------------
    if n < 2:
        res.skip("diag.step_options", f"needs >= 2 devices, got {n}")
    else:
        def options(option: str) -> None:
            params = _seed_replicas(devices)
            grads = ops.DeviceLists([[p.grad for p in ps] for ps in params])
            # lr 1e-9: the weights stay put however many steps the timing takes
            opts = [torch.optim.Adam(ps, lr=1e-9, fused=True) if cuda else torch.optim.Adam(ps, lr=1e-9)
                    for ps in params]
            if option == "master_step_broadcast":
                def fn() -> None:
                    ops.reduce_tensors_(grads, 1.0, True)
                    opts[0].step()
                    ops.broadcast_tensors_(params[0], params[1:])
            else:
                def fn() -> None:
                    ops.all_reduce_tensors_(grads, 1.0)
                    for o in opts:
                        o.step()
            with torch.no_grad():
                ts = time_loop(fn, sync_all, repeats=budget.merge_repeats, warmup=3, target_s=budget.seed_target_s,
                               min_iters=50)
            res.record("diag.step_options.us_per_step", option, [t * 1e6 for t in ts])
        for option in ("master_step_broadcast", "replicated_step"):
            add(f"diag.step_options.{option}", lambda option=option: options(option))

    # -- host costs ------------------------------------------------------------------------------
    def host(name: str) -> None:
        a = torch.ones(4, device=dev)
        bufs = [torch.empty(16, device=d) for d in devices]
        fn: Callable[[], object] = {
            "empty_loop": lambda: None,
            "tiny_op": lambda: torch.add(a, a, out=a),
            "launch": lambda: torch.cuda._sleep(0),
            "dispatcher_round_trip": lambda: torch.ops.vlseq_ext.p2p_status(bufs),
        }[name]
        ts = time_loop(fn, sync_all, repeats=budget.merge_repeats, warmup=3, target_s=budget.seed_target_s,
                       min_iters=500)
        res.record("diag.host.us_per_call", name, [t * 1e6 for t in ts])
    for name in ("empty_loop", "tiny_op", "launch", "dispatcher_round_trip"):
        key = f"diag.host.{name}"
        if name == "launch" and not cuda:
            res.skip(key, "a kernel launch is a GPU matter")
        elif name == "dispatcher_round_trip" and not ops.has_extension():
            res.skip(key, "the vlseq_ext extension is not loaded")
        else:
            add(key, lambda name=name: host(name))

    # -- trainer phases --------------------------------------------------------------------------
    for k in ((1, 32) if cuda else (1, 4)):
        add(f"diag.trainer_phases.k{k}", lambda k=k: trainer_phases(res, devices, k, budget))
    for n in (1, 4, 8, 16):
        key = f"diag.lanes.lanes{n}"
        if cuda:
            add(key, lambda n=n: lanes(res, devices[0], n, budget))
        else:
            res.skip(key, "lanes replay CUDA graphs: GPUs only")
    out += plans.tasks(devices, budget, res)
    out += limits.tasks(devices, budget, res)
    return out, []


def lanes(res: Results, device: torch.device, n: int, budget: Budget) -> None:
    from ..training.trainer import ParallelTrainer
    from .sweep_points import ModelSpec, make_model
    model = make_model(ModelSpec("lstm", 256, 2), "one").to(device)
    trainer = ParallelTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=True), nn.MSELoss(),
                              devices=[device], samples_per_device=32, lanes=n, process_group=None)
    pool = make_pool(32, seed=2, pin=True)
    lengths = sorted({x.shape[0] for x in pool[0]})[:8]
    keep = [i for i, x in enumerate(pool[0]) if x.shape[0] in lengths]
    pool = ([pool[0][i] for i in keep], [pool[1][i] for i in keep])
    trainer.warmup(lengths)
    feed = Feeder(pool)

    def step() -> None:
        trainer.step(*feed.next(32))
    res.set(f"diag.lanes.lanes{n}", plans.samples_per_s(step, device, 32, budget, trainer))


def trainer_phases(res: Results, devices: List[torch.device], k: int, budget: Budget) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ..training.trainer import ParallelTrainer
    cuda = devices[0].type == "cuda"
    torch.manual_seed(0)
    model = SeqModel().to(devices[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if cuda else torch.optim.Adam(model.parameters())
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices=[str(d) for d in devices], samples_per_device=k,
                              reduction="sum", process_group=None)
    n = k * len(devices)
    pool = make_pool(max(2 * n, 32), seed=1, pin=cuda, **({} if cuda else {"min_len": 10, "max_len": 40}))
    if getattr(trainer, "cuda_graphs", False):
        trainer.warmup(sorted({x.shape[0] for x in pool[0]}))
    feed = Feeder(pool)

    def step() -> None:
        xs, ys = feed.next(n)
        trainer.step(xs, ys)
    sync = synchronizer(devices)
    for _ in range(3):
        step()
    sync()
    steps = (50 if k == 1 else 3) if cuda else (10 if k == 1 else 2)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = time.perf_counter() - t0
    finally:
        if callable(getattr(trainer, "close", None)):
            trainer.close()  # its device threads
    ranges: Dict[str, float] = {}
    busy: Dict[str, float] = {}
    for e in prof.events():
        if is_kernel(e):
            key = f"cuda:{getattr(e, 'device_index', 0)}"
            busy[key] = busy.get(key, 0.0) + device_time_us(e) / steps
        elif e.name.startswith("vlseq::"):
            ranges[e.name] = ranges.get(e.name, 0.0) + float(e.cpu_time_total) / steps
    res.set(f"diag.trainer_phases.k{k}", {"steps": steps, "samples_per_step": n,
                                          "wall_us_per_step": wall / steps * 1e6,
                                          "host_us_per_step": dict(sorted(ranges.items())),
                                          "busy_us_per_step": dict(sorted(busy.items()))})


# ------------------------------------------------------------------------------------------------
def markdown_lines(data: Dict[str, Any]) -> List[str]:
    d = data.get("diag") or {}
    L: List[str] = []
    if d.get("kernels"):
        L += ["", "## Diagnostics: kernel vs host time (µs per call)", "",
              "kernel: GPU time from torch.profiler; wall: synchronized loop; host: time to issue one call while "
              "the GPU is busy. A wall time near the host time and well above the kernel's means host-bound.", "",
              "| operation | kernel | wall | host | kernel / wall |", "|---|---|---|---|---|"]
        for name, e in d["kernels"].items():
            share = e.get("kernel_share_of_wall")
            L.append(f"| {name} | {fmt(e.get('kernel_us'))} | {fmt(e.get('wall_us'))} | {fmt(e.get('host_us'))} | "
                     f"{f'{100 * share:.0f}%' if share else '-'} |")
    cross = {s: c for s, c in (d.get("crossover") or {}).items() if c.get("algbw_gbps")}
    if cross:
        methods = sorted({m for c in cross.values() for m in c["algbw_gbps"]})
        L += ["", "## Diagnostics: all-reduce crossover, GB/s (algorithm bandwidth)", "",
              "| method | " + " | ".join(cross) + " |", "|---|" + "---|" * len(cross)]
        L += [f"| {m} | " + " | ".join(fmt(c["algbw_gbps"].get(m)) for c in cross.values()) + " |" for m in methods]
    so = (d.get("step_options") or {}).get("us_per_step")
    if so:
        L += ["", "## Diagnostics: merge + optimizer + sync per step (seed model, µs)", "",
              "| option | µs/step |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in so.items()]
    host = (d.get("host") or {}).get("us_per_call")
    if host:
        L += ["", "## Diagnostics: host costs (µs per call)", "", "| call | µs |", "|---|---|"] + \
             [f"| {k} | {fmt(v)} |" for k, v in host.items()]
    phases = d.get("trainer_phases") or {}
    if phases:
        L += ["", "## Diagnostics: trainer phases (seed model; µs per step)", ""]
        for k, p in phases.items():
            parts = ", ".join(f"{r} {fmt(v)}" for r, v in p.get("host_us_per_step", {}).items())
            busy = ", ".join(f"{dv} {fmt(v)}" for dv, v in p.get("busy_us_per_step", {}).items())
            L.append(f"- {k} ({p.get('samples_per_step')} samples per step, {p.get('steps')} steps): wall "
                     f"{fmt(p.get('wall_us_per_step'))}; host in ranges: {parts or '-'}"
                     + (f"; device busy: {busy}" if busy else ""))
    return L + plans.markdown_lines(d.get("one_sample_plans") or {}) + limits.markdown_lines(d.get("limits") or {})
