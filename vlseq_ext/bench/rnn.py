"""RNN suite (issue 21): the persistent kernels (vlseq_ext.nn) against cuDNN (torch's nn.LSTM /
nn.GRU) in one run, on the first device, forward and forward + backward, both as CUDA-graph replays
(so neither pays host overhead), over hidden 64-1024, layers 1-2, batch 1-32, fp32 / TF32 / bf16,
uniform and variable lengths.

Variable lengths ("50-500"): each sample runs its own length. cuDNN gets a PackedSequence (the way
to run it with lengths: no padding enters), ours gets the zero-padded batch and `lengths=`. Forward +
backward is the gradient of every parameter for the sum of the outputs (no input gradient, as for a
first layer). Input width 36 (the seed's). Ratios are cuDNN's time over ours (> 1: ours is faster).
Each point also says what kernels="auto" runs there, and whether this run measured that the faster.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from .. import ops
from .. import nn as vnn
from .results import Results, Skip, Task, fmt
from .timing import Budget, synchronizer, time_loop

INPUT = 36


@dataclass(frozen=True)
class Point:
    name: str
    cell: str  # "lstm" | "gru"
    hidden: int
    layers: int
    bidirectional: bool
    batch: int
    steps: int
    lengths: str = "uniform"  # or "50-500": random per sample, the longest `steps`
    precision: str = "fp32"  # "fp32" (TF32 off), "tf32" (cuDNN's and the GEMMs' TF32 on), "bf16" (autocast)
    target: Optional[float] = None  # issue 21: forward + backward at least this many times cuDNN's speed


POINTS = [
    Point("lstm64_b1", "lstm", 64, 1, False, 1, 480, target=1.0),
    Point("lstm64_b32", "lstm", 64, 1, False, 32, 480, target=1.0),
    Point("lstm64_b32_var", "lstm", 64, 1, False, 32, 500, "50-500"),
    Point("lstm128_b1", "lstm", 128, 1, False, 1, 480, target=1.0),
    Point("lstm128_b32", "lstm", 128, 1, False, 32, 480, target=1.0),
    Point("gru128_b32", "gru", 128, 1, False, 32, 480, target=1.0),
    Point("gru128bi_b32", "gru", 128, 1, True, 32, 480, target=1.0),
    Point("lstm256x2_b1", "lstm", 256, 2, False, 1, 480, target=3.0),
    Point("lstm256x2_b8", "lstm", 256, 2, False, 8, 480),
    Point("lstm256x2_b32", "lstm", 256, 2, False, 32, 480),
    Point("lstm256x2_b32_var", "lstm", 256, 2, False, 32, 500, "50-500", target=3.0),
    Point("lstm256x2_b32_tf32", "lstm", 256, 2, False, 32, 480, precision="tf32"),
    Point("lstm256x2_b32_bf16", "lstm", 256, 2, False, 32, 480, precision="bf16"),
    Point("gru256x2bi_b32", "gru", 256, 2, True, 32, 480, target=2.0),
    Point("gru256x2bi_b32_var", "gru", 256, 2, True, 32, 500, "50-500"),
    Point("lstm512_b32", "lstm", 512, 1, False, 32, 500),
    # fp32 grid launches on 66 SMs each: two layers pipelined, two directions side by side.
    Point("lstm512x2_b1", "lstm", 512, 2, False, 1, 480),
    Point("lstm512bi_b8_var", "lstm", 512, 1, True, 8, 500, "50-500"),
    Point("lstm1024_b1", "lstm", 1024, 1, False, 1, 500),
    # One sample in TF32 on the whole GPU (its forward: the 16-bit kernels with h in tagged lines, 64 blocks).
    Point("lstm1024_b1_tf32", "lstm", 1024, 1, False, 1, 500, precision="tf32"),
    Point("lstm1024_b32", "lstm", 1024, 1, False, 32, 500, target=2.0),
    Point("lstm1024_b32_tf32", "lstm", 1024, 1, False, 32, 500, precision="tf32", target=2.0),
    Point("lstm1024_b32_bf16", "lstm", 1024, 1, False, 32, 500, precision="bf16"),
    # Two layers in TF32 up to 16 samples: pipelined on 64 blocks a layer (concurrency.pipeline_layout).
    Point("lstm1024x2_b1_tf32", "lstm", 1024, 2, False, 1, 480, precision="tf32"),
    Point("lstm1024x2_b8_var_tf32", "lstm", 1024, 2, False, 8, 500, "50-500", precision="tf32"),
]
QUICK = ("lstm64_b32", "lstm256x2_b1", "lstm256x2_b32_var", "gru256x2bi_b32", "lstm1024_b32")
METHODS = ("cudnn", "vlseq")


@contextlib.contextmanager
def precision(mode: str):
    """TF32 flags for the run (restored after), and bf16 autocast inside `autocast()`."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _lengths(p: Point, gen: torch.Generator) -> torch.Tensor:
    if p.lengths == "uniform":
        return torch.full((p.batch,), p.steps, dtype=torch.long)
    low, high = map(int, p.lengths.split("-"))
    lens = torch.randint(low, high + 1, (p.batch,), generator=gen)
    lens[0] = p.steps
    return lens


def _layer(p: Point, kernels: str, device: torch.device) -> nn.RNNBase:
    """The point's layer as vlseq_ext.nn's module with `kernels`, on `device`."""
    kind = vnn.LSTM if p.cell == "lstm" else vnn.GRU
    return kind(INPUT, p.hidden, num_layers=p.layers, bidirectional=p.bidirectional, batch_first=True,
                kernels=kernels).to(device)


def _autocast(p: Point, device: torch.device):
    """bf16 autocast for a bf16 point on a GPU; nothing otherwise."""
    if p.precision == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build(p: Point, method: str, device: torch.device) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward + backward) of the point's layer with `method`, as closures over fixed inputs."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    module = _layer(p, "vlseq" if method == "vlseq" else "cudnn", device)
    lens = _lengths(p, gen)
    x = torch.randn(p.batch, p.steps, INPUT, generator=gen).to(device)
    x[torch.arange(p.steps)[None, :] >= lens[:, None]] = 0
    params = list(module.parameters())
    dev_lens = lens.to(device)
    varlen = p.lengths != "uniform"
    amp = _autocast(p, device)
    # Packed once, outside the graph (packing copies the sort order from the host, which a capture
    # cannot): the same input preparation that our path's lengths tensor gets.
    packed = pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False) if varlen else None

    def outputs():
        with amp:
            if method == "cudnn" and varlen:
                out, _ = module(packed)
                return out.data
            return module(x, lengths=dev_lens if varlen else None)[0]

    def forward() -> None:
        with torch.no_grad():
            outputs()

    def forward_backward() -> None:
        torch.autograd.grad(outputs().float().sum(), params)

    return forward, forward_backward


def graph_of(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()  # warm-up: cuDNN plans, allocator pools
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    return graph


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    dev = devices[0]
    out: List[Task] = []
    points = [p for p in POINTS if not budget.quick or p.name in QUICK]
    for p in points:
        res.set(f"rnn.points.{p.name}.config", asdict(p))
        for method in METHODS:
            key = f"rnn.{p.name}.{method}"
            if dev.type != "cuda":
                res.skip(key, "the rnn suite compares GPU kernels; no GPU in use")
                continue
            if method == "vlseq" and not ops.has_rnn_kernels():
                res.skip(key, "the extension was built without CUDA kernels")
                continue
            out.append(Task("rnn", key, lambda p=p, method=method: _measure(p, method, dev, budget, res)))
    return out, []


def _plan_text(p: Point, dev: torch.device) -> str:
    """What our module runs at the point (its _layout): the layer's plan, or each direction's or layer's on
    its share of the GPU and how they run at once. Empty when the kernels do not hold it."""
    module = _layer(p, "vlseq", dev)
    x = torch.zeros(p.batch, 1, INPUT, device=dev)
    with precision(p.precision), _autocast(p, dev):
        layout = module._layout(x, p.batch, p.steps)
    weights = p.precision  # fp32, tf32 or bf16: what the module runs (functional.precision_for)

    def plan(blocks: int) -> str:
        return ops.rnn_plan(p.cell, p.hidden, p.batch, weights, dev, blocks)
    if not plan(0):
        return ""
    if layout["side_by_side_blocks"]:
        return f"each direction: {plan(layout['side_by_side_blocks'])}; directions side by side"
    if layout["chunks"] > 1:
        return f"each layer: {plan(layout['max_blocks'])}; layers pipelined over {layout['chunks']} windows"
    return plan(0)


def _auto_runs(p: Point, dev: torch.device) -> str:
    """What kernels="auto" (SeqModel's, the trainer's and use_kernels' choice) runs at the point: "vlseq"
    or "cudnn". finalize holds it against the point's measured ratio."""
    module = _layer(p, "auto", dev)
    x = torch.zeros(p.batch, 1, INPUT, device=dev)
    with precision(p.precision), _autocast(p, dev):
        return "vlseq" if module.uses_kernels(x, p.batch, padded=p.lengths != "uniform") else "cudnn"


def _measure(p: Point, method: str, dev: torch.device, budget: Budget, res: Results) -> None:
    if method == "vlseq":
        res.set(f"rnn.points.{p.name}.auto", _auto_runs(p, dev))
        plan = _plan_text(p, dev)
        if not plan:
            raise Skip(f"{p.cell} hidden {p.hidden} does not fit the kernels")
        res.set(f"rnn.points.{p.name}.plan", plan)
    sync = synchronizer([dev])
    with precision(p.precision):
        for mode, fn in zip(("fwd_ms", "fwdbwd_ms"), build(p, method, dev)):
            graph = graph_of(fn, dev)
            ts = time_loop(graph.replay, sync, repeats=budget.train_repeats, warmup=2, target_s=0.25)
            res.record(f"rnn.points.{p.name}.{mode}", method, [t * 1e3 for t in ts])
            del graph


# How far the measured ratio may sit on the other side of 1 before `auto`'s choice reads as the slower one:
# the run-to-run spread of a point (1-3%, BENCHMARKS.md), so that parity is no verdict.
AUTO_TOLERANCE = 0.05


def finalize(res: Results) -> None:
    """Ratios (cuDNN over ours), what `auto` runs and whether that was the faster, and the issue's targets
    per point: met by the kernels, or (a target of at most 1, "never slower") by `auto` keeping cuDNN."""
    for name, node in (res.get("rnn.points") or {}).items():
        for mode in ("fwd_ms", "fwdbwd_ms"):
            t = node.get(mode, {})
            if t.get("cudnn") and t.get("vlseq"):
                node.setdefault("ratio", {})[mode[:-3]] = t["cudnn"] / t["vlseq"]
        ratio = node.get("ratio", {}).get("fwdbwd")
        runs = node.get("auto")
        if runs is not None and ratio is not None:
            slower = ratio < 1 - AUTO_TOLERANCE if runs == "vlseq" else ratio > 1 + AUTO_TOLERANCE
            node["auto_check"] = {"runs": runs, "ratio": ratio if runs == "vlseq" else 1.0,
                                  "picked": "the slower" if slower else "the faster or at parity"}
        target = node["config"].get("target")
        if target is not None:
            if ratio is None:
                status = "incomplete"
            elif ratio >= target:
                status = "met"
            elif runs == "cudnn" and target <= 1:
                status = "met under auto (cuDNN kept)"
            else:
                status = "missed"
            node["target"] = {"ratio": target, "status": status}


def markdown_lines(data: Dict) -> List[str]:
    points = (data.get("rnn") or {}).get("points") or {}
    if not points:
        return []
    rows = []
    for name, node in points.items():
        c = node["config"]
        f, fb, r = node.get("fwd_ms", {}), node.get("fwdbwd_ms", {}), node.get("ratio", {})
        per_step = fb.get("vlseq") and fb["vlseq"] * 1e3 / (c["steps"] * c["layers"] * (2 if c["bidirectional"] else 1))
        tgt = node.get("target")
        rows.append([name, f"{c['cell']} h{c['hidden']}x{c['layers']}{' bi' if c['bidirectional'] else ''}",
                     str(c["batch"]), f"{c['steps']} {c['lengths']}", c["precision"],
                     fmt(f.get("cudnn")), fmt(f.get("vlseq")), fmt(r.get("fwd")),
                     fmt(fb.get("cudnn")), fmt(fb.get("vlseq")), f"**{fmt(r.get('fwdbwd'))}**", fmt(per_step),
                     _auto_text(node.get("auto_check")),
                     f"≥ {tgt['ratio']:g}: {tgt['status']}" if tgt else "", node.get("plan", "")])
    header = ["point", "layer", "batch", "steps", "precision", "fwd cuDNN ms", "fwd ours ms", "fwd ×",
              "fwd+bwd cuDNN ms", "fwd+bwd ours ms", "fwd+bwd ×", "ours µs/step/dir", "auto runs", "target",
              "our layout"]
    return ["", "## RNN kernels against cuDNN (graph replays; × = cuDNN time / ours)", "",
            "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def _auto_text(check: Optional[Dict]) -> str:
    if not check:
        return ""
    text = "ours" if check["runs"] == "vlseq" else "cuDNN"
    return text + (" (**the slower**)" if check["picked"] == "the slower" else "")
