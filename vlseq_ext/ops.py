"""Thin wrappers over the torch.ops.vlseq_ext ops, with fake implementations for torch.compile
and a fallback to vlseq_ext.reference when the compiled extension is missing.

Trainer code calls these, never _C or torch.ops directly.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _ext, reference

__all__ = [
    "has_extension",
    "has_cuda_kernels",
    "flatten",
    "unflatten_",
    "all_reduce_",
    "broadcast_",
    "DeviceLists",
    "all_reduce_tensors_",
    "reduce_tensors_",
    "broadcast_tensors_",
    "p2p_status",
]


def has_extension() -> bool:
    """True when the compiled extension (at least its CPU kernels) is loaded."""
    return _ext.LOADED


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels are registered (the extension was built with a CUDA toolkit)."""
    return _ext.has_kernel("flatten_", "CUDA")


def _native() -> bool:
    if _ext.LOADED:
        return True
    _ext.warn_fallback_once()
    return False


def flatten(
    tensors: Sequence[Optional[Tensor]],
    out: Optional[Tensor] = None,
    scale: float = 1.0,
    numels: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Copy `tensors` (any shapes, one device) into consecutive slices of one flat buffer, times
    `scale`, and return the buffer.

    Slice i holds numels[i] elements; a None entry (e.g. the grad of an unused parameter) fills
    its slice with zeros, so `numels` is required when an entry is None. `out` (contiguous, at
    least sum(numels) elements, on the tensors' device) is written in place; when omitted it is
    allocated with `dtype` (default: the first tensor's dtype). Inputs may have a dtype other
    than `out`'s: values are converted on the fly. On CUDA this is one kernel launch.
    """
    tensors = list(tensors)
    if not tensors:
        # Checked here too: torch 2.11's dispatcher crashes on an empty Tensor?[] with a CUDA `out`.
        raise ValueError("flatten: tensors must be a non-empty list")
    if numels is None:
        missing = [i for i, t in enumerate(tensors) if t is None]
        if missing:
            raise ValueError(f"flatten: tensors[{missing[0]}] is None, so numels must be given")
        numels = [t.numel() for t in tensors]
    numels = [int(n) for n in numels]
    if len(numels) != len(tensors):
        raise ValueError(f"flatten: numels has {len(numels)} entries but tensors has {len(tensors)}")
    if out is None:
        present = [t for t in tensors if t is not None]
        if not present:
            raise ValueError("flatten: every tensor is None; pass `out` so the device and dtype are known")
        out = torch.empty(sum(numels), dtype=dtype or present[0].dtype, device=present[0].device)
    if _native():
        torch.ops.vlseq_ext.flatten_(tensors, numels, out, float(scale))
    else:
        reference.flatten_(tensors, numels, out, float(scale))
    return out


def unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float = 1.0) -> None:
    """Inverse of `flatten`: tensors[i] <- flat[slice i].view_as(tensors[i]) * scale, in place.
    One launch on CUDA; dtypes may differ between `flat` and the tensors."""
    if _native():
        torch.ops.vlseq_ext.unflatten_(flat, list(tensors), float(scale))
    else:
        reference.unflatten_(flat, list(tensors), float(scale))


def all_reduce_(buffers: Sequence[Tensor], op: str = "sum", algo: str = "auto") -> None:
    """Sum (or mean) one flat buffer per device into all of them, in place.

    Buffers: one per CUDA device (or distinct CPU tensors), same numel and dtype
    (float32/float16/bfloat16/float64), contiguous. The sum runs in device order 0..N-1 with
    fp32 accumulation (fp64 for float64), so every buffer ends with identical bits on every run.
    `algo`: "auto" (measured size threshold), "root" (one kernel on the first device reads and
    writes every buffer), "one_shot", "two_shot" or "copy_engine" (no peer access). Ordered
    against each device's current stream with events; no host sync.
    """
    if _native():
        torch.ops.vlseq_ext.all_reduce_(list(buffers), op, algo)
    else:
        reference.all_reduce_(list(buffers), op, algo)


def broadcast_(src: Tensor, dsts: Sequence[Tensor]) -> None:
    """Copy `src` into every tensor of `dsts` (same numel and dtype; typically on other devices)
    over direct peer reads, ordered with events on the devices' current streams."""
    if _native():
        torch.ops.vlseq_ext.broadcast_(src, list(dsts))
    else:
        reference.broadcast_(src, list(dsts))


class DeviceLists:
    """Per-device tensor lists (lists[d][p]: tensor p of device d), checked and laid out once for
    ops that are called every step on the same tensors (the trainer's merge)."""

    __slots__ = ("lists", "flat", "num_devices")

    def __init__(self, tensor_lists: Sequence[Sequence[Tensor]], op: str = "DeviceLists") -> None:
        self.lists = [list(lst) for lst in tensor_lists]
        if not self.lists:
            raise ValueError(f"{op}: tensor_lists must be a non-empty list")
        sizes = {len(lst) for lst in self.lists}
        if len(sizes) != 1:
            raise ValueError(f"{op}: every device needs the same number of tensors, got {sorted(sizes)}")
        self.flat = [t for lst in self.lists for t in lst]
        self.num_devices = len(self.lists)


def _as_lists(tensor_lists, op: str) -> DeviceLists:
    return tensor_lists if isinstance(tensor_lists, DeviceLists) else DeviceLists(tensor_lists, op)


def all_reduce_tensors_(tensor_lists, scale: float = 1.0, algo: str = "auto") -> None:
    """Fused flatten + all-reduce + unflatten: tensor_lists[d] is device d's list of tensors
    (same shapes and dtypes on every device), or a DeviceLists. Afterwards every
    tensor_lists[d][p] equals scale * sum_e tensor_lists[e][p], summed in device order,
    bit-identical on all devices. `algo`: "auto", "root" (one kernel on device 0 reads every
    device's tensors and stores the result into all of them: the fewest host operations, best
    for a model's gradients), "two_shot" (each device reduces its share of the elements and
    stores it everywhere: best for large lists) or "copy_engine"."""
    packed = _as_lists(tensor_lists, "all_reduce_tensors_")
    if _native():
        torch.ops.vlseq_ext.all_reduce_tensors_(packed.flat, packed.num_devices, float(scale), algo)
    else:
        reference.all_reduce_tensors_(packed.lists, float(scale))


def reduce_tensors_(tensor_lists, scale: float = 1.0, zero_others: bool = True) -> None:
    """tensor_lists[0][p] <- scale * sum_d tensor_lists[d][p] (device order, one kernel on device
    0's GPU reading its peers), and with `zero_others` every other list is zeroed in the same
    kernel. The trainer's merge: the master gets the gradient, the replicas restart from zero.
    Accepts nested lists or a DeviceLists."""
    packed = _as_lists(tensor_lists, "reduce_tensors_")
    if _native():
        torch.ops.vlseq_ext.reduce_tensors_(packed.flat, packed.num_devices, float(scale), bool(zero_others))
    else:
        reference.reduce_tensors_(packed.lists, float(scale), bool(zero_others))


def broadcast_tensors_(srcs: Sequence[Tensor], dst_lists: Sequence[Sequence[Tensor]]) -> None:
    """dst_lists[d][p] <- srcs[p] for every destination list: one kernel on the source device
    stores into every destination over the peer path."""
    srcs = list(srcs)
    lists = [list(lst) for lst in dst_lists]
    for i, lst in enumerate(lists):
        if len(lst) != len(srcs):
            raise ValueError(f"broadcast_tensors_: dst_lists[{i}] has {len(lst)} tensors but srcs has {len(srcs)}")
    if not lists:
        return
    if _native():
        torch.ops.vlseq_ext.broadcast_tensors_(srcs, [t for lst in lists for t in lst])
    else:
        reference.broadcast_tensors_(srcs, lists)


def p2p_status(buffers: Sequence[Tensor]) -> str:
    """Which path all_reduce_ takes for these buffers: "p2p", "copy_engine: <why>", "single" or "cpu"."""
    if not _native():
        return "reference"
    return torch.ops.vlseq_ext.p2p_status(list(buffers))


def _register_fakes() -> None:
    """Fake (meta) implementations so torch.compile can trace graphs that call the ops. All
    ops mutate their inputs in place and return nothing, so the fakes only return None."""
    if not _ext.LOADED:
        return

    def _none(*args, **kwargs) -> None:
        return None

    for name in ("flatten_", "unflatten_", "all_reduce_", "broadcast_", "all_reduce_tensors_", "reduce_tensors_",
                 "broadcast_tensors_"):
        torch.library.register_fake(f"vlseq_ext::{name}")(_none)
    torch.library.register_fake("vlseq_ext::p2p_status")(lambda buffers: "fake")


_register_fakes()
