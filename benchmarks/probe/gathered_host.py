"""Where the host time of a gathered step goes: the sweep's one-sample LSTM (the trainer's "gathered"
plan, gather.CallGatherer) at k samples, warm, on one GPU.

  1. samples/s over back-to-back steps (no profiler), and the step's GPU busy time (torch.profiler);
     with --ab-padding, alternated 3 times with the gathered batch padded by a copy per sample
     (pad_sequence) instead of one launch (modules._padded_flat);
  2. the host's time a step by phase, no profiler: wall time inside the gatherer's run (the passes,
     their hand-overs and the batched calls), inside the batched calls, inside backward, the
     optimizer, and the step's rest; and whether any op of a step waits for the GPU
     (torch.cuda.set_sync_debug_mode);
  3. torch.profiler's CPU events over a few steps, every thread: the ops and autograd nodes with the
     most self CPU time, with their count per step.
(cProfile in the pass threads, by threading.setprofile, fails on Python 3.12: "Another profiling tool is
already active"; the passes then die and the step never ends.)

    python3 benchmarks/probe/gathered_host.py [--hidden 1024] [--layers 1] [--k 32] [--steps 20] [--stack auto|one|pipelined] [--ab-padding]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from vlseq_ext.bench.baselines import Feeder, make_pool
from vlseq_ext.bench.sweep import point_trainer
from vlseq_ext.bench.sweep_points import POOL, ModelSpec
from vlseq_ext.bench.timing import device_time_us, is_kernel

TOP = 30


@contextlib.contextmanager
def phase_timers(spent: collections.Counter):
    """Wall time spent inside a few functions of the step, summed into `spent` (by phase name)
    while the block runs; the functions are put back after it."""
    from vlseq_ext.nn import functional, gather, modules
    from vlseq_ext.training import execution, trainer
    phases = [("step (all of it)", trainer.ParallelTrainer, "step"),
              ("  forward + backward on the device thread", execution.DeviceRunner, "run"),
              ("    gatherer run: passes, hand-overs, batched calls", gather.CallGatherer, "run"),
              ("      batched calls (LSTM and Linear)", gather.CallGatherer, "_run_calls"),
              ("        LSTM batch (padding, kernels, splits)", modules._KernelRNN, "_run_joined"),
              ("          functional.rnn (GEMMs, launches)", functional, "rnn"),
              ("    backward", torch.Tensor, "backward"),
              ("  optimizer step", torch.optim.Adam, "step")]
    saved = []
    for name, owner, attr in phases:
        fn = owner.__dict__[attr]
        saved.append((owner, attr, fn))

        def timed(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t
        setattr(owner, attr, functools.wraps(fn)(timed))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stack", choices=("auto", "one", "pipelined"), default="auto",
                    help="a stack's layers: as the modules plan them (auto), one launch after another on the whole "
                         "GPU (one), or a grid stack pipelined as if the gathered batch were not host-bound")
    ap.add_argument("--ab-padding", action="store_true",
                    help="also time the steps with the gathered batch padded by pad_sequence, alternated")
    args = ap.parse_args()
    from vlseq_ext.nn import concurrency
    plan_stack = concurrency.pipeline_layout
    if args.stack == "one":
        concurrency.pipeline_layout = lambda *a, **kw: (1, 0)
    elif args.stack == "pipelined":
        concurrency.pipeline_layout = lambda *a, **kw: plan_stack(*a)
    dev = torch.device("cuda")
    spec = ModelSpec("lstm", args.hidden, args.layers)
    pool = make_pool(POOL, seed=0, pin=True)

    def run(steps: int, profiler=None, on_start=None) -> float:
        """Seconds a step over `steps` steps after 3 warm-up steps (on_start() between them)."""
        trainer = point_trainer(spec, "one", args.k, [dev], fused=True)
        feed = Feeder(pool)
        try:
            for _ in range(3):
                trainer.step(*feed.next(args.k))
            torch.cuda.synchronize()
            assert trainer.runner.plan == "gathered", trainer.runner.plan
            if on_start is not None:
                on_start()
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.start()
            for _ in range(steps):
                trainer.step(*feed.next(args.k))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("default")
            if profiler is not None:
                profiler.stop()
            return (time.perf_counter() - t0) / steps
        finally:
            trainer.close()

    dt = run(args.steps)
    print(f"{spec.name} one-sample k={args.k} (stack {args.stack}): {dt * 1e3:.2f} ms a step, {args.k / dt:,.0f} samples/s, "
          f"{dt / args.k * 1e6:.0f} us a pass")
    if args.ab_padding:
        from torch.nn.utils.rnn import pad_sequence

        from vlseq_ext.nn import modules
        flat = modules._padded_flat
        times = collections.defaultdict(list)
        for _ in range(3):
            for name, pad in (("one launch", flat), ("a copy per sample", lambda s: pad_sequence(s, batch_first=True))):
                modules._padded_flat = pad
                try:
                    times[name].append(run(args.steps))
                finally:
                    modules._padded_flat = flat
        for name, ts in times.items():
            print(f"  padded by {name}: " + ", ".join(f"{t * 1e3:.2f}" for t in ts) + f" ms a step (median "
                  f"{sorted(ts)[1] * 1e3:.2f})")

    spent = collections.Counter()
    with phase_timers(spent):
        dt = run(args.steps, on_start=spent.clear)
    print(f"host time by phase (no profiler; {dt * 1e3:.2f} ms a step):")
    for name, seconds in spent.items():
        print(f"  {seconds / args.steps * 1e3:8.3f} ms  {name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(2, on_start=lambda: torch.cuda.set_sync_debug_mode("warn"))
    syncs = collections.Counter(str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message))
    print(f"ops that waited for the GPU in 2 steps: {sum(syncs.values())}")
    for text, n in syncs.most_common(5):
        print(f"  {n:4d} x {text}")

    prof_steps = 5
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    run(prof_steps, prof)
    busy = sum(device_time_us(e) for e in prof.events() if is_kernel(e)) / prof_steps
    count, self_us = collections.Counter(), collections.Counter()
    threads = collections.Counter()
    for e in prof.events():
        if is_kernel(e):
            continue
        count[e.name] += 1
        self_us[e.name] += e.self_cpu_time_total
        threads[e.thread] += e.self_cpu_time_total
    print(f"GPU busy {busy:,.0f} us a step; self CPU time by thread (us a step): "
          + ", ".join(f"{t}: {v / prof_steps:,.0f}" for t, v in threads.most_common(6)))
    for name, us in self_us.most_common(TOP):
        print(f"  {us / prof_steps:9,.0f} us  {count[name] / prof_steps:7.1f}/step  {name[:100]}")


if __name__ == "__main__":
    main()
