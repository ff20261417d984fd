"""The training loops we compare against (and our trainer, wrapped the same way), the synthetic
data they share, and the DDP jobs (merge_seed, merge_flat, train) that the worker processes of
vlseq_ext.bench.processes run.

Every loop is built by a function `build_<method>(make_model, devices, k, pool) -> Loop`; the
Loop's `step()` runs one optimizer step on `samples_per_step` samples taken in turn from the
pool. No loop reads the loss back to the host inside the timed region (the seed's `.item()`
logging is left out of all of them alike). Samples live on the host (pinned when CUDA is used),
as a DataLoader would hand them over, and each loop moves them itself.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import SeqModel
from .results import Skip
from .timing import time_loop

FEATURES = 36
MIN_LEN, MAX_LEN = 50, 500

# replicate() and DataParallel copy cuDNN RNN weights out of their flat buffer; cuDNN then warns
# on every call. Expected for those baselines, and noise in a benchmark's output.
warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous chunk")


# --------------------------------------------------------------------------------------------
# data
Pool = Tuple[List[Tensor], List[Tensor]]


def make_pool(n: int, seed: int = 0, pin: bool = False, min_len: int = MIN_LEN, max_len: int = MAX_LEN,
              features: int = FEATURES) -> Pool:
    """n synthetic samples: x of shape (L, 36) with L uniform in [50, 500] (by default), y of shape
    (1,); the same for given arguments in every process."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    xs = [torch.randn(L, features, generator=g) for L in lengths]
    ys = [torch.randn(1, generator=g) for _ in lengths]
    if pin:
        xs = [x.pin_memory() for x in xs]
        ys = [y.pin_memory() for y in ys]
    return xs, ys


class Feeder:
    """Hands out the pool's samples in order, cycling."""

    def __init__(self, pool: Pool) -> None:
        self.xs, self.ys = pool
        self.i = 0

    def next(self, n: int) -> Pool:
        idx = [(self.i + j) % len(self.xs) for j in range(n)]
        self.i = (self.i + n) % len(self.xs)
        return [self.xs[j] for j in idx], [self.ys[j] for j in idx]


@dataclass
class Loop:
    step: Callable[[], object]  # one optimizer step
    samples_per_step: int
    devices: List[torch.device]  # the devices to synchronize around timed loops
    extra: Dict[str, object] = field(default_factory=dict)


def _need_gpus(devices: Sequence[torch.device], what: str) -> None:
    if len(devices) < 2 or any(d.type != "cuda" for d in devices):
        raise Skip(f"{what} needs >= 2 CUDA devices")


def _adam(model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    """Adam(lr=1e-3) over the model's parameters; fused=True (one multi-tensor kernel per step, and
    the trainer's non-finite guard without a host sync) needs them on a GPU."""
    if fused:
        return torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _packed_step(model: nn.Module, opt: torch.optim.Optimizer, feed: "Feeder", k: int,
                 dev: torch.device) -> Callable[[], None]:
    """One optimizer step on k samples from `feed`, run as one packed batch (model(list))."""

    def step() -> None:
        xs, ys = feed.next(k)
        out = model(_to(xs, dev))
        loss = F.mse_loss(out, torch.stack(ys).to(dev, non_blocking=True), reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def _to(ts: Sequence[Tensor], dev: torch.device) -> List[Tensor]:
    return [t.to(dev, non_blocking=True) for t in ts]


# --------------------------------------------------------------------------------------------
# loops
def build_one_gpu(make_model, devices, k, pool) -> Loop:
    """The plain loop users write: per sample forward, MSE, backward, Adam step."""
    dev = devices[0]
    model = make_model().to(dev)
    opt, loss_fn, feed = _adam(model), nn.MSELoss(), Feeder(pool)

    def step() -> None:
        (x,), (y,) = feed.next(1)
        out = model(x.to(dev, non_blocking=True))
        loss = loss_fn(out, y.to(dev, non_blocking=True).view_as(out))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Loop(step, 1, [dev])


def build_one_gpu_packed(make_model, devices, k, pool) -> Loop:
    """One device, k samples per step as one packed batch (model(list) packs them)."""
    dev = devices[0]
    model = make_model().to(dev)
    opt, feed = _adam(model), Feeder(pool)

    return Loop(_packed_step(model, opt, feed, k, dev), k, [dev])


def build_seed_style(make_model, devices, k, pool) -> Loop:
    """The seed's loop, corrected (docs/design.md, "The seed's loop"): replicate every step, one sample per GPU,
    parallel_apply, one backward over all losses. Backward through replicate sums every
    replica's gradient into the master's .grad (autograd's merge), so no Python merge; then Adam
    on the master."""
    _need_gpus(devices, "nn.parallel.replicate")
    from torch.nn import parallel
    ids = [d.index for d in devices]
    model = make_model().to(devices[0])
    opt, loss_fn, feed = _adam(model), nn.MSELoss(), Feeder(pool)

    def step() -> None:
        xs, ys = feed.next(len(ids))
        replicas = parallel.replicate(model, ids)
        inputs = [(x.to(d, non_blocking=True),) for x, d in zip(xs, devices)]
        outs = parallel.parallel_apply(replicas, inputs, devices=ids)
        losses = [loss_fn(o, y.to(o.device, non_blocking=True).view_as(o)) for o, y in zip(outs, ys)]
        torch.autograd.backward(losses)
        opt.step()
        opt.zero_grad()

    return Loop(step, len(ids), list(devices))


class _Padded(nn.Module):
    """SeqModel on a zero-padded batch (B, Lmax, D): the padding runs through the LSTM."""

    def __init__(self, model: SeqModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.recurrent(x)[1]
        h = h[0] if isinstance(h, tuple) else h
        return self.model.fc(h[-1])


def build_data_parallel(make_model, devices, k, pool) -> Loop:
    """nn.DataParallel over a zero-padded batch of k samples per GPU. Padding enters the LSTM, so
    its results differ from the exact methods: a throughput-only baseline."""
    _need_gpus(devices, "nn.DataParallel")
    ids = [d.index for d in devices]
    dev = devices[0]
    model = make_model().to(dev)
    dp = nn.DataParallel(_Padded(model), device_ids=ids, output_device=ids[0])
    opt = _adam(model)
    b = k * len(ids)
    xs, ys = pool
    # Collated ahead, as DataLoader workers would (pad to the batch's max length).
    pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)
    batches = [(pin(nn.utils.rnn.pad_sequence(xs[s:s + b], batch_first=True)), pin(torch.stack(ys[s:s + b])))
               for s in range(0, len(xs) - b + 1, b)]
    it = [0]

    def step() -> None:
        X, Y = batches[it[0] % len(batches)]
        it[0] += 1
        out = dp(X.to(dev, non_blocking=True))
        loss = F.mse_loss(out, Y.to(dev, non_blocking=True), reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()

    return Loop(step, b, list(devices))


def build_vlseq(make_model, devices, k, pool, *, cuda_graphs: bool = True, fused_adam: bool = False,
                **trainer_kw) -> Loop:
    """Our ParallelTrainer, constructed as its docstring shows (plain Adam); CUDA graphs
    pre-captured for the pool's lengths by trainer.warmup, counted in setup_s."""
    from ..training.trainer import ParallelTrainer
    model = make_model().to(devices[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused_adam else _adam(model)
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices=[str(d) for d in devices],
                              samples_per_device=k, reduction="sum", cuda_graphs=cuda_graphs, **trainer_kw)
    if getattr(trainer, "cuda_graphs", False):
        trainer.warmup(sorted({x.shape[0] for x in pool[0]}))
    feed, n = Feeder(pool), k * len(devices)

    def step() -> Tensor:
        xs, ys = feed.next(n)
        return trainer.step(xs, ys)

    loop = Loop(step, n, list(trainer.devices))
    loop.extra["trainer"] = trainer
    return loop


BUILDERS: Dict[str, Callable[..., Loop]] = {
    "seed_style": build_seed_style,
    "one_gpu": build_one_gpu,
    "one_gpu_packed": build_one_gpu_packed,
    "data_parallel": build_data_parallel,
    "vlseq": build_vlseq,
    "vlseq_1gpu": lambda mm, devs, k, pool: build_vlseq(mm, devs[:1], k, pool),
    "vlseq_eager": lambda mm, devs, k, pool: build_vlseq(mm, devs, k, pool, cuda_graphs=False),
    "vlseq_noguard": lambda mm, devs, k, pool: build_vlseq(mm, devs, k, pool, nonfinite="ignore"),
    "vlseq_fused_adam": lambda mm, devs, k, pool: build_vlseq(mm, devs, k, pool, fused_adam=True),
}


# --------------------------------------------------------------------------------------------
# torch.distributed jobs, run in the worker processes (vlseq_ext.bench.processes spawns them)
def ddp_job(job: dict, rank: int, world: int, dev: torch.device, sync, agree) -> dict:
    """One job of kind merge_seed, merge_flat or train in this rank's process."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.nn.parallel import DistributedDataParallel as DDP

    timing = job["timing"]
    if job["kind"] == "merge_seed":
        # What DDP does with one bucket: flatten the grads, all-reduce, copy back.
        torch.manual_seed(rank)
        grads = [torch.randn_like(p) for p in SeqModel().to(dev).parameters()]

        def fn() -> None:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))
    elif job["kind"] == "merge_flat":
        buf = torch.ones(job["numel"], dtype=getattr(torch, job["dtype"]), device=dev)

        def fn() -> None:
            dist.all_reduce(buf)
    elif job["kind"] == "train":
        k = job["k"]
        torch.manual_seed(0)
        model = SeqModel(**job["model"]).to(dev)
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt = _adam(model)
        xs, ys = make_pool(job["pool"], job.get("seed", 0), pin=dev.type == "cuda")
        feed = Feeder((xs[rank::world], ys[rank::world]))

        fn = _packed_step(ddp, opt, feed, k, dev)

        t0 = time.perf_counter()
        for _ in range(len(feed.xs) // k):  # one pass over the shard: warm-up
            fn()
        sync()
        setup_s = time.perf_counter() - t0
        times = time_loop(fn, sync, warmup=0, agree=agree, **timing)
        return {"times": times, "setup_s": setup_s}
    else:
        raise ValueError(f"unknown DDP job kind {job['kind']!r}")
    return {"times": time_loop(fn, sync, agree=agree, **timing)}
