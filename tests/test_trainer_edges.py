"""What plain PyTorch does, ParallelTrainer does too, at the edges a real user reaches: frozen and
unfrozen parameters, a step that raised, a checkpoint inside an accumulation window, dropout on CPU
replicas, float64 and half models, non-contiguous parameters. And a clear error where plain
PyTorch would broadcast silently: outputs of the wrong shape, a loss that is not one number,
integer targets for a regression loss."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vlseq_ext import ParallelTrainer, SeqModel


def batch(n, gen, dim=3, out=1, lo=2, hi=9):
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return ([torch.randn(L, dim, generator=gen) for L in lengths], [torch.randn(out, generator=gen) for _ in lengths])


def plain_step(model, opt, xs, ys):
    """The plain one-device loop: per-sample losses summed, one backward, one step."""
    opt.zero_grad(set_to_none=True)
    sum(nn.MSELoss()(model(x), y.reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    opt.step()


# ---------------------------------------------------------------------------------------------
# frozen parameters
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_a_frozen_parameter_stays_put_under_weight_decay(opt_cls):
    # Every parameter used to get a zero grad, so weight decay moved frozen ones.
    gen = torch.Generator().manual_seed(0)
    model = SeqModel(input_dim=3, hidden_dim=4)
    model.fc.bias.requires_grad_(False)
    frozen = model.fc.bias.detach().clone()
    opt = opt_cls(model.parameters(), lr=0.1, weight_decay=0.5)
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices="cpu:2", samples_per_device=2)
    for _ in range(3):
        trainer.step(*batch(4, gen))
    assert torch.equal(model.fc.bias.detach(), frozen)
    assert model.fc.bias.grad is None
    assert torch.equal(trainer.replicas.replicas[1].fc.bias.detach(), frozen)


def test_freezing_and_unfreezing_between_steps_matches_plain_pytorch():
    # A replica that stayed frozen would add nothing to an unfrozen parameter's gradient.
    gen = torch.Generator().manual_seed(1)
    model = SeqModel(input_dim=3, hidden_dim=4)
    model.lstm.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices="cpu:2", samples_per_device=2)
    for step in range(6):
        if step == 2:
            model.lstm.requires_grad_(True), ref.lstm.requires_grad_(True)
        if step == 4:
            model.fc.requires_grad_(False), ref.fc.requires_grad_(False)
        xs, ys = batch(4, gen)
        trainer.step(xs, ys)
        plain_step(ref, ref_opt, xs, ys)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
            assert (p.grad is None) == (q.grad is None), f"step {step}: {name}"


@pytest.mark.requires_cuda
def test_gpu_unfreezing_recaptures_the_graphs(no_tf32):
    gen = torch.Generator().manual_seed(2)
    model = SeqModel(input_dim=3, hidden_dim=4).cuda()
    model.lstm.requires_grad_(False)
    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    trainer = ParallelTrainer(model, opt, nn.MSELoss(), devices=["cuda:0"], samples_per_device=2)
    for step in range(4):
        if step == 2:
            model.lstm.requires_grad_(True), ref.lstm.requires_grad_(True)
        xs, ys = batch(2, gen, lo=4, hi=5)  # one length: the graphs of steps 0-1 would replay
        trainer.step(xs, ys)
        plain_step(ref, ref_opt, [x.double().cuda() for x in xs], [y.double().cuda() for y in ys])
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().double(), q.detach(), rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    assert sum(s["captures"] for s in trainer.graph_stats()) >= 1


# ---------------------------------------------------------------------------------------------
# a step that raised; a checkpoint inside an accumulation window
# ---------------------------------------------------------------------------------------------


class FailsOnLength(SeqModel):
    def __init__(self) -> None:
        super().__init__(input_dim=3, hidden_dim=4)
        self.bad_length = None

    def forward(self, x):
        if not isinstance(x, list) and x.shape[0] == self.bad_length:
            raise RuntimeError("the user's model failed")
        return super().forward(x)


def test_a_caught_error_leaks_no_gradient_into_the_next_step():
    gen = torch.Generator().manual_seed(3)
    model = FailsOnLength()
    ref = copy.deepcopy(model)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              pack=False)
    model.bad_length = 20  # the long sample goes to the master; device 1 finishes its backward first
    with pytest.raises(RuntimeError, match="the user's model failed"):
        trainer.step([torch.randn(20, 3), torch.randn(5, 3)], [torch.randn(1), torch.randn(1)])
    model.bad_length = None
    ref.bad_length = None
    xs, ys = batch(2, gen)
    trainer.compute_gradients(xs, ys)  # compute_gradients zeroes everything itself; step() must too:
    plain_grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError):
        model.bad_length = 20
        trainer.step([torch.randn(20, 3), torch.randn(5, 3)], [torch.randn(1), torch.randn(1)])
    model.bad_length = None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref.load_state_dict(model.state_dict())
    trainer.step(xs, ys)
    ref_opt.zero_grad()
    sum(nn.MSELoss()(ref(x), y.reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    for g, p in zip(plain_grads, ref.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)


def _accumulating(seed):
    torch.manual_seed(seed)
    model = SeqModel(input_dim=3, hidden_dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, opt, ParallelTrainer(model, opt, nn.MSELoss(), devices="cpu:2", samples_per_device=2,
                                       accumulation_steps=3, reduction="mean")


def test_a_resume_inside_an_accumulation_window_repeats_the_bits():
    gen = torch.Generator().manual_seed(4)
    calls = [batch(4, gen) for _ in range(7)]
    model, opt, trainer = _accumulating(5)
    for c in calls:
        trainer.step(*c)
    model2, opt2, trainer2 = _accumulating(5)
    for c in calls[:4]:  # one call into the second window
        trainer2.step(*c)
    saved = copy.deepcopy((model2.state_dict(), opt2.state_dict(), trainer2.state_dict()))
    assert saved[2]["micro_step"] == 1 and len(saved[2]["window_grads"]) == 2
    model3, opt3, trainer3 = _accumulating(99)
    model3.load_state_dict(saved[0]), opt3.load_state_dict(saved[1]), trainer3.load_state_dict(saved[2])
    for c in calls[4:]:
        trainer3.step(*c)
    for p, q in zip(model.parameters(), model3.parameters()):
        assert torch.equal(p, q)
    # A window saved mid-way needs its devices back.
    model4 = SeqModel(input_dim=3, hidden_dim=4)
    t4 = ParallelTrainer(model4, torch.optim.SGD(model4.parameters(), lr=1), nn.MSELoss(), devices="cpu",
                         accumulation_steps=3)
    with pytest.raises(ValueError, match="needs the same 1 device"):
        t4.load_state_dict(saved[2])


def test_a_failed_call_inside_a_window_restarts_it_and_says_so():
    model, _, trainer = _accumulating(6)
    gen = torch.Generator().manual_seed(6)
    trainer.step(*batch(4, gen))
    with pytest.warns(RuntimeWarning, match="1 earlier call"):
        with pytest.raises(ValueError):
            trainer.step([torch.randn(4, 3), torch.randn(4, 3)], [torch.randn(1), torch.randn(2)])
    assert trainer.state_dict()["micro_step"] == 0


# ---------------------------------------------------------------------------------------------
# randomness, dtypes, layouts
# ---------------------------------------------------------------------------------------------


class DropoutGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc(self.drop(self.gru(x.unsqueeze(0))[1][-1]))


def test_dropout_on_cpu_replicas_repeats_run_to_run():
    # The CPU replicas shared one generator from several threads: masks came in a racy order.
    gen = torch.Generator().manual_seed(7)
    data = [batch(8, gen) for _ in range(4)]
    results = []
    for _ in range(3):
        torch.manual_seed(123)
        model = DropoutGRU()
        trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                                  samples_per_device=4)
        results.append([trainer.step(*d).item() for d in data])
    assert results[0] == results[1] == results[2]


def test_a_float64_model_gets_float64_gradients():
    gen = torch.Generator().manual_seed(8)
    model = SeqModel(input_dim=3, hidden_dim=4).double()
    xs, ys = batch(4, gen)
    ref = copy.deepcopy(model)
    sum(nn.MSELoss()(ref(x.double()), y.double().reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=2)
    loss = trainer.compute_gradients(xs, ys)
    assert loss.dtype == torch.float64
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_trains(dtype):
    gen = torch.Generator().manual_seed(9)
    model = SeqModel(input_dim=3, hidden_dim=4).to(dtype)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2")
    loss = trainer.step(*batch(2, gen))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad.dtype == dtype for p in model.parameters())


def test_a_non_contiguous_parameter_trains():
    gen = torch.Generator().manual_seed(10)
    model = SeqModel(input_dim=3, hidden_dim=4, output_dim=2)
    model.fc.weight = nn.Parameter(torch.randn(4, 2).t())
    ref = copy.deepcopy(model)
    xs, ys = batch(4, gen, out=2)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=2)
    trainer.compute_gradients(xs, ys)
    sum(nn.MSELoss()(ref(x), y.reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        # the merge sums the samples in another order than one backward of the summed loss: fp32
        # rounding (1.8e-7 seen on an H200 host), never a layout error (those are O(1))
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# clear errors instead of silent broadcasting
# ---------------------------------------------------------------------------------------------


class PerStepOutput(nn.Module):
    def __init__(self, rows_of_output) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4)
        self.fc = nn.Linear(4, 1)
        self.rows = rows_of_output

    def forward(self, x):
        return self.rows(self.fc(self.gru(x)[0]))


@pytest.mark.parametrize("rows,match", [
    (lambda o: o, r"output for one sample of length 2 is \(2, 1\); it must be \(1, outputs\)"),
    (lambda o: o[-1, 0], r"output for one sample of length 2 is \(\); it must be \(1, outputs\)"),
])
def test_an_output_that_is_not_one_row_per_sample_is_refused(rows, match):
    # (L, 1) broadcast against the (1, 1) target: MSELoss trained on the wrong loss with a warning
    model = PerStepOutput(rows)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        trainer.step([torch.randn(6, 3), torch.randn(4, 3)], [torch.randn(1), torch.randn(1)])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("loss_fn", [lambda o, y: (o - y) ** 2, nn.MSELoss(reduction="none")])
def test_a_loss_that_is_not_one_number_is_named(loss_fn):
    model = SeqModel(input_dim=3, hidden_dim=4, output_dim=3)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, devices="cpu:2")
    with pytest.raises(ValueError, match=r"loss_fn returned \(1, 3\) for one sample; it must return one number"):
        trainer.step([torch.randn(6, 3), torch.randn(4, 3)], [torch.randn(3), torch.randn(3)])


@pytest.mark.parametrize("target", [torch.tensor([3]), torch.tensor([0])])
def test_integer_targets_for_a_regression_loss_are_refused(target):
    model = SeqModel(input_dim=3, hidden_dim=4)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2")
    with pytest.raises(ValueError, match=r"target 1 is an integer tensor \(torch.int64\), but the loss compares values"):
        trainer.step([torch.randn(6, 3), torch.randn(4, 3)], [torch.randn(1), target])


def test_evaluate_refuses_a_tensor_as_step_does():
    model = SeqModel(input_dim=3, hidden_dim=4)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2")
    with pytest.raises(ValueError, match="evaluate: samples must be a list"):
        trainer.evaluate(torch.randn(4, 5, 3))


# ---------------------------------------------------------------------------------------------
# weights written into the master behind the trainer's back
# ---------------------------------------------------------------------------------------------


def test_weights_loaded_into_the_master_later_reach_every_replica():
    # model.load_state_dict() after a multi-device trainer was built: the next gradient mixed the replicas'
    # old weights with the master's new ones, silently
    gen = torch.Generator().manual_seed(0)
    model, loaded = SeqModel(input_dim=3, hidden_dim=4), SeqModel(input_dim=3, hidden_dim=4)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=2)
    trainer.step(*batch(4, gen))
    model.load_state_dict(loaded.state_dict())
    xs, ys = batch(4, gen)
    trainer.compute_gradients(xs, ys)
    sum(nn.MSELoss()(loaded(x), y.reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    for p, q in zip(model.parameters(), loaded.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with torch.no_grad():  # any in-place write, not only load_state_dict
        model.fc.weight.mul_(2)
        loaded.fc.weight.mul_(2)
    loaded.zero_grad()
    trainer.compute_gradients(xs, ys)
    sum(nn.MSELoss()(loaded(x), y.reshape(1, -1)) for x, y in zip(xs, ys)).backward()
    torch.testing.assert_close(model.fc.bias.grad, loaded.fc.bias.grad)


def test_new_storage_for_a_master_weight_is_refused_in_one_line():
    gen = torch.Generator().manual_seed(0)
    model = SeqModel(input_dim=3, hidden_dim=4)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2")
    model.fc.weight.data = torch.zeros_like(model.fc.weight)  # the replicas' lanes and graphs keep the old one
    with pytest.raises(ValueError, match=r"^the model's parameter fc.weight got new storage \(p.data = ..., .to\(\)\) "
                                         r"after the ParallelTrainer was built; write into it in place") as info:
        trainer.step(*batch(2, gen))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# lanes and graph memory
# ---------------------------------------------------------------------------------------------


def test_more_lanes_do_not_let_graphs_take_more_of_the_device(monkeypatch):
    """Up to eight lanes per device now (four before): by default each lane's graph cache may hold a
    tenth of the device's memory, cut so that a device's lanes together stay within four tenths, as
    four lanes were; a graph_memory_bytes the user gives holds per cache. The trainer's own call
    site is checked with the caches recorded and an 80 GiB device pretended (CI has no GPU)."""
    from types import SimpleNamespace

    from vlseq_ext.training import execution
    total = 80 * 2**30
    assert [execution.lane_graph_bytes(None, total, n) for n in (1, 4, 8)] == [total // 10, total // 10, total // 20]
    assert execution.lane_graph_bytes(123, total, 8) == 123
    made = []
    monkeypatch.setattr(execution, "SampleGraphs", lambda *args: made.append(args[-2:]))
    monkeypatch.setattr(execution.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    model = SeqModel(input_dim=3, hidden_dim=4)
    for option, want in ((None, total // 20), (5000, 5000)):
        made.clear()
        trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu",
                                  samples_per_device=8, graph_memory_bytes=option)
        runner = trainer.runner
        runner.replicas.ensure_lanes(8)
        runner.plan, runner.cuda_graphs = "per_sample", True
        runner._make_caches()
        trainer.close()
        assert made == [(1024, want)] * 8
