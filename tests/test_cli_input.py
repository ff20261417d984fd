"""vlseq-train on bad input: data, numbers, sizes and checkpoints that cannot work each stop with one
line naming the problem and exit code 2, before anything is trained or written."""
from pathlib import Path

import numpy as np
import pytest
import torch

from vlseq_ext import checkpoint, data

from cli_helpers import SMALL, one_line_error, run

def bad_npz(tmp_path, case):
    seqs = [np.ones((n, 4), np.float32) for n in (3, 5, 2)]
    path = tmp_path / f"{case}.npz"
    if case == "missing":
        return path
    if case in ("corrupt", "truncated"):
        data.save_ragged(path, seqs, np.zeros(3, np.float32))
        raw = path.read_bytes()
        path.write_bytes(raw[:len(raw) // 2] if case == "truncated" else b"\x00" * len(raw))
        return path
    values, offsets, targets = np.concatenate(seqs), np.array([0, 3, 8, 10]), np.zeros(3, np.float32)
    if case == "shape":
        values = values.ravel()
    elif case == "offsets":
        offsets = np.array([0, 8, 3, 10])
    elif case == "nan":
        values[4, 2] = np.nan
    elif case == "zero_length":
        offsets = np.array([0, 3, 3, 10])
    np.savez(path, values=values, offsets=offsets, targets=targets)
    return path


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such file"),
    ("corrupt", "not an .npz archive"),
    ("truncated", "corrupt or truncated"),
    ("shape", "'values' must have shape (total_steps, features)"),
    ("offsets", "'offsets' are not monotone"),
    ("nan", "sample 1 has a non-finite value (NaN or inf) at step 1; pass --drop-nonfinite"),
    ("zero_length", "sample 1 has length 0"),
])
def test_bad_data_is_one_line_and_exit_code_2(tmp_path, capsys, case, expect):
    path = bad_npz(tmp_path, case)
    rc, out, err = run(capsys, "--data", path, *SMALL, "--checkpoint-dir", tmp_path / "run")
    assert rc == 2
    assert err.startswith("vlseq-train: error: ") and err.count("\n") == 1, err
    assert str(path) in err and expect in err, err
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("argv, expect", [
    (["--data", "japanese_vowels", "--task", "regression"],
     "japanese_vowels: a built-in classification dataset: it cannot be trained as regression; leave out --task"),
    (["--synthetic-samples", "2", "--val-fraction", "0.9"],
     "a validation fraction of 0.9 leaves no training samples out of 2; give a smaller --val-fraction"),
    (["--data", "nope"], "nope: no such file; --data takes a .npz or .ts file, or one of: synthetic, japanese_vowels"),
])
def test_data_errors_name_the_commands_flag(tmp_path, capsys, argv, expect):
    # the data layer names its parameters (val_fraction, ...): vlseq-train puts its flags in their place
    rc, _, err = run(capsys, *SMALL, *argv, "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, expect)
    assert "val_fraction" not in err and "task=" not in err


def test_drop_nonfinite_trains_on_the_rest(tmp_path, capsys):
    path = bad_npz(tmp_path, "nan")
    rc, _, err = run(capsys, "--data", path, "--drop-nonfinite", "--devices", "cpu:2", "--hidden", "4",
                     "--val-fraction", "0", "--max-steps", "2", "--checkpoint-dir", tmp_path / "run", "--quiet")
    assert rc == 0, err
    assert "dropped 1 of 3 samples with NaN/inf values" in err


def test_resume_with_other_feature_count_and_bad_devices(tmp_path, capsys):
    rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "run")
    assert rc == 0, err
    other = bad_npz(tmp_path, "ok")  # 4 features, the checkpoint's model has 36
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--data", other, "--max-steps", 4)
    assert rc == 2 and err.count("\n") == 1 and str(other) in err
    assert "4 features per step, but the checkpoint's model was trained on 36" in err
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--hidden", 16)
    one_line_error(rc, err, "--hidden 16: the resumed run has --hidden 8", "leave out --hidden")
    # a task the run inferred from its data: a script that always passes --task resumes it
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--task", "classification")
    one_line_error(rc, err, "the resumed run has --task regression (inferred from its data)", "leave out --task")
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--task", "regression", "--max-steps", 3)
    assert rc == 0 and "resuming at step 2" in err, err
    rc, _, err = run(capsys, "--resume", tmp_path / "nothing-here")
    assert rc == 2 and "no checkpoint there" in err
    n = torch.cuda.device_count()
    rc, _, err = run(capsys, *SMALL[2:], "--devices", f"cuda:{n + 7}", "--checkpoint-dir", tmp_path / "x")
    assert rc == 2 and err.count("\n") == 1 and f"cuda:{n + 7} does not exist" in err, err


def test_resume_on_other_data_of_the_same_size_is_refused(tmp_path, capsys):
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((int(rng.integers(4, 12)), 3)).astype(np.float32) for _ in range(16)]
    targets = rng.standard_normal((16, 1)).astype(np.float32)
    data.save_ragged(tmp_path / "d.npz", seqs, targets)
    rc, _, err = run(capsys, *SMALL, "--data", tmp_path / "d.npz", "--max-steps", 2, "--checkpoint-dir", tmp_path / "run")
    assert rc == 0, err
    before = (tmp_path / "run" / "last.pt").read_bytes()
    seqs[5][2, 1] += 1e-3  # one value of one sample, nothing else
    data.save_ragged(tmp_path / "d.npz", seqs, targets)
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--max-steps", 4)
    one_line_error(rc, err, f"{tmp_path / 'd.npz'}: not the data of the checkpoint's run (as many training samples")
    assert (tmp_path / "run" / "last.pt").read_bytes() == before
    ck = torch.load(tmp_path / "run" / "last.pt", weights_only=True)  # a checkpoint from before fingerprints
    del ck["data"]["fingerprint"]
    torch.save(ck, tmp_path / "run" / "last.pt")
    rc, _, err = run(capsys, "--resume", tmp_path / "run", "--max-steps", 4)
    assert rc == 0, err


@pytest.mark.parametrize("argv, expect", [
    (["--lr", "inf"], "--lr must be a number > 0 that float32 holds (at most 3.4e+38), got inf"),
    (["--lr", "nan"], "--lr must be a number > 0 that float32 holds (at most 3.4e+38), got nan"),
    (["--lr", "0"], "--lr must be a number > 0 that float32 holds (at most 3.4e+38), got 0.0"),
    (["--lr", "1e300"], "--lr must be a number > 0 that float32 holds"),  # (overflowed in the first step)
    (["--lr=-1e-3"], "--lr must be a number > 0 that float32 holds (at most 3.4e+38), got -0.001"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number > 0, got nan"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number > 0, got inf"),
    (["--clip-grad", "0"], "--clip-grad must be a finite number > 0"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
    (["--val-fraction", "-0.5"], "--val-fraction must be in [0, 1)"),
    (["--val-fraction", "nan"], "--val-fraction must be in [0, 1), got nan"),
    (["--log-interval", "0"], "--log-interval must be a finite number > 0"),
    (["--log-interval", "inf"], "--log-interval must be a finite number > 0, got inf"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--hidden", "0"], "--hidden must be >= 1"),
    (["--layers", "-2"], "--layers must be >= 1"),
    (["--samples-per-device", "0"], "--samples-per-device must be >= 1"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--max-steps", "-5"], "--max-steps must be >= 1"),
    (["--synthetic-samples", "0"], "--synthetic-samples must be >= 1"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--hidden", "10000000"], "--hidden 10000000 --layers 1: the model would have 400,001,530,000,001 parameters"),
    (["--hidden", "20000", "--layers", "2"], "the limit is 2,147,483,648"),
    # counted in closed form: a loop over the layers took hours
    (["--layers", str(10 ** 15)], "the model would have 576,000,000,000,000,905 parameters"),
    (["--synthetic-samples", str(10 ** 12)], "--synthetic-samples 1000000000000: building the synthetic set needs "
                                             "about 118.8 PB of memory"),
])
def test_numbers_that_make_no_sense_are_refused_up_front(tmp_path, capsys, argv, expect):
    rc, _, err = run(capsys, *SMALL, *argv, "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, expect)
    assert not (tmp_path / "run").exists()


def test_model_size_is_checked_with_the_data_shape(tmp_path, capsys):
    # 4 features but 300,000 regression outputs: the head alone exceeds the limit at --hidden 8000
    data.save_ragged(tmp_path / "wide.npz", [np.ones((2, 4), np.float32)] * 2, np.zeros((2, 300_000), np.float32))
    rc, _, err = run(capsys, "--data", tmp_path / "wide.npz", *SMALL[:2], "--hidden", 8000, "--val-fraction", 0,
                     "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, f"{tmp_path / 'wide.npz'} (4 features, 300000 outputs) with --hidden 8000 --layers 1: "
                            "the model would have")


def float64_npz(tmp_path, value=1e39, where="values"):
    seqs = [np.ones((n, 3)) for n in (3, 5, 2)]
    seqs[1][2, 1] = value if where == "values" else 1.0
    targets = np.zeros(3)
    if where == "targets":
        targets[2] = value
    path = tmp_path / f"f64-{where}.npz"
    np.savez(path, values=np.concatenate(seqs), offsets=np.array([0, 3, 8, 10]), targets=targets)
    return path


def test_float64_values_that_overflow_float32_are_refused_or_dropped(tmp_path, capsys):
    for where, at in (("values", "at step 2"), ("targets", "in its target")):
        path = float64_npz(tmp_path, where=where)
        rc, _, err = run(capsys, "--data", path, *SMALL, "--checkpoint-dir", tmp_path / "run")
        one_line_error(rc, err, str(path), f"the value 1e+39 {at}, which overflows float32", "--drop-nonfinite")
    rc, _, err = run(capsys, "--data", float64_npz(tmp_path), "--drop-nonfinite", *SMALL, "--val-fraction", 0,
                     "--max-steps", 2, "--checkpoint-dir", tmp_path / "run")
    assert rc == 0 and "dropped 1 of 3 samples with NaN/inf values or values that overflow float32" in err, err


def test_a_huge_class_label_is_refused(tmp_path, capsys):
    seqs = [np.ones((3, 2), np.float32)] * 4
    data.save_ragged(tmp_path / "ids.npz", seqs, np.array([0, 1, 1_000_000_000, 1]))
    rc, _, err = run(capsys, "--data", tmp_path / "ids.npz", *SMALL, "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, "sample 2 has class label 1000000000, far beyond the 3 distinct labels",
                   "remap the labels to 0..2")
    assert not (tmp_path / "run").exists()


def test_a_single_class_trains_with_a_warning(tmp_path, capsys):
    data.save_ragged(tmp_path / "one.npz", [np.ones((3, 2), np.float32)] * 4, np.zeros(4, np.int64))
    rc, _, err = run(capsys, "--data", tmp_path / "one.npz", *SMALL, "--val-fraction", 0, "--max-steps", 1,
                     "--checkpoint-dir", tmp_path / "run")
    assert rc == 0 and "warning: " in err and "every training sample has class 0" in err, err


@pytest.mark.parametrize("case, expect", [
    ("no_data", "not a vlseq checkpoint: no 'data' entry"),
    ("hidden_changed", "inconsistent: the saved configuration (lstm, 36 features, hidden 16, layers 1, 1 outputs) "
                       "gives lstm.weight_ih_l0 the shape (64, 36), the saved weights have (32, 36)"),
    ("truncated", "truncated or corrupt"),
    ("empty", "truncated or corrupt: the file is empty (0 bytes)"),
    ("random", "truncated or corrupt"),
    ("number", "not a vlseq checkpoint: it holds a int"),
    ("state_dict", "not a vlseq checkpoint: a model state_dict, no 'config'"),
])
def test_foreign_or_broken_checkpoints_on_resume(tmp_path, capsys, case, expect):
    if not hasattr(test_foreign_or_broken_checkpoints_on_resume, "good"):
        rc, _, err = run(capsys, *SMALL, "--max-steps", 2, "--checkpoint-dir", tmp_path / "good")
        assert rc == 0, err
    good = (tmp_path / "good" / "last.pt").read_bytes()
    ck = checkpoint.load_checkpoint(tmp_path / "good")
    path = tmp_path / "bad" / "last.pt"
    path.parent.mkdir()
    if case == "no_data":
        del ck["data"]
        torch.save(ck, path)
    elif case == "hidden_changed":
        ck["config"]["hidden"] = 16
        torch.save(ck, path)
    elif case == "truncated":
        path.write_bytes(good[:len(good) // 2])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "random":
        path.write_bytes(np.random.default_rng(0).bytes(5000))
    elif case == "number":
        torch.save(5, path)
    elif case == "state_dict":
        torch.save(ck["model"], path)
    before = path.read_bytes()
    rc, _, err = run(capsys, "--resume", path.parent, "--max-steps", 4)
    one_line_error(rc, err, f"--resume: {path}: ", expect)
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]


@pytest.mark.parametrize("kind", ["directory", "device"])
def test_data_that_is_not_a_file_says_what_it_is(tmp_path, capsys, kind):
    path = tmp_path if kind == "directory" else Path("/dev/null")
    if not path.exists():
        pytest.skip("no /dev/null")
    rc, _, err = run(capsys, "--data", path, *SMALL, "--checkpoint-dir", tmp_path / "run")
    one_line_error(rc, err, str(path), "is a directory" if kind == "directory" else "is not a regular file")
    assert "no such file" not in err
