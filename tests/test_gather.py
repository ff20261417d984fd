"""One-sample passes with their recurrent calls batched (vlseq_ext.nn.gather) and the trainer's
"gathered" plan: every output and gradient equals the passes run one by one (float64 reference);
the calls that cannot join a batch run alone; errors reach the pass that made them; the order of
the passes' operations and random draws is the same every run. CPU tests run on torch's CPU RNN
and on the CPU kernels (modules.CPU_KERNELS); the GPU tests run the CUDA kernels with TF32 off."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import vlseq_ext.nn as vnn
from vlseq_ext import ParallelTrainer
from vlseq_ext.nn import modules
from vlseq_ext.nn.gather import CallGatherer, GatherCancelled, GatheredLinear, gather_linear_calls

from helpers import float64_reference_grads

pytestmark = pytest.mark.usefixtures("compiled_ops")
requires_cuda = pytest.mark.requires_cuda


@pytest.fixture(params=["torch", "kernels"])
def path(request, monkeypatch):
    monkeypatch.setattr(modules, "CPU_KERNELS", request.param == "kernels")
    return request.param


class OneSample(nn.Module):
    """The seed's style, with the usual variations: some work before and after the RNN, the last
    step's output and the final state both used."""

    def __init__(self, cell: str = "lstm", dim: int = 5, hidden: int = 7, layers: int = 2, bidirectional: bool = False,
                 batch_first: bool = True) -> None:
        super().__init__()
        cls = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = cls(dim, hidden, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional)
        self.scale = nn.Parameter(torch.ones(dim))
        self.fc = nn.Linear(hidden * (2 if bidirectional else 1) * 2, 1)

    def forward(self, x):
        x = torch.tanh(x * self.scale)
        batched = x.unsqueeze(0) if self.rnn.batch_first else x.unsqueeze(1)
        out, state = self.rnn(batched)
        h = state[0] if isinstance(state, tuple) else state
        last = out[0, -1] if self.rnn.batch_first else out[-1, 0]
        final = h[-1] if not self.rnn.bidirectional else torch.cat([h[-2], h[-1]], -1)
        return self.fc(torch.cat([last.unsqueeze(0), final], -1))


def one_by_one(model, xs):
    return [model(x) for x in xs]


def gathered(model, xs, gatherer=None):
    g = gatherer or CallGatherer()
    try:
        return g.run([lambda x=x: model(x) for x in xs])
    finally:
        if gatherer is None:
            g.close()


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_grads(model, xs):
    ref = copy.deepcopy(model).double()
    vnn.use_kernels(ref, "cudnn")
    loss = sum((ref(x.double()) ** 2).sum() for x in xs)
    loss.backward()
    return [o.detach() for o in one_by_one(ref, [x.double() for x in xs])], grads(ref)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("bidirectional,batch_first", [(False, True), (True, True), (True, False)])
def test_gathered_passes_equal_one_by_one_float64(rand, path, cell, bidirectional, batch_first):
    torch.manual_seed(rand.seed % 2**31)
    model = OneSample(cell, bidirectional=bidirectional, batch_first=batch_first)
    vnn.use_kernels(model, "vlseq" if path == "kernels" else "auto")
    xs = [rand.randn(n, 5) for n in (9, 1, 23, 4, 4, 16)]
    want, want_grads = reference_grads(model, xs)
    g = CallGatherer()
    for _ in range(2):  # the threads are reused
        model.zero_grad()
        outs = gathered(model, xs, g)
        sum((o ** 2).sum() for o in outs).backward()
        for o, w in zip(outs, want):
            torch.testing.assert_close(o.double(), w, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads(model), want_grads):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert (g.joined_calls, g.gathered_calls) == (2, 2 * len(xs))
    g.close()


def test_calls_of_any_shape_and_state_join_one_batch(rand, path):
    """Batched and unbatched input, given lengths, given (h0, c0), two calls per pass, two modules:
    each call gets what it gets alone."""
    torch.manual_seed(rand.seed % 2**31)
    a = vnn.LSTM(3, 4, num_layers=2, batch_first=True, bidirectional=True)
    b = vnn.GRU(8, 5, batch_first=False)
    h0 = rand.randn(4, 2, 4), rand.randn(4, 2, 4)
    calls = [
        lambda: (),                                                    # no call at all: done in the first round
        lambda: (a(rand_x[0]),),                                       # unbatched (L, D)
        lambda: (a(rand_x[1], h0, lengths=torch.tensor([6, 2])),),     # batch of 2, own lengths and state
        lambda: (a(rand_x[2]), b(a(rand_x[2])[0].transpose(0, 1))),    # two calls of a, then b
        lambda: (b(rand_x[3][:, None]),),                              # (L, 1, D) for a batch_first=False GRU
    ]
    rand_x = [rand.randn(5, 3), rand.randn(2, 6, 3), rand.randn(1, 3, 3), rand.randn(7, 8)]
    alone = [c() for c in calls]
    g = CallGatherer()
    together = g.run(calls)
    assert g.joined_calls >= 2
    g.close()
    for x, y in zip(alone, together):
        for (ox, sx), (oy, sy) in zip(x, y):
            torch.testing.assert_close(oy, ox, rtol=1e-5, atol=1e-6)
            for s, t in zip(sx if isinstance(sx, tuple) else (sx,), sy if isinstance(sy, tuple) else (sy,)):
                torch.testing.assert_close(t, s, rtol=1e-5, atol=1e-6)


def test_a_gathered_batch_runs_as_host_bound(rand, monkeypatch):
    """The passes' joined calls, a batch of one included, are planned as host-bound (no grid stack
    pipelined: concurrency.pipeline_layout says why); a call outside a gatherer is not."""
    monkeypatch.setattr(modules, "CPU_KERNELS", True)
    torch.manual_seed(rand.seed % 2**31)
    rnn = vnn.LSTM(3, 4, num_layers=2, batch_first=True)
    seen = []
    layout = rnn._layout
    rnn._layout = lambda *args: seen.append(args[-1]) or layout(*args)
    xs = [rand.randn(5, 3), rand.randn(2, 3)]
    rnn(xs[0].unsqueeze(0))
    assert seen == [False]
    for n in (2, 1):
        seen.clear()
        gathered(rnn, [x.unsqueeze(0) for x in xs[:n]])
        assert seen == [True]


def test_a_bad_call_fails_its_own_pass_with_the_modules_message(rand):
    model = vnn.LSTM(4, 6, batch_first=True)
    g = CallGatherer()
    good = [lambda: model(rand.randn(1, 5, 4))[0] for _ in range(3)]
    with pytest.raises(ValueError, match="input has 3 features per step, the module expects 4"):
        g.run(good[:1] + [lambda: model(rand.randn(1, 5, 3))[0]] + good[1:])
    outs = g.run(good)  # the gatherer works on after a failed run
    assert [tuple(o.shape) for o in outs] == [(1, 5, 6)] * 3
    g.close()


def test_packed_calls_run_alone_beside_a_batch(rand):
    model = vnn.GRU(4, 6)
    seqs = [rand.randn(5, 4), rand.randn(2, 4)]
    single = rand.randn(3, 1, 4)
    g = CallGatherer()
    outs = g.run([lambda: model(pack_sequence(seqs, enforce_sorted=False))[1], lambda: model(single)[1],
                  lambda: model(single)[1]])
    g.close()
    torch.testing.assert_close(outs[0], model(pack_sequence(seqs, enforce_sorted=False))[1])
    torch.testing.assert_close(outs[1], model(single)[1])
    assert (g.joined_calls, g.gathered_calls) == (1, 3)


def test_an_error_cancels_the_waiting_passes_and_the_first_error_is_raised(rand):
    model = vnn.LSTM(2, 3)
    reached = []

    def fails_before_its_call():
        raise KeyError("pass 1")

    def waits_then_continues(i):
        def fn():
            out = model(rand.randn(4, 2))
            reached.append(i)  # never: its call is cancelled
            return out
        return fn

    g = CallGatherer()
    with pytest.raises(KeyError, match="pass 1"):
        g.run([waits_then_continues(0), fails_before_its_call, waits_then_continues(2)])
    assert reached == []

    def catches_cancellation():
        with pytest.raises(GatherCancelled):
            model(rand.randn(4, 2))
        return "went on"

    with pytest.raises(KeyError):
        g.run([catches_cancellation, fails_before_its_call])
    assert len(g.run([waits_then_continues(5)] * 2)) == 2 and reached == [5, 5]
    g.close()
    with pytest.raises(RuntimeError, match="after close"):
        g.run([waits_then_continues(0)])


def test_passes_run_in_order_so_random_draws_repeat(rand):
    """Dropout inside the passes and between the RNN's layers: the same seed gives the same outputs."""
    model = OneSample(layers=2)
    model.rnn = vnn.LSTM(5, 7, num_layers=2, batch_first=True, dropout=0.5)
    model.train()
    xs = [rand.randn(n, 5) for n in (3, 8, 5, 5)]
    g = CallGatherer()
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(torch.cat(g.run([lambda x=x: model(nn.functional.dropout(x, 0.3)) for x in xs])))
    g.close()
    assert torch.equal(runs[0], runs[1])


def test_the_passes_see_the_callers_grad_mode():
    model = vnn.LSTM(2, 3)
    g = CallGatherer()
    with torch.no_grad():
        outs = g.run([lambda: model(torch.randn(3, 2))[0]] * 2)
    assert not any(o.requires_grad for o in outs)
    outs = g.run([lambda: model(torch.randn(3, 2))[0]] * 2)
    assert all(o.requires_grad for o in outs)
    g.close()


def test_calls_join_only_calls_of_the_same_grad_mode():
    """A pass that runs the RNN under no_grad (a frozen teacher, say) gets no graph back, even when
    another pass calls the same module with gradients at the same time."""
    model = vnn.LSTM(2, 3)
    x = torch.randn(4, 2)

    def frozen():
        with torch.no_grad():
            return model(x)[0]

    g = CallGatherer()
    outs = g.run([frozen, lambda: model(x)[0], frozen])
    assert [o.requires_grad for o in outs] == [False, True, False]
    assert (g.joined_calls, g.gathered_calls) == (2, 3)
    torch.testing.assert_close(outs[0], outs[1].detach())
    g.close()


def test_a_wrong_initial_state_fails_its_own_pass(rand):
    model = vnn.GRU(3, 4, batch_first=True)
    g = CallGatherer()
    good = lambda: model(rand.randn(1, 5, 3))[1]  # noqa: E731
    with pytest.raises(ValueError, match=r"initial state must have shape \(1, 1, 4\), got \(1, 2, 4\)"):
        g.run([good, lambda: model(rand.randn(1, 5, 3), torch.zeros(1, 2, 4))[1], good])
    g.close()


def test_linear_calls_join_one_batch_of_rows(rand):
    """GatheredLinear: inputs of any leading shape share one matmul; a wrong feature count or another
    dtype runs alone and fails (or not) as it would; outside a gathered pass it is nn.Linear."""
    torch.manual_seed(rand.seed % 2**31)
    plain = nn.Linear(6, 3)
    lin = copy.deepcopy(plain)
    assert gather_linear_calls(nn.Sequential(lin)) == 1 and isinstance(lin, GatheredLinear)
    assert lin.state_dict().keys() == plain.state_dict().keys()
    xs = [rand.randn(1, 6), rand.randn(4, 6), rand.randn(2, 3, 6), rand.randn(6)]
    g = CallGatherer()
    outs = g.run([lambda x=x: lin(x) for x in xs])
    assert (g.joined_calls, g.gathered_calls) == (1, 4)
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, plain(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        g.run([lambda: lin(xs[0]), lambda: lin(rand.randn(2, 5))])
    with pytest.raises(RuntimeError, match="dtype"):
        g.run([lambda: lin(xs[0]), lambda: lin(xs[1].double())])
    g.close()
    torch.testing.assert_close(lin(xs[1]), plain(xs[1]))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is a Linux call")
def test_pinned_passes_restore_the_callers_cores_and_a_core_not_allowed_is_ignored():
    model = vnn.LSTM(2, 3)
    before = os.sched_getaffinity(0)
    seen = []

    def pass_():
        seen.append(os.sched_getaffinity(0))
        return model(torch.randn(3, 2))[0]

    for cpu in (max(before), 10**6):
        g = CallGatherer(cpu=cpu)
        assert len(g.run([pass_] * 3)) == 3
        g.close()
        assert os.sched_getaffinity(0) == before
    assert seen[:3] == [{max(before)}] * 3 and seen[3:] == [before] * 3


OPENMP_CHECK = """
import os, threading, torch
from vlseq_ext.nn import LSTM
from vlseq_ext.nn.gather import CallGatherer
torch.set_num_threads(2)
core = max(os.sched_getaffinity(0))
model = LSTM(2, 3)

def pinned_threads():
    n = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            n += [l for l in f if l.startswith("Cpus_allowed_list")][0].split()[1] == str(core)
    return n

def caller():  # a fresh thread: no OpenMP team yet
    g = CallGatherer(cpu=core)
    g.run([lambda: model(torch.randn(3, 2))[0]] * 2)
    torch.ones(1 << 20).sum()  # its first parallel op after running pinned passes
    print(pinned_threads())
    g.close()

t = threading.Thread(target=caller)
t.start()
t.join()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.isdir("/proc/self/task"), reason="needs Linux and two cores")
def test_the_callers_openmp_team_is_not_made_on_the_pinned_core():
    """Pinning the caller while it runs the passes must not leave its OpenMP team (made at its first
    parallel region, inheriting its cores) on that one core: only the two pass threads are there."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", OPENMP_CHECK], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "2", proc.stdout


def test_gathering_is_not_reentrant():
    g = CallGatherer()
    with pytest.raises(RuntimeError, match="inside a gathered pass"):
        g.run([lambda: CallGatherer().run([lambda: 1])])
    g.close()


# ---------------------------------------------------------------------------------------------
# the trainer's plan
# ---------------------------------------------------------------------------------------------


def batch(rand, n, dim=5, max_len=30):
    lengths = [int(v) for v in torch.randint(1, max_len, (n,), generator=rand.generator())]
    return [rand.randn(L, dim) for L in lengths], [rand.randn(1) for _ in lengths]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cell,bidirectional", [("lstm", False), ("gru", True)])
def test_trainer_gathers_one_sample_models_on_cpu(rand, cell, bidirectional, reduction):
    torch.manual_seed(rand.seed % 2**31)
    model = OneSample(cell, bidirectional=bidirectional)
    xs, ys = batch(rand, 7)
    want = list(float64_reference_grads(model, xs, ys, reduction).values())
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=4, reduction=reduction)
    for _ in range(2):
        trainer.compute_gradients(xs, ys)
        for a, b in zip(grads(model), want):  # float32 against float64: relative to each gradient's norm
            assert (a.double() - b).norm() <= 1e-5 * b.norm() + 1e-9
    assert trainer.runner.plan == "gathered"
    assert isinstance(model.fc, GatheredLinear) and isinstance(trainer.replicas.lanes[1][0].module.fc, GatheredLinear)
    # each step: per device one joined call of the RNN, one of the head; every sample in each
    gatherers = [g for g in trainer.runner._gatherers if g is not None]
    assert sum(g.gathered_calls for g in gatherers) == 2 * 2 * 7
    assert sum(g.joined_calls for g in gatherers) == 2 * 2 * 2
    out = trainer.evaluate(xs, batch_size=5)
    torch.testing.assert_close(out, torch.cat([model(x) for x in xs]).detach(), rtol=1e-5, atol=1e-6)
    trainer.close()


def test_a_dropped_trainer_ends_its_pass_threads(rand):
    import gc
    model = OneSample()
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu",
                              samples_per_device=3)
    trainer.compute_gradients(*batch(rand, 3))
    threads = [s.thread for s in trainer.runner._gatherers[0]._slots]
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    del trainer
    gc.collect()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def test_trainer_plans_for_one_sample_models():
    """Gathered needs the model's RNN to be an nn.LSTM/GRU module the trainer may swap, k > 1 and
    pack not False; otherwise the per-sample plan, as before."""
    xs = [torch.randn(5, 5) for _ in range(4)]

    def plan(model, **kw):
        t = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu", **kw)
        t.runner.prepare(xs)
        t.close()
        return t.runner.plan

    assert plan(OneSample(), samples_per_device=4) == "gathered"
    assert plan(OneSample(), samples_per_device=4, pack=True) == "gathered"
    assert plan(OneSample(), samples_per_device=4, pack=False) == "per_sample"
    assert plan(OneSample(), samples_per_device=1) == "per_sample"
    assert plan(OneSample(), samples_per_device=4, rnn_kernels="cudnn") == "per_sample"  # torch's module kept

    class CellLoop(nn.Module):  # no RNN module to stop at
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(5, 4)
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            h = c = x.new_zeros(1, 4)
            for t in range(x.shape[0]):
                h, c = self.cell(x[t:t + 1], (h, c))
            return self.fc(h)

    assert plan(CellLoop(), samples_per_device=4) == "per_sample"


@requires_cuda
@pytest.mark.parametrize("cell,hidden,layers,bidirectional", [("lstm", 256, 2, False), ("gru", 130, 1, True),
                                                               ("lstm", 1024, 1, False)])
def test_gpu_trainer_gathers_wide_one_sample_models(rand, no_tf32, cell, hidden, layers, bidirectional):
    """Wide one-sample models gathered (pack=True): one batch on the kernels per module call, the
    gradient of the float64 per-sample reference, and no slow-plan warning."""
    import warnings

    from vlseq_ext import SlowPlanWarning
    torch.manual_seed(rand.seed % 2**31)
    model = OneSample(cell, dim=36, hidden=hidden, layers=layers, bidirectional=bidirectional).cuda()
    xs, ys = batch(rand, 12, dim=36, max_len=70)
    want = list(float64_reference_grads(model, xs, ys).values())
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), devices="cuda:0",
                              samples_per_device=12, rnn_kernels="vlseq", pack=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPlanWarning)
        for _ in range(2):
            trainer.compute_gradients(xs, ys)
    for a, b in zip(grads(model), want):
        err = ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 2e-5, err
    assert trainer.runner.plan == "gathered"
    gatherer = trainer.runner._gatherers[0]
    assert gatherer.gathered_calls == gatherer.joined_calls * 12
    trainer.close()


def test_padded_flat_equals_pad_sequence(rand):
    """The one-launch padding of a gathered batch of data writes pad_sequence's bits: any lengths
    (1 and the longest twice), trailing dims, a strided sample, NaN and infinities kept."""
    from torch.nn.utils.rnn import pad_sequence

    from helpers import assert_same_bits
    for dtype in (torch.float32, torch.float64):
        samples = [rand.randn(n, 3, 2).to(dtype) for n in (4, 1, 7, 7, 2)]
        samples.append(rand.randn(3, 2, 5).to(dtype).permute(2, 0, 1))  # (5, 3, 2), not contiguous
        samples[2][3, 1, 0], samples[3][0, 0, 1], samples[4][1, 2, 1] = float("nan"), float("inf"), -0.0
        assert_same_bits(modules._padded_flat(samples), pad_sequence(samples, batch_first=True), str(dtype))


class LastState(nn.Module):
    """A one-sample model whose recurrent input is the data itself (no gradient flows to it)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(dim, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 1)

    def forward(self, x):
        _, (h, _) = self.rnn(x.unsqueeze(0))
        return self.fc(h[-1])


@requires_cuda
def test_gpu_gathered_data_without_cuda_flatten_is_padded_by_copies(rand, monkeypatch):
    """An extension without its CUDA kernels has no flatten for the GPU: the padding is pad_sequence's."""
    from vlseq_ext import ops
    monkeypatch.setattr(ops, "has_cuda_kernels", lambda: False)
    monkeypatch.setattr(modules, "_padded_flat", lambda samples: pytest.fail("flatten without CUDA kernels"))
    samples = [rand.randn(n, 3).cuda() for n in (4, 1, 6)]
    assert torch.equal(modules._padded(samples), torch.nn.utils.rnn.pad_sequence(samples, batch_first=True))


@requires_cuda
def test_gpu_gathered_data_is_padded_in_one_launch(rand, no_tf32, monkeypatch):
    """A gathered batch of data is padded by _padded_flat (one launch), one whose samples carry a
    gradient by pad_sequence; both give the float64 per-sample reference's gradients."""
    padded = []
    flat = modules._padded_flat
    monkeypatch.setattr(modules, "_padded_flat", lambda samples: padded.append(len(samples)) or flat(samples))
    xs, ys = batch(rand, 12, dim=36, max_len=70)
    for model, want_padded in ((LastState(36, 256), [12, 12]), (OneSample(dim=36, hidden=256, layers=1), [])):
        torch.manual_seed(rand.seed % 2**31)
        model = model.cuda()
        want = list(float64_reference_grads(model, xs, ys).values())
        trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), nn.MSELoss(), devices="cuda:0",
                                  samples_per_device=12, rnn_kernels="vlseq", pack=True)
        padded.clear()
        for _ in range(2):
            trainer.compute_gradients(xs, ys)
        assert trainer.runner.plan == "gathered" and padded == want_padded
        for a, b in zip(grads(model), want):
            err = ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert err < 2e-5, err
        trainer.close()


@requires_cuda
def test_gpu_auto_gathers_where_one_sample_fills_the_gpu():
    """pack="auto": per-sample graphs where one sample's recurrence runs in a cluster (they run side by
    side on lanes), gathered where it takes the whole GPU (LSTM 1024: the grid layout)."""
    xs = [torch.randn(6, 36) for _ in range(4)]

    def plan(hidden, layers):
        model = OneSample(dim=36, hidden=hidden, layers=layers).cuda()
        t = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cuda:0",
                            samples_per_device=4)
        t.runner.prepare(xs)
        t.close()
        return t.runner.plan

    assert plan(1024, 1) == "gathered"
    assert plan(256, 2) == "per_sample"


@requires_cuda
def test_gpu_calls_on_another_stream_run_on_it(rand, no_tf32):
    """A pass that calls the RNN on a side stream gets its batch run on that stream (ordered with the
    pass's own work there), not on the caller's."""
    model = vnn.LSTM(5, 16, batch_first=True, kernels="vlseq").cuda()
    side = torch.cuda.Stream()
    xs = [rand.randn(1, n, 5, device="cuda") for n in (7, 3, 9)]

    def on_side(x):
        def fn():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = model(x * 2)[0]
                ready = torch.cuda.Event()
                ready.record()
            torch.cuda.current_stream().wait_event(ready)
            return out
        return fn

    g = CallGatherer()
    outs = g.run([on_side(xs[0]), lambda: model(xs[1] * 2)[0], on_side(xs[2])])
    torch.cuda.synchronize()
    assert (g.joined_calls, g.gathered_calls) == (2, 3)
    g.close()
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, model(x * 2)[0], rtol=1e-5, atol=1e-6)
