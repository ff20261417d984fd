"""The estimators' network: a recurrent encoder (LSTM or GRU, optionally bidirectional and stacked)
whose per-step outputs are pooled over each series' own length, then a linear head.

It keeps ParallelTrainer's promise for `forward_padded`: each sample's output equals its own
`forward` on the unpadded series, whatever the batch's padding, so k samples per device run as one
CUDA-graph replay per padded shape (and as one padded batch on the CPU). Pooling over time ("mean",
"max") is what lets long univariate series (PickupGestureWiimoteZ, up to 361 steps) be classified
from more than the final state.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence

__all__ = ["SeqNet", "POOLINGS", "RNNS"]

POOLINGS = ("last", "mean", "max", "meanmax")
RNNS = ("lstm", "gru")


class SeqNet(nn.Module):
    """RNN encoder + pooling over time + linear head.

    forward(x): x of shape (L, D) (one series) -> (1, output_dim); x a list of (L_i, D) -> (B, output_dim).
    forward_padded(x (B, T, D), lengths (B,)) -> (B, output_dim), row i equal to forward(x[i, :lengths[i]]).

    pooling: "last" (the final state of each direction: the forward direction at the series' last
    step, the reverse one at its first), "mean" or "max" over the valid steps of the last layer's
    outputs, or "meanmax" (both, concatenated). length_feature: the series' standardised log length
    joins the pooled features (after set_length_stats(training lengths)). Each layer and direction
    is its own one-layer RNN so that the reverse direction can start at each series' own end (a
    flip within its length).
    """

    def __init__(self, input_dim: int, output_dim: int, hidden_dim: int = 64, num_layers: int = 1,
                 rnn: str = "gru", bidirectional: bool = True, dropout: float = 0.0,
                 pooling: str = "meanmax", length_feature: bool = False, conv_channels: int = 0,
                 conv_kernel: int = 5, conv_stride: int = 1) -> None:
        super().__init__()
        if rnn not in RNNS:
            raise ValueError(f"rnn must be one of {RNNS}, got {rnn!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if min(input_dim, output_dim, hidden_dim, num_layers) < 1:
            raise ValueError("input_dim, output_dim, hidden_dim and num_layers must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if conv_channels < 0 or conv_kernel < 1 or conv_kernel % 2 == 0 or conv_stride < 1:
            raise ValueError("conv_channels must be >= 0, conv_kernel odd and conv_stride >= 1")
        cls = nn.LSTM if rnn == "lstm" else nn.GRU
        self.input_dim, self.output_dim = input_dim, output_dim
        self.conv_stride = conv_stride
        self.conv = nn.Conv1d(input_dim, conv_channels, conv_kernel, stride=conv_stride,
                              padding=conv_kernel // 2) if conv_channels else None
        rnn_in = conv_channels or input_dim
        self.rnn_type, self.pooling, self.dropout = rnn, pooling, float(dropout)
        self.directions = 2 if bidirectional else 1
        width = hidden_dim * self.directions
        self.fwd = nn.ModuleList(cls(rnn_in if i == 0 else width, hidden_dim, batch_first=True)
                                 for i in range(num_layers))
        self.bwd = nn.ModuleList(cls(rnn_in if i == 0 else width, hidden_dim, batch_first=True)
                                 for i in range(num_layers)) if bidirectional else None
        self.length_feature = bool(length_feature)
        # log-length standardised with the training set's statistics (set_length_stats)
        self.register_buffer("length_stats", torch.tensor([0.0, 1.0]))
        self.head = nn.Linear(width * (2 if pooling == "meanmax" else 1) + self.length_feature, output_dim)

    def set_length_stats(self, lengths: Sequence[int]) -> None:
        """Mean and standard deviation of log(length) over the training series, for length_feature."""
        logs = torch.log(torch.as_tensor(list(lengths), dtype=torch.float64))
        std = float(logs.std(unbiased=False)) if len(logs) > 1 else 0.0
        self.length_stats.copy_(torch.tensor([float(logs.mean()), std if std > 1e-6 else 1.0]))

    def forward(self, x: Union[Tensor, Sequence[Tensor]]) -> Tensor:
        if isinstance(x, (list, tuple)):
            if len(x) == 0:
                raise ValueError("SeqNet: empty list of samples")
            lengths = torch.tensor([len(s) for s in x], dtype=torch.int64, device=x[0].device)
            return self.forward_padded(pad_sequence(list(x), batch_first=True), lengths)
        if x.dim() != 2:
            raise ValueError(f"SeqNet: expected one sample of shape (L, {self.input_dim}), got {tuple(x.shape)}")
        return self.forward_padded(x.unsqueeze(0), torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device))

    def forward_padded(self, x: Tensor, lengths: Tensor) -> Tensor:
        """Exact for every sample: a forward RNN's output at step t depends on steps <= t only, the
        reverse direction runs on each sample reversed within its own length (a gather), and the
        pooling reads valid steps only. No host sync, so the trainer can capture it in a graph."""
        z = None
        if self.length_feature:  # a series' length is information that padding or cropping would lose
            stats = self.length_stats.to(x.dtype)
            z = ((torch.log(lengths.to(x.dtype)) - stats[0]) / stats[1]).unsqueeze(-1)
        if self.conv is not None:
            # zero past each end, as a lone series' conv pads: then every output step within
            # ceil(L / stride) equals the lone series' own
            inside = torch.arange(x.shape[1], device=x.device).view(1, -1) < lengths.view(-1, 1)
            x = x * inside.unsqueeze(-1).to(x.dtype)
            x = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
            lengths = (lengths + self.conv_stride - 1) // self.conv_stride
        steps = torch.arange(x.shape[1], device=x.device)
        valid = steps.view(1, -1) < lengths.view(-1, 1)  # (B, T)
        rev = None
        if self.bwd is not None:
            rev = (lengths.view(-1, 1) - 1 - steps.view(1, -1)).clamp_(min=0).unsqueeze(-1)  # (B, T, 1)
        h = x
        for layer in range(len(self.fwd)):
            outs: List[Tensor] = [self.fwd[layer](h)[0]]
            if self.bwd is not None:
                outs.append(_flip(self.bwd[layer](_flip(h, rev))[0], rev))
            h = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            if self.dropout and layer < len(self.fwd) - 1:
                h = F.dropout(h, self.dropout, self.training)
        feat = self._pool(h, lengths, valid)
        if z is not None:
            feat = torch.cat([feat, z.to(feat.dtype)], dim=-1)
        return self.head(F.dropout(feat, self.dropout, self.training) if self.dropout else feat)

    def _pool(self, h: Tensor, lengths: Tensor, valid: Tensor) -> Tensor:
        if self.pooling == "last":
            last = (lengths - 1).view(-1, 1, 1).expand(-1, 1, h.shape[-1])
            at_end = h.gather(1, last).squeeze(1)
            if self.bwd is None:
                return at_end
            half = h.shape[-1] // 2  # the reverse direction has seen the whole series at step 0
            return torch.cat([at_end[:, :half], h[:, 0, half:]], dim=-1)
        parts = []
        if self.pooling in ("mean", "meanmax"):
            mask = valid.unsqueeze(-1).to(h.dtype)
            parts.append((h * mask).sum(1) / lengths.view(-1, 1).to(h.dtype))
        if self.pooling in ("max", "meanmax"):
            parts.append(h.masked_fill(~valid.unsqueeze(-1), float("-inf")).amax(1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _flip(z: Tensor, rev: Tensor) -> Tensor:
    """Each sample reversed within its own length (steps past it read step 0; they are never used)."""
    return z.gather(1, rev.expand(-1, -1, z.shape[-1]))
