"""Drop-in `nn.LSTM` / `nn.GRU` that run on the persistent kernels where they can.

Same constructor, parameters, state_dict and outputs as torch's modules (they are subclasses), plus
`lengths=` for zero-padded input: each sample then runs its own steps only (outputs zero past its
length, h_n/c_n at its last step), which equals running it alone. `PackedSequence` input runs the
same way. Where the kernels cannot run a call (CPU tensors, `proj_size`, a dtype other than float32,
a GPU without thread-block clusters, a layer too large to keep on chip) the module runs torch's own
implementation with the same semantics; with `kernels="vlseq"` it says so once per reason. Double
backward through the kernels is not supported (it raises).
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional, Set

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence, pad_sequence

from .. import ops
from . import arguments, concurrency, functional, gather

__all__ = ["LSTM", "GRU", "KERNEL_CHOICES", "use_kernels", "VlseqFallbackWarning"]

KERNEL_CHOICES = ("auto", "vlseq", "cudnn")
# "auto" follows the rnn bench on an H200 (BENCHMARKS.md; forward + backward, ours against cuDNN in the
# same run). cuDNN stays where it measured faster or the same:
# - unpadded input up to hidden 64, where cuDNN runs its own persistent kernel (ours 0.83x for one
#   sample before the sixteenth session's single-block work, not measured since; 1.00x for 32 after
#   it: at parity, nothing to gain); at hidden 128 ours measured faster (LSTM 2.1x /
#   2.0x for 1 / 32 samples, GRU 1.3x and bidirectional GRU 1.4x for 32); hidden 65-127 is unmeasured
#   and goes to ours;
# - under bf16 autocast, layers that only the kernels holding W_hh in bfloat16 hold (hidden past ~1,360
#   for an LSTM): those kernels measured 0.98x cuDNN's bf16 at hidden 256 and 0.66x at 1024 (twenty-fifth
#   session). Elsewhere bf16 runs on the tf32 kernels with W_hh rounded to bfloat16 (the plan says so).
# Everywhere else ours measured faster: 2.55-4.1x at hidden 256, 3.96x at hidden 512 and 2.5x at 1024
# for one sample, 2.9-11x on batches with per-sample lengths, which cuDNN runs packed, and LSTM 1024 at
# batch 32 2.0x of cuDNN in fp32 and 3.2x in TF32 (where cuDNN runs TF32, so do ours); under bf16
# autocast, on the tf32 kernels, 2.11x cuDNN's bf16 at LSTM 256 x 2 (twenty-sixth session, run 3) and
# 1.64x at LSTM 1024, batch 32 (twenty-seventh session, run 4).
AUTO_CUDNN_MAX_HIDDEN = 64
AUTO_BF16_PLAN = "W_hh rounded to bfloat16"

# The CPU kernels (ops.rnn_forward on CPU) are slower than torch's CPU RNN, so the modules never pick
# them; tests set this to run the modules' kernel path (input handling, packing) on CPU-only CI.
CPU_KERNELS = False


class VlseqFallbackWarning(UserWarning):
    """A vlseq_ext.nn module asked for the kernels (kernels="vlseq") ran torch's RNN instead."""


_warned: Set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"vlseq_ext.nn: running torch's RNN instead of the vlseq kernels: {reason}",
                      VlseqFallbackWarning, stacklevel=4)


def _check_kernels(kernels: str) -> str:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}; got {kernels!r}")
    return kernels


def _padded(samples: List[Tensor]) -> Tensor:
    """pad_sequence(samples, batch_first=True): (B, max steps, ...), zeros past each sample's steps.
    On a GPU, where no gradient flows to the samples (a gathered batch of data), one launch
    (_padded_flat) where pad_sequence makes a copy per sample: a gathered step of 32 one-sample
    passes went from 102 to 70 memcpy calls, its time within the host's spread (BENCHMARKS.md,
    thirty-eighth session). On the CPU the copies are the cheaper (57 against 82 us for 32 small
    samples), and an extension built without CUDA has no flatten for the GPU."""
    if (not samples[0].is_cuda or not ops.has_cuda_kernels()
            or (torch.is_grad_enabled() and any(s.requires_grad for s in samples))):
        return pad_sequence(samples, batch_first=True)
    return _padded_flat(samples)


def _padded_flat(samples: List[Tensor]) -> Tensor:
    """pad_sequence(samples, batch_first=True) by one ops.flatten: each sample, then a run of zeros
    (a None entry) to the longest one's steps. Not differentiable; samples share dtype and device."""
    T = max(s.shape[0] for s in samples)
    row = math.prod(samples[0].shape[1:])
    parts: List[Optional[Tensor]] = []
    numels: List[int] = []
    for s in samples:
        parts += [s, None]
        numels += [s.numel(), (T - s.shape[0]) * row]
    return ops.flatten(parts, numels=numels).view(len(samples), T, *samples[0].shape[1:])


class _KernelRNN:
    """What LSTM and GRU share: the choice of implementation per call and the input handling."""

    kernels: str = "vlseq"

    def kernel_fallback_reason(self, x: Tensor, batch: int) -> Optional[str]:
        """Why this call cannot run on the kernels, or None when it can."""
        if not x.is_cuda and not (CPU_KERNELS and x.device.type == "cpu" and ops.has_extension()):
            return "the input is not on a CUDA device"
        if x.is_cuda and not ops.has_rnn_kernels():
            return "the extension was built without its CUDA kernels"
        if getattr(self, "proj_size", 0):
            return "proj_size is not supported"
        params = {p.dtype for p in self.parameters()}
        if params != {torch.float32}:
            return f"the kernels take float32 parameters, got {', '.join(sorted(map(str, params)))}"
        if x.dtype != torch.float32 and not (x.dtype == torch.bfloat16 and functional.precision_for(x) == "bf16"):
            return f"the kernels take float32 input (or bfloat16 under bf16 autocast), got {x.dtype}"
        if any(p.device != x.device for p in self.parameters()):
            return "parameters and input are on different devices"
        if not self._plan(batch, x.device):
            cell = "lstm" if isinstance(self, nn.LSTM) else "gru"
            if batch > 1 and self._plan(1, x.device):  # W_hh fits: the batch is what does not
                return (f"a batch of {batch} samples of a {cell} of hidden size {self.hidden_size} is more "
                        f"than the kernels hold at once on {x.device} (smaller batches run on them)")
            return f"a {cell} of hidden size {self.hidden_size} does not fit the kernels on {x.device}"
        return None

    def _plan(self, batch: int, device: torch.device, max_blocks: int = 0, weights: str = "fp32") -> str:
        # Cached per module: rnn_plan is cached in C++ too, but each call allocates a tensor.
        cache = self.__dict__.setdefault("_vlseq_plans", {})
        cell = "lstm" if isinstance(self, nn.LSTM) else "gru"
        key = (cell, self.hidden_size, batch, str(device), max_blocks, weights)
        if key not in cache:
            cache[key] = ops.rnn_plan(cell, self.hidden_size, batch, weights, device, max_blocks)
        return cache[key]

    def _layout(self, x: Tensor, batch: int, steps: int, host_bound: bool = False) -> dict:
        """How functional.rnn runs this call's layers (its keyword arguments): the time windows to
        pipeline a unidirectional stack over and the SMs each of its launches may take
        (concurrency.pipeline_layout), the SMs each direction of a bidirectional layer takes when the
        two run at once (concurrency.direction_blocks), and the SMs every other launch may take (0:
        all; concurrency.sm_budget). From the plans of the call's precision (the 16-bit grid kernels
        are tf32's only). `host_bound`: the call's host is the bottleneck (a gathered batch), so a grid
        stack is not pipelined (pipeline_layout says why). Nothing off the GPU."""
        layout = {"chunks": 1, "side_by_side_blocks": 0, "max_blocks": 0}
        if not x.is_cuda:
            return layout
        sms = concurrency.sm_count(x.device)
        budget = concurrency.budget()
        weights = functional.precision_for(x)

        def plan(blocks: int) -> str:
            return self._plan(batch, x.device, blocks, weights)
        if budget is not None:
            # Within this thread's concurrency.sm_budget: one launch at a time, on the caller's stream
            # only (see sm_budget for why no side streams), within the budget where a plan fits in it.
            blocks = min(budget, sms)
            return {**layout, "max_blocks": blocks if blocks and plan(blocks) else 0}
        if self.bidirectional:
            return {**layout, "side_by_side_blocks": concurrency.direction_blocks(plan, sms)}
        if self.num_layers > 1:
            chunks, blocks = concurrency.pipeline_layout(plan, self.num_layers, steps, sms, grid=not host_bound)
            return {**layout, "chunks": chunks, "max_blocks": blocks}
        return layout

    def fills_gpu_alone(self, device: torch.device) -> bool:
        """Whether one sample's recurrence takes the whole GPU (the grid layout, or torch's RNN), so
        that one-sample passes cannot run side by side; False when it runs in one thread-block
        cluster, as many samples' recurrences can at once."""
        if self.kernels == "cudnn" or torch.device(device).type != "cuda":
            return True
        plan = self._plan(1, torch.device(device))
        return not plan or plan.startswith("grid")

    def uses_kernels(self, x: Tensor, batch: int, padded: bool) -> bool:
        """Whether a call with this input runs on the kernels (`padded`: the samples have different
        lengths, i.e. lengths or a PackedSequence were given)."""
        if self.kernels == "cudnn":
            return False
        reason = self.kernel_fallback_reason(x, batch)
        if reason is not None:
            if self.kernels == "vlseq":
                _warn_once(reason)
            return False
        if self.kernels == "auto":
            if not padded and self.hidden_size <= AUTO_CUDNN_MAX_HIDDEN:
                return False
            if functional.precision_for(x) == "bf16" and AUTO_BF16_PLAN not in self._plan(batch, x.device, weights="bf16"):
                return False  # the kernels holding W_hh in bfloat16 measured slower than cuDNN's bf16
        return True

    def _run(self, input, hx=None, lengths=None):
        caller = gather.active_caller()
        if caller is not None:  # a one-sample pass of gather.CallGatherer: this call joins a batch
            return caller.call(self, (input, hx, lengths))
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("lengths= is for padded input; a PackedSequence carries its own lengths")
            return self._run_packed(input, hx)
        x, hx, lengths, unbatched = self._as_batch(input, hx, lengths)
        out, state = self._run_batch(x, hx, lengths)
        return self._as_given(out, state, unbatched)

    def _as_batch(self, input, hx, lengths):
        """A call's arguments, checked, as (x (B, T, features) batch first, hx with a batch dim,
        lengths or None, whether the input was unbatched)."""
        if not isinstance(input, Tensor):
            raise TypeError(f"input must be a Tensor or a PackedSequence, got {type(input).__name__}")
        if input.dim() not in (2, 3):
            raise ValueError(f"input must be 2-D (steps, features) or 3-D, got shape {tuple(input.shape)}")
        if input.shape[-1] != self.input_size:
            raise ValueError(f"input has {input.shape[-1]} features per step, the module expects {self.input_size}")
        arguments.check_input_dtype(self, input)
        hx = arguments.state_kind(self, hx)
        unbatched = input.dim() == 2
        x = input.unsqueeze(0) if unbatched else (input if self.batch_first else input.transpose(0, 1))
        lengths = arguments.lengths_tensor(lengths, x.shape[0], x.shape[1], x.device, unbatched)
        if unbatched and hx is not None:
            hx = tuple(h.unsqueeze(1) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
        return x, hx, lengths, unbatched

    def _run_batch(self, x: Tensor, hx, lengths: Optional[Tensor], host_bound: bool = False):
        """x batch first (B, T, features): (output batch first, state); host_bound as _layout takes it."""
        B, T = x.shape[0], x.shape[1]
        if T == 0 or B == 0 or not self.uses_kernels(x, B, lengths is not None):
            return self._torch_padded(x, hx, lengths)
        steps = (lengths.to(x.device, non_blocking=True) if lengths is not None
                 else torch.full((B,), T, dtype=torch.long, device=x.device))
        arguments.check_state(self, hx, B, x)
        out, h_n, c_n = functional.rnn(self, x, steps, hx, **self._layout(x, B, T, host_bound))
        return out, ((h_n, c_n) if isinstance(self, nn.LSTM) else h_n)

    def _as_given(self, out: Tensor, state, unbatched: bool):
        """_run_batch's result in the layout of the call's input."""
        if unbatched:
            out = out.squeeze(0)
            state = tuple(s.squeeze(1) for s in state) if isinstance(state, tuple) else state.squeeze(1)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, state

    def run_calls(self, calls: List[tuple]) -> List[tuple]:
        """Several calls of this module, each (input, hx, lengths) as forward takes them, run as one
        padded batch with per-sample lengths (each sample runs its own steps only, so every call
        gets what it would have got alone, up to the rounding of a larger batch's plan). Returns one
        (True, (output, state)) or (False, exception) per call: a call that fails its checks fails
        alone. PackedSequence calls, and calls whose dtype or device differ from the first
        tensor call's, run on their own."""
        def joins(call: tuple, first: Optional[tuple]) -> Optional[tuple]:
            input, hx, lengths = call
            if isinstance(input, PackedSequence) or (first is not None and (input.dtype, input.device) !=
                                                     (first[0].dtype, first[0].device)):
                return None
            x, h, n, unbatched = self._as_batch(input, hx, lengths)
            if 0 in x.shape[:2]:  # no sample or no step: torch's own answer, as alone
                return None
            arguments.check_state(self, h, x.shape[0], x)
            return x, h, n, unbatched

        def run_joined(parts: List[tuple]) -> List[tuple]:
            results = self._run_joined([part[:3] for part in parts])
            return [self._as_given(out, state, part[3]) for part, (out, state) in zip(parts, results)]

        return gather.reply_calls(calls, joins, lambda call: self._run(*call), run_joined)

    def _run_joined(self, parts: List[tuple]) -> List[tuple]:
        """[(x (B_i, T_i, features), hx or None, lengths or None)] as one batch of sum(B_i) samples
        padded to max(T_i): each part's (output (B_i, T_i, ...), state) slices of the result."""
        if len(parts) == 1:
            return [self._run_batch(*parts[0], host_bound=True)]
        xs = [x for x, _, _ in parts]
        sizes = [x.shape[0] for x in xs]
        device = xs[0].device
        # Given lengths are on the input's device already (_as_batch); the others are known here,
        # on the host, where torch's packed fallback wants them (no wait for the GPU to read them).
        if all(n is None for _, _, n in parts):
            lengths = torch.tensor([x.shape[1] for x in xs for _ in range(x.shape[0])])
            if device.type == "cuda":
                lengths = lengths.pin_memory()  # its copy to the GPU then waits for nothing
        else:
            lengths = torch.cat([torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=device) if n is None
                                 else n for x, _, n in parts])
        x = _padded([s for x in xs for s in (x.unbind(0) if x.shape[0] > 1 else (x[0],))])
        hx = self._joined_state([h for _, h, _ in parts], sizes, x)
        out, state = self._run_batch(x, hx, lengths, host_bound=True)
        # split, not one slice per part: its backward is one concatenation, where k slices would
        # each scatter into a zeroed tensor of the whole batch's size.
        outs = out.split(sizes, 0)
        if isinstance(state, tuple):
            states = list(zip(*(s.split(sizes, 1) for s in state)))
        else:
            states = state.split(sizes, 1)
        return [(o[:, :part.shape[1]], s) for o, s, part in zip(outs, states, xs)]

    def _joined_state(self, states: List, sizes: List[int], x: Tensor):
        """The parts' initial states along the batch dim; zeros for a part that gave none (what the
        module starts from without one). None when no part gave one."""
        if all(h is None for h in states):
            return None
        rows = (self.num_layers * (2 if self.bidirectional else 1), self.hidden_size)
        lstm = isinstance(self, nn.LSTM)

        def zeros(size: int) -> Tensor:
            return x.new_zeros(rows[0], size, rows[1])

        def field(j: int) -> Tensor:
            return torch.cat([(h[j] if lstm else h) if h is not None else zeros(n) for h, n in zip(states, sizes)], 1)

        return (field(0), field(1)) if lstm else field(0)

    def _torch_padded(self, x: Tensor, hx, lengths: Optional[Tensor]):
        """torch's RNN with the kernels' semantics for padded input: packed by lengths (a CUDA
        lengths tensor is read on the host here), outputs zero past each length. A batch of no samples
        gets torch's own (empty) answer, with lengths or without: packing refuses it."""
        if lengths is None or x.shape[0] == 0:
            return self._batch_first_call(x, hx)
        T = x.shape[1]
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, state = self._packed_torch(packed, hx)
        out = pad_packed_sequence(out, batch_first=True, total_length=T)[0]
        return out, state

    def _batch_first_call(self, x: Tensor, hx):
        out, state = super().forward(x if self.batch_first else x.transpose(0, 1), hx)  # type: ignore[misc]
        return (out if self.batch_first else out.transpose(0, 1)), state

    def _packed_torch(self, packed: PackedSequence, hx):
        return super().forward(packed, hx)  # type: ignore[misc]

    def _run_packed(self, packed: PackedSequence, hx):
        arguments.check_input_dtype(self, packed.data)
        hx = arguments.state_kind(self, hx)
        if not self.uses_kernels(packed.data, int(packed.batch_sizes[0]), True):
            return self._packed_torch(packed, hx)
        x, lengths = pad_packed_sequence(packed, batch_first=True)  # original batch order
        B = x.shape[0]
        steps = lengths.to(x.device, non_blocking=True)
        arguments.check_state(self, hx, B, x)
        out, h_n, c_n = functional.rnn(self, x, steps, hx, **self._layout(x, B, x.shape[1]))
        # Same packing (batch sizes and order) as the input, as torch's modules return.
        if packed.sorted_indices is not None:
            out = out.index_select(0, packed.sorted_indices)
            lengths = lengths.index_select(0, packed.sorted_indices.cpu())
        data = pack_padded_sequence(out, lengths, batch_first=True, enforce_sorted=True).data
        out_packed = PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
        return out_packed, ((h_n, c_n) if isinstance(self, nn.LSTM) else h_n)


class LSTM(_KernelRNN, nn.LSTM):
    """nn.LSTM on the persistent kernels. forward(input, hx=None, lengths=None) -> (output, (h_n, c_n)).

    `kernels`: "vlseq" (default: the kernels wherever they can run, a one-time warning where they
    cannot), "auto" (the kernels where the rnn bench measured them faster than cuDNN: see
    AUTO_CUDNN_MAX_HIDDEN above), "cudnn" (torch's own). Settable at any time."""

    def __init__(self, *args, kernels: str = "vlseq", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = _check_kernels(kernels)

    def forward(self, input, hx=None, lengths=None):  # noqa: A002 - nn.LSTM's name
        return self._run(input, hx, lengths)


class GRU(_KernelRNN, nn.GRU):
    """nn.GRU on the persistent kernels; see LSTM."""

    def __init__(self, *args, kernels: str = "vlseq", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = _check_kernels(kernels)

    def forward(self, input, hx=None, lengths=None):  # noqa: A002
        return self._run(input, hx, lengths)


def use_kernels(model: nn.Module, kernels: str = "auto") -> int:
    """Makes every nn.LSTM / nn.GRU inside `model` run on the kernels (or, with "cudnn", on torch's),
    in place: each module becomes the vlseq_ext.nn class of the same kind, keeping its Parameter
    objects (optimizers and checkpoints are untouched) and its state_dict keys. Returns how many
    modules it changed or set."""
    _check_kernels(kernels)
    count = 0
    for module in model.modules():
        if isinstance(module, (LSTM, GRU)):
            module.kernels = kernels
            count += 1
        elif type(module) in (nn.LSTM, nn.GRU) and kernels != "cudnn":
            module.__class__ = LSTM if type(module) is nn.LSTM else GRU
            module.kernels = kernels
            count += 1
    return count
