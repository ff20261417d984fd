"""How k samples of one device run, on that device's thread: the plan and its graph caches.

Four plans, the same gradient (the float64 per-sample reference) either way:
- "padded": the model has forward_padded and CUDA graphs are on: one graph replay per device per
  step, for a padded shape (batch size, length bucket) (graphs.PaddedGraphs);
- "packed": the model accepts a list: one eager packed batch per device;
- "per_sample": one pass per sample, as graph replays per length when graphs are on
  (graphs.SampleGraphs), round robin over the device's lanes (streams with their own gradient
  sets), whose gradients are then folded into lane 0;
- "gathered": a model that takes one sample at a time and holds vlseq_ext.nn LSTM/GRU modules (the
  trainer swaps torch's in): k eager one-sample passes side by side whose recurrent calls run as one
  batch with per-sample lengths, and whose nn.Linear calls as one matmul (vlseq_ext.nn.gather), then
  one backward over their summed loss.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..nn import GRU, LSTM, concurrency
from ..nn.gather import CallGatherer, gather_linear_calls
from .graphs import GRAPH_MEMORY_SHARE, PaddedGraphs, SampleGraphs, padded_length
from .losses import PerSampleLoss, StepPass, forward_backward, stack_targets
from .options import TrainerOptions
from .replicas import Lane, ReplicaSet

# Below this recurrent width (hidden x layers x directions), k samples per device run faster as k
# per-sample graph replays than as one packed cuDNN batch. Measured on one H200 at k=32
# (BENCHMARKS.md, W2): LSTM 36->64, per-sample graphs 2,547 samples/s vs packed 1,681; 2-layer LSTM
# of width 512, packed 725 vs graphs 216. The crossover lies between the two measured models.
PER_SAMPLE_GRAPH_MAX_WIDTH = 256
# Concurrent one-sample graph replays per device at k > 1 (one stream and gradient set each), each
# lane's launches planned within its share of the SMs (concurrency.sm_budget). On the persistent
# recurrent kernels a one-sample pass holds one cluster, so more lanes keep paying: one H200, LSTM
# 256x2 one-sample model at k=32 (BENCHMARKS.md): 4 / 8 lanes 5,921 / 8,299 samples/s (ninth session;
# on cuDNN's chains 4 and 8 had measured the same); 16 lanes of 8 SMs, each layer on one 8-block
# cluster, 11,685 against 9,186 for 8 lanes of 16 (eighteenth session, diag.lanes; the sweep's pool:
# 7,271 samples/s, 1.39x the packed loop).
MAX_LANES = 16
# Default graph memory (graph_memory_bytes None): graphs.GRAPH_MEMORY_SHARE of the device's memory
# per cache, and at most four tenths for all of a device's lanes together (what four lanes had before
# there could be eight), so more lanes never let graphs take more of the device.
LANES_GRAPH_MEMORY_SHARE = 0.4


def lane_graph_bytes(option: Optional[int], total_memory: int, lanes: int) -> int:
    """Each lane's graph-memory bound: the option when given, else GRAPH_MEMORY_SHARE of the
    device's memory, cut so that the lanes together stay within LANES_GRAPH_MEMORY_SHARE."""
    if option is not None:
        return option
    return int(total_memory * min(GRAPH_MEMORY_SHARE, LANES_GRAPH_MEMORY_SHARE / max(lanes, 1)))


def gathers_calls(model: nn.Module) -> bool:
    """Whether one-sample passes of `model` can have their recurrent calls batched: it holds a
    vlseq_ext.nn LSTM/GRU (gather.CallGatherer stops a pass at those modules' calls only)."""
    return any(isinstance(m, (LSTM, GRU)) for m in model.modules())


def sample_graphs_overlap(model: nn.Module, device: torch.device) -> bool:
    """Whether the model's one-sample graph replays run side by side on `device`: each of its
    recurrent modules runs one sample in a thread-block cluster. Then k replays on lanes beat one
    gathered batch, whose k eager passes are host-bound; where one sample fills the GPU they run one
    after the other. One H200, k=32 (BENCHMARKS.md, diag.one_sample_plans, eighteenth session run 3):
    LSTM 256x2 per-sample graphs 7,333 samples/s, gathered 3,622; LSTM 1024 (a grid) 608 against 3,787."""
    modules = [m for m in model.modules() if isinstance(m, (LSTM, GRU))]
    return bool(modules) and not any(m.fills_gpu_alone(device) for m in modules)


def pass_cpu(device: torch.device) -> Optional[int]:
    """The core a GPU's gathered passes run on (gather.CallGatherer's `cpu`): one per GPU index,
    from the last of this process's cores down. None for CPU devices: their passes compute, and
    OpenMP teams started from a pinned thread would inherit its single core."""
    if device.type != "cuda" or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1 - (device.index or 0) % len(cores)]


def recurrent_width(model: nn.Module) -> int:
    """hidden size x layers x directions of the model's widest recurrent module (0 if none)."""
    widths = [m.hidden_size * m.num_layers * (2 if m.bidirectional else 1)
              for m in model.modules() if isinstance(m, nn.RNNBase)]
    return max(widths, default=0)


def autocast_context(amp: Optional[str], device_type: str):
    """The forward's autocast: none, or bf16 for amp="bf16"."""
    if amp is None:
        return contextlib.nullcontext()
    # No autocast weight cache: captured graphs must re-read the (updated) fp32 weights.
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16, cache_enabled=False)


class SlowPlanWarning(UserWarning):
    """The model can only run the slow way on this trainer: see the message for what would help."""


def slow_plan_note(plan: str, model: nn.Module, samples_per_device: int, pack, cuda_graphs: bool) -> Optional[str]:
    """Why the chosen plan will be slow, when it will be: a wide one-sample model at k > 1 runs one
    batch-1 graph per sample, latency-bound (BENCHMARKS.md: one H200, k=32, LSTM 256x2 on the kernels
    4,400 samples/s against ~8,300 as a list model, seventeenth session; on cuDNN ~4,300 vs ~8,350 and
    LSTM 1024 ~300 vs ~1,800, ninth session). None when the plan is fine or was asked for (pack=False)."""
    width = recurrent_width(model)
    if plan != "per_sample" or not cuda_graphs or samples_per_device < 2 or pack is False \
            or width < PER_SAMPLE_GRAPH_MAX_WIDTH:
        return None
    remedies = "give the model forward_padded(x, lengths) (SeqModel shows how) or let forward take a list of samples"
    if not gathers_calls(model):
        remedies += (", or run its RNN as an nn.LSTM/nn.GRU module with rnn_kernels 'auto' or 'vlseq' (its calls "
                     "are then batched across the samples' passes where that is faster)")
    return (f"vlseq_ext: the model takes one sample at a time (no forward_padded, and forward does not take a "
            f"list) and its recurrent width is {width}: each of the {samples_per_device} samples per GPU runs as "
            "its own batch-1 CUDA graph, which is latency-bound (half to a sixth of the same model's speed as one "
            f"batch at this width). To run them as one batch, {remedies}.")


class DeviceRunner:
    """Runs one device's share of a step (`run(d, xs, ys)`) by the plan chosen at the first step."""

    def __init__(self, model: nn.Module, replicas: ReplicaSet, per_sample_loss: PerSampleLoss,
                 options: TrainerOptions, cuda_graphs: bool) -> None:
        self.model, self.replicas, self.per_sample_loss = model, replicas, per_sample_loss
        self.options, self.cuda_graphs = options, cuda_graphs
        self.devices = replicas.devices
        self.master_device = self.devices[replicas.master_index]
        self.plan: Optional[str] = None
        self.output_shape: Optional[Tuple[int, ...]] = None
        self._accepts_list: Optional[bool] = None
        self.sample_graphs: List[List[SampleGraphs]] = [[] for _ in self.devices]
        self.padded_graphs: List[Optional[PaddedGraphs]] = [None] * len(self.devices)
        self._gatherers: List[Optional[CallGatherer]] = [None] * len(self.devices)

    def close(self) -> None:
        """End the gathered passes' threads."""
        for g in self._gatherers:
            if g is not None:
                g.close()
        self._gatherers = [None] * len(self.devices)

    def forward_each(self, d: int, module: nn.Module, inputs: List[Tensor]) -> List[Tensor]:
        """module(x) for each one-sample input on device d: side by side with their recurrent (and
        GatheredLinear) calls batched where the model allows it (gathers_calls), else one after the
        other."""
        if len(inputs) < 2 or not gathers_calls(module):
            return [module(x) for x in inputs]
        if self._gatherers[d] is None:
            gatherer = CallGatherer(worker_context=functools.partial(autocast_context, self.options.amp,
                                                                     self.devices[0].type),
                                    cpu=pass_cpu(self.devices[d]))
            # Its threads hold it and it holds nothing of this runner: a trainer dropped without
            # close() ends them too.
            weakref.finalize(self, gatherer.close)
            self._gatherers[d] = gatherer
        calls: List[Callable[[], Tensor]] = [functools.partial(module, x) for x in inputs]
        return self._gatherers[d].run(calls)

    def drop_graphs(self) -> None:
        """Forget every captured graph (they recorded which parameters get a gradient); the next
        step captures afresh."""
        if not self.cuda_graphs or self.plan is None:
            return
        self.sample_graphs = [[] for _ in self.devices]
        self.padded_graphs = [None] * len(self.devices)
        self._make_caches()

    @property
    def _dtype(self) -> torch.dtype:
        """The model's floating dtype: samples are converted to it, as every training path does."""
        return self.replicas.master.params[0].dtype

    def caches(self, d: int) -> list:
        return [c for c in [*self.sample_graphs[d], self.padded_graphs[d]] if c is not None]

    def autocast(self):
        return autocast_context(self.options.amp, self.devices[0].type)

    def choose_plan(self, xs: List[Tensor]) -> str:
        """"padded" (graph per padded shape), "packed" (eager list batch), "gathered" (one-sample passes,
        recurrent calls batched) or "per_sample"."""
        pack = self.options.pack
        if pack is False:
            return "per_sample"
        if self.cuda_graphs and callable(getattr(self.model, "forward_padded", None)):
            return "padded"
        if pack == "auto" and self.cuda_graphs and recurrent_width(self.model) < PER_SAMPLE_GRAPH_MAX_WIDTH:
            return "per_sample"
        if self.options.samples_per_device > 1 and self.accepts_list(xs):
            return "packed"
        k_samples = self.options.samples_per_device > 1
        if k_samples and gathers_calls(self.model) and not (
                pack == "auto" and self.cuda_graphs and sample_graphs_overlap(self.model, self.master_device)):
            return "gathered"
        return "per_sample"

    @contextlib.contextmanager
    def _probing(self):
        """Probe calls of the master model: no gradient, and eval mode, so that they draw no random
        numbers (a resumed run must repeat the uninterrupted one) and update no running statistics."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.autocast():
                yield
        finally:
            self.model.train(was_training)

    def accepts_list(self, xs: List[Tensor]) -> bool:
        if self._accepts_list is None:
            probe = [x[:2].to(self.master_device, dtype=self._dtype) for x in xs[:2]]
            try:
                with self._probing():
                    out = self.model(probe)
                self._accepts_list = isinstance(out, Tensor) and out.dim() >= 1 and out.shape[0] == len(probe)
            except Exception:  # any model that rejects a list runs per sample
                self._accepts_list = False
        return self._accepts_list

    def prepare(self, xs: List[Tensor]) -> None:
        """First step: the output shape (for the target check) and the plan with its graph caches."""
        if self.output_shape is None:
            probe = xs[0][:2]  # two steps: a model that returns one row per time step shows it
            with self._probing():
                out = self.model(probe.to(self.master_device, dtype=self._dtype))
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != 1:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"the model's output for one sample of length {probe.shape[0]} is {shape}; it must be "
                                 "(1, outputs): one row per sample (a model that returns one row per time step "
                                 "needs e.g. out[-1:] for the last step)")
            self.output_shape = tuple(out.shape)
        if self.plan is not None:
            return
        opts = self.options
        self.plan = self.choose_plan(xs)
        note = slow_plan_note(self.plan, self.model, opts.samples_per_device, opts.pack, self.cuda_graphs)
        if note:
            warnings.warn(note, SlowPlanWarning, stacklevel=2)
        lanes = opts.lanes or (min(opts.samples_per_device, MAX_LANES)
                               if self.plan == "per_sample" and self.cuda_graphs else 1)
        self.replicas.ensure_lanes(lanes)
        if self.plan == "gathered":  # the heads' nn.Linear calls join batches too
            for dev_lanes in self.replicas.lanes:
                for lane in dev_lanes:
                    gather_linear_calls(lane.module)
        self._make_caches()

    def _pass(self, lane: Lane) -> StepPass:
        """The forward + loss + backward of `lane`, eagerly or as a graph's body."""
        return functools.partial(forward_backward, per_sample_loss=self.per_sample_loss, autocast=self.autocast,
                                 loss_sum=lane.loss)

    def _make_caches(self) -> None:
        if not self.cuda_graphs:
            return
        bounds = (self.options.graph_cache_size, self.options.graph_memory_bytes)
        for d, dev_lanes in enumerate(self.replicas.lanes):
            dtype = dev_lanes[0].params[0].dtype
            if self.plan == "padded":
                lane = dev_lanes[0]
                self.padded_graphs[d] = PaddedGraphs(lane.module, self.devices[d], self._pass(lane), lane.stream, dtype,
                                                     *bounds)
            elif self.plan == "per_sample":
                max_bytes = lane_graph_bytes(self.options.graph_memory_bytes,
                                             torch.cuda.get_device_properties(self.devices[d]).total_memory,
                                             len(dev_lanes))
                self.sample_graphs[d] = [SampleGraphs(lane.module, self.devices[d], self._pass(lane), lane.stream,
                                                      dtype, self.options.graph_cache_size, max_bytes)
                                         for lane in dev_lanes]

    def warmup_steps(self, lengths: List[int]) -> List[List[int]]:
        """The sample lengths of the steps that capture every graph these lengths will replay (after
        prepare): one full batch per padded length bucket, or every length on every lane."""
        lengths = sorted(set(lengths), reverse=True)
        if self.plan == "padded":
            return [[L] * self.options.samples_per_device for L in sorted({padded_length(v) for v in lengths},
                                                                           reverse=True)]
        if self.plan == "per_sample":
            return [[L] * len(self.replicas.lanes[0]) for L in lengths]
        return []

    def run(self, d: int, xs: List[Tensor], ys: List[Tensor]) -> None:
        if self.plan == "padded":
            cache = self.padded_graphs[d]
            with self._joined(d, cache.stream), torch.cuda.stream(cache.stream):
                cache.run(xs, self._stack(d, ys))
        elif self.plan == "packed" and len(xs) > 1:
            self._eager(d, 0, xs, ys)
        elif self.plan == "gathered" and len(xs) > 1:
            self._eager(d, 0, xs, ys, gathered=True)
        else:
            self._per_sample(d, xs, ys)

    def _stack(self, d: int, ys: List[Tensor]) -> Tensor:
        return stack_targets(ys, self.output_shape[-1]).to(self.devices[d], non_blocking=True)

    @contextlib.contextmanager
    def _joined(self, d: int, stream):
        """Work queued on the side `stream` inside starts after what the device's current stream
        holds, and the current stream continues only after it."""
        if stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.devices[d])
        stream.wait_stream(current)
        yield
        current.wait_stream(stream)

    def _per_sample(self, d: int, xs: List[Tensor], ys: List[Tensor]) -> None:
        lanes = self.replicas.lanes[d]
        caches = self.sample_graphs[d]
        n = min(len(lanes), len(xs))
        with contextlib.ExitStack() as stack:
            if len(lanes) > 1 and self.devices[d].type == "cuda":  # each lane on its share of the SMs, and on
                # its own stream (sm_budget says why)
                stack.enter_context(concurrency.sm_budget(concurrency.sm_count(self.devices[d]) // len(lanes)))
            for lane in lanes[:n]:
                stack.enter_context(self._joined(d, lane.stream))
            for i, (x, y) in enumerate(zip(xs, ys)):  # round robin: lane i % n, the same every run
                lane = i % n
                if caches:
                    with torch.cuda.stream(lanes[lane].stream):
                        caches[lane].run(x, y.reshape(1, -1) if y.is_floating_point() else y.reshape(1))
                else:
                    self._eager(d, lane, [x], [y])
        if n > 1:
            self.replicas.fold_lanes(d)

    def _eager(self, d: int, lane: int, xs: List[Tensor], ys: List[Tensor], gathered: bool = False) -> None:
        """Eager forward + backward on lane `lane` of device d: of one sample, one packed list, or
        (gathered) the samples' one-sample passes with their calls batched."""
        ln = self.replicas.lanes[d][lane]
        dev, dtype = self.devices[d], ln.params[0].dtype
        inputs = [x.to(dev, dtype=dtype, non_blocking=True) for x in xs]
        if gathered:
            def forward() -> Tensor:
                return torch.cat(self.forward_each(d, ln.module, inputs))
        else:
            def forward() -> Tensor:
                return ln.module(inputs[0] if len(inputs) == 1 else inputs)
        self._pass(ln)(forward, self._stack(d, ys))
