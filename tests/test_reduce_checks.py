"""Bad input to the reductions and broadcasts: the message names the problem, and no buffer changed."""
from __future__ import annotations

import pytest
import torch

from vlseq_ext import ops

from helpers import assert_same_bits, raises_matching
from reduce_oracles import clones

pytestmark = pytest.mark.usefixtures("compiled_ops")

# --------------------------------------------------------------------------------------------
# bad input: the message names the problem, and no buffer changed
# --------------------------------------------------------------------------------------------

ALL_REDUCE_BAD = [
    "alias_same_tensor", "alias_same_storage_view", "alias_overlapping_views", "different_numel",
    "different_dtype", "int_dtype", "unknown_op", "unknown_op_single_buffer", "unknown_algo", "empty",
    "not_contiguous", "meta_buffer",
    pytest.param("cuda_same_device", marks=pytest.mark.requires_cuda),
    pytest.param("cpu_cuda_mixed", marks=pytest.mark.requires_cuda),
]


def _all_reduce_bad_case(case, rand):
    """Returns (buffers, op, algo, message regex, tensors that must stay unchanged)."""
    a, b = rand.randn(5), rand.randn(5)
    if case == "alias_same_tensor":
        return [a, b, a], "sum", "auto", r"all_reduce_: buffers\[2\] aliases another buffer; give distinct buffers", [a, b]
    if case == "alias_same_storage_view":
        return [a, a.view(5, 1).view(5)], "sum", "auto", r"all_reduce_: buffers\[1\] aliases another buffer", [a]
    if case == "alias_overlapping_views":
        # Two views of one storage that overlap without starting at the same address.
        base = rand.randn(6)
        return ([base[0:5], base[1:6]], "sum", "auto",
                r"all_reduce_: buffers\[1\] aliases another buffer; give distinct buffers", [base])
    if case == "different_numel":
        c = rand.randn(6)
        return [a, b, c], "sum", "auto", r"all_reduce_: buffers\[2\] has 6 elements but buffers\[0\] has 5", [a, b, c]
    if case == "different_dtype":
        c = rand.randn(5, dtype=torch.float64)
        return ([a, c], "mean", "auto", r"all_reduce_: buffers\[1\] has dtype Double but buffers\[0\] has Float",
                [a, c])
    if case == "int_dtype":
        i, j = torch.arange(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32) + 7
        return ([i, j], "sum", "auto", r"all_reduce_: buffers\[0\] has unsupported dtype Int \(supported: float32, "
                r"float16, bfloat16, float64\)", [i, j])
    if case == "unknown_op":
        return [a, b], "max", "auto", r'all_reduce_: op must be "sum" or "mean", got "max"', [a, b]
    if case == "unknown_op_single_buffer":
        return [a], "max", "auto", r'all_reduce_: op must be "sum" or "mean", got "max"', [a]
    if case == "unknown_algo":
        return ([a, b], "sum", "ring", r'all_reduce_: algo must be one of auto, [\w, ]*one_shot, two_shot, '
                r'copy_engine; got "ring"', [a, b])
    if case == "empty":
        return [], "sum", "auto", r"all_reduce_: buffers must be a non-empty list", []
    if case == "not_contiguous":
        base = rand.randn(5, 2)
        return [a, base[:, 0]], "sum", "auto", r"all_reduce_: buffers\[1\] must be contiguous", [a, base]
    if case == "meta_buffer":
        m = torch.empty(5, device="meta")
        return [a, m], "sum", "auto", r"all_reduce_: buffers\[1\] must be a CPU or CUDA tensor, got meta", [a]
    if case == "cuda_same_device":
        c, d = rand.randn(5, device="cuda:0"), rand.randn(5, device="cuda:0")
        return ([c, d], "sum", "auto", r"all_reduce_: buffers\[1\] is on cuda:0, which another buffer already uses; "
                r"give one buffer per device", [c, d])
    if case == "cpu_cuda_mixed":
        c = rand.randn(5, device="cuda:0")
        return ([a, c], "sum", "auto", r"all_reduce_: buffers mixes CPU and CUDA tensors \(buffers\[0\] is on cpu, "
                r"buffers\[1\] is on cuda:0\)", [a, c])
    raise AssertionError(case)


@pytest.mark.parametrize("case", ALL_REDUCE_BAD)
def test_all_reduce_bad_input(case, rand):
    bufs, op, algo, match, keep = _all_reduce_bad_case(case, rand)
    saved = clones(keep)
    with raises_matching((RuntimeError, ValueError), match):
        ops.all_reduce_(bufs, op, algo)
    for t, s in zip(keep, saved):
        assert_same_bits(t, s, f"{case}: a failed all_reduce_ changed a buffer")


@pytest.mark.parametrize("name", ["all_reduce_tensors_", "broadcast_tensors_", "p2p_status"])
def test_empty_lists_name_the_problem(name):
    """An empty tensor list must fail with the op's own message (csrc/arg_checks.cpp), not with the
    dispatcher's "There were no tensor arguments to this function". (all_reduce_: see
    test_all_reduce_bad_input[empty].)"""
    calls = {
        "all_reduce_tensors_": lambda: ops.all_reduce_tensors_([[], []]),
        "broadcast_tensors_": lambda: ops.broadcast_tensors_([], [[]]),
        "p2p_status": lambda: ops.p2p_status([]),
    }
    with raises_matching((RuntimeError, ValueError), rf"{name}: \w+ must be a non-empty list"):
        calls[name]()


ALL_REDUCE_TENSORS_BAD = ["empty", "uneven", "shape", "dtype", "not_contiguous", "int_dtype", "meta",
                          "same_tensor_in_two_lists",
                          pytest.param("cpu_cuda_mixed", marks=pytest.mark.requires_cuda),
                          pytest.param("cuda_same_device", marks=pytest.mark.requires_cuda)]


def _all_reduce_tensors_bad_case(case, rand):
    """Returns (tensor_lists, exception, message regex, tensors that must stay unchanged)."""
    a0, b0, a1, b1 = rand.randn(5), rand.randn(2, 3), rand.randn(5), rand.randn(2, 3)
    keep = [a0, b0, a1, b1]
    if case == "empty":
        return [], ValueError, r"all_reduce_tensors_: tensor_lists must be a non-empty list", []
    if case == "uneven":
        return ([[a0, b0], [a1]], ValueError,
                r"all_reduce_tensors_: every device needs the same number of tensors, got \[1, 2\]", keep)
    if case == "shape":
        c = rand.randn(7)
        return ([[a0, b0], [a1, c]], RuntimeError, r"all_reduce_tensors_: tensors\[3\] \(Float, 7 elements\) does "
                r"not match tensors\[1\] \(Float, 6 elements\) of device list 0", keep + [c])
    if case == "dtype":
        c = rand.randn(2, 3, dtype=torch.float16)
        return ([[a0, b0], [a1, c]], RuntimeError, r"all_reduce_tensors_: tensors\[3\] \(Half, 6 elements\) does "
                r"not match tensors\[1\] \(Float, 6 elements\) of device list 0", keep + [c])
    if case == "not_contiguous":
        c = rand.randn(3, 2).t()
        return [[a0, b0], [a1, c]], RuntimeError, r"all_reduce_tensors_: tensors\[3\] must be contiguous", keep + [c]
    if case == "int_dtype":
        i, j = torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
        return ([[a0, i], [a1, j]], RuntimeError, r"all_reduce_tensors_: tensors\[1\] has unsupported dtype Int",
                [a0, a1, i, j])
    if case == "meta":
        m = torch.empty(2, 3, device="meta")
        return ([[a0, b0], [a1, m]], RuntimeError,
                r"all_reduce_tensors_: tensors\[3\] must be a CPU or CUDA tensor, got meta", [a0, b0, a1])
    if case == "same_tensor_in_two_lists":
        return ([[a0, b0], [a1, b0]], RuntimeError, r"all_reduce_tensors_: tensors\[3\] \(list 1, tensor 1\) "
                r"overlaps tensors\[1\] \(list 0, tensor 1\) in memory; every tensor needs its own memory", keep)
    if case == "cpu_cuda_mixed":
        c, d = rand.randn(5, device="cuda:0"), rand.randn(2, 3, device="cuda:0")
        return ([[a0, b0], [c, d]], RuntimeError,
                r"all_reduce_tensors_: tensors mixes CPU and CUDA tensors \(tensors\[0\] is on cpu, tensors\[2\] is "
                r"on cuda:0\)", keep + [c, d])
    if case == "cuda_same_device":
        c = [rand.randn(5, device="cuda:0"), rand.randn(2, 3, device="cuda:0")]
        d = [rand.randn(5, device="cuda:0"), rand.randn(2, 3, device="cuda:0")]
        return ([c, d], RuntimeError, r"all_reduce_tensors_: device list 1 is on cuda:0, which another list already "
                r"uses; give one list per device", c + d)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ALL_REDUCE_TENSORS_BAD)
def test_all_reduce_tensors_bad_input(case, rand):
    lists, exc, match, keep = _all_reduce_tensors_bad_case(case, rand)
    saved = clones(keep)
    with raises_matching(exc, match):
        ops.all_reduce_tensors_(lists, 0.5)
    for t, s in zip(keep, saved):
        assert_same_bits(t, s, f"{case}: a failed all_reduce_tensors_ changed a tensor")


BROADCAST_BAD = ["numel", "dtype", "dst_not_contiguous", "src_int", "tensors_length", "tensors_shape",
                 "dsts_same_tensor", "dst_overlaps_src", "dst_lists_share_a_tensor", "dst_is_another_source",
                 "dst_shifted_own_source",
                 pytest.param("cuda_src_cpu_dst", marks=pytest.mark.requires_cuda)]


def _broadcast_bad_case(case, rand):
    """Returns (call, exception, message regex, tensors that must stay unchanged)."""
    src = rand.randn(5)
    d0, d1 = rand.randn(5), rand.randn(5)
    if case == "numel":
        d2 = rand.randn(6)
        return (lambda: ops.broadcast_(src, [d0, d2]), RuntimeError,
                r"broadcast_: dsts\[1\] \(Float, 6 elements\) does not match srcs\[0\] \(Float, 5 elements\)",
                [src, d0, d2])
    if case == "dtype":
        d2 = rand.randn(5, dtype=torch.bfloat16)
        return (lambda: ops.broadcast_(src, [d0, d2]), RuntimeError,
                r"broadcast_: dsts\[1\] \(BFloat16, 5 elements\) does not match srcs\[0\] \(Float, 5 elements\)",
                [src, d0, d2])
    if case == "dst_not_contiguous":
        base = rand.randn(5, 2)
        return (lambda: ops.broadcast_(src, [d0, base[:, 1]]), RuntimeError,
                r"broadcast_: dsts\[1\] must be contiguous", [src, d0, base])
    if case == "src_int":
        i = torch.arange(5, dtype=torch.int32)
        j = torch.zeros(5, dtype=torch.int32)
        return (lambda: ops.broadcast_(i, [j]), RuntimeError, r"broadcast_: srcs\[0\] has unsupported dtype Int",
                [i, j])
    if case == "tensors_length":
        return (lambda: ops.broadcast_tensors_([src], [[d0], [d1, d0]]), ValueError,
                r"broadcast_tensors_: dst_lists\[1\] has 2 tensors but srcs has 1", [src, d0, d1])
    if case == "tensors_shape":
        s2, e0, e1 = rand.randn(2, 3), rand.randn(2, 3), rand.randn(3, 3)
        return (lambda: ops.broadcast_tensors_([src, s2], [[d0, e0], [d1, e1]]), RuntimeError,
                r"broadcast_tensors_: dsts\[3\] \(Float, 9 elements\) does not match srcs\[1\] \(Float, 6 elements\)",
                [src, s2, d0, e0, d1, e1])
    if case == "dsts_same_tensor":
        return (lambda: ops.broadcast_(src, [d0, d1, d0]), RuntimeError,
                r"broadcast_: dsts\[2\] overlaps dsts\[0\] in memory; give distinct destinations", [src, d0, d1])
    if case == "dst_overlaps_src":
        base = rand.randn(8)
        return (lambda: ops.broadcast_(base[0:5], [d0, base[3:8]]), RuntimeError,
                r"broadcast_: dsts\[1\] overlaps srcs\[0\] in memory; a destination may be its own source, but "
                r"share memory with no other source", [base, d0])
    if case == "dst_lists_share_a_tensor":
        return (lambda: ops.broadcast_tensors_([src], [[d0], [d1], [d0]]), RuntimeError,
                r"broadcast_tensors_: dsts\[2\] overlaps dsts\[0\] in memory", [src, d0, d1])
    if case == "dst_is_another_source":
        s2 = rand.randn(5)
        return (lambda: ops.broadcast_tensors_([src, s2], [[s2, d0]]), RuntimeError,
                r"broadcast_tensors_: dsts\[0\] overlaps srcs\[1\] in memory", [src, s2, d0])
    if case == "dst_shifted_own_source":
        base = rand.randn(6)
        return (lambda: ops.broadcast_tensors_([base[0:5]], [[base[1:6]]]), RuntimeError,
                r"broadcast_tensors_: dsts\[0\] overlaps srcs\[0\] in memory", [base])
    if case == "cuda_src_cpu_dst":
        s = rand.randn(5, device="cuda:0")
        return (lambda: ops.broadcast_(s, [d0]), RuntimeError,
                r"broadcast_: dsts\[0\] is on cpu but srcs are on cuda:0; CPU and CUDA cannot be mixed", [s, d0])
    raise AssertionError(case)


@pytest.mark.parametrize("case", BROADCAST_BAD)
def test_broadcast_bad_input(case, rand):
    call, exc, match, keep = _broadcast_bad_case(case, rand)
    saved = clones(keep)
    with raises_matching(exc, match):
        call()
    for t, s in zip(keep, saved):
        assert_same_bits(t, s, f"{case}: a failed broadcast changed a tensor")


@pytest.mark.parametrize("case", ["alias", "numel"])
def test_p2p_status_bad_input(case, rand):
    a = rand.randn(5)
    bufs = [a, a] if case == "alias" else [a, rand.randn(4)]
    match = r"p2p_status: buffers\[1\] aliases another buffer" if case == "alias" else \
        r"p2p_status: buffers\[1\] has 4 elements but buffers\[0\] has 5"
    with raises_matching(RuntimeError, match):
        ops.p2p_status(bufs)


