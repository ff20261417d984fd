"""Pure-PyTorch versions of every op: what the tests compare against, and the fallback when the
compiled extension is missing. Same semantics as the kernels, including the rounding rule:
out = To(OpMath(x) * scale), OpMath = float64 if either side is float64 else float32, and
reductions sum in the fixed order 0..N-1 in that precision.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def opmath(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check_dtype(op: str, what: str, t: Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"{op}: {what} has unsupported dtype {t.dtype} "
                           "(supported: float32, float16, bfloat16, float64)")


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
    if len(buffers) == 1:
        return
    result = _reduce(buffers, op == "mean", 1.0)
    for b in buffers:
        b.copy_(result)


def broadcast_(src: Tensor, dsts: Sequence[Tensor]) -> None:
    for d in dsts:
        if d.data_ptr() != src.data_ptr():
            d.copy_(src)


def all_reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0) -> None:
    """tensor_lists[d][p]: tensor p of device d. Every list ends with scale * sum over devices."""
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        result = _reduce(group, False, scale)
        for t in group:
            t.copy_(result)


def reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0, zero_others: bool = True) -> None:
    """tensor_lists[0][p] <- scale * sum over devices; other lists zeroed when zero_others."""
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        group[0].copy_(_reduce(group, False, scale))
        if zero_others:
            for t in group[1:]:
                t.zero_()


def broadcast_tensors_(srcs: Sequence[Tensor], dst_lists: Sequence[Sequence[Tensor]]) -> None:
    for lst in dst_lists:
        for s, d in zip(srcs, lst):
            if d.data_ptr() != s.data_ptr():
                d.copy_(s)
