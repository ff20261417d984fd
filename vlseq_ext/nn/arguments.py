"""The checks of a vlseq_ext.nn LSTM / GRU call's arguments, with messages that name the problem.

torch's modules check some of these themselves, but not on every path the modules take (packed input
skips the dtype check and then fails inside a GEMM; a GRU given a tuple fails on `.dim`), so the
modules check first, on every path, kernels or not.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["check_input_dtype", "state_kind", "check_state", "lengths_tensor"]


def _kind(value) -> str:
    """A value's kind for an error message: its type, and the element types of a tuple or list."""
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {', '.join(type(v).__name__ for v in value) or 'nothing'}"
    return type(value).__name__


def _autocast() -> bool:
    return torch._C._is_any_autocast_enabled()  # under autocast torch's modules take other dtypes too


def check_input_dtype(module: nn.RNNBase, input: Tensor) -> None:
    """The input's dtype must be the parameters' (outside autocast), as torch's modules require."""
    weight = module.weight_ih_l0
    if input.dtype != weight.dtype and not _autocast():
        raise ValueError(f"RNN input dtype ({input.dtype}) does not match weight dtype ({weight.dtype}): convert "
                         f"the input (input.to({weight.dtype})) or the model")


def state_kind(module: nn.RNNBase, hx):
    """hx checked for its kind and dtype: None, an LSTM's (h0, c0) (a list too, returned as a tuple),
    or a GRU's h0, of the parameters' dtype (outside autocast)."""
    if hx is None:
        return None
    if isinstance(module, nn.LSTM):
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(h, Tensor) for h in hx)):
            raise ValueError(f"an LSTM's hx must be a tuple of two tensors (h0, c0), got {_kind(hx)}")
        hx = tuple(hx)
    elif not isinstance(hx, Tensor):
        raise ValueError(f"a GRU's hx must be a tensor (h0), got {_kind(hx)}")
    dtype = module.weight_ih_l0.dtype
    for h in hx if isinstance(hx, tuple) else (hx,):
        if h.dtype != dtype and not _autocast():
            raise ValueError(f"initial state must be {dtype} like the parameters, got {h.dtype}")
    return hx


def check_state(module: nn.RNNBase, hx, B: int, x: Tensor) -> None:
    """hx (state_kind's) fits the kernels' call on x (B samples): shape, device, float32."""
    dirs = 2 if module.bidirectional else 1
    want = (module.num_layers * dirs, B, module.hidden_size)
    dtype = module.weight_ih_l0.dtype
    for s in hx if isinstance(hx, tuple) else (() if hx is None else (hx,)):
        if tuple(s.shape) != want:
            raise ValueError(f"initial state must have shape {want}, got {tuple(s.shape)}")
        if s.device != x.device:
            raise ValueError(f"initial state is on {s.device} but the input is on {x.device}")
        if s.dtype != dtype:  # under autocast too: the kernels keep their state in float32
            raise ValueError(f"initial state must be {dtype} like the parameters, got {s.dtype}")


def lengths_tensor(lengths, B: int, T: int, device, unbatched: bool) -> Optional[Tensor]:
    """lengths as an int64 tensor on `device`, checked when they are on the CPU (a CUDA tensor is
    used as is: checking it would wait for the GPU; the kernels clamp it to [0, T])."""
    if lengths is None:
        return None
    if unbatched:
        raise ValueError("lengths= needs batched input (batch, steps, features) or (steps, batch, features)")
    if not isinstance(lengths, Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(f"lengths must be integers, got {lengths.dtype}")
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must have shape ({B},) (one per sample), got {tuple(lengths.shape)}")
    if B and T == 0:
        raise ValueError("input has 0 steps: every sample needs at least one")
    if lengths.device.type == "cpu" and B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
        raise ValueError(f"lengths must be in 1..{T} (the padded number of steps), got "
                         f"{int(lengths.min())}..{int(lengths.max())}")
    return lengths.to(device=device, dtype=torch.long, non_blocking=True)
