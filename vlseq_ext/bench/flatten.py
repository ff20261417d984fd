"""Flatten suite (target F1, issue 2): ops.flatten / ops.unflatten_ against PyTorch's ways of
packing tensors into one buffer and back, on the first device only.

Two workloads: the seed model's grads (µs per call; launch and host overhead dominate) and 256 MB
spread over 200 fp32 tensors (16 MB on CPU, where one thread does the copying), as bandwidth
counted as bytes read + written, beside a plain copy of as many bytes on the same device (the
ceiling).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor

from .. import ops
from ..models import SeqModel
from .results import SIZES, Results, Task
from .timing import Budget, synchronizer, time_loop

TENSORS = 200  # the many-tensor workload spreads its bytes over this many tensors
Call = Callable[[], object]
Factory = Callable[[List[Tensor], Tensor], Call]  # (tensors, a flat buffer of their total numel) -> call


def _seed_grads(device: torch.device) -> List[Tensor]:
    """Random grads shaped like the seed model's parameters."""
    torch.manual_seed(0)
    return [torch.randn_like(p) for p in SeqModel().to(device).parameters()]


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    """The flatten suite's tasks (it has no DDP jobs)."""
    dev = devices[0]
    cuda = dev.type == "cuda"
    have_kernels = not cuda or ops.has_cuda_kernels()
    sync = synchronizer([dev])
    out: List[Task] = []
    res.set("flatten.device", str(dev))

    def add(key: str, fn: Callable[[], None], ours: bool) -> None:
        if ours and not have_kernels:
            res.skip(key, "the extension was built without CUDA kernels")
        else:
            out.append(Task("flatten", key, fn))

    # -- seed model's gradients --------------------------------------------------------------
    P = list(SeqModel().parameters())
    res.set("flatten.seed_model", {"numel": sum(p.numel() for p in P), "tensors": len(P),
                                   "bytes": 4 * sum(p.numel() for p in P), "min_calls_per_repeat": budget.seed_merges})
    seed_methods: Dict[str, Tuple[Factory, bool]] = {  # name: (factory, ours)
        "vlseq": (lambda g, flat: partial(ops.flatten, g, out=flat), True),
        "flatten_dense_tensors": (lambda g, flat: partial(torch._utils._flatten_dense_tensors, g), False),
        "cat": (lambda g, flat: lambda: torch.cat([t.view(-1) for t in g]), False),  # allocating, as the seed does
        "vlseq_unflatten": (lambda g, flat: partial(ops.unflatten_, flat, g), True),
    }
    for name, (factory, ours) in seed_methods.items():
        def run(factory=factory, name=name) -> None:
            g = _seed_grads(dev)
            ts = time_loop(factory(g, torch.cat([t.view(-1) for t in g])), sync, repeats=budget.merge_repeats,
                           warmup=3, target_s=budget.seed_target_s, min_iters=budget.seed_merges)
            res.record("flatten.seed_model.us_per_call", name, [t * 1e6 for t in ts])
        add(f"flatten.seed_model.{name}", run, ours)

    # -- many tensors ------------------------------------------------------------------------
    size = "256MB" if cuda else "16MB"  # CPU: 16 MB, so CI stays fast (the CPU run uses one thread)
    each = SIZES[size] // 4 // TENSORS
    numel = each * TENSORS
    path = "flatten.many_tensors"
    res.set(path, {"size": size, "tensors": TENSORS, "numel": numel, "bytes": 4 * numel})

    def timed(name: str, fn: Call) -> None:
        ts = time_loop(fn, sync, repeats=budget.merge_repeats, warmup=2, target_s=budget.flat_target_s, min_iters=3)
        res.record(path + ".us", name, [t * 1e6 for t in ts])
        res.record(path + ".gbps_rw", name, [2 * 4 * numel / t / 1e9 for t in ts])  # every byte read and written

    def copy() -> None:
        src = torch.randn(numel, device=dev)
        timed("copy", partial(torch.empty_like(src).copy_, src))
    add(f"{path}.copy", copy, False)

    many_methods: Dict[str, Tuple[Factory, bool]] = {
        "vlseq": (lambda ts, flat: partial(ops.flatten, ts, out=flat), True),
        "vlseq_unflatten": (lambda ts, flat: partial(ops.unflatten_, flat, ts), True),
        "cat": (lambda ts, flat: partial(torch.cat, ts, out=flat), False),
        # the unflatten baseline: one multi-tensor copy from views of the flat buffer
        "foreach_copy": (lambda ts, flat: partial(torch._foreach_copy_, ts, list(flat.split(each))), False),
    }
    for name, (factory, ours) in many_methods.items():
        def run(factory=factory, name=name) -> None:
            tensors = [torch.randn(each, device=dev) for _ in range(TENSORS)]
            timed(name, factory(tensors, torch.randn(numel, device=dev)))
        add(f"{path}.{name}", run, ours)
    return out, []


def add_fractions(res: Results) -> None:
    """Each method's bandwidth as a fraction of the plain copy's (median / median)."""
    bw = res.get("flatten.many_tensors.gbps_rw") or {}
    if bw.get("copy"):
        res.set("flatten.many_tensors.fraction_of_copy", {m: v / bw["copy"] for m, v in bw.items()})
