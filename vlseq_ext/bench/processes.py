"""The run's worker processes: one process per device (NCCL on CUDA, gloo on CPU), spawned once per
run, running every suite's multi-process jobs in order. The jobs themselves live with their suites:
baselines.ddp_job (merge_seed, merge_flat, train) and sweep.mp_job (sweep); run_job sends each job
to its code. This module sits above both, so neither imports the other's process machinery."""
from __future__ import annotations

import gc
import json
import os
import socket
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Sequence

import torch

from .. import env
from .baselines import ddp_job
from .sweep import mp_job
from .timing import synchronizer


def run_job(job: dict, rank: int, world: int, dev: torch.device, sync: Callable[[], None],
            agree: Callable[[int], int]) -> dict:
    """One job in this rank's process: the sweep's to sweep.mp_job, every other kind to baselines.ddp_job
    (which raises ValueError on a kind it does not know)."""
    if job["kind"] == "sweep":
        return mp_job(job, rank, world, dev, sync, agree)
    return ddp_job(job, rank, world, dev, sync, agree)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(jobs: List[dict], devices: Sequence[torch.device], timeout_s: float) -> Dict[str, dict]:
    """Runs `jobs` in len(devices) spawned processes (NCCL on CUDA, gloo on CPU), each job timed
    inside the processes. Returns {job key: {"times": [per repeat, max over ranks], "setup_s"} or
    {"error": str} or {"skip": str} (a job that decided, on every rank, not to run)}. A crash or hang
    (past timeout_s) costs only the jobs that had not finished."""
    import torch.multiprocessing as mp

    world = len(devices)
    cuda = devices[0].type == "cuda"
    backend = "nccl" if cuda else "gloo"
    ids = [d.index for d in devices] if cuda else [None] * world
    env.disable_nvls()  # inherited by the children
    failure = ""
    with tempfile.TemporaryDirectory(prefix="vlseq-bench-ddp-") as tmp:
        ctx = mp.start_processes(ddp_worker, args=(world, free_port(), backend, ids, jobs, tmp),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    failure = f"DDP processes timed out after {timeout_s:.0f} s"
                    break
        except Exception as exc:  # a rank raised or died; ctx.join killed the others
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            failure = f"{type(exc).__name__}: {lines[-1] if lines else exc}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        per_rank = []
        for r in range(world):
            try:
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    per_rank.append(json.load(f))
            except (OSError, ValueError):
                per_rank.append({})
    out: Dict[str, dict] = {}
    for job in jobs:
        key = job["key"]
        res = [rk.get(key) for rk in per_rank]
        errs = [r["error"] for r in res if r and "error" in r]
        skips = [r["skip"] for r in res if r and "skip" in r]
        if errs:
            out[key] = {"error": errs[0]}
        elif skips:
            out[key] = {"skip": skips[0]}
        elif all(r and "times" in r for r in res):
            out[key] = {"times": [max(ts) for ts in zip(*(r["times"] for r in res))],
                        "setup_s": max(r.get("setup_s", 0.0) for r in res)}
        else:
            out[key] = {"error": failure or "no result from the DDP processes"}
    return out


def ddp_worker(rank: int, world: int, port: int, backend: str, ids: List, jobs: List[dict], out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(ids[rank])
        dev = torch.device("cuda", ids[rank])
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)  # as the bench's own process on CPU (__main__): tiny ops, shared cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    dev_sync = synchronizer([dev])

    def agree(n: int) -> int:  # max over ranks
        flag.fill_(int(n))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def sync() -> None:  # all ranks start and stop each timed loop together
        dev_sync()
        agree(0)
        dev_sync()

    results: Dict[str, dict] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    for job in jobs:
        try:
            results[job["key"]] = run_job(job, rank, world, dev, sync, agree)
        except Exception as exc:
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"rank {rank}, {os.path.basename(tb.filename)}:{tb.lineno}"
            results[job["key"]] = {"error": f"{type(exc).__name__}: {exc} ({where})"}
        with open(path + ".tmp", "w") as f:  # after every job, so a later hang loses nothing before it
            json.dump(results, f)
        os.replace(path + ".tmp", path)
        gc.collect()  # a job's models, trainers and CUDA graphs go before the next job's
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
