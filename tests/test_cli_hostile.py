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
from vlseq_ext.cli import predict

from cli_helpers import SMALL, cmd, needs_mpl, one_line_error, run, subprocess_env

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
        argv = {"--checkpoint": str(trained / "run"), "--data": str(trained / "d.npz"), "--out": str(tmp_path / "p.csv"),
                flag: str(path)}
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
