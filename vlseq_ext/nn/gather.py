"""One-sample passes whose recurrent calls run as one batch.

A model written for one sample at a time (forward(x) on one (L, D) sample, the seed's style) cannot
take a batch, and k one-sample passes of a wide LSTM each pay the whole recurrence latency alone.
CallGatherer.run(fns) runs k such passes, fn() each, on k threads: one thread at a time, in slot
order. When a pass calls a vlseq_ext.nn LSTM/GRU, its thread stops there; when every pass has stopped
or finished, the calls made to the same module run as ONE padded batch with per-sample lengths
(modules.run_calls), each pass gets its own slice of the result, and the passes go on.

Why threads: the user's code around the recurrent call is arbitrary Python on one sample; it must
keep running on each sample's own tensors, of its exact length (no padding ever reaches the user's
ops, so nothing a pass computes depends on the other samples). A thread is the one way plain Python
can stop a call stack in the middle and resume it later.

Why one at a time, in order: the passes then issue their operations (and draw their random numbers)
in the same order every run, and the GIL is never contended. Autograd needs nothing special: the
batched call is an ordinary op, so the sum of the k losses backpropagates through one batched
backward per module call.

Per-thread state the passes need is carried over from the caller: the grad mode, the current CUDA
device and stream, and whatever `worker_context` enters (autocast, which is per thread too). A
call joins a batch with calls made under the same modes and stream only, and the batch runs under
them (a pass that runs its RNN under no_grad, or on a side stream, gets what it would alone).

A pass's nn.Linear calls can join batches too (gather_linear_calls swaps the modules' class for
GatheredLinear): its head then runs once for all passes, and so does its backward, where k heads
would each run a few small kernels and autograd nodes.

`cpu`: the core that the pass threads, and the caller while it runs them, are kept on. Each round
hands the turn from the caller to each pass in order and back; across cores each hand-over waits for
the woken core (one H200 machine, 16 cores: 32 passes of one call took 4.6 ms of hand-overs on any
core and 0.8 ms on one; seventeenth session). One core loses nothing: one pass runs at a time; but
CPU-heavy work inside a pass (parallel CPU ops) runs on that one core too.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, ContextManager, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["CallGatherer", "GatheredLinear", "active_caller", "gather_linear_calls", "reply_calls"]

_local = threading.local()
_CPU = torch.device("cpu")


def active_caller() -> Optional["_Caller"]:
    """The pass running on this thread when it is one of a CallGatherer's, else None."""
    return getattr(_local, "caller", None)


def _stream_key(device_index: int) -> tuple:
    """The current CUDA stream of a device as (stream id, device index, device type): what
    torch.cuda.current_stream reads, without the Stream object it makes. Every recurrent and Linear
    call of a pass asks (_call_mode): 4.5 -> 1.05 us a call on one H200 machine's host, twice a pass
    of the sweep's one-sample model (BENCHMARKS.md, twenty-fifth session)."""
    return tuple(torch._C._cuda_getCurrentStream(device_index))


def _stream_of(key: tuple) -> "torch.cuda.Stream":
    return torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])


def _call_mode(input: Any) -> tuple:
    """The per-thread modes a call runs under (grad, inference, autocast of the input's device
    type, the current stream of a CUDA input's device as _stream_key): calls join a batch only with
    calls of the same modes, and the batch runs under them."""
    device = input.device if isinstance(input, torch.Tensor) else _CPU
    kind = device.type
    autocast = torch.is_autocast_enabled(kind)
    stream = _stream_key(device.index) if kind == "cuda" else None
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), kind, autocast,
            torch.get_autocast_dtype(kind) if autocast else None, stream)


def _entered(mode: tuple) -> ContextManager:
    grad, inference, kind, autocast, dtype, stream = mode
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(inference))
    stack.enter_context(torch.set_grad_enabled(grad))
    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=autocast, cache_enabled=False))
    if stream is not None:
        stack.enter_context(torch.cuda.stream(_stream_of(stream)))
    return stack


def _pinned(cpus: Optional[set]) -> Optional[set]:
    """Keeps the calling thread on `cpus` (None: leaves it); returns the set it had, None when it
    could not be changed (a core no longer allowed: the passes then run anywhere, only slower)."""
    if cpus is None:
        return None
    try:
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)
        return saved
    except OSError:
        return None


def reply_calls(calls: List[tuple], joins: Callable[[tuple, Any], Any], alone: Callable[[tuple], Any],
                run_joined: Callable[[List[Any]], List[Any]]) -> List[tuple]:
    """What a module's run_calls answers: one (True, result) or (False, exception) per call.
    joins(call, first part or None) gives the call's part of the joined batch, or None when the call
    must run alone (alone(call)); run_joined(parts) gives one result per part. An exception from joins
    or alone fails that call only; one from run_joined fails every call in the batch."""
    replies: List[Optional[tuple]] = [None] * len(calls)
    parts: List[Any] = []
    joined: List[int] = []
    for i, call in enumerate(calls):
        try:
            part = joins(call, parts[0] if parts else None)
            if part is None:
                replies[i] = (True, alone(call))
            else:
                parts.append(part)
                joined.append(i)
        except Exception as e:  # noqa: BLE001 - handed to the pass that made this call
            replies[i] = (False, e)
    if parts:
        try:
            for i, result in zip(joined, run_joined(parts)):
                replies[i] = (True, result)
        except Exception as e:  # noqa: BLE001 - the joined call failed: every call in it did
            for i in joined:
                replies[i] = (False, e)
    return replies


class GatherCancelled(RuntimeError):
    """Raised in a pass waiting at a recurrent call when another pass of the same run failed."""


class _Slot:
    """One worker thread and what it is doing."""

    __slots__ = ("go", "thread", "work", "call", "reply", "outcome", "next", "stream")

    def __init__(self) -> None:
        self.go = threading.Lock()
        self.go.acquire()  # released to hand this thread its turn
        self.thread: Optional[threading.Thread] = None
        self.work: Optional[tuple] = None      # (fn, context factory) of the current run
        self.call: Optional[tuple] = None      # (module, (input, hx, lengths), modes) it waits at
        self.reply: Optional[tuple] = None     # (ok, result or exception) for that call
        self.outcome: Optional[tuple] = None   # (ok, fn's result or exception) once finished
        self.next: Optional["_Slot"] = None    # who runs after it in this round (None: the coordinator)
        self.stream: Any = None                # the CUDA stream (_stream_key) this thread was last made current on


class _Caller:
    """What a pass's thread holds: its slot, so that a module call can stop it there."""

    def __init__(self, gatherer: "CallGatherer", slot: _Slot) -> None:
        self.gatherer, self.slot = gatherer, slot

    def call(self, module: Any, args: tuple) -> Any:
        slot = self.slot
        slot.call = (module, args, _call_mode(args[0]))
        self.gatherer._yield_turn(slot)
        slot.go.acquire()  # the coordinator ran the batch (or cancelled it)
        if self.gatherer._closed:
            raise GatherCancelled("vlseq_ext: the CallGatherer was closed")
        ok, value = slot.reply
        slot.reply = None
        if ok:
            return value
        raise value


class CallGatherer:
    """Runs one-sample passes side by side, their LSTM/GRU (and GatheredLinear) calls batched (see
    the module doc). Threads are made on first use, one per slot, and kept until close()."""

    def __init__(self, worker_context: Callable[[], ContextManager] = contextlib.nullcontext,
                 cpu: Optional[int] = None) -> None:
        self.worker_context = worker_context
        self.cpus = {cpu} if cpu is not None and hasattr(os, "sched_setaffinity") else None
        self._slots: List[_Slot] = []
        self._back = threading.Lock()
        self._back.acquire()  # released by a worker when it stops or finishes
        self._closed = False
        self._running = False
        self._pool_made = False
        self.joined_calls = 0  # batched module calls so far, and the pass calls they held
        self.gathered_calls = 0

    def _yield_turn(self, slot: _Slot) -> None:
        """Hands the turn straight to the round's next pass (one thread switch, not two)."""
        (slot.next.go if slot.next is not None else self._back).release()

    def _worker(self, slot: _Slot) -> None:
        _local.caller = _Caller(self, slot)
        _pinned(self.cpus)
        while True:
            slot.go.acquire()
            if self._closed:
                return
            fn, (grad, stream) = slot.work
            try:
                torch.set_grad_enabled(grad)
                # This thread's current stream stays between runs.
                if stream is not None and stream != slot.stream:
                    torch.cuda.set_device(stream[1])
                    torch.cuda.set_stream(_stream_of(stream))
                    slot.stream = stream
                with self.worker_context():
                    slot.outcome = (True, fn())
            except BaseException as e:  # noqa: BLE001 - handed back to run()'s caller
                slot.outcome = (False, e)
            slot.work = None
            self._yield_turn(slot)

    def _ensure_slots(self, n: int) -> None:
        while len(self._slots) < n:
            slot = _Slot()
            slot.thread = threading.Thread(target=self._worker, args=(slot,), daemon=True,
                                           name=f"vlseq-pass-{len(self._slots)}")
            slot.thread.start()
            self._slots.append(slot)

    @staticmethod
    def _callers_state() -> tuple:
        """The caller's grad mode and current CUDA stream (_stream_key; None without CUDA in use),
        which the workers take on (see the module doc)."""
        stream = (_stream_key(torch.cuda.current_device())
                  if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
        return torch.is_grad_enabled(), stream

    def _round(self, slots: List[_Slot]) -> None:
        """Each of `slots` runs, in order, until it waits at a call or finishes."""
        for slot, after in zip(slots, slots[1:] + [None]):
            slot.next = after
        slots[0].go.release()
        self._back.acquire()

    def run(self, fns: Sequence[Callable[[], Any]]) -> List[Any]:
        """fn() for each fn, their module calls batched; the results in order. If a pass
        raises, the passes still waiting are cancelled and the first error (in slot order) is raised
        once every pass has ended."""
        if self._closed:
            raise RuntimeError("vlseq_ext: CallGatherer.run after close()")
        if self._running:
            raise RuntimeError("vlseq_ext: CallGatherer.run is not reentrant (a pass ran another gathered run)")
        if active_caller() is not None:
            raise RuntimeError("vlseq_ext: CallGatherer.run called from inside a gathered pass")
        fns = list(fns)
        self._ensure_slots(len(fns))
        slots = self._slots[:len(fns)]
        state = self._callers_state()
        if self.cpus is not None and not self._pool_made:
            # A thread's OpenMP team is made at its first parallel region and inherits the thread's
            # cores: the caller's must exist before the caller is pinned below, or its later CPU ops
            # would all run on one core. (A pass's own CPU ops do run on its one core.)
            torch.ones(1 << 16).sum()
            self._pool_made = True
        for slot, fn in zip(slots, fns):
            slot.work, slot.call, slot.reply, slot.outcome = (fn, state), None, None, None
        self._running = True
        saved = _pinned(self.cpus)
        try:
            waiting = slots
            while waiting:
                self._round(waiting)
                waiting = [s for s in waiting if s.outcome is None]
                if any(not s.outcome[0] for s in slots if s.outcome is not None):
                    for slot in waiting:
                        slot.call, slot.reply = None, (False, GatherCancelled(
                            "vlseq_ext: another one-sample pass of this step failed"))
                else:
                    self._run_calls(waiting)
        except BaseException:
            # Interrupted between turns (KeyboardInterrupt, or an error outside the passes): the
            # threads' state is unknown, so they end here, and so does this gatherer.
            self.close()
            raise
        finally:
            self._running = False
            _pinned(saved)
        outcomes = [s.outcome for s in slots]
        for slot in slots:  # the slots keep nothing of this run (outputs, their graphs, errors)
            slot.outcome = None
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            real = [e for e in errors if not isinstance(e, GatherCancelled)]
            raise (real or errors)[0]
        return [value for _, value in outcomes]

    def _run_calls(self, waiting: List[_Slot]) -> None:
        """Every waiting pass's call, one batch per module and modes (in the order of their first
        call), run under the modes the calls were made in; each pass's reply set."""
        groups: dict = {}
        for slot in waiting:
            groups.setdefault((id(slot.call[0]), slot.call[2]), []).append(slot)
        for (_, mode), group in groups.items():
            module = group[0].call[0]
            with _entered(mode):
                replies = module.run_calls([s.call[1] for s in group])
            self.joined_calls += 1
            self.gathered_calls += len(group)
            for slot, reply in zip(group, replies):
                slot.call, slot.reply = None, reply

    def close(self) -> None:
        """Ends the worker threads (a run in progress on another thread is not waited for)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            with contextlib.suppress(RuntimeError):  # a turn handed over but not yet taken
                slot.go.release()
        for slot in self._slots:
            slot.thread.join(timeout=5)
        self._slots = []


class GatheredLinear(nn.Linear):
    """nn.Linear whose calls from gathered passes join one batch: the rows of every call's input
    (any leading shape) are concatenated, multiplied once and split back, which is exact because
    rows are independent. Elsewhere it is nn.Linear."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Linear's name
        caller = active_caller()
        if caller is not None:
            return caller.call(self, (input,))
        return F.linear(input, self.weight, self.bias)

    def run_calls(self, calls: List[tuple]) -> List[tuple]:
        """One (True, output) or (False, exception) per call (input,); inputs that cannot join the
        first one's batch (another dtype or device, a wrong feature count) run alone, so they fail
        or succeed exactly as they would."""
        def joins(call: tuple, first: Optional[Tensor]) -> Optional[Tensor]:
            x = call[0]
            fits = isinstance(x, Tensor) and x.dim() >= 1 and x.shape[-1] == self.in_features
            return x if fits and (first is None or (x.dtype, x.device) == (first.dtype, first.device)) else None

        def run_joined(xs: List[Tensor]) -> List[Tensor]:
            # (rows, features) inputs, the usual head's, join and come back as they are: no view op
            # (and autograd node) each way per call.
            rows = [x if x.dim() == 2 else x.reshape(-1, self.in_features) for x in xs]
            out = F.linear(torch.cat(rows) if len(rows) > 1 else rows[0], self.weight, self.bias)
            return [o if x.dim() == 2 else o.reshape(*x.shape[:-1], self.out_features)
                    for x, o in zip(xs, out.split([r.shape[0] for r in rows]))]

        return reply_calls(calls, joins, lambda call: F.linear(call[0], self.weight, self.bias), run_joined)


def gather_linear_calls(model: nn.Module) -> int:
    """Makes every nn.Linear of `model` (exactly that class) a GatheredLinear, in place, keeping its
    Parameter objects and state_dict keys. Returns how many it changed."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = GatheredLinear
            count += 1
    return count
