"""Hostile input, round 3 (issue 24): every path flag of both commands, streams behind redirects, a
run's explicit files held as its folder is, device counts, and the messages that were unclear: one
true line each (exit 2), and nothing lost."""
import os

import numpy as np
import pytest

from vlseq_ext import data
from vlseq_ext.cli import predict

from cli_helpers import SMALL, one_line_error, run

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
