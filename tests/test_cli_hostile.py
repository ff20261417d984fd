"""Hostile input, round 3 (issue 24): every path flag of both commands, streams behind redirects, a
run's explicit files held as its folder is, device counts, and the messages that were unclear: one
true line each (exit 2), and nothing lost."""
import json
import os
import subprocess
import threading

import numpy as np
import pytest

from vlseq_ext import data, files
from vlseq_ext.cli import checks, predict
from vlseq_ext.cli.config import build_parser
from vlseq_ext.cli.locks import RunLock
from vlseq_ext.cli.resolve import resolve

from cli_helpers import HAS_MPL, SMALL, cmd, needs_mpl, one_line_error, run, steps, subprocess_env

TRAIN_PATHS = ("--data", "--checkpoint-dir", "--metrics", "--plot", "--resume")
PREDICT_PATHS = ("--checkpoint", "--data", "--out", "--metrics")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run and a data file of its shape, to predict on."""
    root = tmp_path_factory.mktemp("hostile")
    data.save_ragged(root / "d.npz", [np.ones((n, 3), np.float32) for n in (3, 5, 4, 6)],
                     np.zeros((4, 1), np.float32))
    from vlseq_ext import cli
    assert cli.main([*SMALL, "--data", str(root / "d.npz"), "--val-fraction", "0", "--max-steps", "1",
                     "--checkpoint-dir", str(root / "run")]) == 0
    return root


def unusable(tmp_path, problem, flag):
    """A path of this kind for `flag`: a name over 255 bytes, a symbolic link loop, or a path through
    a symbolic link to nothing."""
    ext = {"--plot": ".png", "--out": ".csv", "--data": ".npz"}.get(flag, "")
    if problem == "long":
        return tmp_path / ("n" * 300 + ext), "a name in it is 30"
    if problem == "loop":
        (tmp_path / f"a{ext}").symlink_to(tmp_path / f"b{ext}")
        (tmp_path / f"b{ext}").symlink_to(tmp_path / f"a{ext}")
        return tmp_path / f"a{ext}", "is a symbolic link loop: repair the link"
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    return tmp_path / "gone" / f"x{ext}", "goes through " + str(tmp_path / "gone") + ", a symbolic link to"


@pytest.mark.parametrize("problem", ["long", "loop", "dangling"])
@pytest.mark.parametrize("command,flag", [("train", f) for f in TRAIN_PATHS] + [("predict", f) for f in PREDICT_PATHS])
def test_every_path_flag_names_an_unusable_path_in_one_line(trained, tmp_path, capsys, command, flag, problem):
    # Before: a name over 255 bytes was a traceback in every flag but one; a link loop or a link to
    # nothing given as the run folder read "File exists".
    path, expect = unusable(tmp_path, problem, flag)
    before = sorted(os.listdir(tmp_path))
    if command == "train":
        argv = {"--data": str(trained / "d.npz"), "--checkpoint-dir": str(tmp_path / "run"), flag: str(path)}
        if flag == "--resume":
            argv.pop("--checkpoint-dir")
        rc, _, err = run(capsys, *SMALL, "--max-steps", 1, *[x for kv in argv.items() for x in kv])
        one_line_error(rc, err, f"{flag} {path}: {expect}")
    else:
        argv = {"--checkpoint": str(trained / "run"), "--data": str(trained / "d.npz"),
                "--out": str(tmp_path / "p.csv"), flag: str(path)}
        rc = predict.main([x for kv in argv.items() for x in kv] + ["--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"vlseq-predict: error: {flag} {path}: {expect}"), err
    assert sorted(os.listdir(tmp_path)) == before


@needs_mpl
def test_outputs_on_redirected_standard_streams_stay_whole(tmp_path):
    """--metrics /dev/stdout > out.txt and --plot /dev/stderr 2> err.bin: opened anew, each had an offset of
    its own, and the run's own printing there (the summary, the start lines) wrote over the first records
    and the PNG header. Written through the process's own descriptors, everything follows in order."""
    with open(tmp_path / "out.txt", "wb") as out, open(tmp_path / "err.bin", "wb") as err:
        rc = subprocess.run(cmd(*SMALL, "--max-steps", 3, "--checkpoint-dir", tmp_path / "run", "--metrics",
                                "/dev/stdout", "--plot", "/dev/stderr"), stdout=out, stderr=err,
                            env=subprocess_env(), timeout=600).returncode  # (a hang guard)
    text, raw = (tmp_path / "out.txt").read_text(), (tmp_path / "err.bin").read_bytes()
    assert rc == 0, raw[-2000:]
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3]
    assert text.index("vlseq-train summary") > text.rindex('"type": ')
    assert raw.startswith(b"vlseq-train: ") and raw.index(b"\x89PNG\r\n\x1a\n") < raw.index(b"IEND")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["last.pt"]


def test_a_fifo_without_a_reader_is_waited_for_with_a_warning(tmp_path, capsys, monkeypatch):
    # before: the run waited in silence for someone to read its --metrics FIFO
    fifo = tmp_path / "m.fifo"
    os.mkfifo(fifo)
    got, readers, real = [], [], files.warnings.warn

    def warn_then_read(message, *args, **kwargs):
        real(message, *args, **kwargs)
        if "FIFO" in str(message):  # the reader comes once the run said it waits for one
            readers.append(threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True))
            readers[-1].start()

    monkeypatch.setattr(files.warnings, "warn", warn_then_read)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "run", "--metrics", fifo)
    assert rc == 0, err
    assert f"vlseq-train: warning: vlseq_ext: {fifo} is a FIFO that nothing reads yet: waiting for a reader" in err
    assert len(readers) == 1
    readers[0].join(600)  # (a hang guard)
    assert [json.loads(x)["step"] for x in got[0].decode().splitlines() if json.loads(x)["type"] == "step"] == [1, 2]


def test_a_binary_plot_to_a_terminal_is_refused(tmp_path, capsys):
    master, slave = os.openpty()
    try:
        plot = f"/dev/fd/{slave}"
        rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", "--plot", plot)
        one_line_error(rc, err, f"--plot {plot} is a terminal, and a png plot is binary: redirect it to a file")
    finally:
        os.close(master), os.close(slave)
    assert not (tmp_path / "run").exists()


def test_vlseq_predict_appends_to_a_stream_without_overwrite(trained, capsys):
    # before: "--out /dev/null already exists: pass --overwrite to replace it"
    rc = predict.main(["--checkpoint", str(trained / "run"), "--data", str(trained / "d.npz"), "--out", "/dev/null",
                       "--quiet"])
    assert rc == 0, capsys.readouterr().err


def test_a_live_runs_files_are_its_own(trained, tmp_path, capsys):
    """A live run holds its output files as it holds its folder: another run may not write them, given by
    name or found in the live run's folder, --overwrite or not (before: --metrics on a live run's metrics
    file with --overwrite left it with NUL bytes and mixed records, and the live run could not resume)."""
    live_dir, metrics = tmp_path / "live", tmp_path / "live.jsonl"
    metrics.write_text('{"type": "step", "step": 1}\n')
    live = RunLock(live_dir, outputs=[("--metrics", metrics), ("--plot", live_dir / "loss.png")])
    (live_dir / "metrics.jsonl").write_text("the live run's folder\n")
    try:
        for flag, path in (("--metrics", metrics), ("--plot", live_dir / "loss.png")):
            rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "other", flag, path,
                             "--overwrite")
            one_line_error(rc, err, f"{flag} {path}: another vlseq-train run is writing this file now")
        rc = predict.main(["--checkpoint", str(trained / "run"), "--data", str(trained / "d.npz"), "--out",
                           str(tmp_path / "p.csv"), "--metrics", str(metrics), "--overwrite"])  # (it holds nothing)
        assert rc == 2 and f"--metrics {metrics}: another vlseq-train run is writing" in capsys.readouterr().err
        assert metrics.read_text() == '{"type": "step", "step": 1}\n' and (live_dir / "loss.png").read_bytes() == b""
    finally:
        live.release()
    assert sorted(os.listdir(live_dir)) == ["metrics.jsonl"]  # the empty plot it held is gone with it
    assert sorted(os.listdir(tmp_path)) == ["live", "live.jsonl"]


def test_two_runs_started_together_never_share_a_file(tmp_path, capsys):
    """Both used to pass the "exists" check and wrote torn, interleaved records. The file rules that read
    the outputs now run under the lock, so the second run meets the first one's lock, or, once that
    run is done, its records."""
    shared = tmp_path / "m.jsonl"
    argv = [*SMALL, "--max-steps", 1, "--metrics", shared]
    first = resolve(build_parser().parse_args([str(a) for a in argv + ["--checkpoint-dir", tmp_path / "a"]]))
    try:
        rc, _, err = run(capsys, *argv, "--checkpoint-dir", tmp_path / "b")
        one_line_error(rc, err, f"--metrics {shared}: another vlseq-train run is writing this file now")
    finally:
        first.lock.release()
    assert not shared.exists() and not (tmp_path / "b").exists()
    rc, _, err = run(capsys, *argv, "--checkpoint-dir", tmp_path / "a")
    assert rc == 0, err
    rc, _, err = run(capsys, *argv, "--checkpoint-dir", tmp_path / "b")
    one_line_error(rc, err, f"--metrics {shared} already exists")


def test_no_output_replaces_a_checkpoint_and_no_advice_leads_there(trained, tmp_path, capsys):
    """--metrics on another run's last.pt was refused with advice to pass --overwrite, which then turned
    the checkpoint into JSON lines. Neither a checkpoint nor the metrics a run resumes into is replaced
    by another output, and no message advises it."""
    run_dir = trained / "run"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    for argv, expect in (
            (["--metrics", run_dir / "last.pt"], "holds a checkpoint, which no other output replaces"),
            (["--metrics", run_dir / "metrics.jsonl"], f"is the metrics file of the run in {run_dir}"),
            (["--resume", run_dir, "--checkpoint-dir", tmp_path / "fork", "--metrics", run_dir / "metrics.jsonl"],
             f"is the metrics file of the run in {run_dir}")):
        for extra in ([], ["--overwrite"]) if "--resume" not in argv else ([],):
            rc, _, err = run(capsys, *SMALL, "--max-steps", 3, "--checkpoint-dir", tmp_path / "new", *argv, *extra)
            one_line_error(rc, err, expect, "choose another --metrics file")
            assert "pass --overwrite" not in err
    keep = tmp_path / "keep"
    keep.mkdir()
    for name in ("copy.pt", "copy.csv"):  # (whatever its name says)
        (keep / name).write_bytes(before["last.pt"])
    for flag, name in (("--out", "copy.csv"), ("--metrics", "copy.pt")):
        argv = {"--out": str(tmp_path / "p.csv"), flag: str(keep / name)}
        rc = predict.main(["--checkpoint", str(run_dir), "--data", str(trained / "d.npz"), "--overwrite",
                           *[x for kv in argv.items() for x in kv]])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag} {keep / name} holds a checkpoint, which" in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["keep"]
    assert {p.read_bytes() for p in keep.iterdir()} == {before["last.pt"]}


def test_a_fork_refusal_names_the_flag_at_fault(trained, tmp_path, capsys):
    # before: "--checkpoint-dir F already holds files of another run (notes.jsonl)", about a --metrics file
    notes = tmp_path / "notes.jsonl"
    notes.write_text("mine\n")
    rc, _, err = run(capsys, "--resume", trained / "run", "--checkpoint-dir", tmp_path / "F", "--metrics", notes,
                     "--max-steps", 3)
    one_line_error(rc, err, f"--metrics {notes} already exists, and a fork starts its own metrics file: choose "
                            "another --metrics file")
    assert sorted(os.listdir(tmp_path)) == ["notes.jsonl"] and notes.read_text() == "mine\n"


def test_a_renamed_run_folder_resumes_where_it_is_now(tmp_path, capsys):
    """Outputs given inside the run folder move with it: a resume of the renamed folder recreated the old
    one for them, splitting the run's history in two places."""
    old, new = tmp_path / "Q", tmp_path / "Q2"
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", old, "--metrics", old / "m.jsonl",
                     "--plot", old / "curve.svg", "--val-fraction", 0)
    assert rc == 0, err
    old.rename(new)
    rc, _, err = run(capsys, "--resume", new, "--max-steps", 3)
    assert rc == 0, err
    assert not old.exists() and sorted(steps(new / "m.jsonl")) == [1, 2, 3]
    assert sorted(os.listdir(new)) == ["curve.svg", "last.pt", "m.jsonl"] or not HAS_MPL


def test_a_device_count_that_cannot_fit_is_refused_at_once(trained, tmp_path, capsys, monkeypatch):
    # --devices cpu:1000000 copied the model for minutes, eating memory, without a word
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", "--devices", "cpu:1000000")
    one_line_error(rc, err, "--devices cpu:1000000: 1000000 CPU replicas; give 1 to 1024")
    rc = predict.main(["--checkpoint", str(trained / "run"), "--data", str(trained / "d.npz"), "--out",
                       str(tmp_path / "p.csv"), "--devices", "cpu:1000000"])
    assert rc == 2 and "--devices cpu:1000000: 1000000 CPU replicas" in capsys.readouterr().err
    monkeypatch.setattr(checks, "physical_memory", lambda: 10 ** 7)
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", "--devices", "cpu:1000")
    one_line_error(rc, err, "--devices cpu:1000: 1000 CPU replicas of a model of 1,481 parameters need about 11.9 MB "
                            "of memory, this machine has 10.0 MB: give fewer replicas")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_descriptor_that_cannot_be_written_is_refused_up_front(tmp_path, capsys):
    # a closed one read "--metrics folder /dev/fd: cannot write there"; one open for reading failed in training
    (tmp_path / "in.txt").write_text("x")
    reading = os.open(tmp_path / "in.txt", os.O_RDONLY)
    closed = os.dup(reading)
    os.close(closed)
    try:
        for fd, expect in ((closed, f"descriptor {closed} is not open: open it for writing ({closed}> FILE in the "
                                    "shell), or give a file name"),
                           (reading, f"descriptor {reading} is open for reading only")):
            rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run",
                             "--metrics", f"/dev/fd/{fd}")
            one_line_error(rc, err, f"--metrics /dev/fd/{fd}: {expect}")
    finally:
        os.close(reading)
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]


def test_a_name_with_a_newline_or_an_escape_stays_on_one_line(trained, tmp_path, capsys):
    # the refusal of such a path printed it raw: two lines, or a terminal escape sequence
    name = str(tmp_path / "d\n\x1b[31m.npz")
    rc, _, err = run(capsys, *SMALL, "--data", name, "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, f"{tmp_path}/d\\n\\x1b[31m.npz: no such file")
    rc = predict.main(["--checkpoint", str(trained / "run"), "--data", name, "--out", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "\x1b" not in err and "d\\n\\x1b[31m.npz" in err, err


def test_a_link_never_leads_a_run_into_another_runs_files(trained, tmp_path, capsys):
    """A last.pt that links to another run's checkpoint was written through by the resume, into a folder
    the run does not hold; a metrics.jsonl linking to another run's metrics was rewritten under --overwrite."""
    other = trained / "run"
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    (tmp_path / "R").mkdir()
    (tmp_path / "R" / "last.pt").symlink_to(other / "last.pt")
    rc, _, err = run(capsys, "--resume", tmp_path / "R", "--max-steps", 3)
    one_line_error(rc, err, f"--checkpoint-dir {tmp_path / 'R'}: last.pt there is a symbolic link (to {other}",
                   "replace the link by a copy")
    (tmp_path / "M").mkdir()
    (tmp_path / "M" / "metrics.jsonl").symlink_to(other / "metrics.jsonl")
    rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "M", "--overwrite")
    one_line_error(rc, err, f"is the metrics file of the run in {other}")
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before


def test_an_output_where_a_standard_stream_goes_is_refused(tmp_path, capsys):
    # --metrics log.txt > log.txt: the run's printing and its records wrote over each other
    log = tmp_path / "log.txt"
    log.write_text("")
    saved = os.dup(1)
    try:
        fd = os.open(log, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
        rc, _, err = run(capsys, *SMALL, "--max-steps", 1, "--checkpoint-dir", tmp_path / "run", "--metrics", log)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    one_line_error(rc, err, f"--metrics {log} is the standard output's file: choose another file")
    assert sorted(os.listdir(tmp_path)) == ["log.txt"]
