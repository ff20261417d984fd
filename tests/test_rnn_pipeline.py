"""The layer pipeline of vlseq_ext.nn.functional (a unidirectional stack run over time windows, the
windows of different layers side by side on the GPU) and its rule, and the rule for running a
bidirectional layer's two directions at once: the same outputs, final states and gradients as
layer after layer, for any window count, lengths that end before, inside and at a window's edge, given
states, no biases, and inter-layer dropout (its masks drawn as documented). Runs on the CPU kernels;
the GPU tests run it on the streams (tests/test_rnn_gpu.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from vlseq_ext import ops
from vlseq_ext.nn import concurrency, functional

pytestmark = pytest.mark.usefixtures("compiled_ops")


def run(module, x, lengths, hx, chunks, up):
    x = x.detach().clone().requires_grad_()
    hx = None if hx is None else tuple(h.detach().clone().requires_grad_() for h in hx)
    state = None if hx is None else (hx if isinstance(module, nn.LSTM) else hx[0])
    out, h_n, c_n = functional.rnn(module, x, lengths, state, chunks=chunks)
    loss = (out * up[0]).sum() + (h_n * up[1]).sum() + (0 if c_n is None else (c_n * up[2]).sum())
    ins = [x, *(hx or ()), *module.parameters()]
    return [out, h_n] + ([] if c_n is None else [c_n]) + list(torch.autograd.grad(loss, ins))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("chunks", [2, 3, 7])
@pytest.mark.parametrize("layers,bias,with_state", [(2, True, True), (3, False, False)])
def test_windows_equal_layer_after_layer(rand, cls, chunks, layers, bias, with_state):
    torch.manual_seed(rand.seed % 2**31)
    module = cls(3, 5, num_layers=layers, bias=bias, batch_first=True)
    T = 20
    lengths = torch.tensor([20, 1, 7, 10, 13, 3, 0])  # inside, before and at the edges of the windows; none
    x = rand.randn(len(lengths), T, 3)
    x[torch.arange(T)[None, :] >= lengths[:, None]] = 0
    hx = None
    if with_state:
        hx = (rand.randn(layers, len(lengths), 5),) + ((rand.randn(layers, len(lengths), 5),) if cls is nn.LSTM else ())
    up = [rand.randn(len(lengths), T, 5), rand.randn(layers, len(lengths), 5), rand.randn(layers, len(lengths), 5)]
    want = run(module, x, lengths, hx, 1, up)
    got = run(module, x, lengths, hx, chunks, up)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"result {i}: {m}")


def test_dropout_masks_between_layers(rand):
    """Training mode: layer l >= 1 reads its input times a mask drawn, after the seed, as
    empty(B, T, H).bernoulli_(1 - p) / (1 - p) for l = 1, 2, ... (the same for every window)."""
    torch.manual_seed(3)
    module = nn.LSTM(3, 4, num_layers=3, dropout=0.4, batch_first=True).train()
    lengths = torch.tensor([9, 4, 12])
    x = rand.randn(3, 12, 3)
    x[torch.arange(12)[None, :] >= lengths[:, None]] = 0
    torch.manual_seed(11)
    out, h_n, c_n = functional.rnn(module, x, lengths, chunks=3)
    torch.manual_seed(11)
    masks = [x.new_empty(3, 12, 4).bernoulli_(0.6).div_(0.6) for _ in range(2)]
    layer_in, hs = x, []
    for layer in range(3):
        single = nn.LSTM(layer_in.shape[-1], 4, batch_first=True)
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(single, f"{name}_l0").data.copy_(getattr(module, f"{name}_l{layer}"))
        y, h, _ = functional.rnn(single, layer_in if layer == 0 else layer_in * masks[layer - 1], lengths)
        layer_in, hs = y, hs + [h[0]]
    torch.testing.assert_close(out, layer_in, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_n, torch.stack(hs), rtol=1e-5, atol=1e-6)
    assert 0 < (masks[0] == 0).float().mean() < 1  # the masks did drop something


def test_pipeline_rule():
    """Stacks whose layers' launches take at most half the SMs: windows of >= 48 steps, at most 8;
    at most all the SMs on clusters of up to 8 blocks: at most 4; never the grid layout here
    (pipeline_layout plans it on a share of the SMs)."""
    cluster = "cluster 16 blocks x 1 groups, 16 units and 1 samples per block, shared memory 67/70 KiB"
    assert concurrency.pipeline_chunks(cluster, 2, 480, 132) == 8
    assert concurrency.pipeline_chunks(cluster, 2, 100, 132) == 2
    assert concurrency.pipeline_chunks(cluster, 2, 47, 132) == 1
    assert concurrency.pipeline_chunks(cluster, 1, 480, 132) == 1
    wide = "cluster 8 blocks x 11 groups, 32 units and 3 samples per block, shared memory 140/141 KiB"
    assert concurrency.pipeline_chunks(wide, 2, 480, 132) == 1  # 176 blocks > 66
    eight = "cluster 8 blocks x 8 groups, 32 units and 1 samples per block, shared memory 132/134 KiB"
    assert concurrency.pipeline_chunks(eight, 2, 480, 132) == 4  # 128 of 132 SMs
    assert concurrency.pipeline_chunks(eight, 2, 150, 132) == 3
    assert concurrency.pipeline_chunks(eight, 3, 480, 132) == 1  # 192 blocks
    assert concurrency.pipeline_chunks(eight, 2, 480, 256) == 8
    sixteen = "cluster 16 blocks x 4 groups, 16 units and 8 samples per block, shared memory 16/50 KiB"
    assert concurrency.pipeline_chunks(sixteen, 2, 480, 132) == 1  # clusters of 16 and 128 SMs
    assert concurrency.pipeline_chunks(sixteen, 2, 480, 256) == 8
    single = "local 1 blocks x 60 groups, 64 units and 1 samples per block"
    assert concurrency.pipeline_chunks(single, 2, 480, 132) == 4
    grid = "grid 22 blocks x 6 groups, 24 units and 6 samples per block, h staged 512 columns at a time"
    assert concurrency.pipeline_chunks(grid, 2, 480, 1000) == 1
    # A forward and a backward on layouts of their own: the largest cluster and the most blocks of the two.
    split = ("cluster 8 blocks x 8 groups, 32 units and 1 samples per block, fused cell and W_hh in registers, "
             "shared memory 2 KiB; backward: cluster 16 blocks x 4 groups, 16 units and 2 samples per block, fused "
             "cell and W_hh in registers, by reduce-scatter, shared memory 12 KiB")
    assert concurrency.pipeline_chunks(split, 2, 480, 132) == 1  # the backward's clusters of 16
    assert concurrency.pipeline_chunks(split, 2, 480, 256) == 8
    assert concurrency.pipeline_chunks(split.replace("x 4 groups", "x 5 groups"), 2, 480, 256) == 1  # 80 > 64
    assert concurrency.pipeline_chunks(split.replace("16 blocks x 4", "8 blocks x 4"), 2, 480, 132) == 4


def test_pipeline_layout_of_grid_stacks():
    """A stack whose layer takes the grid on the whole GPU is pipelined where a grid plan for an equal share of
    the SMs per layer exists and every layer's launches fit beside the others' (at most 4 windows of >= 48
    steps, each launch planned for the share); other stacks as pipeline_chunks says, on the whole GPU."""
    whole = ("grid 114 blocks x 1 groups, 9 units and 8 samples per block, W_hh and h in 16 bits, fp16 products on "
             "the tensor cores (forward), shared memory 29 KiB; backward: grid 64 blocks x 2 groups, 16 units and 4 "
             "samples per block, W_hh and the gate gradients in 16 bits, fp16 products on the tensor cores (backward), "
             "shared memory 72 KiB")
    half = ("grid 64 blocks x 1 groups, 16 units and 8 samples per block, W_hh, h and the gate gradients in 16 bits, "
            "fp16 products on the tensor cores (forward and backward), shared memory 33/73 KiB")
    asked = []

    def plan_for(blocks):
        asked.append(blocks)
        return {0: whole, 66: half}.get(blocks, "")

    assert concurrency.pipeline_layout(plan_for, 2, 480, 132) == (4, 66) and asked == [0, 66]
    assert concurrency.pipeline_layout(plan_for, 2, 100, 132) == (2, 66)
    assert concurrency.pipeline_layout(plan_for, 2, 480, 132, grid=False) == (1, 0)  # a host-bound call
    assert concurrency.pipeline_layout(plan_for, 2, 95, 132) == (1, 0)  # one window: the whole GPU
    assert concurrency.pipeline_layout(plan_for, 3, 480, 132) == (1, 0)  # no plan within 44 SMs
    assert concurrency.pipeline_layout(plan_for, 1, 480, 132) == (1, 0)
    assert concurrency.pipeline_layout(lambda b: {0: whole, 66: whole}[b], 2, 480, 132) == (1, 0)  # 228 > 132
    assert concurrency.pipeline_layout(lambda b: {0: whole, 66: ""}[b], 2, 480, 132) == (1, 0)  # fp32: none fits
    cluster = "cluster 16 blocks x 1 groups, 16 units and 1 samples per block, shared memory 67/70 KiB"
    assert concurrency.pipeline_layout(lambda b: cluster, 2, 480, 132) == (8, 0)
    assert concurrency.pipeline_layout(lambda b: cluster, 2, 480, 132, grid=False) == (8, 0)


def test_side_by_side_rule():
    """The two directions of a layer run at once when both launches fit on the GPU together (a grid plan's
    cooperative launches too)."""
    assert concurrency.side_by_side("cluster 4 blocks x 16 groups, 64 units and 2 samples per block", 132)
    assert not concurrency.side_by_side("cluster 8 blocks x 11 groups, 32 units and 3 samples per block", 132)
    assert concurrency.side_by_side("grid 22 blocks x 2 groups, 24 units and 6 samples per block", 88)
    assert not concurrency.side_by_side("grid 22 blocks x 2 groups, 24 units and 6 samples per block", 87)
    wide_forward = "cluster 8 blocks x 4 groups, 32 units and 8 samples per block, shared memory 152 KiB; backward: "
    assert concurrency.side_by_side(wide_forward + "cluster 16 blocks x 4 groups, 16 units and 8 samples per block", 132)
    assert not concurrency.side_by_side(wide_forward + "cluster 16 blocks x 5 groups, 16 units and 7 samples per block",
                                        132)  # the backward's 80 blocks


def test_each_direction_gets_half_the_gpu_when_a_plan_fits_there():
    asked = []

    def plan_for(blocks):
        asked.append(blocks)
        return {66: "cluster 16 blocks x 4 groups, 16 units and 8 samples per block"}.get(blocks, "")

    assert concurrency.direction_blocks(plan_for, 132) == 66 and asked == [66]
    assert concurrency.direction_blocks(plan_for, 100) == 0  # no plan within 50 blocks: one after the other
    grid = "grid 22 blocks x 2 groups, 24 units and 6 samples per block"
    assert concurrency.direction_blocks(lambda blocks: grid, 132) == 66
    assert concurrency.direction_blocks(lambda blocks: grid, 80) == 0  # 88 blocks


@pytest.mark.parametrize("chunks", [1, 3])
def test_frozen_layer_gets_no_gradient_and_the_others_are_unchanged(rand, chunks):
    """Weight gradients are computed only where asked: with layer 0 frozen, layer 1's gradients are
    those of the unfrozen stack, layer-by-layer or pipelined."""
    torch.manual_seed(rand.seed % 2**31)
    module = nn.GRU(3, 5, num_layers=2, batch_first=True)
    lengths = torch.tensor([12, 5, 9])
    x = rand.randn(3, 12, 3)
    x[torch.arange(12)[None, :] >= lengths[:, None]] = 0
    out, h_n, _ = functional.rnn(module, x, lengths, chunks=chunks)
    upper = [p for n, p in module.named_parameters() if n.endswith("l1")]
    want = torch.autograd.grad(out.square().sum() + h_n.sum(), upper)
    for n, p in module.named_parameters():
        p.requires_grad_(n.endswith("l1"))
        p.grad = None
    out, h_n, _ = functional.rnn(module, x, lengths, chunks=chunks)
    (out.square().sum() + h_n.sum()).backward()
    assert all(p.grad is None for n, p in module.named_parameters() if n.endswith("l0"))
    for p, w in zip(upper, want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


def test_max_blocks_reaches_every_window_and_excludes_side_by_side(rand, monkeypatch):
    """functional.rnn's max_blocks bounds every launch, a pipelined stack's windows included (forward
    and backward); with side-by-side directions, which set their own share, it is refused, not ignored."""
    module = nn.LSTM(3, 4, num_layers=2, batch_first=True)
    x, lengths = rand.randn(2, 5, 3), torch.tensor([5, 3])
    seen = []
    for name in ("rnn_forward", "rnn_backward"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: seen.append((_name, a[-1])) or _real(*a))
    out, h_n, _ = functional.rnn(module, x.requires_grad_(), lengths, chunks=2, max_blocks=8)
    (out.sum() + h_n.sum()).backward()
    # 2 layers x 2 windows, each way
    assert sorted(seen) == [("rnn_backward", 8)] * 4 + [("rnn_forward", 8)] * 4
    with pytest.raises(ValueError, match="max_blocks"):
        functional.rnn(module, x, lengths, side_by_side_blocks=66, max_blocks=8)


def test_sm_budget_nests_and_stays_on_its_thread():
    """sm_budget is per thread (the trainer sets it around one device's lanes) and restores what was
    there on exit, errors included; a budget of 0 (more lanes than SMs) is still a budget."""
    import threading
    assert concurrency.budget() is None
    seen = []
    with concurrency.sm_budget(16):
        t = threading.Thread(target=lambda: seen.append(concurrency.budget()))
        t.start()
        t.join()
        with pytest.raises(RuntimeError):
            with concurrency.sm_budget(8):
                assert concurrency.budget() == 8
                raise RuntimeError("inside")
        assert concurrency.budget() == 16
        with concurrency.sm_budget(-3):
            assert concurrency.budget() == 0
    assert concurrency.budget() is None and seen == [None]
