"""SeqClassifier and SeqRegressor as a user meets them: ragged input, string labels, the same model
from the same random_state, pickling (and predicting where no GPU is visible), scikit-learn's
clone / cross_val_score / GridSearchCV on ragged lists, the training options, and one-line errors for
bad input. aeon's and scikit-learn's own estimator checks are in test_estimators_checks.py."""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("aeon", reason="the estimators need aeon (pip install 'vlseq_ext[ts]')")

from sklearn.base import clone  # noqa: E402  (after the skip: sklearn comes with aeon)
from sklearn.exceptions import NotFittedError  # noqa: E402
from sklearn.model_selection import GridSearchCV, cross_val_score  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402

from vlseq_ext.estimators import SeqClassifier, SeqRegressor  # noqa: E402
import vlseq_ext.estimators.training as training  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one small network, no augmentation, a 20% validation split: what most tests look at
SMALL = dict(hidden_size=8, n_epochs=40, batch_size=8, patience=10, devices="cpu", n_networks=1, augment=0.0,
             validation_fraction=0.2)
SLOPES = {"down": -2.0, "flat": 0.0, "up": 2.0}


def make_data(n, seed, channels=2, lo=8, hi=40):
    """Ragged series (channels, L_i) whose class is the trend: "down", "flat" or "up"."""
    rng = np.random.default_rng(seed)
    y = rng.choice(list(SLOPES), n)
    X = []
    for c in y:
        t = np.linspace(0, 1, int(rng.integers(lo, hi)))
        X.append(np.stack([SLOPES[c] * t + 0.3 * rng.standard_normal(len(t)) + 5.0 for _ in range(channels)]))
    return X, y


@pytest.fixture(scope="module")
def data():
    return make_data(60, 0), make_data(40, 1)


@pytest.fixture(scope="module")
def fitted(data):
    (X, y), _ = data
    torch.set_num_threads(1)
    return SeqClassifier(random_state=0, **SMALL).fit(X, y)


def test_learns_ragged_series_with_string_labels(data, fitted):
    _, (Xt, yt) = data
    assert fitted.classes_.tolist() == ["down", "flat", "up"]
    pred = fitted.predict(Xt)
    assert pred.dtype == fitted.classes_.dtype and set(pred) <= set(fitted.classes_)
    assert np.mean(pred == yt) >= 0.9
    proba = fitted.predict_proba(Xt)
    assert proba.shape == (40, 3) and np.allclose(proba.sum(1), 1.0)
    assert (fitted.classes_[proba.argmax(1)] == pred).all()
    assert fitted.score(Xt, yt) == np.mean(pred == yt)
    # validation split: 20% per class, early stopping restored the best epoch
    assert len(fitted.models_) == 1 and len(fitted.train_indices_[0]) == 48
    val_losses = [h["val_loss"] for h in fitted.histories_[0]]
    assert val_losses[fitted.best_epochs_[0]] == min(val_losses)
    assert fitted.stop_reasons_[0] in ("early_stopping", "epochs")
    assert all(p.device.type == "cpu" for p in fitted.models_[0].parameters())


def test_restored_weights_are_the_best_epochs(data):
    """Stopped early: the model kept is the best epoch's, not the last one's (its validation loss,
    recomputed on the held-out series, is the best recorded)."""
    (X, y), _ = data
    y = np.random.default_rng(5).permutation(y)  # labels the series cannot predict: memorising them overfits
    clf = SeqClassifier(random_state=1, **dict(SMALL, n_epochs=60, patience=3, lr=0.03, hidden_size=16)).fit(X, y)
    history, best = clf.histories_[0], clf.best_epochs_[0]
    assert clf.stop_reasons_ == ["early_stopping"] and len(history) == best + 1 + 3
    val = np.flatnonzero(np.isin(np.arange(len(X)), clf.train_indices_[0], invert=True))
    proba = clf.predict_proba([X[i] for i in val])
    codes = np.searchsorted(clf.classes_, y[val])
    loss = -np.mean(np.log(proba[np.arange(len(val)), codes]))
    assert abs(loss - history[best]["val_loss"]) < 1e-4
    assert history[-1]["val_loss"] > history[best]["val_loss"]


def test_same_random_state_same_model(data):
    (X, y), (Xt, _) = data
    a = SeqClassifier(random_state=7, **dict(SMALL, n_epochs=5)).fit(X, y)
    b = SeqClassifier(random_state=7, **dict(SMALL, n_epochs=5)).fit(X, y)
    c = SeqClassifier(random_state=8, **dict(SMALL, n_epochs=5)).fit(X, y)
    assert np.array_equal(a.predict_proba(Xt), b.predict_proba(Xt))
    assert not np.array_equal(a.predict_proba(Xt), c.predict_proba(Xt))
    before = torch.random.get_rng_state()
    SeqClassifier(random_state=7, **dict(SMALL, n_epochs=1)).fit(X, y)
    assert torch.equal(before, torch.random.get_rng_state())  # the user's torch stream is left alone


def test_pickle_round_trip_predicts_where_no_gpu_is_visible(data, fitted, tmp_path):
    """A fitted estimator pickles; loaded in a process that sees no GPU it predicts the same."""
    _, (Xt, _) = data
    path = tmp_path / "clf.pkl"
    path.write_bytes(pickle.dumps(fitted))
    (tmp_path / "X.pkl").write_bytes(pickle.dumps(Xt))
    code = ("import pickle, sys, numpy as np, torch\n"
            "assert not torch.cuda.is_available()\n"
            "clf = pickle.loads(open(sys.argv[1], 'rb').read())\n"
            "X = pickle.loads(open(sys.argv[2], 'rb').read())\n"
            "np.save(sys.argv[3], clf.predict_proba(X))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "X.pkl"), str(tmp_path / "p.npy")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), fitted.predict_proba(Xt), rtol=1e-4, atol=1e-6)
    again = pickle.loads(path.read_bytes())
    assert np.array_equal(again.predict_proba(Xt), fitted.predict_proba(Xt))


def test_other_collection_formats(data):
    """Equal-length 3D arrays and 2D univariate arrays are aeon collections too."""
    rng = np.random.default_rng(2)
    y = np.array([0, 1] * 10)
    X3 = rng.standard_normal((20, 2, 15)) + y[:, None, None] * 2.0
    clf = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=5)).fit(X3, y)
    assert clf.predict(X3).shape == (20,) and clf.predict(list(X3)).tolist() == clf.predict(X3).tolist()
    X2 = X3[:, 0, :]
    assert SeqClassifier(random_state=0, **dict(SMALL, n_epochs=2)).fit(X2, y).predict(X2).shape == (20,)


def test_sklearn_model_selection_on_ragged_lists(data):
    (X, y), _ = data
    est = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=10, hidden_size=6))
    scores = cross_val_score(est, X, y, cv=3, error_score="raise")
    assert scores.shape == (3,) and scores.mean() >= 0.7
    grid = GridSearchCV(est.set_params(n_epochs=3), {"pooling": ["meanmax", "last"]}, cv=2, error_score="raise")
    grid.fit(X, y)
    assert set(grid.best_params_) == {"pooling"} and len(grid.cv_results_["params"]) == 2
    assert grid.predict(X[:5]).shape == (5,)
    pipe = make_pipeline(clone(est)).fit(X, y)  # ragged lists pass through a Pipeline untouched
    assert pipe.predict(X[:4]).shape == (4,) and 0.0 <= pipe.score(X, y) <= 1.0
    assert grid.best_estimator_.models_[0].head.in_features == \
        6 * 2 * (2 if grid.best_params_["pooling"] == "meanmax" else 1) + 1


def test_clone_and_set_params_then_fit(data, fitted):
    (X, y), _ = data
    twin = clone(fitted)
    assert twin.get_params() == fitted.get_params() and not twin.is_fitted and not hasattr(twin, "models_")
    twin.set_params(hidden_size=3, rnn="lstm", bidirectional=False, n_epochs=2)
    twin.fit(X, y)
    assert twin.models_[0].fwd[0].hidden_size == 3 and twin.models_[0].bwd is None
    assert isinstance(twin.models_[0].fwd[0], torch.nn.LSTM)
    assert fitted.models_[0].fwd[0].hidden_size == 8  # the original is untouched


def test_networks_validate_on_disjoint_folds_and_their_probabilities_are_averaged(data):
    (X, y), (Xt, _) = data
    clf = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=3, n_networks=3, validation_fraction=0.34)).fit(X, y)
    assert len(clf.models_) == len(clf.histories_) == len(clf.best_epochs_) == 3
    held_out = [np.setdiff1d(np.arange(60), tr) for tr in clf.train_indices_]
    assert sorted(np.concatenate(held_out).tolist()) == list(range(60))  # every series validated once
    one = copy.copy(clf)
    each = []
    for m in clf.models_:
        one.models_ = [m]
        each.append(one.predict_proba(Xt))
    np.testing.assert_allclose(clf.predict_proba(Xt), np.mean(each, axis=0), rtol=1e-12)
    assert not np.allclose(each[0], each[1])  # other folds and seeds: other networks


def test_auto_convolution_only_for_long_series():
    assert SeqClassifier()._conv_settings(15.0) == (0, 1)  # JapaneseVowels-like: the GRU sees every step
    assert SeqClassifier()._conv_settings(140.0) == (32, 2)  # PickupGestureWiimoteZ-like: ~70 steps left
    assert SeqClassifier()._conv_settings(1000.0) == (32, 16)
    assert SeqClassifier(conv_channels=8)._conv_settings(15.0) == (8, 1)
    assert SeqClassifier(conv_stride=3)._conv_settings(140.0) == (32, 3)
    assert SeqClassifier(conv_channels=0)._conv_settings(1000.0) == (0, 1)
    X, y = make_data(12, 4, channels=1, lo=100, hi=160)
    clf = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=1, hidden_size=4)).fit(X, y)
    assert (clf.conv_channels_, clf.conv_stride_) == (32, 2) and clf.models_[0].conv.stride == (2,)


def test_augmentation_changes_training_and_repeats(data):
    (X, y), (Xt, _) = data
    plain = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=3)).fit(X, y).predict_proba(Xt)
    a = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=3, augment=0.2)).fit(X, y).predict_proba(Xt)
    b = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=3, augment=0.2)).fit(X, y).predict_proba(Xt)
    assert np.array_equal(a, b) and not np.allclose(a, plain)


def test_devices_and_trainer_options_reach_the_trainer(data, monkeypatch):
    (X, y), _ = data
    seen = []

    class Spy(training.ParallelTrainer):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(training, "ParallelTrainer", Spy)
    clf = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=2, batch_size=6, devices="cpu:2",
                                                 trainer_kwargs={"nonfinite": "raise", "accumulation_steps": 2}))
    clf.fit(X, y)
    assert seen[-1]["samples_per_device"] == 3 and [str(d) for d in seen[-1]["devices"]] == ["cpu", "cpu"]
    assert seen[-1]["nonfinite"] == "raise" and seen[-1]["accumulation_steps"] == 2
    assert seen[-1]["reduction"] == "mean" and seen[-1]["clip_grad_norm"] == 1.0
    assert clf.trainer_kwargs == {"nonfinite": "raise", "accumulation_steps": 2}  # not changed by fit
    SeqClassifier(random_state=0, **dict(SMALL, n_epochs=1, samples_per_device=2, devices="cpu:2")).fit(X, y)
    assert seen[-1]["samples_per_device"] == 2


def test_learning_rate_schedules(data):
    (X, y), _ = data
    cos = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=6, lr_schedule="cosine", validation_fraction=0.0,
                                                lr=0.01)).fit(X, y)
    lrs = [h["lr"] for h in cos.histories_[0]]
    expected = [1e-4 + (0.01 - 1e-4) * (1 + np.cos(np.pi * e / 6)) / 2 for e in range(6)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-9)
    assert len(cos.histories_[0]) == 6 and len(cos.train_indices_[0]) == 60 and "val_loss" not in cos.histories_[0][0]
    flat = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=4, lr_schedule=None)).fit(X, y)
    assert {h["lr"] for h in flat.histories_[0]} == {flat.lr}
    plateau = SeqClassifier(random_state=0, **dict(SMALL, n_epochs=60, patience=6, lr=0.05)).fit(X, y)
    lrs = [h["lr"] for h in plateau.histories_[0]]
    assert lrs[0] == 0.05 and min(lrs) < 0.05 and all(b <= a for a, b in zip(lrs, lrs[1:]))


def test_verbose_shows_progress_and_quiet_shows_nothing(data, capfd):
    (X, y), _ = data
    SeqClassifier(random_state=0, **dict(SMALL, n_epochs=2)).fit(X, y)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    SeqClassifier(random_state=0, verbose=True, **dict(SMALL, n_epochs=2)).fit(X, y)
    out, err = capfd.readouterr()
    assert "SeqClassifier: 2 epoch(s) on 1 x cpu" in out + err and "epoch" in err


def test_regressor_on_ragged_series_in_original_units():
    rng = np.random.default_rng(3)
    X = [rng.standard_normal((2, int(rng.integers(5, 30)))) + rng.normal() for _ in range(80)]
    y = np.array([1000.0 + 50.0 * x[0].mean() for x in X])  # far from 0 and 1: the target scaling must undo
    reg = SeqRegressor(random_state=0, **dict(SMALL, n_epochs=60, patience=15)).fit(X[:60], y[:60])
    pred = reg.predict(X[60:])
    assert pred.shape == (20,) and reg.score(X[60:], y[60:]) > 0.8
    assert abs(reg.y_mean_ - y[:60].mean()) < 1e-9 and abs(reg.y_scale_ - y[:60].std()) < 1e-9
    with pytest.raises(ValueError, match=r"^Input y contains infinity"):  # aeon's own check
        SeqRegressor(**SMALL).fit(X[:10], np.r_[y[:3], np.inf, y[4:10]])


def _other_channels(X):
    return [np.ones((3, 5))] + list(X[1:])


BAD_FIT = [  # (what, X change, y change, error, message)
    ("NaN in a 3D array", lambda X: np.where(np.arange(60)[:, None, None] == 4, np.nan, np.ones((60, 2, 9))), None,
     ValueError, r"^X: series 4 has a NaN \(missing values are not supported\) at channel 0, step 0$"),
    ("inf in a series", lambda X: [X[0]] + [np.array([[1.0, np.inf], [0.0, 1.0]])] + list(X[2:]), None,
     ValueError, r"^X: series 1 has the value inf at channel 0, step 1$"),
    ("an empty series", lambda X: [X[0], np.ones((2, 0))] + list(X[2:]), None, ValueError,
     r"^X: series 1 is empty \(shape \(2, 0\)\)$"),
    ("an empty 3D array", lambda X: np.ones((60, 2, 0)), None, ValueError, r"^X: the series are empty"),
    ("no series", lambda X: [], lambda y: y[:0], ValueError, "^X holds no series$"),
    ("X is None", lambda X: None, None, TypeError, "^X is None"),
    ("another channel count", _other_channels, None, ValueError,
     r"^X: series 1 has 2 channel\(s\) but series 0 has 3$"),
    ("a single class", None, lambda y: np.full(len(y), "up"), ValueError, "at least 2 unique labels"),
    ("fewer labels than series", None, lambda y: y[:-1], ValueError, "Mismatch in number of cases"),
]


@pytest.mark.parametrize("what,xf,yf,exc,match", BAD_FIT, ids=[b[0] for b in BAD_FIT])
def test_bad_fit_input_one_line_error(data, what, xf, yf, exc, match):
    (X, y), _ = data
    X = xf(X) if xf else X
    y = yf(y) if yf else y
    with pytest.raises(exc, match=match) as info:
        SeqClassifier(**SMALL).fit(X, y)
    assert "\n" not in str(info.value)


def test_channel_count_differs_from_fit_one_line_error(data, fitted):
    (X, _), _ = data
    with pytest.raises(ValueError, match=r"^X has 3 channel\(s\) but SeqClassifier was fitted on 2$"):
        fitted.predict([np.ones((3, 7)), np.ones((3, 9))])
    with pytest.raises(ValueError, match=r"^X: series 1 is empty"):
        fitted.predict_proba([X[0], np.ones((2, 0))])


def test_predict_before_fit_and_unseen_labels(data, fitted):
    (X, y), _ = data
    for method in ("predict", "predict_proba"):
        with pytest.raises(NotFittedError, match="has not been fitted"):
            getattr(SeqClassifier(), method)(X)
    with pytest.raises(ValueError, match=r"^y holds label\(s\) 'sideways', 'UP' that fit never saw \(classes: "
                                         r"'down', 'flat', 'up'\)$"):
        fitted.score(X[:4], np.array(["up", "sideways", "UP", "down"]))
    with pytest.raises(ValueError, match=r"^y holds label\(s\) 1 that fit never saw"):
        fitted.score(X[:2], np.array([1, 1]))  # numbers are not the string labels


BAD_PARAMS = [
    (dict(rnn="rnn"), "rnn must be one of 'lstm', 'gru', got 'rnn'"),
    (dict(pooling="sum"), "pooling must be one of"),
    (dict(hidden_size=0), "hidden_size must be an int >= 1, got 0"),
    (dict(n_epochs=2.5), "n_epochs must be an int >= 1, got 2.5"),
    (dict(batch_size=True), "batch_size must be an int >= 1, got True"),
    (dict(lr=float("nan")), "lr must be a positive number, got nan"),
    (dict(lr=0), "lr must be a positive number, got 0"),
    (dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
    (dict(validation_fraction=-0.1), r"validation_fraction must be a number in \[0, 1\)"),
    (dict(patience=0), "patience must be None or an int >= 1, got 0"),
    (dict(clip_grad_norm=-1.0), "clip_grad_norm must be a positive number or None"),
    (dict(weight_decay=-1e-3), "weight_decay must be a number >= 0"),
    (dict(scaling="minmax"), "scaling must be one of"),
    (dict(lr_schedule="step"), "lr_schedule must be one of"),
    (dict(bidirectional="yes"), "bidirectional must be True or False"),
    (dict(trainer_kwargs={"devices": "cpu"}), "trainer_kwargs: devices are the estimator's own parameters"),
    (dict(trainer_kwargs={"lr": 1.0}), r"trainer_kwargs: unknown ParallelTrainer argument\(s\) lr"),
    (dict(devices="cuda:99"), r"devices 'cuda:99'"),
    (dict(trainer_kwargs={"amp": "fp8"}), "amp must be None or 'bf16'"),
    (dict(conv_kernel=4), "conv_kernel must be odd, got 4"),
    (dict(conv_channels=-1), r"conv_channels must be 'auto' or an int >= 0 \(0: no convolution\), got -1"),
    (dict(conv_stride="2"), r"conv_stride must be 'auto' or an int >= 1, got '2'"),
    (dict(n_networks=0), "n_networks must be an int >= 1, got 0"),
    (dict(augment=1.5), r"augment must be a number in \[0, 1\), got 1.5"),
]


@pytest.mark.parametrize("params,match", BAD_PARAMS, ids=[str(p) for p, _ in BAD_PARAMS])
def test_bad_parameters_one_line_error(data, params, match):
    (X, y), _ = data
    with pytest.raises(ValueError, match=match) as info:
        SeqClassifier(**{**SMALL, **params}).fit(X[:12], y[:12])
    assert "\n" not in str(info.value)


@pytest.mark.requires_cuda
def test_gpu_fit_comes_back_on_the_cpu_and_repeats(data, no_tf32):
    """On a GPU: the fitted network comes back on the CPU (so it pickles for machines without one),
    predictions there match the GPU's, and the same random_state gives the same model (to float
    rounding: cuDNN may reorder sums). In full fp32 (no_tf32): TF32, torch's default for cuDNN and so
    for vlseq_ext.nn, would differ from the CPU by ~1e-3."""
    (X, y), (Xt, yt) = data
    a = SeqClassifier(random_state=0, **dict(SMALL, devices="cuda:0")).fit(X, y)
    assert all(p.device.type == "cpu" for p in a.models_[0].parameters()) and a.score(Xt, yt) >= 0.9
    c = pickle.loads(pickle.dumps(a)).set_params(devices="cpu")
    np.testing.assert_allclose(c.predict_proba(Xt), a.predict_proba(Xt), atol=1e-4)
    fixed = dict(SMALL, devices="cuda:0", n_epochs=10, patience=None, validation_fraction=0.0)
    b1 = SeqClassifier(random_state=3, **fixed).fit(X, y)
    b2 = SeqClassifier(random_state=3, **fixed).fit(X, y)
    np.testing.assert_allclose(b1.predict_proba(Xt), b2.predict_proba(Xt), atol=1e-4)
