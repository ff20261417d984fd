"""vlseq-train's files (the file rules of docs/design.md, cli/file_rules.py): a new run never replaces
an old run's files, a resume or fork only its own, outputs are written where they can be and never
over an input, a live run's folder is its own, and a full disk keeps what was there."""
import errno
import json
import os
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vlseq_ext import checkpoint, data
from vlseq_ext.cli.config import build_parser
from vlseq_ext.cli.metrics import open_metrics
from vlseq_ext.cli.resolve import resolve

from cli_helpers import HAS_MPL, SMALL, needs_mpl, one_line_error, run, snapshot, steps

def test_resume_drops_metrics_written_after_the_checkpoint(tmp_path, capsys):
    rc, _, err = run(capsys, *SMALL, "--max-steps", 6, "--checkpoint-dir", tmp_path)
    assert rc == 0, err
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"type": "step", "step": 7, "tor')  # a line torn by a crash
    open_metrics(metrics, 4).close()  # as a resume from a step-4 checkpoint does
    assert sorted(steps(metrics)) == [1, 2, 3, 4]


def test_a_new_run_refuses_a_folder_that_holds_a_run(tmp_path, capsys):
    run_dir = tmp_path / "old"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", run_dir)
    assert rc == 0, err
    before = snapshot(run_dir)
    rc, out, err = run(capsys, *SMALL, "--max-steps", 4, "--checkpoint-dir", run_dir)
    one_line_error(rc, err, f"--checkpoint-dir {run_dir} already holds a run", "last.pt", "metrics.jsonl",
                   f"--resume {run_dir}", "another --checkpoint-dir", "--overwrite")
    assert snapshot(run_dir) == before  # byte for byte
    # a folder with only the metrics of an earlier run, and a --metrics file of an earlier run
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "metrics.jsonl").write_bytes(before["metrics.jsonl"])
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "m")
    one_line_error(rc, err, "holds the outputs of a run that saved no checkpoint", "nothing to resume", "--overwrite")
    (tmp_path / "m.jsonl").write_bytes(before["metrics.jsonl"])
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "new",
                     "--metrics", tmp_path / "m.jsonl")
    one_line_error(rc, err, f"--metrics {tmp_path / 'm.jsonl'} already exists", "--overwrite")
    assert snapshot(run_dir) == before and not (tmp_path / "new").exists()
    rc, _, err = run(capsys, "--resume", run_dir, "--overwrite")
    one_line_error(rc, err, "--overwrite starts a new run and --resume continues one")
    # --overwrite: a new run replaces the old one; --resume continues it
    rc, _, err = run(capsys, *SMALL, "--max-steps", 3, "--checkpoint-dir", run_dir, "--overwrite")
    assert rc == 0 and "resuming" not in err, err
    assert checkpoint.load_checkpoint(run_dir)["run"]["step"] == 3 and sorted(steps(run_dir / "metrics.jsonl")) == [1, 2, 3]
    rc, _, err = run(capsys, "--resume", run_dir, "--max-steps", 4)
    assert rc == 0 and "resuming at step 3" in err, err


def test_a_resume_never_replaces_another_run_or_a_later_point(tmp_path, capsys):
    a, b, h = tmp_path / "A", tmp_path / "B", tmp_path / "H"
    for d, steps_ in ((a, 2), (b, 3), (h, 2)):
        rc, _, err = run(capsys, *SMALL, "--max-steps", steps_, "--checkpoint-dir", d)
        assert rc == 0, err
    before = snapshot(b)
    # another run's folder
    rc, _, err = run(capsys, "--resume", a, "--max-steps", 4, "--checkpoint-dir", b)
    one_line_error(rc, err, f"--checkpoint-dir {b} already holds files of another run", "a new --checkpoint-dir")
    assert snapshot(b) == before
    # another run's checkpoint copied into a folder whose last.pt it would replace
    (b / "a.pt").write_bytes((a / "last.pt").read_bytes())
    rc, _, err = run(capsys, "--resume", b / "a.pt", "--max-steps", 4)
    one_line_error(rc, err, f"{b / 'last.pt'} holds another run", "another --checkpoint-dir")
    (b / "a.pt").unlink()
    assert snapshot(b) == before
    # an older copy of this run, resumed into its own folder that holds a later point
    (h / "early.pt").write_bytes((h / "last.pt").read_bytes())
    rc, _, err = run(capsys, "--resume", h, "--max-steps", 4)
    assert rc == 0, err
    later = snapshot(h)
    rc, _, err = run(capsys, "--resume", h / "early.pt", "--max-steps", 3)
    one_line_error(rc, err, "holds step 4 of this run, later than the resumed step 2")
    assert snapshot(h) == later
    # ... while a later copy may continue into a folder holding an earlier point of the same run
    (h / "late.pt").write_bytes((h / "last.pt").read_bytes())
    (h / "last.pt").write_bytes(later["early.pt"])
    rc, _, err = run(capsys, "--resume", h / "late.pt", "--max-steps", 5)
    assert rc == 0 and "resuming at step 4" in err, err


def test_a_fork_leaves_the_original_runs_files_alone(tmp_path, capsys):
    ea, eb = tmp_path / "EA", tmp_path / "EB"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", ea, "--metrics", ea / "m.jsonl",
                     "--plot", ea / "curve.png")
    assert rc == 0, err
    before = snapshot(ea)
    rc, _, err = run(capsys, "--resume", ea, "--checkpoint-dir", eb, "--max-steps", 4)
    assert rc == 0, err
    assert snapshot(ea) == before
    assert sorted(steps(eb / "metrics.jsonl")) == [3, 4] and (eb / "last.pt").exists()


def test_an_overwrite_that_dies_early_leaves_no_old_checkpoint_to_resume(tmp_path, capsys, monkeypatch):
    # The new run emptied the metrics at once but the old last.pt stayed: a resume then continued the
    # old run on top of the new run's metrics.
    c = tmp_path / "C"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", c)
    assert rc == 0, err
    monkeypatch.setattr(checkpoint, "_write_bytes", lambda f, data: (_ for _ in ()).throw(OSError(28, "No space")))
    rc, _, err = run(capsys, *SMALL, "--max-steps", 3, "--checkpoint-dir", c, "--overwrite", "--lr", "0.005")
    assert rc == 2 and "cannot save the checkpoint" in err, err
    monkeypatch.undo()
    assert not (c / "last.pt").exists()
    rc, _, err = run(capsys, "--resume", c, "--max-steps", 4)
    one_line_error(rc, err, "no checkpoint there")


@pytest.mark.parametrize("content", [b"my notes\nimportant results: 0.93\n", b"[1,2]\n", b"\x89PNG\r\n\x1a\n\x00",
                                     b'{"step": "x", "type": "step"}\n'])
def test_a_resume_refuses_to_rewrite_a_file_that_is_not_its_metrics(tmp_path, capsys, content):
    a = tmp_path / "A"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", a)
    assert rc == 0, err
    notes = a / "metrics.jsonl"  # the run's own metrics file, replaced by something else since
    notes.write_bytes(content)
    rc, _, err = run(capsys, "--resume", a, "--max-steps", 3)
    one_line_error(rc, err, f"--metrics {notes} is not a vlseq-train metrics file", "choose another --metrics",
                   during_training=True)
    assert notes.read_bytes() == content


def test_a_resume_appends_to_a_stream_and_never_replaces_it(tmp_path, capsys):
    # os.replace over the path turned /dev/null (a saved --metrics) into a regular file
    fifo_dir = tmp_path / "r"
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", fifo_dir, "--metrics", fifo)
    assert rc == 0, err
    reader.join(30)
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    rc, _, err = run(capsys, "--resume", fifo_dir, "--max-steps", 3)
    assert rc == 0, err
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert [json.loads(x)["step"] for x in got[1].decode().splitlines() if json.loads(x)["type"] == "step"] == [3]


def test_a_resume_from_another_folder_names_the_saved_data_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data.save_ragged("d.npz", [np.ones((5, 3), np.float32)] * 8, np.zeros((8, 1), np.float32))
    rc, _, err = run(capsys, *SMALL, "--data", "d.npz", "--max-steps", 2, "--checkpoint-dir", "r")
    assert rc == 0, err
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, _, err = run(capsys, "--resume", "../r", "--max-steps", 3)
    one_line_error(rc, err, "the run's data d.npz (saved in the checkpoint", "pass --data")
    rc, _, err = run(capsys, "--resume", "../r", "--max-steps", 3, "--data", "../d.npz")
    assert rc == 0 and "resuming at step 2" in err, err


def test_a_checkpoint_path_that_is_a_folder_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "LD" / "last.pt").mkdir(parents=True)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "LD")
    one_line_error(rc, err, "last.pt: is a directory, not a file")


def test_an_overwrite_with_bad_input_keeps_the_old_checkpoint(tmp_path, capsys):
    a = tmp_path / "A"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", a)
    assert rc == 0, err
    before = (a / "last.pt").read_bytes()
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", a, "--overwrite",
                     "--data", tmp_path / "nonexist.npz")
    one_line_error(rc, err, "no such file")
    assert (a / "last.pt").read_bytes() == before


def test_forks_are_runs_of_their_own(tmp_path, capsys):
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", a)
    assert rc == 0, err
    for d, n in ((b, 4), (c, 3)):
        rc, _, err = run(capsys, "--resume", a, "--checkpoint-dir", d, "--max-steps", n)
        assert rc == 0, err
    ids = {d: checkpoint.load_checkpoint(d)["config"]["run_id"] for d in (a, b, c)}
    assert len(set(ids.values())) == 3 and checkpoint.load_checkpoint(c)["config"]["forked_from"] == ids[a]
    before = snapshot(c)
    (c / "fromB.pt").write_bytes((b / "last.pt").read_bytes())
    rc, _, err = run(capsys, "--resume", c / "fromB.pt", "--max-steps", 6)
    one_line_error(rc, err, f"{c / 'last.pt'} holds another run")
    (c / "fromB.pt").unlink()
    assert snapshot(c) == before


def test_a_resume_never_wipes_another_runs_metrics(tmp_path, capsys):
    a, b = tmp_path / "A", tmp_path / "B"
    for d in (a, b):
        rc, _, err = run(capsys, *SMALL, "--max-steps", 3, "--checkpoint-dir", d, "--metrics", d.with_suffix(".jsonl"))
        assert rc == 0, err
    before = b.with_suffix(".jsonl").read_bytes()
    rc, _, err = run(capsys, "--resume", a, "--max-steps", 4, "--metrics", b.with_suffix(".jsonl"))
    one_line_error(rc, err, f"--metrics {b.with_suffix('.jsonl')} already exists and is not this run's metrics file")
    assert b.with_suffix(".jsonl").read_bytes() == before


def test_explicit_outputs_are_found_again_from_another_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", "E", "--metrics", "e.jsonl")
    assert rc == 0, err
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, _, err = run(capsys, "--resume", "../E", "--max-steps", 3)
    assert rc == 0, err
    assert sorted(steps(tmp_path / "e.jsonl")) == [1, 2, 3] and not (tmp_path / "elsewhere" / "e.jsonl").exists()


def test_a_symbolic_link_loop_as_an_output_is_one_line(tmp_path, capsys):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "r",
                     "--metrics", tmp_path / "a.jsonl")
    one_line_error(rc, err, "is a symbolic link loop")


def test_dot_dot_in_output_paths_makes_no_stray_folders(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", "R/sub/..", "--metrics", "other/../m.jsonl")
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["R", "m.jsonl"]
    assert sorted(p.name for p in (tmp_path / "R").iterdir()) == ["last.pt", "loss.png"] or not HAS_MPL


@needs_mpl
def test_dev_null_as_the_plot(tmp_path, capsys):
    # refused before: "no file extension"; a stream is written in place, as png
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "r", "--plot", "/dev/null")
    assert rc == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["last.pt", "metrics.jsonl"]


def test_a_new_run_keeps_an_existing_plot(tmp_path, capsys):
    fig = tmp_path / "fig.png"
    fig.write_bytes(b"the user's figure")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "r", "--plot", fig)
    one_line_error(rc, err, f"--plot {fig} already exists", "--overwrite")
    assert fig.read_bytes() == b"the user's figure"


def test_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "vlseq-20261201-120000")
    args = build_parser().parse_args([*SMALL, "--max-steps", "1"])
    first, second = resolve(args).config, resolve(args).config
    assert first.checkpoint_dir == str(Path("runs/vlseq-20261201-120000"))
    assert second.checkpoint_dir == str(Path("runs/vlseq-20261201-120000-2"))
    assert Path(second.checkpoint_dir).is_dir()


def test_metrics_on_a_full_disk_is_one_line(tmp_path, capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full (Linux only)")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 3, "--checkpoint-dir", tmp_path / "run", "--metrics", "/dev/full")
    one_line_error(rc, err, "cannot write the metrics to /dev/full: No space left on device", during_training=True)
    assert not (tmp_path / "run" / "last.pt").exists()


def test_a_checkpoint_on_a_full_disk_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    real, calls = checkpoint._write_bytes, []

    def full_after_the_first(f, payload):
        calls.append(1)
        if len(calls) > 1:
            f.write(payload[:100])  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, payload)

    monkeypatch.setattr(checkpoint, "_write_bytes", full_after_the_first)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 6, "--checkpoint-every", 2, "--checkpoint-dir", tmp_path)
    one_line_error(rc, err, f"cannot save the checkpoint of step 4 to {tmp_path / 'last.pt'}: No space left on device",
                   "the checkpoint of step 2 there is kept", during_training=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(tmp_path)["run"]["step"] == 2
    rc, _, err = run(capsys, "--resume", tmp_path, "--max-steps", 6)
    assert rc == 0 and "resuming at step 2" in err, err
    assert sorted(steps(tmp_path / "metrics.jsonl")) == list(range(1, 7))


@pytest.mark.parametrize("case", ["file", "under_a_file", "proc", "metrics_dir", "plot_ext", "plot_no_ext"])
def test_impossible_output_paths_are_refused_before_training(tmp_path, capsys, case):
    (tmp_path / "afile").write_text("x")
    argv, expect = {
        "file": (["--checkpoint-dir", tmp_path / "afile"], "is a file, not a directory"),
        "under_a_file": (["--checkpoint-dir", tmp_path / "afile" / "run"],
                         f"cannot be created: {tmp_path / 'afile'} is a file, not a directory"),
        "proc": (["--checkpoint-dir", "/proc/vlseq-test/run"], "--checkpoint-dir /proc/vlseq-test/run: cannot be created"),
        "metrics_dir": (["--checkpoint-dir", tmp_path / "run", "--metrics", tmp_path], "is a directory, not a file"),
        "plot_ext": (["--checkpoint-dir", tmp_path / "run", "--plot", tmp_path / "loss.foo"],
                     "unknown extension .foo (use one of: "),
        "plot_no_ext": (["--checkpoint-dir", tmp_path / "run", "--plot", tmp_path / "loss"], "no file extension"),
    }[case]
    if case.startswith("plot") and not HAS_MPL:
        pytest.skip("matplotlib is not installed (pip install 'vlseq_ext[plot]')")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, *argv)
    one_line_error(rc, err, expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "x"
    assert "png" in err or not case.startswith("plot_ext")


def test_a_run_folder_in_use_by_a_live_run_is_refused(tmp_path, capsys):
    """The same folder twice at once: a second run (with --overwrite too) stops before touching it."""
    from vlseq_ext.cli.locks import RunLock
    live = RunLock(tmp_path / "run")  # another run holds the folder (a separate open file: flock conflicts)
    (tmp_path / "run" / "metrics.jsonl").write_text("the live run's\n")
    try:
        for extra in ([], ["--overwrite"]):  # (the lock comes first: what a live run's files hold may change)
            rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", *extra)
            one_line_error(rc, err, "another vlseq-train run is using this folder now")
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
        assert (tmp_path / "run" / "metrics.jsonl").read_text() == "the live run's\n"
    finally:
        live.release()
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", "--overwrite")
    assert rc == 0, err


def test_a_run_that_fails_after_taking_its_folder_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04 not really a zip")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--data", tmp_path / "bad.npz",
                     "--checkpoint-dir", tmp_path / "a" / "b" / "run")
    one_line_error(rc, err, "cannot read as .npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]


@pytest.mark.parametrize("case", ["metrics_is_data", "metrics_is_data_hardlink", "plot_is_metrics",
                                  "metrics_is_checkpoint", "metrics_is_resumed_checkpoint"])
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, capsys, case):
    """Even with --overwrite, no output may replace the data or checkpoint being read, and two outputs
    of one run never share a file; the refusal changes no file."""
    data.save_ragged(tmp_path / "d.npz", [np.ones((5, 3), np.float32)] * 4, np.zeros((4, 1), np.float32))
    os.link(tmp_path / "d.npz", tmp_path / "same.jsonl")
    ours = ["--data", tmp_path / "d.npz", "--overwrite"]
    if case == "metrics_is_resumed_checkpoint":
        rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "old")
        assert rc == 0, err
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv, expect = {
        "metrics_is_data": ([*ours, "--metrics", tmp_path / "d.npz", "--checkpoint-dir", tmp_path / "r"],
                            f"--metrics {tmp_path / 'd.npz'} is the --data file, which is read"),
        "metrics_is_data_hardlink": ([*ours, "--metrics", tmp_path / "same.jsonl", "--checkpoint-dir", tmp_path / "r"],
                                     "is the --data file, which is read"),
        "plot_is_metrics": (["--metrics", tmp_path / "m.png", "--plot", tmp_path / "m.png",
                             "--checkpoint-dir", tmp_path / "r"], f"--plot {tmp_path / 'm.png'} is the --metrics file"),
        "metrics_is_checkpoint": (["--metrics", tmp_path / "r" / "last.pt", "--checkpoint-dir", tmp_path / "r"],
                                  "--checkpoint-dir " + str(tmp_path / "r" / "last.pt") + " is the --metrics file"),
        "metrics_is_resumed_checkpoint": (["--resume", tmp_path / "old", "--max-steps", 4, "--checkpoint-dir",
                                           tmp_path / "new", "--metrics", tmp_path / "old" / "last.pt"],
                                          "is the --resume file, which is read"),
    }[case]
    if case == "plot_is_metrics" and not HAS_MPL:
        pytest.skip("matplotlib is not installed (pip install 'vlseq_ext[plot]')")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, *argv)
    one_line_error(rc, err, expect)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "r").exists() and not (tmp_path / "new").exists()
