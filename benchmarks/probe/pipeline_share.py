"""Whether a unidirectional stack whose layers each need more than half the GPU gains from the
pipeline when each layer's launches are planned for a share of the SMs (functional.rnn's chunks with
max_blocks): forward + backward of an LSTM stack as CUDA-graph replays, against the stack run layer by
layer on the whole GPU, in one process; plus the plans ops.rnn_plan gives at each share, and the
largest gradient difference between the two ways (the pipeline's windows sum in another order).

    python3 benchmarks/probe/pipeline_share.py [--hidden 256] [--layers 2] [--batch 32]
        [--lengths 50-500] [--steps 500] [--precision tf32] [--chunks 2,4,8] [--blocks 0,60,64,66]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from vlseq_ext import nn as vnn
from vlseq_ext import ops
from vlseq_ext.bench.rnn import graph_of
from vlseq_ext.bench.timing import synchronizer, time_loop
from vlseq_ext.nn import functional

INPUT = 36


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lengths", default="50-500")
    ap.add_argument("--precision", default="tf32", choices=("fp32", "tf32"))
    ap.add_argument("--chunks", default="2,4,8")
    ap.add_argument("--blocks", default="0,60,64,66")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default, as the sweep runs
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = vnn.LSTM(INPUT, args.hidden, num_layers=args.layers, batch_first=True, kernels="vlseq").to(dev)
    if args.lengths == "uniform":
        lens = torch.full((args.batch,), args.steps)
    else:
        lo, hi = map(int, args.lengths.split("-"))
        lens = torch.randint(lo, hi + 1, (args.batch,), generator=gen)
        lens[0] = args.steps
    x = torch.randn(args.batch, args.steps, INPUT, generator=gen)
    x[torch.arange(args.steps)[None, :] >= lens[:, None]] = 0
    x, lens = x.to(dev), lens.to(dev)
    params = list(module.parameters())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}; "
          f"LSTM {args.hidden} x {args.layers}, batch {args.batch}, {args.steps} steps, lengths {args.lengths}, "
          f"{args.precision}")
    for b in [0, 48, 56, 60, 64, 66, 72, 88]:
        plan = ops.rnn_plan("lstm", args.hidden, args.batch, args.precision, dev, b)
        print(f"  plan within {b or 'all'} SMs: {plan}")

    def run(chunks: int, blocks: int):
        def fwd_bwd():
            out, h_n, c_n = functional.rnn(module, x, lens, chunks=chunks, max_blocks=blocks)
            return torch.autograd.grad(out.sum() + h_n.sum(), params)
        return fwd_bwd

    base = [g.clone() for g in run(1, 0)()]
    sync = synchronizer([dev])
    ways = [(1, 0)] + [(c, b) for c in map(int, args.chunks.split(",")) for b in map(int, args.blocks.split(","))
                       if not b or ops.rnn_plan("lstm", args.hidden, args.batch, args.precision, dev, b)]
    rows = []
    for rnd in range(2):  # two rounds, alternating ways: the machine's drift shows
        for chunks, blocks in ways:
            fn = run(chunks, blocks)
            diff = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(fn(), base))
            graph = graph_of(fn, dev)
            ts = time_loop(graph.replay, sync, repeats=7, warmup=2, target_s=0.3)
            del graph
            rows.append((rnd, chunks, blocks, statistics.median(ts) * 1e3, diff))
    seq = {r: ms for r, c, b, ms, _ in rows if c == 1}
    print("round chunks blocks   fwd+bwd ms   x layer-by-layer   max grad diff (rel)")
    for rnd, chunks, blocks, ms, diff in rows:
        print(f"{rnd:5d} {chunks:6d} {blocks or 'all':>6} {ms:12.3f} {seq[rnd] / ms:17.3f}   {diff:.2e}")


if __name__ == "__main__":
    main()
