"""Thin wrappers over the torch.ops.vlseq_ext ops, with fake implementations for torch.compile
and a fallback to vlseq_ext.reference when the compiled extension is missing.

Trainer code calls these, never _C or torch.ops directly.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _ext, reference
from . import _op_registrations  # noqa: F401 - importing registers the fake kernels and mm_tf32's autograd

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
    "has_rnn_kernels",
    "rnn_forward",
    "rnn_backward",
    "rnn_plan",
    "mm_tf32",
]


def has_extension() -> bool:
    """True when the compiled extension (at least its CPU kernels) is loaded."""
    return _ext.LOADED


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels are registered (the extension was built with a CUDA toolkit)."""
    return _ext.has_kernel("flatten_", "CUDA")


def _tensor_list(tensors, op: str, arg: str, empty_ok: bool = False) -> list:
    # Empty lists are checked here as well as in C++: with no tensor argument the dispatcher cannot
    # pick a kernel and fails with a generic message.
    if isinstance(tensors, Tensor) or not isinstance(tensors, Iterable):
        raise TypeError(f"{op}: {arg} must be a list of tensors, got {_describe(tensors)}")
    tensors = list(tensors)
    if not tensors and not empty_ok:
        raise ValueError(f"{op}: {arg} must be a non-empty list")
    return tensors


def _describe(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _type_error(op: str, args) -> Optional[TypeError]:
    """A TypeError naming the first of `args` ((name, value, None allowed) triples) that is not a
    tensor, or None."""
    for name, value, none_ok in args:
        if not (isinstance(value, Tensor) or (none_ok and value is None)):
            kind = "a torch.Tensor or None" if none_ok else "a torch.Tensor"
            return TypeError(f"{op}: {name} must be {kind}, got {_describe(value)}")
    return None


def _entries(arg: str, values, none_ok: bool = False):
    return ((f"{arg}[{i}]", v, none_ok) for i, v in enumerate(values))


def _run(op: str, args, native, fallback):
    """Calls the compiled op, or the reference without the extension, and returns its result.
    `args()` yields the tensor arguments as (name, value, None allowed): a non-tensor among them
    becomes a TypeError naming it. For the compiled op that check runs only after a failure (the
    dispatcher refuses non-tensors before any kernel runs, and checking every call would cost the
    hot path); the reference could write part of its result first, so it is checked up front."""
    if not _native():
        err = _type_error(op, args())
        if err is not None:
            raise err
        return fallback()
    try:
        return native()
    except (RuntimeError, TypeError):
        err = _type_error(op, args())
        if err is None:
            raise
        raise err from None


def _native() -> bool:
    if _ext.LOADED:
        return True
    _ext.warn_fallback_once()
    return False


def _count(n: object, i: int) -> int:
    """numels[i] as an int: int() would turn 2.9 into 2 and True into 1 without a word."""
    try:
        if isinstance(n, bool) or isinstance(n, Tensor) and n.dtype == torch.bool:
            raise TypeError
        value = operator.index(n)  # ints, NumPy integers, integer 0-dim tensors
    except TypeError:
        raise TypeError(f"flatten: numels[{i}] must be a whole number of elements, got {n!r}") from None
    if not -2**63 <= value < 2**63:
        raise ValueError(f"flatten: numels[{i}] = {value} does not fit in int64")
    return value


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
    than `out`'s: values are converted on the fly, as Tensor.to() converts them (a value beyond a
    narrower `out` dtype's range becomes +-inf, which the trainer's non-finite guard then catches;
    check torch.isfinite(out) when you cast down yourself). No input may share memory with the part of
    `out` that is written. On CUDA this is one kernel launch.
    """
    # Checked here too: torch 2.11's dispatcher crashed on an empty Tensor?[] with a CUDA `out`.
    tensors = _tensor_list(tensors, "flatten", "tensors")
    args = lambda: [*_entries("tensors", tensors, none_ok=True), ("out", out, out is None)]  # noqa: E731
    try:  # numel(), dtype and device below fail on a non-tensor: say which
        if numels is None:
            missing = [i for i, t in enumerate(tensors) if t is None]
            if missing:
                raise ValueError(f"flatten: tensors[{missing[0]}] is None, so numels must be given")
            numels = [t.numel() for t in tensors]
        numels = [_count(n, i) for i, n in enumerate(numels)]
        if len(numels) != len(tensors):
            raise ValueError(f"flatten: numels has {len(numels)} entries but tensors has {len(tensors)}")
        if out is None:
            present = [t for t in tensors if t is not None]
            if not present:
                raise ValueError("flatten: every tensor is None; pass `out` so the device and dtype are known")
            out = torch.empty(sum(numels), dtype=dtype or present[0].dtype, device=present[0].device)
    except AttributeError:
        err = _type_error("flatten", args())
        if err is None:
            raise
        raise err from None
    _run("flatten", args,
         lambda: torch.ops.vlseq_ext.flatten_(tensors, numels, out, float(scale)),
         lambda: reference.flatten_(tensors, numels, out, float(scale)))
    return out


def unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float = 1.0) -> None:
    """Inverse of `flatten`: tensors[i] <- flat[slice i].view_as(tensors[i]) * scale, in place.
    One launch on CUDA; dtypes may differ between `flat` and the tensors. The destinations may
    share memory neither with each other nor with the part of `flat` that is read."""
    tensors = _tensor_list(tensors, "unflatten_", "tensors", empty_ok=True)  # `flat` picks the kernel
    _run("unflatten_", lambda: [("flat", flat, False), *_entries("tensors", tensors)],
         lambda: torch.ops.vlseq_ext.unflatten_(flat, tensors, float(scale)),
         lambda: reference.unflatten_(flat, tensors, float(scale)))


def all_reduce_(buffers: Sequence[Tensor], op: str = "sum", algo: str = "auto") -> None:
    """Sum (or mean) one flat buffer per device into all of them, in place.

    Buffers: one per CUDA device (or distinct CPU tensors), same numel and dtype
    (float32/float16/bfloat16/float64), contiguous, none sharing memory with another. The sum
    runs in device order 0..N-1 with fp32 accumulation (fp64 for float64), so every buffer ends
    with identical bits on every run. `algo`: "auto" (measured size threshold), "root" (one
    kernel on the first device reads and writes every buffer), "one_shot", "two_shot" or
    "copy_engine" (no peer access). Ordered against each device's current stream with events;
    no host sync.
    """
    buffers = _tensor_list(buffers, "all_reduce_", "buffers")
    _run("all_reduce_", lambda: _entries("buffers", buffers),
         lambda: torch.ops.vlseq_ext.all_reduce_(buffers, op, algo),
         lambda: reference.all_reduce_(buffers, op, algo))


def broadcast_(src: Tensor, dsts: Sequence[Tensor]) -> None:
    """Copy `src` into every tensor of `dsts` (same numel and dtype; typically on other devices)
    over direct peer reads, ordered with events on the devices' current streams. Destinations may
    not share memory with each other or with `src`, except a destination that is `src` itself."""
    dsts = _tensor_list(dsts, "broadcast_", "dsts")
    _run("broadcast_", lambda: [("src", src, False), *_entries("dsts", dsts)],
         lambda: torch.ops.vlseq_ext.broadcast_(src, dsts),
         lambda: reference.broadcast_(src, dsts))


class DeviceLists:
    """Per-device tensor lists (lists[d][p]: tensor p of device d), checked and laid out once for
    ops that are called every step on the same tensors (the trainer's merge)."""

    __slots__ = ("lists", "flat", "num_devices")

    def __init__(self, tensor_lists: Sequence[Sequence[Tensor]], op: str = "DeviceLists") -> None:
        self.lists = [_tensor_list(lst, op, f"tensor_lists[{d}]", empty_ok=True)
                      for d, lst in enumerate(_tensor_list(tensor_lists, op, "tensor_lists"))]
        sizes = {len(lst) for lst in self.lists}
        if len(sizes) != 1:
            raise ValueError(f"{op}: every device needs the same number of tensors, got {sorted(sizes)}")
        if 0 in sizes:
            raise ValueError(f"{op}: tensors must be a non-empty list (every device list is empty)")
        self.flat = [t for lst in self.lists for t in lst]
        self.num_devices = len(self.lists)

    def entries(self):
        """(name, tensor, False) for every tensor, named tensor_lists[d][p]."""
        return ((f"tensor_lists[{d}][{p}]", t, False) for d, lst in enumerate(self.lists) for p, t in enumerate(lst))


def _as_lists(tensor_lists, op: str) -> DeviceLists:
    return tensor_lists if isinstance(tensor_lists, DeviceLists) else DeviceLists(tensor_lists, op)


def all_reduce_tensors_(tensor_lists, scale: float = 1.0, algo: str = "auto") -> None:
    """Fused flatten + all-reduce + unflatten: tensor_lists[d] is device d's list of tensors
    (same shapes and dtypes on every device), or a DeviceLists. Afterwards every
    tensor_lists[d][p] equals scale * sum_e tensor_lists[e][p], summed in device order,
    bit-identical on all devices. `algo`: "auto", "root" (one kernel on device 0 reads every
    device's tensors and stores the result into all of them: the fewest host operations, best
    for a model's gradients), "two_shot" (each device reduces its share of the elements and
    stores it everywhere: best for large lists) or "copy_engine". One list per CUDA device; no
    tensor may share memory with another."""
    packed = _as_lists(tensor_lists, "all_reduce_tensors_")
    _run("all_reduce_tensors_", packed.entries,
         lambda: torch.ops.vlseq_ext.all_reduce_tensors_(packed.flat, packed.num_devices, float(scale), algo),
         lambda: reference.all_reduce_tensors_(packed.lists, float(scale)))


def reduce_tensors_(tensor_lists, scale: float = 1.0, zero_others: bool = True) -> None:
    """tensor_lists[0][p] <- scale * sum_d tensor_lists[d][p] (list order, one kernel on list 0's
    GPU reading its peers), and with `zero_others` every other list is zeroed in the same kernel.
    The trainer's merge: the master gets the gradient, the replicas restart from zero. Accepts
    nested lists or a DeviceLists, at most 8 lists on CUDA. Several lists may be on one device
    (e.g. the gradients of several streams); the op is ordered with each device's current stream
    only, so work on other streams must be ordered with it by the caller. No tensor may share
    memory with another."""
    packed = _as_lists(tensor_lists, "reduce_tensors_")
    _run("reduce_tensors_", packed.entries,
         lambda: torch.ops.vlseq_ext.reduce_tensors_(packed.flat, packed.num_devices, float(scale), bool(zero_others)),
         lambda: reference.reduce_tensors_(packed.lists, float(scale), bool(zero_others)))


def broadcast_tensors_(srcs: Sequence[Tensor], dst_lists: Sequence[Sequence[Tensor]]) -> None:
    """dst_lists[d][p] <- srcs[p] for every destination list: one kernel on the source device
    stores into every destination over the peer path. Destinations may not share memory with each
    other or with a source, except a destination that is its own source."""
    srcs = _tensor_list(srcs, "broadcast_tensors_", "srcs")
    if isinstance(dst_lists, Tensor) or not isinstance(dst_lists, Iterable):
        raise TypeError(f"broadcast_tensors_: dst_lists must be a list of tensor lists, got {_describe(dst_lists)}")
    lists = [_tensor_list(lst, "broadcast_tensors_", f"dst_lists[{i}]") for i, lst in enumerate(dst_lists)]
    for i, lst in enumerate(lists):
        if len(lst) != len(srcs):
            raise ValueError(f"broadcast_tensors_: dst_lists[{i}] has {len(lst)} tensors but srcs has {len(srcs)}")
    if not lists:
        return
    args = lambda: [*_entries("srcs", srcs), *((f"dst_lists[{d}][{p}]", t, False)  # noqa: E731
                                                for d, lst in enumerate(lists) for p, t in enumerate(lst))]
    _run("broadcast_tensors_", args,
         lambda: torch.ops.vlseq_ext.broadcast_tensors_(srcs, [t for lst in lists for t in lst]),
         lambda: reference.broadcast_tensors_(srcs, lists))


def p2p_status(buffers: Sequence[Tensor]) -> str:
    """Which path all_reduce_ takes for these buffers: "p2p", "copy_engine: <why>", "single" or "cpu"."""
    buffers = _tensor_list(buffers, "p2p_status", "buffers")
    return _run("p2p_status", lambda: _entries("buffers", buffers),
                lambda: torch.ops.vlseq_ext.p2p_status(buffers), lambda: "reference")


def has_rnn_kernels() -> bool:
    """True when the persistent recurrent kernels are registered for CUDA."""
    return _ext.has_kernel("rnn_forward", "CUDA")


def _rnn_args(names, values):
    return [(n, v, n in ("b_hh", "c0", "dy", "dh_n", "dc_n")) for n, v in zip(names, values)]


def rnn_forward(cell: str, xproj: Tensor, w_hh: Tensor, b_hh: Optional[Tensor], h0: Tensor, c0: Optional[Tensor],
                lengths: Tensor, reverse: bool = False, weights: str = "fp32", max_blocks: int = 0):
    """One LSTM/GRU layer in one direction over a zero-padded batch with per-sample lengths: the
    recurrence after the input projection. Returns (y, h_n, c_n, saved, cs); see
    csrc/include/vlseq/rnn.h for shapes and what each holds. `cell`: "lstm" | "gru"; `weights`:
    "fp32" | "tf32" | "bf16" (the recurrent products' precision: "tf32" runs them on the tensor cores
    where the grid layout has a kernel for the shape, the forward's from 8 samples a group with W_hh and
    h in fp16, W_hh scaled by a power of 2 per row (TF32's 11 significant bits), the backward's from 2
    samples with W_hh and the gate gradients in fp16 (scaled per column, and per block and sample), as
    fp32 elsewhere and on the CPU; "bf16" rounds W_hh to bfloat16, then runs as "tf32" where that holds
    the layer, else holds W_hh in bfloat16 on chip; state and sums stay fp32). All
    float32 and contiguous on one device, lengths int64 there (clamped to [0, T] by the kernels).
    On CUDA one persistent launch runs every step (csrc/cuda/rnn.cu), planned for at most
    `max_blocks` SMs (0: the whole GPU; rnn_backward must get the same). Writes only new tensors."""
    values = (xproj, w_hh, b_hh, h0, c0, lengths)
    args = lambda: _rnn_args(("xproj", "w_hh", "b_hh", "h0", "c0", "lengths"), values)  # noqa: E731
    return _run("rnn_forward", args,
                lambda: torch.ops.vlseq_ext.rnn_forward(cell, *values, bool(reverse), weights, int(max_blocks)),
                lambda: reference.rnn_forward(cell, *values, bool(reverse), weights))


def rnn_backward(cell: str, w_hh: Tensor, y: Tensor, saved: Tensor, cs: Tensor, h0: Tensor, c0: Optional[Tensor],
                 lengths: Tensor, dy: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor],
                 reverse: bool = False, weights: str = "fp32", max_blocks: int = 0):
    """Backward of rnn_forward through the recurrence: (dgates, dgates_hn, dh0, dc0), where dgates is
    the gradient of xproj and, for a GRU, dgates_hn that of W_hn h + b_hn (rnn.h). Missing dy, dh_n,
    dc_n count as zeros. Weight gradients are GEMMs of these (vlseq_ext.nn.functional)."""
    values = (w_hh, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n)
    args = lambda: _rnn_args(("w_hh", "y", "saved", "cs", "h0", "c0", "lengths", "dy", "dh_n", "dc_n"),  # noqa: E731
                             values)
    return _run("rnn_backward", args,
                lambda: torch.ops.vlseq_ext.rnn_backward(cell, *values, bool(reverse), weights, int(max_blocks)),
                lambda: reference.rnn_backward(cell, *values, bool(reverse), weights))


def rnn_plan(cell: str, hidden_size: int, batch: int, weights: str, device, max_blocks: int = 0) -> str:
    """How the kernels would run a layer of this size on `device` within `max_blocks` SMs (0: all):
    on CUDA the layout ("cluster 16 blocks x 2 groups, ..."; "<forward's>; backward: <its own>" where
    the two launches take different layouts), or "" when W_hh does not fit on chip (or the GPU has no
    thread-block clusters); "cpu" for the CPU; "" without the compiled kernels."""
    device = torch.device(device)
    if device.type == "cuda" and not has_rnn_kernels():
        return ""
    if not _native():
        return "cpu" if device.type == "cpu" else ""
    like = torch.empty(0, device=device)
    return torch.ops.vlseq_ext.rnn_plan(cell, int(hidden_size), int(batch), weights, like, int(max_blocks))


def mm_tf32(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """a @ b (+ bias) of float32 matrices as a new tensor: on CUDA with TF32 products on the tensor
    cores and float32 sums whatever torch.backends.cuda.matmul.allow_tf32 says (cuBLASLt; the GEMMs of
    vlseq_ext.nn's "tf32" mode); exact on the CPU. Operands may be transposed views (no copy).
    Differentiable (its backward's products on mm_tf32 too)."""
    args = lambda: [("a", a, False), ("b", b, False), ("bias", bias, True)]  # noqa: E731
    return _run("mm_tf32", args, lambda: torch.ops.vlseq_ext.mm_tf32(a, b, bias), lambda: reference.mm_tf32(a, b, bias))
