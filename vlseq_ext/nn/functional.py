"""Recurrent layers on the persistent kernels (ops.rnn_forward / ops.rnn_backward): the input
projection of all steps is one GEMM before the recurrence, the weight gradients are GEMMs after it.

`rnn(module, x, lengths, hx)` runs any `nn.LSTM` / `nn.GRU` (multi-layer, bidirectional,
inter-layer dropout, bias or not) with the module's own parameters over a zero-padded, batch-first
batch with per-sample lengths. Each sample's result is that of the sample alone: its steps past its
length never run, its outputs there are zero and its gradients there are zero.

Precision: "fp32" keeps everything in float32 (the GEMMs follow torch.backends.cuda.matmul.allow_tf32,
off by default); "tf32" (chosen where cuDNN would run TF32: torch.backends.cudnn.allow_tf32, on by
default) runs the GEMMs (input projections, input and weight gradients) in TF32 on the tensor cores
(ops.mm_tf32) and the recurrent products of the grid layout (hidden ~440 and up) there too, as cuDNN's
RNNs run both under that flag; "bf16" (chosen under bf16 autocast) runs the GEMMs in bfloat16 and the
recurrence with W_hh rounded to bfloat16 (on the tf32 kernels where they hold the layer). State and
accumulation are float32 in every mode.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

from .. import ops
from . import concurrency

__all__ = ["rnn", "precision_for", "weights_of"]


def precision_for(x: Tensor) -> str:
    """"bf16" under CUDA bf16 autocast, "tf32" on CUDA where torch.backends.cudnn.allow_tf32 is on (cuDNN's
    RNNs would then run TF32), else "fp32"."""
    if x.is_cuda and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
        return "bf16"
    if x.is_cuda and torch.backends.cudnn.allow_tf32:
        return "tf32"
    return "fp32"


def _gemm(a: Tensor, b: Tensor, precision: str, bias: Optional[Tensor] = None) -> Tensor:
    """a @ b (+ bias): in TF32 for the tf32 mode, in bfloat16 (then widened) for bf16, else in float32
    (TF32 as torch.backends.cuda.matmul.allow_tf32 says)."""
    if precision == "tf32" and a.is_cuda:
        return ops.mm_tf32(a, b, bias)
    if precision == "bf16":
        out = (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).float()
        return out if bias is None else out + bias
    return a @ b if bias is None else torch.addmm(bias, a, b)  # the bias in the GEMM's epilogue


def _recurrent_weight_grad(dgh: Tensor, y: Tensor, h0: Tensor, lengths: Optional[Tensor], reverse: bool,
                           precision: str) -> Tensor:
    """dW_hh = sum over every sample and step of dgh_t^T h_{t-1}: dgh (B * T, G) the gradients of the
    gates that W_hh multiplies, y (B, T, H) the layer's outputs (zero at padded steps), h0 (B, H).

    h_{t-1} is the output one row before (forward; reverse: one row after), so one GEMM of dgh against
    the flat outputs shifted by one row, with no copy, covers every step but each sample's first (in
    its direction). There the shifted row is the neighbouring sample's output (or a padded zero), not
    h0: a GEMM over those B rows puts h0 in its place. Padded rows carry zero gate gradients."""
    B, T, H = y.shape
    flat = y.reshape(B * T, H)
    first = torch.arange(B, device=y.device) * T
    if not reverse:
        dw = _gemm(dgh[1:].t(), flat[:-1], precision)
        # step 0 (row `first`) read flat[first - 1], the sample before's last row; it wants h0
        wrong = torch.cat([flat.new_zeros(1, H), flat[first[1:] - 1]])
        dg_edge = dgh[first]
    else:
        dw = _gemm(dgh[:-1].t(), flat[1:], precision)
        lens = lengths.clamp(0, T)  # the last step, len - 1, read flat[first + len], wants h0
        edge = first + lens - 1
        after = first + lens
        wrong = torch.where((after < B * T).unsqueeze(1), flat[after.clamp(max=B * T - 1)], 0.0)
        dg_edge = torch.where((lens > 0).unsqueeze(1), dgh[edge.clamp(min=0)], 0.0)
    return dw.addmm_(dg_edge.t(), h0 - wrong)


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _recurrence(cell: str, precision: str, reverse: bool, max_blocks: int, x: Tensor, lengths: Tensor, h0: Tensor,
                c0: Optional[Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor], b_hh: Optional[Tensor]):
    """One layer and direction over x (B, T, D): the input projection of every step (one GEMM), then
    the recurrence (ops.rnn_forward): (y, h_n, c_n, saved, cs)."""
    B, T, D = x.shape
    xproj = _gemm(x.reshape(B * T, D), w_ih.t(), precision, b_ih)
    return ops.rnn_forward(cell, xproj.view(B, T, -1).contiguous(), w_hh.contiguous(), _contiguous(b_hh),
                           h0.contiguous(), _contiguous(c0), lengths, reverse, precision, max_blocks)


def _recurrence_backward(cell: str, precision: str, reverse: bool, max_blocks: int, w_hh: Tensor, y: Tensor,
                         saved: Tensor, cs: Tensor, h0: Tensor, c0: Optional[Tensor], lengths: Tensor,
                         dy: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor]):
    """ops.rnn_backward of _recurrence's recurrence: (dgates, dgates_hn, dh0, dc0); a GRU's dc_n is
    ignored (its c_n is an empty placeholder)."""
    return ops.rnn_backward(cell, w_hh.contiguous(), y, saved, cs, h0.contiguous(), _contiguous(c0), lengths,
                            _contiguous(dy), _contiguous(dh_n), None if cell == "gru" else _contiguous(dc_n), reverse,
                            precision, max_blocks)


def _column_sums(m: Tensor) -> Tensor:
    """m.sum(0) of a (rows, columns) matrix as a GEMV: on an H200 ~20 us for 16,000 x 1,024 where
    torch's column reduction took ~38 us (benchmarks/probe/layer_ops.py)."""
    return torch.mv(m.t(), m.new_ones(m.shape[0]))


def _weight_grads(cell: str, precision: str, dgates: Tensor, dgates_hn: Optional[Tensor], x: Tensor, y: Tensor,
                  h0: Tensor, lengths: Optional[Tensor], reverse: bool, need) -> List[Optional[Tensor]]:
    """[dw_ih, dw_hh, db_ih, db_hh] of one layer and direction from its gate gradients over the whole
    sequence (x its input, y its output); None where `need` (four flags, as needs_input_grad gives
    them: False for an absent bias) says nobody wants it. lengths: only for the reverse direction."""
    B, T, D = x.shape
    H = y.shape[-1]
    dgx = dgates.view(B * T, -1)
    dw_ih = _gemm(dgx.t(), x.reshape(B * T, D), precision) if need[0] else None
    db_ih = _column_sums(dgx) if need[2] else None
    dw_hh = db_hh = None
    if need[1] or need[3]:
        dgh = dgx if cell == "lstm" else torch.cat([dgates[..., :2 * H], dgates_hn], dim=-1).view(B * T, -1)
        if need[1]:
            dw_hh = _recurrent_weight_grad(dgh, y, h0, lengths, reverse, precision)
        if need[3]:  # an LSTM's two biases add to the same gates: one sum (a pass over B * T rows)
            db_hh = db_ih.clone() if cell == "lstm" and db_ih is not None else _column_sums(dgh)
    return [dw_ih, dw_hh, db_ih, db_hh]


class _Layer(torch.autograd.Function):
    """One layer, one direction: y (B, T, H), h_n, c_n from x (B, T, D); the launches planned for at
    most max_blocks SMs (0: the whole GPU)."""

    @staticmethod
    def forward(ctx, cell: str, precision: str, reverse: bool, max_blocks: int, x: Tensor, lengths: Tensor, h0: Tensor,
                c0: Optional[Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor], b_hh: Optional[Tensor]):
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, h_n, c_n, saved, cs = _recurrence(cell, precision, reverse, max_blocks, x, lengths, h0, c0, w_ih, w_hh,
                                                 b_ih, b_hh)
        ctx.meta = (cell, precision, reverse, max_blocks)
        ctx.set_materialize_grads(False)  # unused outputs cost no zero tensors (the ops take None)
        if cell == "gru":
            ctx.mark_non_differentiable(c_n)  # an empty placeholder
        ctx.save_for_backward(x, lengths, h0, c0, w_ih, w_hh, y, saved, cs)
        return y, h_n, c_n

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor]):
        cell, precision, reverse, max_blocks = ctx.meta
        x, lengths, h0, c0, w_ih, w_hh, y, saved, cs = ctx.saved_tensors
        B, T, D = x.shape
        with torch.autocast(device_type=x.device.type, enabled=False):
            dgates, dgates_hn, dh0, dc0 = _recurrence_backward(cell, precision, reverse, max_blocks, w_hh, y, saved, cs,
                                                               h0, c0, lengths, dy, dh_n, dc_n)
            need = ctx.needs_input_grad
            dx = _gemm(dgates.view(B * T, -1), w_ih, precision).view(B, T, D) if need[4] else None
            grads = _weight_grads(cell, precision, dgates, dgates_hn, x, y, h0, lengths, reverse, need[8:12])
        return (None, None, None, None, dx, None, dh0 if need[6] else None,
                dc0 if cell == "lstm" and need[7] else None, *grads)


class _Pipelined(torch.autograd.Function):
    """A unidirectional stack of layers over time windows ("chunks"), layer l + 1 running window k
    while layer l runs window k + 1 (each layer on its own stream, an event per window between
    them); backward runs the windows in reverse, the top layer ahead. A window is a batch with the
    sample lengths cut to it and the state carried in from the window before (forward: h and c;
    backward: dh and dc), so every result equals the layer-by-layer one. Each launch is planned for at
    most max_blocks SMs (0: the whole GPU)."""

    @staticmethod
    def forward(ctx, cell: str, precision: str, chunks: int, max_blocks: int, dropout: float, x: Tensor,
                lengths: Tensor, h0: Tensor, c0: Optional[Tensor], *weights: Optional[Tensor]):
        L = len(weights) // 4
        B, T, _ = x.shape
        lstm = cell == "lstm"
        bounds = _windows(T, chunks)
        main, streams = concurrency.streams_for(x, L)
        masks = [None] * L  # masks[l]: dropout on layer l's input (l >= 1)
        if dropout:
            H = weights[1].shape[1]
            masks = [None] + [x.new_empty(B, T, H, dtype=torch.float32).bernoulli_(1 - dropout).div_(1 - dropout)
                              for _ in range(L - 1)]
        lens = [(lengths - t0).clamp(0, t1 - t0) for t0, t1 in bounds]
        ys = [[None] * len(bounds) for _ in range(L)]
        saved = [[None] * len(bounds) for _ in range(L)]  # per layer and window: (h0, c0, saved, cs)
        done = [[None] * len(bounds) for _ in range(L)]
        h_n, c_n = [None] * L, [None] * L
        concurrency.fork(main, streams)
        with torch.autocast(device_type=x.device.type, enabled=False):
            for k, (t0, t1) in enumerate(bounds):
                for l in range(L):
                    w_ih, w_hh, b_ih, b_hh = weights[4 * l:4 * l + 4]
                    with concurrency.on(streams[l]):
                        if l and done[l - 1][k] is not None:
                            streams[l].wait_event(done[l - 1][k])
                        inp = x[:, t0:t1] if l == 0 else ys[l - 1][k]
                        if masks[l] is not None:
                            inp = inp * masks[l][:, t0:t1]
                        hk = h0[l] if k == 0 else h_n[l]
                        ck = (c0[l] if k == 0 else c_n[l]) if lstm else None
                        y, h_n[l], cn, sv, cs = _recurrence(cell, precision, False, max_blocks, inp, lens[k], hk, ck,
                                                            w_ih, w_hh, b_ih, b_hh)
                        c_n[l] = cn if lstm else None
                        ys[l][k], saved[l][k] = y, (hk, ck, sv, cs)
                        done[l][k] = concurrency.record(streams[l])
        concurrency.join(main, streams)
        out = torch.cat(ys[-1], dim=1)
        h_stack = torch.stack(h_n)
        c_stack = torch.stack(c_n) if lstm else h_stack.new_empty(0)
        concurrency.settle(main, streams)
        ctx.meta = (cell, precision, bounds, L, max_blocks)
        ctx.set_materialize_grads(False)
        if not lstm:
            ctx.mark_non_differentiable(c_stack)
        ctx.save_for_backward(x, *weights[0::4], *weights[1::4])
        ctx.chunks = (lens, ys, saved, masks)
        return out, h_stack, c_stack

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor]):
        cell, precision, bounds, L, max_blocks = ctx.meta
        x, *ws = ctx.saved_tensors
        w_ihs, w_hhs = ws[:L], ws[L:]
        lens, ys, saved, masks = ctx.chunks
        lstm = cell == "lstm"
        B, T, D = x.shape
        last = len(bounds) - 1
        main, streams = concurrency.streams_for(x, L)
        dgates = [[None] * len(bounds) for _ in range(L)]
        dgates_hn = [[None] * len(bounds) for _ in range(L)]
        dins = [[None] * len(bounds) for _ in range(L)]  # d (layer l's input) per window
        done = [[None] * len(bounds) for _ in range(L)]
        dh0, dc0 = [None] * L, [None] * L
        grads = [None] * (4 * L)
        concurrency.fork(main, streams)
        with torch.autocast(device_type=x.device.type, enabled=False):
            for k in reversed(range(len(bounds))):
                t0, t1 = bounds[k]
                for l in reversed(range(L)):
                    with concurrency.on(streams[l]):
                        if l < L - 1 and done[l + 1][k] is not None:
                            streams[l].wait_event(done[l + 1][k])
                        dy = (None if dout is None else dout[:, t0:t1]) if l == L - 1 else dins[l + 1][k]
                        if k == last:
                            dh = None if dh_n is None else dh_n[l]
                            dc = None if dc_n is None or not lstm else dc_n[l]
                        else:
                            dh, dc = dh0[l], dc0[l]
                        hk, ck, sv, cs = saved[l][k]
                        dg, dg_hn, dh0[l], dcl = _recurrence_backward(cell, precision, False, max_blocks, w_hhs[l],
                                                                      ys[l][k], sv, cs, hk, ck, lens[k], dy, dh, dc)
                        dc0[l] = dcl if lstm else None
                        dgates[l][k], dgates_hn[l][k] = dg, dg_hn
                        if l > 0 or ctx.needs_input_grad[5]:
                            din = _gemm(dg.view(B * (t1 - t0), -1), w_ihs[l], precision).view(B, t1 - t0, -1)
                            dins[l][k] = din * masks[l][:, t0:t1] if masks[l] is not None else din
                        done[l][k] = concurrency.record(streams[l])
                        if k == 0:  # the layer's weight gradients, beside the lower layers' last windows
                            grads[4 * l:4 * l + 4] = _weight_grads(
                                cell, precision, torch.cat(dgates[l], 1), None if lstm else torch.cat(dgates_hn[l], 1),
                                _layer_input(x, ys, masks, l), torch.cat(ys[l], 1), saved[l][0][0], None, False,
                                ctx.needs_input_grad[9 + 4 * l:13 + 4 * l])
        concurrency.join(main, streams)
        dx = torch.cat(dins[0], 1) if ctx.needs_input_grad[5] else None
        dh0_all = torch.stack(dh0) if ctx.needs_input_grad[7] else None
        dc0_all = torch.stack(dc0) if lstm and ctx.needs_input_grad[8] else None
        concurrency.settle(main, streams)
        return (None, None, None, None, None, dx, None, dh0_all, dc0_all, *grads)


def _windows(T: int, chunks: int) -> List[Tuple[int, int]]:
    step = -(-T // chunks)
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]


def _layer_input(x: Tensor, ys, masks, l: int) -> Tensor:
    if l == 0:
        return x
    inp = torch.cat(ys[l - 1], 1)
    return inp * masks[l] if masks[l] is not None else inp


def weights_of(module: nn.RNNBase, layer: int, reverse: bool) -> List[Optional[Tensor]]:
    """[w_ih, w_hh, b_ih, b_hh] of one layer and direction (biases None when bias=False)."""
    suffix = "_reverse" if reverse else ""
    return [getattr(module, f"{name}_l{layer}{suffix}", None) for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


def rnn(module: nn.RNNBase, x: Tensor, lengths: Tensor, hx=None, chunks: int = 1,
        side_by_side_blocks: int = 0, max_blocks: int = 0) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Runs `module` (an nn.LSTM or nn.GRU, float32, on CUDA or CPU) on the kernels.

    x: (B, T, input_size), zero-padded after each sample's end; lengths: (B,) int64 on x's device;
    hx: None, h0, or (h0, c0) for an LSTM, each (num_layers * directions, B, hidden_size).
    Returns (output (B, T, directions * hidden_size), h_n, c_n (None for a GRU)), output zero at
    padded steps and h_n/c_n the states after each sample's own last step (step 0 for the reverse
    direction). Training mode applies the module's inter-layer dropout. chunks > 1 pipelines a
    unidirectional stack over that many time windows (see _Pipelined; concurrency.pipeline_chunks chooses it);
    side_by_side_blocks > 0 runs a bidirectional layer's two directions at once on two streams, each
    launch planned for at most that many SMs (the modules give half the GPU when
    concurrency.side_by_side allows it); otherwise every launch, a pipelined stack's windows included, is
    planned for at most max_blocks SMs (0: the whole GPU; the modules' concurrency.sm_budget)."""
    if max_blocks and side_by_side_blocks:
        raise ValueError("max_blocks and side_by_side_blocks both set the SMs a launch may take: give one")
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
    if chunks > 1 and dirs == 1 and module.num_layers > 1:
        weights = [w for layer in range(module.num_layers) for w in weights_of(module, layer, False)]
        dropout = module.dropout if module.training else 0.0
        out, h_n, c_n = _Pipelined.apply(cell, precision, chunks, max_blocks, dropout, layer_in, lengths, h0,
                                         c0 if lstm else None, *weights)
        return out, h_n, (c_n if lstm else None)
    # The reverse direction on a side stream, beside the forward one (its backward follows it there:
    # autograd runs a node's backward on its forward's stream).
    side_by_side = dirs == 2 and side_by_side_blocks > 0
    main, streams = concurrency.streams_for(x, 2) if side_by_side else (None, [None, None])
    if side_by_side:
        max_blocks = side_by_side_blocks
    h_out, c_out = [], []
    for layer in range(module.num_layers):
        outs = []
        concurrency.fork(main, streams)
        for d in range(dirs):
            k = layer * dirs + d
            w_ih, w_hh, b_ih, b_hh = weights_of(module, layer, bool(d))
            with concurrency.on(streams[d]):
                y, h_n, c_n = _Layer.apply(cell, precision, bool(d), max_blocks, layer_in, lengths, h0[k],
                                           c0[k] if lstm else None, w_ih, w_hh, b_ih, b_hh)
            outs.append(y)
            h_out.append(h_n)
            c_out.append(c_n)
        concurrency.join(main, streams)
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
        if module.dropout and module.training and layer < module.num_layers - 1:
            layer_in = F.dropout(layer_in, module.dropout, training=True)
    result = layer_in, torch.stack(h_out), (torch.stack(c_out) if lstm else None)
    concurrency.settle(main, streams)
    return result
