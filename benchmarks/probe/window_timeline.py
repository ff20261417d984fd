"""What a pipelined grid stack's windows cost beyond their steps: the kernels of one forward + backward
graph replay of a vlseq_ext.nn stack (torch.profiler's CUDA activity), in start order with their
stream, start, length and the gap before them on their stream (--list); then the recurrent launches'
lengths, forward and backward. Runs at several window counts side by side say what a window adds:
the launches' total against their steps, and the replay's span against the launches'.

    python3 benchmarks/probe/window_timeline.py [--hidden 1024] [--layers 2] [--batch 1] [--steps 436]
        [--windows 4] [--precision tf32] [--list]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import vlseq_ext.nn as vnn
from vlseq_ext.nn import concurrency
from vlseq_ext.bench.rnn import graph_of, precision
from vlseq_ext.bench.timing import is_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="lstm", choices=("lstm", "gru"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=436)
    ap.add_argument("--windows", type=int, default=concurrency.PIPELINE_GRID_CHUNKS)
    ap.add_argument("--precision", default="tf32", choices=("fp32", "tf32"))
    ap.add_argument("--list", action="store_true", help="print every kernel of the replay")
    args = ap.parse_args()
    concurrency.PIPELINE_GRID_CHUNKS = args.windows
    concurrency.PIPELINE_MIN_STEPS = 1  # as many windows as asked for
    dev = torch.device("cuda")
    with precision(args.precision):
        torch.manual_seed(0)
        T, B = args.steps, args.batch
        lens = torch.full((B,), T)  # every sample runs every step: a window's steps are its length
        x = torch.randn(B, T, 36, device=dev)
        cls = vnn.LSTM if args.cell == "lstm" else vnn.GRU
        mod = cls(36, args.hidden, num_layers=args.layers, batch_first=True, kernels="vlseq").to(dev)
        print("layout:", mod._layout(x, B, T))
        params = list(mod.parameters())
        dlens = lens.to(dev)

        def fb() -> None:
            torch.autograd.grad(mod(x, lengths=dlens)[0].sum(), params)

        graph = graph_of(fb, dev)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if is_kernel(e)), key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start
    end = max(e.time_range.end for e in kernels)
    print(f"replay: {len(kernels)} kernels, {(end - t0) / 1e3:.3f} ms first start to last end")
    last_end: dict = {}
    rec = []
    for e in kernels:
        s, d = e.time_range.start, e.time_range.end - e.time_range.start
        stream = getattr(e, "device_resource_id", 0)
        gap = s - last_end.get(stream, s)
        last_end[stream] = e.time_range.end
        name = e.name
        if args.list:
            print(f"  {(s - t0) / 1e3:8.3f} ms  stream {stream:3d}  {d / 1e3:7.3f} ms  gap {gap:7.1f} us  {name[:90]}")
        if "rnn_" in name and ("grid" in name or "fused" in name):
            rec.append((name, d))
    for kind in ("forward", "backward"):
        ds = [d for n, d in rec if kind in n]
        if ds:
            print(f"{kind}: {len(ds)} launches, {sum(ds) / 1e3:.3f} ms in all; lengths (us): "
                  + ", ".join(f"{d:.0f}" for d in ds))


if __name__ == "__main__":
    main()
