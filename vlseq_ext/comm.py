"""Gradient merging across the devices of one process: what replaces the seed's
`torch.stack([...]).sum(0)` loop."""
from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import ops


class GradientMerger:
    """Merges the gradients of per-device copies of one model.

    `params_per_device[d]` lists device d's parameters, in the same order and with the same
    shapes on every device (e.g. `[list(m.parameters()) for m in replicas]`). Devices are
    distinct CUDA devices, or CPU (several CPU "devices" are allowed, for testing).

    `merge(scale)` leaves `scale * sum_d grad_d` in every device's `.grad`, summed in device
    order with fp32 accumulation, bit-identical on all devices. A missing grad (None) counts as
    zeros; the merger gives such a parameter a zero grad tensor once so later merges reuse it.

    Two pipelines, same bits:
    - `fused=True` (default): one kernel per device reads every peer's grads directly and writes
      the result into every device's grads (`ops.all_reduce_tensors_`): no flat copies at all.
    - `fused=False`: `ops.flatten` into a flat buffer per device (allocated once), then
      `ops.all_reduce_`, then `ops.unflatten_` (the classic pipeline; kept for comparison and
      for gradients whose dtype differs from the buffer's).
    """

    def __init__(self, params_per_device: Sequence[Sequence[Tensor]], dtype: torch.dtype = torch.float32,
                 fused: bool = True) -> None:
        lists = [list(ps) for ps in params_per_device]
        if not lists:
            raise ValueError("GradientMerger: params_per_device is empty")
        if not lists[0]:
            raise ValueError("GradientMerger: the model has no parameters")
        for d, ps in enumerate(lists):
            if len(ps) != len(lists[0]):
                raise ValueError(f"GradientMerger: device list {d} has {len(ps)} parameters, list 0 has {len(lists[0])}")
            dev = ps[0].device
            for p, (a, b) in enumerate(zip(ps, lists[0])):
                if a.shape != b.shape or a.dtype != b.dtype:
                    raise ValueError(f"GradientMerger: parameter {p} of device list {d} is {tuple(a.shape)} {a.dtype}, "
                                     f"list 0 has {tuple(b.shape)} {b.dtype}")
                if a.device != dev:
                    raise ValueError(f"GradientMerger: device list {d} mixes devices ({dev} and {a.device})")
        devices = [ps[0].device for ps in lists]
        cuda = [d for d in devices if d.type == "cuda"]
        if len(set(cuda)) != len(cuda):
            raise ValueError(f"GradientMerger: devices must be distinct, got {[str(d) for d in devices]}")
        self.params: List[List[Tensor]] = lists
        self.devices = devices
        self.fused = fused
        self.numels = [p.numel() for p in lists[0]]
        self.flat_buffers: List[Tensor] = [torch.empty(sum(self.numels), dtype=dtype, device=d) for d in devices]
        self._flat_params = [p for ps in lists for p in ps]
        self._flat_grads: List[Optional[Tensor]] = [None] * len(self._flat_params)
        self._packed: Optional[ops.DeviceLists] = None

    def grads(self) -> ops.DeviceLists:
        """Every device's grad tensors, allocating zeros for missing ones. The layout for the op is
        built once and reused while the parameters keep the same .grad objects
        (optimizer.zero_grad(set_to_none=True) or an assignment to .grad rebuilds it)."""
        if self._packed is not None and all(map(operator.is_, map(_grad_of, self._flat_params), self._flat_grads)):
            return self._packed
        for p in self._flat_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._flat_grads = [p.grad for p in self._flat_params]
        self._packed = ops.DeviceLists([[p.grad for p in ps] for ps in self.params], "GradientMerger")
        return self._packed

    def merge(self, scale: float = 1.0) -> None:
        """Every device's grads <- scale * (sum over devices of the grads). In place, no host sync."""
        grads = self.grads()
        if self.fused:
            ops.all_reduce_tensors_(grads, scale)
            return
        for gs, flat in zip(grads.lists, self.flat_buffers):
            ops.flatten(gs, out=flat, numels=self.numels)
        ops.all_reduce_(self.flat_buffers, "sum")
        for gs, flat in zip(grads.lists, self.flat_buffers):
            ops.unflatten_(flat, gs, scale)

    def grad_norm(self, device_index: int = 0) -> Tensor:
        """Global L2 norm of device `device_index`'s grads, computed on its flat buffer
        (one flatten launch + one norm), as a 0-dim float32 tensor on that device."""
        flat = ops.flatten(self.grads().lists[device_index], out=self.flat_buffers[device_index], numels=self.numels)
        return torch.linalg.vector_norm(flat, dtype=torch.float32)

    def broadcast_parameters(self, src_index: int = 0) -> None:
        """Copy device `src_index`'s parameter values into every other device's parameters."""
        with torch.no_grad():
            srcs = self.params[src_index]
            ops.broadcast_tensors_(srcs, [ps for i, ps in enumerate(self.params) if i != src_index])


def _grad_of(p: Tensor) -> Optional[Tensor]:
    return p.grad
