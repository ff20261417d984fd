"""vlseq-train end to end on CPU (two CPU replicas): the demo, metrics and plot, exact resume,
crash-safe checkpoints, signals, non-finite steps, a diverging run, the summary and the plot, and
JapaneseVowels through aeon."""
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from vlseq_ext import checkpoint, data, files
from vlseq_ext.cli.config import build_parser
from vlseq_ext.cli.reporting import write_plot

from cli_helpers import HAS_MPL, SMALL, cmd, needs_aeon, needs_mpl, run, steps, subprocess_env

def test_demo_loss_falls_and_writes_metrics_and_plot(tmp_path, capsys):
    # The default model (LSTM 36 -> 64 -> 1) on the default synthetic data, cut short: 200 steps of
    # 2 samples, just over an epoch of 360 training samples.
    rc, out, err = run(capsys, "--devices", "cpu:2", "--max-steps", 200, "--synthetic-samples", 400,
                       "--lr", 3e-3, "--checkpoint-dir", tmp_path / "run", "--quiet")
    assert rc == 0, err
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recs = {r["step"]: r for r in lines if r["type"] == "step"}
    assert sorted(recs) == list(range(1, 201))
    loss = [recs[s]["loss"] for s in range(1, 201)]
    assert np.mean(loss[-40:]) < 0.6 * np.mean(loss[:40])  # observed: 0.40x
    assert all(recs[s]["grad_norm"] > 0 and recs[s]["samples"] == 2 for s in recs)
    assert {"samples_per_s", "skipped_steps", "epoch", "lr", "time"} <= set(recs[1])
    epoch = [r for r in lines if r["type"] == "epoch"]
    assert len(epoch) == 1 and epoch[0]["step"] == 180
    assert {"train_loss", "val_loss", "grad_norm", "samples_per_s", "skipped_steps"} <= set(epoch[0])
    final = [r for r in lines if r["type"] == "val"]
    assert len(final) == 1 and final[0]["step"] == 200 and final[0]["val_loss"] < 0.5  # the target's variance is ~1
    if HAS_MPL:
        assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "skipped: matplotlib is not installed" in out and not (tmp_path / "run" / "loss.png").exists()
    assert "vlseq-train summary" in out and "LSTM(36 -> 64) + Linear(64 -> 1), 26,177 parameters" in out
    assert re.search(r"warm-up +(none \(no CUDA graphs on this device\)|[0-9.]+ s of first runs and captures)", out)
    assert checkpoint.load_checkpoint(tmp_path / "run")["run"]["step"] == 200


def test_resume_repeats_the_uninterrupted_losses_exactly(tmp_path, capsys):
    # 40 steps cross the epoch boundary (29 steps per epoch); the resumed run stops twice on the way.
    common = [*SMALL, "--deterministic", "--metrics"]
    rc, _, err = run(capsys, *common, tmp_path / "straight.jsonl", "--max-steps", 40,
                     "--checkpoint-dir", tmp_path / "a", *(["--plot", tmp_path / "a.png"] if HAS_MPL else []))
    assert rc == 0, err
    rc, _, err = run(capsys, *common, tmp_path / "resumed.jsonl", "--max-steps", 10, "--checkpoint-dir", tmp_path / "b")
    assert rc == 0, err
    rc, _, err = run(capsys, "--resume", tmp_path / "b", "--max-steps", 33, "--checkpoint-every", 4)
    assert rc == 0 and "resuming at step 10" in err, err
    # a crash after the step-32 checkpoint: the metrics of step 33 must not survive the resume
    ck = checkpoint.load_checkpoint(tmp_path / "b")
    assert ck["run"]["step"] == 33
    rc, _, err = run(capsys, "--resume", tmp_path / "b", "--max-steps", 40)
    assert rc == 0, err
    a, b = steps(tmp_path / "straight.jsonl"), steps(tmp_path / "resumed.jsonl")
    assert sorted(b) == list(range(1, 41))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]
    assert [a[s]["grad_norm"] for s in a] == [b[s]["grad_norm"] for s in a]
    ea = [r for r in map(json.loads, (tmp_path / "straight.jsonl").read_text().splitlines()) if r["type"] == "epoch"]
    eb = [r for r in map(json.loads, (tmp_path / "resumed.jsonl").read_text().splitlines()) if r["type"] == "epoch"]
    key = ("train_loss", "val_loss", "grad_norm", "grad_norm_max")
    assert [[r[k] for k in key] for r in ea] == [[r[k] for k in key] for r in eb] and len(ea) == 1
    # a finished run has nothing left to do
    rc, _, err = run(capsys, "--resume", tmp_path / "b")
    assert rc == 0 and "nothing to do: the run is at step 40 after 1 epoch (--max-steps 40); raise --max-steps" in err


def test_checkpoint_is_atomic_and_loads_weights_only(tmp_path, monkeypatch):
    path = tmp_path / "ck" / "last.pt"
    checkpoint.save_checkpoint({"w": torch.arange(3), "meta": {"step": 1, "names": ["a", None]}}, path)

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint({"w": torch.zeros(5)}, path)
    assert torch.equal(checkpoint.load_checkpoint(path.parent)["w"], torch.arange(3))
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # the temporary file is gone


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.standard_normal(), torch.rand(1)
    state = checkpoint.capture_rng_state()
    before = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    # survives the weights_only loader
    state = checkpoint.load_checkpoint(checkpoint.save_checkpoint({"rng": state}, tmp_path / "rng.pt"))["rng"]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.restore_rng_state(state)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == before


def test_rng_state_of_a_cpu_process_leaves_cuda_uninitialized():
    """A process that never used CUDA saves no CUDA generator and does not initialize CUDA to read them (on a
    GPU machine that would create a context on every GPU, in the middle of a CPU run's first checkpoint)."""
    code = ("import torch; from vlseq_ext import checkpoint; s = checkpoint.capture_rng_state(); "
            "print(len(s['cuda']), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "False"], out.stderr


@pytest.mark.requires_cuda
def test_rng_state_round_trip_of_cuda_generators(tmp_path):
    """Once CUDA is in use every device's generator is saved and restored with the others."""
    torch.cuda.manual_seed_all(3)
    torch.rand(1, device="cuda")
    state = checkpoint.capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    before = torch.rand(3, device="cuda").tolist()
    state = checkpoint.load_checkpoint(checkpoint.save_checkpoint({"rng": state}, tmp_path / "rng.pt"))["rng"]
    torch.cuda.manual_seed_all(9)
    checkpoint.restore_rng_state(state)
    assert torch.rand(3, device="cuda").tolist() == before


# vlseq-train in a process whose 2nd checkpoint write stops halfway through its temporary file and hangs
# (checkpoint._write_bytes patched here: the shipped package has no test hook).
HANG_IN_SECOND_WRITE = """
import os, sys, time
from vlseq_ext import checkpoint
from vlseq_ext.cli import main
real, calls = checkpoint._write_bytes, []

def hanging(f, data):
    calls.append(1)
    if len(calls) == 2:
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        print("test: hanging in checkpoint write", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)
    real(f, data)

checkpoint._write_bytes = hanging
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, capsys):
    # The 2nd save of the process stops halfway through its temporary file; SIGKILL it there.
    argv = [*SMALL, "--max-steps", 50, "--checkpoint-every", 2, "--checkpoint-dir", tmp_path]
    proc = subprocess.Popen([sys.executable, "-c", HANG_IN_SECOND_WRITE, *map(str, argv)], env=subprocess_env(),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        for line in proc.stderr:
            if "hanging in checkpoint write" in line:
                break
        else:
            pytest.fail("the checkpoint writer never reached the patched write")
        temps = list(tmp_path.glob(".last.pt.*.tmp"))
        assert len(temps) == 1 and temps[0].stat().st_size > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        watchdog.cancel()
        proc.kill()
        proc.stderr.close()
    with pytest.raises(Exception):
        torch.load(temps[0], weights_only=True)  # the torn temporary file really is torn...
    ck = checkpoint.load_checkpoint(tmp_path)  # ...and the previous checkpoint is intact
    assert ck["run"]["step"] == 2 and ck["sampler"]["position"] == 2
    rc, _, err = run(capsys, "--resume", tmp_path, "--max-steps", 4)
    assert rc == 0 and "resuming at step 2" in err, err
    assert checkpoint.load_checkpoint(tmp_path)["run"]["step"] == 4
    assert not list(tmp_path.glob(".last.pt.*.tmp"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_finishes_the_step_saves_and_exits(tmp_path, sig):
    proc = subprocess.Popen(cmd(*SMALL, "--max-steps", 100000, "--checkpoint-dir", tmp_path), env=subprocess_env(),
                            cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    assert rc == 128 + sig, err
    assert f"stopped by {signal.Signals(sig).name}" in err and "--resume" in err and "Traceback" not in err
    ck = checkpoint.load_checkpoint(tmp_path)
    assert max(steps(metrics)) == ck["run"]["step"] == ck["trainer"]["global_step"] >= 3


# ------------------------------------------------------------------------------------------------
# bad input: one line naming the file or sample, exit code 2, no traceback


def test_nonfinite_steps_are_skipped_and_counted(tmp_path, capsys):
    # Finite data whose huge targets overflow the float32 loss: the trainer skips those steps.
    seqs = [np.random.default_rng(i).standard_normal((5, 3)).astype(np.float32) for i in range(8)]
    targets = np.zeros(8, np.float32)
    targets[[1, 5]] = 1e30
    data.save_ragged(tmp_path / "inf.npz", seqs, targets)
    rc, out, err = run(capsys, "--data", tmp_path / "inf.npz", "--devices", "cpu:2", "--hidden", 4, "--val-fraction", 0,
                       "--epochs", 2, "--checkpoint-dir", tmp_path, "--quiet")
    assert rc == 0, err
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    skipped = [r for r in lines if r["type"] == "step" and r["skipped"]]
    assert len(skipped) == 4 and all(r["loss"] is None and r["grad_norm"] is None for r in skipped)
    epochs = [r for r in lines if r["type"] == "epoch"]
    assert [r["skipped_steps"] for r in epochs] == [2, 4] and all(0 < r["train_loss"] < 10 for r in epochs)
    assert "4 skipped as non-finite" in out and "Warning" not in err


def test_console_entry_exit_code_and_help(tmp_path):
    res = subprocess.run(cmd("--data", tmp_path / "nope.npz"), env=subprocess_env(),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr == (f"vlseq-train: error: {tmp_path / 'nope.npz'}: no such file; --data "
                                                  "takes a .npz or .ts file, or one of: synthetic, japanese_vowels\n")
    assert not (tmp_path / "runs").exists()
    helptext = build_parser().format_help()
    for opt in ("--data", "--devices", "--samples-per-device", "--epochs", "--max-steps", "--lr", "--model", "--hidden",
                "--layers", "--task", "--val-fraction", "--seed", "--deterministic", "--amp", "--clip-grad",
                "--checkpoint-dir", "--checkpoint-every", "--resume", "--metrics", "--plot", "--quiet",
                "--drop-nonfinite", "--reduction"):
        assert opt in helptext


@needs_aeon
def test_japanese_vowels_classifier_beats_chance(tmp_path, capsys):
    rc, out, err = run(capsys, "--data", "japanese_vowels", "--devices", "cpu:2", "--hidden", 16, "--epochs", 2,
                       "--lr", 1e-2, "--checkpoint-dir", tmp_path, "--quiet")
    assert rc == 0, err
    epochs = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"]
    assert len(epochs) == 2 and epochs[-1]["val_accuracy"] > 0.4  # chance: 1/9
    assert "val accuracy" in out and "(9 classes)" in err


# ------------------------------------------------------------------------------------------------
# reliability: nothing lost, nothing silently wrong


def test_warnings_are_one_line(tmp_path, capsys):
    np.savez(tmp_path / "big.npz", values=np.full((32, 3), 2**24 + 1, np.int64), offsets=np.arange(0, 33, 4),
             targets=np.zeros((8, 1), np.float32))  # int64 on disk: the loader's cast rounds them
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--data", tmp_path / "big.npz", "--checkpoint-dir", tmp_path / "r")
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "float32" in ln]
    assert lines and all(ln.startswith("vlseq-train: warning: ") for ln in lines), err


def test_a_diverging_run_keeps_its_summary_and_plots_what_is_finite(tmp_path, capsys):
    rc, out, err = run(capsys, *SMALL, "--lr", "1e30", "--max-steps", 30, "--checkpoint-dir", tmp_path)
    assert rc == 0, err
    assert "vlseq-train summary" in out and "skipped as non-finite" in out
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("loss") is None or r.get("val_loss") is None for r in lines)  # it did diverge
    if HAS_MPL:
        assert "non-finite loss value" in out and "not shown" in out and (tmp_path / "loss.png").stat().st_size > 0


@needs_mpl
def test_write_plot_with_non_finite_and_huge_values(tmp_path):
    history = {"step": list(range(1, 9)), "loss": [1.0, 0.5, float("inf"), float("nan"), 3e38, 0.2, 0.1, 0.1],
               "val_step": [4, 8], "val_loss": [float("inf"), 0.3], "val_accuracy": [None, None], "epoch_loss": []}
    note = write_plot(tmp_path / "p.svg", history, "diverging")
    assert note == f"{tmp_path / 'p.svg'} (3 non-finite loss values not shown)" and (tmp_path / "p.svg").exists()
    nothing = {**history, "loss": [float("nan")] * 8, "val_loss": [float("inf")] * 2}
    assert "10 non-finite" in write_plot(tmp_path / "q.png", nothing, "all bad")


def test_a_failing_plot_is_one_line_of_the_summary(tmp_path, capsys, monkeypatch):
    from vlseq_ext.cli import train as train_mod

    def broken(path, history, title):
        raise ValueError("Axis limits cannot be NaN or Inf\nmore")

    monkeypatch.setattr(train_mod, "write_plot", broken)
    monkeypatch.setattr(train_mod, "matplotlib_available", lambda: True)
    rc, out, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path)
    assert rc == 0, err
    assert "plot                            not written: ValueError: Axis limits cannot be NaN or Inf\n" in out


def test_ctrl_c_during_the_final_plot_tells_the_truth(tmp_path, capsys, monkeypatch):
    from vlseq_ext.cli import train as train_mod

    def interrupted(path, history, title):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "write_plot", interrupted)
    monkeypatch.setattr(train_mod, "matplotlib_available", lambda: True)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path)
    assert rc == 130 and f"interrupted: exiting at once; the checkpoint of step 2 is in {tmp_path / 'last.pt'}" in err
    assert "without saving" not in err and checkpoint.load_checkpoint(tmp_path)["run"]["step"] == 2


def test_the_run_configuration_is_one_typed_record():
    """Every option of vlseq-train is a RunConfig field: the parser, the saved configuration, what a
    resume keeps and what the trainer gets all come from it."""
    import dataclasses

    from vlseq_ext.cli.config import RunConfig
    from vlseq_ext.training.options import TrainerOptions

    flags = {a.dest for a in build_parser()._actions}
    assert {f.name for f in RunConfig.options()} | {"resume", "overwrite", "help", "version"} == flags
    assert set(RunConfig.fixed_on_resume()) == {"model", "hidden", "layers", "task", "seed", "val_fraction",
                                                "synthetic_samples"}
    config = RunConfig(clip_grad=0.5, amp="bf16", samples_per_device=4)
    given = config.trainer_options()
    assert {k: given[k] for k in ("samples_per_device", "reduction", "clip_grad_norm", "amp")} == {
        "samples_per_device": 4, "reduction": "mean", "clip_grad_norm": 0.5, "amp": "bf16"}
    TrainerOptions.from_keywords(given)  # every name is one the trainer knows
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    saved = {**config.saved(), "a_field_of_a_later_version": 1}
    assert RunConfig(**RunConfig.from_saved(saved)) == config and "run_id" in config.saved()
    assert build_parser().parse_args(["--amp", "none", "--epochs", "2"]).epochs == 2
