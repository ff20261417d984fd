"""Per-sample losses from a user's loss function, so that k samples run as one batch give exactly
the loss (and gradient) of k single-sample passes; and the one forward + loss + backward body that
every plan runs, eagerly or inside a CUDA graph."""
from __future__ import annotations

import copy
from typing import Callable, ContextManager, List, Optional, Sequence

import torch
from torch import Tensor, nn

# nn losses whose reduction="none" output, reduced over the non-batch dims with the original
# reduction, equals calling the loss on one sample at a time.
_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCEWithLogitsLoss, nn.BCELoss,
                nn.CrossEntropyLoss, nn.NLLLoss)


def _batchable(loss_fn: Callable) -> Optional[nn.Module]:
    if not isinstance(loss_fn, _ELEMENTWISE) or getattr(loss_fn, "reduction", None) not in ("mean", "sum"):
        return None
    # Class weights make a per-sample "mean" divide by that sample's weight; positive weights scale
    # elements. Both are exact only when called per sample, so leave them to the loop.
    for attr in ("weight", "pos_weight"):
        if getattr(loss_fn, attr, None) is not None:
            return None
    if getattr(loss_fn, "ignore_index", -100) != -100:
        return None
    unreduced = copy.copy(loss_fn)
    unreduced.reduction = "none"
    return unreduced


class PerSampleLoss:
    """Wraps `loss_fn(output, target)`; calling it on a batch (B, ...) returns the (B,) vector of
    what loss_fn returns for each sample alone. Vectorised for the common nn losses, a loop over
    samples otherwise."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.loss_fn = loss_fn
        self.unreduced = _batchable(loss_fn)

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        if target.is_floating_point() and target.dtype != output.dtype:
            target = target.to(output.dtype)  # a float64 model's loss: torch 2.11's mse backward refuses mixed dtypes
        if self.unreduced is not None:
            elem = self.unreduced(output, target)
            if elem.dim() > 1:
                flat = elem.reshape(elem.shape[0], -1)
                elem = flat.mean(1) if self.loss_fn.reduction == "mean" else flat.sum(1)
            return elem
        losses = []
        for i in range(output.shape[0]):
            loss = self.loss_fn(output[i:i + 1], target[i:i + 1])
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn returned {shape} for one sample; it must return one number (a 0-dim "
                                 "tensor), e.g. an nn loss with reduction='mean' or 'sum'")
            losses.append(loss.reshape(()))
        return torch.stack(losses)


def loss_precision(output: Tensor) -> Tensor:
    """The output as the loss sees it: half precision (autocast, or a half model) goes up to
    float32; float32 and float64 stay as they are (a float64 model keeps float64 gradients)."""
    return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output


def stack_targets(targets: Sequence[Tensor], output_dim: int) -> Tensor:
    """Per-sample targets -> one batch tensor matching a (B, output_dim) output: float targets
    with output_dim elements become rows (B, output_dim); integer targets (class indices) become
    (B,); anything else is stacked as is."""
    rows: List[Tensor] = []
    for t in targets:
        if t.is_floating_point() and t.numel() == output_dim:
            rows.append(t.reshape(output_dim))
        elif not t.is_floating_point() and t.numel() == 1:
            rows.append(t.reshape(()))
        else:
            rows.append(t.squeeze(0) if t.dim() > 0 and t.shape[0] == 1 else t)
    return torch.stack(rows)


# A lane's pass: run(forward, targets) with the lane's loss sum bound (execution.DeviceRunner._pass).
StepPass = Callable[[Callable[[], Tensor], Tensor], None]


def forward_backward(forward: Callable[[], Tensor], targets: Tensor, *, per_sample_loss: PerSampleLoss,
                     autocast: Callable[[], ContextManager], loss_sum: Tensor) -> None:
    """forward() under autocast, the loss of every sample (targets: one row per output row) summed,
    backward into the parameters' .grad, and the loss added to `loss_sum`."""
    with autocast():
        out = forward()
    loss = per_sample_loss(loss_precision(out), targets).sum()
    loss.backward()
    loss_sum.add_(loss.detach())
