"""vlseq_ext.training.loop.TrainingLoop, the one training loop of ParallelTrainer.fit and vlseq-train: limits,
stop requests, exact resume mid-epoch, sharding of global steps, callbacks, empty data."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

from vlseq_ext import ParallelTrainer, SeqModel
from vlseq_ext.data.samplers import DistributedLengthSampler, IterableBatches, LengthBucketSampler, OrderedBatches
from vlseq_ext.training.loop import Callback, TrainingLoop, fit
from vlseq_ext.training.scheduling import lpt_shard


class FakeGroup:
    """The process group of one rank of `world_size`. The ranks of these tests agree by construction;
    with several, a stop is agreed once `trainer` has taken `stop_after` steps (as if another rank asked)."""

    def __init__(self, trainer, rank, world_size, stop_after):
        self.trainer, self.rank, self.world_size, self.stop_after = trainer, rank, world_size, stop_after
        self.stop_requests = 0

    def request_stop(self):
        self.stop_requests += 1

    def stop_agreed(self, requested):
        if self.world_size == 1:
            return requested
        return self.stop_after is not None and len(self.trainer.steps) >= self.stop_after

    def check_same(self, what, value, show=True):
        pass


class FakeTrainer:
    """Records what it trains: the keys (sample ids) of every step, for one rank of `world_size`."""

    reduction = "mean"
    samples_per_device = 2
    devices = [torch.device("cpu")]

    def __init__(self, rank=0, world_size=1, stop_after=None):
        self.group = FakeGroup(self, rank, world_size, stop_after)
        self.steps = []

    @property
    def samples_per_step(self):
        return self.samples_per_device * len(self.devices)

    def step(self, xs, ys):
        self.steps.append([int(y) for y in ys])
        return torch.tensor(1.0)  # the mean loss

    def shard(self, lengths):  # as ParallelTrainer.shard
        if self.group.world_size == 1:
            return list(range(len(lengths)))
        return lpt_shard(lengths, self.group.rank, self.group.world_size, len(self.devices), self.samples_per_device)

    @property
    def skipped_steps(self):
        return 0


def items(n=23, seed=0):
    """Sample i: a (L_i, 2) tensor and its id i as the target."""
    lengths = np.random.default_rng(seed).integers(1, 30, n)
    return [(torch.zeros(int(L), 2), torch.tensor(i)) for i, L in enumerate(lengths)], lengths


class Recorder(Callback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_step(self, loop, batch, loss):
        self.events.append(("step", loop.step, loop.epoch))
        if self.stop_at is not None and loop.step == self.stop_at:
            loop.request_stop("test")

    def on_epoch_end(self, loop):
        self.events.append(("epoch_end", loop.step, loop.epoch))

    def on_step_end(self, loop, epoch_end, stopping):
        self.events.append(("step_end", loop.step, loop.epoch, epoch_end, stopping))


def make_loop(data, lengths, trainer, **kw):
    sampler = LengthBucketSampler(lengths, 4, seed=3, bucket_batches=2)
    return TrainingLoop(trainer, sampler, data.__getitem__, **kw)


def test_epochs_and_max_steps_limits():
    data, lengths = items()  # 23 samples in steps of 4: 6 steps per epoch
    tr = FakeTrainer()
    loop = make_loop(data, lengths, tr, epochs=2)
    assert loop.total_steps() == 12
    assert loop.run() == "epochs" and loop.step == 12 and loop.epoch == 2 and loop.position == 0
    for epoch in range(2):  # every sample once per epoch
        assert sorted(i for s in tr.steps[6 * epoch:6 * epoch + 6] for i in s) == list(range(23))
    tr = FakeTrainer()
    loop = make_loop(data, lengths, tr, max_steps=8, epochs=5)
    assert loop.run() == "max_steps" and loop.step == 8 and (loop.epoch, loop.position) == (1, 2)
    assert loop.done() and loop.run() == "max_steps" and len(tr.steps) == 8  # nothing more to do
    with pytest.raises(ValueError, match="give max_steps or epochs"):
        make_loop(data, lengths, tr)
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        make_loop(data, lengths, tr, max_steps=0)


@pytest.mark.parametrize("stop_at", [1, 5, 6, 7, 13])
def test_stop_and_resume_mid_epoch_repeats_the_uninterrupted_steps(stop_at):
    data, lengths = items()
    straight = FakeTrainer()
    make_loop(data, lengths, straight, epochs=3).run()
    first = FakeTrainer()
    rec = Recorder(stop_at=stop_at)
    loop = make_loop(data, lengths, first, epochs=3, callbacks=[rec])
    assert loop.run() == "test" and loop.step == stop_at
    assert rec.events[-1] == ("step_end", stop_at, loop.epoch, stop_at % 6 == 0, True)
    state = copy.deepcopy(loop.state_dict())
    assert (state["step"], state["epoch"], state["position"]) == (stop_at, stop_at // 6, stop_at % 6)
    second = FakeTrainer()
    resumed = make_loop(data, lengths, second, epochs=3)  # a new process: fresh sampler and trainer
    resumed.load_state_dict(state)
    assert resumed.run() == "epochs" and resumed.step == 18
    assert first.steps + second.steps == straight.steps


def test_callbacks_see_epoch_end_before_the_sampler_moves_on():
    data, lengths = items(8)  # 2 steps per epoch
    rec = Recorder()
    make_loop(data, lengths, FakeTrainer(), epochs=2, callbacks=[rec]).run()
    assert rec.events == [
        ("step", 1, 0), ("step_end", 1, 0, False, False),
        ("step", 2, 0), ("epoch_end", 2, 0), ("step_end", 2, 1, True, False),
        ("step", 3, 1), ("step_end", 3, 1, False, False),
        ("step", 4, 1), ("epoch_end", 4, 1), ("step_end", 4, 2, True, True)]


def test_empty_data_is_an_error():
    tr = FakeTrainer()
    with pytest.raises(ValueError, match="empty dataset"):
        TrainingLoop(tr, OrderedBatches(0, 2), lambda i: None, epochs=1)
    with pytest.raises(ValueError, match="empty dataset"):
        TrainingLoop(tr, IterableBatches([], 2), lambda item: item, epochs=1).run()
    with pytest.raises(ValueError, match="empty dataset"):
        fit(tr, [])
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        fit(tr, [(torch.zeros(2, 2), torch.tensor(0))], epochs=0)


def test_every_rank_trains_its_share_of_the_same_global_steps():
    data, lengths = items(21)
    ranks = [FakeTrainer(rank=r, world_size=3) for r in range(3)]
    for r, tr in enumerate(ranks):
        sampler = DistributedLengthSampler(lengths, 2, 1, 3, seed=5)  # global steps of 6
        TrainingLoop(tr, sampler, data.__getitem__, epochs=1).run()
    assert len({len(tr.steps) for tr in ranks}) == 1 == len(ranks[0].steps) // 4  # 4 steps on every rank
    for s in range(4):
        shares = [set(tr.steps[s]) for tr in ranks]
        assert all(len(sh) <= 2 for sh in shares) and not (shares[0] & shares[1] or shares[1] & shares[2])
    assert sorted(i for tr in ranks for st in tr.steps for i in st) == list(range(21))


def test_a_stop_requested_anywhere_stops_every_rank_after_the_same_step():
    data, lengths = items(40)
    tr = FakeTrainer(rank=0, world_size=2, stop_after=3)  # another rank asked: the all-reduce says so
    loop = TrainingLoop(tr, DistributedLengthSampler(lengths, 2, 1, 2), data.__getitem__, epochs=1)
    assert loop.run() == "peer" and loop.step == 3
    tr = FakeTrainer(rank=1, world_size=2, stop_after=4)
    loop = TrainingLoop(tr, DistributedLengthSampler(lengths, 2, 1, 2), data.__getitem__, epochs=1,
                        callbacks=[Recorder(stop_at=2)])
    assert loop.run() == "test" and loop.step == 4  # this rank asked at step 2; all agree after step 4
    assert tr.group.stop_requests == 1  # (the group carries it in every later step's all-reduce)


def test_iterable_batches_resume_by_skipping():
    data = [(torch.zeros(3, 2), torch.tensor(i)) for i in range(7)]
    straight = FakeTrainer()
    TrainingLoop(straight, IterableBatches(data, 2), lambda item: item, epochs=2).run()
    assert [len(s) for s in straight.steps] == [2, 2, 2, 1] * 2
    first, second = FakeTrainer(), FakeTrainer()
    loop = TrainingLoop(first, IterableBatches(data, 2), lambda item: item, epochs=2, max_steps=5)
    loop.run()
    resumed = TrainingLoop(second, IterableBatches(data, 2), lambda item: item, epochs=2)
    resumed.load_state_dict(loop.state_dict())
    resumed.run()
    assert first.steps + second.steps == straight.steps


def test_resumed_training_matches_uninterrupted_training_exactly():
    """A real ParallelTrainer (2 CPU replicas): model, optimizer and loop state saved at step 5 and
    restored into new objects give the losses of the uninterrupted run, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(int(torch.randint(2, 9, (1,), generator=gen)), 3, generator=gen),
             torch.randn(1, generator=gen)) for _ in range(13)]

    def build(state=None):
        torch.manual_seed(1)
        model = SeqModel(3, 5, 1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if state:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        tr = ParallelTrainer(model, opt, nn.MSELoss(), devices="cpu:2", reduction="mean")
        losses = []

        class Losses(Callback):
            def on_step(self, loop, batch, loss):
                losses.append(loss.item())

        loop = TrainingLoop(tr, OrderedBatches(len(data), 2, shuffle=True, seed=4), data.__getitem__,
                            epochs=2, callbacks=[Losses()])
        return model, opt, loop, losses

    _, _, loop, straight = build()
    loop.run()
    model, opt, loop, head = build()
    loop.max_steps = 5
    loop.run()
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "loop": loop.state_dict()})
    _, _, loop, tail = build(state)
    loop.load_state_dict(state["loop"])
    loop.run()
    assert len(straight) == 14 and head + tail == straight


def test_fit_records_an_epoch_cut_short_by_max_steps():
    data, _ = items(10)
    hist = fit(FakeTrainer(), data, epochs=3, max_steps=7)  # steps of 2: 5 per epoch
    assert [(h["epoch"], h["steps"], h["samples"]) for h in hist] == [(0, 5, 10), (1, 2, 4)]
    assert all(h["loss"] == 1.0 for h in hist)  # FakeTrainer's mean loss is 1 per sample


def test_fit_says_when_an_iterator_cannot_give_a_second_epoch():
    # fit(generator, epochs=2) trained one epoch and said nothing
    data, _ = items(6)
    with pytest.raises(ValueError, match=r"fit: data is an iterator \(generator\), which gives its samples once, "
                                         r"so it cannot give epoch 2 of 2"):
        fit(FakeTrainer(), (d for d in data), epochs=2)
    assert len(fit(FakeTrainer(), (d for d in data), epochs=1)) == 1

    class Once:  # an iterator of its own
        def __init__(self):
            self.it = iter(data)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.it)

    class ReadOnce:  # iterable, but empty once read
        def __init__(self):
            self.left = list(data)

        def __iter__(self):
            left, self.left = self.left, []
            return iter(left)

    with pytest.raises(ValueError, match="fit: data is an iterator"):
        fit(FakeTrainer(), Once(), epochs=3)
    with pytest.raises(ValueError, match=r"epoch 2: the data gave no samples, after 3 steps of earlier epochs"):
        fit(FakeTrainer(), ReadOnce(), epochs=2)
    assert [h["steps"] for h in fit(FakeTrainer(), data, epochs=2)] == [3, 3]  # a list gives every epoch
    with pytest.raises(ValueError, match=r"fit: val_data is an iterator \(generator\)"):
        fit(FakeTrainer(), data, epochs=2, val_data=(d for d in data))
    tr = FakeTrainer()
    with pytest.raises(ValueError, match=r"fit: val_data is empty"):  # (was: "not enough values to unpack")
        fit(tr, data, val_data=[])
    assert tr.steps == []  # before any training
    with pytest.raises(ValueError, match=r"fit: val_data gave no samples for epoch 1"):
        fit(FakeTrainer(), data, val_data=(d for d in []))
