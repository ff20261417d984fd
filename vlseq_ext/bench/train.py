"""Train suite (targets W1, W2): samples/s of every training loop on synthetic variable-length data.

Workloads: `w1_k1_<model>` (one sample per device per step, the seed's semantics) and
`w2_k32_<model>` (32 samples per device per step), for the seed model and a larger one. Each
method is built fresh, runs one pass over the data pool untimed (warm-up: cuDNN plans, CUDA-graph
captures; reported as setup_s), then `repeats` timed loops of about train_target_s each.
"""
from __future__ import annotations

import functools
import time
from typing import List, Tuple

import torch

from ..models import SeqModel
from .baselines import BUILDERS, make_pool
from .results import Results, Task
from .timing import Budget, synchronizer, time_loop

MODELS = {"seed": {}, "large": {"hidden_dim": 512, "num_layers": 2}}
NOTES = {
    "seed_style": "corrected seed loop: replicate every step, 1 sample/GPU, grads summed by autograd",
    "one_gpu": "plain loop: per sample forward, MSE, backward, Adam step",
    "one_gpu_packed": "one device, k samples packed per step",
    "data_parallel": "zero-padded batch: padding enters the LSTM, results differ (throughput only)",
    "ddp_nccl": "one process per GPU, packed k per GPU, timed in the processes",
    "ddp_gloo": "one process per CPU device (gloo), packed k per process",
    "vlseq": "ParallelTrainer (defaults), all devices",
    "vlseq_1gpu": "ParallelTrainer on one device",
    "vlseq_eager": "ParallelTrainer, cuda_graphs=False",
    "vlseq_noguard": "ParallelTrainer, nonfinite='ignore' (no non-finite guard)",
    "vlseq_fused_adam": "ParallelTrainer with Adam(fused=True) (device-side non-finite guard, no host sync)",
}


MULTI_DEVICE = {"seed_style", "data_parallel", "vlseq", "vlseq_eager", "vlseq_noguard", "vlseq_fused_adam"}
GPU_ONLY = {"seed_style": "nn.parallel.replicate needs CUDA devices",
            "data_parallel": "nn.DataParallel needs CUDA devices",
            "vlseq_eager": "CUDA graphs are GPU-only (on CPU, vlseq is already eager)",
            "vlseq_noguard": "the guard's cost is a device-to-host read, a GPU matter",
            "vlseq_fused_adam": "the device-side guard is a GPU matter"}
VARIANTS = {"vlseq_eager", "vlseq_noguard", "vlseq_fused_adam"}  # left out of --quick


def _why_not(name: str, n: int, cuda: bool, quick: bool) -> str:
    """Why `name` does not run here ("" when it does)."""
    if name in MULTI_DEVICE and n < 2:
        return f"needs >= 2 devices, got {n}"
    if name in GPU_ONLY and not cuda:
        return GPU_ONLY[name]
    if name in VARIANTS and quick:
        return "variant left out of --quick"
    return ""


WORKLOADS = {"w1_k1_seed": ("seed", 1), "w2_k32_seed": ("seed", 32),
             "w1_k1_large": ("large", 1), "w2_k32_large": ("large", 32)}  # name: (model, samples per device)


def tasks(devices: List[torch.device], budget: Budget, res: Results) -> Tuple[List[Task], List[tuple]]:
    cuda = devices[0].type == "cuda"
    n = len(devices)
    ddp_name = "ddp_nccl" if cuda else "ddp_gloo"
    out: List[Task] = []
    ddp: List[tuple] = []
    for wl, (model_name, k) in WORKLOADS.items():
        if budget.quick and model_name != "seed":
            res.skip(f"train.{wl}", "--quick runs the seed model only")
            continue
        if k > 1 and not cuda and (budget.quick or model_name != "seed"):
            res.skip(f"train.{wl}", "packed batches on CPU are slow (PyTorch's CPU backward of a packed LSTM "
                                    "takes ~1 s per 32-sample step, 10x per-sample): on CPU only w2_k32_seed, "
                                    "without --quick")
            continue
        kw = MODELS[model_name]
        step = k * n
        # Pool: k=1 -> enough distinct lengths to be realistic; k=32 -> whole steps for every method.
        pool_n = (64 if budget.quick else 256) if k == 1 else step * (2 if budget.quick else 4)
        if not cuda and k == 1:
            pool_n = 32 if budget.quick else 64
        methods = ["seed_style", "one_gpu"] if k == 1 else ["one_gpu_packed", "data_parallel"]
        methods += ["vlseq_1gpu", "vlseq", "vlseq_fused_adam", "vlseq_noguard"] + (["vlseq_eager"] if k == 1 else [])
        path = f"train.{wl}"
        params = sum(p.numel() for p in SeqModel(**kw).parameters())
        res.set(path, {"model": {"name": model_name, **kw}, "params": params, "k": k, "pool_samples": pool_n,
                       "num_devices": {}, "notes": {}})
        pool = functools.lru_cache(None)(functools.partial(make_pool, pool_n, seed=0, pin=cuda))  # built on first use

        for name in methods:
            key = f"{path}.{name}"
            why = _why_not(name, n, cuda, budget.quick) or (
                "variants run on the seed model only" if name in VARIANTS and model_name != "seed" else "")
            if why:
                res.skip(key, why)
                continue

            def run(name=name, kw=kw, k=k, path=path, pool=pool) -> None:
                _run_method(res, path, name, kw, k, devices, pool(), budget)
            out.append(Task("train", key, run))
        if k > 1 and n >= 2:
            ddp.append(({"key": f"{path}.{ddp_name}", "kind": "train", "model": kw, "k": k, "pool": pool_n,
                         "timing": {"repeats": budget.train_repeats, "target_s": budget.train_target_s,
                                    "min_iters": 2}},
                        lambda r, path=path, step=step: _record(res, path, ddp_name, [step / t for t in r["times"]],
                                                                n, r.get("setup_s"))))
    return out, ddp


def _record(res: Results, path: str, name: str, sps: List[float], ndev: int, setup_s) -> None:
    res.record(path + ".samples_per_s", name, sps)
    res.node(path + ".num_devices")[name] = ndev
    res.node(path + ".notes")[name] = NOTES.get(name, "")
    if setup_s is not None:
        res.node(path + ".setup_s")[name] = setup_s


def _run_method(res: Results, path: str, name: str, kw: dict, k: int, devices: List[torch.device], pool,
                budget: Budget) -> None:
    def make_model() -> SeqModel:
        torch.manual_seed(0)
        return SeqModel(**kw)

    t0 = time.perf_counter()
    loop = BUILDERS[name](make_model, devices, k, pool)
    sync = synchronizer(loop.devices)
    for _ in range(-(-len(pool[0]) // loop.samples_per_step)):  # one pass over the pool: warm-up
        loop.step()
    sync()
    setup_s = time.perf_counter() - t0
    trainer = loop.extra.get("trainer")
    try:
        ts = time_loop(loop.step, sync, repeats=budget.train_repeats, warmup=0, target_s=budget.train_target_s,
                       min_iters=2)
    finally:
        if callable(getattr(trainer, "close", None)):
            trainer.close()  # its device threads
    _record(res, path, name, [loop.samples_per_step / t for t in ts], len(loop.devices), setup_s)
    if trainer is not None and getattr(trainer, "cuda_graphs", False):
        res.node(path + ".graph_stats")[name] = trainer.graph_stats()


def add_ratios(res: Results, cuda: bool) -> None:
    """W1-style workloads: ratio to the plain one-device loop; W2-style: to DDP and to our 1-device run."""
    ddp_name = "ddp_nccl" if cuda else "ddp_gloo"
    for wl, w in res.data["train"].items():
        sps = w.get("samples_per_s") if isinstance(w, dict) else None
        if not sps:
            continue
        bases = ["one_gpu"] if wl.startswith("w1_") else [ddp_name, "vlseq_1gpu"]
        w["ratios"] = {f"vs_{b}": {m: v / sps[b] for m, v in sps.items()} for b in bases if sps.get(b)}
