"""Training across processes and machines (torchrun) on torch.distributed.

The same ParallelTrainer and `vlseq-train` run under torchrun; we build no networking of our own.

Launch modes (both through torchrun; docs/multi-node.md has the command lines):
  - one process per machine, driving all of that machine's GPUs through the single-process path
    (persistent replicas, CUDA graphs, the fused P2P merge): `--nproc-per-node 1`;
  - one process per GPU: `--nproc-per-node <GPUs>`. With devices=None (`--devices all`) each process
    takes its share of the machine's GPUs by LOCAL_RANK (`vlseq_ext.devices.local_share`).

Process group. ParallelTrainer(process_group="auto") uses the default group when torch.distributed
is initialised with more than one process; otherwise, when torchrun's environment says there are
several (WORLD_SIZE > 1, RANK, MASTER_ADDR, MASTER_PORT), it initialises one (`init_from_env`):
NCCL when the master model is on a GPU, gloo on CPU. A group of one, or process_group=None, means
this process trains alone and nothing here runs.

Timeout. Every group that vlseq_ext creates gets the timeout `VLSEQ_DIST_TIMEOUT` (seconds, default
600), passed to init_process_group in `init_from_env`. It bounds the rendezvous and every
collective: a rank that died, left the training loop early or never arrived makes the others fail
within it, with a `DistributedError` that says so, instead of hanging. (gloo usually notices a dead
peer at once, from the closed connection. With NCCL the collective is asynchronous: PyTorch's NCCL
watchdog aborts the process when the timeout expires, with a message naming the timed-out
all-reduce.) A group you create yourself keeps the timeout you gave it.

Hierarchical merge. Inside a process the trainer already sums every local replica's gradients and
loss into the master's (`ops.reduce_tensors_`, one fused P2P kernel). Across processes,
`CrossProcessMerge.all_reduce_` then runs ONE torch.distributed.all_reduce of one flat buffer
    [master grads | loss | local sample count | stop flag]      (fp32; fp64 for a float64 model)
from the master GPU: flatten (one kernel, `ops.flatten`, into a buffer allocated once), all-reduce
(SUM), and for reduction="mean" a division by the global sample count, which came back in the same
buffer (no second collective, no host sync), then unflatten (`ops.unflatten_`). The loss
accumulator ends as the global loss, identical on every rank, and so do the gradients: the
optimizer then steps identically on every rank's master, which broadcasts to its local replicas as
in one process.

Why not the "better" sliced variant (reduce-scatter inside the node, every local GPU all-reducing
only its slice across nodes, then an all-gather)? It divides the bytes each NIC carries by the
number of local GPUs, which pays off only when the inter-node transfer is bandwidth-bound. Our
gradients are small: the seed model's are 105 KB, a few microseconds of wire time on a 25 GB/s
link, while one NCCL all-reduce of a ready buffer costs ~18 us even between two GPUs of one node
(docs/design.md) and more across nodes. The merge is latency-bound, and the sliced variant would pay
that latency G times (one collective per local GPU, on G communicators) plus an intra-node
reduce-scatter and all-gather, to save microseconds of bandwidth. One latency-bound collective from
the master is the right choice until gradients reach tens of MB.

Sampling. A global step has world_size x samples_per_step samples (samples_per_step = this process's
devices x samples_per_device; equal on every rank, checked when the trainer is built). Every rank
sees the same global batch (same data order, same seed) and takes its share by length: `lpt_shard`
runs the trainer's longest-first assignment over all ranks' devices and keeps this rank's devices'
samples, so every GPU of every process gets a balanced part of the step. In a short last step a
rank may get few samples or none: it still joins the collective, contributing zeros, and "mean"
divides by the true global count, so the gradient is exactly that of one device on those samples.
`vlseq_ext.samplers.DistributedLengthSampler` does this for the length-bucketed order of vlseq-train; its checkpoints
do not depend on the world size.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import math
import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops
from .training.scheduling import lpt_shard

__all__ = ["TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "DistributedError", "env_world_size", "timeout_from_env",
           "init_from_env", "start_from_env", "rank_and_world", "CrossProcessMerge"]

TIMEOUT_ENV = "VLSEQ_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
_created_timeout_s: Optional[float] = None  # the timeout of the default group, when init_from_env created it
_live_merges: "weakref.WeakSet[CrossProcessMerge]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Release every CrossProcessMerge's buffers and group while the interpreter is still whole.
    Otherwise gloo can abort the process at exit ("terminate called without an active exception"):
    its worker threads still hold the last collective's tensors, which they then free during
    interpreter finalisation. Observed with torch 2.14 in about 1 run in 3 (2 ranks x gloo)."""
    for merge in list(_live_merges):
        merge.close()
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


def env_world_size() -> int:
    """WORLD_SIZE from the environment (torchrun sets it), 1 when absent."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={raw!r} is not an integer") from None
    if n < 1:
        raise DistributedError(f"WORLD_SIZE={n} must be >= 1")
    return n


def timeout_from_env() -> datetime.timedelta:
    """The process-group timeout: VLSEQ_DIST_TIMEOUT seconds (default 600)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        s = float(raw)
    except ValueError:
        s = float("nan")
    if not (s > 0 and math.isfinite(s)):
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=s)


def init_from_env(backend: str, device_id: Optional[torch.device] = None) -> bool:
    """Initialise the default process group from torchrun's environment (env://: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) with the VLSEQ_DIST_TIMEOUT timeout, unless one is initialised already.
    `backend`: "nccl", "gloo" or a per-device mix such as "cpu:gloo,cuda:nccl". `device_id` (NCCL)
    binds the group to this process's master GPU and connects eagerly, so a failed rendezvous shows
    up here. Returns True when a group of more than one process is active afterwards."""
    dist = _dist()
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    world = env_world_size()
    if world == 1:
        return False
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise DistributedError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun "
                               "(docs/multi-node.md), or set RANK, MASTER_ADDR and MASTER_PORT for every process")
    timeout = timeout_from_env()
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    kw: Dict[str, Any] = {}
    if device_id is not None and device_id.type == "cuda":
        torch.cuda.set_device(device_id)
        kw["device_id"] = device_id
    global _created_timeout_s
    try:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout, **kw)
        _created_timeout_s = timeout.total_seconds()
    except Exception as exc:
        raise DistributedError(
            f"rank {os.environ['RANK']} of {world} could not join the process group at {where} ({backend}) within "
            f"{timeout.total_seconds():g} s: {_first_line(exc)}. Check that every process was started (torchrun "
            f"--nnodes/--nproc-per-node on every machine), that {where} is reachable from this machine, and the "
            f"timeout ({TIMEOUT_ENV})") from exc
    return dist.get_world_size() > 1


def rank_and_world() -> Tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not initialised."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def start_from_env() -> bool:
    """Under torchrun (WORLD_SIZE > 1): initialise the default process group from the environment, gloo
    for CPU tensors and NCCL for CUDA ones, with the VLSEQ_DIST_TIMEOUT timeout. True when this call
    did; False when there is one process or a group already exists."""
    dist = _dist()
    if env_world_size() == 1 or not dist.is_available() or dist.is_initialized():
        return False
    return init_from_env("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


class CrossProcessMerge:
    """Sums the master's merged gradient and loss over every process of a group: one all-reduce of
    one preallocated flat buffer per step (see the module docstring).

    Attributes: group, rank, world_size (of the group), backend, device (the master's), timeout
    (seconds, when vlseq_ext created the group, else None), steps (all-reduces done).
    """

    def __init__(self, group: Any, grads: List[Tensor], loss: Tensor, samples_per_step: Optional[int] = None,
                 timeout: Optional[float] = None) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = timeout
        self.device = loss.device
        self._src = dist.get_global_rank(group, 0)
        self._tensors = list(grads) + [loss]
        self._numel = sum(g.numel() for g in grads)
        for i, g in enumerate(grads):
            if g.device != self.device:
                raise ValueError(f"CrossProcessMerge: grads[{i}] is on {g.device}, the loss on {self.device}")
        if self.device.type == "cuda":
            # NCCL creates its communicator on the current device; make it the master's (as
            # torch.cuda.set_device(local_rank) does in a DDP script), not cuda:0 in every process.
            torch.cuda.set_device(self.device)
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        # [grads | loss | count | stop]: one buffer, one collective per step.
        self._flat = torch.zeros(self._numel + 3, dtype=dtype, device=self.device)
        self._payload = self._flat[:self._numel + 1]
        self._count = self._flat[self._numel + 1:self._numel + 2]
        self._stop = self._flat[self._numel + 2:]
        self._denom = torch.ones(1, dtype=dtype, device=self.device)
        self._stop_local = False
        cuda = self.device.type == "cuda"
        self._flag_host = torch.zeros(2, dtype=dtype, pin_memory=cuda)
        self._flag_events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.steps = 0
        self._closed = False
        _live_merges.add(self)
        self._check_consistent(len(grads), samples_per_step)

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def create(cls, process_group: Any, grads: List[Tensor], loss: Tensor,
               samples_per_step: Optional[int] = None) -> Optional["CrossProcessMerge"]:
        """The cross-process merge for `process_group`, or None when training runs in one process.

        process_group: None (one process), "auto" (the default group when torch.distributed is
        initialised with more than one process; else, under torchrun with WORLD_SIZE > 1, a group
        initialised from the environment: NCCL for CUDA grads, gloo for CPU, timeout
        VLSEQ_DIST_TIMEOUT), or a ProcessGroup. grads: the master's gradient tensors (one device);
        loss: its 0-dim loss accumulator; both are overwritten by all_reduce_. samples_per_step (this
        process's) must be equal on every rank, and so must the gradients' layout: checked here, with
        one collective."""
        if process_group is None:
            return None
        dist = _dist()
        timeout = None
        if isinstance(process_group, str):
            if process_group != "auto":
                raise ValueError(f"process_group must be 'auto', None or a ProcessGroup, got {process_group!r}")
            if not dist.is_available():
                return None
            if not dist.is_initialized():
                if env_world_size() == 1:
                    return None
                cuda = loss.device.type == "cuda"
                init_from_env("nccl" if cuda else "gloo", loss.device if cuda else None)
            group = dist.group.WORLD
            timeout = _created_timeout_s
        else:
            group = process_group
        if dist.get_world_size(group) == 1:
            return None
        backend = str(dist.get_backend(group))
        if loss.device.type == "cpu" and backend == "nccl":
            raise ValueError("the process group's backend is nccl, which cannot reduce the CPU devices' gradients: "
                             "initialise it with backend='gloo' or 'cpu:gloo,cuda:nccl'")
        return cls(group, grads, loss, samples_per_step, timeout)

    def _check_consistent(self, num_tensors: int, samples_per_step: Optional[int]) -> None:
        """Every rank must train the same model layout with the same step size; otherwise the flat
        buffers would not line up (or the sampler would split steps wrongly)."""
        sps = -1 if samples_per_step is None else int(samples_per_step)
        mine = [self._numel, num_tensors, sps, 1 if self._flat.dtype == torch.float64 else 0]
        t = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist_all_reduce(t, op="max"), "consistency check at start-up")
        hi, lo = t[:4].tolist(), [-v for v in t[4:].tolist()]
        names = ("gradient elements", "parameter tensors", "samples per step (devices x samples_per_device)",
                 "float64 gradients")
        diff = [f"{n}: {a} to {b}" for n, a, b in zip(names, lo, hi) if a != b]
        if diff:
            raise ValueError(f"the {self.world_size} processes differ ({'; '.join(diff)}; this is rank {self.rank} "
                             f"with {dict(zip(names, mine))}): every rank must build the same model with the same "
                             "number of devices and samples_per_device")

    def check_same(self, what: str, value: int, show: bool = True) -> None:
        """`value` (an int64: a count, or part of a hash, then show=False) must be equal on every rank:
        each rank reads its own files, and ranks with other data would train on a silent mix of both."""
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self._collective(lambda: self._dist_all_reduce(t, op="max"), f"check of the {what}")
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            values = f" (this is rank {self.rank} with {value}; the ranks range from {lo} to {hi})" if show else ""
            raise ValueError(f"the {self.world_size} processes differ in their {what}{values}: every rank must read "
                             "the same data")

    # -- collectives -------------------------------------------------------------------------------
    def _dist_all_reduce(self, t: Tensor, op: str = "sum") -> None:
        dist = _dist()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)

    def _collective(self, fn, what: str) -> None:
        try:
            fn()
        except DistributedError:
            raise
        except Exception as exc:  # DistBackendError, DistError, RuntimeError from gloo/NCCL
            limit = (f"the timeout ({self.timeout:g} s, {TIMEOUT_ENV})" if self.timeout is not None
                     else "the process group's timeout")
            raise DistributedError(
                f"the cross-process {what} failed on rank {self.rank} of {self.world_size} ({self.backend}) after "
                f"{self.steps} step(s): {_first_line(exc)}. Another process has probably stopped (it crashed, was "
                "killed, or left the training loop early: every rank must run the same number of steps), or the "
                f"network failed; a missing process is detected within {limit}") from exc

    def close(self) -> None:
        """Drop the flat buffers and the reference to the process group (done at exit). The trainer
        can no longer merge across processes afterwards."""
        self._closed = True
        self._flat = self._payload = self._count = self._stop = self._denom = None  # type: ignore[assignment]
        self.group = None

    def all_reduce_(self, local_count: int, mean: bool) -> None:
        """grads and loss <- their sum over all ranks (divided by the global sample count when `mean`),
        in place, identical on every rank. `local_count`: this process's samples in the step (0 is
        fine: a rank with no sample contributes zeros). One collective; no host sync on CUDA."""
        if self._closed:
            raise DistributedError("this CrossProcessMerge was closed (close(), or the interpreter is exiting)")
        ops.flatten(self._tensors, out=self._payload)
        self._count.fill_(float(local_count))
        self._stop.fill_(1.0 if self._stop_local else 0.0)
        self._collective(lambda: self._dist_all_reduce(self._flat), "all-reduce of the gradients")
        if mean:
            torch.clamp_min(self._count, 1.0, out=self._denom)  # a step needs a sample on some rank
            self._payload.div_(self._denom)
        ops.unflatten_(self._payload, self._tensors)
        slot = self.steps % 2
        self._flag_host[slot:slot + 1].copy_(self._stop, non_blocking=self._flag_events is not None)
        if self._flag_events is not None:
            self._flag_events[slot].record(torch.cuda.current_stream(self.device))
        self.steps += 1

    def broadcast_from_rank0(self, tensors: List[Tensor]) -> None:
        """tensors (parameters and buffers, on the master device) <- rank 0's, in place: every rank
        starts from the same weights whatever its seed."""
        dist = _dist()
        with torch.no_grad():
            for t in tensors:
                if t.device != self.device:
                    raise ValueError(f"broadcast_from_rank0: a tensor is on {t.device}, the master on {self.device}")
                self._collective(lambda t=t: dist.broadcast(t.detach(), src=self._src, group=self.group),
                                 "broadcast of the initial weights")

    def sum_(self, t: Tensor) -> Tensor:
        """t <- the sum of t over all ranks, in place (t on the master device); returns t."""
        self._collective(lambda: self._dist_all_reduce(t), "sum")
        return t

    def barrier(self) -> None:
        """Wait (host) until every rank got here."""
        t = torch.zeros(1, device=self.device)
        self._collective(lambda: self._dist_all_reduce(t), "barrier")
        float(t[0])

    # -- agreeing to stop (vlseq-train's Ctrl-C / SIGTERM) ---------------------------------------------
    def request_stop(self) -> None:
        """Ask every rank to stop: the request rides in the flat buffer of each following all_reduce_."""
        self._stop_local = True

    def stop_requested(self) -> bool:
        """Whether any rank had requested a stop by the all_reduce_ before the latest one. Every rank
        that calls this after the same step gets the same answer, so all stop after the same step.
        One step behind so that on CUDA it waits for the previous step only (the GPU keeps the
        current one), not for a host sync of the current step."""
        if self.steps < 2:
            return False
        slot = (self.steps - 2) % 2
        if self._flag_events is not None:
            self._flag_events[slot].synchronize()
        return float(self._flag_host[slot]) > 0

    def shard(self, lengths: Sequence[int], samples_per_device: int, devices_per_rank: int) -> List[int]:
        """This rank's positions in a global step with these sample lengths (lpt_shard)."""
        return lpt_shard(lengths, self.rank, self.world_size, devices_per_rank, samples_per_device)
