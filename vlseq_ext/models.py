"""The seed's sequence model, generalised a little (GRU, layers, bidirectional, packed batches)."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_sequence


class SeqModel(nn.Module):
    """RNN encoder + linear head: `LSTM(36 -> 64) + Linear(64 -> 1)` by default, as in the seed.

    forward(x):
      - x of shape (L, D) (one sample, as in the seed) -> (1, output_dim);
      - x a list of B samples of shapes (L_i, D) -> (B, output_dim), run as one packed batch,
        so no sample's result depends on the others' lengths (no padding enters the RNN).

    The prediction is the head applied to the last layer's final hidden state (both directions
    concatenated when bidirectional). State-dict keys match the seed (`lstm.*`, `fc.*`).
    """

    def __init__(self, input_dim: int = 36, hidden_dim: int = 64, output_dim: int = 1, num_layers: int = 1,
                 rnn: str = "lstm", bidirectional: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        if rnn not in ("lstm", "gru"):
            raise ValueError(f"SeqModel: rnn must be 'lstm' or 'gru', got {rnn!r}")
        if min(input_dim, hidden_dim, output_dim, num_layers) < 1:
            raise ValueError("SeqModel: input_dim, hidden_dim, output_dim and num_layers must be >= 1")
        cls = nn.LSTM if rnn == "lstm" else nn.GRU
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.rnn_type = rnn
        self.directions = 2 if bidirectional else 1
        self.add_module(rnn, cls(input_dim, hidden_dim, num_layers=num_layers, batch_first=True,
                                 bidirectional=bidirectional, dropout=dropout if num_layers > 1 else 0.0))
        self.fc = nn.Linear(hidden_dim * self.directions, output_dim)

    @property
    def recurrent(self) -> nn.RNNBase:
        return getattr(self, self.rnn_type)

    def forward(self, x: Union[Tensor, Sequence[Tensor]]) -> Tensor:
        if isinstance(x, (list, tuple)):
            if len(x) == 0:
                raise ValueError("SeqModel: empty list of samples")
            inp = pack_sequence(list(x), enforce_sorted=False)
        else:
            if x.dim() != 2:
                raise ValueError(f"SeqModel: expected one sample of shape (L, {self.input_dim}), got {tuple(x.shape)}")
            inp = x.unsqueeze(0)
        out = self.recurrent(inp)[1]
        h_n = out[0] if isinstance(out, tuple) else out  # LSTM returns (h_n, c_n)
        # h_n: (num_layers * directions, B, H); the last layer's directions are the last rows.
        last = h_n[-self.directions:]
        feat = last[0] if self.directions == 1 else torch.cat([last[0], last[1]], dim=-1)
        return self.fc(feat)
