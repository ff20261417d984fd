"""Registrations on the torch.ops.vlseq_ext ops that live in Python: fake (meta) kernels for
torch.compile and mm_tf32's autograd formula. vlseq_ext.ops imports this once."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _ext


def _same_device(op: str, tensors: Sequence[Optional[Tensor]], ref: str, device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if t is not None and t.device != device:
            raise RuntimeError(f"{op}: tensors[{i}] is on {t.device} but {ref} is on {device}")


def _register_fakes() -> None:
    """Fake (meta) implementations so torch.compile can trace graphs that call the ops. The ops
    mutate their inputs in place and return nothing; the fakes check devices, because a call
    that mixes meta tensors with real ones dispatches here instead of to the real kernels."""
    if not _ext.LOADED:
        return
    fake = torch.library.register_fake

    fake("vlseq_ext::flatten_")(lambda tensors, numels, out, scale: _same_device("flatten_", tensors, "out", out.device))
    fake("vlseq_ext::unflatten_")(lambda flat, tensors, scale: _same_device("unflatten_", tensors, "flat", flat.device))

    def _kinds(op: str, arg: str, tensors: Sequence[Tensor]) -> None:
        # All meta (tracing) is fine; meta mixed with real tensors is a caller's mistake.
        if any(t.device.type != "meta" for t in tensors):
            for i, t in enumerate(tensors):
                if t.device.type == "meta":
                    raise RuntimeError(f"{op}: {arg}[{i}] must be a CPU or CUDA tensor, got meta")

    fake("vlseq_ext::all_reduce_")(lambda buffers, op, algo="auto": _kinds("all_reduce_", "buffers", buffers))
    fake("vlseq_ext::broadcast_")(lambda src, dsts: _kinds("broadcast_", "src+dsts", [src, *dsts]))
    fake("vlseq_ext::all_reduce_tensors_")(
        lambda tensors, num_devices, scale, algo="auto": _kinds("all_reduce_tensors_", "tensors", tensors))
    fake("vlseq_ext::reduce_tensors_")(
        lambda tensors, num_devices, scale, zero_others: _kinds("reduce_tensors_", "tensors", tensors))
    fake("vlseq_ext::broadcast_tensors_")(lambda srcs, dsts: _kinds("broadcast_tensors_", "srcs+dsts", [*srcs, *dsts]))
    fake("vlseq_ext::p2p_status")(lambda buffers: "fake")

    def rnn_forward_fake(cell, xproj, w_hh, b_hh, h0, c0, lengths, reverse, weights, max_blocks=0):
        B, T, H = xproj.shape[0], xproj.shape[1], w_hh.shape[-1]
        lstm = cell == "lstm"
        return (xproj.new_empty(B, T, H), xproj.new_empty(B, H), xproj.new_empty(B, H) if lstm else xproj.new_empty(0),
                xproj.new_empty(B, T, 4 * H), xproj.new_empty(B, T, H) if lstm else xproj.new_empty(0))

    def rnn_backward_fake(cell, w_hh, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n, reverse, weights, max_blocks=0):
        B, T, H = y.shape
        lstm = cell == "lstm"
        return (y.new_empty(B, T, w_hh.shape[0]), y.new_empty(0) if lstm else y.new_empty(B, T, H), y.new_empty(B, H),
                y.new_empty(B, H) if lstm else y.new_empty(0))

    fake("vlseq_ext::rnn_forward")(rnn_forward_fake)
    fake("vlseq_ext::rnn_backward")(rnn_backward_fake)
    fake("vlseq_ext::mm_tf32")(lambda a, b, bias=None: a.new_empty(a.shape[0], b.shape[1]))


def _mm_tf32_setup(ctx, inputs, output) -> None:
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _mm_tf32_backward(ctx, grad: Tensor):
    """The gradients of a @ b + bias, their products on mm_tf32 too (TF32 on CUDA, as torch's matmul
    under its TF32 flag computes its own backward)."""
    a, b = ctx.saved_tensors
    need = ctx.needs_input_grad
    da = torch.ops.vlseq_ext.mm_tf32(grad, b.t()) if need[0] else None
    db = torch.ops.vlseq_ext.mm_tf32(a.t(), grad) if need[1] else None
    dbias = grad.sum(0) if ctx.has_bias and need[2] else None
    return da, db, dbias


def _register_autograd() -> None:
    """mm_tf32 is differentiable (the other ops are the pieces of vlseq_ext.nn's own autograd)."""
    if _ext.LOADED:
        torch.library.register_autograd("vlseq_ext::mm_tf32", _mm_tf32_backward, setup_context=_mm_tf32_setup)


_register_fakes()
_register_autograd()
