"""The model's replicas, one per device, and their gradient sets ("lanes").

The master is the user's own model on its device; every other device holds a persistent deep
copy. Each device has one or more lanes: a lane is a module whose parameters are the device
replica's (lane 0 is the replica itself; the others alias its weights, sharing storage), with its
own static .grad tensors and loss accumulator, and the CUDA stream it runs on. Several lanes let
one device run several one-sample graph replays at once without two of them adding into the same
gradient.
"""
from __future__ import annotations

import copy
import operator
import warnings
from typing import Iterable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .. import ops

__all__ = ["Lane", "ReplicaSet", "GradientMerger", "check_param_lists"]


def check_param_lists(lists: Sequence[Sequence[Tensor]], who: str) -> List[torch.device]:
    """Per-device parameter lists must match in count, shape and dtype, each on one device, with
    distinct GPUs. Returns each list's device."""
    if not lists:
        raise ValueError(f"{who}: params_per_device is empty")
    if not lists[0]:
        raise ValueError(f"{who}: the model has no parameters")
    for d, ps in enumerate(lists):
        if len(ps) != len(lists[0]):
            raise ValueError(f"{who}: device list {d} has {len(ps)} parameters, list 0 has {len(lists[0])}")
        for p, (a, b) in enumerate(zip(ps, lists[0])):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"{who}: parameter {p} of device list {d} is {tuple(a.shape)} {a.dtype}, "
                                 f"list 0 has {tuple(b.shape)} {b.dtype}")
            if a.device != ps[0].device:
                raise ValueError(f"{who}: device list {d} mixes devices ({ps[0].device} and {a.device})")
    devices = [ps[0].device for ps in lists]
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        raise ValueError(f"{who}: devices must be distinct, got {[str(d) for d in devices]}")
    return devices


def _aliasing_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters share storage with the original's (new Parameter objects,
    so their .grad is their own) and whose buffers are the original's."""
    memo = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in module.parameters()}
    memo.update({id(b): b for b in module.buffers()})
    clone = copy.deepcopy(module, memo)
    for m in clone.modules():
        if isinstance(m, nn.RNNBase):
            # Point the cuDNN weight list at the new Parameters. No flatten_parameters(): that would
            # move them into a buffer of their own and end the sharing.
            m._init_flat_weights()
    return clone


class Lane:
    """One gradient set on one device."""

    __slots__ = ("module", "params", "grads", "loss", "stream")

    def __init__(self, module: nn.Module, stream: Optional["torch.cuda.Stream"]) -> None:
        self.module = module
        self.params = list(module.parameters())
        self.grads = [torch.zeros_like(p) for p in self.params]
        # float64 models keep a float64 loss; half-precision ones sum their loss in float32
        self.loss = torch.zeros((), dtype=torch.promote_types(self.params[0].dtype, torch.float32),
                                device=self.params[0].device)
        self.stream = stream

    def attach(self) -> None:
        """Give every trainable parameter its static grad tensor (CUDA graphs captured their
        addresses), e.g. after optimizer.zero_grad(set_to_none=True) dropped them. A frozen one
        (requires_grad=False) keeps grad None, as in plain PyTorch, so that the optimizer skips it:
        a zero grad would still let weight decay or momentum move it."""
        for p, g in zip(self.params, self.grads):
            if p.requires_grad:
                if p.grad is not g:
                    p.grad = g
            elif p.grad is g:
                p.grad = None

    def zero_(self) -> None:
        self.attach()
        torch._foreach_zero_(self.grads + [self.loss])


class ReplicaSet:
    """Replicas of `model` on `devices` (the model stays the master on its own device)."""

    def __init__(self, model: nn.Module, devices: List[torch.device]) -> None:
        master_dev = next(model.parameters()).device
        with torch.no_grad():
            for p in model.parameters():
                if not p.is_contiguous():  # e.g. a transposed view made a Parameter; the kernels need flat memory
                    p.data = p.data.contiguous()  # the same Parameter object, so the optimizer still holds it
        self.devices = devices
        self.master_index = devices.index(master_dev)
        self.model = model
        self.replicas: List[nn.Module] = []
        for i, dev in enumerate(devices):
            if i == self.master_index:
                self.replicas.append(model)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # deepcopy of a cuDNN RNN; .to() re-flattens it
                    self.replicas.append(copy.deepcopy(model).to(dev))
        for r in self.replicas:
            r.train(model.training)
            for m in r.modules():
                if isinstance(m, nn.RNNBase):
                    m.flatten_parameters()
        self.params = [list(r.parameters()) for r in self.replicas]
        check_param_lists(self.params, "ReplicaSet")
        self.lanes: List[List[Lane]] = [[Lane(r, None)] for r in self.replicas]
        self._trainable = self._master_trainable()
        for lanes in self.lanes:
            lanes[0].attach()
        self._merge_lists: Optional[ops.DeviceLists] = None

    @property
    def master(self) -> Lane:
        return self.lanes[self.master_index][0]

    @property
    def is_cuda(self) -> bool:
        return self.devices[0].type == "cuda"

    def ensure_lanes(self, per_device: int) -> None:
        """At least `per_device` lanes on every device, each on its own CUDA stream."""
        for d, lanes in enumerate(self.lanes):
            if self.is_cuda and lanes[0].stream is None:
                lanes[0].stream = torch.cuda.Stream(self.devices[d])
            while len(lanes) < per_device:
                lanes.append(Lane(_aliasing_copy(self.replicas[d]),
                                  torch.cuda.Stream(self.devices[d]) if self.is_cuda else None))
                lanes[-1].attach()
                lanes[-1].module.train(self.model.training)

    def sync_mode(self) -> None:
        """Every replica and lane in the master's train/eval mode."""
        for lanes in self.lanes:
            for lane in lanes:
                if lane.module.training != self.model.training:
                    lane.module.train(self.model.training)

    def _master_trainable(self) -> List[bool]:
        return [p.requires_grad for p in self.params[self.master_index]]

    def sync_requires_grad(self) -> bool:
        """Every replica and lane freezes what the master freezes (the user may freeze or unfreeze
        layers between steps; a replica still frozen would add nothing to an unfrozen parameter's
        gradient). Returns True when something changed: graphs captured before are stale then."""
        trainable = self._master_trainable()
        if trainable == self._trainable:
            return False
        for lanes in self.lanes:
            for lane in lanes:
                for p, t in zip(lane.params, trainable):
                    p.requires_grad_(t)
        self._trainable = trainable
        return True

    def attach_grads(self) -> None:
        for lanes in self.lanes:
            for lane in lanes:
                lane.attach()

    def zero(self, devices: Iterable[int]) -> None:
        """Zero every lane's grads and loss on these devices, in place."""
        for d in devices:
            for lane in self.lanes[d]:
                lane.zero_()

    def fold_lanes(self, d: int) -> None:
        """Device d's lanes summed into lane 0 (lane order, so the bits repeat) and zeroed."""
        lanes = self.lanes[d]
        if len(lanes) == 1:
            return
        first = lanes[0].grads + [lanes[0].loss]
        for lane in lanes[1:]:
            torch._foreach_add_(first, lane.grads + [lane.loss])
            torch._foreach_zero_(lane.grads + [lane.loss])

    def zero_losses(self) -> None:
        """Zero lane 0's loss on every device (a later call of an accumulation window: its own loss)."""
        for lanes in self.lanes:
            lanes[0].loss.zero_()

    def merge_into_master(self, scale: float) -> None:
        """The master's lane 0 <- scale x the sum of every device's lane 0 (gradients and loss, in device
        order, the master's first), the other devices' zeroed: one kernel (ops.reduce_tensors_)."""
        if self._merge_lists is None:
            order = [self.master_index] + [i for i in range(len(self.devices)) if i != self.master_index]
            self._merge_lists = ops.DeviceLists([self.lanes[i][0].grads + [self.lanes[i][0].loss] for i in order])
        ops.reduce_tensors_(self._merge_lists, scale, zero_others=True)

    def broadcast_parameters(self) -> None:
        """Copy the master's parameters into every other replica (and so into their lanes), over the
        one-kernel P2P broadcast."""
        if len(self.replicas) == 1:
            return
        others = [i for i in range(len(self.replicas)) if i != self.master_index]
        with torch.no_grad():
            ops.broadcast_tensors_([p.detach() for p in self.params[self.master_index]],
                                   [[p.detach() for p in self.params[i]] for i in others])

    def broadcast_buffers(self) -> None:
        master_bufs = list(self.model.buffers())
        if not master_bufs or len(self.replicas) == 1:
            return
        with torch.no_grad():
            for i, r in enumerate(self.replicas):
                if i != self.master_index:
                    for src, dst in zip(master_bufs, r.buffers()):
                        dst.copy_(src, non_blocking=True)


class GradientMerger:
    """Merges the gradients of per-device copies of one model (the lower-level API; ParallelTrainer
    uses ReplicaSet and the merge kernel directly).

    `params_per_device[d]` lists device d's parameters, same order, shapes and dtypes on every
    device (e.g. `[list(m.parameters()) for m in replicas]`), on distinct GPUs or CPU. `merge(scale)`
    leaves `scale * sum_d grad_d` in every device's `.grad`, summed in device order with fp32
    accumulation, bit-identical on all devices, in one kernel per call (`ops.all_reduce_tensors_`).
    A missing grad (None) counts as zeros: such a parameter gets a zero grad tensor once."""

    def __init__(self, params_per_device: Sequence[Sequence[Tensor]]) -> None:
        self.params: List[List[Tensor]] = [list(ps) for ps in params_per_device]
        self.devices = check_param_lists(self.params, "GradientMerger")
        self._flat_params = [p for ps in self.params for p in ps]
        self._flat_grads: List[Optional[Tensor]] = [None] * len(self._flat_params)
        self._packed: Optional[ops.DeviceLists] = None

    def grads(self) -> ops.DeviceLists:
        """Every device's grad tensors, allocating zeros for missing ones. Laid out once and reused
        while the parameters keep the same .grad objects."""
        if self._packed is not None and all(map(operator.is_, (p.grad for p in self._flat_params), self._flat_grads)):
            return self._packed
        for p in self._flat_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._flat_grads = [p.grad for p in self._flat_params]
        self._packed = ops.DeviceLists([[p.grad for p in ps] for ps in self.params], "GradientMerger")
        return self._packed

    def merge(self, scale: float = 1.0) -> None:
        """Every device's grads <- scale * (sum over devices of the grads). In place, no host sync."""
        ops.all_reduce_tensors_(self.grads(), scale)

    def grad_norm(self, device_index: int = 0) -> Tensor:
        """Global L2 norm of device `device_index`'s grads (one flatten launch + one norm)."""
        return torch.linalg.vector_norm(ops.flatten(self.grads().lists[device_index]), dtype=torch.float32)

    def broadcast_parameters(self, src_index: int = 0) -> None:
        """Copy device `src_index`'s parameter values into every other device's parameters."""
        with torch.no_grad():
            ops.broadcast_tensors_(self.params[src_index], [ps for i, ps in enumerate(self.params) if i != src_index])
