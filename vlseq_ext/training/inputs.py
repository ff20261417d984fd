"""Checks of a step's samples and targets, before any work, so that bad input changes nothing
and the error names the sample and the problem."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["model_input_dim", "as_tensor", "check_samples", "check_targets", "check_lengths", "place_model"]


def model_input_dim(model: nn.Module) -> Optional[int]:
    dim = getattr(model, "input_dim", None)
    if isinstance(dim, int):
        return dim
    for m in model.modules():
        if isinstance(m, nn.RNNBase):
            return m.input_size
    return None


def as_tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} is not a tensor ({exc})") from None


def check_samples(samples: Sequence[Any], targets: Any, input_dim: Optional[int], max_samples: int,
                  allow_empty: bool = False) -> Tuple[List[Tensor], List[Tensor]]:
    """(samples, targets) -> lists of (L, D) float tensors and their targets."""
    if isinstance(samples, Tensor) or not isinstance(samples, (list, tuple)):
        raise ValueError("samples must be a list of (L, D) tensors")
    if len(samples) == 0 and not allow_empty:
        raise ValueError("empty step: no samples")
    if isinstance(targets, Tensor):
        targets = list(targets) if targets.dim() > 0 and targets.shape[0] == len(samples) else [targets]
    if len(targets) != len(samples):
        raise ValueError(f"got {len(samples)} samples but {len(targets)} targets")
    if len(samples) > max_samples:
        raise ValueError(f"got {len(samples)} samples but a step takes at most {max_samples}")
    xs, ys = [], []
    for i, (x, y) in enumerate(zip(samples, targets)):
        x = as_tensor(x, f"sample {i}")
        y = as_tensor(y, f"target {i}")
        if x.dim() == 3 and x.shape[0] == 1:  # a DataLoader(batch_size=1) sample
            x = x[0]
        if x.dim() != 2:
            raise ValueError(f"sample {i} has shape {tuple(x.shape)}; expected (length, features)")
        if x.shape[0] == 0:
            raise ValueError(f"sample {i} has length 0")
        if input_dim is not None and x.shape[1] != input_dim:
            raise ValueError(f"sample {i} has {x.shape[1]} features, model expects {input_dim}")
        if not x.is_floating_point():
            raise ValueError(f"sample {i} has dtype {x.dtype}; expected a floating-point tensor")
        if y.numel() == 0:
            raise ValueError(f"target {i} is empty")
        xs.append(x)
        ys.append(y)
    return xs, ys


def check_targets(ys: List[Tensor], output_shape: Tuple[int, ...], class_targets: bool) -> None:
    """Each target must fit the model's one-sample output (1, O): O values for a float target, one
    class index in [0, O) for an integer target, which only a class loss (`class_targets`:
    CrossEntropyLoss, NLLLoss) takes. Torch would broadcast a mismatch with only a warning and
    train on the wrong loss."""
    out_dim = output_shape[-1] if output_shape else 1
    for i, y in enumerate(ys):
        if not y.is_floating_point() and not class_targets:
            raise ValueError(f"target {i} is an integer tensor ({y.dtype}), but the loss compares values, not "
                             "class indices: give float targets (e.g. y.float())")
        if y.is_floating_point():
            if y.numel() != out_dim:
                raise ValueError(f"target {i} has shape {tuple(y.shape)} but the model's output for one sample has "
                                 f"shape {tuple(output_shape)}: give {out_dim} value(s) per sample")
        elif y.numel() != 1:
            raise ValueError(f"target {i} has shape {tuple(y.shape)}: a class-index target is one integer per sample "
                             f"(the model's output for one sample has shape {tuple(output_shape)})")
        elif y.device.type == "cpu" and not 0 <= int(y.reshape(())) < out_dim:
            raise ValueError(f"target {i} is class {int(y.reshape(()))} but the model outputs {out_dim} classes "
                             f"(0..{out_dim - 1})")


def check_lengths(lengths: Any, what: str) -> List[int]:
    """Sample lengths as ints: each a whole number >= 1 (an int, or an integral float, numpy or
    tensor value), so a typo fails here (ValueError naming it) instead of, say, capturing a CUDA
    graph that training never replays."""
    try:
        values = list(lengths.tolist() if isinstance(lengths, (Tensor, np.ndarray)) else lengths)
    except TypeError:
        raise TypeError(f"{what}: lengths must be a sequence of sample lengths, got {type(lengths).__name__}") from None
    out = []
    for i, v in enumerate(values):
        if not (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                and math.isfinite(v) and v == int(v) and v >= 1):
            raise ValueError(f"{what}: lengths[{i}] = {v!r} is not a sample length (a whole number >= 1)")
        out.append(int(v))
    return out


def place_model(model: nn.Module, optimizer: torch.optim.Optimizer, devices: List[torch.device]) -> None:
    """The model and its optimizer must fit the trainer: parameters on one device, the optimizer over
    the model's own. A model outside `devices` moves to devices[0] while its optimizer holds no state."""
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters")
    owned = {id(p) for p in params}
    if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds a parameter that is not one of the model's; "
                         "build it over model.parameters()")
    where = params[0].device
    if any(p.device != where for p in params):
        raise ValueError("the model's parameters are on several devices; put the model on one device")
    if where not in devices:
        if optimizer.state:
            raise ValueError(f"the model is on {where}, which is not in devices, and the optimizer "
                             "already holds state there; move the model before building the optimizer")
        model.to(devices[0])
