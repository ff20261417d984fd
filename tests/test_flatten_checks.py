"""Bad input to flatten / unflatten_ and their wrappers: the message names the problem, and nothing was
written; inputs that may share memory."""
from __future__ import annotations

import pytest
import torch

from vlseq_ext import ops, reference

from helpers import assert_same_bits, raises_matching
from flatten_cases import DEVICES

pytestmark = pytest.mark.usefixtures("compiled_ops")


FLATTEN_BAD = [
    "empty", "device_mismatch", "out_too_small", "out_int32", "input_int32", "numels_length_wrapper",
    "numels_length_op", "numels_value", "numels_negative", "none_without_numels", "out_not_contiguous",
    "input_overlaps_out", "input_is_out", "strided_input_overlaps_out", "input_aliases_out_other_storage",
    "numels_sum_overflows", "numels_fraction", "numels_bool",
]


def _flatten_bad_case(case, device, rand):
    """Returns (call, exception type, message regex, tensors that must stay unchanged)."""
    a = rand.randn(3, device=device)
    b = rand.randn(2, 2, device=device)
    out = rand.randn(16, device=device)
    op = torch.ops.vlseq_ext.flatten_
    if case == "empty":
        # The wrapper may refuse it (ValueError, "flatten:") before the op does (RuntimeError, "flatten_:").
        return (lambda: ops.flatten([], out=out), (RuntimeError, ValueError),
                r"flatten_?: tensors must be a non-empty list", [out])
    if case == "device_mismatch":
        if device == "cpu":
            # No second real device on a CPU-only machine: a "meta" tensor is on another device too.
            other = torch.empty(4, device="meta")
            return (lambda: ops.flatten([a, b, other], out=out), RuntimeError,
                    r"flatten_: tensors\[2\] is on meta but out is on cpu", [out, a, b])
        other = rand.randn(4)
        return (lambda: ops.flatten([a, b, other], out=out), RuntimeError,
                r"flatten_: tensors\[2\] is on cpu but out is on cuda:0", [out, a, b, other])
    if case == "out_too_small":
        small = rand.randn(6, device=device)
        return (lambda: ops.flatten([a, b], out=small), RuntimeError,
                r"flatten_: out is too small: it has 6 elements but numels\[0\.\.1\] need more \(3 \+ 4\)", [small, a, b])
    if case == "out_int32":
        iout = torch.arange(16, dtype=torch.int32, device=device)
        return (lambda: ops.flatten([a, b], out=iout), RuntimeError,
                r"flatten_: out has unsupported dtype Int", [iout])
    if case == "input_int32":
        i = torch.arange(4, dtype=torch.int32, device=device)
        return (lambda: ops.flatten([a, b, i], out=out), RuntimeError,
                r"flatten_: tensors\[2\] has unsupported dtype Int \(supported: float32, float16, bfloat16, float64\)",
                [out])
    if case == "numels_length_wrapper":
        return (lambda: ops.flatten([a, b], out=out, numels=[3, 4, 1]), ValueError,
                r"flatten: numels has 3 entries but tensors has 2", [out])
    if case == "numels_length_op":
        return (lambda: op([a, b], [3, 4, 1], out, 1.0), RuntimeError,
                r"flatten_: numels has 3 entries but tensors has 2", [out])
    if case == "numels_value":
        return (lambda: ops.flatten([a, b], out=out, numels=[3, 5]), RuntimeError,
                r"flatten_: tensors\[1\] has 4 elements but numels\[1\] is 5", [out])
    if case == "numels_negative":
        return (lambda: ops.flatten([a, None], out=out, numels=[3, -1]), RuntimeError,
                r"flatten_: numels\[1\] is negative \(-1\)", [out])
    if case == "none_without_numels":
        return (lambda: ops.flatten([a, None, b], out=out), ValueError,
                r"flatten: tensors\[1\] is None, so numels must be given", [out])
    if case == "out_not_contiguous":
        base = rand.randn(16, 2, device=device)
        nc = base.t()
        return (lambda: op([a, b], [3, 4], nc, 1.0), RuntimeError, r"flatten_: out must be contiguous", [base])
    overlap = r"flatten_: tensors\[{}\] overlaps out in memory; the inputs must not share memory with the part of out"
    if case == "input_overlaps_out":
        buf = rand.randn(8, device=device)
        return lambda: ops.flatten([buf[0:4]], out=buf[2:6]), RuntimeError, overlap.format(0), [buf]
    if case == "input_is_out":
        return lambda: ops.flatten([a, out[3:7]], out=out), RuntimeError, overlap.format(1), [out, a]
    if case == "strided_input_overlaps_out":
        # A transposed view of out: its first-to-last element range covers what flatten writes.
        buf = rand.randn(24, device=device)
        return (lambda: ops.flatten([buf[:16].view(4, 4).t()], out=buf[8:24]), RuntimeError, overlap.format(0),
                [buf])
    if case == "input_aliases_out_other_storage":
        # Two tensors over the same memory with separate storages (as from_blob/DLPack make them):
        # the check compares addresses, not storages.
        if device != "cpu":
            pytest.skip("numpy aliases CPU memory only")
        arr = rand.randn(8).numpy()
        buf, alias = torch.from_numpy(arr), torch.from_numpy(arr)
        return lambda: ops.flatten([alias[4:8]], out=buf[2:6]), RuntimeError, overlap.format(0), [buf]
    if case == "numels_sum_overflows":
        # The total wraps past 2**63 to 10 = out's size: it passed the size check, and on CUDA the
        # float64 input (a launch group of its own) was written 20 elements before `out`.
        buf = torch.arange(100.0, device=device)
        x = torch.full((10,), -7.0, dtype=torch.float64, device=device)
        huge = [2**62 - 20, 10, 2**62, 2**62, 2**62 + 20]
        return (lambda: op([None, x, None, None, None], huge, buf[50:60], 1.0), RuntimeError,
                r"flatten_: out is too small: it has 10 elements but numels\[0\.\.0\] need more", [buf])
    if case == "numels_fraction":
        return (lambda: ops.flatten([a, None], out=out, numels=[3, 2.9]), TypeError,
                r"flatten: numels\[1\] must be a whole number of elements, got 2\.9", [out])
    if case == "numels_bool":
        return (lambda: ops.flatten([None, a], out=out, numels=[True, 3]), TypeError,
                r"flatten: numels\[0\] must be a whole number of elements, got True", [out])
    raise AssertionError(case)


@pytest.mark.parametrize("case", FLATTEN_BAD)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_bad_input(device, case, rand):
    call, exc, match, keep = _flatten_bad_case(case, device, rand)
    saved = [t.clone() for t in keep]
    with raises_matching(exc, match):
        call()
    for t, s in zip(keep, saved):
        assert_same_bits(t, s, f"{case}: a failed flatten wrote into its arguments")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_flatten_cuda_tensors_into_cpu_out(device, rand):
    a = rand.randn(3, device=device)
    out = rand.randn(8)
    saved = out.clone()
    with raises_matching(RuntimeError, r"flatten_: tensors\[0\] is on cuda:0 but out is on cpu"):
        ops.flatten([a], out=out)
    assert_same_bits(out, saved)


UNFLATTEN_BAD = ["empty", "flat_too_small", "dest_int32", "flat_int32", "device_mismatch", "flat_not_contiguous",
                 "dest_overlaps_flat", "dests_overlap", "dest_twice", "strided_dests_interleaved"]


def _unflatten_bad_case(case, device, rand):
    flat = rand.randn(10, device=device)
    a = rand.randn(3, device=device)
    b = rand.randn(2, 2, device=device)
    op = torch.ops.vlseq_ext.unflatten_
    if case == "empty":
        return lambda: ops.unflatten_(flat, []), r"unflatten_: tensors must be a non-empty list", [flat]
    if case == "flat_too_small":
        c = rand.randn(4, device=device)
        return (lambda: ops.unflatten_(flat, [a, b, c]),
                r"unflatten_: flat is too small: it has 10 elements but the tensors need 11", [a, b, c])
    if case == "dest_int32":
        i = torch.arange(2, dtype=torch.int32, device=device)
        return (lambda: ops.unflatten_(flat, [a, b, i]), r"unflatten_: tensors\[2\] has unsupported dtype Int",
                [a, b, i])
    if case == "flat_int32":
        iflat = torch.arange(10, dtype=torch.int32, device=device)
        return lambda: ops.unflatten_(iflat, [a, b]), r"unflatten_: flat has unsupported dtype Int", [a, b]
    if case == "device_mismatch":
        if device == "cpu":
            other = torch.empty(2, device="meta")
            return (lambda: ops.unflatten_(flat, [a, b, other]),
                    r"unflatten_: tensors\[2\] is on meta but flat is on cpu", [a, b])
        other = rand.randn(2)
        return (lambda: ops.unflatten_(flat, [a, b, other]),
                r"unflatten_: tensors\[2\] is on cpu but flat is on cuda:0", [a, b, other])
    if case == "flat_not_contiguous":
        nc = rand.randn(10, 2, device=device).t()
        return lambda: op(nc, [a, b], 1.0), r"unflatten_: flat must be contiguous", [a, b]
    if case == "dest_overlaps_flat":
        buf = rand.randn(8, device=device)
        return (lambda: ops.unflatten_(buf[0:4], [buf[2:6]]),
                r"unflatten_: tensors\[0\] overlaps flat in memory; the destinations must not share memory", [buf])
    if case == "dests_overlap":
        buf = rand.randn(8, device=device)
        return (lambda: ops.unflatten_(flat, [buf[0:4], buf[3:7]]),
                r"unflatten_: tensors\[1\] overlaps tensors\[0\] in memory; give distinct destinations", [buf])
    if case == "dest_twice":
        return (lambda: ops.unflatten_(flat, [a, b, a]),
                r"unflatten_: tensors\[2\] overlaps tensors\[0\] in memory; give distinct destinations", [a, b])
    if case == "strided_dests_interleaved":
        # Columns 0 and 1 of one matrix share no element, but their first-to-last ranges intersect:
        # refused, since the check compares address ranges.
        m = rand.randn(3, 2, device=device)
        return (lambda: ops.unflatten_(flat, [m[:, 0], m[:, 1]]),
                r"unflatten_: tensors\[1\] overlaps tensors\[0\] in memory", [m])
    raise AssertionError(case)


@pytest.mark.parametrize("case", UNFLATTEN_BAD)
@pytest.mark.parametrize("device", DEVICES)
def test_unflatten_bad_input(device, case, rand):
    call, match, keep = _unflatten_bad_case(case, device, rand)
    saved = [t.clone() for t in keep]
    with raises_matching(RuntimeError, match):
        call()
    for t, s in zip(keep, saved):
        assert_same_bits(t, s, f"{case}: a failed unflatten_ wrote into its arguments")


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_inputs_may_share_memory_with_each_other_and_with_unwritten_out(device, rand):
    """Only memory that is written must not be read: inputs may overlap each other, and the part of
    out past sum(numels) is not written."""
    buf = rand.randn(16, device=device)
    x = rand.randn(6, device=device)
    tensors = [x, x[1:4], buf[13:16]]  # 12 elements written: buf[0:12]
    expected = buf.clone()
    reference.flatten_([t.clone() for t in tensors], [6, 3, 3], expected, 1.0)
    ops.flatten(tensors, out=buf)
    assert_same_bits(buf, expected)


@pytest.mark.parametrize("case", ["flatten_input_overlaps_out", "unflatten_dest_overlaps_flat", "unflatten_dests_overlap"])
def test_reference_refuses_overlaps_before_writing(case, rand):
    """The pure-PyTorch fallback refuses what the kernels refuse, with their message."""
    buf = rand.randn(8)
    saved = buf.clone()
    calls = {
        "flatten_input_overlaps_out": (lambda: reference.flatten_([buf[0:4]], [4], buf[2:6], 1.0),
                                       r"flatten_: tensors\[0\] overlaps out in memory"),
        "unflatten_dest_overlaps_flat": (lambda: reference.unflatten_(buf[0:4], [buf[2:6]], 1.0),
                                         r"unflatten_: tensors\[0\] overlaps flat in memory"),
        "unflatten_dests_overlap": (lambda: reference.unflatten_(rand.randn(8), [buf[0:4], buf[2:6]], 1.0),
                                    r"unflatten_: tensors\[1\] overlaps tensors\[0\] in memory"),
    }
    call, match = calls[case]
    with raises_matching(RuntimeError, match):
        call()
    assert_same_bits(buf, saved, f"{case}: the reference wrote before refusing")


NON_TENSOR_CASES = ["nested_list", "string_among_tensors", "out_list", "tensor_as_list", "flat_list", "dest_int"]


@pytest.mark.parametrize("native", [True, False], ids=["extension", "reference-fallback"])
@pytest.mark.parametrize("case", NON_TENSOR_CASES)
def test_wrappers_name_non_tensor_arguments(case, native, rand, monkeypatch):
    """A non-tensor argument is a TypeError naming it and saying what it is (it used to be an
    AttributeError from inside the wrapper, or the dispatcher's schema dump)."""
    if not native:
        monkeypatch.setattr(ops._ext, "LOADED", False)
        monkeypatch.setattr(ops._ext, "_warned", True)
    a, out = rand.randn(3), rand.randn(8)
    saved = [a.clone(), out.clone()]
    calls = {
        "nested_list": (lambda: ops.flatten([[1.0, 2.0]]),
                        r"flatten: tensors\[0\] must be a torch.Tensor or None, got list \[1.0, 2.0\]"),
        "string_among_tensors": (lambda: ops.flatten([a, "x"], out=out, numels=[3, 1]),
                                 r"flatten: tensors\[1\] must be a torch.Tensor or None, got str 'x'"),
        "out_list": (lambda: ops.flatten([a], out=[0.0] * 3), r"flatten: out must be a torch.Tensor, got list"),
        "tensor_as_list": (lambda: ops.flatten(a, out=out), r"flatten: tensors must be a list of tensors, got Tensor"),
        "flat_list": (lambda: ops.unflatten_([1.0, 2.0, 3.0], [a]), r"unflatten_: flat must be a torch.Tensor, got list"),
        "dest_int": (lambda: ops.unflatten_(out, [a, 3]), r"unflatten_: tensors\[1\] must be a torch.Tensor, got int 3"),
    }
    call, match = calls[case]
    with raises_matching(TypeError, match):
        call()
    for t, s in zip([a, out], saved):
        assert_same_bits(t, s, f"{case}: a refused call wrote into its arguments")


