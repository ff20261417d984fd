"""The trainer's execution paths against the float64 per-sample reference: packed, padded graphs,
per-sample graphs on several lanes (streams) per device, one issuing thread per device; races
(repeat the same step many times: the bits must not move); capture failures and the RNG.

CPU tests run everywhere (the threads, lanes and folding run on CPU replicas too); GPU tests run on
every visible GPU (the threaded multi-GPU path where there are two), with TF32 off.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

from vlseq_ext import ParallelTrainer, SeqModel

from helpers import float64_reference_grads

requires_cuda = pytest.mark.requires_cuda  # every visible GPU: two where there are two


class OneSampleLSTM(nn.Module):
    """The seed's style: forward takes one (L, D) sample only and cannot be packed."""

    def __init__(self, dim: int = 6, hidden: int = 8, layers: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, hidden, num_layers=layers, batch_first=True, dropout=dropout)
        self.fc = nn.Linear(hidden, 1)

    def forward(self, x):
        out, _ = self.lstm(x.unsqueeze(0))
        return self.fc(out[:, -1])


class HostReadModel(OneSampleLSTM):
    """Reads a value on the host to pick a branch: cannot be captured as a CUDA graph."""

    def forward(self, x):
        out = super().forward(x)
        return out * 2 if float(x[0, 0]) > 0 else out


class DropoutHostReadModel(HostReadModel):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return super().forward(self.drop(x))


class DropoutModel(OneSampleLSTM):
    def __init__(self) -> None:
        super().__init__(layers=2, dropout=0.3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return super().forward(self.drop(x))


MODELS = {
    "list_lstm2": lambda: SeqModel(input_dim=6, hidden_dim=8, num_layers=2),
    "list_bigru2": lambda: SeqModel(input_dim=6, hidden_dim=8, num_layers=2, rnn="gru", bidirectional=True),
    "one_lstm": OneSampleLSTM,
}


def batch(n: int, gen: torch.Generator, dim: int = 6, max_len: int = 40):
    lengths = torch.randint(1, max_len, (n,), generator=gen).tolist()
    return [torch.randn(L, dim, generator=gen) for L in lengths], [torch.randn(1, generator=gen) for _ in lengths]


def assert_close_to(model: nn.Module, ref, rtol: float) -> None:
    for name, p in model.named_parameters():
        err = (p.grad.double().cpu() - ref[name]).norm().item()
        assert err <= rtol * ref[name].norm().item() + 1e-9, f"{name}: relative error {err / ref[name].norm().item():.2e}"


def grads_of(model: nn.Module):
    return [p.grad.detach().cpu().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("k,n", [(1, 2), (3, 6), (3, 5), (8, 16), (8, 11)])
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_cpu_lanes_and_threads_match_float64(model_name, lanes, k, n, reduction):
    """Two CPU replicas (one thread each), k samples each on `lanes` gradient sets, short tails."""
    gen = torch.Generator().manual_seed(k * 100 + n + lanes)
    torch.manual_seed(gen.initial_seed())
    model = MODELS[model_name]()
    xs, ys = batch(n, gen)
    ref = float64_reference_grads(model, xs, ys, reduction)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=k, reduction=reduction, pack=False, lanes=lanes)
    trainer.compute_gradients(xs, ys)
    assert_close_to(model, ref, 1e-5)
    assert len(trainer.replicas.lanes[0]) == lanes


def test_cpu_lanes_share_weights_after_steps():
    """Extra lanes alias their replica's weights: after optimizer steps and the broadcast they
    still compute with the master's weights (checked through the gradient)."""
    gen = torch.Generator().manual_seed(5)
    model = OneSampleLSTM()
    trainer = ParallelTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=3, pack=False, lanes=3)
    for _ in range(4):
        trainer.step(*batch(6, gen))
    for lanes in trainer.replicas.lanes:
        for lane in lanes:
            for p, q in zip(lane.params, model.parameters()):
                assert torch.equal(p.detach(), q.detach())
    xs, ys = batch(6, gen)
    ref = float64_reference_grads(model, xs, ys, "sum")
    trainer.compute_gradients(xs, ys)
    assert_close_to(model, ref, 1e-5)


def test_cpu_steps_repeat_bit_for_bit():
    """The same step merged again gives the same bits (and the float64 reference): lanes fold and
    devices merge in a fixed order. CPU replicas run one after the other on the caller's thread
    (workers.py), so there is no race to provoke here: 20 repeats show the order is fixed, and the
    GPU stress test below repeats 1,000 threaded steps."""
    gen = torch.Generator().manual_seed(9)
    model = SeqModel(input_dim=6, hidden_dim=8)
    xs, ys = batch(6, gen, max_len=12)
    ref = float64_reference_grads(model, xs, ys, "mean")
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:3",
                              samples_per_device=2, reduction="mean", pack=False, lanes=2)
    trainer.compute_gradients(xs, ys)
    first = grads_of(model)
    assert_close_to(model, ref, 1e-5)
    for i in range(20):
        trainer.compute_gradients(xs, ys)
        for a, b in zip(first, model.parameters()):
            assert torch.equal(a, b.grad), f"merge {i} differs"


def test_cpu_deterministic_runs_are_identical():
    def run():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        model = OneSampleLSTM()
        trainer = ParallelTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss(),
                                  devices="cpu:2", samples_per_device=3, pack=False, lanes=2)
        losses = [trainer.step(*batch(6, gen)).item() for _ in range(5)]
        return losses, [p.detach().clone() for p in model.parameters()]

    (la, pa), (lb, pb) = run(), run()
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def test_target_that_does_not_fit_the_output_is_named():
    model = SeqModel(input_dim=6, hidden_dim=8)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu")
    with pytest.raises(ValueError, match=r"target 0 has shape \(3,\) but the model's output for one sample has "
                                         r"shape \(1, 1\)"):
        trainer.step([torch.randn(5, 6)], [torch.randn(3)])
    classifier = SeqModel(input_dim=6, hidden_dim=8, output_dim=3)
    trainer = ParallelTrainer(classifier, torch.optim.SGD(classifier.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                              devices="cpu")
    with pytest.raises(ValueError, match=r"target 0 is class 7 but the model outputs 3 classes"):
        trainer.step([torch.randn(5, 6)], [torch.tensor(7)])


def test_evaluate_and_load_state_dict_reject_bad_input():
    model = SeqModel(input_dim=6, hidden_dim=8)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu")
    with pytest.raises(ValueError, match="evaluate: no samples"):
        trainer.evaluate([])
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['foo'\]"):
        trainer.load_state_dict({"foo": 1})


# ---------------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------------


def gpus() -> int:
    return min(torch.cuda.device_count(), 2)


@requires_cuda
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("k,short", [(1, 0), (3, 0), (3, 1), (8, 0), (8, 3)])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_gpu_paths_match_float64(model_name, k, short, reduction, no_tf32):
    """List models run as padded graphs, the one-sample model as per-sample graphs on min(k, 8)
    lanes; both threaded over two GPUs (where there are two), full steps and steps `short` samples
    short. Twice: the second pass replays."""
    n = k * gpus() - short
    gen = torch.Generator().manual_seed(k * 1000 + n)
    torch.manual_seed(gen.initial_seed())
    model = MODELS[model_name]()
    xs, ys = batch(n, gen)
    ref = float64_reference_grads(model, xs, ys, reduction)
    model.cuda(0)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                              samples_per_device=k, reduction=reduction)
    for _ in range(2):
        trainer.compute_gradients(xs, ys)
    assert_close_to(model, ref, 3e-5)
    assert trainer.runner.plan == ("per_sample" if model_name.startswith("one") else "padded")
    assert sum(s["replays"] for s in trainer.graph_stats()) > 0


@requires_cuda
@pytest.mark.parametrize("model_name", ["list_lstm2", "one_lstm"])
def test_gpu_stress_1000_steps_same_bits(model_name, no_tf32):
    gen = torch.Generator().manual_seed(3)
    model = MODELS[model_name]().cuda(0)
    xs, ys = batch(8 * gpus(), gen)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                              samples_per_device=8, reduction="mean")
    ref = float64_reference_grads(model, xs, ys, "mean")
    trainer.compute_gradients(xs, ys)
    first = grads_of(model)
    assert_close_to(model, ref, 3e-5)
    for i in range(1000):
        trainer.compute_gradients(xs, ys)
        if i % 100 == 99 or i < 3:
            for a, b in zip(first, model.parameters()):
                assert torch.equal(a, b.grad.cpu()), f"step {i} differs"


@requires_cuda
@pytest.mark.parametrize("where", ["pageable", "pinned", "cuda"])
def test_gpu_padded_steps_back_to_back_each_train_on_their_own_samples(where, no_tf32):
    """Every step refills the same padded graph's input buffers while the last replay may still run:
    ten SGD steps queued with no host sync in between, every batch in the same padded shape, from
    pageable, pinned and GPU memory, must equal ten float64 steps taken one by one."""
    gen = torch.Generator().manual_seed(21)
    model = MODELS["list_lstm2"]()
    ref = copy.deepcopy(model).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model.cuda(0)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                              samples_per_device=4, reduction="mean")
    for _ in range(10):
        n = 4 * gpus()
        lengths = [33] + torch.randint(10, 34, (n - 1,), generator=gen).tolist()  # one padded length: 64
        xs = [torch.randn(L, 6, generator=gen) for L in lengths]
        ys = [torch.randn(1, generator=gen) for _ in lengths]
        ref_opt.zero_grad()
        for x, y in zip(xs, ys):
            (nn.MSELoss()(ref(x.double()), y.double().reshape(1, 1)) / n).backward()
        ref_opt.step()
        if where == "pinned":
            xs = [x.pin_memory() for x in xs]
        elif where == "cuda":
            xs = [x.cuda(0) for x in xs]
        trainer.step(xs, ys)
    assert [s["graphs"] for s in trainer.graph_stats()][:1] == [1]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p.detach().double().cpu() - q.detach()).norm().item()
        # (plus an absolute floor: fc.bias can end near 0; a step on the wrong samples moves it by ~1e-2)
        assert err <= 1e-5 * q.norm().item() + 1e-6, f"{name}: error {err:.2e}, norm {q.norm().item():.2e}"


@requires_cuda
@pytest.mark.parametrize("model_name", ["list_bigru2", "one_lstm"])
def test_gpu_deterministic_runs_identical_bits(model_name):
    def run():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(4)
        model = MODELS[model_name]().cuda(0)
        trainer = ParallelTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), nn.MSELoss(),
                                  devices=gpus(), samples_per_device=3)
        losses = [trainer.step(*batch(3 * gpus(), gen)) for _ in range(6)]
        return [float(v) for v in losses], [p.detach().cpu().clone() for p in model.parameters()]

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it
    torch.use_deterministic_algorithms(True)
    try:
        (la, pa), (lb, pb) = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert la == lb
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


@requires_cuda
def test_gpu_failed_capture_leaves_the_process_usable(no_tf32):
    """One process, in order: a model that cannot be captured (warns, trains eagerly, right
    gradients); then dropout models with graphs on and off at k = 1 and 2 on both GPUs, plain
    dropout ops, a fresh dropout mask at every replay, and a model that mixes dropout with a host
    read."""
    gen = torch.Generator().manual_seed(11)
    model = HostReadModel().cuda(0)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                              samples_per_device=2)
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        for _ in range(3):  # a cache gives up after its second failed capture
            xs, ys = batch(2 * gpus(), gen)
            trainer.compute_gradients(xs, ys)
    assert_close_to(model, float64_reference_grads(model, xs, ys, "sum"), 3e-5)
    assert all(s["graphs"] == 0 for s in trainer.graph_stats())

    for dev in range(torch.cuda.device_count()):  # every device's generator still works
        torch.nn.functional.dropout(torch.ones(100, device=f"cuda:{dev}"), 0.5)
        torch.rand(3, device=f"cuda:{dev}")
    for graphs in (True, False):
        for k in (1, 2):
            m = DropoutModel().cuda(0)
            t = ParallelTrainer(m, torch.optim.Adam(m.parameters(), lr=1e-3), nn.MSELoss(), devices=gpus(),
                                samples_per_device=k, cuda_graphs=graphs)
            for _ in range(3):
                loss = t.step(*batch(gpus() * k, gen))
            assert torch.isfinite(loss)

    # fresh masks per replay: the same sample, replayed, gives different losses
    m = DropoutModel().cuda(0)
    t = ParallelTrainer(m, torch.optim.SGD(m.parameters(), lr=0.0), nn.MSELoss(), devices=gpus())
    x, y = torch.randn(20, 6, generator=gen), torch.randn(1, generator=gen)
    losses = {float(t.compute_gradients([x] * gpus(), [y] * gpus())) for _ in range(6)}
    assert sum(s["replays"] for s in t.graph_stats()) > 0
    assert len(losses) > 3, f"dropout masks repeat across replays: {losses}"

    m = DropoutHostReadModel().cuda(0)
    t = ParallelTrainer(m, torch.optim.SGD(m.parameters(), lr=0.1), nn.MSELoss(), devices=gpus())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            assert torch.isfinite(t.step(*batch(gpus(), gen)))
    torch.nn.functional.dropout(torch.ones(10, device="cuda:0"), 0.5)


def test_slow_plan_note_names_wide_one_sample_models_only():
    from vlseq_ext.training.execution import slow_plan_note
    wide, narrow = OneSampleLSTM(hidden=256), OneSampleLSTM(hidden=64)
    note = slow_plan_note("per_sample", wide, 32, "auto", True)
    assert "recurrent width is 256" in note and "forward_padded" in note and "32 samples per GPU" in note
    assert slow_plan_note("per_sample", OneSampleLSTM(hidden=128, layers=2), 8, "auto", True) is not None
    for args in (("per_sample", narrow, 32, "auto", True),   # narrow: per-sample graphs are the fast plan
                 ("per_sample", wide, 1, "auto", True),      # one sample per GPU: nothing to batch
                 ("per_sample", wide, 32, False, True),      # asked for
                 ("per_sample", wide, 32, "auto", False),    # no graphs (CPU): eager either way
                 ("padded", wide, 32, "auto", True), ("packed", wide, 32, "auto", True)):
        assert slow_plan_note(*args) is None, args


def test_first_step_probes_draw_no_random_numbers():
    """The first step probes the model (output shape, list support) in eval mode: a dropout model
    draws no random numbers there, so a resumed run repeats the uninterrupted one's masks."""
    model = DropoutModel()
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices="cpu:2",
                              samples_per_device=2)
    xs, _ = batch(4, torch.Generator().manual_seed(0))
    before = torch.get_rng_state()
    trainer.runner.prepare(xs)
    trainer.runner.accepts_list(xs)
    assert torch.equal(before, torch.get_rng_state())
    assert model.training


@requires_cuda
def test_gpu_wide_one_sample_model_warns_once_and_trains(no_tf32):
    """On torch's RNN (rnn_kernels="cudnn": the module is not swapped, so its calls cannot be gathered)
    a wide one-sample model can only run per-sample graphs, and says so once."""
    from vlseq_ext import SlowPlanWarning
    gen = torch.Generator().manual_seed(5)
    model = OneSampleLSTM(hidden=256).cuda(0)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                              samples_per_device=2, rnn_kernels="cudnn")
    xs, ys = batch(2 * gpus(), gen, max_len=12)
    with pytest.warns(SlowPlanWarning, match="recurrent width is 256"):
        trainer.compute_gradients(xs, ys)
    assert trainer.runner.plan == "per_sample"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPlanWarning)
        trainer.compute_gradients(xs, ys)  # the plan is chosen once
        quiet = SeqModel(input_dim=6, hidden_dim=256).cuda(0)  # has forward_padded: no warning
        ParallelTrainer(quiet, torch.optim.SGD(quiet.parameters(), lr=0.1), nn.MSELoss(), devices=gpus(),
                        samples_per_device=2).compute_gradients(xs, ys)
    assert_close_to(model, float64_reference_grads(model, xs, ys, "sum"), 3e-5)


@requires_cuda
@pytest.mark.parametrize("task", ["regression2", "classification"])
def test_gpu_warmup_graphs_are_the_ones_training_replays(task, no_tf32):
    """warmup() captures with targets shaped like the real ones: training then only replays."""
    gen = torch.Generator().manual_seed(2)
    out, loss_fn = (2, nn.MSELoss()) if task == "regression2" else (3, nn.CrossEntropyLoss())
    model = SeqModel(input_dim=6, hidden_dim=8, output_dim=out).cuda(0)
    trainer = ParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, devices=gpus(),
                              samples_per_device=2)
    trainer.warmup([10, 20, 30])
    before = sum(s["eager_runs"] for s in trainer.graph_stats())
    xs = [torch.randn(L, 6, generator=gen) for L in [10, 20, 30, 10][:2 * gpus()]]
    ys = [torch.randn(out, generator=gen) if task == "regression2" else torch.tensor(i % out) for i in range(len(xs))]
    trainer.step(xs, ys)
    assert sum(s["eager_runs"] for s in trainer.graph_stats()) == before, "training ran eagerly after warmup"
