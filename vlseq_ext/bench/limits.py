"""What limits the sweep's hardest points, from a profile on one GPU (part of the diag suite,
results under `diag.limits`; GPUs only).

  points: our trainer on the first GPU, warm (the sweep's pool, graphs captured), at the points
      where one GPU of ours is slowest against the best plain one-GPU loop (twenty-second session):
      the list-form LSTM h1024 l1 and l2 and biGRU h256 l2, and the one-sample LSTM h1024 l1, at
      k=32. A few steps back to back (one sync at the end) under torch.profiler:
      wall per step; kernels per step; kernel time per step summed over streams (busy) and as the
      union of the kernel intervals (active: the time at least one kernel runs); the span from the
      first kernel's start to the last one's end (the wall time less the host's lead-in) and active /
      span; busy / active, the mean number of kernels in flight; kernels completed per second. For the padded plan, the
      share of the padded batch that is padding; the kernels with the most busy time (calls per
      step, mean µs, share); the host's time per cudaGraphLaunch and its share of the wall time.
      {<point>: {...}}.
  batch_scaling: the list-form LSTM h256 l2 and h1024 l1 with every sample 480 steps long (one
      padded graph), B = 1, 8, 32 and 128 samples per step: µs per step. A step time that barely
      grows with B means the recurrence is bound by its per-time-step latency, not by arithmetic.
      {<model>: {B<b>: us_per_step}}.
  launch_threads: the trainer's per-sample graphs of the one-sample LSTM h256 l2 (one 275-step
      sample) on its 4 lanes (streams) of one GPU, 32 replays per round issued by 1, 2 or 4 host
      threads (the lanes split between them): samples per second. Says whether
      the host's cudaGraphLaunch time, which grows with the graph's node count, parallelizes over
      threads on one device. {threads<N>: samples_per_s}.
  launch_ceiling: a CUDA graph of GRAPH_KERNELS one-element kernels, replayed on 1, 4 and 8
      streams at once: kernels per second the GPU completes when a kernel does almost nothing, the
      rate no graph of tiny kernels can beat. {streams<N>: kernels_per_s}.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

import torch

from ..training.graphs import padded_length
from .baselines import Feeder, make_pool
from .results import Results, Task, fmt
from .sweep import point_trainer
from .sweep_points import POOL, ModelSpec, point_name
from .timing import Budget, is_kernel, synchronizer, time_loop

POINTS = (("list", ModelSpec("lstm", 1024, 1), 32), ("list", ModelSpec("lstm", 1024, 2), 32),
          ("list", ModelSpec("bigru", 256, 2), 32), ("one", ModelSpec("lstm", 1024, 1), 32))
PROFILED_STEPS = 4
GRAPH_KERNELS = 1000
STREAMS = (1, 4, 8)
LAUNCH_THREADS = (1, 2, 4)
LAUNCH_STREAMS = 4
LAUNCH_SAMPLE_LENGTH = 275
LAUNCH_REPLAYS = 32
SCALING_MODELS = (ModelSpec("lstm", 256, 2), ModelSpec("lstm", 1024, 1))
SCALING_BATCHES = (1, 8, 32, 128)
SCALING_LENGTH = 480
TOP_KERNELS = 12
KERNEL_NAME_CHARS = 90


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> List[Task]:
    if devices[0].type != "cuda":
        res.skip("diag.limits", "profiles of CUDA kernels: GPUs only")
        return []
    dev = devices[0]
    out = [Task("diag", f"diag.limits.{point_name(form, spec, k)}",
                lambda form=form, spec=spec, k=k: profile_point(res, dev, form, spec, k))
           for form, spec, k in POINTS]
    out += [Task("diag", f"diag.limits.batch_scaling.{spec.name}.B{b}",
                 lambda spec=spec, b=b: batch_scaling(res, dev, spec, b, budget))
            for spec in SCALING_MODELS for b in SCALING_BATCHES]
    out += [Task("diag", f"diag.limits.launch_threads.threads{n}", lambda n=n: launch_threads(res, dev, n, budget))
            for n in LAUNCH_THREADS]
    out += [Task("diag", f"diag.limits.launch_ceiling.streams{n}",
                 lambda n=n: launch_ceiling(res, dev, n, budget)) for n in STREAMS]
    return out


def _union_us(intervals: List[tuple]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile_point(res: Results, dev: torch.device, form: str, spec: ModelSpec, k: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    trainer = point_trainer(spec, form, k, [dev], fused=True)
    pool = make_pool(POOL, seed=0, pin=True)
    feed, sync = Feeder(pool), synchronizer([dev])
    steps: List[List[int]] = []

    def step() -> None:
        xs, ys = feed.next(k)
        steps.append([x.shape[0] for x in xs])
        trainer.step(xs, ys)
    try:
        step()
        trainer.warmup(sorted({x.shape[0] for x in pool[0]}))
        for _ in range(2):
            step()
        sync()
        steps.clear()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            # back to back, as training runs them: the host may queue a step while the GPU runs the last
            wall = time_loop(step, sync, repeats=1, warmup=0, iters=PROFILED_STEPS)[0]
        plan = trainer.runner.plan
    finally:
        trainer.close()
    kernels = [e for e in prof.events() if is_kernel(e)]
    n = len(steps)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels) / n
    active = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / n
    # From the first kernel's start to the last one's end: the wall time less the host's lead-in before
    # the first kernel, which a few steps' window would count as idle GPU time.
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / n if kernels else 0.0
    entry: Dict[str, Any] = {"plan": plan, "samples_per_step": k, "wall_us_per_step": wall * 1e6,
                             "kernels_per_step": len(kernels) / n, "busy_us_per_step": busy,
                             "active_us_per_step": active, "kernels_in_flight": busy / active if active else None,
                             "active_share_of_wall": active / (wall * 1e6), "span_us_per_step": span,
                             "active_share_of_span": active / span if span else None,
                             "kernels_per_s": len(kernels) / n / wall,
                             "mean_kernel_us": busy / (len(kernels) / n) if kernels else None}
    launches = [e.time_range.end - e.time_range.start for e in prof.events()
                if e.name == "cudaGraphLaunch" and not is_kernel(e)]
    if launches:  # the host's time in graph launches: each replays a whole sample or padded batch
        entry.update(graph_launches_per_step=len(launches) / n, host_us_per_graph_launch=sum(launches) / len(launches),
                     host_launch_share_of_wall=sum(launches) / n / (wall * 1e6))
    by_name: Dict[str, List[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    entry["top_kernels"] = [{"name": name[:KERNEL_NAME_CHARS], "per_step": len(ts) / n, "mean_us": sum(ts) / len(ts),
                             "share_of_busy": sum(ts) / n / busy} for name, ts in top]
    if plan == "padded":
        entry["padding_share"] = 1 - sum(sum(s) for s in steps) / sum(len(s) * padded_length(max(s)) for s in steps)
    res.set(f"diag.limits.{point_name(form, spec, k)}", entry)


def batch_scaling(res: Results, dev: torch.device, spec: ModelSpec, batch: int, budget: Budget) -> None:
    trainer = point_trainer(spec, "list", batch, [dev], fused=True)
    xs, ys = make_pool(batch, seed=3, pin=True, min_len=SCALING_LENGTH, max_len=SCALING_LENGTH)
    try:
        ts = time_loop(lambda: trainer.step(xs, ys), synchronizer([dev]), repeats=budget.merge_repeats, warmup=3,
                       target_s=0.3, min_iters=3)
    finally:
        trainer.close()
    res.set(f"diag.limits.batch_scaling.{spec.name}.B{batch}", statistics.median(ts) * 1e6)


def launch_threads(res: Results, dev: torch.device, n_threads: int, budget: Budget) -> None:
    from concurrent.futures import ThreadPoolExecutor
    trainer = point_trainer(ModelSpec("lstm", 256, 2), "one", LAUNCH_STREAMS, [dev], fused=True)  # k = 4: 4 lanes
    try:
        trainer.warmup([LAUNCH_SAMPLE_LENGTH])  # every lane captures the length
        lanes, caches = trainer.replicas.lanes[0], trainer.runner.sample_graphs[0]
        x = torch.randn(LAUNCH_SAMPLE_LENGTH, 36, device=dev)
        y = torch.randn(1, 1, device=dev)
        share = [list(range(len(lanes)))[t::n_threads] for t in range(n_threads)]  # each thread its own lanes

        def issue(mine: List[int]) -> None:
            with torch.cuda.device(dev):
                for _ in range(LAUNCH_REPLAYS // len(lanes)):
                    for i in mine:
                        with torch.cuda.stream(lanes[i].stream):
                            caches[i].run(x, y)

        with ThreadPoolExecutor(n_threads) as pool:
            ts = time_loop(lambda: list(pool.map(issue, share)), synchronizer([dev]), repeats=budget.merge_repeats,
                           warmup=2, target_s=0.5, min_iters=2)
    finally:
        trainer.close()
    res.set(f"diag.limits.launch_threads.threads{n_threads}", LAUNCH_REPLAYS / statistics.median(ts))


def launch_ceiling(res: Results, dev: torch.device, n_streams: int, budget: Budget) -> None:
    streams = [torch.cuda.Stream(dev) for _ in range(n_streams)]
    graphs = []
    for s in streams:
        x = torch.zeros(1, device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            x.add_(1)  # the first (eager) call outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(GRAPH_KERNELS):
                    x.add_(1)
        graphs.append((g, s))
    sync = synchronizer([dev])

    def replay_all() -> None:
        for g, s in graphs:
            with torch.cuda.stream(s):
                g.replay()
        for _, s in graphs:
            torch.cuda.current_stream(dev).wait_stream(s)
    ts = time_loop(replay_all, sync, repeats=budget.merge_repeats, warmup=2, target_s=0.3, min_iters=3)
    res.set(f"diag.limits.launch_ceiling.streams{n_streams}", n_streams * GRAPH_KERNELS / statistics.median(ts))


def markdown_lines(limits: Dict[str, Any]) -> List[str]:
    points = {k: v for k, v in limits.items()
              if k not in ("launch_ceiling", "batch_scaling", "launch_threads") and isinstance(v, dict)}
    threads = limits.get("launch_threads") or {}
    scaling = limits.get("batch_scaling") or {}
    ceiling = limits.get("launch_ceiling") or {}
    if not points and not ceiling and not scaling and not threads:
        return []
    L = ["", "## Diagnostics: what limits the hardest sweep points (one GPU, profiled)", ""]
    if points:
        L += ["busy: kernel time summed over streams; active: time at least one kernel runs; in flight: busy / "
              "active; span: the first kernel's start to the last one's end (the wall time less the host's lead-in); in "
              "flight: busy / active.", "", "| point | plan | wall µs/step | kernels/step | busy µs | active µs | "
              "active / wall | active / span | in flight | kernels/s | µs/kernel | padding |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def share(v: Any) -> str:
        return f"{100 * v:.0f}%" if v is not None else "-"
    for name, e in points.items():
        pad = e.get("padding_share")
        L.append(f"| {name} | {e.get('plan')} | {fmt(e.get('wall_us_per_step'))} | {fmt(e.get('kernels_per_step'))} | "
                 f"{fmt(e.get('busy_us_per_step'))} | {fmt(e.get('active_us_per_step'))} | "
                 f"{share(e.get('active_share_of_wall', 0))} | {share(e.get('active_share_of_span'))} | "
                 f"{fmt(e.get('kernels_in_flight'))} | "
                 f"{fmt(e.get('kernels_per_s'))} | {fmt(e.get('mean_kernel_us'))} | "
                 f"{share(pad)} |")
    for name, e in points.items():
        tops = "; ".join(f"`{t['name']}` {fmt(t['per_step'])}/step × {fmt(t['mean_us'])} µs "
                         f"({100 * t['share_of_busy']:.0f}%)" for t in e.get("top_kernels") or [])
        if tops:
            L.append(f"- {name}, most busy time: {tops}")
        if e.get("host_us_per_graph_launch") is not None:
            L.append(f"- {name}, host: {fmt(e['graph_launches_per_step'])} graph launches per step, "
                     f"{fmt(e['host_us_per_graph_launch'])} µs each, {100 * e['host_launch_share_of_wall']:.0f}% "
                     "of the wall time")
    for model, by_b in scaling.items():
        L.append(f"- {model}, every sample {SCALING_LENGTH} steps, µs per step by samples per step: "
                 + ", ".join(f"{b.replace('B', 'B=')} {fmt(v)}" for b, v in by_b.items()))
    if threads:
        L.append(f"- one-sample LSTM h256 l2 graphs ({LAUNCH_SAMPLE_LENGTH} steps) on {LAUNCH_STREAMS} streams, "
                 "samples/s by issuing host threads: "
                 + ", ".join(f"{n.replace('threads', '')} thread(s) {fmt(v)}" for n, v in threads.items()))
    if ceiling:
        L += ["", "Graph-launched one-element kernels completed per second: "
              + ", ".join(f"{n.replace('streams', '')} stream(s) {fmt(v)}" for n, v in ceiling.items()) + "."]
    return L
