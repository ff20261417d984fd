"""Pure-PyTorch versions of every op: what the tests compare against, and the fallback when the
compiled extension is missing. Same semantics as the kernels, including the rounding rule:
out = To(OpMath(x) * scale), OpMath = float64 if either side is float64 else float32, and
reductions sum in the fixed order 0..N-1 in that precision. Input checks that protect the
result (overlapping buffers) raise the kernels' messages, before anything is written.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def opmath(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check_dtype(op: str, what: str, t: Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"{op}: {what} has unsupported dtype {t.dtype} "
                           "(supported: float32, float16, bfloat16, float64)")


def _span(t: Tensor, numel: Optional[int] = None):
    """(device, first byte, one past the last byte) of t's elements, first to last (strided views
    included), or of the first `numel` elements of contiguous t; None when that is empty."""
    if numel is None:
        numel = t.numel()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    else:
        extent = numel
    if numel == 0:
        return None
    begin = t.data_ptr()
    return str(t.device), begin, begin + extent * t.element_size()


def _first_overlap(spans, conflict=lambda i, j: True) -> Optional[Tuple[int, int]]:
    """The first pair (i, j), i < j, of the numbered spans [(i, span or None)] that share memory on
    one device and that conflict(i, j) does not excuse; None when there is none. The search of
    csrc/arg_checks.cpp: sorted by start, O(n log n) while nothing overlaps."""
    ordered = sorted((s[0], s[1], i, s[2]) for i, s in spans if s is not None)
    active = []
    for dev, begin, k, end in ordered:
        active = [a for a in active if a[0] == dev and a[3] > begin]
        for a in active:
            i, j = min(a[2], k), max(a[2], k)
            if conflict(i, j):
                return i, j
        active.append((dev, begin, k, end))
    return None


def _check_lists_disjoint(op: str, flat: Sequence[Tensor], per_list: int) -> None:
    hit = _first_overlap((k, _span(t)) for k, t in enumerate(flat))
    if hit is not None:
        i, j = hit
        raise RuntimeError(f"{op}: tensors[{j}] (list {j // per_list}, tensor {j % per_list}) overlaps tensors[{i}] "
                           f"(list {i // per_list}, tensor {i % per_list}) in memory; every tensor needs its own memory")


def _check_broadcast_disjoint(op: str, srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> None:
    P = len(srcs)

    def conflict(a: int, b: int) -> bool:  # numbering: srcs, then dsts
        if b < P:
            return False  # sources are only read
        if a >= P:
            return True
        return (b - P) % P != a or dsts[b - P].data_ptr() != srcs[a].data_ptr()  # its own source is fine

    hit = _first_overlap([(p, _span(s)) for p, s in enumerate(srcs)] +
                         [(P + i, _span(d)) for i, d in enumerate(dsts)], conflict)
    if hit is not None:
        a, b = hit
        if a >= P:
            raise RuntimeError(f"{op}: dsts[{b - P}] overlaps dsts[{a - P}] in memory; give distinct destinations")
        raise RuntimeError(f"{op}: dsts[{b - P}] overlaps srcs[{a}] in memory; a destination may be its own source, "
                           "but share memory with no other source")


def flatten_(tensors: Sequence[Optional[Tensor]], numels: Sequence[int], out: Tensor, scale: float) -> None:
    if len(tensors) == 0:
        raise RuntimeError("flatten_: tensors must be a non-empty list")
    _check_dtype("flatten_", "out", out)
    total = 0
    for i, (t, n) in enumerate(zip(tensors, numels)):
        if t is not None:
            if t.device != out.device:
                raise RuntimeError(f"flatten_: tensors[{i}] is on {t.device} but out is on {out.device}")
            _check_dtype("flatten_", f"tensors[{i}]", t)
            if t.numel() != n:
                raise RuntimeError(f"flatten_: tensors[{i}] has {t.numel()} elements but numels[{i}] is {n}")
        total += n
    if out.numel() < total:
        raise RuntimeError(f"flatten_: out is too small: it has {out.numel()} elements but the tensors need {total}")
    n = len(tensors)
    hit = _first_overlap([(i, _span(t)) for i, t in enumerate(tensors) if t is not None] + [(n, _span(out, total))],
                         lambda i, j: j == n)
    if hit is not None:
        raise RuntimeError(f"flatten_: tensors[{hit[0]}] overlaps out in memory; the inputs must not share memory "
                           "with the part of out that is written")
    flat = out.view(-1)
    off = 0
    for t, n in zip(tensors, numels):
        seg = flat[off:off + n]
        if t is None:
            seg.zero_()
        else:
            seg.copy_((t.reshape(-1).to(opmath(t.dtype, out.dtype)) * scale).to(out.dtype))
        off += n


def unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float) -> None:
    if len(tensors) == 0:
        raise RuntimeError("unflatten_: tensors must be a non-empty list")
    total = sum(t.numel() for t in tensors)
    if flat.numel() < total:
        raise RuntimeError(f"unflatten_: flat is too small: it has {flat.numel()} elements but the tensors need {total}")
    n = len(tensors)
    hit = _first_overlap([(i, _span(t)) for i, t in enumerate(tensors)] + [(n, _span(flat, total))])
    if hit is not None:
        i, j = hit
        if j == n:
            raise RuntimeError(f"unflatten_: tensors[{i}] overlaps flat in memory; the destinations must not share "
                               "memory with the part of flat that is read")
        raise RuntimeError(f"unflatten_: tensors[{j}] overlaps tensors[{i}] in memory; give distinct destinations")
    f = flat.view(-1)
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_((f[off:off + n].to(opmath(flat.dtype, t.dtype)) * scale).to(t.dtype).view_as(t))
        off += n


def _reduce(tensors: Sequence[Tensor], divide: bool, scale: float) -> Tensor:
    """Sum in order 0..N-1 in the op's precision, on tensors[0]'s device."""
    acc_t = opmath(tensors[0].dtype)
    dev = tensors[0].device
    acc = tensors[0].to(acc_t, copy=True)
    for t in tensors[1:]:
        acc += t.to(dev).to(acc_t)
    acc = acc / len(tensors) if divide else acc * scale
    return acc.to(tensors[0].dtype)


def all_reduce_(buffers: Sequence[Tensor], op: str = "sum", algo: str = "auto") -> None:
    if op not in ("sum", "mean"):
        raise RuntimeError(f'all_reduce_: op must be "sum" or "mean", got "{op}"')
    if len(buffers) == 0:
        raise RuntimeError("all_reduce_: buffers must be a non-empty list")
    hit = _first_overlap((i, _span(b)) for i, b in enumerate(buffers))
    if hit is not None:
        raise RuntimeError(f"all_reduce_: buffers[{hit[1]}] aliases another buffer; give distinct buffers "
                           f"(it overlaps buffers[{hit[0]}] in memory)")
    if len(buffers) == 1:
        return
    result = _reduce(buffers, op == "mean", 1.0)
    for b in buffers:
        b.copy_(result)


def broadcast_(src: Tensor, dsts: Sequence[Tensor]) -> None:
    _check_broadcast_disjoint("broadcast_", [src], dsts)
    for d in dsts:
        if d.data_ptr() != src.data_ptr():
            d.copy_(src.reshape(d.shape))  # flat, as the kernels copy: same numel, any shape


def all_reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0) -> None:
    """tensor_lists[d][p]: tensor p of device d. Every list ends with scale * sum over devices."""
    _check_lists_disjoint("all_reduce_tensors_", [t for lst in tensor_lists for t in lst], len(tensor_lists[0]))
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        result = _reduce(group, False, scale)
        for t in group:
            t.copy_(result)


def reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0, zero_others: bool = True) -> None:
    """tensor_lists[0][p] <- scale * sum over the lists; other lists zeroed when zero_others."""
    _check_lists_disjoint("reduce_tensors_", [t for lst in tensor_lists for t in lst], len(tensor_lists[0]))
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        group[0].copy_(_reduce(group, False, scale))
        if zero_others:
            for t in group[1:]:
                t.zero_()


def broadcast_tensors_(srcs: Sequence[Tensor], dst_lists: Sequence[Sequence[Tensor]]) -> None:
    _check_broadcast_disjoint("broadcast_tensors_", srcs, [t for lst in dst_lists for t in lst])
    for lst in dst_lists:
        for s, d in zip(srcs, lst):
            if d.data_ptr() != s.data_ptr():
                d.copy_(s.reshape(d.shape))
