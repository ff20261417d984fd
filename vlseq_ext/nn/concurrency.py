"""Which recurrent launches run at once, and on which CUDA streams: the rules for pipelining a
unidirectional stack over time windows and for running a bidirectional layer's two directions side
by side (both read the layer's launch plan, ops.rnn_plan), and the side streams they use
(vlseq_ext.nn.functional runs them)."""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["pipeline_chunks", "pipeline_layout", "side_by_side", "direction_blocks", "sm_count", "sm_budget", "budget",
           "streams_for", "on", "record", "fork", "join", "settle"]

# A stack is pipelined over time windows of at least this many steps, at most this many windows:
# each window costs a few launches per layer (~10 us in a graph replay) and the pipeline's fill
# costs one window per extra layer. Where the layers' launches together take more than half the SMs,
# at most PIPELINE_FULL_CHUNKS windows (their GEMMs find fewer SMs beside them).
PIPELINE_MIN_STEPS = 48
PIPELINE_MAX_CHUNKS = 8
PIPELINE_FULL_CHUNKS = 4
# A grid stack (pipeline_layout): at most this many windows.
PIPELINE_GRID_CHUNKS = 4


def pipeline_chunks(plan: str, layers: int, steps: int, sm_count: int) -> int:
    """How many time windows to pipeline a unidirectional stack of `layers` layers over (1: none),
    from each layer's launch `plan` (ops.rnn_plan: one block per SM):
    - launches of all layers within half the SMs: up to PIPELINE_MAX_CHUNKS windows;
    - within all the SMs, on clusters of at most 8 blocks: up to PIPELINE_FULL_CHUNKS. Measured
      (LSTM 256 x 2, lengths 50-500, TF32; BENCHMARKS.md, twenty-first session): 8 samples (2 x 64
      SMs) 1.31x faster than layer by layer with 4 windows, 1.14x with 8; 16 samples 1.08x with 4,
      0.97x with 8. Clusters of 16 pack into the GPCs only when nothing else holds their SMs: with
      them the windows' GEMMs kept the layers from running at once (32 samples, 0.80-0.83x);
    - otherwise none, and never for the grid layout here (pipeline_layout plans it on a share of the
      SMs)."""
    cluster, blocks = _shape(plan)
    if layers < 2 or not blocks or plan.startswith("grid"):
        return 1
    if blocks * layers <= sm_count // 2:
        most = PIPELINE_MAX_CHUNKS
    elif blocks * layers <= sm_count and cluster <= 8:
        most = PIPELINE_FULL_CHUNKS
    else:
        return 1
    return max(1, min(most, steps // PIPELINE_MIN_STEPS))


def pipeline_layout(plan_for: Callable[[int], str], layers: int, steps: int, sms: int,
                    grid: bool = True) -> Tuple[int, int]:
    """(time windows, the SMs each launch is planned for: 0 for all) of a unidirectional stack of
    `layers` layers, from plan_for(max_blocks) (ops.rnn_plan for a layer). A stack whose layer takes
    the grid layout on the whole GPU is pipelined where a grid plan for sms // layers SMs exists (the
    16-bit kernels: LSTM 1024 in TF32 up to 16 samples on 64 blocks; the fp32 ones: LSTM 512-768), so
    that every layer's cooperative launch is resident beside the others', over at most
    PIPELINE_GRID_CHUNKS windows; the rest as pipeline_chunks says. Measured against one launch at a
    time (BENCHMARKS.md, twenty-eighth and twenty-ninth sessions): LSTM 1024 x 2 TF32 1.16-1.30x at
    1-16 samples, LSTM 512 x 2 fp32 1.01-1.63x at 1-32, never slower.

    grid=False: no grid stack is pipelined. For calls whose host is the bottleneck: each window costs
    a layer ~0.2 ms of host work (its GEMMs, launches, allocations), and a gathered batch of one-sample
    LSTM 1024 x 2 passes at 8 samples took 6.9-7.6 ms a step pipelined against 6.1-6.2 one layer after
    the other (BENCHMARKS.md, twenty-eighth session)."""
    whole = plan_for(0)
    if not whole.startswith("grid"):
        return pipeline_chunks(whole, layers, steps, sms), 0
    chunks = min(PIPELINE_GRID_CHUNKS, steps // PIPELINE_MIN_STEPS)
    if not grid or layers < 2 or chunks < 2:
        return 1, 0  # one window: each launch on the whole GPU
    share = sms // layers
    shared = plan_for(share)
    if not shared.startswith("grid") or _blocks(shared) * layers > sms:
        return 1, 0
    return chunks, share


def side_by_side(plan: str, sm_count: int) -> bool:
    """Whether the two directions of a layer (launch `plan` each) can run at once: both launches
    resident together (a grid plan's cooperative launches as well: each is resident as a whole)."""
    blocks = _blocks(plan)
    return bool(blocks) and 2 * blocks <= sm_count


def direction_blocks(plan_for: Callable[[int], str], sms: int) -> int:
    """The SMs each direction of a bidirectional layer is planned for when the two run at once: half
    the GPU where `plan_for(max_blocks)` (ops.rnn_plan for the layer) has a plan for it that fits
    twice (side_by_side); 0 (one direction after the other, each on the whole GPU) otherwise.
    Measured at batch 32, GRU 256x2 (BENCHMARKS.md, sixth session): 15.9 / 14.4 ms (uniform /
    lengths 50-500) side by side on half the GPU each, 15.7 / 16.3 one after the other; a
    bidirectional LSTM 1024 in TF32 at 8 samples on 64 blocks a direction 1.72x (twenty-eighth
    session), LSTM 512 in fp32 1.28-2.10x at 1-32 samples (twenty-ninth)."""
    half = sms // 2
    return half if side_by_side(plan_for(half), sms) else 0


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (one block of a plan per SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_budget = threading.local()


@contextlib.contextmanager
def sm_budget(blocks: int):
    """The vlseq_ext.nn LSTM/GRU calls made on this thread inside run their layers and directions
    one at a time on the caller's stream (no pipelined stack, no directions side by side), each launch
    planned for at most `blocks` SMs where a plan fits in them (0: the whole GPU). For passes
    that run side by side (the trainer's per-sample lanes):
    - their throughput is bound by the SMs their clusters hold, and a layout of fewer blocks costs
      less SM time per sample (LSTM 256: 8 blocks of 32 units against 16 of 16; BENCHMARKS.md,
      eighteenth session);
    - their CUDA graphs replay at the same time, and GEMMs captured on a side stream shared between
      them share torch's cuBLAS workspace, which is cached per handle and stream (pytorch#193402):
      a one-sample LSTM 256 x 2 pipelined on 8 lanes got wrong layer-0 gradients, intermittently
      (eighteenth session). On its own stream each lane's work has its own.
    What runs is fixed when the forward runs: its backward keeps it."""
    before = budget()
    _budget.blocks = max(0, int(blocks))  # 0 is a budget too: the whole GPU, one launch at a time
    try:
        yield
    finally:
        _budget.blocks = before


def budget() -> Optional[int]:
    """This thread's sm_budget, None outside one."""
    return getattr(_budget, "blocks", None)


# A launch's layout in ops.rnn_plan's text: the plan's start, and a backward on a layout of its own.
_LAYOUT = re.compile(r"(?:^|; backward: )(local|cluster|grid) (\d+) blocks x (\d+) groups")


def _shape(plan: str) -> Tuple[int, int]:
    """(the largest group, the most blocks) of a plan's launches (its forward and backward may take
    different layouts); (0, 0) for none."""
    launches = [(int(m.group(2)), int(m.group(2)) * int(m.group(3))) for m in _LAYOUT.finditer(plan)]
    return (max(c for c, _ in launches), max(b for _, b in launches)) if launches else (0, 0)


def _blocks(plan: str) -> int:
    """The most blocks (one per SM) of a plan's launches; 0 for none."""
    return _shape(plan)[1]


class _Streams:
    """Per device and thread: the side streams (a pipelined stack's upper layers, a bidirectional
    layer's reverse direction); threads that capture CUDA graphs must not share a stream."""

    local = threading.local()

    @classmethod
    def get(cls, device: torch.device, n: int) -> List[torch.cuda.Stream]:
        cache = cls.local.__dict__.setdefault("streams", {})
        have = cache.setdefault(device, [])
        while len(have) < n:
            have.append(torch.cuda.Stream(device))
        return have[:n]


def streams_for(x: Tensor, layers: int):
    """The main (current) stream and one stream per layer (layer 0 on the main one); None off the GPU."""
    if not x.is_cuda:
        return None, [None] * layers
    main = torch.cuda.current_stream(x.device)
    return main, [main] + _Streams.get(x.device, layers - 1)


def on(stream):
    """`with on(stream)`: work goes to that stream (nothing changes off the GPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record(stream):
    """An event recorded on the stream now (None off the GPU)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def fork(main, streams) -> None:
    """The side streams wait for what the main stream has queued."""
    for s in streams[1:]:
        if s is not None:
            s.wait_stream(main)


def join(main, streams) -> None:
    """The main stream waits for what the side streams have queued."""
    for s in streams[1:]:
        if s is not None:
            main.wait_stream(s)


def settle(main, streams) -> None:
    """The side streams wait for the main stream's reads of their tensors: memory a side stream
    allocated is reused only by that stream, so its later work must come after those reads."""
    fork(main, streams)
