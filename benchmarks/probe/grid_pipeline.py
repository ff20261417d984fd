"""Grid-layout stacks and bidirectional layers on a share of the SMs against one launch at a time on the
whole GPU: forward + backward of a vlseq_ext.nn module as CUDA-graph replays, the layout the module picks
(concurrency.pipeline_layout / direction_blocks) against the layer-by-layer one, and cuDNN, in one run.
Lengths like the sweep's pool (the longest `steps`, the others random down to a third of it).

    python3 benchmarks/probe/grid_pipeline.py [--steps 436] [--repeats 7] [--windows 4,8] [--cases 0,1]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.utils.rnn import pack_padded_sequence

import vlseq_ext.nn as vnn
from vlseq_ext.nn import concurrency
from vlseq_ext.bench.rnn import graph_of, precision
from vlseq_ext.bench.timing import synchronizer, time_loop

# (cell, hidden, layers, bidirectional, batch, precision)
CASES = [
    ("lstm", 1024, 2, False, 1, "tf32"),
    ("lstm", 1024, 2, False, 8, "tf32"),
    ("lstm", 1024, 2, False, 16, "tf32"),
    ("lstm", 1024, 1, True, 8, "tf32"),
    ("gru", 1024, 2, False, 8, "tf32"),
    ("lstm", 512, 2, False, 1, "fp32"),
    ("lstm", 512, 2, False, 32, "fp32"),
    ("gru", 512, 1, True, 8, "fp32"),
    ("lstm", 512, 2, False, 8, "fp32"),
    ("lstm", 512, 2, False, 16, "fp32"),
    ("lstm", 512, 1, True, 1, "fp32"),
    ("lstm", 512, 1, True, 8, "fp32"),
    ("lstm", 512, 1, True, 32, "fp32"),
    ("lstm", 768, 2, False, 8, "fp32"),
    ("gru", 768, 2, False, 8, "fp32"),
    ("gru", 1024, 2, False, 1, "fp32"),
]
ONE_AT_A_TIME = {"chunks": 1, "side_by_side_blocks": 0, "max_blocks": 0}


def closure(module, x, lens, packed=None):
    """Forward + backward; cuDNN on a PackedSequence packed beforehand (packing reads the lengths on
    the host, which a capture cannot)."""
    params = list(module.parameters())

    def fb() -> None:
        out = module(packed)[0].data if packed is not None else module(x, lengths=lens)[0]
        torch.autograd.grad(out.sum(), params)
    return fb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=436)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--windows", default=str(concurrency.PIPELINE_GRID_CHUNKS),
                    help="comma-separated values of concurrency.PIPELINE_GRID_CHUNKS to time the picked layout at")
    ap.add_argument("--cases", default="", help="comma-separated indices into CASES (default: all)")
    args = ap.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    default_windows = concurrency.PIPELINE_GRID_CHUNKS
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    dev = torch.device("cuda")
    sync = synchronizer([dev])
    picks = [f"picked ({w} windows at most) ms" for w in windows]
    print(f"| case | layout picked | {' | '.join(picks)} | one at a time ms | cuDNN ms | one at a time / picked | "
          "cuDNN / picked |")
    print("|---" * (6 + len(windows)) + "|")
    for cell, H, layers, bi, B, prec in cases:
        with precision(prec):
            gen = torch.Generator().manual_seed(0)
            lens = torch.randint(args.steps // 3, args.steps + 1, (B,), generator=gen)
            lens[0] = args.steps
            x = torch.randn(B, args.steps, 36, generator=gen)
            x[torch.arange(args.steps)[None, :] >= lens[:, None]] = 0
            x, dlens = x.to(dev), lens.to(dev)
            cls = vnn.LSTM if cell == "lstm" else vnn.GRU
            torch.manual_seed(0)
            mod = cls(36, H, num_layers=layers, bidirectional=bi, batch_first=True, kernels="vlseq").to(dev)
            concurrency.PIPELINE_GRID_CHUNKS = default_windows
            picked = mod._layout(x, B, args.steps)
            times = {}
            for name in [f"picked{w}" for w in windows] + ["one", "cudnn"]:
                m = mod
                if name.startswith("picked"):
                    concurrency.PIPELINE_GRID_CHUNKS = int(name[6:])
                elif name == "one":
                    m = cls(36, H, num_layers=layers, bidirectional=bi, batch_first=True, kernels="vlseq").to(dev)
                    m.load_state_dict(mod.state_dict())
                    m._layout = lambda *a: dict(ONE_AT_A_TIME)
                elif name == "cudnn":
                    m = cls(36, H, num_layers=layers, bidirectional=bi, batch_first=True, kernels="cudnn").to(dev)
                    m.load_state_dict(mod.state_dict())
                packed = (pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False)
                          if name == "cudnn" else None)
                graph = graph_of(closure(m, x, dlens, packed), dev)
                times[name] = statistics.median(time_loop(graph.replay, sync, repeats=args.repeats)) * 1e3
                del graph
            concurrency.PIPELINE_GRID_CHUNKS = default_windows
            label = f"{cell} {H} x {layers}{' bi' if bi else ''}, {B}, {prec}"
            best = min(times[f"picked{w}"] for w in windows)
            cells = " | ".join(f"{times['picked%d' % w]:.3f}" for w in windows)
            print(f"| {label} | {picked} | {cells} | "
                  f"{times['one']:.3f} | {times['cudnn']:.3f} | {times['one'] / best:.2f} | {times['cudnn'] / best:.2f} |",
                  flush=True)
            blocks = picked["max_blocks"] or picked["side_by_side_blocks"]
            print(f"  plan at {blocks or 'all the'} SMs: {mod._plan(B, dev, blocks, prec)}", flush=True)


if __name__ == "__main__":
    main()
