"""CUDA graphs for a replica's forward + backward: per sample length, or per padded batch shape.

Why: one eager forward + backward of a small RNN spends most of its wall time on the host
(docs/design.md): 1.3 ms eager vs 0.39 ms as a graph replay for the seed model at L=300. A graph
has fixed shapes, so we keep one per shape:
- `SampleGraphs`: one graph per sample length, for any model that maps one (L, D) sample to (1, O).
- `PaddedGraphs`: one graph per (batch size, padded length bucket), for models with
  `forward_padded(x (B, T, D), lengths (B,))` (SeqModel has it). Bucketed lengths repeat, so a
  few dozen graphs cover any data, and k samples run as one replay.

The first time a shape is seen it runs eagerly (a real step: its loss and gradient count), which
also warms up cuDNN and autograd for that shape; then the same computation is captured.

Static state (captured addresses, so it must never move): the input/target buffers of each
shape, the loss accumulator, and the module's `.grad` tensors, which backward accumulates into
in place (the trainer owns them and re-attaches them if anyone replaces them). All graphs of one
cache share a memory pool: they replay one at a time on the cache's stream, so each graph's
intermediates can reuse the same memory. Two caches never share a pool: their streams may run
at the same time.

Each device's work, captures included, is issued by its own thread, so another device's thread may
allocate or synchronise during a capture: see CAPTURE_MODE.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from .losses import StepPass

__all__ = ["capture", "SampleGraphs", "PaddedGraphs", "padded_length"]

# Padded lengths are rounded up to a multiple of this: at most 31 wasted steps per batch (6% of a
# 275-step mean at the default data), and 16 graphs cover lengths 1-512.
PAD_BUCKET = 32
# A cache's graph memory when no bound is given: this share of the device's memory.
GRAPH_MEMORY_SHARE = 0.1
# "relaxed": CUDA's capture-mode checks flag API calls made during a capture that are harmless here
# (another device's thread allocating; lazy loading and event queries inside cuDNN and the
# allocator) and invalidate the capture. With "thread_local", captures of models that capture
# cleanly alone failed now and then on an H200 in a test run (2026-12-01). What must fail still
# fails: a host read syncs the capturing stream, which no mode allows.
CAPTURE_MODE = "relaxed"
# Captures that may fail on one cache before it stops trying (each failure costs one eager run).
MAX_CAPTURE_FAILURES = 2


def padded_length(max_len: int) -> int:
    return -(-max_len // PAD_BUCKET) * PAD_BUCKET


def _rng_usable(device: torch.device) -> bool:
    try:
        torch.empty(1, device=device).uniform_()
        return True
    except RuntimeError:
        return False


def _repair_rng(device: torch.device, backup: torch.Generator) -> None:
    """A capture that fails leaves the device's default generator marked as capturing, and then
    every random op in the process fails ("Offset increment outside graph capture"). An empty
    capture runs the generator's capture prologue and epilogue on the same state that every
    captured graph uses, which clears the mark. If that does not help, the generator gets a fresh
    copy of its pre-capture state, moved far ahead so that it never repeats numbers that graphs
    registered with the old state still draw."""
    if _rng_usable(device):
        return
    side = torch.cuda.Stream(device)
    with warnings.catch_warnings(), torch.cuda.stream(side):
        warnings.simplefilter("ignore")  # "the CUDA Graph is empty"
        try:
            empty = torch.cuda.CUDAGraph()
            empty.capture_begin(capture_error_mode=CAPTURE_MODE)
            empty.capture_end()
            del empty
        except RuntimeError:
            pass
    if _rng_usable(device):
        return
    gen = torch.cuda.default_generators[device.index]
    gen.graphsafe_set_state(backup)
    gen.set_offset(backup.get_offset() + (1 << 44))


def capture(fn: Callable[[], None], device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """Capture fn() (queued on the current stream, which must not be the default stream) as a graph.
    On any failure, capture_begin's included (it marks the generator before it can fail on the
    pool), the capture is ended, the process's RNG left usable, and the error re-raised."""
    gen = torch.cuda.default_generators[device.index]
    backup = gen.clone_state()
    graph = torch.cuda.CUDAGraph()
    error: Optional[BaseException] = None
    began = False
    try:
        graph.capture_begin(pool=pool, capture_error_mode=CAPTURE_MODE)
        began = True
        fn()
    except BaseException as exc:  # noqa: B036 - the capture must end whatever happened
        error = exc
    if began:
        try:
            graph.capture_end()
        except BaseException as exc:  # noqa: B036
            error = error or exc
    if error is not None:
        del graph
        _repair_rng(device, backup)
        raise error
    return graph


class _Cache:
    """What both caches share: the graph pool, the bounds and the counters."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, max_graphs: int,
                 max_bytes: Optional[int]) -> None:
        self.device = device
        self.stream = stream
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes if max_bytes is not None else int(
            GRAPH_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory)
        self.pool = None
        self.graph_bytes = 0
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0
        self.capture_seconds = 0.0  # eager first runs + captures: the warm-up cost
        self.failures = 0
        self.failed: Optional[str] = None  # set once captures are given up

    def _eager_then_capture(self, step: Callable[[], None], n_graphs: int) -> Optional[torch.cuda.CUDAGraph]:
        """Run `step` eagerly (a real step), then capture it; None when it is not captured."""
        t0 = time.perf_counter()
        step()
        self.eager_runs += 1
        graph = None
        if self.failed is None and n_graphs < self.max_graphs and self.graph_bytes < self.max_bytes:
            before = torch.cuda.memory_reserved(self.device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            try:
                graph = capture(step, self.device, self.pool)
                self.captures += 1
                self.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
            except RuntimeError as exc:
                # A model that cannot be captured stays eager. One more try, at another shape, first:
                # a capture once failed on cuDNN's bidirectional GRU and the same shape captured in
                # the run beside it (seen once on an H200; cause not found).
                self.failures += 1
                self.pool = None  # a failed capture can leave its pool marked in use: the next takes a new one
                if self.failures >= MAX_CAPTURE_FAILURES:
                    self.failed = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                    warnings.warn(f"vlseq_ext: CUDA-graph capture failed on {self.device} ({self.failed}); "
                                  "running this replica eagerly", RuntimeWarning)
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def stats(self) -> Dict[str, int]:
        return {"graphs": self.num_graphs(), "captures": self.captures, "replays": self.replays,
                "eager_runs": self.eager_runs, "graph_bytes": self.graph_bytes}

    def num_graphs(self) -> int:
        raise NotImplementedError


class SampleGraphs(_Cache):
    """One sample's forward + backward on `module` (`run_pass`: its lane's pass), through a graph per
    length. Queued on `stream` (the caller makes it wait for the step's start and waits for it at
    the end)."""

    def __init__(self, module: nn.Module, device: torch.device, run_pass: StepPass, stream: torch.cuda.Stream,
                 dtype: torch.dtype, max_graphs: int = 1024, max_bytes: Optional[int] = None) -> None:
        super().__init__(device, stream, max_graphs, max_bytes)
        self.module, self.run_pass, self.dtype = module, run_pass, dtype
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.x_buf: Optional[Tensor] = None
        self.y_buf: Optional[Tensor] = None

    def num_graphs(self) -> int:
        return len(self.graphs)

    def _fits(self, x: Tensor, y: Tensor) -> bool:
        """Make x_buf/y_buf fit this sample; False when it cannot use graphs (a target shape or
        dtype other than the captured one)."""
        L, D = x.shape
        if self.y_buf is None:
            self.y_buf = torch.empty(y.shape, dtype=y.dtype, device=self.device)
        elif self.y_buf.shape != y.shape or self.y_buf.dtype != y.dtype:
            return False
        if self.x_buf is None or self.x_buf.shape[0] < L or self.x_buf.shape[1] != D:
            cap = max(L, 2 * self.x_buf.shape[0] if self.x_buf is not None else 512)
            self.graphs.clear()  # captured addresses point at the old buffer
            self.pool, self.graph_bytes = None, 0
            self.x_buf = torch.zeros(cap, D, dtype=self.dtype, device=self.device)
        return True

    def _step(self, x: Tensor, y: Tensor) -> None:
        self.run_pass(lambda: self.module(x), y)

    def run(self, x: Tensor, y: Tensor) -> None:
        """x: (L, D) on any device; y: the target shaped like a one-sample batch. Must be called
        with `stream` current."""
        if not self._fits(x, y):
            self.eager_runs += 1
            self._step(x.to(self.device, self.dtype, non_blocking=True), y.to(self.device, non_blocking=True))
            return
        L = x.shape[0]
        xs = self.x_buf[:L]
        xs.copy_(x, non_blocking=True)
        self.y_buf.copy_(y, non_blocking=True)
        graph = self.graphs.get(L)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        graph = self._eager_then_capture(lambda: self._step(xs, self.y_buf), len(self.graphs))
        if graph is not None:
            self.graphs[L] = graph


class _PaddedEntry:
    __slots__ = ("x", "lengths", "y", "graph")

    def __init__(self, x: Tensor, lengths: Tensor, y: Tensor) -> None:
        self.x, self.lengths, self.y, self.graph = x, lengths, y, None


class PaddedGraphs(_Cache):
    """k samples' forward + backward as one replay: the batch is zero-padded to a bucketed length
    T and run through `module.forward_padded(x, lengths)`, whose result for each sample equals
    its own forward (the model's promise; SeqModel keeps it by reading each sample's state at its
    own last step). `run_pass`: the lane's pass; queued on `stream`."""

    def __init__(self, module: nn.Module, device: torch.device, run_pass: StepPass, stream: torch.cuda.Stream,
                 dtype: torch.dtype, max_graphs: int = 1024, max_bytes: Optional[int] = None) -> None:
        super().__init__(device, stream, max_graphs, max_bytes)
        self.module, self.run_pass, self.dtype = module, run_pass, dtype
        self.entries: Dict[Tuple[int, int], _PaddedEntry] = {}

    def num_graphs(self) -> int:
        return sum(e.graph is not None for e in self.entries.values())

    def _step(self, e: _PaddedEntry) -> None:
        self.run_pass(lambda: self.module.forward_padded(e.x, e.lengths), e.y)

    def run(self, xs: List[Tensor], y: Tensor) -> None:
        """xs: B samples (L_i, D); y: their stacked targets (B, ...). Must be called with `stream`
        current."""
        lengths = [x.shape[0] for x in xs]
        B, T = len(xs), padded_length(max(lengths))
        e = self.entries.get((B, T))
        if e is None or e.y.shape != y.shape or e.y.dtype != y.dtype:
            if e is not None:  # another target layout: keep the graph, run this one eagerly
                e = _PaddedEntry(torch.empty_like(e.x), torch.empty_like(e.lengths), y.to(self.device))
                self._fill(e, xs, lengths, y)
                self.eager_runs += 1
                self._step(e)
                return
            e = _PaddedEntry(torch.empty(B, T, xs[0].shape[1], dtype=self.dtype, device=self.device),
                             torch.empty(B, dtype=torch.int64, device=self.device),
                             torch.empty(y.shape, dtype=y.dtype, device=self.device))
            self.entries[(B, T)] = e
        self._fill(e, xs, lengths, y)
        if e.graph is not None:
            e.graph.replay()
            self.replays += 1
            return
        e.graph = self._eager_then_capture(lambda: self._step(e), self.num_graphs())

    @staticmethod
    def _fill(e: _PaddedEntry, xs: List[Tensor], lengths: List[int], y: Tensor) -> None:
        L = max(lengths)
        e.x[:, :L].copy_(pad_sequence(xs, batch_first=True), non_blocking=True)
        if L < e.x.shape[1]:
            e.x[:, L:].zero_()
        e.lengths.copy_(torch.tensor(lengths, dtype=torch.int64), non_blocking=True)
        e.y.copy_(y, non_blocking=True)
