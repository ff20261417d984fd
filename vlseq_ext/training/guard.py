"""What happens between the merged gradient and the optimizer step: clipping, the gradient norm,
and the non-finite guard."""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch
from torch import Tensor

from .. import ops

__all__ = ["StepGuard"]


class StepGuard:
    """Clips and checks the master's merged gradient, then steps the optimizer (or skips the step).

    nonfinite: "skip" (skip the step on a NaN/inf gradient, count it, warn), "raise"
    (FloatingPointError) or "ignore". With a fused optimizer (torch.optim.Adam/AdamW/SGD(fused=True))
    "skip" happens on the GPU with no host sync (GradScaler's found_inf protocol) and the count is
    read lazily; otherwise "skip"/"raise" read one flag per step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grads: List[Tensor], nonfinite: str,
                 clip_grad_norm: Optional[float], track_grad_norm: bool) -> None:
        self.optimizer, self.grads, self.nonfinite = optimizer, grads, nonfinite
        self.clip_grad_norm, self.track_grad_norm = clip_grad_norm, track_grad_norm
        dev = grads[0].device
        self.is_cuda = dev.type == "cuda"
        self._norm_buffer = torch.empty(sum(g.numel() for g in grads), dtype=torch.float32, device=dev)
        self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=dev)
        self._skipped_seen = 0
        self.skipped_host = 0
        self._inf_flag = torch.zeros((), dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self.last_grad_norm: Optional[Tensor] = None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reads the device-side count: one host sync)."""
        on_device = int(self._skipped_on_device.item())
        if on_device > self._skipped_seen:
            warnings.warn(f"vlseq_ext: {on_device - self._skipped_seen} step(s) had a non-finite gradient and were "
                          f"skipped ({self.skipped_host + on_device} skipped in all)", RuntimeWarning)
            self._skipped_seen = on_device
        return self.skipped_host + on_device

    def reset(self, skipped: int) -> None:
        self.skipped_host = skipped
        self._skipped_on_device.zero_()
        self._skipped_seen = 0

    def _found_inf(self) -> Tensor:
        """1.0 (float32, on the master device) when any merged gradient is NaN/inf, else 0.0."""
        if self.last_grad_norm is not None:
            return (~torch.isfinite(self.last_grad_norm)).float()
        self._inf_flag.zero_()
        if self.is_cuda:  # one multi-tensor kernel over all gradients (GradScaler's check, scale 1.0)
            torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self._inf_flag, self._one)
        else:
            for g in self.grads:
                self._inf_flag.logical_or_(~torch.isfinite(g).all())
        return self._inf_flag

    def step(self, step_number: int) -> bool:
        """Clip, check, and step the optimizer. Returns False when the step was skipped on the host
        (a fused optimizer's device-side skip still returns True)."""
        self.last_grad_norm = None
        if self.clip_grad_norm is not None or self.track_grad_norm:
            with torch.profiler.record_function("vlseq::grad_norm"):
                # Global L2 norm on one flat copy of the gradient; no host sync.
                self.last_grad_norm = torch.linalg.vector_norm(ops.flatten(self.grads, out=self._norm_buffer))
                if self.clip_grad_norm is not None:
                    coef = torch.clamp(self.clip_grad_norm / (self.last_grad_norm + 1e-6), max=1.0)
                    torch._foreach_mul_(self.grads, coef)
        found_inf = None
        if self.nonfinite != "ignore":
            found_inf = self._found_inf()
            if self.nonfinite == "skip" and getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self._skipped_on_device += found_inf  # the fused step skips itself when found_inf != 0
            else:
                if bool(found_inf):  # one host sync per step
                    self.skipped_host += 1
                    if self.nonfinite == "raise":
                        raise FloatingPointError(f"non-finite gradient at step {step_number}; no update was made")
                    warnings.warn(f"vlseq_ext: non-finite gradient at step {step_number}; skipped the optimizer "
                                  f"step ({self.skipped_host} skipped so far)", RuntimeWarning)
                    return False
                found_inf = None
        with torch.profiler.record_function("vlseq::optimizer"):
            if found_inf is None:
                self.optimizer.step()
            else:
                self.optimizer.grad_scale = None
                self.optimizer.found_inf = found_inf
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.grad_scale, self.optimizer.found_inf
        return True
