"""One issuing thread per device.

Why: a host-bound step (cuDNN's eager RNN calls, hundreds of small kernels) issued by one Python
thread for every GPU keeps each GPU waiting while the thread serves the others. ATen releases
the GIL inside ops, and autograd already runs each device's backward on a thread of its own, so
per-device threads overlap almost all of that host time (a probe on 2xH200, packed LSTM 512x2 at
k=32: one thread 709 samples/s, one thread per GPU 1,332).

CPU "devices" (cpu:N, for tests and CPU-only machines) run one after the other on the calling
thread: they share one CPU random generator, which threads would draw from in a racy order (dropout
masks differing from run to run), and ATen already spreads each op over the cores.

Per-thread state that the work needs is carried over from the calling thread: the current CUDA
stream of each device (so the work is ordered with the merge that follows on the caller's
streams) and the grad mode.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Sequence

import torch

__all__ = ["DeviceWorkers"]


class DeviceWorkers:
    """Runs fn(d) for several devices at once, one thread each; returns when all are done and
    re-raises the first error (every device's work has finished or failed by then)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        threaded = len(self.devices) > 1 and self.devices[0].type == "cuda"
        self._pool = (ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="vlseq-device")
                      if threaded else None)

    def _context(self, d: int, stream, grad: bool):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        if stream is not None:
            stack.enter_context(torch.cuda.device(self.devices[d]))
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    def _call(self, fn: Callable[[int], None], d: int, stream, grad: bool) -> None:
        with self._context(d, stream, grad):
            fn(d)

    def run(self, fn: Callable[[int], None], which: Sequence[int]) -> None:
        which = list(which)
        grad = torch.is_grad_enabled()
        streams: List = [torch.cuda.current_stream(self.devices[d]) if self.devices[d].type == "cuda" else None
                         for d in which]
        if self._pool is None or len(which) <= 1:
            for d, s in zip(which, streams):
                self._call(fn, d, s, grad)
            return
        futures = [self._pool.submit(self._call, fn, d, s, grad) for d, s in zip(which, streams)]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
