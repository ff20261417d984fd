"""vlseq_ext.replicas.GradientMerger on CPU "devices" (deep copies of one model) and, under
requires_2gpu, on cuda:0 and cuda:1.

The oracle is computed separately in float64: every copy's grads are saved after its own backward,
summed in float64 and scaled. The merger sums in fp32, so the comparison allows rtol 1e-5 plus the
fp32 accumulation error relative to sum |g| (needed where the copies' grads nearly cancel).
"""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_same_bits, bits
import torch.nn.functional as F
from torch import nn

from vlseq_ext import ops
from vlseq_ext.training.replicas import GradientMerger
from vlseq_ext.models import SeqModel

pytestmark = pytest.mark.usefixtures("compiled_ops")

MODELS = {
    "lstm": lambda: SeqModel(),
    "gru2bi": lambda: SeqModel(rnn="gru", num_layers=2, bidirectional=True, hidden_dim=16),
}


def flat_pipeline_merge(params_per_device, scale: float) -> None:
    """The classic pipeline, from the ops: flatten per device, all_reduce_, unflatten_ with the scale."""
    grads = [[p.grad for p in ps] for ps in params_per_device]
    flats = [ops.flatten(gs) for gs in grads]
    ops.all_reduce_(flats, "sum")
    for gs, flat in zip(grads, flats):
        ops.unflatten_(flat, gs, scale)


def make_replicas(rand, kind: str, devices):
    """One model with fresh random weights, deep-copied onto each device."""
    base = MODELS[kind]()
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(rand.randn(*p.shape, scale=0.3))
    return [copy.deepcopy(base).to(d) for d in devices]


def backward_each(rand, replicas):
    """Every copy gets a different random sample (random length) and its own backward."""
    for m in replicas:
        dev = next(m.parameters()).device
        length = rand.py.randint(5, 60)
        x = rand.randn(length, 36, device=dev)
        y = rand.randn(1, 1, device=dev)
        F.mse_loss(m(x), y).backward()


def grads64(replicas):
    return [[torch.zeros(p.shape, dtype=torch.float64) if p.grad is None else p.grad.detach().cpu().double().clone()
             for p in m.parameters()] for m in replicas]


def assert_merged(replicas, per_copy, scale: float) -> None:
    """Every copy's grads equal scale * sum of per_copy (float64), and all copies are bit-identical."""
    n = len(replicas)
    params = [list(m.parameters()) for m in replicas]
    for p in range(len(params[0])):
        exact = sum(per_copy[d][p] for d in range(n)) * scale
        abs_sum = sum(per_copy[d][p].abs() for d in range(n)) * abs(scale)
        bound = 1e-5 * exact.abs() + (n + 3) * 2.0**-24 * abs_sum
        got = params[0][p].grad
        assert got is not None, f"parameter {p} has no grad after merge"
        err = (got.detach().cpu().double() - exact).abs()
        worst = (err - bound).max().item()
        assert worst <= 0, f"parameter {p}: off the float64 sum by up to {err.max().item():.3g}"
        for d in range(1, n):
            assert_same_bits(params[d][p].grad, got, f"parameter {p}: device {d} vs device 0")


@pytest.mark.parametrize("scale", [1.0, 1.0 / 3.0])
@pytest.mark.parametrize("ndev", [1, 2, 3])
@pytest.mark.parametrize("kind", list(MODELS))
def test_merge_equals_scaled_sum(kind, ndev, scale, rand):
    replicas = make_replicas(rand, kind, ["cpu"] * ndev)
    backward_each(rand, replicas)
    per_copy = grads64(replicas)
    if ndev > 1:
        assert not torch.equal(per_copy[0][0], per_copy[1][0]), "copies should have different grads"
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    merger.merge(scale)
    assert_merged(replicas, per_copy, scale)


@pytest.mark.parametrize("scale", [1.0, 0.1])
@pytest.mark.parametrize("ndev", [1, 2, 3])
@pytest.mark.parametrize("kind", list(MODELS))
def test_fused_merge_and_flat_op_pipeline_agree(kind, ndev, scale, rand):
    a = make_replicas(rand, kind, ["cpu"] * ndev)
    backward_each(rand, a)
    b = [copy.deepcopy(m) for m in a]
    for ma, mb in zip(a, b):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = pa.grad.clone()
    GradientMerger([list(m.parameters()) for m in a]).merge(scale)
    flat_pipeline_merge([list(m.parameters()) for m in b], scale)
    for d, (ma, mb) in enumerate(zip(a, b)):
        for p, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
            assert_same_bits(pa.grad, pb.grad, f"device {d} parameter {p}: fused vs flat")


def test_none_grad_counts_as_zeros(rand):
    replicas = make_replicas(rand, "lstm", ["cpu"] * 3)
    backward_each(rand, replicas)
    replicas[1].fc.bias.grad = None                 # missing on one device
    for m in replicas:
        m.fc.weight.grad = None                     # missing everywhere
    per_copy = grads64(replicas)                    # None -> zeros
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    merger.merge(0.5)
    assert_merged(replicas, per_copy, 0.5)
    for m in replicas:
        assert (bits(m.fc.weight.grad) == 0).all(), "all-None parameter must merge to +0.0"
        assert m.fc.weight.grad.shape == m.fc.weight.shape
    # the zero grads the merger created are reused by later merges
    kept = [m.fc.bias.grad for m in replicas]
    for m in replicas:
        m.zero_grad(set_to_none=False)
    backward_each(rand, replicas)
    per_copy = grads64(replicas)
    merger.merge(1.0)
    assert_merged(replicas, per_copy, 1.0)
    assert all(m.fc.bias.grad is k for m, k in zip(replicas, kept))


def test_merge_after_zero_grad_set_to_none(rand):
    """New .grad objects (optimizer.zero_grad(set_to_none=True)) must be picked up, not the
    cached old ones."""
    replicas = make_replicas(rand, "gru2bi", ["cpu"] * 2)
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    for step in range(3):
        for m in replicas:
            m.zero_grad(set_to_none=True)
        backward_each(rand, replicas)
        per_copy = grads64(replicas)
        merger.merge(0.25)
        assert_merged(replicas, per_copy, 0.25)


@pytest.mark.parametrize("device_index", [0, 1, 2])
def test_grad_norm(device_index, rand):
    replicas = make_replicas(rand, "gru2bi", ["cpu"] * 3)
    backward_each(rand, replicas)
    replicas[device_index].fc.bias.grad = None
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    before = [[p.grad.clone() if p.grad is not None else None for p in m.parameters()] for m in replicas]
    norm = merger.grad_norm(device_index)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicas[device_index].parameters()]
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert norm.dtype == torch.float32 and norm.dim() == 0
    torch.testing.assert_close(norm, expected)
    # a different device's norm is a different number (the grads differ), so the index is honoured
    other = (device_index + 1) % 3
    assert merger.grad_norm(other).item() != norm.item()
    for m, bs in zip(replicas, before):
        for p, b in zip(m.parameters(), bs):
            if b is not None:
                assert_same_bits(p.grad, b, "grad_norm modified a grad")


@pytest.mark.parametrize("src_index", [0, 2])
def test_broadcast_parameters(src_index, rand):
    replicas = make_replicas(rand, "lstm", ["cpu"] * 3)
    with torch.no_grad():
        for m in replicas:
            for p in m.parameters():
                p.copy_(rand.randn(*p.shape))
    src = [p.detach().clone() for p in replicas[src_index].parameters()]
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    merger.broadcast_parameters(src_index)
    for d, m in enumerate(replicas):
        for i, (p, s) in enumerate(zip(m.parameters(), src)):
            assert_same_bits(p.detach(), s, f"device {d} parameter {i}")
            assert p.requires_grad


def test_bad_input_empty_list():
    with pytest.raises(ValueError, match=r"GradientMerger: params_per_device is empty"):
        GradientMerger([])


def test_bad_input_model_without_parameters():
    with pytest.raises(ValueError, match=r"GradientMerger: the model has no parameters"):
        GradientMerger([list(nn.ReLU().parameters()), list(nn.ReLU().parameters())])


def test_bad_input_mismatched_shapes():
    a, b = SeqModel(), SeqModel(hidden_dim=32)
    with pytest.raises(ValueError, match=r"GradientMerger: parameter 0 of device list 1 is \(128, 36\) torch.float32, "
                                         r"list 0 has \(256, 36\) torch.float32"):
        GradientMerger([list(a.parameters()), list(b.parameters())])


def test_bad_input_mismatched_parameter_count():
    a, b = SeqModel(), SeqModel(num_layers=2)
    with pytest.raises(ValueError, match=r"GradientMerger: device list 1 has 10 parameters, list 0 has 6"):
        GradientMerger([list(a.parameters()), list(b.parameters())])


def test_bad_input_mismatched_dtypes():
    a, b = SeqModel(), SeqModel().double()
    with pytest.raises(ValueError, match=r"GradientMerger: parameter 0 of device list 1 is \(256, 36\) torch.float64"):
        GradientMerger([list(a.parameters()), list(b.parameters())])


@pytest.mark.requires_cuda
def test_bad_input_same_cuda_device_twice():
    a, b = SeqModel().cuda(), SeqModel().cuda()
    with pytest.raises(ValueError, match=r"GradientMerger: devices must be distinct"):
        GradientMerger([list(a.parameters()), list(b.parameters())])


# --------------------------------------------------------------------------------------------
# two GPUs
# --------------------------------------------------------------------------------------------


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("scale", [1.0, 1.0 / 3.0])
@pytest.mark.parametrize("kind", list(MODELS))
def test_merge_2gpu(kind, scale, rand):
    devices = ["cuda:0", "cuda:1"]
    a = make_replicas(rand, kind, devices)
    backward_each(rand, a)
    b = [copy.deepcopy(m) for m in a]
    for ma, mb in zip(a, b):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            pb.grad = pa.grad.clone()
    per_copy = grads64(a)
    GradientMerger([list(m.parameters()) for m in a]).merge(scale)
    flat_pipeline_merge([list(m.parameters()) for m in b], scale)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert_merged(a, per_copy, scale)
    assert_merged(b, per_copy, scale)
    for d, (ma, mb) in enumerate(zip(a, b)):
        for p, (pa, pb) in enumerate(zip(ma.parameters(), mb.parameters())):
            assert_same_bits(pa.grad, pb.grad, f"cuda:{d} parameter {p}: fused vs flat")


@pytest.mark.requires_2gpu
def test_merge_2gpu_repeated_steps(rand):
    """Several steps without a host sync between backward and merge (the trainer's pattern)."""
    replicas = make_replicas(rand, "lstm", ["cuda:0", "cuda:1"])
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    for step in range(5):
        for m in replicas:
            m.zero_grad(set_to_none=step % 2 == 0)
        backward_each(rand, replicas)
        per_copy = grads64(replicas)
        merger.merge(0.5)
        assert_merged(replicas, per_copy, 0.5)


@pytest.mark.requires_2gpu
def test_grad_norm_and_broadcast_parameters_2gpu(rand):
    replicas = make_replicas(rand, "gru2bi", ["cuda:0", "cuda:1"])
    backward_each(rand, replicas)
    merger = GradientMerger([list(m.parameters()) for m in replicas])
    for d in range(2):
        grads = [p.grad for p in replicas[d].parameters()]
        expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
        norm = merger.grad_norm(d)
        assert norm.device == torch.device("cuda", d)
        torch.testing.assert_close(norm, expected)
    with torch.no_grad():
        for p in replicas[1].parameters():
            p.copy_(rand.randn(*p.shape, device="cuda:1"))
    src = [p.detach().clone() for p in replicas[0].parameters()]
    merger.broadcast_parameters(0)
    for i, (p, s) in enumerate(zip(replicas[1].parameters(), src)):
        assert_same_bits(p.detach(), s, f"parameter {i} on cuda:1")
