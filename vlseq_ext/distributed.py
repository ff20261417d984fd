"""The process group: who trains together, and the few collectives training needs.

`ProcessGroup` is this process alone: rank 0 of 1, and every collective is trivial.
`TorchProcessGroup` is several processes on torch.distributed (torchrun). ParallelTrainer, the
training loop, vlseq-train and benchmarks/distributed_check.py talk to one of the two and never
branch on which; nothing else in the package imports torch.distributed (the bench's DDP baselines
aside: they measure it). The collectives:
  - the step's one flat all-reduce of gradients, loss, sample count and stop flag (`bind`, then
    `all_reduce_step_`), with `merge_scale` saying what the in-process merge divides by;
  - `broadcast_from_rank0` (rank 0's initial weights), `broadcast_object` (rank 0's configuration),
    `sum_` (evaluation totals), `barrier`, `check_same` (a value every rank must share);
  - the stop flag: `request_stop`, and `stop_agreed`, the same answer on every rank.

Launch modes (both through torchrun; docs/multi-node.md has the command lines):
  - one process per machine, driving all of that machine's GPUs through the single-process path
    (persistent replicas, CUDA graphs, the fused P2P merge): `--nproc-per-node 1`;
  - one process per GPU: `--nproc-per-node <GPUs>`. With devices=None (`--devices all`) each process
    takes its share of the machine's GPUs by LOCAL_RANK (`vlseq_ext.devices.local_share`).

Getting a group. `start()` (vlseq-train, scripts) initialises torch.distributed from torchrun's
environment (WORLD_SIZE > 1, RANK, MASTER_ADDR, MASTER_PORT) and owns it: `close()` (or leaving its
`with` block) destroys it. `resolve()` (ParallelTrainer's `process_group`) takes "auto" (the default
group when one with several processes exists, else `start()`), None (alone), a torch.distributed
ProcessGroup or one of ours.

Timeout. Every group vlseq_ext creates gets the timeout `VLSEQ_DIST_TIMEOUT` (seconds, default 600).
It bounds the rendezvous and every collective: a rank that died, left the training loop early or never
arrived makes the others fail within it, with a `DistributedError` that says so, instead of hanging.
(gloo usually notices a dead peer at once, from the closed connection. With NCCL the collective is
asynchronous: PyTorch's NCCL watchdog aborts the process when the timeout expires, with a message
naming the timed-out all-reduce.) A group you create yourself keeps the timeout you gave it.

Hierarchical merge. Inside a process the trainer sums every local replica's gradients and loss into
the master's (`ops.reduce_tensors_`, one fused P2P kernel). Across processes, `all_reduce_step_` then
runs ONE torch.distributed.all_reduce of one flat buffer
    [master grads | loss | local sample count | stop flag]      (fp32; fp64 for a float64 model)
from the master device: flatten (one kernel, `ops.flatten`, into a buffer allocated once), all-reduce
(SUM), and for reduction="mean" a division by the global sample count, which came back in the same
buffer (no second collective, no host sync), then unflatten (`ops.unflatten_`). The loss ends as the
global loss, identical on every rank, and so do the gradients: the optimizer steps identically on
every rank's master, which broadcasts to its local replicas as in one process.

Why not a sliced variant (reduce-scatter inside the node, every local GPU all-reducing only its slice
across nodes, then an all-gather)? It divides the bytes each NIC carries by the number of local GPUs,
which pays off only when the transfer is bandwidth-bound. Our gradients are small: the seed model's
are 105 KB, a few microseconds on a 25 GB/s link, while one NCCL all-reduce of a ready buffer costs
~18 us even between two GPUs of one node (docs/design.md). The merge is latency-bound; the sliced
variant would pay that latency once per local GPU to save microseconds of bandwidth. One collective
from the master is the right choice until gradients reach tens of MB.

Sampling. A global step has world_size x samples_per_step samples (samples_per_step = this process's
devices x samples_per_device; equal on every rank, checked by `bind`). Every rank sees the same
global batch (same data order, same seed) and takes its share by length (ParallelTrainer.shard, a
longest-first assignment over all ranks' devices), so every GPU of every process gets a balanced
part of the step. In a short last step a rank may get few samples or none: it still joins the
all-reduce, contributing zeros, and "mean" divides by the true global count.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any, List, Optional

import torch
from torch import Tensor

from . import env, ops

__all__ = ["DistributedError", "ProcessGroup", "TorchProcessGroup", "start", "resolve"]

_created_timeout_s: Optional[float] = None  # the timeout of the default group, when start() created it
_bound: "weakref.WeakSet[TorchProcessGroup]" = weakref.WeakSet()


@atexit.register
def _release_buffers() -> None:
    """Drop every bound group's buffers while the interpreter is still whole. Otherwise gloo can abort
    the process at exit ("terminate called without an active exception"): its worker threads still
    hold the last collective's tensors, which they then free during interpreter finalisation (seen
    with torch 2.14 in about 1 run in 3, 2 ranks x gloo)."""
    for group in list(_bound):
        group.unbind()
    gc.collect()


class DistributedError(RuntimeError):
    """A failure across processes: a rendezvous that did not complete, or a collective that failed
    because another rank stopped or the network broke. The message says which and what to check."""


def _dist():
    import torch.distributed as dist
    return dist


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class ProcessGroup:
    """This process alone: rank 0 of 1. Every collective is trivial; TorchProcessGroup gives the real
    ones. Usable as a context manager (closed at the end)."""

    rank = 0
    world_size = 1

    def bind(self, grads: List[Tensor], loss: Tensor, samples_per_step: int) -> "ProcessGroup":
        """This group for one trainer, whose master holds `grads` and `loss`: all_reduce_step_ sums them."""
        return self

    def merge_scale(self, count: int, mean: bool) -> float:
        """What the in-process merge multiplies the step's sum by: alone, the whole "mean" division."""
        return 1.0 / count if mean else 1.0

    def all_reduce_step_(self, count: int, mean: bool) -> None:
        """The bound gradients and loss <- their sum over every process (divided by the global sample
        count when `mean`); `count`: this process's samples in the step."""

    def sum_(self, t: Tensor) -> Tensor:
        """t <- its sum over every process, in place; returns t."""
        return t

    def broadcast_from_rank0(self, tensors: List[Tensor]) -> None:
        """tensors <- rank 0's, in place (every rank starts from the same weights, whatever its seed)."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (picklable) on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait (host) until every rank got here."""

    def check_same(self, what: str, value: int, show: bool = True) -> None:
        """ValueError unless `value` (an int64) is equal on every rank; the message names `what` and,
        unless show=False (a hash), the values."""

    def request_stop(self) -> None:
        """Ask every rank to stop after the same step (safe in a signal handler)."""

    def stop_agreed(self, requested: bool) -> bool:
        """Whether every rank stops after this step: alone, when this process `requested` it."""
        return requested

    def close(self) -> None:
        """Release the group (destroy it, when this object created it)."""

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TorchProcessGroup(ProcessGroup):
    """Several processes on a torch.distributed group. `device`: where this group's own small
    collectives run (the CPU for gloo, a GPU for NCCL). `owned`: created by `start()`, destroyed by
    close(). Attributes: group, rank, world_size, backend, timeout_s (when vlseq_ext created the group),
    steps (step all-reduces done, once bound)."""

    def __init__(self, group: Any, device: torch.device, timeout_s: Optional[float] = None,
                 owned: bool = False) -> None:
        dist = _dist()
        self.group, self.device, self.timeout_s, self._owned = group, torch.device(device), timeout_s, owned
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self._src = dist.get_global_rank(group, 0)
        self._flat: Optional[Tensor] = None
        self.steps = 0
        self._stop_local = False

    # -- the step's flat all-reduce ---------------------------------------------------------------
    def bind(self, grads: List[Tensor], loss: Tensor, samples_per_step: int) -> "TorchProcessGroup":
        """A new group object on the same processes for one trainer, with the flat buffer of its master's
        `grads` and `loss` (on one device). Every rank must bind the same layout with the same
        samples_per_step: checked here with one collective."""
        bound = TorchProcessGroup(self.group, loss.device, self.timeout_s)
        if self.backend == "nccl" and loss.device.type == "cpu":
            raise ValueError("the process group's backend is nccl, which cannot reduce the CPU devices' gradients: "
                             "initialise it with backend='gloo' or 'cpu:gloo,cuda:nccl'")
        for i, g in enumerate(grads):
            if g.device != loss.device:
                raise ValueError(f"bind: grads[{i}] is on {g.device}, the loss on {loss.device}")
        if loss.device.type == "cuda":
            # NCCL creates its communicator on the current device: the master's (as
            # torch.cuda.set_device(local_rank) does in a DDP script), not cuda:0 in every process.
            torch.cuda.set_device(loss.device)
        bound._tensors = list(grads) + [loss]
        numel = sum(g.numel() for g in grads)
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        bound._flat = torch.zeros(numel + 3, dtype=dtype, device=loss.device)  # [grads | loss | count | stop]
        bound._payload, bound._count, bound._stop = bound._flat[:numel + 1], bound._flat[numel + 1:numel + 2], \
            bound._flat[numel + 2:]
        bound._denom = torch.ones(1, dtype=dtype, device=loss.device)
        cuda = loss.device.type == "cuda"
        # The stop flag is read one step late from a pinned copy: no host sync of the current step.
        bound._flag_host = torch.zeros(2, dtype=dtype, pin_memory=cuda)
        bound._flag_events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        _bound.add(bound)
        bound._check_layout([numel, len(grads), int(samples_per_step), int(dtype == torch.float64)])
        return bound

    def _check_layout(self, mine: List[int]) -> None:
        """Every rank must train the same model layout with the same step size; otherwise the flat
        buffers would not line up (or the sampler would split steps wrongly)."""
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._all_reduce(t, "max"), "consistency check at start-up")
        hi, lo = t[:4].tolist(), [-v for v in t[4:].tolist()]
        names = ("gradient elements", "parameter tensors", "samples per step (devices x samples_per_device)",
                 "float64 gradients")
        diff = [f"{n}: {a} to {b}" for n, a, b in zip(names, lo, hi) if a != b]
        if diff:
            raise ValueError(f"the {self.world_size} processes differ ({'; '.join(diff)}; this is rank {self.rank} "
                             f"with {dict(zip(names, mine))}): every rank must build the same model with the same "
                             "number of devices and samples_per_device")

    def merge_scale(self, count: int, mean: bool) -> float:
        return 1.0  # the division waits for the global count (all_reduce_step_)

    def all_reduce_step_(self, count: int, mean: bool) -> None:
        """One collective; no host sync on CUDA. A rank with no sample (count 0) contributes zeros."""
        if self._flat is None:
            raise DistributedError("this process group is not bound to a trainer's gradients (bind()), or was "
                                   "released (unbind(), or the interpreter is exiting)")
        ops.flatten(self._tensors, out=self._payload)
        self._count.fill_(float(count))
        self._stop.fill_(1.0 if self._stop_local else 0.0)
        self._collective(lambda: self._all_reduce(self._flat), "all-reduce of the gradients")
        if mean:
            torch.clamp_min(self._count, 1.0, out=self._denom)  # a step needs a sample on some rank
            self._payload.div_(self._denom)
        ops.unflatten_(self._payload, self._tensors)
        slot = self.steps % 2
        self._flag_host[slot:slot + 1].copy_(self._stop, non_blocking=self._flag_events is not None)
        if self._flag_events is not None:
            self._flag_events[slot].record(torch.cuda.current_stream(self.device))
        self.steps += 1

    def unbind(self) -> None:
        """Drop the flat buffer (done at exit); the trainer can no longer merge across processes."""
        self._flat = self._payload = self._count = self._stop = self._denom = self._tensors = None  # type: ignore

    # -- the other collectives ----------------------------------------------------------------------
    def _all_reduce(self, t: Tensor, op: str = "sum") -> None:
        dist = _dist()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)

    def _collective(self, fn, what: str) -> Any:
        try:
            return fn()
        except DistributedError:
            raise
        except Exception as exc:  # DistBackendError, DistError, RuntimeError from gloo/NCCL
            limit = (f"the timeout ({self.timeout_s:g} s, {env.DIST_TIMEOUT})" if self.timeout_s is not None
                     else "the process group's timeout")
            raise DistributedError(
                f"the cross-process {what} failed on rank {self.rank} of {self.world_size} ({self.backend}) after "
                f"{self.steps} step(s): {_first_line(exc)}. Another process has probably stopped (it crashed, was "
                "killed, or left the training loop early: every rank must run the same number of steps), or the "
                f"network failed; a missing process is detected within {limit}") from exc

    def sum_(self, t: Tensor) -> Tensor:
        self._collective(lambda: self._all_reduce(t), "sum")
        return t

    def broadcast_from_rank0(self, tensors: List[Tensor]) -> None:
        dist = _dist()
        with torch.no_grad():
            for t in tensors:
                self._collective(lambda t=t: dist.broadcast(t.detach(), src=self._src, group=self.group),
                                 "broadcast of the initial weights")

    def broadcast_object(self, obj: Any) -> Any:
        payload = [obj]
        self._collective(lambda: _dist().broadcast_object_list(payload, src=self._src, group=self.group),
                         "broadcast of rank 0's configuration")
        return payload[0]

    def barrier(self) -> None:
        t = torch.zeros(1, device=self.device)
        self._collective(lambda: self._all_reduce(t), "barrier")
        float(t[0])

    def check_same(self, what: str, value: int, show: bool = True) -> None:
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._all_reduce(t, "max"), f"check of the {what}")
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            values = f" (this is rank {self.rank} with {value}; the ranks range from {lo} to {hi})" if show else ""
            raise ValueError(f"the {self.world_size} processes differ in their {what}{values}: every rank must read "
                             "the same data")

    # -- agreeing to stop (vlseq-train's Ctrl-C / SIGTERM) -------------------------------------------
    def request_stop(self) -> None:
        """The request rides in the flat buffer of every following all_reduce_step_."""
        self._stop_local = True

    def stop_agreed(self, requested: bool) -> bool:
        """Whether any rank had requested a stop by the step all-reduce before the latest one: every rank
        that asks after the same step gets the same answer. One step behind, so that on CUDA it waits
        for the previous step only (the GPU keeps the current one), not for a host sync."""
        if self.steps < 2:
            return False
        slot = (self.steps - 2) % 2
        if self._flag_events is not None:
            self._flag_events[slot].synchronize()
        return float(self._flag_host[slot]) > 0

    def close(self) -> None:
        if not self._owned:
            return
        self._owned = False
        _release_buffers()  # the finished run's buffers first (see there), then the group
        dist = _dist()
        if dist.is_initialized():
            dist.destroy_process_group()


def _backend(device: Optional[torch.device]) -> str:
    """NCCL for a GPU, gloo for the CPU, and both (by tensor device) when the device is not known yet."""
    if device is None:
        return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if device.type == "cuda" else "gloo"


def _wrap(group: Any, device: Optional[torch.device], timeout_s: Optional[float] = None,
          owned: bool = False) -> TorchProcessGroup:
    """Our object for a torch group; its small collectives run where its backend takes tensors."""
    backend = str(_dist().get_backend(group))
    if backend == "nccl":
        device = device if device is not None and device.type == "cuda" else torch.device(
            "cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return TorchProcessGroup(group, device, timeout_s, owned)


def start(device: Optional[torch.device] = None) -> ProcessGroup:
    """The processes torchrun started (WORLD_SIZE > 1): a group initialised from its environment
    (env://) with the VLSEQ_DIST_TIMEOUT timeout, owned by the returned object (close() destroys it),
    or the default group when one exists already (not owned). `device`: this process's master device,
    which picks the backend (NCCL for a GPU: the group is bound to it and connects now, so a failed
    rendezvous shows up here; gloo for the CPU; None: both, by tensor device). Alone: a ProcessGroup."""
    global _created_timeout_s
    dist = _dist()
    if not dist.is_available():
        return ProcessGroup()
    if dist.is_initialized():
        return _wrap(dist.group.WORLD, device, _created_timeout_s) if dist.get_world_size() > 1 else ProcessGroup()
    try:
        launch, timeout = env.launch(), env.dist_timeout()
    except ValueError as exc:
        raise DistributedError(str(exc)) from None
    if launch.world_size == 1:
        return ProcessGroup()
    if launch.missing:
        raise DistributedError(f"WORLD_SIZE={launch.world_size} but {', '.join(launch.missing)} not set: launch with "
                               "torchrun (docs/multi-node.md), or set RANK, MASTER_ADDR and MASTER_PORT for every "
                               "process")
    backend = _backend(device)
    where = f"{launch.master_addr}:{launch.master_port}"
    kw = {}
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        kw["device_id"] = device
    try:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kw)
    except Exception as exc:
        raise DistributedError(
            f"rank {launch.rank} of {launch.world_size} could not join the process group at {where} ({backend}) "
            f"within {timeout.total_seconds():g} s: {_first_line(exc)}. Check that every process was started "
            f"(torchrun --nnodes/--nproc-per-node on every machine), that {where} is reachable from this machine, "
            f"and the timeout ({env.DIST_TIMEOUT})") from exc
    _created_timeout_s = timeout.total_seconds()
    return _wrap(dist.group.WORLD, device, _created_timeout_s, owned=True)


def resolve(process_group: Any, device: torch.device) -> ProcessGroup:
    """ParallelTrainer's `process_group` as one of ours: "auto" (the default group of several processes,
    or start(device) under torchrun; else alone), None (alone), a torch.distributed ProcessGroup, or a
    ProcessGroup of ours (as it is). `device`: the trainer's master device."""
    if process_group is None:
        return ProcessGroup()
    if isinstance(process_group, ProcessGroup):
        return process_group
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ValueError(f"process_group must be 'auto', None or a process group, got {process_group!r}")
        return start(device)
    if _dist().get_world_size(process_group) == 1:
        return ProcessGroup()
    return _wrap(process_group, device)
