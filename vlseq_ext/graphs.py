"""Per-length CUDA-graph cache for the one-sample forward + backward of a replica.

Why: one eager forward + backward of the seed model spends most of its wall time on the host
(DESIGN.md §3): 1.3 ms eager vs 0.39 ms as a graph replay at L=300. A graph has fixed shapes, so
we keep one graph per sample length. The first sample of a length runs eagerly (it is a real
sample: its loss and gradient count) on the capture stream, which also warms up cuDNN and
autograd for that shape; then the same computation is captured for later replays.

Static state shared by all graphs of one replica (captured addresses, so it must never move):
- `x_buf` (capacity, D): inputs are copied into x_buf[:L]; the capacity only grows, and growing
  drops every graph (their addresses would be stale);
- `y_buf`: the target, shaped as the first target seen;
- `loss_acc`: a 0-dim fp32 accumulator, the graph adds the sample's loss to it;
- the replica's `.grad` tensors, which backward accumulates into in place. The trainer owns them
  and re-attaches them if anyone replaces them (e.g. optimizer.zero_grad(set_to_none=True)).
All graphs of a replica share one memory pool: each graph's intermediates die at the end of its
capture, and graphs only ever replay one at a time on one stream, so they can reuse the same
memory; the pool is about one graph's footprint, not the sum.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Dict, Optional

import torch
from torch import Tensor, nn


class GraphCache:
    """Runs one sample's forward + backward on `replica` (on `device`), through a cached CUDA
    graph per length when possible, else eagerly. Adds the loss to `loss_acc` and the gradient
    to the replica's grads."""

    def __init__(self, replica: nn.Module, device: torch.device, loss_of: Callable[[Tensor, Tensor], Tensor],
                 autocast: Callable[[], contextlib.AbstractContextManager], loss_acc: Tensor,
                 dtype: torch.dtype = torch.float32, max_graphs: int = 1024, max_bytes: Optional[int] = None) -> None:
        self.replica = replica
        self.device = device
        self.loss_of = loss_of  # (output (1, O), target) -> 0-dim loss
        self.autocast = autocast
        self.loss_acc = loss_acc
        self.dtype = dtype  # of the static input buffer: the replica's parameter dtype
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes if max_bytes is not None else int(
            0.1 * torch.cuda.get_device_properties(device).total_memory)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.x_buf: Optional[Tensor] = None
        self.y_buf: Optional[Tensor] = None
        self.pool = None
        self.stream = torch.cuda.Stream(device)
        self.graph_bytes = 0
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0

    # -- static buffers -------------------------------------------------------------------
    def _ensure_buffers(self, x: Tensor, y: Tensor) -> bool:
        """Make x_buf/y_buf fit this sample; returns False when the sample cannot use graphs
        (a target shape or dtype other than the captured one)."""
        L, D = x.shape
        if not x.is_floating_point():
            return False
        if self.y_buf is None:
            self.y_buf = torch.empty(y.shape, dtype=y.dtype, device=self.device)
        elif self.y_buf.shape != y.shape or self.y_buf.dtype != y.dtype:
            return False
        if self.x_buf is None or self.x_buf.shape[0] < L or self.x_buf.shape[1] != D:
            cap = max(L, 2 * self.x_buf.shape[0] if self.x_buf is not None else 512)
            self.graphs.clear()  # captured addresses point at the old buffer
            self.pool = None
            self.graph_bytes = 0
            self.x_buf = torch.zeros(cap, D, dtype=self.dtype, device=self.device)
        return True

    # -- one sample -----------------------------------------------------------------------
    def _forward_backward(self, x: Tensor, y: Tensor) -> None:
        with self.autocast():
            out = self.replica(x)
        loss = self.loss_of(out.float(), y)
        loss.backward()
        self.loss_acc.add_(loss.detach())

    def run(self, x: Tensor, y: Tensor) -> None:
        """x: (L, D) on any device (pinned CPU memory keeps the copy asynchronous); y: the sample's
        target shaped like a one-sample batch. Queued on the current stream: one copy for x, one
        for y, and a graph replay (or the eager pass plus a capture, the first time a length is seen)."""
        L = x.shape[0]
        if not self._ensure_buffers(x, y):
            self.eager_runs += 1
            self._forward_backward(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            return
        xs = self.x_buf[:L]
        xs.copy_(x, non_blocking=True)
        self.y_buf.copy_(y, non_blocking=True)
        graph = self.graphs.get(L)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        self._eager_then_capture(xs, self.y_buf)

    def _eager_then_capture(self, x: Tensor, y: Tensor) -> None:
        L = x.shape[0]
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            # The real computation for this sample, on the side stream (warm-up for the capture).
            self._forward_backward(x, y)
            self.eager_runs += 1
            if len(self.graphs) < self.max_graphs and self.graph_bytes < self.max_bytes:
                try:
                    self._capture(L)
                except RuntimeError as exc:  # a model that cannot be captured stays eager
                    self.max_graphs = 0
                    warnings.warn(f"vlseq_ext: CUDA-graph capture failed on {self.device} ({exc}); "
                                  "running this replica eagerly", RuntimeWarning)
        current.wait_stream(self.stream)

    def _capture(self, L: int) -> None:
        before = torch.cuda.memory_reserved(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Not torch.cuda.graph(): that context runs gc.collect() and empty_cache() per capture,
        # which would dominate the cost of hundreds of small captures.
        graph.capture_begin(pool=self.pool)
        try:
            self._forward_backward(self.x_buf[:L], self.y_buf)
        finally:
            graph.capture_end()
        self.graphs[L] = graph
        self.captures += 1
        self.graph_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)

    def stats(self) -> Dict[str, int]:
        return {"graphs": len(self.graphs), "captures": self.captures, "replays": self.replays,
                "eager_runs": self.eager_runs, "graph_bytes": self.graph_bytes}
