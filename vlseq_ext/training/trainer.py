"""ParallelTrainer: drop-in multi-device training on variable-length samples with exact gradients.

It replaces the seed's replicate / scatter / parallel_apply / stack-sum loop (docs/design.md):

    model = SeqModel().cuda(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = ParallelTrainer(model, optimizer, nn.MSELoss())
    for samples, targets in steps:           # lists of (L_i, 36) tensors and their targets
        loss = trainer.step(samples, targets)

The coordinator. One step: samples go to devices by length (scheduling.assign_lpt); each device's
thread (workers.DeviceWorkers) runs its share on its replica (replicas.ReplicaSet) in one of three
ways (`plan`); the merge (merge.LocalMerge / CrossProcessMerge) sums every gradient set into the
master's in one kernel; the guard (guard.StepGuard) clips, checks and steps the user's optimizer
once on the master; a one-kernel P2P broadcast copies the parameters back to the replicas.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import loop
from ..devices import parse_devices
from .execution import DeviceRunner
from .graphs import padded_length
from .guard import StepGuard
from .inputs import check_lengths, check_samples, check_targets, check_trainer_options, model_input_dim
from .losses import PerSampleLoss, loss_precision, stack_targets
from ..merge import make_merge
from .replicas import ReplicaSet
from .scheduling import assign_lpt
from .workers import DeviceWorkers


class ParallelTrainer:
    """Trains `model` with `optimizer` on several devices of one process.

    Args:
        model: the user's model, on one of `devices` (or on CPU; it is then moved to devices[0]).
            It maps one sample (L, D) to an output (1, O). If it also maps a list of samples to
            (B, O) (like SeqModel), k samples per device can run as one packed batch; if it has
            `forward_padded(x (B, T, D), lengths (B,))` (SeqModel does), they run as one CUDA graph
            replay per padded shape.
        optimizer: built over model.parameters(); it steps once per step on the master model.
        loss_fn: loss_fn(output, target) for one sample, e.g. nn.MSELoss(). The step's loss is
            the sum over samples (reduction="sum", the seed's semantics) or the mean over the
            step's true sample count (reduction="mean"), so a short tail step gives exactly the
            gradient one device would compute on the same samples.
        devices: a device spec (vlseq_ext.devices): None / "all", N (the first N GPUs), a list such
            as ["cuda:0", "cuda:1"], "cpu:2" (CPU replicas).
        samples_per_device: k samples per device per step.
        cuda_graphs: replay CUDA graphs of forward + backward (exactly the eager gradient).
        pack: how k samples of one device run, with the same gradient either way: "auto" (padded
            graphs when the model has forward_padded; otherwise per-sample graphs for narrow RNNs
            and one packed batch for wide ones), True (one batch: padded graphs, or a packed list
            when the model has no forward_padded or graphs are off), or False (k per-sample passes).
        lanes: concurrent per-sample passes per device (one CUDA stream and gradient set each);
            None: min(k, 4) on the per-sample graph path, else 1.
        clip_grad_norm, track_grad_norm, nonfinite: see vlseq_ext.guard.StepGuard.
        amp: None or "bf16" (autocast forward; fp32 master weights, gradients and reduction).
        accumulation_steps: optimizer steps every this many calls of step().
        graph_cache_size, graph_memory_bytes: bounds on each graph cache; past them, eager.
        process_group: "auto" (the initialised default group, or one from torchrun's environment,
            when there are several processes), None (this process only), or a ProcessGroup.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, devices=None,
                 samples_per_device: int = 1, reduction: str = "sum", cuda_graphs: bool = True,
                 pack: Union[str, bool] = "auto", lanes: Optional[int] = None,
                 clip_grad_norm: Optional[float] = None, amp: Optional[str] = None, accumulation_steps: int = 1,
                 nonfinite: str = "skip", track_grad_norm: bool = False, graph_cache_size: int = 1024,
                 graph_memory_bytes: Optional[int] = None, process_group: Any = "auto") -> None:
        check_trainer_options(reduction, samples_per_device, amp, nonfinite, accumulation_steps, pack,
                              clip_grad_norm, lanes)
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        owned = {id(p) for p in params}
        if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds a parameter that is not one of the model's; "
                             "build it over model.parameters()")
        self.devices = parse_devices(devices)
        master_dev = params[0].device
        if any(p.device != master_dev for p in params):
            raise ValueError("the model's parameters are on several devices; put the model on one device")
        if master_dev not in self.devices:
            if optimizer.state:
                raise ValueError(f"the model is on {master_dev}, which is not in devices, and the optimizer "
                                 "already holds state there; move the model before building the optimizer")
            model.to(self.devices[0])
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.per_sample_loss = PerSampleLoss(loss_fn)
        self.samples_per_device = samples_per_device
        self.samples_per_step = samples_per_device * len(self.devices)
        self.reduction, self.pack, self.amp, self.accumulation_steps = reduction, pack, amp, accumulation_steps
        self.input_dim = model_input_dim(model)
        self.is_cuda = self.devices[0].type == "cuda"
        self.cuda_graphs = bool(cuda_graphs) and self.is_cuda

        self.replicas = ReplicaSet(model, self.devices)
        self.master_index = self.replicas.master_index
        self.master_device = self.devices[self.master_index]
        self.guard = StepGuard(optimizer, self.replicas.master.grads, nonfinite, clip_grad_norm, track_grad_norm)
        self.merger = make_merge(self.replicas, process_group, self.samples_per_step)
        self.rank, self.world_size = self.merger.rank, self.merger.world_size
        self.workers = DeviceWorkers(self.devices)
        self.runner = DeviceRunner(model, self.replicas, self.per_sample_loss, samples_per_device, pack,
                                   self.cuda_graphs, lanes, amp, (graph_cache_size, graph_memory_bytes))
        self._micro_step = self._window_samples = 0
        self._replicas_zeroed = True  # every gradient set is zero outside a step (see _guarded_forward_backward)
        self.global_step = 0
        self.setup_seconds = 0.0
        self.sync_replicas()

    # -- properties the loop and the CLI read ---------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

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

    def shard(self, lengths: Sequence[int]) -> List[int]:
        """This rank's positions in a global step with these sample lengths."""
        return self.merger.shard(lengths, self.samples_per_device, len(self.devices))

    def request_stop(self) -> None:
        self.merger.request_stop()

    def stop_requested(self) -> bool:
        return self.merger.stop_requested()

    def barrier(self) -> None:
        self.merger.barrier()

    def check_same_on_every_rank(self, what: str, value: int, show: bool = True) -> None:
        """[distributed] ValueError unless `value` (an int) is equal on every rank (the message shows
        the values unless show=False: a hash); no-op in one process."""
        self.merger.check_same(what, int(value), show)

    def graph_stats(self) -> List[Dict[str, int]]:
        return [c.stats() for d in range(len(self.devices)) for c in self.runner.caches(d)]

    def close(self) -> None:
        """Stop the device threads (also done at exit)."""
        self.workers.close()

    # -- the step ---------------------------------------------------------------------------------
    def _forward_backward(self, xs: List[Tensor], ys: List[Tensor]) -> None:
        if not xs:  # [distributed] no sample on this rank this step: it only joins the merge
            return
        self.runner.prepare(xs)
        if self.per_sample_loss.unreduced is not None:  # a known nn loss: targets must fit its output
            check_targets(ys, self.runner.output_shape, isinstance(self.loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)))
        self.replicas.sync_mode()
        if self.replicas.sync_requires_grad():
            self.runner.drop_graphs()
        self.replicas.attach_grads()
        groups = assign_lpt([x.shape[0] for x in xs], len(self.devices), self.samples_per_device)
        with torch.profiler.record_function("vlseq::forward_backward"):
            self.workers.run(lambda d: self.runner.run(d, [xs[i] for i in groups[d]], [ys[i] for i in groups[d]]),
                             [d for d, g in enumerate(groups) if g])

    def _merge(self, n: int) -> Tensor:
        """Master grads <- sum of every gradient set (scaled for "mean"), the rest zeroed; the loss
        rides along. Returns the step's loss (a copy, on the master device)."""
        with torch.profiler.record_function("vlseq::merge"):
            self.merger.merge(n, self.reduction == "mean")
        self._replicas_zeroed = True  # the merge kernel zeroed every set but the master's
        return self.replicas.master.loss.clone()

    def _check(self, samples, targets) -> Tuple[List[Tensor], List[Tensor]]:
        return check_samples(samples, targets, self.input_dim, self.samples_per_step, allow_empty=self.world_size > 1)

    def _optimizer_step(self) -> None:
        self.global_step += 1
        if not self.guard.step(self.global_step):
            return
        with torch.profiler.record_function("vlseq::sync"):
            self.replicas.broadcast_parameters()
            self.replicas.broadcast_buffers()

    def compute_gradients(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """Forward and backward of one step's samples on every device, then the gradient merge.
        Leaves the merged gradient (sum, or mean over these samples) in the master model's .grad;
        no optimizer step. Returns the step's loss as a 0-dim tensor on the master device."""
        xs, ys = self._check(samples, targets)
        self._micro_step = self._window_samples = 0
        self.replicas.zero(range(len(self.devices)))
        self._guarded_forward_backward(xs, ys)
        return self._merge(len(xs))

    def _guarded_forward_backward(self, xs: List[Tensor], ys: List[Tensor]) -> None:
        """_forward_backward; if it raises, the devices that finished hold gradients of a step that
        never merged, so the next step starts from zero on every device (a caught error must not
        leak into the next step). Inside an accumulation window the window starts again: the failed
        call's part cannot be told from the earlier calls'."""
        self._replicas_zeroed = False
        try:
            self._forward_backward(xs, ys)
        except BaseException:
            if self._micro_step:
                warnings.warn(f"vlseq_ext: a step failed inside an accumulation window; the gradients of "
                              f"its {self._micro_step} earlier call(s) are dropped and the window starts again",
                              RuntimeWarning, stacklevel=3)
            self._micro_step = self._window_samples = 0
            raise

    def step(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """compute_gradients, then clipping, the non-finite guard, the optimizer step on the master
        and the parameter sync to every replica. With accumulation_steps=a, gradients accumulate
        over a calls and the optimizer steps on the a-th. Returns the loss of these samples (sum or
        mean per `reduction`) as a 0-dim tensor on the master device; no host sync."""
        xs, ys = self._check(samples, targets)
        if self.accumulation_steps == 1:
            # The other replicas were zeroed by the last merge, unless a step failed before its merge.
            self.replicas.zero([self.master_index] if self._replicas_zeroed else range(len(self.devices)))
            self._guarded_forward_backward(xs, ys)
            loss = self._merge(len(xs))
            self._optimizer_step()
            return loss
        # Accumulation: the window's grads add up on every replica and merge on the last call; each
        # call's own loss is summed across devices here.
        if self._micro_step == 0:
            self.replicas.zero(range(len(self.devices)))
        for lanes in self.replicas.lanes:
            lanes[0].loss.zero_()
        self._guarded_forward_backward(xs, ys)
        loss = sum(lanes[0].loss.to(self.master_device, non_blocking=True) for lanes in self.replicas.lanes)
        self._micro_step += 1
        self._window_samples += len(xs)
        if self._micro_step == self.accumulation_steps:
            self._merge(self._window_samples)
            self._micro_step = self._window_samples = 0
            self._optimizer_step()
        return loss / max(len(xs), 1) if self.reduction == "mean" else loss

    def sync_replicas(self, buffers_only: bool = False) -> None:
        """Copy the master's parameters (unless buffers_only) and buffers into every replica, over
        the P2P broadcast. Call it after changing the master's weights outside step()."""
        if not buffers_only:
            self.replicas.broadcast_parameters()
        self.replicas.broadcast_buffers()

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
                    outs.append(self.model(chunk) if packed and len(chunk) > 1 else torch.cat([self.model(x) for x in chunk]))
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
        t0 = time.perf_counter()
        dim = self.input_dim or 1
        lengths = sorted(set(lengths), reverse=True)
        self.runner.prepare([torch.randn(lengths[0], dim)])
        if target is not None:
            y = target
        elif isinstance(self.loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
            y = torch.zeros((), dtype=torch.int64)
        else:
            y = torch.zeros(self.runner.output_shape[-1])
        k = self.samples_per_device
        if self.runner.plan == "padded":  # one full batch per padded length bucket
            steps = [[L] * k for L in sorted({padded_length(v) for v in lengths}, reverse=True)]
        elif self.runner.plan == "per_sample":  # every length on every lane
            lanes = len(self.replicas.lanes[0])
            steps = [[L] * lanes for L in lengths]
        else:
            steps = []
        try:
            for step in steps:
                xs = [torch.randn(L, dim) for L in step]
                self.workers.run(lambda d: self.runner.run(d, xs, [y] * len(xs)), range(len(self.devices)))
        finally:  # a failed warm-up leaves no gradient behind either
            self.replicas.zero(range(len(self.devices)))
        if self.is_cuda:
            torch.cuda.synchronize()
        self.setup_seconds += time.perf_counter() - t0

    def state_dict(self) -> Dict[str, Any]:
        """Counters; inside an accumulation window also the gradients gathered so far (each device's
        set, on the CPU), so that a resume gives the bits the uninterrupted run gives."""
        state = {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                 "micro_step": self._micro_step, "window_samples": self._window_samples}
        if self._micro_step:
            if self.world_size > 1:
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
        micro_step = int(state.get("micro_step", 0))
        if micro_step:
            self._restore_window(state.get("window_grads"), micro_step)
        self.global_step = int(state.get("global_step", 0))
        self.guard.reset(int(state.get("skipped_steps", 0)))
        self._micro_step = micro_step
        self._window_samples = int(state.get("window_samples", 0))
        self.sync_replicas()

    def _restore_window(self, grads: Any, micro_step: int) -> None:
        """The gradients of an accumulation window saved mid-way, back on their devices."""
        if micro_step >= self.accumulation_steps:
            raise ValueError(f"load_state_dict: the state is {micro_step} call(s) into an accumulation window, "
                             f"but this trainer steps every {self.accumulation_steps}")
        lanes = self.replicas.lanes
        if not isinstance(grads, list) or len(grads) != len(lanes):
            have = f"{len(grads)} device(s)" if isinstance(grads, list) else "none"
            raise ValueError(f"load_state_dict: the state was saved inside an accumulation window, with the gradients "
                             f"of {have}; resuming it needs the same {len(lanes)} device(s) (or save at a window end)")
        for d, (saved, dev_lanes) in enumerate(zip(grads, lanes)):
            mine = dev_lanes[0].grads
            if len(saved) != len(mine) or any(a.shape != b.shape for a, b in zip(saved, mine)):
                raise ValueError(f"load_state_dict: the saved window gradients of device {d} do not match the "
                                 "model's parameters")
        with torch.no_grad():
            self.replicas.zero(range(len(lanes)))
            for saved, dev_lanes in zip(grads, lanes):
                torch._foreach_copy_(dev_lanes[0].grads, [g.to(dtype=m.dtype) for g, m in zip(saved, dev_lanes[0].grads)])

    def fit(self, data, epochs: int = 1, max_steps: Optional[int] = None, shuffle: bool = False,
            seed: int = 0, val_data=None, log_every: int = 0) -> List[Dict[str, float]]:
        """Train on `data`: a Dataset or DataLoader yielding (x, y) per sample as in the seed (x of
        shape (L, D), or (1, L, D) from a DataLoader with batch_size=1). Consecutive samples form
        steps of samples_per_step; the last step of an epoch may be short. Returns one dict per
        epoch: loss (per-sample mean), samples, steps, samples_per_s, skipped_steps and, with
        val_data, val_loss. [distributed] Every rank passes the same data in the same order; each
        trains on its longest-first share of every global step (vlseq_ext.loop)."""
        return loop.fit(self, data, epochs=epochs, max_steps=max_steps, shuffle=shuffle, seed=seed,
                        val_data=val_data, log_every=log_every)
