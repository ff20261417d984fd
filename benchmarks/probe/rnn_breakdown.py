"""Where the time of a `vlseq-bench --suite rnn` point goes, kernel by kernel: torch's profiler over
eager forward + backward passes of our modules (the bench times CUDA-graph replays of the same work),
the GPU time of each kernel name summed and divided by the passes.

Usage: python3 benchmarks/probe/rnn_breakdown.py [point ...]   (default lstm256x2_b32_var lstm256x2_b32)
"""
from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from vlseq_ext.bench import rnn

PASSES = 5


def breakdown(name: str) -> None:
    point = next(p for p in rnn.POINTS if p.name == name)
    dev = torch.device("cuda")
    with rnn.precision(point.precision):
        _, forward_backward = rnn.build(point, "vlseq", dev)
        for _ in range(3):  # warm-up: plans, allocator
            forward_backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PASSES):
                forward_backward()
            torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name][0] += ev.device_time_total / 1e3 / PASSES
            per_kernel[ev.name][1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    print(f"{name}: {total:.3f} ms of GPU time per forward + backward, {len(per_kernel)} kernel names")
    for kernel, (ms, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {ms:8.3f} ms  {calls // PASSES:4d} calls  {kernel[:110]}")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["lstm256x2_b32_var", "lstm256x2_b32"]:
        breakdown(name)
