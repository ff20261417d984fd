"""Training across processes on torch.distributed (gloo on CPU, 127.0.0.1 only).

Multi-process tests start real processes: this file doubles as their worker
(`python tests/test_distributed.py <scenario> <out_dir>`, with torchrun's environment variables set
by `launch`), and `vlseq-train` runs under `torchrun --standalone`. Every launch is bounded by a
deadline, after which its processes are killed, so a bug cannot hang CI.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
LAUNCH_TIMEOUT_S = 150  # hard bound on any multi-process launch
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# Tiny CLI runs: 58 training samples, global steps of 4 (15 per epoch, the last of 2 samples: both
# go to rank 0's devices, rank 1 has none).
SMALL = ["--hidden", "8", "--synthetic-samples", "64", "--quiet", "--deterministic"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def communicate_all(procs: List[subprocess.Popen], timeout: float) -> List[Tuple[int, str, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"processes still running after {timeout} s: killed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out


def launch(scenario: str, out_dir: Path, world: int = 2, ranks=None, timeout: float = LAUNCH_TIMEOUT_S,
           **env) -> List[Tuple[int, str, str]]:
    """Runs this file's `scenario` as ranks `ranks` (default all) of a `world`-process group, the way
    torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT...); returns (returncode, stdout, stderr) per rank."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(THIS), scenario, str(out_dir)],
                              env=base_env(RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, LOCAL_WORLD_SIZE=world,
                                           MASTER_PORT=port, **env),
                              cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (range(world) if ranks is None else ranks)]
    return communicate_all(procs, timeout)


def torchrun(*argv, cwd: Path, nproc: int = 2, timeout: float = LAUNCH_TIMEOUT_S, **env) -> Tuple[int, str, str]:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "vlseq_ext", *map(str, argv)]
    proc = subprocess.Popen(cmd, env=base_env(**env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return communicate_all([proc], timeout)[0]


def steps(path) -> Dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if r["type"] == "step"}


# ------------------------------------------------------------------------------------------------
# the worker side


def _data(n: int = 30, features: int = 3, out: int = 2):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 10, (n,), generator=g).tolist()
    xs = [torch.randn(L, features, generator=g) for L in lengths]
    ys = [torch.randn(out, generator=g) for _ in lengths]
    return lengths, xs, ys


# Global steps of the merge scenario: full (8 = 2 ranks x 2 devices x 2), a short tail (5), a tail
# of one sample (one rank gets none), and 3.
GLOBAL_STEPS = [list(range(0, 8)), list(range(8, 16)), list(range(16, 21)), [21], list(range(22, 25))]


def _flat_params(module: nn.Module) -> List[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def scenario_merge(out: Path) -> None:
    """Merged gradients vs a float64 single-device reference; training, fit() and accumulation
    vs one process with 4 CPU devices; the state every rank ends with."""
    from vlseq_ext import ParallelTrainer, SeqModel
    from vlseq_ext.distributed import TorchProcessGroup

    rank = int(os.environ["RANK"])
    lengths, xs, ys = _data()
    res: Dict[str, object] = {"rank": rank}

    def trainer_for(reduction, opt="sgd", devices=("cpu", "cpu"), group="auto", **kw):
        torch.manual_seed(100 + rank if group == "auto" else 100)  # ranks differ until broadcast_from_rank0
        model = SeqModel(3, 8, 2)
        optim = (torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=1e-2))
        return ParallelTrainer(model, optim, nn.MSELoss(), devices=list(devices), samples_per_device=2,
                               reduction=reduction, process_group=group, **kw)

    # 1. merged gradients (compute_gradients) against the float64 reference of the whole global step
    for reduction in ("sum", "mean"):
        tr = trainer_for(reduction)
        assert isinstance(tr.group, TorchProcessGroup) and (tr.group.rank, tr.group.world_size) == (rank, 2)
        ref = copy.deepcopy(tr.model).double()
        worst, counts, losses = 0.0, [], []
        for gs in GLOBAL_STEPS:
            mine = [gs[i] for i in tr.shard([lengths[i] for i in gs])]
            counts.append(len(mine))
            loss = tr.compute_gradients([xs[i] for i in mine], [ys[i] for i in mine])
            ref.zero_grad()
            total = sum(F.mse_loss(ref(xs[i].double()), ys[i].double().view(1, -1)) for i in gs)
            if reduction == "mean":
                total = total / len(gs)
            total.backward()
            for p, q in zip(tr.model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-5, atol=1e-7)
                worst = max(worst, float(((p.grad.double() - q.grad).abs() / q.grad.abs().clamp_min(1e-3)).max()))
            torch.testing.assert_close(loss.double(), total.detach(), rtol=1e-5, atol=0)
            losses.append(float(loss))
        res[f"grads_{reduction}"] = {"worst_rel": worst, "counts": counts, "losses": losses}

    # 2. training steps (Adam, with the tails) vs one process with 4 CPU devices on the same global steps
    tr = trainer_for("mean", "adam")
    one = trainer_for("mean", "adam", devices=["cpu"] * 4, group=None)
    one.model.load_state_dict(tr.model.state_dict())  # rank 0's initial weights (after the broadcast)
    one.sync_replicas()
    step_losses = []
    for _ in range(2):
        for gs in GLOBAL_STEPS:
            mine = [gs[i] for i in tr.shard([lengths[i] for i in gs])]
            a = tr.step([xs[i] for i in mine], [ys[i] for i in mine])
            b = one.step([xs[i] for i in gs], [ys[i] for i in gs])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
            step_losses.append(float(a))
    torch.testing.assert_close(torch.tensor(_flat_params(tr.model)), torch.tensor(_flat_params(one.model)),
                               rtol=1e-5, atol=1e-6)
    res["train"] = {"losses": step_losses, "params": _flat_params(tr.model),
                    "replicas_equal_master": all(_flat_params(r) == _flat_params(tr.model) for r in tr.replicas.replicas)}

    # 3. fit(): same data, same shuffle seed; global steps of 8, the last one of 6
    tr, one = trainer_for("mean"), trainer_for("mean", devices=["cpu"] * 4, group=None)
    one.model.load_state_dict(tr.model.state_dict())
    one.sync_replicas()
    data = list(zip(xs, ys))
    ha = tr.fit(data, epochs=2, shuffle=True, seed=3)
    hb = one.fit(data, epochs=2, shuffle=True, seed=3)
    assert [h["samples"] for h in ha] == [h["samples"] for h in hb] == [30, 30]
    assert [h["steps"] for h in ha] == [h["steps"] for h in hb] == [4, 4]
    np.testing.assert_allclose([h["loss"] for h in ha], [h["loss"] for h in hb], rtol=1e-5)
    res["fit"] = {"losses": [h["loss"] for h in ha], "params": _flat_params(tr.model)}

    # 4. gradient accumulation over 2 calls: the window's global mean
    tr = trainer_for("mean", accumulation_steps=2)
    one = trainer_for("mean", devices=["cpu"] * 4, group=None, accumulation_steps=2)
    one.model.load_state_dict(tr.model.state_dict())
    one.sync_replicas()
    for gs in GLOBAL_STEPS[1:]:  # 8+5, then 1+3
        mine = [gs[i] for i in tr.shard([lengths[i] for i in gs])]
        tr.step([xs[i] for i in mine], [ys[i] for i in mine])
        one.step([xs[i] for i in gs], [ys[i] for i in gs])
    torch.testing.assert_close(torch.tensor(_flat_params(tr.model)), torch.tensor(_flat_params(one.model)),
                               rtol=1e-5, atol=1e-6)
    res["accumulation"] = {"params": _flat_params(tr.model)}
    (out / f"rank{rank}.json").write_text(json.dumps(res))


def scenario_early_exit(out: Path) -> None:
    """Rank 1 leaves after 3 steps; rank 0 keeps training and must fail with a clear error."""
    from vlseq_ext import ParallelTrainer, SeqModel
    from vlseq_ext.distributed import DistributedError

    rank = int(os.environ["RANK"])
    _, xs, ys = _data(features=3, out=1)
    model = SeqModel(3, 8, 1)
    tr = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=["cpu", "cpu"])
    print("ready", flush=True)
    for step in range(1000):
        if rank == 1 and step == 3:
            os._exit(0)  # gone without a word (no destroy_process_group), as a crashed or finished rank is
        try:
            tr.step(xs[2 * rank:2 * rank + 2], ys[2 * rank:2 * rank + 2])
        except DistributedError as exc:
            print(f"CAUGHT at step {step}: {exc}", flush=True)
            sys.exit(3)
    print("no error", flush=True)


def scenario_lonely(out: Path) -> None:
    """The only rank of a 2-process group: the rendezvous must fail within the timeout."""
    from vlseq_ext import ParallelTrainer, SeqModel
    from vlseq_ext.distributed import DistributedError

    model = SeqModel(3, 8, 1)
    try:
        ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=["cpu"])
    except DistributedError as exc:
        print(f"CAUGHT: {exc}", flush=True)
        sys.exit(3)
    print("no error", flush=True)


def scenario_other_data(out: Path) -> None:
    """Each rank reads its own copy of train.npz (as on several machines); rank 1's has other values
    (same sizes). With VLSEQ_TEST_PART=cli vlseq-train trains on it, else fit() gets data of another
    length on rank 1."""
    from vlseq_ext import ParallelTrainer, SeqModel, cli, data

    rank = int(os.environ["RANK"])
    own = out / f"rank{rank}"
    own.mkdir()
    os.chdir(own)
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((5, 3)).astype(np.float32) * (1.5 if rank == 1 and i == 7 else 1.0) for i in range(16)]
    data.save_ragged("train.npz", seqs, np.zeros((16, 1), np.float32))
    if os.environ.get("VLSEQ_TEST_PART") == "cli":
        rc = cli.main(["--devices", "cpu", "--data", "train.npz", "--hidden", "8", "--quiet", "--max-steps", "2",
                       "--checkpoint-dir", str(out / "run")])
        print(f"CLI rc {rc}", flush=True)
        return
    model = SeqModel(3, 8, 1)
    tr = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=["cpu"])
    samples = [(torch.from_numpy(x), torch.zeros(1)) for x in seqs[:7 + 2 * rank]]
    try:
        tr.fit(samples)
    except ValueError as exc:
        print(f"FIT: {exc}", flush=True)


SCENARIOS = {"merge": scenario_merge, "early_exit": scenario_early_exit, "lonely": scenario_lonely,
             "other_data": scenario_other_data}


# ------------------------------------------------------------------------------------------------
# multi-process tests


def test_two_processes_merge_equals_the_float64_reference(tmp_path):
    """2 processes x 2 CPU replicas: merged gradients and losses equal the single-device float64
    reference (sum and mean, with tails that leave a rank few or no samples); training, fit() and
    accumulation match one process with 4 devices; every rank ends with identical weights."""
    res = launch("merge", tmp_path)
    for rc, _, err in res:
        assert rc == 0, err[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for red in ("sum", "mean"):
        c0, c1 = r0[f"grads_{red}"]["counts"], r1[f"grads_{red}"]["counts"]
        assert [a + b for a, b in zip(c0, c1)] == [len(gs) for gs in GLOBAL_STEPS]
        assert 0 in c0 + c1 and c0[0] == c1[0] == 4  # a rank with no sample; full steps split evenly
        assert r0[f"grads_{red}"]["losses"] == r1[f"grads_{red}"]["losses"]  # the global loss on every rank
    for key in ("train", "fit", "accumulation"):
        assert r0[key] == r1[key]  # bit-identical losses and weights on both ranks
    assert r0["train"]["replicas_equal_master"] and r1["train"]["replicas_equal_master"]


def test_a_rank_that_leaves_early_makes_the_others_fail_clearly(tmp_path):
    (rc0, out0, err0), (rc1, _, err1) = launch("early_exit", tmp_path, VLSEQ_DIST_TIMEOUT=20)
    assert rc1 == 0, err1[-2000:]
    assert rc0 == 3, (out0, err0[-2000:])
    assert "CAUGHT at step 3" in out0 and "rank 0 of 2 (gloo)" in out0
    assert "Another process has probably stopped" in out0 and "VLSEQ_DIST_TIMEOUT" in out0


def test_ranks_with_other_data_are_refused_before_training(tmp_path):
    # Each rank reads its own files: a copy of other values (or another length) trained on a silent mix.
    res = launch("other_data", tmp_path, VLSEQ_DIST_TIMEOUT=20, VLSEQ_TEST_PART="cli")
    for rc, out, err in res:
        assert rc == 0 and "CLI rc 2" in out, (out, err[-3000:])
    assert "differ in their training data (same size, other values" in res[0][2], res[0][2][-3000:]
    assert not (tmp_path / "run" / "last.pt").exists()
    (tmp_path / "fit").mkdir()
    for rc, out, err in launch("other_data", tmp_path / "fit", VLSEQ_DIST_TIMEOUT=20):
        assert rc == 0, err[-3000:]
        assert "FIT: the 2 processes differ in their training samples" in out and "from 7 to 9" in out, out


def test_a_failed_rendezvous_is_a_clear_error_within_the_timeout(tmp_path):
    ((rc, out, err),) = launch("lonely", tmp_path, ranks=[0], VLSEQ_DIST_TIMEOUT=2, timeout=90)
    assert rc == 3, (out, err[-2000:])
    assert "rank 0 of 2 could not join the process group at 127.0.0.1:" in out and "within 2 s" in out


def test_vlseq_train_under_torchrun_matches_one_process_and_resumes_anywhere(tmp_path, capsys):
    from vlseq_ext import checkpoint, cli

    # 2 processes x 2 CPU replicas vs 1 process x 4: 18 steps, across the epoch end (step 15) and
    # the 2-sample tail step that leaves rank 1 without a sample.
    rc, out, err = torchrun("--devices", "cpu:2", *SMALL, "--max-steps", 18, "--checkpoint-dir", tmp_path / "dist",
                            cwd=tmp_path)
    assert rc == 0, err[-3000:]
    assert err.count("vlseq-train: synthetic(seed=0): 58 train") == 1  # one log stream: rank 0's
    assert "2 processes x (cpu x2), 4 samples per step" in err and out.count("vlseq-train summary") == 1
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == sorted(
        ["last.pt", "metrics.jsonl"] + (["loss.png"] if importlib.util.find_spec("matplotlib") else []))
    rc = cli.main([*map(str, ["--devices", "cpu:4", *SMALL, "--max-steps", 24, "--checkpoint-dir", tmp_path / "one"])])
    assert rc == 0, capsys.readouterr().err
    a, b = steps(tmp_path / "dist" / "metrics.jsonl"), steps(tmp_path / "one" / "metrics.jsonl")
    assert sorted(a) == list(range(1, 19))
    assert 2 in {r["samples"] for r in a.values()}  # the tail step
    np.testing.assert_allclose([a[s]["loss"] for s in a], [b[s]["loss"] for s in a], rtol=1e-5)
    np.testing.assert_allclose([a[s]["grad_norm"] for s in a], [b[s]["grad_norm"] for s in a], rtol=1e-4)
    ck = checkpoint.load_checkpoint(tmp_path / "dist")
    assert ck["run"]["step"] == 18 and ck["sampler"]["batch_size"] == 4

    # resume the 2-process checkpoint in one process (4 devices: the same global step): it continues
    # where the uninterrupted run went
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "last.pt").write_bytes((tmp_path / "dist" / "last.pt").read_bytes())
    rc = cli.main(["--resume", str(tmp_path / "dist"), "--devices", "cpu:4", "--max-steps", "24"])
    assert rc == 0, capsys.readouterr().err
    a = steps(tmp_path / "dist" / "metrics.jsonl")
    assert sorted(a) == list(range(1, 25))
    np.testing.assert_allclose([a[s]["loss"] for s in range(19, 25)], [b[s]["loss"] for s in range(19, 25)],
                               rtol=1e-4)

    # and with another global step size (1 process x 2 devices): the rest of epoch 2 uses every
    # sample not yet seen, once
    rc = cli.main(["--resume", str(tmp_path / "copy"), "--devices", "cpu:2", "--epochs", "2", "--metrics",
                   str(tmp_path / "copy" / "m.jsonl")])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "written with 4 samples per step, this run has 2: the rest of epoch 2 (23 steps)" in err
    assert sum(r["samples"] for r in steps(tmp_path / "copy" / "m.jsonl").values()) == 58 - 3 * 4
    ck = checkpoint.load_checkpoint(tmp_path / "copy")
    assert ck["run"]["step"] == 18 + 23 and ck["sampler"]["epoch"] == 2 and ck["sampler"]["batch_size"] == 2


def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step(tmp_path):
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "vlseq_ext", "--devices", "cpu:2",
           *SMALL, "--max-steps", "100000", "--checkpoint-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=base_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 20):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every worker
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert err.count("stopped by SIGTERM after step") == 1, err[-3000:]
    from vlseq_ext import checkpoint
    ck = checkpoint.load_checkpoint(tmp_path)
    assert max(steps(metrics)) == ck["run"]["step"] == ck["trainer"]["global_step"] >= 20


def test_distributed_check_runs_on_cpu(tmp_path):
    """benchmarks/distributed_check.py in its CPU mode (torchrun 2 processes x 1 CPU device, gloo, against
    1 process x 2): the script behind the 2-GPU check runs end to end, and both modes agree step by step."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "distributed_check.py"), "--out", str(tmp_path),
                          "--iters", "2", "--repeats", "1", "--timeout", str(LAUNCH_TIMEOUT_S)],
                         env=base_env(VLSEQ_CHECK_CPU=1), cwd=tmp_path, capture_output=True, text=True,
                         timeout=3 * LAUNCH_TIMEOUT_S)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["check"]) == {"k1", "k32"} and all(c["ok"] for c in results["check"].values()), results
    assert results["w2"]["dist"]["processes"] == 2 and results["w2"]["single"]["devices_per_process"] == 2
    assert all(results["w2"][mode]["samples_per_s"] > 0 for mode in ("single", "dist"))
    assert "| k1 | 6 |" in res.stdout and "gloo all-reduce" in res.stdout


@pytest.mark.requires_2gpu
def test_nccl_two_processes_match_one_process_on_two_gpus(tmp_path):
    """On 2 GPUs: torchrun 2 processes x 1 GPU (NCCL) against 1 process x 2 GPUs, step by step
    (rtol 1e-5), k=1 and k=32, with tails (benchmarks/distributed_check.py; its W2 timing is short here)."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "distributed_check.py"), "--out", str(tmp_path),
                          "--iters", "5", "--repeats", "1", "--timeout", "400"],
                         env=base_env(NCCL_NVLS_ENABLE=0), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = json.loads((tmp_path / "results.json").read_text())["check"]
    assert all(c["ok"] for c in checks.values()), checks


# ------------------------------------------------------------------------------------------------
# in-process tests: sharding, the sampler, configuration


def test_lpt_shard_splits_every_global_step_into_balanced_disjoint_shares():
    from vlseq_ext.training.scheduling import lpt_shard

    rng = np.random.default_rng(0)
    for n in (12, 11, 5, 1):
        lengths = rng.integers(1, 500, n).tolist()
        shares = [lpt_shard(lengths, r, 3, 2, 2) for r in range(3)]
        assert sorted(i for s in shares for i in s) == list(range(n))
        assert all(len(s) <= 4 for s in shares)
        if n == 12:
            loads = [sum(lengths[i] for i in s) for s in shares]
            assert max(loads) - min(loads) <= max(lengths)
    assert lpt_shard([7], 1, 2, 1, 1) == []  # a one-sample tail: rank 1 has nothing
    with pytest.raises(ValueError, match="at most 4 samples"):
        lpt_shard([1] * 5, 0, 2, 1, 2)


def test_distributed_sampler_uses_every_sample_once_per_epoch():
    from vlseq_ext.data.samplers import DistributedLengthSampler, LengthBucketSampler
    from vlseq_ext.training.scheduling import lpt_shard

    lengths = np.random.default_rng(1).integers(5, 300, 101)
    samplers = [DistributedLengthSampler(lengths, 2, 2, 3, seed=4, bucket_batches=3) for r in range(3)]
    plain = LengthBucketSampler(lengths, 12, seed=4, bucket_batches=3)
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        plain.set_epoch(epoch)
        got = []
        for batches in zip(*samplers, plain):
            assert all(b == batches[-1] for b in batches[:-1])  # the same global step on every rank
            shares = [[b[i] for i in lpt_shard(lengths[b].tolist(), r, 3, 2, 2)] for r, b in enumerate(batches[:3])]
            assert sorted(i for sh in shares for i in sh) == sorted(batches[-1])
            got += [i for sh in shares for i in sh]
        assert sorted(got) == list(range(101)) and len(samplers[0]) == 9
    single = DistributedLengthSampler(lengths, 3, 2, seed=4)  # one process: LengthBucketSampler(6)
    assert single.batches(0) == LengthBucketSampler(lengths, 6, seed=4).batches(0)


def test_sampler_state_resumes_with_another_step_size():
    from vlseq_ext.data.samplers import DistributedLengthSampler, LengthBucketSampler

    lengths = np.random.default_rng(2).integers(5, 300, 57)
    a = DistributedLengthSampler(lengths, 2, 1, 2, seed=1)  # global steps of 4
    it = iter(a)
    seen = [i for _ in range(5) for i in next(it)]
    b = DistributedLengthSampler(lengths, 3, 2, seed=1)  # 1 process x 2 devices x 3: steps of 6
    b.load_state_dict(a.state_dict())
    it = iter(b)
    seen += [i for _ in range(3) for i in next(it)]
    c = DistributedLengthSampler(lengths, 1, 1, 4, seed=1)  # again steps of 4, another resize
    c.load_state_dict(b.state_dict())
    assert c.state_dict()["resized"] == [[4, 5], [6, 3]] and c.position == 0
    rest = list(c)
    seen += [i for bt in rest for i in bt]
    assert sorted(seen) == list(range(57))  # every sample once in the interrupted epoch
    assert all(len(bt) == 4 for bt in rest[:-1]) and len(c) == len(rest)
    again = DistributedLengthSampler(lengths, 1, 1, 4, seed=1)  # a checkpoint taken there resumes exactly
    again.load_state_dict({**c.state_dict(), "position": 2})
    assert list(again) == rest[2:]
    c.set_epoch(1)  # later epochs follow the new size, as a fresh run would
    assert c.batches(1) == LengthBucketSampler(lengths, 4, seed=1).batches(1) and "resized" not in c.state_dict()
    with pytest.raises(ValueError, match="num_samples"):
        c.load_state_dict({**c.state_dict(), "num_samples": 3})


def test_single_process_configuration(monkeypatch):
    from vlseq_ext import ParallelTrainer, SeqModel, distributed, env

    for k in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", env.DIST_TIMEOUT):
        monkeypatch.delenv(k, raising=False)
    model = SeqModel(3, 4, 1)
    tr = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=["cpu"])
    assert type(tr.group) is distributed.ProcessGroup and (tr.group.rank, tr.group.world_size) == (0, 1)
    with pytest.raises(ValueError, match="empty step"):  # only a rank of several may have no sample
        tr.step([], [])
    with pytest.raises(ValueError, match="process_group must be"):
        ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=["cpu"],
                        process_group="nccl")
    alone = distributed.start()
    assert type(alone) is distributed.ProcessGroup and alone.stop_agreed(True) and not alone.stop_agreed(False)
    assert env.dist_timeout().total_seconds() == env.DEFAULT_DIST_TIMEOUT_S
    monkeypatch.setenv(env.DIST_TIMEOUT, "2.5")
    assert env.dist_timeout().total_seconds() == 2.5
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(distributed.DistributedError, match="RANK, MASTER_ADDR, MASTER_PORT not set"):
        distributed.start()
    monkeypatch.setenv(env.DIST_TIMEOUT, "soon")
    with pytest.raises(distributed.DistributedError, match="VLSEQ_DIST_TIMEOUT='soon'"):
        distributed.start()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(distributed.DistributedError, match="WORLD_SIZE='two' is not an integer"):
        distributed.start()
    monkeypatch.delenv("WORLD_SIZE")
    from vlseq_ext.devices import local_share
    from vlseq_ext.training.scheduling import sample_length

    assert local_share() is None  # one process per machine: every GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    if not torch.cuda.is_available():
        assert local_share() == [torch.device("cpu")]
    assert sample_length(torch.zeros(1, 7, 3)) == sample_length(np.zeros((7, 3))) == 7


# ------------------------------------------------------------------------------------------------
# worker entry point

if __name__ == "__main__":
    torch.set_num_threads(1)
    name, out_dir = sys.argv[1], Path(sys.argv[2])
    try:
        SCENARIOS[name](out_dir)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
