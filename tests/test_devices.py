"""vlseq_ext.devices.parse_devices: the one device syntax of the trainer, vlseq-train, vlseq-predict
and vlseq-bench."""
from __future__ import annotations

import pytest
import torch

from vlseq_ext.devices import parse_devices

CPU = torch.device("cpu")


@pytest.fixture
def two_gpus(monkeypatch):
    """Pretend two GPUs are visible (parsing only: nothing touches them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_all_means_every_gpu_or_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parse_devices("all") == parse_devices(None) == [CPU]


def test_specs_on_two_gpus(two_gpus):
    g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert parse_devices("all") == parse_devices(None) == parse_devices("cuda") == [g0, g1]
    assert parse_devices("2") == parse_devices(2) == [g0, g1]  # N: the first N devices
    assert parse_devices("1") == parse_devices(1) == [g0]
    assert parse_devices("cuda:1,cuda:0") == parse_devices("1,0") == parse_devices([1, "cuda:0"]) == [g1, g0]
    assert parse_devices(torch.device("cuda", 1)) == [g1]
    assert parse_devices("cpu") == [CPU]
    assert parse_devices("cpu:3") == parse_devices(["cpu"] * 3) == [CPU] * 3


def test_torchrun_share(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert parse_devices("all") == [torch.device("cuda", 1)]
    assert parse_devices("2") == [torch.device("cuda", 0), torch.device("cuda", 1)]  # explicit specs stay


@pytest.mark.parametrize("spec, message", [
    ("3", r"first 3 GPUs but 2 are visible"),
    ("0", r"at least one device"),
    ("cuda:2", r"cuda:2 does not exist \(visible GPUs: cuda:0, cuda:1\)"),
    ("cuda:0,cuda:0", r"cuda:0 is listed twice"),
    ("cpu,cuda:0", r"mixes CPU and CUDA"),
    ("cpu:0", r"0 CPU replicas; give 1 to 1024"),
    # cpu:<huge> copied the model for minutes, eating memory, without a word
    ("cpu:1000000", r"^devices 'cpu:1000000': 1000000 CPU replicas; give 1 to 1024 \(they run one after another"),
    ("cpu:2,cpu:3", r"cpu:2 in a list; cpu:N alone gives N CPU replicas, a list takes cpu \(cpu,cpu\)"),
    ("tpu", r"cannot parse 'tpu'"),
    ("mps", r"only CUDA and CPU devices"),
    (True, r"expected all, N"),
    ([], r"empty"),
])
def test_bad_specs_name_the_problem(two_gpus, spec, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec)


def test_no_gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"first 2 GPUs but 0 are visible; use cpu or cpu:N"):
        parse_devices("2")
    with pytest.raises(ValueError, match=r"no CUDA GPU is visible"):
        parse_devices("cuda")
