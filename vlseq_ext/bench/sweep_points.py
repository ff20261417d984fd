"""What the sweep (target W3) measures: the models, their two forms, the points and the targets.

Points. Every model x k x form:
  - models: LSTM of hidden 64, 256 and 1024 with 1 and 2 layers, and a 2-layer bidirectional GRU of
    width 256 (36 input features, 1 output, MSE loss); on CPU the same shapes, tiny (hidden 8/16);
  - k, samples per device per step: 1, 8, 32 (CPU: 1, 4);
  - form: "list", SeqModel, which also takes a list of samples (so the trainer and the one-GPU
    loop may pack them); "one", `OneSampleModel`, the seed's style: forward(x) takes ONE sample
    (L, D), unsqueezes it and cannot take a list. Same weights layout as SeqModel.
  `--quick`: h64 l1, h256 l2 and h1024 l1, k 1 and 32, both forms.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import torch
from torch import nn

from ..models import SeqModel
from .baselines import MAX_LEN, MIN_LEN

FORMS = ("list", "one")
POOL = 12        # samples per point on GPUs (distinct lengths ~ graph captures per device and lane; see above)
CPU_POOL = 8
CPU_LENGTHS = (10, 40)
TARGETS = {"vs_ddp": 1.3, "vs_1gpu": 1.8, "vs_one_gpu_best": 1.0}  # vlseq / method >= threshold


@dataclass(frozen=True)
class ModelSpec:
    rnn: str  # "lstm" or "bigru" (a bidirectional GRU)
    hidden: int
    layers: int

    @property
    def name(self) -> str:
        return f"{self.rnn}_h{self.hidden}_l{self.layers}"

    @property
    def label(self) -> str:
        return f"{'biGRU' if self.rnn == 'bigru' else 'LSTM'} h{self.hidden} l{self.layers}"

    def kwargs(self) -> Dict[str, Any]:
        return {"hidden_dim": self.hidden, "num_layers": self.layers, "rnn": "gru" if self.rnn == "bigru" else "lstm",
                "bidirectional": self.rnn == "bigru"}


FULL_MODELS = tuple(ModelSpec("lstm", h, n) for h in (64, 256, 1024) for n in (1, 2)) + (ModelSpec("bigru", 256, 2),)
QUICK_MODELS = (ModelSpec("lstm", 64, 1), ModelSpec("lstm", 256, 2), ModelSpec("lstm", 1024, 1))
CPU_MODELS = (ModelSpec("lstm", 8, 1), ModelSpec("lstm", 16, 2), ModelSpec("bigru", 8, 2))


@dataclass(frozen=True)
class Plan:
    models: Tuple[ModelSpec, ...]
    ks: Tuple[int, ...]
    pool: int
    min_len: int
    max_len: int


def plan_for(cuda: bool, quick: bool) -> Plan:
    if not cuda:
        return Plan(CPU_MODELS, (1, 4), CPU_POOL, *CPU_LENGTHS)
    if quick:
        return Plan(QUICK_MODELS, (1, 32), POOL, MIN_LEN, MAX_LEN)
    return Plan(FULL_MODELS, (1, 8, 32), POOL, MIN_LEN, MAX_LEN)


def point_name(form: str, spec: ModelSpec, k: int) -> str:
    return f"{form}_{spec.name}_k{k}"


class OneSampleModel(nn.Module):
    """A model written in the seed's style: forward(x) takes ONE sample x of shape (L, D),
    makes it a batch of one (x.unsqueeze(0)), runs its batch_first RNN and a Linear on the last
    layer's final hidden state (both directions' for a bidirectional RNN). A list of samples fails
    (a list has no unsqueeze), so nothing can pack its samples. Submodules, parameter order and
    initialisation are SeqModel's (`lstm`/`gru`, then `fc`): the same seed builds the same weights,
    and state dicts load either way."""

    def __init__(self, input_dim: int = 36, hidden_dim: int = 64, output_dim: int = 1, num_layers: int = 1,
                 rnn: str = "lstm", bidirectional: bool = False) -> None:
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[rnn]
        self.rnn_type = rnn
        self.directions = 2 if bidirectional else 1
        self.add_module(rnn, cls(input_dim, hidden_dim, num_layers=num_layers, batch_first=True,
                                 bidirectional=bidirectional))
        self.fc = nn.Linear(hidden_dim * self.directions, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(0)  # (L, D) -> (1, L, D)
        _, h = getattr(self, self.rnn_type)(x)
        h_n = h[0] if isinstance(h, tuple) else h  # LSTM: (h_n, c_n)
        feat = h_n[-1] if self.directions == 1 else torch.cat([h_n[-2], h_n[-1]], dim=-1)
        return self.fc(feat)


def make_model(spec: ModelSpec, form: str, rnn_kernels: str = "auto") -> nn.Module:
    """The point's model, seeded. The list model (SeqModel) runs its RNN on vlseq_ext.nn's kernels
    where `rnn_kernels` ("auto": SeqModel's default) picks them; OneSampleModel holds torch's own
    modules (cuDNN) until a trainer swaps them."""
    torch.manual_seed(0)
    if form == "list":
        return SeqModel(**spec.kwargs(), rnn_kernels=rnn_kernels)
    return OneSampleModel(**spec.kwargs())


@functools.lru_cache(maxsize=None)
def param_count(spec: ModelSpec) -> int:
    with torch.device("meta"):  # no memory, no init cost
        return sum(p.numel() for p in SeqModel(**spec.kwargs()).parameters())
