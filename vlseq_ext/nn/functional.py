"""Recurrent layers on the persistent kernels (ops.rnn_forward / ops.rnn_backward): the input
projection of all steps is one GEMM before the recurrence, the weight gradients are GEMMs after it.

`rnn(module, x, lengths, hx)` runs any `nn.LSTM` / `nn.GRU` (multi-layer, bidirectional,
inter-layer dropout, bias or not) with the module's own parameters over a zero-padded, batch-first
batch with per-sample lengths. Each sample's result is that of the sample alone: its steps past its
length never run, its outputs there are zero and its gradients there are zero.

Precision: "fp32" keeps everything in float32 (the GEMMs follow torch.backends.cuda.matmul.allow_tf32,
off by default); "bf16" (chosen under bf16 autocast) runs the GEMMs in bfloat16 and holds W_hh in
bfloat16 on chip, with float32 state and accumulation.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .. import ops

__all__ = ["rnn", "precision_for", "weights_of"]


def precision_for(x: Tensor) -> str:
    """"bf16" under CUDA bf16 autocast, else "fp32"."""
    if x.is_cuda and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
        return "bf16"
    return "fp32"


def _gemm(a: Tensor, b: Tensor, precision: str) -> Tensor:
    """a @ b in float32, or in bfloat16 (then widened) for the bf16 mode."""
    if precision == "bf16":
        return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).float()
    return a @ b


def _previous_states(y: Tensor, h0: Tensor, lengths: Tensor, reverse: bool) -> Tensor:
    """h_{t-1} at every step (B, T, H): the state each step's W_hh products read. Forward: y shifted
    one step later, h0 first. Reverse: y shifted one step earlier, h0 at each sample's last step.
    Padded steps get finite values; their gate gradients are zero."""
    B, T, H = y.shape
    if not reverse:
        return torch.cat([h0.unsqueeze(1), y[:, :-1]], dim=1)
    prev = torch.cat([y[:, 1:], y.new_zeros(B, 1, H)], dim=1)
    last = (torch.arange(T, device=y.device).unsqueeze(0) == (lengths - 1).unsqueeze(1)).unsqueeze(-1)
    return torch.where(last, h0.unsqueeze(1), prev)


class _Layer(torch.autograd.Function):
    """One layer, one direction: y (B, T, H), h_n, c_n from x (B, T, D)."""

    @staticmethod
    def forward(ctx, cell: str, precision: str, reverse: bool, x: Tensor, lengths: Tensor, h0: Tensor,
                c0: Optional[Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor], b_hh: Optional[Tensor]):
        B, T, D = x.shape
        with torch.autocast(device_type=x.device.type, enabled=False):
            xproj = _gemm(x.reshape(B * T, D), w_ih.t(), precision)
            if b_ih is not None:
                xproj = xproj + b_ih
            y, h_n, c_n, saved, cs = ops.rnn_forward(
                cell, xproj.view(B, T, -1).contiguous(), w_hh.contiguous(),
                None if b_hh is None else b_hh.contiguous(), h0.contiguous(),
                None if c0 is None else c0.contiguous(), lengths, reverse, precision)
        ctx.meta = (cell, precision, reverse, b_ih is not None, b_hh is not None)
        ctx.set_materialize_grads(False)  # unused outputs cost no zero tensors (the ops take None)
        if cell == "gru":
            ctx.mark_non_differentiable(c_n)  # an empty placeholder
        ctx.save_for_backward(x, lengths, h0, c0, w_ih, w_hh, y, saved, cs)
        return y, h_n, c_n

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor]):
        cell, precision, reverse, has_b_ih, has_b_hh = ctx.meta
        x, lengths, h0, c0, w_ih, w_hh, y, saved, cs = ctx.saved_tensors
        B, T, D = x.shape
        H = w_hh.shape[1]
        with torch.autocast(device_type=x.device.type, enabled=False):
            dgates, dgates_hn, dh0, dc0 = ops.rnn_backward(
                cell, w_hh.contiguous(), y, saved, cs, h0.contiguous(), None if c0 is None else c0.contiguous(),
                lengths, None if dy is None else dy.contiguous(), None if dh_n is None else dh_n.contiguous(),
                None if dc_n is None or cell == "gru" else dc_n.contiguous(), reverse, precision)
            dgx = dgates.view(B * T, -1)
            need = ctx.needs_input_grad
            dx = _gemm(dgx, w_ih, precision).view(B, T, D) if need[3] else None
            dw_ih = _gemm(dgx.t(), x.reshape(B * T, D), precision) if need[7] else None
            db_ih = dgx.sum(0) if has_b_ih and need[9] else None
            dw_hh = db_hh = None
            if need[8] or (has_b_hh and need[10]):
                dgh = dgx if cell == "lstm" else torch.cat([dgates[..., :2 * H], dgates_hn], dim=-1).view(B * T, -1)
                if need[8]:
                    prev = _previous_states(y, h0, lengths, reverse).view(B * T, H)
                    dw_hh = _gemm(dgh.t(), prev, precision)
                if has_b_hh and need[10]:
                    db_hh = dgh.sum(0)
        return (None, None, None, dx, None, dh0 if need[5] else None, dc0 if cell == "lstm" and need[6] else None,
                dw_ih, dw_hh, db_ih, db_hh)


def weights_of(module: nn.RNNBase, layer: int, reverse: bool) -> List[Optional[Tensor]]:
    """[w_ih, w_hh, b_ih, b_hh] of one layer and direction (biases None when bias=False)."""
    suffix = "_reverse" if reverse else ""
    return [getattr(module, f"{name}_l{layer}{suffix}", None) for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


def rnn(module: nn.RNNBase, x: Tensor, lengths: Tensor, hx=None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Runs `module` (an nn.LSTM or nn.GRU, float32, on CUDA or CPU) on the kernels.

    x: (B, T, input_size), zero-padded after each sample's end; lengths: (B,) int64 on x's device;
    hx: None, h0, or (h0, c0) for an LSTM, each (num_layers * directions, B, hidden_size).
    Returns (output (B, T, directions * hidden_size), h_n, c_n (None for a GRU)), output zero at
    padded steps and h_n/c_n the states after each sample's own last step (step 0 for the reverse
    direction). Training mode applies the module's inter-layer dropout."""
    lstm = isinstance(module, nn.LSTM)
    cell = "lstm" if lstm else "gru"
    dirs = 2 if module.bidirectional else 1
    B = x.shape[0]
    H = module.hidden_size
    if hx is None:
        h0 = x.new_zeros(module.num_layers * dirs, B, H)
        c0 = h0 if lstm else None
    elif lstm:
        h0, c0 = hx
    else:
        h0, c0 = hx, None
    precision = precision_for(x)
    layer_in = x.float() if precision == "bf16" else x
    h_out, c_out = [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w_ih, w_hh, b_ih, b_hh = weights_of(module, layer, bool(d))
            y, h_n, c_n = _Layer.apply(cell, precision, bool(d), layer_in, lengths, h0[k],
                                       c0[k] if lstm else None, w_ih, w_hh, b_ih, b_hh)
            outs.append(y)
            h_out.append(h_n)
            c_out.append(c_n)
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
        if module.dropout and module.training and layer < module.num_layers - 1:
            layer_in = F.dropout(layer_in, module.dropout, training=True)
    return layer_in, torch.stack(h_out), (torch.stack(c_out) if lstm else None)
