"""ParallelTrainer: drop-in multi-device training on variable-length samples with exact gradients.

It replaces the seed's replicate / scatter / parallel_apply / stack-sum loop (docs/design.md):

    model = SeqModel().cuda(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = ParallelTrainer(model, optimizer, nn.MSELoss())
    for samples, targets in steps:           # lists of (L_i, 36) tensors and their targets
        loss = trainer.step(samples, targets)

The coordinator. One step: samples go to devices by length (scheduling.assign_lpt); each device's
thread (workers.DeviceWorkers) runs its share on its replica (replicas.ReplicaSet) by the plan of
execution.DeviceRunner; one kernel sums every gradient set into the master's, and the process group
(vlseq_ext.distributed) sums the masters of every process; the guard (guard.StepGuard) clips,
checks and steps the user's optimizer once on the master; a one-kernel P2P broadcast copies the
parameters back to the replicas.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import distributed
from ..devices import parse_devices
from ..nn import use_kernels
from . import loop
from .execution import DeviceRunner
from .guard import StepGuard
from .inputs import check_lengths, check_samples, check_targets, model_input_dim, place_model
from .losses import PerSampleLoss, loss_precision, stack_targets
from .options import TrainerOptions
from .replicas import ReplicaSet
from .scheduling import assign_lpt, lpt_shard
from .window import AccumulationWindow
from .workers import DeviceWorkers

__all__ = ["ParallelTrainer"]


class ParallelTrainer:
    """Trains `model` with `optimizer` on several devices of one process (and, under torchrun, of
    several processes).

    Args:
        model: the user's model, on one of `devices` (or on CPU; it is then moved to devices[0]).
            It maps one sample (L, D) to an output (1, O). If it also maps a list of samples to
            (B, O) (like SeqModel), k samples per device can run as one packed batch; if it has
            `forward_padded(x (B, T, D), lengths (B,))` (SeqModel does), they run as one CUDA graph
            replay per padded shape.
        optimizer: built over model.parameters(); it steps once per step on the master model.
        loss_fn: loss_fn(output, target) for one sample, e.g. nn.MSELoss().
        devices: a device spec (vlseq_ext.devices): None / "all", N (the first N GPUs), a list such
            as ["cuda:0", "cuda:1"], "cpu:2" (CPU replicas).
        **options: samples_per_device, reduction, accumulation_steps, cuda_graphs, pack, lanes, amp,
            graph_cache_size, graph_memory_bytes, clip_grad_norm, track_grad_norm, nonfinite,
            process_group: see vlseq_ext.training.options.TrainerOptions (`self.options`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, devices=None,
                 **options: Any) -> None:
        self.options = opts = TrainerOptions.from_keywords(options)
        self.devices = parse_devices(devices)
        place_model(model, optimizer, self.devices)
        use_kernels(model, opts.rnn_kernels)  # before the replicas copy the model
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.input_dim = model_input_dim(model)
        self.cuda_graphs = opts.cuda_graphs and self.devices[0].type == "cuda"

        self.replicas = ReplicaSet(model, self.devices)
        master = self.replicas.master
        self.master_device = master.loss.device
        self.group = distributed.resolve(opts.process_group, self.master_device).bind(
            master.grads, master.loss, self.samples_per_step)
        self.group.broadcast_from_rank0(master.params + list(model.buffers()))  # one start on every rank
        self.guard = StepGuard(optimizer, master.grads, opts.nonfinite, opts.clip_grad_norm, opts.track_grad_norm)
        self.per_sample_loss = PerSampleLoss(loss_fn)
        self.runner = DeviceRunner(model, self.replicas, self.per_sample_loss, opts, self.cuda_graphs)
        self.workers = DeviceWorkers(self.devices)
        self.window = AccumulationWindow(opts.accumulation_steps)
        self.global_step = 0
        self.sync_replicas()

    # -- what the loop, the CLI and the bench read ------------------------------------------------
    @property
    def samples_per_device(self) -> int:
        return self.options.samples_per_device

    @property
    def samples_per_step(self) -> int:
        """Samples of one step in this process: devices x samples_per_device."""
        return self.options.samples_per_device * len(self.devices)

    @property
    def reduction(self) -> str:
        return self.options.reduction

    @property
    def skipped_steps(self) -> int:
        return self.guard.skipped_steps

    @property
    def last_grad_norm(self) -> Optional[Tensor]:
        return self.guard.last_grad_norm

    @property
    def capture_seconds(self) -> float:
        """Time spent in first eager runs + graph captures, on the slowest device (devices overlap)."""
        return max(sum(c.capture_seconds for c in self.runner.caches(d)) for d in range(len(self.devices)))

    def graph_stats(self) -> List[Dict[str, int]]:
        return [c.stats() for d in range(len(self.devices)) for c in self.runner.caches(d)]

    def shard(self, lengths: Sequence[int]) -> List[int]:
        """This process's positions in a global step with these sample lengths: a longest-first
        assignment over every process's devices (all of them when alone)."""
        if self.group.world_size == 1:
            return list(range(len(lengths)))
        return lpt_shard(lengths, self.group.rank, self.group.world_size, len(self.devices), self.samples_per_device)

    def close(self) -> None:
        """Stop the device threads and the gathered passes' threads (also done at exit)."""
        self.workers.close()
        self.runner.close()

    # -- the step ---------------------------------------------------------------------------------
    def step(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """Forward and backward of one step's samples on every device, then (on the window's last
        call, every call without accumulation) the merge, clipping, the non-finite guard, the optimizer
        step on the master and the parameter sync to every replica. Returns the step's loss (sum or
        mean per `reduction`) as a 0-dim tensor on the master device, with no host sync: the global
        step's (every process's samples) or, with accumulation, this call's own samples'."""
        xs, ys = self._check(samples, targets)
        self._follow_master()
        window = self.window
        if window.open:  # a later call of the window: only its loss starts from zero
            self.replicas.zero_losses()
        else:  # the last merge zeroed every gradient set but the master's, unless a call failed since
            self.replicas.zero([self.replicas.master_index] if window.clean else range(len(self.devices)))
        self._forward_backward(xs, ys)
        full = window.add(len(xs))
        # With accumulation a call's loss is its own (read before the merge adds up the window's sets).
        own = self._own_loss(len(xs)) if window.size > 1 else None
        if not full:
            return own
        merged = self._merge(window.samples)
        self._optimizer_step()
        return merged if own is None else own

    def compute_gradients(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """Forward and backward of one step's samples on every device, then the gradient merge (an
        open accumulation window is dropped). Leaves the merged gradient (sum, or mean over these
        samples) in the master model's .grad; no optimizer step. Returns the step's loss as a 0-dim
        tensor on the master device."""
        xs, ys = self._check(samples, targets)
        self._follow_master()
        self.window.drop()
        self.replicas.zero(range(len(self.devices)))
        self._forward_backward(xs, ys)
        return self._merge(len(xs))

    def _check(self, samples, targets) -> Tuple[List[Tensor], List[Tensor]]:
        # [distributed] a rank may have no sample of a short global step: it only joins the merge
        return check_samples(samples, targets, self.input_dim, self.samples_per_step,
                             allow_empty=self.group.world_size > 1)

    def _forward_backward(self, xs: List[Tensor], ys: List[Tensor]) -> None:
        """Every device's share on its own thread. If it raises, the devices that finished hold
        gradients of a step that never merged: the window is dropped (the failed call's part cannot be
        told from the earlier calls') and the next call zeroes every set."""
        self.window.begin_call()
        try:
            if not xs:
                return
            self.runner.prepare(xs)
            if self.per_sample_loss.unreduced is not None:  # a known nn loss: targets must fit its output
                check_targets(ys, self.runner.output_shape,
                              isinstance(self.loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)))
            self.replicas.sync_mode()
            if self.replicas.sync_requires_grad():
                self.runner.drop_graphs()
            self.replicas.attach_grads()
            groups = assign_lpt([x.shape[0] for x in xs], len(self.devices), self.samples_per_device)
            with torch.profiler.record_function("vlseq::forward_backward"):
                self.workers.run(lambda d: self.runner.run(d, [xs[i] for i in groups[d]], [ys[i] for i in groups[d]]),
                                 [d for d, g in enumerate(groups) if g])
        except BaseException:
            dropped = self.window.drop()
            if dropped:
                warnings.warn(f"vlseq_ext: a step failed inside an accumulation window; the gradients of its "
                              f"{dropped} earlier call(s) are dropped and the window starts again",
                              RuntimeWarning, stacklevel=3)
            raise

    def _own_loss(self, n: int) -> Tensor:
        """This call's loss on this process: every device's sum, divided by n for "mean"."""
        loss = sum(lanes[0].loss.to(self.master_device, non_blocking=True) for lanes in self.replicas.lanes)
        return loss / max(n, 1) if self.reduction == "mean" else loss

    def _merge(self, n: int) -> Tensor:
        """Master grads <- the sum of every gradient set of every process (divided by the global sample
        count for "mean"; n: this process's samples), the other sets zeroed; the loss rides along.
        Returns the step's loss (a copy, on the master device)."""
        mean = self.reduction == "mean"
        with torch.profiler.record_function("vlseq::merge"):
            self.replicas.merge_into_master(self.group.merge_scale(n, mean))
            self.group.all_reduce_step_(n, mean)
        self.window.merged()
        return self.replicas.master.loss.clone()

    def _optimizer_step(self) -> None:
        self.global_step += 1
        if not self.guard.step(self.global_step):
            return
        with torch.profiler.record_function("vlseq::sync"):
            self.sync_replicas()

    def sync_replicas(self, buffers_only: bool = False) -> None:
        """Copy the master's parameters (unless buffers_only) and buffers into every replica, over
        the P2P broadcast. step() does it by itself when the master's weights changed in place since
        (model.load_state_dict, an init_ under no_grad)."""
        if not buffers_only:
            self.replicas.broadcast_parameters()
            self._master_seen = self._master_marks()
        self.replicas.broadcast_buffers()

    def _master_marks(self) -> List[Tuple[int, int]]:
        """Each master parameter's version counter (which every in-place write bumps) and storage. (The
        trainer's list, not model.parameters(): walking the modules every step costs 5 us of host time.)"""
        return [(p._version, p.data_ptr()) for p in self.replicas.master.params]

    def _follow_master(self) -> None:
        """The replicas follow weights written into the master behind the trainer's back: without this,
        the next gradient mixed the replicas' old weights with the master's new ones. New storage
        (p.data = t, model.double()) cannot be followed: the replicas' lanes and CUDA graphs hold the old
        one. (A module replaced after the optimizer was built goes untrained, as in plain PyTorch.)"""
        marks = self._master_marks()
        if marks == self._master_seen:
            return
        names = [n for n, _ in self.model.named_parameters()]
        for (_, ptr), (_, seen), name in zip(marks, self._master_seen, names):
            if ptr != seen:
                raise ValueError(f"the model's parameter {name} got new storage (p.data = ..., .to()) after the "
                                 "ParallelTrainer was built; write into it in place (with torch.no_grad(): "
                                 "p.copy_(t), or model.load_state_dict), or build a new ParallelTrainer")
        if self.window.open:
            warnings.warn("vlseq_ext: the model's weights changed inside an accumulation window; the gradients "
                          "gathered so far are of the old weights", RuntimeWarning, stacklevel=3)
        self.sync_replicas()

    # -- evaluation, warm-up, state ---------------------------------------------------------------
    def evaluate(self, samples: Sequence[Tensor], targets: Optional[Sequence[Any]] = None,
                 batch_size: int = 64) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Outputs (B, O) of the master model for `samples`, without gradients (eval mode for the
        duration), on the master device. With targets, returns (outputs, per-sample losses (B,))."""
        if isinstance(samples, Tensor) or not isinstance(samples, (list, tuple)):  # as step() refuses it
            raise ValueError("evaluate: samples must be a list of (L, D) tensors")
        if len(samples) == 0:
            raise ValueError("evaluate: no samples (give a non-empty list of (L, D) tensors)")
        if batch_size < 1:
            raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
        xs, ys = check_samples(list(samples), list(targets) if targets is not None else [torch.zeros(1)] * len(samples),
                               self.input_dim, len(samples))
        dtype = self.replicas.master.params[0].dtype
        was_training = self.model.training
        self.model.eval()
        outs = []
        try:
            with torch.no_grad(), self.runner.autocast():
                packed = len(xs) > 1 and self.runner.accepts_list(xs)
                for s in range(0, len(xs), batch_size):
                    chunk = [x.to(self.master_device, dtype=dtype) for x in xs[s:s + batch_size]]
                    outs.append(self.model(chunk) if packed and len(chunk) > 1 else
                                torch.cat(self.runner.forward_each(self.replicas.master_index, self.model, chunk)))
        finally:
            self.model.train(was_training)
        out = loss_precision(torch.cat(outs))
        if targets is None:
            return out
        return out, self.per_sample_loss(out, stack_targets(ys, out.shape[-1]).to(self.master_device))

    def warmup(self, lengths: Sequence[int], target: Optional[Tensor] = None) -> None:
        """Capture the CUDA graphs for these sample lengths on every device ahead of training (all
        devices at once), so the first epoch does not pay for captures. `target`: one sample's
        target as training will give it (graphs are kept per target shape and dtype); by default a
        class index for CrossEntropyLoss/NLLLoss, else one float per model output. Leaves gradients,
        losses and parameters as they were. No-op without CUDA graphs (the lengths are checked anyway)."""
        lengths = check_lengths(lengths, "warmup")
        if not self.cuda_graphs or not lengths:
            return
        dim = self.input_dim or 1
        self.runner.prepare([torch.randn(max(lengths), dim)])
        if target is None:
            classes = isinstance(self.loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss))
            target = torch.zeros((), dtype=torch.int64) if classes else torch.zeros(self.runner.output_shape[-1])
        try:
            for step in self.runner.warmup_steps(lengths):
                xs = [torch.randn(L, dim) for L in step]
                self.workers.run(lambda d: self.runner.run(d, xs, [target] * len(xs)), range(len(self.devices)))
        finally:  # a failed warm-up leaves no gradient behind either
            self.replicas.zero(range(len(self.devices)))
        if self.devices[0].type == "cuda":
            torch.cuda.synchronize()

    def state_dict(self) -> Dict[str, Any]:
        """Counters; inside an accumulation window also the gradients gathered so far (each device's
        set, on the CPU), so that a resume gives the bits the uninterrupted run gives."""
        state = {"global_step": self.global_step, "skipped_steps": self.skipped_steps, **self.window.state_dict()}
        if self.window.open:
            if self.group.world_size > 1:
                raise ValueError("state_dict: inside an accumulation window the gradients gathered so far live in "
                                 "every process; save after the window's last call (micro_step 0)")
            # A call folds its lanes into lane 0, so lane 0 holds each device's whole share.
            state["window_grads"] = [[g.detach().to("cpu", copy=True) for g in lanes[0].grads]
                                     for lanes in self.replicas.lanes]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the counters and re-sync every replica from the master model (load the model
        and optimizer state first)."""
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict: expected a dict from ParallelTrainer.state_dict(), got {type(state).__name__}")
        unknown = sorted(set(state) - {"global_step", "skipped_steps", "micro_step", "window_samples", "window_grads"})
        if unknown:
            raise ValueError(f"load_state_dict: unknown key(s) {unknown}; expected a ParallelTrainer.state_dict()")
        self.window.load_state_dict(state)
        if self.window.open:
            self._restore_window(state.get("window_grads"))
        self.global_step = int(state.get("global_step", 0))
        self.guard.reset(int(state.get("skipped_steps", 0)))
        self.sync_replicas()

    def _restore_window(self, grads: Any) -> None:
        """The gradients of an accumulation window saved mid-way, back on their devices."""
        lanes = self.replicas.lanes
        if not isinstance(grads, list) or len(grads) != len(lanes):
            self.window.drop()
            have = f"{len(grads)} device(s)" if isinstance(grads, list) else "none"
            raise ValueError(f"load_state_dict: the state was saved inside an accumulation window, with the gradients "
                             f"of {have}; resuming it needs the same {len(lanes)} device(s) (or save at a window end)")
        for d, (saved, dev_lanes) in enumerate(zip(grads, lanes)):
            mine = dev_lanes[0].grads
            if len(saved) != len(mine) or any(a.shape != b.shape for a, b in zip(saved, mine)):
                self.window.drop()
                raise ValueError(f"load_state_dict: the saved window gradients of device {d} do not match the "
                                 "model's parameters")
        with torch.no_grad():
            self.replicas.zero(range(len(lanes)))
            for saved, dev_lanes in zip(grads, lanes):
                torch._foreach_copy_(dev_lanes[0].grads, [g.to(dtype=m.dtype) for g, m in zip(saved, dev_lanes[0].grads)])

    def fit(self, data, epochs: int = 1, max_steps: Optional[int] = None, shuffle: bool = False,
            seed: int = 0, val_data=None) -> List[Dict[str, float]]:
        """Train on `data`: a Dataset or DataLoader yielding (x, y) per sample as in the seed (x of
        shape (L, D), or (1, L, D) from a DataLoader with batch_size=1). Consecutive samples form
        steps of samples_per_step; the last step of an epoch may be short. Returns one dict per
        epoch: loss (per-sample mean), samples, steps, samples_per_s, skipped_steps and, with
        val_data, val_loss. [distributed] Every rank passes the same data in the same order; each
        trains on its longest-first share of every global step (vlseq_ext.training.loop)."""
        return loop.fit(self, data, epochs=epochs, max_steps=max_steps, shuffle=shuffle, seed=seed, val_data=val_data)

