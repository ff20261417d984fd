"""rnn_forward / rnn_backward on the CPU: the compiled kernels against the pure-PyTorch reference, the
autograd around them (vlseq_ext.nn.functional) against float64 torch modules run one sample at a
time, the argument checks, and the fake kernels. The CPU kernels define what the GPU kernels must
compute (test_rnn_gpu.py checks those)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vlseq_ext import ops, reference
from vlseq_ext.nn import functional as F

from helpers import mm_operands, raises_matching

pytestmark = pytest.mark.usefixtures("compiled_ops")


def op_inputs(rand, cell, B, T, H, lengths):
    G = 4 if cell == "lstm" else 3
    return dict(xproj=rand.randn(B, T, G * H), w_hh=rand.randn(G * H, H, scale=0.3), b_hh=rand.randn(G * H),
                h0=rand.randn(B, H), c0=rand.randn(B, H) if cell == "lstm" else None,
                lengths=torch.tensor(lengths, dtype=torch.long))


def within_lengths(t, lengths):
    T = t.shape[1]
    return t[torch.arange(T)[None, :] < torch.tensor(lengths).clamp(0, T)[:, None]]


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("weights", ["fp32", "tf32", "bf16"])
def test_kernel_matches_reference(rand, cell, reverse, weights):
    lengths = [7, 1, 3, 0, 5, 12]  # 0 runs no step; 12 > T is clamped to T
    a = op_inputs(rand, cell, 6, 7, 5, lengths)
    got = ops.rnn_forward(cell, **a, reverse=reverse, weights=weights)
    want = reference.rnn_forward(cell, *a.values(), reverse, weights)
    for i, (g, w) in enumerate(zip(got, want)):
        if i >= 3 and g.numel():  # saved/cs: defined within each sample's length only
            g, w = within_lengths(g, lengths), within_lengths(w, lengths)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"forward output {i}")
    y, _, _, saved, cs = got
    assert y[3].abs().max() == 0 and y[1, 1:].abs().max() == 0  # nothing past a sample's length
    torch.testing.assert_close(got[1][3], a["h0"][3])  # length 0: the state is h0
    dy, dh = rand.randn(6, 7, 5), rand.randn(6, 5)
    dc = rand.randn(6, 5) if cell == "lstm" else None
    args = (a["w_hh"], y, saved, cs, a["h0"], a["c0"], a["lengths"], dy, dh, dc)
    gg = ops.rnn_backward(cell, *args, reverse=reverse, weights=weights)
    gw = reference.rnn_backward(cell, *args, reverse, weights)
    for i, (g, w) in enumerate(zip(gg, gw)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"backward output {i}")
    assert gg[0][1, 1:].abs().max() == 0  # zero gradient past the length


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_tf32_is_fp32_on_the_cpu(rand, cell):
    """The tensor cores' mode has no CPU meaning: "tf32" computes exactly what "fp32" does (as torch's CPU
    matmul ignores allow_tf32), forward and backward, bit for bit."""
    lengths = [6, 2, 0, 4]
    a = op_inputs(rand, cell, 4, 6, 5, lengths)
    outs = {w: ops.rnn_forward(cell, **a, weights=w) for w in ("fp32", "tf32")}
    dy, dh = rand.randn(4, 6, 5), rand.randn(4, 5)
    for w, (y, _, _, saved, cs) in outs.items():
        outs[w] = list(outs[w]) + list(ops.rnn_backward(cell, a["w_hh"], y, saved, cs, a["h0"], a["c0"], a["lengths"],
                                                         dy, dh, None, weights=w))
    for i, (x, t) in enumerate(zip(outs["fp32"], outs["tf32"])):
        if 3 <= i <= 4 and x.numel():  # saved/cs: defined within each sample's length only
            x, t = within_lengths(x, lengths), within_lengths(t, lengths)
        assert torch.equal(x, t), f"output {i}"
    assert F.precision_for(torch.zeros(1)) == "fp32"  # and the modules never ask for it off the GPU


def test_missing_upstream_gradients_count_as_zero(rand):
    a = op_inputs(rand, "lstm", 3, 4, 6, [4, 2, 3])
    y, _, _, saved, cs = ops.rnn_forward("lstm", **a)
    zeros = torch.zeros_like(y)
    none = ops.rnn_backward("lstm", a["w_hh"], y, saved, cs, a["h0"], a["c0"], a["lengths"], None, None, None)
    explicit = ops.rnn_backward("lstm", a["w_hh"], y, saved, cs, a["h0"], a["c0"], a["lengths"], zeros,
                                torch.zeros_like(a["h0"]), torch.zeros_like(a["h0"]))
    for n, e in zip(none, explicit):
        torch.testing.assert_close(n, e)


def float64_alone(module, x, lengths, hx, up):
    """The oracle: torch's module in float64, each sample alone over its own steps."""
    m = copy.deepcopy(module).double()
    x = x.double().detach().requires_grad_()
    hx64 = None if hx is None else tuple(h.double().detach().requires_grad_() for h in
                                        (hx if isinstance(hx, tuple) else (hx,)))
    loss, outs = 0, []
    for i, L in enumerate(lengths):
        h_i = None if hx64 is None else tuple(h[:, i:i + 1] for h in hx64)
        if h_i is not None and isinstance(module, nn.GRU):
            h_i = h_i[0]
        y, state = m(x[i:i + 1, :L], h_i)
        states = state if isinstance(state, tuple) else (state,)
        loss = loss + (y * up[0][i:i + 1, :L].double()).sum() + \
            sum((s * u[:, i:i + 1].double()).sum() for s, u in zip(states, up[1:]))
        outs.append(y[0])
    ins = [x] + (list(hx64) if hx64 else []) + list(m.parameters())
    return outs, torch.autograd.grad(loss, ins)


@pytest.mark.parametrize("cls,layers,bidirectional,bias", [
    (nn.LSTM, 1, False, True), (nn.LSTM, 2, True, True), (nn.GRU, 2, True, True), (nn.GRU, 1, False, False),
    (nn.LSTM, 3, True, False)])
def test_autograd_matches_float64_samples_alone(rand, cls, layers, bidirectional, bias):
    D, H = 3, 5
    lengths = [rand.py.randint(1, 9) for _ in range(4)]
    T = max(lengths)
    torch.manual_seed(rand.seed % 2**31)
    m = cls(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=True)
    dirs = 2 if bidirectional else 1
    x = rand.randn(4, T, D)
    h0 = rand.randn(layers * dirs, 4, H)
    hx = (h0, rand.randn(layers * dirs, 4, H)) if cls is nn.LSTM else h0
    up = [rand.randn(4, T, dirs * H)] + [rand.randn(layers * dirs, 4, H) for _ in range(2 if cls is nn.LSTM else 1)]
    xr = x.clone().requires_grad_()
    hxr = tuple(h.clone().requires_grad_() for h in hx) if isinstance(hx, tuple) else hx.clone().requires_grad_()
    y, h_n, c_n = F.rnn(m, xr, torch.tensor(lengths), hxr)
    states = [h_n] + ([c_n] if c_n is not None else [])
    loss = (y * up[0]).sum() + sum((s * u).sum() for s, u in zip(states, up[1:]))
    got = torch.autograd.grad(loss, [xr] + list(hxr if isinstance(hxr, tuple) else (hxr,)) + list(m.parameters()))
    outs, want = float64_alone(m, x, lengths, hx, up)
    for i, L in enumerate(lengths):
        torch.testing.assert_close(y[i, :L].double(), outs[i], rtol=1e-5, atol=1e-6)
        assert y[i, L:].abs().max() == 0 if L < T else True
    for g, w in zip(got, want):
        err = ((g.double() - w).norm() / w.norm().clamp_min(1e-30)).item()
        assert err < 1e-5, err


@pytest.mark.parametrize("reverse", [False, True])
def test_recurrent_weight_grad_puts_h0_at_each_samples_first_step(rand, reverse):
    """dW_hh from one GEMM over the outputs shifted a row: every sample's first step (in its direction)
    reads h0, not the neighbouring sample's row, whether that sample is full length, one step, or empty."""
    lengths = [5, 0, 1, 3, 5]
    B, T, H, G = len(lengths), 5, 3, 12
    valid = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).unsqueeze(-1)
    y = rand.randn(B, T, H) * valid
    dg = rand.randn(B, T, G) * valid
    h0 = rand.randn(B, H)
    want = torch.zeros(G, H, dtype=torch.float64)
    for b, L in enumerate(lengths):
        for t in range(L):
            first = t == (L - 1 if reverse else 0)
            prev = h0[b] if first else y[b, t + 1 if reverse else t - 1]
            want += torch.outer(dg[b, t].double(), prev.double())
    got = F._recurrent_weight_grad(dg.view(B * T, G), y, h0, torch.tensor(lengths), reverse, "fp32")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_argument_checks_name_the_problem(rand):
    a = op_inputs(rand, "lstm", 2, 3, 4, [3, 2])
    call = lambda **kw: ops.rnn_forward("lstm", **{**a, **kw})  # noqa: E731
    with raises_matching(RuntimeError, 'cell must be "lstm" or "gru"'):
        ops.rnn_forward("rnn", **a)
    with raises_matching(RuntimeError, r"w_hh must have shape \(16, 4\), got \(16, 5\)"):
        call(w_hh=rand.randn(16, 5))
    with raises_matching(RuntimeError, "h0 must be float32, got Double"):
        call(h0=a["h0"].double())
    with raises_matching(RuntimeError, "an LSTM needs c0"):
        call(c0=None)
    with raises_matching(RuntimeError, r"lengths must have shape \(2,\)"):
        call(lengths=torch.tensor([1, 2, 3]))
    with raises_matching(RuntimeError, "lengths must be int64"):
        call(lengths=torch.tensor([1, 2], dtype=torch.int32))
    with raises_matching(RuntimeError, "xproj must be contiguous"):
        call(xproj=rand.randn(2, 16, 3).transpose(1, 2))
    with raises_matching(RuntimeError, 'weights must be "fp32", "tf32" or "bf16"'):
        ops.rnn_forward("lstm", **a, weights="fp16")
    with raises_matching(RuntimeError, "a GRU has no cell state"):
        ops.rnn_forward("gru", **{**op_inputs(rand, "gru", 2, 3, 4, [3, 2]), "c0": a["c0"]})


def test_fake_kernels_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        xp, w = torch.empty(2, 5, 12), torch.empty(12, 4)
        h0, lens = torch.empty(2, 4), torch.empty(2, dtype=torch.long)
        y, h_n, c_n, saved, cs = torch.ops.vlseq_ext.rnn_forward("gru", xp, w, None, h0, None, lens, False, "fp32")
        assert y.shape == (2, 5, 4) and h_n.shape == (2, 4) and c_n.numel() == 0 and saved.shape == (2, 5, 16)
        dg, dgh, dh0, dc0 = torch.ops.vlseq_ext.rnn_backward("gru", w, y, saved, cs, h0, None, lens, None, None, None,
                                                              False, "fp32")
        assert dg.shape == (2, 5, 12) and dgh.shape == (2, 5, 4) and dh0.shape == (2, 4) and dc0.numel() == 0


def test_plan_on_cpu():
    assert ops.rnn_plan("lstm", 256, 4, "fp32", "cpu") == "cpu"
    assert ops.rnn_plan("lstm", 256, 4, "fp32", "cpu", max_blocks=66) == "cpu"


@pytest.mark.parametrize("call", ["forward", "backward", "plan"])
def test_negative_block_budget_is_refused(call):
    xp, w, h0 = torch.zeros(2, 5, 12), torch.zeros(12, 4), torch.zeros(2, 4)
    lens = torch.tensor([5, 3])
    with pytest.raises(RuntimeError, match="max_blocks must be >= 0"):
        if call == "forward":
            torch.ops.vlseq_ext.rnn_forward("gru", xp, w, None, h0, None, lens, False, "fp32", -1)
        elif call == "backward":
            y, _, cs = torch.zeros(2, 5, 4), None, torch.zeros(0)
            torch.ops.vlseq_ext.rnn_backward("gru", w, y, torch.zeros(2, 5, 16), cs, h0, None, lens, None, None, None,
                                             False, "fp32", -1)
        else:
            torch.ops.vlseq_ext.rnn_plan("gru", 4, 2, "fp32", torch.empty(0), -1)


@pytest.mark.parametrize("layout", ["rows", "transposed", "slices", "strided"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mm", [ops.mm_tf32, reference.mm_tf32], ids=["kernel", "reference"])
def test_mm_tf32_is_the_exact_product_on_the_cpu(rand, layout, with_bias, mm):
    a, b = mm_operands(rand, 7, 5, 3, layout)
    bias = rand.randn(3) if with_bias else None
    want = a.double() @ b.double() + (bias.double() if with_bias else 0)
    torch.testing.assert_close(mm(a, b, bias).double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,k,n", [(0, 4, 3), (4, 0, 3), (4, 3, 0)])
def test_mm_tf32_of_empty_matrices(rand, m, k, n):
    bias = rand.randn(n)
    got = ops.mm_tf32(rand.randn(m, k), rand.randn(k, n), bias)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, bias.expand(m, n))  # k = 0: the bias alone


def test_mm_tf32_argument_checks_name_the_problem(rand):
    a, b = rand.randn(4, 3), rand.randn(3, 2)
    with raises_matching(RuntimeError, "a and b must be matrices, got 1-d and 2-d"):
        ops.mm_tf32(a[0], b)
    with raises_matching(RuntimeError, "a and b must be float32, got Double and Float"):
        ops.mm_tf32(a.double(), b)
    with raises_matching(RuntimeError, r"a must be a float32 matrix, got torch.float64 of shape \(4, 3\)"):
        reference.mm_tf32(a.double(), b)
    with raises_matching(RuntimeError, r"a is \[4, 3\] and b is \[2, 2\]: a's columns must equal b's rows"):
        reference.mm_tf32(a, b[:2])
    with raises_matching(RuntimeError, r"a is \[4, 3\] and b is \[2, 2\]: a's columns must equal b's rows"):
        ops.mm_tf32(a, b[:2])
    with raises_matching(RuntimeError, r"bias must be float32 of shape \(2\), got Float of shape \[3\]"):
        ops.mm_tf32(a, b, rand.randn(3))
    with raises_matching(TypeError, "bias"):
        ops.mm_tf32(a, b, [1.0, 2.0])


def test_mm_tf32_fake_kernel_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert torch.ops.vlseq_ext.mm_tf32(torch.empty(5, 3), torch.empty(3, 7), torch.empty(7)).shape == (5, 7)


@pytest.mark.parametrize("with_bias", [False, True])
def test_mm_tf32_gradients_are_the_products(rand, with_bias):
    """Differentiable: on the CPU (exact) its gradients are torch's own for a @ b + bias, for any subset
    of the inputs that requires them, and its output keeps no extra autograd graph of the kernel's."""
    a, b = rand.randn(6, 5), rand.randn(5, 3)
    bias = rand.randn(3) if with_bias else None
    up = rand.randn(6, 3)
    for wants in ([True, True, True], [True, False, False], [False, True, False]):
        leaves = [t.clone().requires_grad_(w) if t is not None else None for t, w in zip((a, b, bias), wants)]
        ops.mm_tf32(*leaves).backward(up)
        ref = [t.clone().requires_grad_(w) if t is not None else None for t, w in zip((a, b, bias), wants)]
        (ref[0] @ ref[1] + (ref[2] if ref[2] is not None else 0)).backward(up)
        for name, got, want in zip("a b bias".split(), leaves, ref):
            if got is None or not got.requires_grad:
                continue
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6, msg=name)
    assert ops.mm_tf32(a.requires_grad_(), b).grad_fn.name() != "MmBackward0"
