"""The seed's sequence model, generalised a little (GRU, layers, bidirectional, packed batches)."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_sequence

from . import nn as vnn


class SeqModel(nn.Module):
    """RNN encoder + linear head: `LSTM(36 -> 64) + Linear(64 -> 1)` by default, as in the seed.

    forward(x):
      - x of shape (L, D) (one sample, as in the seed) -> (1, output_dim);
      - x a list of B samples of shapes (L_i, D) -> (B, output_dim), run as one packed batch,
        so no sample's result depends on the others' lengths (no padding enters the RNN).

    The prediction is the head applied to the last layer's final hidden state (both directions
    concatenated when bidirectional). State-dict keys match the seed (`lstm.*`, `fc.*`).

    forward_padded(x (B, T, D), lengths (B,)) gives the same result as forward on the list of
    x[i, :lengths[i]], with fixed shapes, so the trainer can replay it as one CUDA graph per
    (B, bucketed T) (vlseq_ext.training.graphs.PaddedGraphs).

    The recurrent module is vlseq_ext.nn's LSTM/GRU (torch's, plus the persistent kernels):
    `rnn_kernels` "auto" (default) runs the kernels on CUDA where they beat cuDNN, "vlseq" wherever
    they can run, "cudnn" never.
    """

    def __init__(self, input_dim: int = 36, hidden_dim: int = 64, output_dim: int = 1, num_layers: int = 1,
                 rnn: str = "lstm", bidirectional: bool = False, dropout: float = 0.0,
                 rnn_kernels: str = "auto") -> None:
        super().__init__()
        if rnn not in ("lstm", "gru"):
            raise ValueError(f"SeqModel: rnn must be 'lstm' or 'gru', got {rnn!r}")
        if min(input_dim, hidden_dim, output_dim, num_layers) < 1:
            raise ValueError("SeqModel: input_dim, hidden_dim, output_dim and num_layers must be >= 1")
        cls = vnn.LSTM if rnn == "lstm" else vnn.GRU
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.rnn_type = rnn
        self.directions = 2 if bidirectional else 1
        self.add_module(rnn, cls(input_dim, hidden_dim, num_layers=num_layers, batch_first=True,
                                 bidirectional=bidirectional, dropout=dropout if num_layers > 1 else 0.0,
                                 kernels=rnn_kernels))
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

    def forward_padded(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x: (B, T, D), each sample zero-padded after its end; lengths: (B,) int64 on x's device, each
        in 1..T. Returns (B, output_dim), sample i equal to forward(x[i, :lengths[i]]).

        Exact because an RNN's output at step t depends on steps <= t only: the forward direction
        runs over the padding too, and each sample's state is read at its own last step. The
        reverse direction cannot start in the padding, so for bidirectional models each sample's
        steps are reversed within its own length first (a gather), run forward, and put back.
        On the persistent kernels each sample simply stops at its length (no padded step runs)."""
        rnn = self.recurrent
        if isinstance(rnn, (vnn.LSTM, vnn.GRU)) and rnn.uses_kernels(x, x.shape[0], padded=False):
            state = rnn(x, lengths=lengths)[1]
            h_n = state[0] if isinstance(state, tuple) else state
            last_layer = h_n[-self.directions:]
            return self.fc(last_layer[0] if self.directions == 1 else torch.cat([last_layer[0], last_layer[1]], -1))
        last = (lengths - 1).view(-1, 1, 1)
        if self.directions == 1:
            out = self.recurrent(x)[0]  # (B, T, H): the last layer's state at every step
            return self.fc(out.gather(1, last.expand(-1, 1, out.shape[-1])).squeeze(1))
        steps = torch.arange(x.shape[1], device=x.device)
        rev = (lengths.view(-1, 1) - 1 - steps.view(1, -1)).clamp_(min=0).unsqueeze(-1)  # (B, T, 1)

        def flip(z: Tensor) -> Tensor:  # reverse each sample within its own length
            return z.gather(1, rev.expand(-1, -1, z.shape[-1]))

        inp = x
        for layer in range(rnn.num_layers):
            fwd = self._one_direction(inp, layer, "")
            bwd_reversed = self._one_direction(flip(inp), layer, "_reverse")
            if layer == rnn.num_layers - 1:
                pick = last.expand(-1, 1, fwd.shape[-1])
                feat = torch.cat([fwd.gather(1, pick), bwd_reversed.gather(1, pick)], dim=-1).squeeze(1)
                return self.fc(feat)
            inp = torch.cat([fwd, flip(bwd_reversed)], dim=-1)
            if rnn.dropout and self.training:
                inp = F.dropout(inp, rnn.dropout, training=True)
        raise AssertionError("unreachable")

    def _one_direction(self, x: Tensor, layer: int, suffix: str) -> Tensor:
        """One layer, one direction of the recurrent module, with its own weights: (B, T, H)."""
        rnn = self.recurrent
        w = [getattr(rnn, f"{name}_l{layer}{suffix}") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
             if hasattr(rnn, f"{name}_l{layer}{suffix}")]
        h0 = x.new_zeros(1, x.shape[0], rnn.hidden_size)
        if isinstance(rnn, nn.LSTM):
            return torch._VF.lstm(x, (h0, h0), w, rnn.bias, 1, 0.0, self.training, False, True)[0]
        return torch._VF.gru(x, h0, w, rnn.bias, 1, 0.0, self.training, False, True)[0]
