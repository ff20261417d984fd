"""ParallelTrainer: drop-in multi-device training on variable-length samples with exact gradients.

It replaces the seed's replicate / scatter / parallel_apply / stack-sum loop (DESIGN.md §1):

    model = SeqModel().cuda(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = ParallelTrainer(model, optimizer, nn.MSELoss())
    for samples, targets in steps:           # lists of (L_i, 36) tensors and their targets
        loss = trainer.step(samples, targets)

One step: samples go to devices by length (longest first, LPT), every device runs forward +
backward on its replica (one persistent replica per device; the master model is the replica on
its own device), one fused P2P all-reduce merges the gradients, the user's optimizer steps once
on the master, and a P2P broadcast copies parameters and buffers back to the replicas.
"""
from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import ops
from .graphs import GraphCache
from .losses import PerSampleLoss, stack_targets

DeviceLike = Union[str, int, torch.device]


def parse_devices(devices: Optional[Sequence[DeviceLike]]) -> List[torch.device]:
    """None -> every visible GPU (or one CPU device when there is none). Validates existence and
    rejects duplicate GPUs; several "cpu" entries are allowed (CPU replicas, for testing)."""
    if devices is None:
        n = torch.cuda.device_count()
        return [torch.device("cuda", i) for i in range(n)] if n else [torch.device("cpu")]
    if isinstance(devices, (str, int, torch.device)):
        raise ValueError(f"devices must be a list, got {devices!r}")
    out: List[torch.device] = []
    for d in devices:
        try:
            dev = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"devices: cannot parse {d!r} as a device ({exc})") from None
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", 0)
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if dev.index >= n:
                raise ValueError(f"devices: {dev} does not exist ({n} CUDA device(s) visible)")
            if dev in out:
                raise ValueError(f"devices: {dev} is listed twice")
        elif dev.type != "cpu":
            raise ValueError(f"devices: only CUDA and CPU devices are supported, got {dev}")
        out.append(dev)
    if not out:
        raise ValueError("devices is empty")
    if len({d.type for d in out}) > 1:
        raise ValueError(f"devices mixes CPU and CUDA: {[str(d) for d in out]}")
    return out


def assign_lpt(lengths: Sequence[int], num_devices: int, capacity: int) -> List[List[int]]:
    """Longest-processing-time-first assignment of samples (by length) to devices, at most
    `capacity` per device, so the devices finish together. Returns sample indices per device."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * num_devices
    groups: List[List[int]] = [[] for _ in range(num_devices)]
    for i in order:
        d = min((d for d in range(num_devices) if len(groups[d]) < capacity), key=lambda d: (loads[d], d))
        groups[d].append(i)
        loads[d] += lengths[i]
    return groups


def _model_input_dim(model: nn.Module) -> Optional[int]:
    dim = getattr(model, "input_dim", None)
    if isinstance(dim, int):
        return dim
    for m in model.modules():
        if isinstance(m, nn.RNNBase):
            return m.input_size
    return None


class ParallelTrainer:
    """Trains `model` with `optimizer` on several devices of one process.

    Args:
        model: the user's model, on one of `devices` (or on CPU; it is then moved to devices[0]).
            It maps one sample (L, D) to an output (1, O); if it also maps a list of samples to
            (B, O) (like SeqModel), k samples per device run as one packed batch.
        optimizer: built over model.parameters(), as in the seed; it steps once per step on the
            master model.
        loss_fn: loss_fn(output, target) for one sample, e.g. nn.MSELoss(). The step's loss is
            the sum over samples (reduction="sum", the seed's semantics) or the mean over the
            step's true sample count (reduction="mean"), so a short tail step gives exactly the
            gradient one device would compute on the same samples.
        devices: None (all visible GPUs), or a list such as ["cuda:0", "cuda:1"] or ["cpu", "cpu"].
        samples_per_device: k samples per device per step.
        cuda_graphs: replay a per-length CUDA graph for one-sample forward + backward (exactly the
            eager gradient; see vlseq_ext.graphs). False runs everything eagerly.
        pack: how k > 1 samples per device run, with the same gradient either way: "auto" (one
            graph replay per sample for narrow RNNs under CUDA graphs; otherwise one packed batch
            when the model accepts a list), True (packed), or False (k per-sample passes).
        clip_grad_norm: clip the merged gradient to this global L2 norm.
        amp: None or "bf16" (autocast forward; fp32 master weights, gradients and reduction).
        accumulation_steps: optimizer steps every this many calls of step().
        nonfinite: "skip" (skip the optimizer step on a NaN/inf gradient, count it, warn),
            "raise" (FloatingPointError), or "ignore". With a fused optimizer
            (torch.optim.Adam/AdamW/SGD(fused=True)) "skip" happens on the GPU with no host sync
            and the count is read lazily; otherwise "skip"/"raise" read one flag per step.
        track_grad_norm: compute the global gradient norm every step (last_grad_norm); always
            on when clipping.
        graph_cache_size, graph_memory_bytes: bounds on the per-device graph cache; past them
            new lengths run eagerly.
        process_group: "auto" (use the initialised torch.distributed default group, or initialise
            one from torchrun's environment, when there are several processes), None (this
            process only), or a ProcessGroup. With several processes the gradient is summed
            across all of them after the in-process merge (vlseq_ext.distributed).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, devices=None,
                 samples_per_device: int = 1, reduction: str = "sum", cuda_graphs: bool = True,
                 pack: Union[str, bool] = "auto", clip_grad_norm: Optional[float] = None, amp: Optional[str] = None,
                 accumulation_steps: int = 1, nonfinite: str = "skip", track_grad_norm: bool = False,
                 graph_cache_size: int = 1024, graph_memory_bytes: Optional[int] = None,
                 process_group: Any = "auto") -> None:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        if not isinstance(samples_per_device, int) or samples_per_device < 1:
            raise ValueError(f"samples_per_device must be a positive int, got {samples_per_device!r}")
        if amp not in (None, "bf16"):
            raise ValueError(f"amp must be None or 'bf16', got {amp!r}")
        if nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"nonfinite must be 'skip', 'raise' or 'ignore', got {nonfinite!r}")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if pack not in ("auto", True, False):
            raise ValueError(f"pack must be 'auto', True or False, got {pack!r}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive, got {clip_grad_norm!r}")
        params = list(model.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        model_param_ids = {id(p) for p in params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model_param_ids:
                    raise ValueError("the optimizer holds a parameter that is not one of the model's; "
                                     "build it over model.parameters()")

        if devices is None:  # [distributed] several processes per machine: this process's share of the GPUs
            from .distributed import default_local_devices
            devices = default_local_devices()
        self.devices = parse_devices(devices)
        master_dev = params[0].device
        if any(p.device != master_dev for p in params):
            raise ValueError("the model's parameters are on several devices; put the model on one device")
        if master_dev not in self.devices:
            if optimizer.state:
                raise ValueError(f"the model is on {master_dev}, which is not in devices, and the optimizer "
                                 "already holds state there; move the model before building the optimizer")
            model.to(self.devices[0])
            master_dev = self.devices[0]
        self.master_index = self.devices.index(master_dev)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.per_sample_loss = PerSampleLoss(loss_fn)
        self.samples_per_device = samples_per_device
        self.samples_per_step = samples_per_device * len(self.devices)
        self.reduction = reduction
        self.pack = pack
        self.clip_grad_norm = clip_grad_norm
        self.amp = amp
        self.accumulation_steps = accumulation_steps
        self.nonfinite = nonfinite
        self.track_grad_norm = track_grad_norm
        self.input_dim = _model_input_dim(model)
        self.is_cuda = self.devices[0].type == "cuda"

        self.replicas: List[nn.Module] = []
        for i, dev in enumerate(self.devices):
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
        self.replica_params = [list(r.parameters()) for r in self.replicas]
        self._static_grads = [[torch.zeros_like(p) for p in ps] for ps in self.replica_params]
        self._attach_grads()
        self.loss_acc = [torch.zeros((), dtype=torch.float32, device=d) for d in self.devices]
        # The merge reduces every replica's grads and loss into the master's, in one kernel on the
        # master's device, and zeroes the replicas' (the next step starts from zero there).
        order = [self.master_index] + [i for i in range(len(self.devices)) if i != self.master_index]
        self._merge_lists = ops.DeviceLists([self._static_grads[i] + [self.loss_acc[i]] for i in order])
        self._norm_buffer = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=master_dev)
        self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=master_dev)
        self._skipped_seen = 0
        self._inf_flag = torch.zeros((), dtype=torch.float32, device=master_dev)
        self._one = torch.ones((), dtype=torch.float32, device=master_dev)
        from .distributed import CrossProcessMerge
        # Across processes: the master's merged gradient and loss, summed over every rank.
        self.cross_process = CrossProcessMerge.create(process_group, self._static_grads[self.master_index],
                                                      self.loss_acc[self.master_index],
                                                      samples_per_step=self.samples_per_step)
        if self.cross_process is not None:
            self.cross_process.broadcast_from_rank0(params + list(model.buffers()))
        # [distributed] this process's rank and the number of processes (0 and 1 when alone).
        self.rank = self.cross_process.rank if self.cross_process is not None else 0
        self.world_size = self.cross_process.world_size if self.cross_process is not None else 1

        self.cuda_graphs = bool(cuda_graphs) and self.is_cuda
        self.graph_caches: List[Optional[GraphCache]] = [None] * len(self.devices)
        if self.cuda_graphs:
            for i, (r, dev) in enumerate(zip(self.replicas, self.devices)):
                self.graph_caches[i] = GraphCache(r, dev, self._one_sample_loss, self._autocast, self.loss_acc[i],
                                                  dtype=self.replica_params[i][0].dtype, max_graphs=graph_cache_size,
                                                  max_bytes=graph_memory_bytes)
        self._accepts_list: Optional[bool] = None
        self._micro_step = 0
        self._window_samples = 0
        self.global_step = 0
        self._skipped_host = 0
        self.last_grad_norm: Optional[Tensor] = None
        self.sync_replicas()

    # ---------------------------------------------------------------------------------------
    # helpers
    def _autocast(self):
        if self.amp is None:
            return contextlib.nullcontext()
        # No autocast weight cache: captured graphs must re-read the (updated) fp32 weights.
        return torch.autocast(device_type=self.devices[0].type, dtype=torch.bfloat16, cache_enabled=False)

    def _one_sample_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self.per_sample_loss(output, target)[0]

    def _attach_grads(self) -> None:
        """Give every replica parameter its static grad tensor (CUDA graphs captured their
        addresses), e.g. after optimizer.zero_grad(set_to_none=True) dropped them."""
        for ps, gs in zip(self.replica_params, self._static_grads):
            for p, g in zip(ps, gs):
                if p.grad is not g:
                    p.grad = g

    def _zero(self, devices: Iterable[int]) -> None:
        """Zero the static grads and loss accumulators of these replicas, in place."""
        self._attach_grads()
        for i in devices:
            torch._foreach_zero_(self._static_grads[i] + [self.loss_acc[i]])

    @staticmethod
    def _as_tensor(x: Any, what: str) -> Tensor:
        if isinstance(x, Tensor):
            return x
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{what} is not a tensor ({exc})") from None

    def _validate(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tuple[List[Tensor], List[Tensor]]:
        """Normalises and checks one step's input before any work, so bad input changes nothing."""
        if isinstance(samples, Tensor) or not isinstance(samples, (list, tuple)):
            raise ValueError("samples must be a list of (L, D) tensors")
        if len(samples) == 0 and self.cross_process is None:  # [distributed] a rank may have none in a tail step
            raise ValueError("empty step: no samples")
        if isinstance(targets, Tensor):
            targets = list(targets) if targets.dim() > 0 and targets.shape[0] == len(samples) else [targets]
        if len(targets) != len(samples):
            raise ValueError(f"got {len(samples)} samples but {len(targets)} targets")
        if len(samples) > self.samples_per_step:
            raise ValueError(f"got {len(samples)} samples but a step takes at most {self.samples_per_step} "
                             f"({len(self.devices)} devices x {self.samples_per_device})")
        xs, ys = [], []
        for i, (x, y) in enumerate(zip(samples, targets)):
            x = self._as_tensor(x, f"sample {i}")
            y = self._as_tensor(y, f"target {i}")
            if x.dim() == 3 and x.shape[0] == 1:  # a DataLoader(batch_size=1) sample
                x = x[0]
            if x.dim() != 2:
                raise ValueError(f"sample {i} has shape {tuple(x.shape)}; expected (length, features)")
            if x.shape[0] == 0:
                raise ValueError(f"sample {i} has length 0")
            if self.input_dim is not None and x.shape[1] != self.input_dim:
                raise ValueError(f"sample {i} has {x.shape[1]} features, model expects {self.input_dim}")
            if not x.is_floating_point():
                raise ValueError(f"sample {i} has dtype {x.dtype}; expected a floating-point tensor")
            if y.numel() == 0:
                raise ValueError(f"target {i} is empty")
            xs.append(x)
            ys.append(y)
        return xs, ys

    def _model_accepts_list(self, xs: List[Tensor]) -> bool:
        if self.pack is not True and self.pack is not False:
            if self._accepts_list is None:
                probe = [x[:2].to(self.devices[self.master_index]) for x in xs[:2]]
                try:
                    with torch.no_grad():
                        out = self.model(probe)
                    self._accepts_list = isinstance(out, Tensor) and out.dim() >= 1 and out.shape[0] == len(probe)
                except Exception:  # any model that rejects a list runs per sample
                    self._accepts_list = False
            return self._accepts_list
        return bool(self.pack)

    # ---------------------------------------------------------------------------------------
    # per-device work
    @staticmethod
    def _one_target(y: Tensor) -> Tensor:
        """A sample's target as a one-sample batch: float targets (1, numel), class indices (1,)."""
        return y.reshape(1, -1) if y.is_floating_point() else y.reshape(1)

    def _run_packed(self, d: int, xs: List[Tensor], ys: List[Tensor]) -> None:
        """One packed forward + backward of several samples on device d."""
        dev = self.devices[d]
        dtype = self.replica_params[d][0].dtype
        with self._autocast():
            out = self.replicas[d]([x.to(dev, dtype=dtype, non_blocking=True) for x in xs])
        out = out.float()
        loss = self.per_sample_loss(out, stack_targets(ys, out.shape[-1]).to(dev, non_blocking=True)).sum()
        loss.backward()
        self.loss_acc[d].add_(loss.detach())

    def _run_one(self, d: int, x: Tensor, y: Tensor) -> None:
        """Forward + backward of one sample on device d: a graph replay when possible."""
        cache = self.graph_caches[d]
        if cache is not None:
            cache.run(x, self._one_target(y))
            return
        dev = self.devices[d]
        with self._autocast():
            out = self.replicas[d](x.to(dev, dtype=self.replica_params[d][0].dtype, non_blocking=True))
        loss = self._one_sample_loss(out.float(), stack_targets([y], out.shape[-1]).to(dev, non_blocking=True))
        loss.backward()
        self.loss_acc[d].add_(loss.detach())

    # ---------------------------------------------------------------------------------------
    # public API
    def compute_gradients(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """Forward and backward of one step's samples on every device, then the gradient merge.
        Leaves the merged gradient (sum, or mean over these samples) in the master model's .grad;
        no optimizer step. Returns the step's loss as a 0-dim tensor on the master device."""
        xs, ys = self._validate(samples, targets)
        self._micro_step = self._window_samples = 0
        self._zero(range(len(self.devices)))
        self._forward_backward(xs, ys)
        return self._merge(len(xs))

    def step(self, samples: Sequence[Any], targets: Sequence[Any]) -> Tensor:
        """compute_gradients, then clipping, the non-finite guard, the optimizer step on the master
        and the parameter sync to every replica. With accumulation_steps=a, gradients accumulate
        over a calls and the optimizer steps on the a-th. Returns the loss of these samples
        (sum or mean per `reduction`) as a 0-dim tensor on the master device; no host sync."""
        xs, ys = self._validate(samples, targets)
        if self.accumulation_steps == 1:
            # Replicas were zeroed by the previous merge; only the master needs it.
            self._zero([self.master_index])
            self._forward_backward(xs, ys)
            loss = self._merge(len(xs))
            self._optimizer_step()
            return loss
        # Accumulation: the window's grads add up on every replica and merge on the last call;
        # each call's own loss is summed across devices here.
        self._zero(range(len(self.devices)) if self._micro_step == 0 else [])
        for acc in self.loss_acc:
            acc.zero_()
        self._forward_backward(xs, ys)
        master = self.devices[self.master_index]
        loss = sum(acc.to(master, non_blocking=True) for acc in self.loss_acc)
        self._micro_step += 1
        self._window_samples += len(xs)
        if self._micro_step == self.accumulation_steps:
            self._merge(self._window_samples)
            self._micro_step = self._window_samples = 0
            self._optimizer_step()
        return loss / max(len(xs), 1) if self.reduction == "mean" else loss

    def _forward_backward(self, xs: List[Tensor], ys: List[Tensor]) -> None:
        if not xs:  # [distributed] no sample on this rank this step: it only joins the merge
            return
        for r in self.replicas:
            if r.training != self.model.training:
                r.train(self.model.training)
        groups = assign_lpt([x.shape[0] for x in xs], len(self.devices), self.samples_per_device)
        packed = self.samples_per_device > 1 and self._packs(xs)
        with torch.profiler.record_function("vlseq::forward_backward"):
            if packed or not self.is_cuda:
                for d, idx in enumerate(groups):
                    if idx:
                        with self._on(d):
                            if packed and len(idx) > 1:
                                self._run_packed(d, [xs[i] for i in idx], [ys[i] for i in idx])
                            else:
                                for i in idx:
                                    self._run_one(d, xs[i], ys[i])
                return
            # One sample per device at a time, round robin, so every GPU starts working at once.
            for s in range(max(len(g) for g in groups)):
                for d, idx in enumerate(groups):
                    if s < len(idx):
                        with self._on(d):
                            self._run_one(d, xs[idx[s]], ys[idx[s]])

    def _on(self, d: int):
        return torch.cuda.device(self.devices[d]) if self.is_cuda else contextlib.nullcontext()

    def _packs(self, xs: List[Tensor]) -> bool:
        """Whether k samples per device run as one packed batch (same gradient either way). "auto":
        without CUDA graphs, pack; with them, replay one graph per sample for narrow RNNs and pack
        wide ones. Measured on one H200 at k=32 (BENCHMARKS.md, W2): LSTM 36->64, per-sample
        graphs 2,547 samples/s vs packed 1,681; 2-layer LSTM of width 512, packed 725 vs graphs
        216. The crossover width (256) lies between the two measured models."""
        if self.pack == "auto":
            if self.cuda_graphs and self._recurrent_width() < 256:
                return False
            return self._model_accepts_list(xs)
        return bool(self.pack) and self._model_accepts_list(xs)

    def _recurrent_width(self) -> int:
        """hidden size x layers x directions of the model's widest recurrent module (0 if none)."""
        widths = [m.hidden_size * m.num_layers * (2 if m.bidirectional else 1)
                  for m in self.model.modules() if isinstance(m, nn.RNNBase)]
        return max(widths, default=0)

    def _merge(self, n: int) -> Tensor:
        """Master grads <- sum of every replica's (scaled for "mean"), replicas zeroed; the loss
        accumulators ride along. Returns the step's loss (a copy, on the master device)."""
        mean = self.reduction == "mean"
        with torch.profiler.record_function("vlseq::merge"):
            if self.cross_process is None:
                ops.reduce_tensors_(self._merge_lists, 1.0 / n if mean else 1.0, zero_others=True)
            else:
                ops.reduce_tensors_(self._merge_lists, 1.0, zero_others=True)
                self.cross_process.all_reduce_(n, mean)  # sum over ranks; / global count for "mean"
        return self.loss_acc[self.master_index].clone()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped by the non-finite guard (reads the device-side count: one host sync)."""
        on_device = int(self._skipped_on_device.item())
        if on_device > self._skipped_seen:
            warnings.warn(f"vlseq_ext: {on_device - self._skipped_seen} step(s) had a non-finite gradient and were "
                          f"skipped ({self._skipped_host + on_device} skipped in all)", RuntimeWarning)
            self._skipped_seen = on_device
        return self._skipped_host + on_device

    def _found_inf(self) -> Tensor:
        """1.0 (float32, on the master device) when any merged gradient is NaN/inf, else 0.0."""
        if self.last_grad_norm is not None:
            return (~torch.isfinite(self.last_grad_norm)).float()
        self._inf_flag.zero_()
        if self.is_cuda:
            # One multi-tensor kernel over all gradients (GradScaler's check; scaling by 1.0).
            torch._amp_foreach_non_finite_check_and_unscale_(self._static_grads[self.master_index], self._inf_flag,
                                                             self._one)
        else:
            for g in self._static_grads[self.master_index]:
                self._inf_flag.logical_or_(~torch.isfinite(g).all())
        return self._inf_flag

    def _optimizer_step(self) -> None:
        self.last_grad_norm = None
        master_grads = self._static_grads[self.master_index]
        if self.clip_grad_norm is not None or self.track_grad_norm:
            with torch.profiler.record_function("vlseq::grad_norm"):
                # Global L2 norm on the master's flat gradient buffer; no host sync.
                self.last_grad_norm = torch.linalg.vector_norm(ops.flatten(master_grads, out=self._norm_buffer))
                if self.clip_grad_norm is not None:
                    coef = torch.clamp(self.clip_grad_norm / (self.last_grad_norm + 1e-6), max=1.0)
                    torch._foreach_mul_(master_grads, coef)
        found_inf = None
        if self.nonfinite != "ignore":
            found_inf = self._found_inf()
            if self.nonfinite == "skip" and getattr(self.optimizer, "_step_supports_amp_scaling", False):
                # Fused optimizers skip on the device when found_inf != 0 (the GradScaler protocol):
                # no host sync; the count is read lazily (skipped_steps).
                self._skipped_on_device += found_inf
            else:
                if bool(found_inf):  # one host sync per step
                    self._skipped_host += 1
                    self.global_step += 1
                    if self.nonfinite == "raise":
                        raise FloatingPointError(f"non-finite gradient at step {self.global_step}; no update was made")
                    warnings.warn(f"vlseq_ext: non-finite gradient at step {self.global_step}; skipped the optimizer "
                                  f"step ({self._skipped_host} skipped so far)", RuntimeWarning)
                    return
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
        self.global_step += 1
        with torch.profiler.record_function("vlseq::sync"):
            self.sync_replicas()

    def sync_replicas(self, buffers_only: bool = False) -> None:
        """Copy the master's parameters (unless buffers_only) and buffers into every replica, over
        the P2P broadcast. Call it after changing the master's weights outside step()."""
        if len(self.replicas) == 1:
            return
        others = [i for i in range(len(self.replicas)) if i != self.master_index]
        with torch.no_grad():
            if not buffers_only:
                ops.broadcast_tensors_([p.detach() for p in self.replica_params[self.master_index]],
                                       [[p.detach() for p in self.replica_params[i]] for i in others])
            master_bufs = list(self.model.buffers())
            if master_bufs:
                for i in others:
                    for src, dst in zip(master_bufs, self.replicas[i].buffers()):
                        dst.copy_(src, non_blocking=True)

    def evaluate(self, samples: Sequence[Tensor], targets: Optional[Sequence[Any]] = None,
                 batch_size: int = 64) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """Outputs (B, O) of the master model for `samples`, without gradients (eval mode for the
        duration), on the master device. With targets, returns (outputs, per-sample losses (B,))."""
        xs, ys = self._validate_eval(samples, targets if targets is not None else [torch.zeros(1)] * len(samples))
        dev = self.devices[self.master_index]
        dtype = self.replica_params[self.master_index][0].dtype
        was_training = self.model.training
        self.model.eval()
        outs = []
        try:
            with torch.no_grad(), self._autocast():
                packed = len(xs) > 1 and self._model_accepts_list(xs)
                for s in range(0, len(xs), batch_size):
                    chunk = [x.to(dev, dtype=dtype) for x in xs[s:s + batch_size]]
                    outs.append(self.model(chunk) if packed and len(chunk) > 1 else torch.cat([self.model(x) for x in chunk]))
        finally:
            self.model.train(was_training)
        out = torch.cat(outs).float()
        if targets is None:
            return out
        return out, self.per_sample_loss(out, stack_targets(ys, out.shape[-1]).to(dev))

    def _validate_eval(self, samples, targets):
        xs, ys = [], []
        for s in range(0, len(samples), self.samples_per_step):
            a, b = self._validate(list(samples[s:s + self.samples_per_step]), list(targets[s:s + self.samples_per_step]))
            xs += a
            ys += b
        return xs, ys

    def warmup(self, lengths: Iterable[int], target: Optional[Tensor] = None) -> None:
        """Capture CUDA graphs for these sample lengths on every device ahead of training (the
        one-sample path), so timing and the first epoch do not pay for captures. Leaves
        gradients, losses and parameters as they were."""
        if not self.cuda_graphs:
            return
        target = torch.zeros(1) if target is None else target
        dim = self.input_dim or 1
        y = self._one_target(target)
        for d, cache in enumerate(self.graph_caches):
            with torch.cuda.device(self.devices[d]):
                for L in sorted(set(int(v) for v in lengths), reverse=True):
                    cache.run(torch.randn(L, dim, device=self.devices[d]), y)
        self._zero(range(len(self.devices)))

    def graph_stats(self) -> List[Dict[str, int]]:
        return [c.stats() for c in self.graph_caches if c is not None]

    def state_dict(self) -> Dict[str, Any]:
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "micro_step": self._micro_step, "window_samples": self._window_samples}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the counters and re-sync every replica from the master model (load the model
        and optimizer state first)."""
        self.global_step = int(state.get("global_step", 0))
        self._skipped_host = int(state.get("skipped_steps", 0))
        self._skipped_on_device.zero_()
        self._skipped_seen = 0
        self._micro_step = int(state.get("micro_step", 0))
        self._window_samples = int(state.get("window_samples", 0))
        self.sync_replicas()

    def fit(self, data, epochs: int = 1, max_steps: Optional[int] = None, shuffle: bool = False,
            seed: int = 0, val_data=None, log_every: int = 0) -> List[Dict[str, float]]:
        """Train on `data`: a Dataset or DataLoader yielding (x, y) per sample as in the seed
        (x of shape (L, D), or (1, L, D) from a DataLoader with batch_size=1). Consecutive samples
        form steps of samples_per_step; the last step of an epoch may be short. Returns one dict
        per epoch: loss (per-sample mean), samples, steps, samples_per_s, skipped_steps and, with
        val_data, val_loss. [distributed] With several processes, every rank must pass the same data
        in the same order: consecutive samples form global steps of world_size x samples_per_step,
        each rank trains on its longest-first share (vlseq_ext.distributed.lpt_shard), and the
        records count the global samples."""
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        history: List[Dict[str, float]] = []
        steps_done = 0
        for epoch in range(epochs):
            order = None
            if shuffle and hasattr(data, "__len__") and hasattr(data, "__getitem__"):
                g = torch.Generator().manual_seed(seed + epoch)
                order = torch.randperm(len(data), generator=g).tolist()
            it = (data[i] for i in order) if order is not None else iter(data)
            t0 = time.perf_counter()
            total = torch.zeros((), device=self.devices[self.master_index])
            n = steps = 0
            batch: List[Tuple[Any, Any]] = []
            stop = False
            for item in it:
                batch.append(item)
                if len(batch) == self.samples_per_step * self.world_size:  # [distributed] a global step
                    total += self._fit_step(batch)
                    n, steps, batch = n + len(batch), steps + 1, []
                    if max_steps is not None and steps_done + steps >= max_steps:
                        stop = True
                        break
            if batch and not stop:
                total += self._fit_step(batch)
                n, steps = n + len(batch), steps + 1
            if n == 0:
                raise ValueError("empty dataset: no samples to train on")
            if self.is_cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            steps_done += steps
            rec = {"epoch": epoch, "loss": float(total) / n, "samples": n, "steps": steps,
                   "samples_per_s": n / elapsed if elapsed > 0 else math.inf, "skipped_steps": self.skipped_steps}
            if val_data is not None:
                vx, vy = zip(*[(x, y) for x, y in val_data])
                _, losses = self.evaluate(list(vx), list(vy))
                rec["val_loss"] = float(losses.mean())
            history.append(rec)
            if stop:
                break
        return history

    def _fit_step(self, batch: List[Tuple[Any, Any]]) -> Tensor:
        mine = batch
        if self.cross_process is not None:  # [distributed] this rank's longest-first share of the global step
            from .distributed import sample_length
            mine = [batch[i] for i in self.cross_process.shard([sample_length(b[0]) for b in batch],
                                                               self.samples_per_device, len(self.devices))]
        xs = [b[0] for b in mine]
        ys = [b[1] for b in mine]
        loss = self.step(xs, ys)  # the global loss: sum, or mean over the global step
        return loss * len(batch) if self.reduction == "mean" else loss
