"""vlseq-predict end to end on CPU: train a few steps with vlseq-train, predict (.npy and .csv,
regression and classification), and compare with a forward pass of the saved weights on one sample
at a time; metrics; bad input (one line, exit code 2, nothing written); vlseq_ext.checkpoint.load_model."""
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vlseq_ext import SeqModel, cli, data
from vlseq_ext.checkpoint import CheckpointError, load_model
from vlseq_ext.cli import predict

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--devices", "cpu:2", "--hidden", "8", "--quiet", "--val-fraction", "0", "--max-steps", "4"]
needs_aeon = pytest.mark.skipif(importlib.util.find_spec("aeon") is None,
                                reason="aeon is not installed (pip install 'vlseq_ext[ts]')")


# Full fp32 on GPUs (no_tf32: cuDNN's default TF32 would differ from the CPU reference by ~1e-4), so
# predictions on any device compare with the CPU forward at fp32 tolerances.
pytestmark = pytest.mark.usefixtures("no_tf32")


def sequences(n, d, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((int(rng.integers(2, 15)), d)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A regression run (5 features, 2 outputs) and a classification run (4 features, 3 classes)."""
    root = tmp_path_factory.mktemp("trained")
    seqs = sequences(20, 5, 0)
    data.save_ragged(root / "reg.npz", seqs, np.stack([[s.mean(), s[-1, 0]] for s in seqs]))
    cseqs = sequences(24, 4, 1)
    data.save_ragged(root / "cls.npz", cseqs, np.arange(24) % 3)
    for name in ("reg", "cls"):
        rc = cli.main([*TRAIN, "--data", str(root / f"{name}.npz"), "--checkpoint-dir", str(root / name)])
        assert rc == 0
    new = sequences(11, 5, 2)
    data.save_ragged(root / "new_reg.npz", new)  # no targets
    data.save_ragged(root / "new_reg_t.npz", new, np.zeros((11, 2), np.float32))
    cnew = sequences(13, 4, 3)
    data.save_ragged(root / "new_cls.npz", cnew, np.arange(13) % 3)
    return root, new, cnew


def run(capsys, *argv):
    rc = predict.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def single_sample_outputs(run_dir, seqs):
    """The saved weights, one sample at a time, built by hand (not through load_model)."""
    ck = torch.load(run_dir / "last.pt", weights_only=True)
    model = SeqModel(ck["data"]["num_features"], ck["config"]["hidden"], ck["data"]["output_dim"],
                     ck["config"]["layers"], ck["config"]["model"])
    model.load_state_dict(ck["model"])
    model.eval()
    with torch.no_grad():
        return torch.cat([model(torch.from_numpy(s)) for s in seqs])


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


@pytest.mark.parametrize("batch_size, devices", [(256, "cpu"), (3, "cpu:2"), (1, "all")])
def test_regression_predictions_equal_single_sample_forwards(trained, tmp_path, capsys, batch_size, devices):
    root, new, _ = trained
    expected = single_sample_outputs(root / "reg", new)
    for fmt in ("npy", "csv"):
        out = tmp_path / f"p.{fmt}"
        rc, _, err = run(capsys, "--checkpoint", root / "reg", "--data", root / "new_reg.npz", "--out", out,
                         "--batch-size", batch_size, "--devices", devices)
        assert rc == 0 and "11 predictions (regression)" in err, err
        if fmt == "npy":
            got = np.load(out, allow_pickle=False)
            assert got.dtype == np.float32 and got.shape == (11, 2)
            torch.testing.assert_close(torch.from_numpy(got), expected)
        else:
            header, rows = read_csv(out)
            assert header == ["index", "prediction_0", "prediction_1"]
            assert [int(r[0]) for r in rows] == list(range(11))
            torch.testing.assert_close(torch.tensor([[float(v) for v in r[1:]] for r in rows]), expected)


def test_outputs_are_as_readable_as_any_new_file(trained, tmp_path, capsys):
    # they were 0o600 (mkstemp's mode) whatever the umask: a team could not read its predictions
    root, _, _ = trained
    old = os.umask(0o022)
    try:
        rc, _, err = run(capsys, "--checkpoint", root / "reg", "--data", root / "new_reg_t.npz",
                         "--out", tmp_path / "p.csv", "--metrics", tmp_path / "m.json", "--quiet")
    finally:
        os.umask(old)
    assert rc == 0, err
    for name in ("p.csv", "m.json"):
        assert oct(os.stat(tmp_path / name).st_mode & 0o777) == oct(0o644), name
    assert oct(os.stat(root / "reg" / "last.pt").st_mode & 0o077) != oct(0), "the checkpoint is private"


def test_classification_class_probabilities_and_metrics(trained, tmp_path, capsys):
    root, _, cnew = trained
    logits = single_sample_outputs(root / "cls", cnew)
    prob = torch.softmax(logits, 1)
    rc, out, err = run(capsys, "--checkpoint", root / "cls" / "last.pt", "--data", root / "new_cls.npz",
                       "--out", tmp_path / "p.npy", "--metrics", tmp_path / "m.json")
    assert rc == 0, err
    got = np.load(tmp_path / "p.npy", allow_pickle=False)
    assert got.dtype.names == ("class", "prob") and got.shape == (13,) and got["prob"].shape == (13, 3)
    torch.testing.assert_close(torch.from_numpy(got["prob"]), prob)
    assert got["class"].tolist() == logits.argmax(1).tolist()
    y = torch.arange(13) % 3
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["samples"] == 13 and m["task"] == "classification" and m["loss_fn"] == "cross_entropy"
    assert m["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert m["accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item())
    assert f"13 samples: cross_entropy loss {m['loss']:.6g}, accuracy {100 * m['accuracy']:.2f}%" in out
    rc, _, err = run(capsys, "--checkpoint", root / "cls", "--data", root / "new_cls.npz", "--out", tmp_path / "p.csv")
    assert rc == 0, err
    header, rows = read_csv(tmp_path / "p.csv")
    assert header == ["index", "class", "p_0", "p_1", "p_2"]
    assert [int(r[1]) for r in rows] == logits.argmax(1).tolist()
    torch.testing.assert_close(torch.tensor([[float(v) for v in r[2:]] for r in rows]), prob)


def test_regression_metrics(trained, tmp_path, capsys):
    root, new, _ = trained
    rc, out, err = run(capsys, "--checkpoint", root / "reg", "--data", root / "new_reg_t.npz", "--out",
                       tmp_path / "p.npy", "--metrics", tmp_path / "m.json", "--quiet")
    assert rc == 0, err
    expected = single_sample_outputs(root / "reg", new)
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["loss_fn"] == "mse" and "accuracy" not in m
    assert m["loss"] == pytest.approx((expected ** 2).mean().item(), rel=1e-5)  # the targets are zeros


def test_load_model_returns_the_trained_model_in_eval_mode(trained):
    root, new, _ = trained
    model = load_model(root / "reg")
    assert not model.training and isinstance(model, SeqModel)
    with torch.no_grad():
        got = torch.cat([model(torch.from_numpy(s)) for s in new])
    torch.testing.assert_close(got, single_sample_outputs(root / "reg", new), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError):
        load_model(root / "nothing")
    (root / "junk.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(root / "junk.pt")


@pytest.mark.parametrize("change,match", [
    (lambda w: w.fill_(float("nan")), "holds NaN or inf"),
    (lambda w: w.to(torch.complex64), r"is torch.complex64; vlseq-train saves torch.float32"),
    (lambda w: w.half(), r"is torch.float16; vlseq-train saves torch.float32"),
])
def test_load_model_refuses_weights_vlseq_train_never_writes(trained, tmp_path, change, match):
    # load_state_dict cast them silently (a complex weight lost its imaginary part; NaN predicted NaN)
    root, _, _ = trained
    ck = torch.load(root / "reg" / "last.pt", weights_only=True)
    name = next(iter(ck["model"]))
    ck["model"][name] = change(ck["model"][name].clone())
    torch.save(ck, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=f"saved weight {re.escape(name)} " + match):
        load_model(tmp_path / "bad.pt")


def test_entry_points(trained, tmp_path):
    root, _, _ = trained
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "vlseq_ext", "predict", "--checkpoint", str(root / "reg"), "--data",
                          str(root / "new_reg.npz"), "--out", str(tmp_path / "p.npy")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and np.load(tmp_path / "p.npy").shape == (11, 2), res.stderr
    res = subprocess.run([sys.executable, "-m", "vlseq_ext", "predict", "--help"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "output layouts" in res.stdout and "preds['class']" in res.stdout
    assert cli.main(["predict", "--checkpoint", str(root / "reg"), "--data", str(root / "new_reg.npz"), "--out",
                     str(tmp_path / "q.csv"), "--quiet"]) == 0
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'vlseq-predict = "vlseq_ext.cli.predict:main"' in scripts


def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path, capsys, rand):
    root, _, _ = trained
    (tmp_path / "afile").write_text("x")
    (tmp_path / "junk.pt").write_bytes(rand.py.randbytes(3000))  # may start like a pickle (1 in 256)
    data.save_ragged(tmp_path / "three.npz", sequences(4, 3, 5))
    data.save_ragged(tmp_path / "nan.npz", [np.full((3, 5), np.nan, np.float32)])
    (tmp_path / "d.npy").mkdir()
    (tmp_path / "afile.csv").write_text("old")
    os.link(root / "new_reg.npz", tmp_path / "data_link.npy")  # the data file under another name
    checkpoint_bytes = (root / "reg" / "last.pt").read_bytes()
    ok = ["--checkpoint", root / "reg", "--data", root / "new_reg.npz"]
    cases = [
        (["--checkpoint", tmp_path / "none", "--data", root / "new_reg.npz", "--out", tmp_path / "p.npy"],
         f"--checkpoint {tmp_path / 'none'}: no checkpoint there"),
        (["--checkpoint", tmp_path / "junk.pt", "--data", root / "new_reg.npz", "--out", tmp_path / "p.npy"],
         "truncated or corrupt"),
        (["--checkpoint", root / "reg", "--data", tmp_path / "three.npz", "--out", tmp_path / "p.npy"],
         f"{tmp_path / 'three.npz'}: 3 features per step, but the checkpoint's model takes 5"),
        (["--checkpoint", root / "reg", "--data", tmp_path / "nan.npz", "--out", tmp_path / "p.npy"],
         "every sample to predict needs finite values"),
        ([*ok, "--out", tmp_path / "missing.npz"], "unknown extension .npz (use one of: .csv, .npy)"),
        ([*ok, "--out", tmp_path], "no file extension"),
        ([*ok, "--out", tmp_path / "d.npy"], "--out " + str(tmp_path / "d.npy") + ": is a directory"),
        ([*ok, "--out", tmp_path / "afile" / "p.npy"], "is a file, not a directory"),
        ([*ok, "--out", tmp_path / "afile.csv"], "already exists: pass --overwrite"),
        ([*ok, "--out", tmp_path / "p.npy", "--metrics", tmp_path / "m.json"], "--metrics needs targets"),
        ([*ok, "--out", tmp_path / "p.npy", "--batch-size", 0], "--batch-size must be >= 1"),
        ([*ok, "--out", tmp_path / "data_link.npy", "--overwrite"], "is the --data file, which is read"),
        ([*ok, "--out", tmp_path / "p.csv", "--metrics", root / "reg" / "last.pt", "--overwrite"],
         "is the --checkpoint file, which is read"),
        ([*ok, "--out", tmp_path / "p.csv", "--metrics", tmp_path / "p.csv"], "is the --out file"),
        ([*ok, "--out", tmp_path / "p.npy", "--devices", "cuda:99"], "--devices cuda:99: "),
        (["--checkpoint", root / "reg", "--data", tmp_path, "--out", tmp_path / "p.npy"], "is a directory"),
    ]
    for argv, expect in cases:
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and err.startswith("vlseq-predict: error: ") and err.count("\n") == 1, (argv, err)
        assert expect in err and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "afile.csv", "d.npy", "data_link.npy", "junk.pt",
                                                          "nan.npz", "three.npz"]
    assert (root / "reg" / "last.pt").read_bytes() == checkpoint_bytes
    assert (tmp_path / "afile.csv").read_text() == "old"
    rc, _, err = run(capsys, *ok, "--out", tmp_path / "afile.csv", "--overwrite")
    assert rc == 0 and read_csv(tmp_path / "afile.csv")[0][0] == "index", err


@needs_aeon
def test_ts_labels_map_to_the_trained_classes(tmp_path, capsys):
    """Trained on a .ts with @classLabel a b c; predicting on a file that lists them as c a b: the
    metrics use the trained model's class indices, and the outputs carry the class names."""
    rng = np.random.default_rng(7)

    def ts(path, labels, order):
        lines = [f"@problemName t\n@univariate true\n@equalLength false\n@classLabel true {' '.join(order)}\n@data\n"]
        for lab in labels:
            lines.append(",".join(f"{v:.4f}" for v in rng.standard_normal(int(rng.integers(3, 9)))) + f":{lab}\n")
        path.write_text("".join(lines))

    ts(tmp_path / "train.ts", ["a", "b", "c"] * 6, ["a", "b", "c"])
    ts(tmp_path / "test.ts", ["c", "a", "b", "b"], ["c", "a", "b"])
    rc = cli.main([*TRAIN, "--data", str(tmp_path / "train.ts"), "--checkpoint-dir", str(tmp_path / "run")])
    assert rc == 0
    rc, _, err = run(capsys, "--checkpoint", tmp_path / "run", "--data", tmp_path / "test.ts", "--out",
                     tmp_path / "p.npy", "--metrics", tmp_path / "m.json")
    assert rc == 0, err
    got = np.load(tmp_path / "p.npy", allow_pickle=False)
    assert got.dtype.names == ("class", "prob", "label")
    assert [["a", "b", "c"][c] for c in got["class"]] == got["label"].tolist()
    ds = data.load_ts(tmp_path / "test.ts", targets_required=False, class_names=["a", "b", "c"])
    assert ds.targets.tolist() == [2, 0, 1, 1]
    assert json.loads((tmp_path / "m.json").read_text())["accuracy"] == pytest.approx(
        float((torch.from_numpy(got["class"]) == ds.targets).double().mean()))
    rc, _, err = run(capsys, "--checkpoint", tmp_path / "run", "--data", tmp_path / "test.ts", "--out",
                     tmp_path / "p.csv")
    assert rc == 0 and read_csv(tmp_path / "p.csv")[0] == ["index", "class", "label", "p_0", "p_1", "p_2"], err
