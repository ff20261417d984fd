"""The persistent LSTM/GRU kernels on the GPU against float64: outputs, final states and every
gradient (inputs, weights, biases, h0/c0) within 1e-5 relative in fp32, over random lengths (1
included), long sequences, odd sizes, batches 1-256, bidirectional and multi-layer layers, every
layout the planner picks (one block, clusters, the grid); the same bits run to run and in CUDA-graph
replays; TF32 and bf16 modes within their documented tolerances.

The oracle is torch's own module in float64 on a PackedSequence (each sample its own length)."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import vlseq_ext.nn as vnn
from vlseq_ext import ops
from vlseq_ext.nn import concurrency

from helpers import assert_same_bits, mm_operands

pytestmark = [pytest.mark.requires_cuda, pytest.mark.usefixtures("no_tf32")]
DEV = "cuda"

# The TF32 kernels' error, relative norm, against the fp32 kernels (W_hh and h or the gate gradients
# rounded to TF32's 10-bit mantissa, products summed in fp32): 0.5-3.9e-4 measured over 30 steps
# (BENCHMARKS.md, thirteenth session), 5x that allowed; the fp32 kernels stay within 1e-5. The kernels in
# 16 bits round W_hh and h or the gate gradients to the same 11 significant bits (under scales).
TF32_OP_TOL = 2e-3
HALF_FORWARD = "W_hh and h in 16 bits, fp16 products on the tensor cores (forward)"
HALF_BACKWARD = "W_hh and the gate gradients in 16 bits, fp16 products on the tensor cores (backward)"
HALF_BOTH = "W_hh, h and the gate gradients in 16 bits, fp16 products on the tensor cores (forward and backward)"
TAGGED = "h passed in tagged lines, no barrier a step (forward)"
SCATTER = "partial dh passed in tagged lines, no barrier a step (backward)"
LENS32 = [30, 1, 17, 17, 0, 30, 3, 25, 1, 9, 30, 17, 2, 29, 12, 6] * 2


def both_in_16_bits(plan: str) -> bool:
    """Whether the plan's forward and backward both run the 16-bit grid kernels."""
    return HALF_BOTH in plan or (HALF_FORWARD in plan and HALF_BACKWARD in plan)


def make(rand, cls, D, H, layers=1, bidirectional=False, bias=True, lengths=(5,), with_state=True):
    torch.manual_seed(rand.seed % 2**31)
    ref = cls(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=True)
    mod = (vnn.LSTM if cls is nn.LSTM else vnn.GRU)(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias,
                                                   batch_first=True)
    mod.load_state_dict(ref.state_dict())
    B, T = len(lengths), max(lengths)
    lens = torch.tensor(lengths)
    x = rand.randn(B, T, D)
    x[torch.arange(T)[None, :] >= lens[:, None]] = 0
    dirs = 2 if bidirectional else 1
    hx = None
    if with_state:
        h0 = rand.randn(layers * dirs, B, H)
        hx = (h0, rand.randn(layers * dirs, B, H)) if cls is nn.LSTM else h0
    return ref, mod.to(DEV), x, lens, hx


def _to(hx, **kw):
    if hx is None:
        return None
    return tuple(h.to(**kw) for h in hx) if isinstance(hx, tuple) else hx.to(**kw)


def run_and_grads(module, x, lens, hx, up, packed_oracle=False):
    """Forward, a fixed random linear loss on every output, and the gradients of x, hx, params."""
    x = x.detach().clone().requires_grad_()
    hx = _to(hx)
    if hx is not None:
        hx = tuple(h.detach().clone().requires_grad_() for h in hx) if isinstance(hx, tuple) else \
            hx.detach().clone().requires_grad_()
    if packed_oracle:
        out, state = module(pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False), hx)
        out = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
    else:
        out, state = module(x, hx, lengths=lens.to(x.device))
    states = state if isinstance(state, tuple) else (state,)
    loss = (out * up[0].to(out)).sum() + sum((s * u.to(s)).sum() for s, u in zip(states, up[1:]))
    ins = [x] + ([] if hx is None else list(hx if isinstance(hx, tuple) else (hx,))) + list(module.parameters())
    grads = torch.autograd.grad(loss, ins)
    # Detached: a live graph would keep the parameters' AccumulateGrad nodes, whose stream is the
    # one of the first backward; a later capture on another stream then syncs with it (the legacy
    # stream), which the capture refuses (torch's rule, not the kernels').
    return [t.detach() for t in (out, *states)], list(grads)


def compare(rand, cls, D, H, layers=1, bidirectional=False, bias=True, lengths=(5,), rtol=1e-5, with_state=True):
    ref, mod, x, lens, hx = make(rand, cls, D, H, layers, bidirectional, bias, lengths, with_state)
    dirs = 2 if bidirectional else 1
    B = len(lengths)
    up = [rand.randn(B, max(lengths), dirs * H, device=DEV)] + \
         [rand.randn(layers * dirs, B, H, device=DEV) for _ in range(2 if cls is nn.LSTM else 1)]
    got, got_g = run_and_grads(mod, x.to(DEV), lens, _to(hx, device=DEV), up)
    ref64 = copy.deepcopy(ref).to(DEV, torch.float64)
    want, want_g = run_and_grads(ref64, x.to(DEV, torch.float64), lens, _to(hx, device=DEV, dtype=torch.float64),
                                 up, packed_oracle=True)
    names = ["output", "h_n", "c_n"][:len(got)]
    names += ["d input"] + (["d h0", "d c0"][:len(got) - 1] if hx is not None else []) + \
        [f"d {n}" for n, _ in mod.named_parameters()]
    for name, a, b in zip(names, got + got_g, want + want_g):
        assert a.dtype == torch.float32, name
        err = ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol} ({cls.__name__} D={D} H={H} layers={layers} " \
                            f"bidirectional={bidirectional} lengths {min(lengths)}..{max(lengths)})"
    return mod, x, lens, hx


def random_lengths(rand, B, low, high):
    lens = [rand.py.randint(low, high) for _ in range(B)]
    lens[rand.py.randrange(B)] = high
    return tuple(lens)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_small_one_block_layout(rand, cls):
    compare(rand, cls, 36, 64, lengths=random_lengths(rand, 8, 1, 40))


@pytest.mark.parametrize("cls,H,B,bidirectional", [(nn.LSTM, 64, 32, True), (nn.GRU, 64, 32, True),
                                                    (nn.LSTM, 33, 6, True), (nn.GRU, 47, 264, False)])
def test_one_block_fused_on_four_warps(rand, cls, H, B, bidirectional):
    """Single blocks of one or two samples on the fused kernels' four worker warps, the backward with
    two units a lane: hidden 64, odd sizes (a lane group whose second unit is past H), two samples a
    block where 264 outnumber the SMs, lengths that end at different steps. The 264 run in one
    direction, so that the plan asserted is the one that runs (a bidirectional layer plans each
    direction on half the SMs); the others run both."""
    plan = ops.rnn_plan("lstm" if cls is nn.LSTM else "gru", H, B, "fp32", DEV)
    assert re.match(rf"local 1 blocks x \d+ groups, {H} units and [12] samples per block, fused cell and W_hh in "
                    r"registers \(forward and backward\)", plan), plan
    compare(rand, cls, 36, H, bidirectional=bidirectional, lengths=random_lengths(rand, B, 1, 60))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_wide_two_layer_one_sample_480_steps(rand, cls):
    compare(rand, cls, 36, 256, layers=2, lengths=(480,))


@pytest.mark.parametrize("cls,H,bidirectional", [(nn.LSTM, 256, True), (nn.GRU, 256, False), (nn.GRU, 128, True),
                                                  (nn.LSTM, 100, False)])
def test_one_sample_layers_run_fused(rand, cls, H, bidirectional):
    """One fp32 sample per cluster: the fused kernels (W_hh in registers, the cell in the product
    lanes; the backward's all-gather), H = 100 with a last block of fewer units (and warps with none)."""
    plan = ops.rnn_plan("lstm" if cls is nn.LSTM else "gru", H, 1, "fp32", DEV)
    assert "fused cell and W_hh in registers (forward and backward)" in plan and "reduce-scatter" not in plan, plan
    compare(rand, cls, 36, H, bidirectional=bidirectional, lengths=(rand.py.randint(1, 300),))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_several_samples_per_block_run_fused(rand, cls):
    """A bidirectional layer of 8 samples within 32 SMs (concurrency.sm_budget; its directions one
    after the other): several fp32 samples per block on the fused kernels (the forward on wide 8-block
    clusters, the backward by reduce-scatter on 16-block ones; on half the GPU the planner takes one
    sample a block on wide 8-block clusters), lengths that end at different steps."""
    plan = ops.rnn_plan("lstm" if cls is nn.LSTM else "gru", 256, 8, "fp32", DEV, max_blocks=32)
    assert plan.startswith("cluster 8 blocks") and "fused cell and W_hh in registers, 8 chunks a lane" in plan \
        and " 1 samples per block" not in plan, plan
    with concurrency.sm_budget(32):
        compare(rand, cls, 36, 256, bidirectional=True, lengths=random_lengths(rand, 8, 1, 300))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_fused_groups_by_length_ties_and_a_partial_round(rand, cls):
    """13 samples on the fused kernels with several per block, the backward by reduce-scatter: the
    kernels deal them out longest first (a last round that reaches only some groups) and multiply and
    send only the samples still running, so the lengths tie, end at 1, and differ within every group.
    Within 32 SMs (concurrency.sm_budget; the forward on wide 8-block clusters): on the whole GPU the
    planner takes one sample a block on wide 8-block clusters for them."""
    plan = ops.rnn_plan("lstm" if cls is nn.LSTM else "gru", 256, 13, "fp32", DEV, max_blocks=32)
    assert re.search(r"; backward: cluster 16 blocks x \d+ groups, 16 units and \d+ samples per block, fused cell and "
                     r"W_hh in registers, by reduce-scatter", plan) and " 1 samples per block" not in plan, plan
    with concurrency.sm_budget(32):
        compare(rand, cls, 36, 256, layers=2, lengths=(7, 30, 30, 1, 30, 12, 7, 1, 25, 30, 2, 19, 7))


def test_wide_bidirectional_batch_32_lengths_50_to_500(rand):
    compare(rand, nn.LSTM, 36, 256, layers=2, bidirectional=True, lengths=random_lengths(rand, 32, 50, 500))


def test_gru_256_two_layers_bidirectional_batch_32(rand):
    compare(rand, nn.GRU, 36, 256, layers=2, bidirectional=True, lengths=random_lengths(rand, 32, 1, 200))


@pytest.mark.parametrize("cls,D,H", [(nn.LSTM, 1, 100), (nn.GRU, 300, 257), (nn.LSTM, 300, 257), (nn.GRU, 1, 100)])
def test_odd_sizes(rand, cls, D, H):
    compare(rand, cls, D, H, lengths=random_lengths(rand, 5, 1, 60))


def test_no_bias_no_initial_state_three_layers(rand):
    compare(rand, nn.LSTM, 7, 48, layers=3, bias=False, lengths=random_lengths(rand, 6, 1, 30), with_state=False)


def test_batch_256(rand):
    compare(rand, nn.GRU, 8, 128, lengths=random_lengths(rand, 256, 1, 50))


def test_2000_steps(rand):
    compare(rand, nn.LSTM, 4, 64, lengths=(2000, 1, 1337))


@pytest.mark.parametrize("H", [512, 1024])
def test_grid_layout_large_hidden(rand, H):
    """fp32 W_hh of H >= 512 does not fit a cluster: the grid layout with its global barrier."""
    plan = ops.rnn_plan("lstm", H, 32, "fp32", DEV)
    assert plan.startswith("grid") and "W_hh in registers (forward and backward)" in plan, plan
    compare(rand, nn.LSTM, 36, H, lengths=random_lengths(rand, 32, 1, 100))


def test_plans_cover_the_layouts():
    assert ops.rnn_plan("lstm", 32, 1, "fp32", DEV).startswith("local")
    assert ops.rnn_plan("lstm", 256, 1, "fp32", DEV).startswith("cluster")
    assert ops.rnn_plan("gru", 1024, 8, "fp32", DEV).startswith("grid")
    assert ops.rnn_plan("lstm", 4096, 1, "fp32", DEV) == ""  # 256 MiB of W_hh: no layout holds it


@pytest.mark.parametrize("B", [1, 32, 256])
def test_plans_within_a_block_budget(B):
    """A plan for half the SMs (a bidirectional layer's directions side by side) uses at most that many."""
    half = torch.cuda.get_device_properties(0).multi_processor_count // 2
    plan = ops.rnn_plan("gru", 256, B, "fp32", DEV, max_blocks=half)
    m = re.match(r"cluster (\d+) blocks x (\d+) groups", plan)
    assert m and int(m.group(1)) * int(m.group(2)) <= half, plan
    if B == 1:
        assert ops.rnn_plan("lstm", 256, B, "fp32", DEV, max_blocks=8).startswith("cluster 8 blocks x 1 groups")


@pytest.mark.parametrize("cell,H,lens,reverse", [("lstm", 256, (300,), False), ("gru", 256, (300,), True),
                                                  ("lstm", 200, (37, 120), True), ("gru", 256, (1, 90), False),
                                                  ("lstm", 256, (120, 300, 1), True),
                                                  ("gru", 200, (90, 5, 300, 37), False),
                                                  ("lstm", 256, (64, 64, 64, 64), False)])
def test_op_wide_cluster_against_the_cpu_op(rand, cell, H, lens, reverse):
    """Within 8 SMs a layer of hidden 200-256 runs on the wide fused kernels (8 blocks, 8 chunks a lane;
    tiles of one, two and four samples, the last with 3 or 4): every output and gradient against the CPU
    kernels."""
    plan = ops.rnn_plan(cell, H, len(lens), "fp32", DEV, max_blocks=8)
    assert plan.startswith("cluster 8 blocks x 1 groups") and "8 chunks a lane" in plan, plan
    compare_ops_with_cpu(rand, cell, lens, max(lens), H, reverse, max_blocks=8)


@pytest.mark.parametrize("cls,H,B,layers,bidirectional,budget", [
    (nn.LSTM, 256, 1, 2, False, 8), (nn.GRU, 256, 2, 3, False, 16), (nn.LSTM, 200, 2, 1, True, 8),
    (nn.GRU, 1024, 1, 2, True, 8)])
def test_modules_within_an_sm_budget(rand, cls, H, B, layers, bidirectional, budget):
    """Inside concurrency.sm_budget (a per-sample lane's share of the SMs: 8 at 16 lanes, 16 at 8) a
    stack runs its layers and directions one launch at a time on the caller's stream (no pipeline, no
    side-by-side directions), each planned within the budget (LSTM 256 on the wide 8-block clusters)
    or, where no plan fits in it (GRU 1024's grid), on the whole GPU. Against float64, and the same
    bits in a graph replay."""
    lengths = (300,) if B == 1 else (300, 41)
    with concurrency.sm_budget(budget):
        mod, x, lens, hx = compare(rand, cls, 36, H, layers=layers, bidirectional=bidirectional, lengths=lengths)
        layout = mod._layout(x.to(DEV), B, 300)
        fits = H <= 256
        assert layout == {"chunks": 1, "side_by_side_blocks": 0, "max_blocks": budget if fits else 0}, layout
        x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)
        dirs = 2 if bidirectional else 1
        up = [rand.randn(B, 300, dirs * H, device=DEV)] + \
            [rand.randn(layers * dirs, B, H, device=DEV) for _ in range(2 if cls is nn.LSTM else 1)]
        replay_equals(mod, x, lens, hx, up, run_and_grads(mod, x, lens, hx, up))


def test_too_large_falls_back_with_one_warning(rand):
    mod = vnn.LSTM(4, 4096).to(DEV)
    x = rand.randn(3, 1, 4, device=DEV)
    with pytest.warns(vnn.VlseqFallbackWarning, match="does not fit"):
        out, _ = mod(x)
    want, _ = nn.LSTM.forward(mod, x)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("cls,H,B,layers,bidirectional,tf32", [
    (nn.LSTM, 256, 7, 2, True, False),   # clusters
    (nn.LSTM, 1024, 32, 1, False, False),  # the grid layout, W_hh in registers
    (nn.GRU, 1024, 32, 1, False, False),
    (nn.LSTM, 1024, 32, 1, False, True),  # the grid layout in 16 bits, forward and backward
    (nn.GRU, 1024, 32, 1, False, True),
])
def test_same_bits_run_to_run(rand, cls, H, B, layers, bidirectional, tf32):
    """Every sum in a fixed order: outputs, states and every gradient repeat bit for bit."""
    torch.backends.cudnn.allow_tf32 = tf32  # the fixture restores it
    if H == 1024:
        plan = ops.rnn_plan("lstm" if cls is nn.LSTM else "gru", H, B, "tf32" if tf32 else "fp32", DEV)
        if tf32:
            assert HALF_BOTH in plan, plan
        else:
            assert "W_hh in registers (forward and backward)" in plan and "tensor cores" not in plan, plan
    ref, mod, x, lens, hx = make(rand, cls, 36, H, layers=layers, bidirectional=bidirectional,
                                 lengths=random_lengths(rand, B, 1, 90))
    dirs = 2 if bidirectional else 1
    states = 2 if cls is nn.LSTM else 1
    up = [rand.randn(B, 90, dirs * H, device=DEV)] + [rand.randn(layers * dirs, B, H, device=DEV) for _ in range(states)]
    first = run_and_grads(mod, x.to(DEV), lens, _to(hx, device=DEV), up)
    for _ in range(3):
        again = run_and_grads(mod, x.to(DEV), lens, _to(hx, device=DEV), up)
        for a, b in zip(first[0] + first[1], again[0] + again[1]):
            assert_same_bits(a, b, "rerun")


@pytest.mark.parametrize("H", [64, 256, 1024])
def test_graph_replay_matches_eager(rand, H):
    """Capture-safe: no host sync, no allocation outside the caching allocator (grid layouts launch
    cooperatively inside the graph)."""
    mod = vnn.LSTM(16, H, batch_first=True).to(DEV)
    B, T = 4, 33
    x = rand.randn(B, T, 16, device=DEV)
    lens = torch.tensor([33, 1, 20, 7], device=DEV)

    def step():
        for p in mod.parameters():
            p.grad = None
        out, (h, c) = mod(x, lengths=lens)
        (out.square().sum() + h.sum() + c.sum()).backward()
        return [out.detach(), h.detach(), c.detach()] + [p.grad.detach().clone() for p in mod.parameters()]

    eager = step()
    for a, b in zip(replayed(step), eager):
        assert_same_bits(a, b, "graph replay")


def replayed(fn):
    """fn's outputs from a CUDA-graph replay of it (warmed up, then captured on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    return static


def against_one_launch_at_a_time(mod, x, lens, hx, up, blocks, tol):
    """run_and_grads of `mod` as it lays its launches out, each output and gradient within `tol` (relative
    norm) of the same module's with every launch planned for `blocks` SMs, one after another; the first."""
    apart = copy.deepcopy(mod)
    apart._layout = lambda *args: {"chunks": 1, "side_by_side_blocks": 0, "max_blocks": blocks}
    laid_out = run_and_grads(mod, x, lens, hx, up)
    for a, b in zip(laid_out[0] + laid_out[1], sum(run_and_grads(apart, x, lens, hx, up), [])):
        assert ((a - b).norm() / b.norm()).item() <= tol
    return laid_out


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_pipelined_stack_against_float64_and_in_a_graph(rand, cls):
    """A unidirectional stack whose layers fit side by side runs pipelined over time windows (the
    upper layers on side streams): against float64, against the layer-by-layer path (the GEMMs of a
    window may sum in another order than those of the whole sequence), and the same bits as a
    CUDA-graph replay (the streams join the capture). One sample, 3 layers: 3 clusters of 16 blocks
    (the windows' own cases, lengths ending inside and at their edges, are tested on the CPU)."""
    lengths = (200,)
    mod, x, lens, hx = compare(rand, cls, 12, 256, layers=3, lengths=lengths)
    assert mod._layout(x.to(DEV), len(lengths), 200)["chunks"] == 4
    x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)  # nothing is copied from the host in the capture
    up = [rand.randn(len(lengths), 200, 256, device=DEV)] + \
        [rand.randn(3, len(lengths), 256, device=DEV) for _ in range(2 if cls is nn.LSTM else 1)]
    piped = against_one_launch_at_a_time(mod, x, lens, hx, up, 0, 1e-6)
    replay_equals(mod, x, lens, hx, up, piped)


def test_pipelined_stack_on_most_of_the_gpu(rand):
    """8 samples of LSTM 256 x 2: each layer on 8 wide 8-block clusters (64 SMs), both at once on up to
    all the SMs, so the stack runs pipelined over 4 windows (concurrency.pipeline_chunks): against
    float64, with lengths that end inside windows and at 1."""
    lengths = (300, 1, 97, 144, 288, 48, 200, 13)
    mod, x, lens, hx = compare(rand, nn.LSTM, 36, 256, layers=2, lengths=lengths)
    plan, sms = ops.rnn_plan("lstm", 256, len(lengths), "fp32", DEV), concurrency.sm_count(torch.device(DEV))
    want = concurrency.pipeline_chunks(plan, 2, 300, sms)
    assert mod._layout(x.to(DEV), len(lengths), 300)["chunks"] == want, plan
    if sms >= 128:  # an H100 / H200: 2 x 64 SMs fit
        assert plan.startswith("cluster 8 blocks x 8 groups") and want == 4, plan


def replay_equals(mod, x, lens, hx, up, eager):
    """run_and_grads captured in a CUDA graph and replayed gives `eager`'s bits."""
    static = replayed(lambda: run_and_grads(mod, x, lens, hx, up))
    for a, b in zip(static[0] + static[1], eager[0] + eager[1]):
        assert_same_bits(a, b, "graph replay")


def test_directions_side_by_side(rand):
    """A bidirectional layer whose two launches fit together runs its reverse direction on a side
    stream (backward too): against float64, the same bits run to run, and in a graph replay of the
    trainer's form (parameter gradients; input and state need none) and with an input and a state
    that need gradients."""
    lengths = (150, 1, 77, 149)
    mod, x, lens, hx = compare(rand, nn.GRU, 12, 256, layers=2, bidirectional=True, lengths=lengths)
    x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)
    assert mod._layout(x, len(lengths), 150)["side_by_side_blocks"]
    up = [rand.randn(len(lengths), 150, 512, device=DEV), rand.randn(4, len(lengths), 256, device=DEV)]
    first = run_and_grads(mod, x, lens, hx, up)
    again = run_and_grads(mod, x, lens, hx, up)
    for a, b in zip(first[0] + first[1], again[0] + again[1]):
        assert_same_bits(a, b, "rerun")
    replay_equals(mod, x, lens, hx, up, first)

    def trainer_step():
        out, h = mod(x, hx, lengths=lens)
        grads = torch.autograd.grad((out * up[0]).sum() + (h * up[1]).sum(), list(mod.parameters()))
        return [out.detach(), h.detach()] + list(grads)

    eager = trainer_step()
    for a, b in zip(replayed(trainer_step), eager):
        assert_same_bits(a, b, "graph replay, directions side by side")


def _half_the_sms() -> int:
    """Half the GPU's SMs; the test is skipped where they hold no 64-block grid launch (the 16-bit kernels'
    at hidden 1024)."""
    half = torch.cuda.get_device_properties(0).multi_processor_count // 2
    if half < 64:
        pytest.skip(f"{2 * half} SMs: no 64-block launch fits half of them")
    return half


# (hidden, TF32 on, tolerance against float64, against the same launches one at a time): LSTM 1024 in TF32
# on the 16-bit grid kernels (a window's input GEMM sums in another order than the whole sequence's, and h
# rounded to 16 bits can turn such a last-bit difference into one of its own last bit: a quarter of the
# TF32 tolerance); LSTM 512 in fp32 on the fp32 grid kernels (W_hh, 4 MiB, fits no cluster).
GRID_SHARES = [(1024, True, 5e-3, TF32_OP_TOL / 4), (512, False, 1e-5, 1e-6)]


def _grid_share_case(H, tf32, half, batch):
    """Sets TF32 as the case says (the fixture restores it) and checks that a launch planned for half the
    SMs is a grid plan that fits there: the case covers the grid kernels, not a cluster plan."""
    torch.backends.cudnn.allow_tf32 = tf32
    plan = ops.rnn_plan("lstm", H, batch, "tf32" if tf32 else "fp32", DEV, half)
    assert plan.startswith("grid") and concurrency._blocks(plan) <= half, plan
    assert both_in_16_bits(plan) == tf32, plan
    return plan


@pytest.mark.parametrize("H,tf32,tol,apart_tol", GRID_SHARES)
@pytest.mark.parametrize("lengths", [(100,), (100, 37), (100, 1, 57, 96), (100, 1, 57, 96, 100, 33, 7, 48)])
def test_grid_stack_pipelined_on_half_the_gpu_each(rand, lengths, H, tf32, tol, apart_tol):
    """LSTM x 2 whose layer takes the grid layout on the whole GPU: each layer's launches within half the
    SMs (one sample included), the two layers at once over time windows (concurrency.pipeline_layout;
    lengths ending inside windows and at 1): against float64, against the same kernels layer by layer, and
    the same bits in a graph replay. In TF32 (LSTM 1024, the 16-bit kernels: at 1-4 samples their
    forward passes h and their backward partial dh in tagged lines, at 8 through rows and a barrier) and fp32
    (LSTM 512)."""
    half = _half_the_sms()
    plan = _grid_share_case(H, tf32, half, len(lengths))
    assert (TAGGED in plan) == (tf32 and len(lengths) <= 4) == (SCATTER in plan), plan
    mod, x, lens, hx = compare(rand, nn.LSTM, 36, H, layers=2, lengths=lengths, rtol=tol)
    x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)
    assert mod._layout(x, len(lengths), 100) == {"chunks": 2, "side_by_side_blocks": 0, "max_blocks": half}
    up = [rand.randn(len(lengths), 100, H, device=DEV)] + [rand.randn(2, len(lengths), H, device=DEV)
                                                           for _ in range(2)]
    piped = against_one_launch_at_a_time(mod, x, lens, hx, up, half, apart_tol)
    replay_equals(mod, x, lens, hx, up, piped)


@pytest.mark.parametrize("lengths", [(300,), (300, 41), (300, 1, 177, 260), (300, 1, 177, 260, 5, 300, 299, 64)])
def test_tagged_lines_on_the_whole_gpu(rand, lengths):
    """LSTM 1024 in TF32 at 1-8 samples on the whole GPU: the 16-bit forward with h in tagged lines and the
    16-bit backward by reduce-scatter with partial dh in tagged lines (no barrier a step) on 64 blocks, the
    samples spread over two groups from 2 on (uneven at 3 is covered by the layout test), lengths ending
    mid-run and at 1: against float64, the same bits run to run and in a graph replay."""
    torch.backends.cudnn.allow_tf32 = True  # the fixture restores it
    n = len(lengths)
    plan = ops.rnn_plan("lstm", 1024, n, "tf32", DEV)
    layout = f"grid 64 blocks x {min(n, 2)} groups, 16 units and {-(-n // 2)} samples per block"
    assert plan.startswith(layout) and HALF_BOTH in plan and TAGGED in plan and SCATTER in plan, plan
    mod, x, lens, hx = compare(rand, nn.LSTM, 36, 1024, lengths=lengths, rtol=GRID_SHARES[0][2])
    x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)
    up = [rand.randn(len(lengths), max(lengths), 1024, device=DEV)] + [rand.randn(1, len(lengths), 1024, device=DEV)
                                                                      for _ in range(2)]
    first = run_and_grads(mod, x, lens, hx, up)
    again = run_and_grads(mod, x, lens, hx, up)
    for a, b in zip(first[0] + first[1], again[0] + again[1]):
        assert_same_bits(a, b, "rerun")
    replay_equals(mod, x, lens, hx, up, first)


@pytest.mark.parametrize("H,tf32,tol", [case[:3] for case in GRID_SHARES])
def test_grid_directions_side_by_side(rand, H, tf32, tol):
    """A bidirectional LSTM whose direction takes the grid layout runs its two directions at once, each on
    half the SMs (two cooperative grid launches resident together): against float64, the same results as
    the same launches one after the other, and the same bits in a graph replay. TF32 and fp32 as above."""
    half = _half_the_sms()
    lengths = (60, 1, 33, 59, 60, 12, 2, 41)
    _grid_share_case(H, tf32, half, len(lengths))
    mod, x, lens, hx = compare(rand, nn.LSTM, 36, H, bidirectional=True, lengths=lengths, rtol=tol)
    x, hx, lens = x.to(DEV), _to(hx, device=DEV), lens.to(DEV)
    assert mod._layout(x, len(lengths), 60)["side_by_side_blocks"] == half
    up = [rand.randn(len(lengths), 60, 2 * H, device=DEV)] + [rand.randn(2, len(lengths), H, device=DEV)
                                                              for _ in range(2)]
    both = against_one_launch_at_a_time(mod, x, lens, hx, up, half, 1e-6)
    replay_equals(mod, x, lens, hx, up, both)


def test_concurrent_streams_each_correct(rand):
    """One-sample calls on several streams at once (the trainer's lanes): clusters run side by side."""
    mod = vnn.LSTM(8, 256, batch_first=True).to(DEV)
    xs = [rand.randn(1, 50 + 10 * i, 8, device=DEV) for i in range(4)]
    alone = [mod(x)[0] for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    outs = [None] * len(xs)
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for i, (s, x) in enumerate(zip(streams, xs)):
        with torch.cuda.stream(s):
            outs[i] = mod(x)[0]
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(outs, alone):
        assert_same_bits(a, b, "concurrent")


def test_tf32_mode_tolerance(rand):
    torch.backends.cuda.matmul.allow_tf32 = True  # the fixture restores it
    compare(rand, nn.LSTM, 36, 256, layers=2, lengths=random_lengths(rand, 8, 1, 100), rtol=2e-3)


@pytest.mark.parametrize("cell,H,lens,reverse,layout,kernels,max_blocks", [
    # both directions in 16 bits on 2 groups of 64 blocks
    ("lstm", 1024, LENS32, False, "grid 64 blocks x 2 groups, 16 units and 16 samples per block", (HALF_BOTH,), 0),
    ("gru", 1024, LENS32, True, "grid 64 blocks x 2 groups, 16 units and 16 samples per block", (HALF_BOTH,), 0),
    # the second tile of 8 samples: all of them ended after a few steps
    ("lstm", 1024, [30, 12, 30, 7, 25, 30, 1, 19, 30, 30, 4, 16, 30, 2, 8, 30, 3, 0, 5, 1], True,
     "grid 64 blocks x 2 groups, 16 units and 10 samples per block", (HALF_BOTH,), 0),
    # the forward in one group (fewer than 8 samples in each of two), 3 m-tiles, its last block 2 units of
    # 9; the backward's 63 blocks of units rounded up to 64 (the last holds none, the one before 9 units),
    # one tile of samples
    ("lstm", 1001, [30, 4, 17, 1, 30, 9, 0, 22, 13, 30, 2, 8], True, "grid 112 blocks x 1 groups, 9 units",
     (HALF_FORWARD, "backward: grid 64 blocks x 2 groups, 16 units and 6 samples", HALF_BACKWARD), 0),
    ("gru", 1000, [30, 4, 0, 17, 1, 30, 22, 11, 30], False, "grid 91 blocks x 1 groups, 11 units",
     (HALF_FORWARD, "backward: grid 64 blocks x 2 groups, 16 units and 5 samples", HALF_BACKWARD), 0),
    # 48 blocks (6 source blocks a warp), 4 of them past H, the last real one 12 units
    ("gru", 700, [30, 4, 0, 17, 1, 30, 22, 11, 30, 5, 30, 2, 19, 30], True, "grid",
     ("backward: grid 48 blocks x 2 groups, 16 units and 7 samples", HALF_BACKWARD), 0),
    # 32 blocks (4 source blocks a warp); no 16-bit forward below hidden 615
    ("lstm", 512, [30, 1, 0, 22, 30, 9, 14, 3, 30, 8, 11], False, "grid",
     ("TF32 products on the tensor cores (forward)", "backward: grid 32 blocks x 2 groups, 16 units and 6 samples",
      HALF_BACKWARD), 64),
    # fewer than 8 samples: the 16-bit forward with tagged lines on 63 blocks (on more, 9-15 units each, its
    # polls cost more than the barrier), two groups of 2 and 1 samples, as the backward's, by reduce-scatter
    # (its 64th block holds no unit)
    ("lstm", 1001, [30, 4, 17], True, "grid 63 blocks x 2 groups, 16 units and 2 samples",
     (HALF_FORWARD, TAGGED, "backward: grid 64 blocks x 2 groups, 16 units and 2 samples", HALF_BACKWARD, SCATTER), 0),
    # one sample: both directions in 16 bits on 64 blocks, with tagged lines (the backward by reduce-scatter)
    ("lstm", 1024, [30], False, "grid 64 blocks x 1 groups, 16 units and 1 samples", (HALF_BOTH, TAGGED, SCATTER), 0),
    ("gru", 1024, [30], True, "grid 64 blocks x 1 groups, 16 units and 1 samples", (HALF_BOTH, TAGGED, SCATTER), 0),
    # the reduce-scatter on 48 blocks (6 m-tiles a warp, 4 blocks past H) and on 32 (4 m-tiles), lengths 0 and 1
    ("gru", 700, [30, 0, 17], False, "grid", ("backward: grid 48 blocks x 2 groups, 16 units and 2 samples",
                                              HALF_BACKWARD, SCATTER), 0),
    ("lstm", 512, [1, 30, 22], True, "grid", ("backward: grid 32 blocks x 2 groups, 16 units and 2 samples",
                                              HALF_BACKWARD, SCATTER), 64),
    # more than 16 samples a group: the fp32 register backward
    ("lstm", 1024, LENS32[:20] + [30, 5, 11, 30] * 5, False, "grid 64 blocks x 2 groups, 16 units and 20 samples",
     (HALF_FORWARD, "W_hh in registers (backward)"), 0),
])
def test_op_grid_layout_tf32(rand, cell, H, lens, reverse, layout, kernels, max_blocks):
    """weights "tf32" on the grid layout: the products on the tensor cores in the directions whose kernel
    has the shape (in 16 bits on a layout of their own where they have one); every output of both ops
    against the CPU kernels in fp32 within TF32_OP_TOL, and samples past their length untouched."""
    compare_ops_with_cpu(rand, cell, lens, 30, H, reverse, weights="tf32", max_blocks=max_blocks, tol=TF32_OP_TOL)
    plan = ops.rnn_plan(cell, H, len(lens), "tf32", DEV, max_blocks=max_blocks)
    assert plan.startswith(layout) and all(k in plan for k in kernels), plan


@pytest.mark.parametrize("cell,lens", [("lstm", [30]), ("lstm", LENS32[:16]), ("gru", [30, 4, 17, 1, 30, 9, 0, 22]),
                                      ("gru", [30, 0, 1, 17])])
def test_op_16_bit_kernels_alone_within_half_the_gpu(rand, cell, lens):
    """Within half the SMs no fp32 kernel holds hidden 1024; in tf32 the 16-bit kernels alone make the plan
    (pipelined stacks, directions side by side), one sample included (the whole GPU takes their forward from 8
    samples a group on, or with tagged lines at up to 4, and their backward from 2, or by reduce-scatter at up
    to 4):
    one group on at most half the SMs, every output of both ops against the CPU kernels. 17 samples: none
    (the backward holds 16 a group)."""
    half = _half_the_sms()
    assert ops.rnn_plan(cell, 1024, len(lens), "fp32", DEV, max_blocks=half) == ""
    assert ops.rnn_plan(cell, 1024, 17, "tf32", DEV, max_blocks=half) == ""
    plan = ops.rnn_plan(cell, 1024, len(lens), "tf32", DEV, max_blocks=half)
    assert plan.startswith("grid") and concurrency._blocks(plan) <= half and "x 2 groups" not in plan, plan
    assert both_in_16_bits(plan) and (SCATTER in plan) == (len(lens) <= 4), plan
    compare_ops_with_cpu(rand, cell, lens, 30, 1024, cell == "gru", weights="tf32", max_blocks=half, tol=TF32_OP_TOL)


@pytest.mark.parametrize("lens", [LENS32, LENS32[:8]])
def test_op_16_bit_kernels_scale_rows_and_columns(rand, lens):
    """The 16-bit forward scales each row of W_hh by a power of 2 of its own, the 16-bit backward each
    column (at 8 samples, 4 a group, the reduce-scatter backward scales each row, as the forward): rows of weights
    past fp16's
    range (up to ~4e5: unscaled they would be infinite, and their sums NaN), rows of ~1e-7 (below its
    normal range), of ~1e-36 (whose scale would be below fp32's normal range) and of zeros, beside ordinary
    ones; and huge columns, so that every row's largest weight is ~1e6 times its others (which keep their
    11 bits). The huge rows' gates get inputs of 1e8 and saturate whatever the products' rounding (near
    zero a rounding of the huge products could flip them); the huge columns' units have their output gate
    shut (input -1e8) and h0 = 0, so their h stays 0 and only the backward multiplies by those columns (dh0
    ~1e5). Every output of both ops against the CPU kernels within TF32_OP_TOL."""
    H, cols = 1024, [2, 100, 513, 1000]  # units whose output gate's row is not one of the huge rows
    plan = ops.rnn_plan("lstm", H, len(lens), "tf32", DEV)
    assert plan.startswith("grid 64 blocks x 2") and HALF_BOTH in plan and (SCATTER in plan) == (len(lens) == 8), plan

    def rows_and_columns_apart(xp, w, b, h0):
        huge = torch.arange(0, 4 * H, 7)
        assert not set((3 * H + torch.tensor(cols)).tolist()) & set(huge.tolist())
        w[huge] *= 4e6
        xp[..., huge] = 1e8
        w[3::11] *= 4e-6
        w[5::13] *= 1e-34
        w[6::17] = 0
        w[:, cols] *= 4e6
        xp[..., [3 * H + c for c in cols]] = -1e8
        h0[:, cols] = 0
        assert w.abs().max() > 65504 and w.isfinite().all()
        return xp, w, b, h0

    compare_ops_with_cpu(rand, "lstm", lens, 30, H, False, weights="tf32", tol=TF32_OP_TOL,
                         adjust=rows_and_columns_apart)


@pytest.mark.parametrize("lens", [LENS32, LENS32[:8]])
def test_op_backward_in_16_bits_scales_each_sample(rand, lens):
    """The 16-bit backward publishes each block's gate gradients of a sample with a power-of-2 scale of their
    own (all-gather at 32 samples; at 8 the reduce-scatter, whose partial sums then carry it): samples whose
    gradients are ~1e-30 (below fp16's range, and 1e-25 of the others) and ~1e25 (past it) beside ordinary
    ones, in the same block, and units whose gradients are 1e6 times their block's others. Every output of
    both ops, sample by sample, against the CPU kernels within TF32_OP_TOL."""
    H = 1024
    plan = ops.rnn_plan("lstm", H, len(lens), "tf32", DEV)
    assert plan.startswith("grid 64 blocks x 2") and HALF_BOTH in plan and (SCATTER in plan) == (len(lens) == 8), plan

    def samples_apart(dy, dh_n, dc_n):
        scale = torch.tensor([1e-30, 1.0, 1e25, 1e-12] * (len(lens) // 4), dtype=dy.dtype)
        loud = torch.arange(3, H, 37)  # a unit in most blocks of 16
        dy[:, :, loud] *= 1e6
        return dy * scale[:, None, None], dh_n * scale[:, None], dc_n * scale[:, None]

    compare_ops_with_cpu(rand, "lstm", lens, 30, H, True, weights="tf32", tol=TF32_OP_TOL, adjust_grads=samples_apart,
                         per_sample=True)


def test_op_backward_in_16_bits_in_four_groups(rand):
    """The 16-bit backward with four groups of blocks side by side (LSTM 512: 32 blocks a group, 16 samples
    each): each group's barrier and exchange apart from the others'."""
    lens = [30, 1, 17, 17, 0, 30, 3, 25, 1, 9, 30, 17, 2, 29, 12, 6] * 4
    plan = ops.rnn_plan("lstm", 512, len(lens), "tf32", DEV, max_blocks=128)
    assert plan.startswith("grid 32 blocks x 4 groups, 16 units and 16 samples") and HALF_BACKWARD in plan, plan
    compare_ops_with_cpu(rand, "lstm", lens, 30, 512, False, weights="tf32", max_blocks=128, tol=TF32_OP_TOL)


@pytest.mark.parametrize("H,layers,bidirectional", [(1024, 1, False), (256, 2, True)])
def test_tf32_modules_follow_cudnns_flag(rand, H, layers, bidirectional):
    """vlseq_ext.nn runs "tf32" where cuDNN would (cudnn.allow_tf32) and exact fp32 where it would not, its
    GEMMs in TF32 whatever torch's matmul flag says (off here): an LSTM 1024 on the grid layout and a
    2-layer bidirectional LSTM 256 on clusters, outputs and gradients against float64."""
    lens = random_lengths(rand, 12, 1, 40)
    torch.backends.cudnn.allow_tf32 = True  # the fixture restores it
    assert vnn.functional.precision_for(torch.zeros(1, device=DEV)) == "tf32"
    compare(rand, nn.LSTM, 36, H, layers, bidirectional, lengths=lens, rtol=TF32_OP_TOL)
    assert not torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    assert vnn.functional.precision_for(torch.zeros(1, device=DEV)) == "fp32"
    compare(rand, nn.LSTM, 36, H, layers, bidirectional, lengths=lens)


def relative_error(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("layout", ["rows", "transposed", "slices", "strided"])
@pytest.mark.parametrize("m,k,n", [(1000, 36, 1024), (1024, 3000, 256), (3, 1, 5), (257, 300, 1), (1, 7, 1)])
def test_mm_tf32_within_tf32_of_float64(rand, layout, m, k, n):
    """Every layout the layers pass (transposed views and row slices read in place), odd sizes down to one
    column or row (4-byte alignment), the bias in the epilogue: within TF32_OP_TOL of float64."""
    a, b = mm_operands(rand, m, k, n, layout, device=DEV)
    bias = rand.randn(n, device=DEV)
    err = relative_error(ops.mm_tf32(a, b, bias), a.double() @ b.double() + bias.double())
    assert err <= TF32_OP_TOL, f"relative error {err:.3g}"


def test_mm_tf32_runs_tf32_whatever_the_matmul_flag(rand):
    """With torch's matmul TF32 off (no_tf32), torch.mm is exact to ~1e-7 and mm_tf32 is not (TF32 rounds
    each operand to a 10-bit mantissa), and the flag stays off: the tensor cores ran, nothing global
    was switched. A bias at a 4-byte offset gives the same sum as an aligned one."""
    a, b = rand.randn(512, 2048, device=DEV), rand.randn(2048, 384, device=DEV)
    want = a.double() @ b.double()
    assert relative_error(a @ b, want) < 1e-6
    assert 1e-5 < relative_error(ops.mm_tf32(a, b), want) <= TF32_OP_TOL
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    bias = rand.randn(385, device=DEV)
    assert torch.equal(ops.mm_tf32(a, b, bias[1:]), ops.mm_tf32(a, b, bias[1:].clone()))


def test_mm_tf32_same_bits_eager_and_in_a_graph(rand):
    """One algorithm per shape and layout: a shape first met inside a CUDA-graph capture (its algorithm
    chosen there, its workspace from the graph's pool) replays on another stream to the bits that eager
    calls then give, run after run."""
    a, b, bias = rand.randn(2040, 264, device=DEV).t(), rand.randn(2040, 1000, device=DEV), rand.randn(1000, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            out = ops.mm_tf32(a, b, bias)
    g.replay()
    torch.cuda.synchronize()
    eager = ops.mm_tf32(a, b, bias)
    assert torch.equal(out, eager) and torch.equal(eager, ops.mm_tf32(a, b, bias))


def test_bf16_autocast_tolerance(rand):
    ref, mod, x, lens, hx = make(rand, nn.LSTM, 36, 256, lengths=random_lengths(rand, 8, 1, 100))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, (h, c) = mod(x.to(DEV), _to(hx, device=DEV), lengths=lens)
    assert out.dtype == torch.float32
    want = ref.to(DEV, torch.float64)(pack_padded_sequence(x.to(DEV, torch.float64), lens, batch_first=True,
                                                           enforce_sorted=False), _to(hx, device=DEV,
                                                                                       dtype=torch.float64))
    want_out = pad_packed_sequence(want[0], batch_first=True, total_length=x.shape[1])[0]
    err = ((out.double() - want_out).norm() / want_out.norm()).item()
    assert err < 3e-2, err


def compare_ops_with_cpu(rand, cell, lens, T, H, reverse, weights="fp32", max_blocks=0, tol=1e-5, adjust=None,
                         adjust_grads=None, per_sample=False):
    """Every output of rnn_forward and rnn_backward on the GPU against the CPU kernels (relative norm, of
    each sample's part where per_sample: every output is batch-first); adjust(xproj, W_hh, b_hh, h0) -> the
    four, adjust_grads(dy, dh_n, dc_n) -> the three: changes to the random inputs."""
    B, G = len(lens), 4 if cell == "lstm" else 3
    xp = rand.randn(B, T, G * H)
    w, b = rand.randn(G * H, H, scale=0.8 / H ** 0.5), rand.randn(G * H, scale=0.1)
    h0 = rand.randn(B, H)
    if adjust is not None:
        xp, w, b, h0 = adjust(xp, w, b, h0)
    c0 = rand.randn(B, H) if cell == "lstm" else None
    dy, dh_n = rand.randn(B, T, H), rand.randn(B, H)
    dc_n = rand.randn(B, H) if cell == "lstm" else None
    if adjust_grads is not None:
        dy, dh_n, dc_n = adjust_grads(dy, dh_n, dc_n)
    if weights == "bf16":  # the CPU kernels take fp32 weights: the bf16-rounded ones are the same numbers
        w = w.to(torch.bfloat16).float()
    outs = {}
    for dev in ("cpu", DEV):
        on = [None if t is None else t.to(dev) for t in (xp, w, b, h0, c0, torch.tensor(lens), dy, dh_n, dc_n)]
        prec = weights if dev != "cpu" else "fp32"  # (tf32 on the CPU is fp32 too)
        y, h_n, c_n, saved, cs = ops.rnn_forward(cell, *on[:6], reverse, prec, max_blocks=max_blocks)
        grads = ops.rnn_backward(cell, on[1], y, saved, cs, on[3], on[4], on[5], *on[6:], reverse, prec,
                                 max_blocks=max_blocks)
        outs[dev] = [t.cpu() for t in (y, h_n, c_n, *grads) if t.numel()]
    for i, (got, want) in enumerate(zip(outs[DEV], outs["cpu"])):
        for b, (g, w) in enumerate(zip(got, want) if per_sample else [(got, want)]):
            g, w = g.double(), w.double()
            err = ((g - w).norm() / w.norm()).item() if w.norm() > 0 else g.norm().item()
            assert err <= tol, f"output {i}" + (f", sample {b}" if per_sample else "") + f": relative error {err:.3g}"


@pytest.mark.parametrize("cell,max_blocks", [("lstm", 0), ("gru", 66)])
def test_op_forward_and_backward_on_their_own_layouts(rand, cell, max_blocks):
    """32 samples of hidden 256 (on the whole GPU; the GRU within half of it, as a bidirectional layer
    runs): the forward on wide 8-block clusters, the backward by reduce-scatter on 16-block ones, each
    dealing the samples to its own groups; lengths that tie, end at 1 and at 0. Every output of both ops
    against the CPU kernels."""
    lens = [90, 1, 17, 17, 0, 90, 3, 65, 1, 9, 33, 17, 2, 88, 12, 6] * 2
    plan = ops.rnn_plan(cell, 256, len(lens), "fp32", DEV, max_blocks=max_blocks)
    m = re.match(r"cluster 8 blocks x \d+ groups.*8 chunks a lane.*; backward: cluster 16 blocks x \d+ groups.*"
                 r"by reduce-scatter", plan)
    assert m, plan
    compare_ops_with_cpu(rand, cell, lens, 90, 256, reverse=cell == "gru", max_blocks=max_blocks)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_op_single_block_reduce_scatter_against_the_cpu_op(rand, cell):
    """Four samples per block on one block per group (hidden 64, 16 samples on 4 SMs): the
    reduce-scatter backward's single-block path, lengths that tie, end at 1 and at 0, the GRU in
    reverse; every output of both ops against the CPU kernels."""
    lens = [40, 1, 17, 17, 0, 40, 3, 25, 1, 9, 33, 17, 2, 40, 12, 6]
    plan = ops.rnn_plan(cell, 64, len(lens), "fp32", DEV, max_blocks=4)
    assert plan.startswith("local") and "reduce-scatter" in plan, plan
    compare_ops_with_cpu(rand, cell, lens, 40, 64, reverse=cell == "gru", max_blocks=4)


@pytest.mark.parametrize("cell,H,lens,reverse,regs", [
    ("lstm", 1024, [30, 1, 17, 17, 0, 30, 3, 25, 1, 9, 30, 17, 2, 29, 12, 6] * 2, False, True),
    ("gru", 1024, [30, 1, 17, 17, 0, 30, 3, 25, 1, 9, 30, 17, 2, 29, 12, 6] * 2, True, True),
    ("lstm", 1000, [30], True, True),
    ("gru", 604, [5, 30, 0, 11, 30], False, None),
    ("lstm", 516, list(range(1, 31)) + [0, 30, 7], False, False),
    ("gru", 1001, [30, 4, 17, 1], True, None),
    ("lstm", 768, [30, 4, 0, 17, 1, 30] * 5 + [2, 29], True, False),
])
def test_op_grid_layout_against_the_cpu_op(rand, cell, H, lens, reverse, regs):
    """The grid kernels (W_hh over more than a cluster): every output of both ops against the CPU
    kernels, with lengths that tie, end at 0 and 1, a last block with fewer units (H 604, 516, 1001),
    a hidden size that is not a multiple of 4 (1001), one sample, more samples than a batch tile, both
    directions. `regs`: whether both directions hold W_hh in registers (None: either). With 12 or 20
    units a block (H 768 at 32 samples, H 516 at 33: 3 or 5 float4s of units, which the backward's gather
    cannot split) the backward keeps the shared-memory kernel, and at H 768 the forward too (its 768
    columns would pad to 1,024)."""
    plan = ops.rnn_plan(cell, H, len(lens), "fp32", DEV)
    assert plan.startswith("grid"), plan
    assert regs is None or ("W_hh in registers (forward and backward)" in plan) == regs, plan
    if regs is False:
        assert "backward)" not in plan, plan
    compare_ops_with_cpu(rand, cell, lens, 30, H, reverse)


@pytest.mark.parametrize("cell,H,lens,plan_has,tol", [
    # on the tf32 kernels, W_hh rounded to bfloat16: the 16-bit grid kernels, and the fp32 fused ones in clusters
    ("lstm", 1024, [20, 1, 13, 0, 20, 7, 19, 2, 20, 11], (HALF_FORWARD, HALF_BACKWARD), TF32_OP_TOL),
    ("gru", 1024, [20, 1, 13, 0, 20, 7, 19, 2, 20, 11], (HALF_FORWARD, HALF_BACKWARD), TF32_OP_TOL),
    ("lstm", 256, [20, 1, 13, 0, 20, 7, 19, 2], ("fused cell and W_hh in registers",), TF32_OP_TOL),
    # past what fp32 W_hh fits in (LSTM 1,400: 31 MB): W_hh held in bfloat16 (products of bf16 weights and fp32
    # state summed in fp32)
    ("lstm", 1400, [20, 1, 13, 0, 20, 7], ("h staged",), 1e-5),
])
def test_op_bf16_weights(rand, cell, H, lens, plan_has, tol):
    """weights "bf16": W_hh rounded to bfloat16, then the tf32 kernels where they hold the layer (the plan
    says so) or else the kernels holding W_hh in bfloat16; against the CPU kernels with the same rounded
    weights."""
    plan = ops.rnn_plan(cell, H, len(lens), "bf16", DEV)
    assert all(k in plan for k in plan_has) and (", W_hh rounded to bfloat16" in plan) == (tol == TF32_OP_TOL), plan
    compare_ops_with_cpu(rand, cell, lens, 20, H, False, weights="bf16", tol=tol)


def test_op_lengths_zero_and_beyond_are_clamped(rand):
    """Device lengths are not read on the host: 0 runs no step (state = h0), > T runs T steps."""
    B, T, H = 3, 6, 32
    xp = rand.randn(B, T, 4 * H, device=DEV)
    w = rand.randn(4 * H, H, device=DEV, scale=0.2)
    h0, c0 = rand.randn(B, H, device=DEV), rand.randn(B, H, device=DEV)
    lens = torch.tensor([0, 6, 99], device=DEV)
    got = ops.rnn_forward("lstm", xp, w, None, h0, c0, lens, False, "fp32")
    cpu = ops.rnn_forward("lstm", xp.cpu(), w.cpu(), None, h0.cpu(), c0.cpu(), lens.cpu(), False, "fp32")
    torch.testing.assert_close(got[1][0], h0[0])
    assert got[0][0].abs().max() == 0
    for a, b in zip(got[:3], cpu[:3]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)


def test_packed_input_returns_torchs_packing(rand):
    ref, mod, x, lens, hx = make(rand, nn.GRU, 5, 200, layers=2, lengths=random_lengths(rand, 6, 1, 25))
    packed = pack_padded_sequence(x.to(DEV), lens, batch_first=True, enforce_sorted=False)
    out, h = mod(packed, _to(hx, device=DEV))
    want, wh = nn.GRU.forward(mod, packed, _to(hx, device=DEV))
    assert torch.equal(out.batch_sizes, want.batch_sizes)
    assert torch.equal(out.sorted_indices, want.sorted_indices)
    torch.testing.assert_close(out.data, want.data, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h, wh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rnn,bidirectional", [("lstm", False), ("gru", True)])
def test_seq_model_on_the_kernels_equals_samples_alone(rand, rnn, bidirectional):
    """SeqModel's padded path (the trainer's padded graphs) and its one-sample path run on the kernels
    and give, value and gradient, what float64 gives each sample alone."""
    from vlseq_ext import SeqModel
    torch.manual_seed(rand.seed % 2**31)
    model = SeqModel(36, 256, 3, num_layers=2, rnn=rnn, bidirectional=bidirectional).to(DEV)
    lengths = random_lengths(rand, 6, 1, 70)
    xs = [rand.randn(n, 36, device=DEV) for n in lengths]
    x = torch.zeros(len(xs), max(lengths), 36, device=DEV)
    for i, s in enumerate(xs):
        x[i, :len(s)] = s
    assert model.recurrent.uses_kernels(x, len(xs), padded=False)
    padded = model.forward_padded(x, torch.tensor(lengths, device=DEV))
    grads = torch.autograd.grad(padded.square().sum(), list(model.parameters()))
    ref = copy.deepcopy(model).double().cpu()
    ref.recurrent.kernels = "cudnn"
    alone = torch.cat([ref(s.double().cpu()) for s in xs])
    ref_grads = torch.autograd.grad(alone.square().sum(), list(ref.parameters()))
    torch.testing.assert_close(padded.double().cpu(), alone, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        err = ((g.double().cpu() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, err
    one = torch.cat([model(s) for s in xs])  # batch-1 calls, as the trainer's one-sample graphs make them
    torch.testing.assert_close(one.double().cpu(), alone, rtol=1e-5, atol=1e-6)


class OneSample(nn.Module):
    """A model written for one sample at a time (the seed's style): LSTM 256 x 2 and a head on h_n."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(36, 256, num_layers=2, batch_first=True)
        self.fc = nn.Linear(256, 1)

    def forward(self, x):
        return self.fc(self.lstm(x.unsqueeze(0))[1][0][-1])


@pytest.mark.parametrize("form", ["padded", "one_sample", "one_sample_graphs"])
def test_trainer_steps_on_the_kernels_match_cudnn(rand, form):
    """ParallelTrainer with rnn_kernels="vlseq" (padded-batch graphs of SeqModel; a one-sample model's
    passes with their recurrent calls gathered into one batch (pack=True), or its one-sample graphs on
    lanes (pack=False)) gives the gradient cuDNN gives, within fp32 rounding."""
    from vlseq_ext import ParallelTrainer, SeqModel

    lengths = random_lengths(rand, 8, 1, 60)
    xs = [rand.randn(n, 36) for n in lengths]
    ys = [rand.randn(1) for _ in lengths]
    grads = {}
    for kernels in ("vlseq", "cudnn"):
        torch.manual_seed(rand.seed % 2**31)
        model = (SeqModel(36, 256, 1, num_layers=2) if form == "padded" else OneSample()).to(DEV)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices="cuda:0", samples_per_device=8,
                                  rnn_kernels=kernels, pack={"padded": "auto", "one_sample": True}.get(form, False))
        for _ in range(3):  # eager first, then graph captures and replays
            trainer.compute_gradients(xs, ys)
        grads[kernels] = [p.grad.detach().double().cpu().clone() for p in model.parameters()]
        gathered = form == "one_sample" and kernels == "vlseq"  # cuDNN's torch module is not swapped
        assert trainer.runner.plan == {"padded": "padded"}.get(form, "gathered" if gathered else "per_sample")
    for a, b in zip(grads["vlseq"], grads["cudnn"]):
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, err


def test_per_sample_lanes_plan_within_their_share(rand, monkeypatch):
    """The trainer's per-sample lanes (8, a one-sample LSTM 256 x 2 as graphs) run each pass within
    its share of the SMs (sm_count // 8), one layer at a time on the lane's stream. The gradient is
    cuDNN's: with the layers of samples of 96 steps or more pipelined on side streams shared by the
    lanes (before concurrency.sm_budget kept them off), layer 0's gradients came out wrong
    intermittently (0.26-0.75 relative; eighteenth session)."""
    from vlseq_ext import ParallelTrainer
    from vlseq_ext.nn import concurrency, functional

    share = torch.cuda.get_device_properties(0).multi_processor_count // 8
    layouts = []
    real = functional.rnn

    def spy(*args, **kw):  # (the trainer's probes of the model run outside the lanes: no budget)
        if concurrency.budget() is not None:
            assert concurrency.budget() == share
            layouts.append((args[1].shape[1], kw))
        return real(*args, **kw)
    monkeypatch.setattr(functional, "rnn", spy)
    lengths = (250, 40, 130, 7, 96, 200, 1, 61)
    xs = [rand.randn(n, 36) for n in lengths]
    ys = [rand.randn(1) for _ in lengths]
    grads = {}
    for kernels in ("vlseq", "cudnn"):
        torch.manual_seed(rand.seed % 2**31)
        model = OneSample().to(DEV)
        trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), devices="cuda:0",
                                  samples_per_device=8, rnn_kernels=kernels, pack=False, lanes=8)
        for _ in range(3):
            trainer.compute_gradients(xs, ys)
        grads[kernels] = [p.grad.detach().double().cpu().clone() for p in model.parameters()]
        trainer.close()
    for a, b in zip(grads["vlseq"], grads["cudnn"]):
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, err
    assert {T for T, _ in layouts} == set(lengths)
    for T, kw in layouts:
        assert kw == {"chunks": 1, "side_by_side_blocks": 0, "max_blocks": share}, (T, kw)
