"""The estimators' parts that need no aeon: SeqNet's padded batches against each series alone (values
and gradients, float64), SeqNet under ParallelTrainer against per-series float64 passes, the input
checks, scaling and validation split, and the package without aeon."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from vlseq_ext import ParallelTrainer
from vlseq_ext.estimators.network import SeqNet
from vlseq_ext.estimators.training import Scaler, as_series, augmented, trainer_options, validation_folds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = [  # rnn, bidirectional, layers, pooling, length_feature, (conv channels, kernel, stride)
    ("gru", True, 1, "meanmax", True, (0, 5, 1)),
    ("lstm", True, 2, "last", False, (4, 3, 1)),
    ("gru", False, 2, "max", False, (0, 5, 1)),
    ("lstm", False, 1, "mean", True, (3, 5, 2)),
    ("gru", True, 2, "last", True, (2, 7, 3)),
    ("lstm", True, 1, "max", False, (0, 5, 1)),
]


def ragged(rand, n=5, dim=3, lo=1, hi=13):
    lengths = [int(v) for v in torch.randint(lo, hi, (n,), generator=rand.generator())]
    return [rand.randn(L, dim, dtype=torch.float64) for L in lengths]


@pytest.mark.parametrize("rnn,bidirectional,layers,pooling,length_feature,conv", CONFIGS)
def test_padded_batch_equals_each_series_alone(rand, rnn, bidirectional, layers, pooling, length_feature, conv):
    torch.manual_seed(rand.seed % 2**31)
    net = SeqNet(3, 4, hidden_dim=5, num_layers=layers, rnn=rnn, bidirectional=bidirectional, dropout=0.0,
                 pooling=pooling, length_feature=length_feature, conv_channels=conv[0], conv_kernel=conv[1],
                 conv_stride=conv[2]).double()
    xs = ragged(rand)
    net.set_length_stats([len(x) for x in xs])
    T = max(len(x) for x in xs) + 4
    pad = rand.randn(len(xs), T, 3, dtype=torch.float64, scale=100.0)  # padding of any value must not leak in
    for i, x in enumerate(xs):
        pad[i, :len(x)] = x
    lengths = torch.tensor([len(x) for x in xs])
    weights = rand.randn(len(xs), 4, dtype=torch.float64)

    out = net.forward_padded(pad, lengths)
    (out * weights).sum().backward()
    batch_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    alone = torch.cat([net(x) for x in xs])
    sum((net(x) * w).sum() for x, w in zip(xs, weights)).backward()
    torch.testing.assert_close(out, alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(net(xs), alone, rtol=1e-12, atol=1e-12)  # a list runs padded with zeros
    for g, p in zip(batch_grads, net.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)


def test_output_depends_on_the_series_and_its_length_feature(rand):
    torch.manual_seed(0)
    net = SeqNet(2, 3, hidden_dim=4, pooling="mean", length_feature=True).double()
    x = rand.randn(6, 2, dtype=torch.float64)
    twice = torch.cat([x, x])  # the same mean-pooled steps would not tell these apart without the length
    net.set_length_stats([6, 12])
    assert not torch.allclose(net(x), net(twice))
    assert torch.allclose(net.length_stats, torch.tensor([float(np.log(6) + np.log(12)) / 2, np.log(2) / 2]))
    with pytest.raises(ValueError, match="pooling must be one of"):
        SeqNet(2, 3, pooling="sum")
    with pytest.raises(ValueError, match="dropout must be in"):
        SeqNet(2, 3, dropout=1.0)


def test_trainer_step_on_seqnet_matches_float64_reference(rand):
    """ParallelTrainer runs SeqNet as padded lists on CPU replicas: the merged gradient must be that of
    per-series float64 passes (reduction mean, as the estimators train)."""
    torch.manual_seed(rand.seed % 2**31)
    net = SeqNet(3, 4, hidden_dim=6, rnn="lstm", bidirectional=True, pooling="meanmax", length_feature=True)
    xs = [x.float() for x in ragged(rand, n=7)]
    net.set_length_stats([len(x) for x in xs])
    ys = [torch.tensor(int(c)) for c in torch.randint(0, 4, (7,), generator=rand.generator())]
    ref = copy.deepcopy(net).double()
    loss = sum(nn.functional.cross_entropy(ref(x.double()), y.view(1)) for x, y in zip(xs, ys)) / len(xs)
    loss.backward()
    loss = loss.detach()
    trainer = ParallelTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                              devices="cpu:2", samples_per_device=4, reduction="mean", process_group=None)
    try:
        got = trainer.compute_gradients(xs, ys)
    finally:
        trainer.close()
    assert abs(float(got) - loss.item()) <= 1e-5 * loss.item()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        err = (p.grad.double() - q.grad).norm() / q.grad.norm().clamp(min=1e-12)
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


def test_as_series_transposes_and_names_bad_series():
    X = [np.arange(10.0).reshape(2, 5), np.ones(3)[None, :]]
    with pytest.raises(ValueError, match=r"^X: series 1 has 1 channel\(s\) but series 0 has 2$"):
        as_series(X)
    out = as_series([np.arange(10.0).reshape(2, 5), np.ones((2, 3))])
    assert out[0].shape == (5, 2) and out[0].dtype == np.float32 and out[0][4, 1] == 9.0
    cases = [
        ([np.ones((2, 0))], r"series 0 is empty"),
        ([np.ones((2, 4)), np.array([[1.0, np.inf], [0.0, 0.0]])], r"series 1 has the value inf at channel 0, step 1"),
        ([np.array([[1.0, 1e39]])], r"series 0 has the value 1e\+39 at channel 0, step 1, which overflows float32"),
        ([np.ones((1, 2, 2))], r"series 0 has shape \(1, 2, 2\)"),
    ]
    for X, match in cases:
        with pytest.raises(ValueError, match=match):
            as_series(X)
    with pytest.raises(ValueError, match="series 0 has 3 channel.s. but the estimator was fitted on 2"):
        as_series([np.ones((3, 4))], n_channels=2)


def test_scaling_is_fitted_on_what_it_is_given(rand):
    series = [np.asarray(rand.randn(int(L), 3)) * [1.0, 50.0, 0.0] + [5.0, -3.0, 7.0] for L in (4, 9, 13)]
    sc = Scaler("standard").fit(series)
    out = np.concatenate(sc.transform(series))
    np.testing.assert_allclose(out[:, :2].mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(out[:, :2].std(0), 1.0, atol=1e-4)
    np.testing.assert_allclose(out[:, 2], 0.0)  # a constant channel: shifted, not divided by 0
    per = Scaler("series").transform(series)
    for s in per:
        np.testing.assert_allclose(s[:, :2].mean(0), 0.0, atol=1e-5)
    assert Scaler(None).transform(series)[1] is series[1]
    with pytest.raises(ValueError, match="scaling must be one of"):
        Scaler("minmax")


def test_validation_folds_are_stratified_and_cover_every_series():
    y = np.repeat(np.arange(10), 5)
    folds = validation_folds(y, 0.2, seed=3, stratify=True, count=6)
    for tr, va in folds:
        assert sorted(np.concatenate([tr, va]).tolist()) == list(range(50))
        assert np.bincount(y[va]).tolist() == [1] * 10 and np.bincount(y[tr]).tolist() == [4] * 10
    assert sorted(np.concatenate([va for _, va in folds[:5]]).tolist()) == list(range(50))  # 5 disjoint folds
    assert folds[5][1].tolist() == folds[0][1].tolist()  # the sixth network validates on fold 0 again
    again = validation_folds(y, 0.2, seed=3, stratify=True)
    assert len(again) == 1 and again[0][1].tolist() == folds[0][1].tolist()  # the seed fixes them
    assert validation_folds(np.array([0, 0, 1, 1, 2]), 0.2, 0, True)[0][1] is None  # class 2 has one series
    assert validation_folds(np.arange(3.0), 0.5, 0, False)[0][1] is None  # too few series
    assert [len(va) for _, va in validation_folds(np.zeros(10), 0.3, 0, False, 3)] == [4, 3, 3]
    assert all(va is None and len(tr) == 50 for tr, va in validation_folds(y, 0.0, 0, True, 2))


def test_augmented_series_stretch_scale_and_repeat(rand):
    x = rand.randn(40, 3)
    assert torch.equal(augmented(x, 0.0, np.random.default_rng(0)), x)
    draws = [augmented(x, 0.2, np.random.default_rng(s)) for s in range(20)]
    assert all(d.shape[1] == 3 and d.dtype == torch.float32 for d in draws)
    lengths = {len(d) for d in draws}
    assert len(lengths) > 3 and min(lengths) >= 20 and max(lengths) <= 80  # exp(N(0, 0.2)) stretches
    assert torch.equal(augmented(x, 0.2, np.random.default_rng(3)), draws[3])
    for d in draws:  # x stretched to the draw's length, then scaled and noisy: near it, not equal to it
        pos = np.linspace(0, 39, len(d))
        stretched = np.stack([np.interp(pos, np.arange(40), x[:, c].numpy()) for c in range(3)], axis=1)
        assert 0.05 < float(np.std(d.numpy() - stretched)) < 1.0


def test_trainer_kwargs_are_checked_by_name():
    assert trainer_options({"amp": "bf16", "lanes": 2}) == {"amp": "bf16", "lanes": 2}
    with pytest.raises(ValueError, match="devices, samples_per_device are the estimator's own parameters"):
        trainer_options({"samples_per_device": 2, "devices": "cpu"})
    with pytest.raises(ValueError, match="unknown ParallelTrainer argument.s. bogus"):
        trainer_options({"bogus": 1})
    with pytest.raises(ValueError, match="must be a dict"):
        trainer_options([("amp", "bf16")])


def test_package_works_without_aeon():
    """aeon blocked: vlseq_ext and the network import, the estimators say how to get aeon."""
    code = ("import sys; sys.modules['aeon'] = None\n"
            "import vlseq_ext, vlseq_ext.data\n"
            "from vlseq_ext.estimators import SeqNet\n"
            "try:\n    from vlseq_ext.estimators import SeqClassifier\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("ImportError: vlseq_ext.estimators needs aeon: pip install 'vlseq_ext[ts]' "
                                  "(or pip install aeon)")
