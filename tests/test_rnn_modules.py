"""vlseq_ext.nn.LSTM / GRU as drop-ins for torch's modules, on the CPU: the same parameters, state_dict
and outputs; lengths= and PackedSequence input; the fallback to torch's RNN and its one-time warning;
use_kernels() swapping the modules of any model in place. The kernel path itself runs here on the
CPU kernels (modules.CPU_KERNELS), so its input handling is tested without a GPU."""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import vlseq_ext.nn as vnn
from vlseq_ext import SeqModel
from vlseq_ext.nn import modules

from helpers import raises_matching

pytestmark = pytest.mark.usefixtures("compiled_ops")


@pytest.fixture(params=["torch", "kernels"])
def path(request, monkeypatch):
    """Every module test runs twice: on torch's CPU RNN (the fallback) and on the CPU kernels."""
    monkeypatch.setattr(modules, "CPU_KERNELS", request.param == "kernels")
    return request.param


def pair(cls, *args, **kwargs):
    torch.manual_seed(0)
    ref = cls(*args, **kwargs)
    mine = (vnn.LSTM if cls is nn.LSTM else vnn.GRU)(*args, kernels="auto", **kwargs)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def padded(rand, lengths, D, batch_first=True):
    x = rand.randn(len(lengths), max(lengths), D)
    x[torch.arange(max(lengths))[None, :] >= torch.tensor(lengths)[:, None]] = 0
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [True, False])
def test_lengths_equal_torch_on_packed_input(rand, path, cls, batch_first):
    ref, mine = pair(cls, 4, 6, num_layers=2, bidirectional=True, batch_first=batch_first)
    lengths = [5, 1, 3]
    x = padded(rand, lengths, 4, batch_first)
    out, state = mine(x, lengths=torch.tensor(lengths))
    want, wstate = ref(pack_padded_sequence(x, torch.tensor(lengths), batch_first=batch_first, enforce_sorted=False))
    want = pad_packed_sequence(want, batch_first=batch_first, total_length=5)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(state if isinstance(state, tuple) else (state,), wstate if isinstance(wstate, tuple) else (wstate,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_packed_input_keeps_torchs_packing(rand, path, cls):
    ref, mine = pair(cls, 3, 4)
    lengths = torch.tensor([2, 6, 4])
    packed = pack_padded_sequence(padded(rand, [2, 6, 4], 3, batch_first=False), lengths, enforce_sorted=False)
    out, state = mine(packed)
    want, wstate = ref(packed)
    assert torch.equal(out.batch_sizes, want.batch_sizes) and torch.equal(out.sorted_indices, want.sorted_indices)
    torch.testing.assert_close(out.data, want.data, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_plain_and_unbatched_input_with_initial_state(rand, path, cls):
    ref, mine = pair(cls, 3, 4, num_layers=2)
    x = rand.randn(7, 2, 3)
    h0 = rand.randn(2, 2, 4)
    hx = (h0, rand.randn(2, 2, 4)) if cls is nn.LSTM else h0
    torch.testing.assert_close(mine(x, hx)[0], ref(x, hx)[0], rtol=1e-5, atol=1e-6)
    one = rand.randn(5, 3)  # unbatched (steps, features)
    h1 = (hx[0][:, 0], hx[1][:, 0]) if cls is nn.LSTM else hx[:, 0]
    got, want = mine(one, h1), ref(one, h1)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[0].shape == (5, 4)


def test_bad_input_is_named(rand, path):
    mine = vnn.LSTM(3, 4, batch_first=True, kernels="auto")
    x = rand.randn(2, 5, 3)
    with raises_matching(ValueError, "2 features per step, the module expects 3"):
        mine(rand.randn(2, 5, 2))
    with raises_matching(ValueError, r"lengths must have shape \(2,\)"):
        mine(x, lengths=torch.tensor([5]))
    with raises_matching(ValueError, r"lengths must be in 1\.\.5"):
        mine(x, lengths=torch.tensor([6, 1]))
    with raises_matching(ValueError, r"lengths must be in 1\.\.5"):
        mine(x, lengths=torch.tensor([0, 1]))
    with raises_matching(ValueError, "lengths must be integers"):
        mine(x, lengths=torch.tensor([1.5, 2.0]))
    with raises_matching(ValueError, "needs batched input"):
        mine(rand.randn(5, 3), lengths=[5])
    with raises_matching(ValueError, "input has 0 steps: every sample needs at least one"):
        mine(rand.randn(2, 0, 3), lengths=torch.tensor([1, 1]))
    with raises_matching(ValueError, "kernels must be one of"):
        vnn.GRU(3, 4, kernels="fast")


@pytest.mark.parametrize("cls", [vnn.LSTM, vnn.GRU])
def test_a_batch_of_no_samples_with_lengths_gets_what_it_gets_without(rand, path, cls):
    """torch's packing refuses an empty batch; lengths of shape (0,) say nothing, so the answer is
    torch's own for the empty batch: empty outputs and states."""
    mine = cls(3, 4, num_layers=2, batch_first=True, kernels="auto")
    x = rand.randn(0, 5, 3)
    out, state = mine(x, lengths=torch.zeros(0, dtype=torch.long))
    want_out, want_state = mine(x)
    assert out.shape == want_out.shape == (0, 5, 4)
    for got, want in zip(state if isinstance(state, tuple) else (state,),
                         want_state if isinstance(want_state, tuple) else (want_state,)):
        assert got.shape == want.shape == (2, 0, 4)


@pytest.mark.parametrize("given", ["padded", "lengths", "packed"])
def test_bad_state_and_dtype_are_named_on_every_path(rand, path, given):
    """torch's own modules fail on some of these inside a GEMM or on `.dim` (packed input skips
    their dtype check): ours name the problem whichever path the call takes."""
    lstm = vnn.LSTM(3, 4, batch_first=True, kernels="auto")
    gru = vnn.GRU(3, 4, batch_first=True, kernels="auto")
    x = rand.randn(2, 5, 3)

    def call(module, x, hx=None):
        if given == "packed":
            return module(pack_padded_sequence(x, torch.tensor([5, 2]), batch_first=True), hx)
        return module(x, hx, lengths=torch.tensor([5, 2]) if given == "lengths" else None)

    h = rand.randn(1, 2, 4)
    with raises_matching(ValueError, r"an LSTM's hx must be a tuple of two tensors \(h0, c0\), got Tensor"):
        call(lstm, x, h)
    with raises_matching(ValueError, "an LSTM's hx must be a tuple of two tensors .*got tuple of Tensor, ndarray"):
        call(lstm, x, (h, h.numpy()))
    with raises_matching(ValueError, r"a GRU's hx must be a tensor \(h0\), got tuple of Tensor"):
        call(gru, x, (h,))
    with raises_matching(ValueError, "a GRU's hx must be a tensor .*got ndarray"):
        call(gru, x, h.numpy())
    with raises_matching(ValueError, "initial state must be torch.float32 like the parameters, got torch.float64"):
        call(gru, x, h.double())
    with raises_matching(ValueError, r"input dtype \(torch.float64\) does not match weight dtype \(torch.float32\)"):
        call(lstm, x.double())
    with raises_matching(ValueError, r"input dtype \(torch.bfloat16\) does not match"):
        call(gru, x.bfloat16())
    as_list, as_tuple = call(lstm, x, [h, h + 1]), call(lstm, x, (h, h + 1))  # a list is taken as torch takes it
    out = (lambda o: o.data) if given == "packed" else (lambda o: o)
    assert torch.equal(out(as_list[0]), out(as_tuple[0]))


def test_state_dict_and_parameters_are_torchs(rand):
    ref, mine = pair(nn.LSTM, 3, 4, num_layers=2, bidirectional=True, bias=False)
    assert list(ref.state_dict()) == list(mine.state_dict())
    assert isinstance(mine, nn.LSTM)
    clone = pickle.loads(pickle.dumps(mine))
    assert clone.kernels == "auto" and torch.equal(clone.weight_hh_l1_reverse, mine.weight_hh_l1_reverse)
    assert copy.deepcopy(mine).kernels == "auto"


def test_fallback_warns_once_per_reason(rand):
    mine = vnn.GRU(3, 4)  # kernels="vlseq" asks for the kernels: on the CPU it says why it cannot
    modules._warned.clear()
    with pytest.warns(vnn.VlseqFallbackWarning, match="not on a CUDA device"):
        mine(rand.randn(2, 5, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mine(rand.randn(2, 5, 3))  # said once
        vnn.GRU(3, 4, kernels="auto")(rand.randn(2, 5, 3))  # "auto" picks silently


def test_fallback_reason_names_the_batch_when_one_sample_fits(monkeypatch):
    """A layer whose W_hh fits but whose batch is more than the layouts hold (e.g. LSTM 1024 with
    hundreds of samples) says so, not that its hidden size does not fit."""
    monkeypatch.setattr(modules, "CPU_KERNELS", True)
    x = torch.randn(300, 3, 4)
    m = vnn.LSTM(4, 1024)
    monkeypatch.setattr(m, "_plan", lambda batch, device: "grid 128 blocks x 1 groups" if batch <= 128 else "")
    reason = m.kernel_fallback_reason(x, 300)
    assert "batch of 300 samples" in reason and "smaller batches" in reason, reason
    assert m.kernel_fallback_reason(x, 128) is None
    monkeypatch.setattr(m, "_plan", lambda batch, device: "")
    assert "hidden size 1024 does not fit" in m.kernel_fallback_reason(x, 300)


def test_use_kernels_swaps_in_place_keeping_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.LSTM(3, 8)
            self.dec = nn.GRU(8, 8)
            self.head = nn.Linear(8, 1)

    net = Net()
    params = list(net.parameters())
    keys = list(net.state_dict())
    assert vnn.use_kernels(net, "cudnn") == 0 and type(net.enc) is nn.LSTM
    assert vnn.use_kernels(net) == 2
    assert type(net.enc) is vnn.LSTM and type(net.dec) is vnn.GRU and net.enc.kernels == "auto"
    assert all(a is b for a, b in zip(params, net.parameters())) and list(net.state_dict()) == keys
    assert vnn.use_kernels(net, "cudnn") == 2 and net.dec.kernels == "cudnn"
    with raises_matching(ValueError, "kernels must be one of"):
        vnn.use_kernels(net, "gpu")


def test_seq_model_keeps_its_keys_and_results(rand, path):
    model = SeqModel(5, 8, 2, num_layers=2, rnn="gru", bidirectional=True)
    assert list(model.state_dict())[0].startswith("gru.")
    xs = [rand.randn(n, 5) for n in (4, 1, 7)]
    batch = model(xs)
    x = torch.zeros(3, 7, 5)
    for i, s in enumerate(xs):
        x[i, :len(s)] = s
    padded_out = model.forward_padded(x, torch.tensor([4, 1, 7]))
    alone = torch.cat([model(s) for s in xs])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_out, alone, rtol=1e-5, atol=1e-6)


def test_trainer_swaps_the_models_rnns_and_keeps_its_parameters():
    from vlseq_ext import ParallelTrainer

    class OneSample(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(3, 8, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.rnn(x.unsqueeze(0))[1][-1])

    model = OneSample()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices="cpu", rnn_kernels="vlseq")
    assert type(model.rnn) is vnn.GRU and model.rnn.kernels == "vlseq"
    assert all(a is b for a, b in zip(params, model.parameters()))
    loss = trainer.step([torch.randn(5, 3)], [torch.randn(1)])
    assert torch.isfinite(loss)
    with raises_matching(ValueError, "rnn_kernels must be 'auto', 'vlseq' or 'cudnn'"):
        ParallelTrainer(OneSample(), opt, nn.MSELoss(), devices="cpu", rnn_kernels="fast")
    plain = OneSample()
    ParallelTrainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), nn.MSELoss(), devices="cpu",
                    rnn_kernels="cudnn")
    assert type(plain.rnn) is nn.GRU


def test_auto_follows_the_measured_rule(monkeypatch):
    """auto: cuDNN for unpadded input up to hidden 64, and under bf16 autocast for layers only the kernels
    holding W_hh in bfloat16 hold; the kernels otherwise, grid layouts with TF32 on or off, training or
    not, bf16 on the tf32 kernels (modules.AUTO_* and BENCHMARKS.md)."""
    monkeypatch.setattr(modules, "CPU_KERNELS", True)
    x = torch.randn(2, 3, 4)
    cluster = "cluster 16 blocks x 1 groups, 16 units and 1 samples per block"

    def choice(hidden, padded, plan=cluster, bf16_plan=None):
        m = vnn.LSTM(4, hidden, kernels="auto")
        monkeypatch.setattr(m, "_plan", lambda batch, device, max_blocks=0, weights="fp32":
                            bf16_plan if weights == "bf16" else plan)
        return m.uses_kernels(x, 2, padded)

    assert not choice(64, padded=False) and choice(64, padded=True) and choice(65, padded=False)
    assert choice(128, padded=False) and choice(256, padded=False)
    grid = "grid 128 blocks x 1 groups, 8 units and {} samples per block, h staged 352 columns at a time"
    for tf32 in (True, False):  # ours runs TF32 where cuDNN would: faster either way, forward alone too
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
        assert choice(1024, False, grid.format(32)) and choice(1024, True, grid.format(16))
        with torch.no_grad():
            assert choice(1024, False, grid.format(32)) and choice(1024, True, grid.format(16))
            assert choice(512, False, grid.format(6))
    # bf16 autocast: the kernels where the plan runs the tf32 ones on W_hh rounded to bfloat16, padded or not
    # (but unpadded hidden 64); cuDNN where only the kernels holding W_hh in bfloat16 hold the layer
    monkeypatch.setattr(vnn.functional, "precision_for", lambda x: "bf16")
    rounded = ", W_hh rounded to bfloat16"
    assert choice(256, False, bf16_plan=cluster + rounded) and choice(1024, False, bf16_plan=grid.format(16) + rounded)
    assert choice(1024, True, bf16_plan=grid.format(16) + rounded) and not choice(64, False, bf16_plan=cluster + rounded)
    assert not choice(1400, False, bf16_plan=grid.format(8)) and not choice(1400, True, bf16_plan=grid.format(8))
