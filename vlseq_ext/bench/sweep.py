"""Sweep suite (target W3): samples/s over model sizes, samples per device and model forms.

Points, models and targets: sweep_points.py.

Methods, all in one run (samples/s counts every sample of a step, all devices together):
  vlseq           ParallelTrainer on all devices, one process (pack="auto", CUDA graphs);
  vlseq_1gpu      ParallelTrainer on the first device;
  vlseq_mp        ParallelTrainer(devices=[its device], process_group=WORLD), one process per
                  device, in the run's single spawn of worker processes (NCCL; gloo on CPU);
  ddp_nccl        DDP, one process per GPU, in the same spawn. list: k samples per process packed
                  (pack_sequence); one: k per-sample forward + backward passes, all but the last
                  under no_sync. On CPU the same runs over gloo as `ddp_gloo`;
  one_gpu_packed  one device, k samples per step packed (the list model: a user could write one).
                  The list model is SeqModel, whose RNN runs on vlseq_ext.nn's kernels by default
                  (rnn_kernels="auto"; packed input at every width), so this loop has our kernels too;
  one_gpu_cudnn   the same packed loop with SeqModel(rnn_kernels="cudnn"): torch's cuDNN RNN, the loop a
                  user writes with nn.LSTM / nn.GRU (GPUs only: on a CPU both run torch's RNN);
  one_gpu         one device, k per-sample forward + backward passes, one optimizer step (the
                  one-sample model: torch's nn modules, cuDNN);
  one_gpu_best    the fastest of one_gpu_packed, one_gpu_cudnn and one_gpu. The one-GPU loops compute
                  the same thing for both forms, so they are measured once per model and k (in the list
                  point for the packed ones, the one point for one_gpu) and recorded in both.
  Optimizer: Adam(lr=1e-3) everywhere; on GPUs fused=True for our trainer and DDP (vlseq, vlseq_1gpu,
  vlseq_mp, ddp_nccl), and plain Adam for the one-GPU loops, as users write them (the seed's;
  ONE_GPU_LOOPS_FUSED switches them to fused); plain Adam for every method on CPU;
  `train.sweep_info.optimizer` says which.

Data: one pool of POOL samples per point (lengths uniform in 50-500, as the train suite's), cycled;
a step of more samples than the pool repeats some. A small pool keeps the number of distinct
lengths, and so the trainer's per-length CUDA-graph captures counted in setup_s, small: a dataset
with every length from 50 to 500 would capture up to 451 per device once, then replay them.

Timing, per method and point: build, warm-up (the first step; then, when the trainer replays
per-sample graphs, `trainer.warmup` over the pool's lengths; then steps until the pool was seen
once, at most Budget.sweep_warmup_s), all of it reported as setup_s; then Budget.sweep_repeats
synchronized loops of about Budget.sweep_target_s each (at least one step); the median is the
figure. Past Budget.sweep_deadline_s seconds of in-process sweep work (sweep_mp_deadline_s in the
worker processes) the remaining points are skipped, with that reason. The worker processes run
every point's vlseq_mp and DDP jobs in the run's one spawn (process start and NCCL init paid once).

Duration on 2 x H200, estimated from the per-method setup and step costs of the train suite's runs
(not yet measured as a whole): the full sweep about 6 minutes (~4 in this process, ~2.5 in the
worker processes), --quick about 2; the deadlines (7 and 5 minutes; 2.5 and 1.7 with --quick) only
stop a run that goes far past that.

Results: train.sweep.<form>_<rnn>_h<H>_l<L>_k<K> with samples_per_s.<method> (and _spread),
setup_s.<method>, ratio.{vs_ddp, vs_1gpu, vs_one_gpu_best, vs_best, vs_mp}, where vs_best =
vlseq / max(DDP, one_gpu_best), and target: {status: met | missed | incomplete, checks}; the
targets are vlseq >= 1.3x DDP, >= 1.8x vlseq_1gpu and >= 1.0x one_gpu_best.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import asdict
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .baselines import Feeder, Loop, Pool, _adam, _packed_step, make_pool
from .results import Results, Skip, Task
from .sweep_points import FORMS, TARGETS, ModelSpec, Plan, make_model, param_count, plan_for, point_name
from .timing import Budget, synchronizer, time_loop

ONE_GPU_LOOPS_FUSED = False  # the plain one-GPU loops' Adam (ours and DDP's are fused on GPUs)


# ------------------------------------------------------------------------------------------------
# loops
def _per_sample_step(model: nn.Module, opt: torch.optim.Optimizer, feed: Feeder, k: int, dev: torch.device,
                     no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None) -> Callable[[], None]:
    """One optimizer step on k samples run one by one (forward, MSE sum, backward each). With
    `no_sync` (DDP) every pass but the last runs under it, so gradients are all-reduced once."""

    def step() -> None:
        xs, ys = feed.next(k)
        opt.zero_grad()
        for i, (x, y) in enumerate(zip(xs, ys)):
            with no_sync() if no_sync is not None and i < k - 1 else contextlib.nullcontext():
                out = model(x.to(dev, non_blocking=True))
                F.mse_loss(out, y.to(dev, non_blocking=True).view_as(out), reduction="sum").backward()
        opt.step()

    return step


def point_trainer(spec: ModelSpec, form: str, k: int, devices: Sequence[torch.device], fused: bool,
                  process_group: Any = None) -> Any:
    """Our trainer as the sweep runs it at a point (also what diag.limits profiles)."""
    from ..training.trainer import ParallelTrainer
    model = make_model(spec, form).to(devices[0])
    return ParallelTrainer(model, _adam(model, fused), nn.MSELoss(), devices=[str(d) for d in devices],
                           samples_per_device=k, reduction="sum", cuda_graphs=True, pack="auto",
                           process_group=process_group)


def _trainer_loop(spec: ModelSpec, form: str, k: int, devices: Sequence[torch.device], pool: Pool, fused: bool,
                  process_group: Any = None) -> Loop:
    trainer = point_trainer(spec, form, k, devices, fused, process_group)
    feed, n = Feeder(pool), k * len(devices)

    def step() -> None:
        xs, ys = feed.next(n)
        trainer.step(xs, ys)

    loop = Loop(step, n, list(devices))
    loop.extra["trainer"] = trainer
    return loop


def _one_gpu_loop(spec: ModelSpec, packed: bool, k: int, dev: torch.device, pool: Pool, fused: bool,
                  rnn_kernels: Optional[str]) -> Loop:
    model = (make_model(spec, "list", rnn_kernels) if packed else make_model(spec, "one")).to(dev)
    opt, feed = _adam(model, fused), Feeder(pool)
    step = _packed_step(model, opt, feed, k, dev) if packed else _per_sample_step(model, opt, feed, k, dev)
    return Loop(step, k, [dev])


def _graph_work(trainer: Any) -> int:
    """First eager runs + captures + replays of the trainer's CUDA-graph caches so far (0 when it
    runs no graphs: packed batches, or no CUDA)."""
    try:
        stats = trainer.graph_stats() or []
    except Exception:
        return 0
    return sum(int(s.get(key, 0) or 0) for s in stats if isinstance(s, dict)
               for key in ("eager_runs", "captures", "replays"))


def warm_steps(pool: int, samples_per_step: int) -> int:
    """Untimed steps to see the pool once: 2 to 8."""
    return min(max(math.ceil(pool / samples_per_step), 2), 8)


def _warm_up(loop: Loop, lengths: Sequence[int], steps: int, max_s: Optional[float]) -> None:
    """The first step; when that step went through the trainer's CUDA-graph caches, graph captures
    for every pool length (trainer.warmup; packed steps capture none); then the rest of `steps`,
    stopping early after max_s (not in the worker processes, whose ranks must run the same number
    of steps: max_s=None)."""
    t0 = time.perf_counter()
    loop.step()
    trainer = loop.extra.get("trainer")
    if trainer is not None and _graph_work(trainer):
        trainer.warmup(sorted(set(lengths)))
    for _ in range(steps - 1):
        if max_s is not None and time.perf_counter() - t0 > max_s:
            break
        loop.step()


def _path_note(trainer: Any, before: int) -> str:
    """How the trainer ran the timed steps."""
    if not getattr(trainer, "cuda_graphs", False):
        return "eager"
    return "CUDA-graph replays" if _graph_work(trainer) > before else "no graph replays (packed batches)"


# ------------------------------------------------------------------------------------------------
# plan
class _Deadline:
    """The in-process sweep's time budget, counted from its first measurement."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.t0: Optional[float] = None

    def check(self) -> None:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        if now - self.t0 > self.limit_s:
            raise Skip(f"the sweep's time budget ({self.limit_s:.0f} s of in-process measurements) was spent "
                       "before this point")


NOTES = {
    "vlseq": "ParallelTrainer, all devices, one process",
    "vlseq_1gpu": "ParallelTrainer, first device",
    "vlseq_mp": "ParallelTrainer(devices=[its device], process_group=WORLD), one process per device",
    "ddp_nccl": "DDP, one process per GPU",
    "ddp_gloo": "DDP over gloo, one process per CPU device",
    "one_gpu_packed": "one device, k samples packed per step (list model, its RNN on vlseq_ext.nn's kernels); shared "
                      "by both forms",
    "one_gpu_cudnn": "one device, k samples packed per step (list model, its RNN on torch's cuDNN); shared by both "
                     "forms",
    "one_gpu": "one device, k per-sample passes, one optimizer step (torch's RNN modules); shared by both forms",
}


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    """The sweep's in-process tasks and its jobs for the run's worker processes [(job, on_result)]."""
    cuda = devices[0].type == "cuda"
    n = len(devices)
    plan = plan_for(cuda, budget.quick)
    ddp_name = "ddp_nccl" if cuda else "ddp_gloo"
    fused = cuda  # our trainer's and DDP's optimizer
    loops_fused = cuda and ONE_GPU_LOOPS_FUSED
    opt_names = {False: "Adam(lr=1e-3)", True: "Adam(lr=1e-3, fused=True)"}
    optimizer = {m: opt_names[fused] for m in ("vlseq", "vlseq_1gpu", "vlseq_mp", ddp_name)}
    optimizer.update({m: opt_names[loops_fused] for m in ("one_gpu_packed", "one_gpu_cudnn", "one_gpu", "one_gpu_best")})
    res.set("train.sweep_info", {
        "devices": [str(d) for d in devices], "models": [asdict(s) for s in plan.models], "ks": list(plan.ks),
        "forms": list(FORMS), "pool_samples": plan.pool, "lengths": [plan.min_len, plan.max_len],
        "ddp_method": ddp_name, "optimizer": optimizer,
        "targets": {f"vlseq_{k}": thr for k, thr in TARGETS.items()},
        "repeats": budget.sweep_repeats, "target_s": budget.sweep_target_s,
        "deadline_s": budget.sweep_deadline_s, "mp_deadline_s": budget.sweep_mp_deadline_s})
    if not cuda:
        res.skip("train.sweep.ddp_nccl", "no GPU in this run: DDP runs over gloo instead (ddp_gloo)")
        res.skip("train.sweep.one_gpu_cudnn", "no GPU in this run: on a CPU one_gpu_packed runs torch's RNN already")
    res.node("train.sweep")
    clock = _Deadline(budget.sweep_deadline_s)
    out: List[Task] = []
    jobs: List[tuple] = []
    n_jobs = len(plan.models) * len(plan.ks) * len(FORMS) * 2 if n >= 2 else 0
    # One pool for every point (built on first use): the same samples for every model, k and method.
    pool = functools.lru_cache(None)(functools.partial(
        make_pool, plan.pool, seed=0, pin=cuda, min_len=plan.min_len, max_len=plan.max_len))
    for spec in plan.models:
        for k in plan.ks:
            paths = {form: f"train.sweep.{point_name(form, spec, k)}" for form in FORMS}
            for form, path in paths.items():
                res.set(path, {"form": form, "rnn": spec.rnn, "hidden": spec.hidden, "layers": spec.layers, "k": k,
                               "params": param_count(spec), "pool_samples": plan.pool, "num_devices": {},
                               "notes": {}, "setup_s": {}})
                for method, devs in (("vlseq", devices), ("vlseq_1gpu", devices[:1])):
                    if method == "vlseq" and n < 2:
                        res.skip(f"{path}.{method}", f"needs >= 2 devices, got {n} (vlseq_1gpu is the one-device run)")
                        continue

                    def run(method=method, devs=devs, form=form, path=path, pool=pool, k=k, spec=spec) -> None:
                        clock.check()
                        _measure(res, path, [path], method, lambda: _trainer_loop(spec, form, k, devs, pool(), fused),
                                 pool(), plan, budget)
                    out.append(Task("sweep", f"{path}.{method}", run))
            # (the one-sample loop's OneSampleModel holds torch's modules whatever rnn_kernels says: None)
            for method, packed, kernels in (("one_gpu_packed", True, "auto"), ("one_gpu_cudnn", True, "cudnn"),
                                            ("one_gpu", False, None)):
                if method == "one_gpu_cudnn" and not cuda:
                    continue
                home = paths["list" if packed else "one"]

                def run(method=method, packed=packed, kernels=kernels, pool=pool, k=k, spec=spec, paths=paths,
                        home=home) -> None:
                    clock.check()
                    _measure(res, home, list(paths.values()), method,
                             lambda: _one_gpu_loop(spec, packed, k, devices[0], pool(), loops_fused, kernels), pool(),
                             plan, budget)
                out.append(Task("sweep", f"{home}.{method}", run))
            for form, path in paths.items():
                for method in ("vlseq_mp", ddp_name):
                    key = f"{path}.{method}"
                    if n < 2:
                        res.skip(key, f"needs >= 2 devices (one process each), got {n}")
                        continue
                    job = {"key": key, "kind": "sweep", "method": "vlseq_mp" if method == "vlseq_mp" else "ddp",
                           "form": form, "spec": asdict(spec), "k": k, "fused": fused,
                           "pool": {"n": plan.pool, "seed": 0, "min_len": plan.min_len, "max_len": plan.max_len},
                           "warm_steps": warm_steps(plan.pool, k * n), "deadline_s": budget.sweep_mp_deadline_s,
                           "timing": {"repeats": budget.sweep_repeats, "target_s": budget.sweep_target_s,
                                      "min_iters": 1},
                           "timeout_s": budget.sweep_mp_deadline_s / max(n_jobs, 1) + 10}
                    jobs.append((job, lambda r, path=path, method=method, k=k: _record(
                        res, [path], method, [k * n / t for t in r["times"]], n, r.get("setup_s"), NOTES[method])))
    return out, jobs


def _measure(res: Results, path: str, record_in: List[str], method: str, build: Callable[[], Loop], pool: Pool,
             plan: Plan, budget: Budget) -> None:
    """Build, warm up (counted in setup_s), time; record under every path of record_in."""
    t0 = time.perf_counter()
    loop = build()
    sync = synchronizer(loop.devices)
    _warm_up(loop, [x.shape[0] for x in pool[0]], warm_steps(plan.pool, loop.samples_per_step), budget.sweep_warmup_s)
    sync()
    setup_s = time.perf_counter() - t0
    trainer = loop.extra.get("trainer")
    before = _graph_work(trainer) if trainer is not None else 0
    try:
        ts = time_loop(loop.step, sync, repeats=budget.sweep_repeats, warmup=0, target_s=budget.sweep_target_s,
                       min_iters=1)
    finally:
        _close(loop)
    note = NOTES[method]
    if trainer is not None:
        note += f"; {_path_note(trainer, before)}"
        if getattr(trainer, "cuda_graphs", False):
            res.node(path + ".graph_stats")[method] = trainer.graph_stats()
        if isinstance(getattr(trainer, "capture_seconds", None), (int, float)):
            res.node(path + ".capture_s")[method] = trainer.capture_seconds  # (part of setup_s)
    _record(res, record_in, method, [loop.samples_per_step / t for t in ts], len(loop.devices), setup_s, note)


def _close(loop: Loop) -> None:
    """Stop the trainer's device threads, if it has any (its graphs go with it)."""
    close = getattr(loop.extra.get("trainer"), "close", None)
    if callable(close):
        close()


def _record(res: Results, paths: List[str], method: str, sps: List[float], ndev: int, setup_s: Optional[float],
            note: str) -> None:
    for path in paths:
        res.record(path + ".samples_per_s", method, sps)
        res.node(path + ".num_devices")[method] = ndev
        res.node(path + ".notes")[method] = note
        if setup_s is not None:
            res.node(path + ".setup_s")[method] = setup_s


# ------------------------------------------------------------------------------------------------
# in the worker processes (one per device; processes.ddp_worker runs the jobs in order)
_MP_T0: Optional[float] = None  # when this process started its first sweep job


def mp_job(job: dict, rank: int, world: int, dev: torch.device, sync: Callable[[], None],
           agree: Callable[[int], int]) -> dict:
    """One sweep point of ddp ("ddp") or our trainer ("vlseq_mp") in this rank's process; every rank
    runs it together on its share of the pool (pool[rank::world])."""
    global _MP_T0
    import torch.distributed as dist
    if _MP_T0 is None:
        _MP_T0 = time.monotonic()
    if agree(int(time.monotonic() - _MP_T0 > job["deadline_s"])):  # every rank skips, or none
        return {"skip": f"the sweep's time budget in the worker processes ({job['deadline_s']:.0f} s) was spent "
                        "before this point"}
    spec, form, k, fused = ModelSpec(**job["spec"]), job["form"], job["k"], job["fused"]
    xs, ys = make_pool(pin=dev.type == "cuda", **job["pool"])
    shard = (xs[rank::world], ys[rank::world])
    t0 = time.perf_counter()
    if job["method"] == "vlseq_mp":
        loop = _trainer_loop(spec, form, k, [dev], shard, fused, process_group=dist.group.WORLD)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = make_model(spec, form).to(dev)
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt, feed = _adam(model, fused), Feeder(shard)
        step = _packed_step(ddp, opt, feed, k, dev) if form == "list" else \
            _per_sample_step(ddp, opt, feed, k, dev, no_sync=ddp.no_sync)
        loop = Loop(step, k, [dev])
    try:
        _warm_up(loop, [x.shape[0] for x in shard[0]], job["warm_steps"], None)
        sync()
        setup_s = time.perf_counter() - t0
        return {"times": time_loop(loop.step, sync, warmup=0, agree=agree, **job["timing"]), "setup_s": setup_s}
    finally:
        _close(loop)
