"""Pure-PyTorch versions of every op: what the tests compare against, and the fallback when the
compiled extension is missing. Same semantics as the kernels, including the rounding rule:
out = To(OpMath(x) * scale), OpMath = float64 if either side is float64 else float32, and
reductions sum in the fixed order 0..N-1 in that precision. Input checks that protect the
result (overlapping buffers) raise the kernels' messages, before anything is written.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def opmath(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check_dtype(op: str, what: str, t: Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise RuntimeError(f"{op}: {what} has unsupported dtype {t.dtype} "
                           "(supported: float32, float16, bfloat16, float64)")


def _span(t: Tensor, numel: Optional[int] = None):
    """(device, first byte, one past the last byte) of t's elements, first to last (strided views
    included), or of the first `numel` elements of contiguous t; None when that is empty."""
    if numel is None:
        numel = t.numel()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    else:
        extent = numel
    if numel == 0:
        return None
    begin = t.data_ptr()
    return str(t.device), begin, begin + extent * t.element_size()


def _first_overlap(spans, conflict=lambda i, j: True) -> Optional[Tuple[int, int]]:
    """The first pair (i, j), i < j, of the numbered spans [(i, span or None)] that share memory on
    one device and that conflict(i, j) does not excuse; None when there is none. The search of
    csrc/arg_checks.cpp: sorted by start, O(n log n) while nothing overlaps."""
    ordered = sorted((s[0], s[1], i, s[2]) for i, s in spans if s is not None)
    active = []
    for dev, begin, k, end in ordered:
        active = [a for a in active if a[0] == dev and a[3] > begin]
        for a in active:
            i, j = min(a[2], k), max(a[2], k)
            if conflict(i, j):
                return i, j
        active.append((dev, begin, k, end))
    return None


def _check_lists_disjoint(op: str, flat: Sequence[Tensor], per_list: int) -> None:
    hit = _first_overlap((k, _span(t)) for k, t in enumerate(flat))
    if hit is not None:
        i, j = hit
        raise RuntimeError(f"{op}: tensors[{j}] (list {j // per_list}, tensor {j % per_list}) overlaps tensors[{i}] "
                           f"(list {i // per_list}, tensor {i % per_list}) in memory; every tensor needs its own memory")


def _check_broadcast_disjoint(op: str, srcs: Sequence[Tensor], dsts: Sequence[Tensor]) -> None:
    P = len(srcs)

    def conflict(a: int, b: int) -> bool:  # numbering: srcs, then dsts
        if b < P:
            return False  # sources are only read
        if a >= P:
            return True
        return (b - P) % P != a or dsts[b - P].data_ptr() != srcs[a].data_ptr()  # its own source is fine

    hit = _first_overlap([(p, _span(s)) for p, s in enumerate(srcs)] +
                         [(P + i, _span(d)) for i, d in enumerate(dsts)], conflict)
    if hit is not None:
        a, b = hit
        if a >= P:
            raise RuntimeError(f"{op}: dsts[{b - P}] overlaps dsts[{a - P}] in memory; give distinct destinations")
        raise RuntimeError(f"{op}: dsts[{b - P}] overlaps srcs[{a}] in memory; a destination may be its own source, "
                           "but share memory with no other source")


def flatten_(tensors: Sequence[Optional[Tensor]], numels: Sequence[int], out: Tensor, scale: float) -> None:
    if len(tensors) == 0:
        raise RuntimeError("flatten_: tensors must be a non-empty list")
    _check_dtype("flatten_", "out", out)
    total = 0
    for i, (t, n) in enumerate(zip(tensors, numels)):
        if t is not None:
            if t.device != out.device:
                raise RuntimeError(f"flatten_: tensors[{i}] is on {t.device} but out is on {out.device}")
            _check_dtype("flatten_", f"tensors[{i}]", t)
            if t.numel() != n:
                raise RuntimeError(f"flatten_: tensors[{i}] has {t.numel()} elements but numels[{i}] is {n}")
        total += n
    if out.numel() < total:
        raise RuntimeError(f"flatten_: out is too small: it has {out.numel()} elements but the tensors need {total}")
    n = len(tensors)
    hit = _first_overlap([(i, _span(t)) for i, t in enumerate(tensors) if t is not None] + [(n, _span(out, total))],
                         lambda i, j: j == n)
    if hit is not None:
        raise RuntimeError(f"flatten_: tensors[{hit[0]}] overlaps out in memory; the inputs must not share memory "
                           "with the part of out that is written")
    flat = out.view(-1)
    off = 0
    for t, n in zip(tensors, numels):
        seg = flat[off:off + n]
        if t is None:
            seg.zero_()
        else:
            seg.copy_((t.reshape(-1).to(opmath(t.dtype, out.dtype)) * scale).to(out.dtype))
        off += n


def unflatten_(flat: Tensor, tensors: Sequence[Tensor], scale: float) -> None:
    if len(tensors) == 0:
        raise RuntimeError("unflatten_: tensors must be a non-empty list")
    total = sum(t.numel() for t in tensors)
    if flat.numel() < total:
        raise RuntimeError(f"unflatten_: flat is too small: it has {flat.numel()} elements but the tensors need {total}")
    n = len(tensors)
    hit = _first_overlap([(i, _span(t)) for i, t in enumerate(tensors)] + [(n, _span(flat, total))])
    if hit is not None:
        i, j = hit
        if j == n:
            raise RuntimeError(f"unflatten_: tensors[{i}] overlaps flat in memory; the destinations must not share "
                               "memory with the part of flat that is read")
        raise RuntimeError(f"unflatten_: tensors[{j}] overlaps tensors[{i}] in memory; give distinct destinations")
    f = flat.view(-1)
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_((f[off:off + n].to(opmath(flat.dtype, t.dtype)) * scale).to(t.dtype).view_as(t))
        off += n


def _reduce(tensors: Sequence[Tensor], divide: bool, scale: float) -> Tensor:
    """Sum in order 0..N-1 in the op's precision, on tensors[0]'s device."""
    acc_t = opmath(tensors[0].dtype)
    dev = tensors[0].device
    acc = tensors[0].to(acc_t, copy=True)
    for t in tensors[1:]:
        acc += t.to(dev).to(acc_t)
    acc = acc / len(tensors) if divide else acc * scale
    return acc.to(tensors[0].dtype)


def all_reduce_(buffers: Sequence[Tensor], op: str = "sum", algo: str = "auto") -> None:
    if op not in ("sum", "mean"):
        raise RuntimeError(f'all_reduce_: op must be "sum" or "mean", got "{op}"')
    if len(buffers) == 0:
        raise RuntimeError("all_reduce_: buffers must be a non-empty list")
    hit = _first_overlap((i, _span(b)) for i, b in enumerate(buffers))
    if hit is not None:
        raise RuntimeError(f"all_reduce_: buffers[{hit[1]}] aliases another buffer; give distinct buffers "
                           f"(it overlaps buffers[{hit[0]}] in memory)")
    if len(buffers) == 1:
        return
    result = _reduce(buffers, op == "mean", 1.0)
    for b in buffers:
        b.copy_(result)


def broadcast_(src: Tensor, dsts: Sequence[Tensor]) -> None:
    _check_broadcast_disjoint("broadcast_", [src], dsts)
    for d in dsts:
        if d.data_ptr() != src.data_ptr():
            d.copy_(src.reshape(d.shape))  # flat, as the kernels copy: same numel, any shape


def all_reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0) -> None:
    """tensor_lists[d][p]: tensor p of device d. Every list ends with scale * sum over devices."""
    _check_lists_disjoint("all_reduce_tensors_", [t for lst in tensor_lists for t in lst], len(tensor_lists[0]))
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        result = _reduce(group, False, scale)
        for t in group:
            t.copy_(result)


def reduce_tensors_(tensor_lists: Sequence[Sequence[Tensor]], scale: float = 1.0, zero_others: bool = True) -> None:
    """tensor_lists[0][p] <- scale * sum over the lists; other lists zeroed when zero_others."""
    _check_lists_disjoint("reduce_tensors_", [t for lst in tensor_lists for t in lst], len(tensor_lists[0]))
    for p in range(len(tensor_lists[0])):
        group = [lst[p] for lst in tensor_lists]
        if group[0].numel() == 0:
            continue
        group[0].copy_(_reduce(group, False, scale))
        if zero_others:
            for t in group[1:]:
                t.zero_()


def broadcast_tensors_(srcs: Sequence[Tensor], dst_lists: Sequence[Sequence[Tensor]]) -> None:
    _check_broadcast_disjoint("broadcast_tensors_", srcs, [t for lst in dst_lists for t in lst])
    for lst in dst_lists:
        for s, d in zip(srcs, lst):
            if d.data_ptr() != s.data_ptr():
                d.copy_(s.reshape(d.shape))


# --- recurrent layers (rnn_forward / rnn_backward; semantics in csrc/include/vlseq/rnn.h) ---------


def _rnn_check(op: str, cell: str, weights: str, tensors) -> None:
    """The checks that keep the reference from computing garbage; the kernels' checks are fuller."""
    if cell not in ("lstm", "gru"):
        raise RuntimeError(f'{op}: cell must be "lstm" or "gru", got "{cell}"')
    if weights not in ("fp32", "tf32", "bf16"):
        raise RuntimeError(f'{op}: weights must be "fp32", "tf32" or "bf16", got "{weights}"')
    for name, t, shape in tensors:
        if t.dtype != (torch.int64 if name == "lengths" else torch.float32):
            raise RuntimeError(f"{op}: {name} must be {'int64' if name == 'lengths' else 'float32'}, got {t.dtype}")
        if tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _rnn_weights(w_hh: Tensor, weights: str) -> Tensor:
    # tf32 computes in fp32 off the GPU's tensor cores, as the CPU kernels do
    return w_hh.to(torch.bfloat16).to(w_hh.dtype) if weights == "bf16" else w_hh


def _step_rows(s: int, lengths: Tensor, reverse: bool) -> Tuple[Tensor, Tensor]:
    """(samples still running at step s, their time index)."""
    active = (s < lengths).nonzero().flatten()
    t = lengths[active] - 1 - s if reverse else torch.full_like(active, s)
    return active, t


def rnn_forward(cell: str, xproj: Tensor, w_hh: Tensor, b_hh: Optional[Tensor], h0: Tensor, c0: Optional[Tensor],
                lengths: Tensor, reverse: bool, weights: str):
    op, lstm = "rnn_forward", cell == "lstm"
    B, T, GH = xproj.shape
    H = w_hh.shape[-1]
    _rnn_check(op, cell, weights, [("xproj", xproj, (B, T, GH)), ("w_hh", w_hh, (GH, H)), ("h0", h0, (B, H)),
                                   ("lengths", lengths, (B,))] + ([("c0", c0, (B, H))] if lstm else []))
    W, L = _rnn_weights(w_hh, weights), lengths.clamp(0, T)
    y, saved = xproj.new_zeros(B, T, H), xproj.new_zeros(B, T, 4 * H)
    cs = xproj.new_zeros(B, T, H) if lstm else xproj.new_empty(0)
    h, c = h0.clone(), (c0.clone() if lstm else None)
    for s in range(T):
        rows, t = _step_rows(s, L, reverse)
        if rows.numel() == 0:
            break
        x, hp = xproj[rows, t], h[rows]
        gh = hp @ W.T + (b_hh if b_hh is not None else 0)
        if lstm:
            i, f, g, o = (x + gh).chunk(4, dim=1)
            i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
            c[rows] = f * c[rows] + i * g
            hn = o * c[rows].tanh()
            saved[rows, t] = torch.stack([i, f, g, o], 2).flatten(1)  # each unit's four together
            cs[rows, t] = c[rows]
        else:
            xr, xz, xn = x.chunk(3, dim=1)
            hr, hz, hn_ = gh.chunk(3, dim=1)
            r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
            n = (xn + r * hn_).tanh()
            hn = (1 - z) * n + z * hp
            saved[rows, t] = torch.stack([r, z, n, hn_], 2).flatten(1)
        h[rows] = hn
        y[rows, t] = hn
    return y, h, (c if lstm else xproj.new_empty(0)), saved, cs


def rnn_backward(cell: str, w_hh: Tensor, y: Tensor, saved: Tensor, cs: Tensor, h0: Tensor, c0: Optional[Tensor],
                 lengths: Tensor, dy: Optional[Tensor], dh_n: Optional[Tensor], dc_n: Optional[Tensor], reverse: bool,
                 weights: str):
    op, lstm = "rnn_backward", cell == "lstm"
    B, T, H = y.shape
    G = 4 if lstm else 3
    _rnn_check(op, cell, weights, [("w_hh", w_hh, (G * H, H)), ("y", y, (B, T, H)), ("saved", saved, (B, T, 4 * H)),
                                   ("h0", h0, (B, H)), ("lengths", lengths, (B,))]
               + ([("cs", cs, (B, T, H)), ("c0", c0, (B, H))] if lstm else []))
    W, L = _rnn_weights(w_hh, weights), lengths.clamp(0, T)
    dgates = y.new_zeros(B, T, G * H)
    dgates_hn = y.new_empty(0) if lstm else y.new_zeros(B, T, H)
    dh = dh_n.clone() if dh_n is not None else y.new_zeros(B, H)
    dc = (dc_n.clone() if dc_n is not None else y.new_zeros(B, H)) if lstm else None
    for s in range(T - 1, -1, -1):
        rows, t = _step_rows(s, L, reverse)
        if rows.numel() == 0:
            continue
        tp = t + 1 if reverse else t - 1  # the step before (s > 0)
        dht = dh[rows] + (dy[rows, t] if dy is not None else 0)
        sv = saved[rows, t]
        if lstm:
            i, f, g, o = sv.unflatten(1, (H, 4)).unbind(2)
            cp = c0[rows] if s == 0 else cs[rows, tp]
            tc = cs[rows, t].tanh()
            dct = dc[rows] + dht * o * (1 - tc * tc)
            d = torch.cat([dct * g * i * (1 - i), dct * cp * f * (1 - f), dct * i * (1 - g * g),
                           dht * tc * o * (1 - o)], 1)
            dc[rows] = dct * f
            dgh, direct = d, 0
        else:
            r, z, n, ghn = sv.unflatten(1, (H, 4)).unbind(2)
            hp = h0[rows] if s == 0 else y[rows, tp]
            dn = dht * (1 - z) * (1 - n * n)
            d = torch.cat([dn * ghn * r * (1 - r), dht * (hp - n) * z * (1 - z), dn], 1)
            dgates_hn[rows, t] = dn * r
            dgh, direct = torch.cat([d[:, :2 * H], dn * r], 1), dht * z
        dgates[rows, t] = d
        dh[rows] = dgh @ W + direct
    return dgates, dgates_hn, dh, (dc if lstm else y.new_empty(0))


def mm_tf32(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """a @ b (+ bias) of float32 matrices, exact (the CPU kernel's result; the CUDA kernel's TF32
    products are within ~1e-3 of it)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2 or t.dtype != torch.float32:
            raise RuntimeError(f"vlseq_ext::mm_tf32: {name} must be a float32 matrix, got {t.dtype} of shape "
                               f"{tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"vlseq_ext::mm_tf32: a is {list(a.shape)} and b is {list(b.shape)}: a's columns must "
                           "equal b's rows")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.dtype != torch.float32):
        raise RuntimeError(f"vlseq_ext::mm_tf32: bias must be float32 of shape ({b.shape[1]}), got {bias.dtype} "
                           f"of shape {list(bias.shape)}")
    return a @ b if bias is None else torch.addmm(bias, a, b)
