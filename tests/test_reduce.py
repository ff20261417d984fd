"""all_reduce_, broadcast_, all_reduce_tensors_, reduce_tensors_, broadcast_tensors_ and p2p_status.

On CPU several distinct buffers stand in for several devices: the CPU kernels sum in the same
fixed order 0..N-1 with the same widened accumulation as the CUDA kernels, so CI checks the
semantics the GPUs must meet. GPU tests (requires_2gpu) run on a 2-GPU machine.

Two oracles for every reduction:
  * reference.all_reduce_ / all_reduce_tensors_ / reduce_tensors_ (same order, same precision):
    exact bits;
  * a float64 sum of the original inputs: within the rounding error of the accumulation
    (N+2 roundings of the accumulator precision, relative to sum |x|) plus one rounding to the
    buffer dtype. That bound fails for a wrong order-independent result (a missing or doubled
    buffer, a stale value) while allowing every correctly rounded answer.
"""
from __future__ import annotations

import inspect
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from vlseq_ext import ops, reference

from helpers import assert_same_bits, bits, dname, raises_matching

pytestmark = pytest.mark.usefixtures("compiled_ops")

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CORE_ALGOS = ["auto", "one_shot", "two_shot", "copy_engine"]


def _accepted_algos():
    """The algo names all_reduce_ accepts, as its own error message lists them (so a new algorithm,
    e.g. "root", is swept by every test below without editing this file)."""
    if not ops.has_extension():
        return list(CORE_ALGOS)
    try:
        torch.ops.vlseq_ext.all_reduce_([torch.zeros(1), torch.zeros(1)], "sum", "no-such-algo")
    except RuntimeError as exc:
        m = re.search(r"algo must be one of ([\w, ]+); got", str(exc))
        if m:
            return [a.strip() for a in m.group(1).split(",")]
    return list(CORE_ALGOS)  # test_all_reduce_bad_input[unknown_algo] reports the missing error


ALGOS = _accepted_algos()
# all_reduce_tensors_ takes every algo but one_shot (which needs a flat scratch buffer), when the
# wrapper has an `algo` argument at all.
TENSORS_TAKE_ALGO = "algo" in inspect.signature(ops.all_reduce_tensors_).parameters
TENSOR_ALGOS = [a for a in ALGOS if a != "one_shot"] if TENSORS_TAKE_ALGO else ["auto"]


def all_reduce_tensors(lists, scale, algo="auto"):
    if TENSORS_TAKE_ALGO:
        ops.all_reduce_tensors_(lists, scale, algo)
    else:
        assert algo == "auto"
        ops.all_reduce_tensors_(lists, scale)


REDUCE_OPS = ["sum", "mean"]

# unit roundoff of each dtype and its smallest positive (subnormal) value
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
TINY = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149, torch.float64: 0.0}


def assert_near_float64(result: torch.Tensor, inputs, divide: bool = False, scale: float = 1.0, what: str = "") -> None:
    """`result` is the sum (or mean, or scale * sum) of `inputs`, rounded as the ops promise."""
    dev = result.device
    x64 = [t.to(device=dev, dtype=torch.float64).reshape(-1) for t in inputs]
    exact = x64[0].clone()
    abs_sum = x64[0].abs()
    for x in x64[1:]:
        exact += x
        abs_sum += x.abs()
    n = len(inputs)
    factor = 1.0 / n if divide else scale
    exact *= factor
    abs_sum *= abs(factor)
    acc = torch.float64 if result.dtype == torch.float64 else torch.float32
    acc_err = (n + 2) * UNIT[acc] * abs_sum
    bound = acc_err + UNIT[result.dtype] * (exact.abs() + acc_err) + TINY[result.dtype]
    got = result.reshape(-1)
    err = (got.to(torch.float64) - exact).abs()
    bad = (err > bound).nonzero().reshape(-1)
    if bad.numel():
        k = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} elements off the float64 reference, first at "
                             f"flat index {k}: got {got[k].item()!r}, exact {exact[k].item()!r}, "
                             f"allowed error {bound[k].item():.3g}")


def clones(ts):
    return [t.clone() for t in ts]


# --------------------------------------------------------------------------------------------
# all_reduce_ on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("nbuf", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [1, 3, 4097])
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
def test_all_reduce_cpu(dtype, size, nbuf, op, rand):
    bufs = [rand.randn(size, dtype=dtype, scale=10.0) for _ in range(nbuf)]
    originals = clones(bufs)
    expected = clones(bufs)
    reference.all_reduce_(expected, op)

    ops.all_reduce_(bufs, op)

    for i, b in enumerate(bufs):
        assert_same_bits(b, expected[i], f"buffer {i} vs reference.all_reduce_")
        assert_same_bits(b, bufs[0], f"buffer {i} vs buffer 0")
    assert_near_float64(bufs[0], originals, divide=op == "mean", what="float64 reference")
    if nbuf == 1:
        assert_same_bits(bufs[0], originals[0], "one buffer: sum and mean are the buffer itself")


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("nbuf", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_all_reduce_cpu_every_algo(dtype, nbuf, op, rand):
    """Every algo name is accepted and gives the same bits (CPU has one algorithm)."""
    inputs = [rand.randn(4097, dtype=dtype) for _ in range(nbuf)]
    expected = clones(inputs)
    reference.all_reduce_(expected, op)
    for algo in ALGOS:
        bufs = clones(inputs)
        ops.all_reduce_(bufs, op, algo)
        for i, b in enumerate(bufs):
            assert_same_bits(b, expected[i], f"algo={algo} buffer {i}")


@pytest.mark.parametrize(
    "dtype,op,nbuf,size",
    [(torch.float32, "sum", 3, 1_000_003), (torch.float32, "mean", 3, 1_000_003),
     (torch.bfloat16, "sum", 3, 1_000_003), (torch.float16, "mean", 2, 1_000_003),
     (torch.float64, "sum", 2, 1_000_003), (torch.float32, "sum", 2, 2**24)],
    ids=lambda v: dname(v) if isinstance(v, torch.dtype) else str(v))
def test_all_reduce_cpu_large(dtype, op, nbuf, size, rand):
    bufs = [rand.randn(size, dtype=dtype) for _ in range(nbuf)]
    originals = clones(bufs)
    expected = clones(bufs)
    reference.all_reduce_(expected, op)
    ops.all_reduce_(bufs, op)
    for i, b in enumerate(bufs):
        assert_same_bits(b, expected[i], f"buffer {i} vs reference")
    assert_near_float64(bufs[0], originals, divide=op == "mean")


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("nbuf", [2, 3, 4])
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
def test_all_reduce_cpu_overwrites_every_buffer(dtype, nbuf, op, rand):
    """Inputs chosen so that the result differs from every input at every element: buffers
    0..N-2 in [1, 1.5], buffer N-1 in [3N, 3N+0.5]; the sum is >= 4N-1 > 3N+0.5 and the mean lies
    in [3.5, 4.5), away from both ranges. A buffer that kept any input value would show."""
    bufs = [rand.uniform(4097, low=1.0, high=1.5, dtype=dtype) for _ in range(nbuf - 1)]
    bufs.append(rand.uniform(4097, low=3.0 * nbuf, high=3.0 * nbuf + 0.5, dtype=dtype))
    originals = clones(bufs)
    ops.all_reduce_(bufs, op)
    for i, (b, o) in enumerate(zip(bufs, originals)):
        kept = (bits(b) == bits(o)).sum().item()
        assert kept == 0, f"buffer {i} kept {kept} of its input values"
    assert_near_float64(bufs[0], originals, divide=op == "mean")


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
def test_all_reduce_cpu_misaligned_buffers(dtype, rand):
    n = 4097
    bases = [rand.randn(n + 2, dtype=dtype) for _ in range(3)]
    saved = clones(bases)
    bufs = [b[1:1 + n] for b in bases]
    expected = [b.clone() for b in bufs]
    reference.all_reduce_(expected, "sum")
    ops.all_reduce_(bufs, "sum")
    for i, (b, base, s) in enumerate(zip(bufs, bases, saved)):
        assert_same_bits(b, expected[i], f"buffer {i}")
        assert_same_bits(base[0], s[0], "wrote before the view")
        assert_same_bits(base[-1], s[-1], "wrote after the view")


@pytest.mark.parametrize("dtype,op", [(torch.float32, "sum"), (torch.bfloat16, "mean")], ids=["float32-sum", "bfloat16-mean"])
def test_all_reduce_cpu_deterministic(dtype, op, rand):
    # 50_003 elements: several parallel_for chunks (grain 16384), so the threads split the work.
    inputs = [rand.randn(50_003, dtype=dtype) for _ in range(3)]
    bufs = clones(inputs)
    ops.all_reduce_(bufs, op)
    first = bufs[0].clone()
    for it in range(100):
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        ops.all_reduce_(bufs, op)
        for i, b in enumerate(bufs):
            assert torch.equal(bits(b), bits(first)), f"run {it}: buffer {i} differs from the first run"


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_opcheck_all_reduce(op, rand):
    bufs = [rand.randn(37), rand.randn(37), rand.randn(37)]
    torch.library.opcheck(torch.ops.vlseq_ext.all_reduce_.default, (bufs, op, "auto"))


# --------------------------------------------------------------------------------------------
# all_reduce_tensors_ on CPU
# --------------------------------------------------------------------------------------------

MIXED_SPECS = [
    ((3, 4), torch.float32), ((7,), torch.bfloat16), ((1,), torch.float16), ((5, 2, 3), torch.float64),
    ((0,), torch.float32), ((4097,), torch.float32), ((70_001,), torch.bfloat16), ((), torch.float32),
    ((33, 3), torch.float16),
]


def _device_lists(rand, ndev, specs, devices=None):
    devices = devices or ["cpu"] * ndev
    return [[rand.randn(*shape, dtype=dtype, device=devices[d]) for shape, dtype in specs] for d in range(ndev)]


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_all_reduce_tensors_cpu(ndev, scale, rand):
    lists = _device_lists(rand, ndev, MIXED_SPECS)
    originals = [clones(lst) for lst in lists]
    expected = [clones(lst) for lst in lists]
    reference.all_reduce_tensors_(expected, scale)

    ops.all_reduce_tensors_(lists, scale)

    for p in range(len(MIXED_SPECS)):
        for d in range(ndev):
            assert_same_bits(lists[d][p], expected[d][p], f"tensor {p} of device {d} vs reference")
            assert_same_bits(lists[d][p], lists[0][p], f"tensor {p}: device {d} vs device 0")
        if lists[0][p].numel():
            assert_near_float64(lists[0][p], [originals[d][p] for d in range(ndev)], scale=scale,
                                what=f"tensor {p}")


def test_core_algos_are_accepted():
    assert set(CORE_ALGOS) <= set(ALGOS), f"all_reduce_ lists algos {ALGOS}"


@pytest.mark.skipif(not TENSORS_TAKE_ALGO, reason="this all_reduce_tensors_ has no algo argument")
def test_all_reduce_tensors_cpu_every_algo(rand):
    """Every algo all_reduce_tensors_ takes gives the reference's bits; one_shot and unknown names
    are refused with a message, before anything is written."""
    lists = _device_lists(rand, 3, MIXED_SPECS)
    expected = [clones(lst) for lst in lists]
    reference.all_reduce_tensors_(expected, 0.25)
    for algo in TENSOR_ALGOS:
        work = [clones(lst) for lst in lists]
        all_reduce_tensors(work, 0.25, algo)
        for d in range(3):
            for p in range(len(MIXED_SPECS)):
                assert_same_bits(work[d][p], expected[d][p], f"algo={algo}: tensor {p} of device {d}")
    for algo, match in [("one_shot", r"all_reduce_tensors_: algo one_shot is for flat buffers"),
                        ("ring", r'all_reduce_tensors_: algo must be one of auto, .*copy_engine; got "ring"')]:
        work = [clones(lst) for lst in lists]
        with raises_matching(RuntimeError, match):
            all_reduce_tensors(work, 0.25, algo)
        for d in range(3):
            for p in range(len(MIXED_SPECS)):
                assert_same_bits(work[d][p], lists[d][p], f"algo={algo} was refused but changed a tensor")


def test_all_reduce_tensors_cpu_matches_flat_pipeline(rand):
    """The fused op and flatten + all_reduce_ + unflatten_ give the same bits (fp32 tensors)."""
    specs = [((3, 4), torch.float32), ((4097,), torch.float32), ((1,), torch.float32), ((64, 36), torch.float32)]
    lists = _device_lists(rand, 3, specs)
    other = [clones(lst) for lst in lists]
    ops.all_reduce_tensors_(lists, 0.25)
    flats = [ops.flatten(lst) for lst in other]
    ops.all_reduce_(flats, "sum")
    for flat, lst in zip(flats, other):
        ops.unflatten_(flat, lst, 0.25)
    for d in range(3):
        for p in range(len(specs)):
            assert_same_bits(lists[d][p], other[d][p], f"tensor {p} of device {d}")


def test_opcheck_all_reduce_tensors(rand):
    lists = _device_lists(rand, 2, [((3, 4), torch.float32), ((5,), torch.bfloat16)])
    torch.library.opcheck(torch.ops.vlseq_ext.all_reduce_tensors_.default,
                          ([t for lst in lists for t in lst], 2, 0.5))


# --------------------------------------------------------------------------------------------
# reduce_tensors_ (the merge onto device list 0) on CPU
# --------------------------------------------------------------------------------------------


def _check_reduce_tensors(lists, originals, expected, scale, zero_others, where="cpu"):
    """List 0 holds the reference's bits (and the float64 sum); the other lists are +0.0 with
    zero_others and untouched without."""
    ndev = len(lists)
    for p in range(len(lists[0])):
        assert_same_bits(lists[0][p], expected[0][p], f"tensor {p} of list 0 vs reference")
        if lists[0][p].numel():
            assert_near_float64(lists[0][p], [originals[d][p] for d in range(ndev)], scale=scale,
                                what=f"tensor {p}")
        for d in range(1, ndev):
            if zero_others:
                assert (bits(lists[d][p]) == 0).all(), f"tensor {p} of list {d} ({where}) is not +0.0"
            else:
                assert_same_bits(lists[d][p], originals[d][p],
                                 f"tensor {p} of list {d} ({where}) changed although zero_others=False")


@pytest.mark.parametrize("zero_others", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_reduce_tensors_cpu(ndev, scale, zero_others, rand):
    lists = _device_lists(rand, ndev, MIXED_SPECS)
    originals = [clones(lst) for lst in lists]
    expected = [clones(lst) for lst in lists]
    reference.reduce_tensors_(expected, scale, zero_others)
    ops.reduce_tensors_(lists, scale, zero_others)
    _check_reduce_tensors(lists, originals, expected, scale, zero_others)


@pytest.mark.parametrize("case", ["uneven", "shape", "not_contiguous", "same_tensor_in_two_lists",
                                  "overlapping_views_in_two_lists", "same_tensor_twice_in_one_list"])
def test_reduce_tensors_bad_input(case, rand):
    a0, b0, a1, b1 = rand.randn(5), rand.randn(2, 3), rand.randn(5), rand.randn(2, 3)
    keep = [a0, b0, a1, b1]
    overlap = (r"reduce_tensors_: tensors\[{}\] \(list {}, tensor {}\) overlaps tensors\[{}\] \(list {}, tensor {}\) "
               r"in memory; every tensor needs its own memory")
    if case == "same_tensor_in_two_lists":
        # [[x], [x]] used to sum x with itself and then zero it.
        lists, exc, match = [[a0, b0], [a0, b1]], RuntimeError, overlap.format(2, 1, 0, 0, 0, 0)
    elif case == "overlapping_views_in_two_lists":
        base = rand.randn(8)
        keep.append(base)
        lists, exc, match = [[base[0:5], b0], [base[3:8], b1]], RuntimeError, overlap.format(2, 1, 0, 0, 0, 0)
    elif case == "same_tensor_twice_in_one_list":
        c = rand.randn(2, 3)
        keep.append(c)
        lists, exc, match = [[a0, c], [a1, c]], RuntimeError, overlap.format(3, 1, 1, 1, 0, 1)
    elif case == "uneven":
        lists, exc, match = [[a0, b0], [a1]], ValueError, r"reduce_tensors_: every device needs the same number"
    elif case == "shape":
        c = rand.randn(7)
        keep.append(c)
        lists, exc, match = [[a0, b0], [a1, c]], RuntimeError, (r"reduce_tensors_: tensors\[3\] \(Float, 7 elements\) "
                                                                r"does not match tensors\[1\]")
    else:
        c = rand.randn(3, 2).t()
        keep.append(c)
        lists, exc, match = [[a0, b0], [a1, c]], RuntimeError, r"reduce_tensors_: tensors\[3\] must be contiguous"
    saved = clones(keep)
    with raises_matching(exc, match):
        ops.reduce_tensors_(lists, 0.5, True)
    for t, v in zip(keep, saved):
        assert_same_bits(t, v, f"{case}: a failed reduce_tensors_ changed a tensor")


@pytest.mark.parametrize("zero_others", [True, False])
@pytest.mark.parametrize("nlists", [5, 8])
def test_reduce_tensors_cpu_lists_are_views_of_one_buffer(nlists, zero_others, rand):
    """Many lists on one device, every tensor a disjoint view of one flat buffer (as gradient sets of
    several streams might be): accepted, and list 0 gets the sum in list order 0, 1, 2, ..."""
    specs = [((3, 4), torch.float32), ((4097,), torch.float32), ((1,), torch.float32), ((5, 7), torch.float32)]
    per_list = sum(math.prod(shape) for shape, _ in specs)
    flat = rand.randn(nlists * per_list + 3)
    views, off = [], 3  # start at element 3: no list is 16-byte aligned
    for _ in range(nlists):
        lst = []
        for shape, _ in specs:
            n = math.prod(shape)
            lst.append(flat[off:off + n].view(shape))
            off += n
        views.append(lst)
    originals = [clones(lst) for lst in views]
    expected = [clones(lst) for lst in views]
    reference.reduce_tensors_(expected, 0.5, zero_others)
    ops.reduce_tensors_(views, 0.5, zero_others)
    _check_reduce_tensors(views, originals, expected, 0.5, zero_others)


REFERENCE_OVERLAPS = {
    "reduce_tensors_": (lambda x, y: reference.reduce_tensors_([[x], [x]], 1.0, True),
                        r"reduce_tensors_: tensors\[1\] \(list 1, tensor 0\) overlaps tensors\[0\]"),
    "all_reduce_tensors_": (lambda x, y: reference.all_reduce_tensors_([[x[0:4]], [x[2:6]]], 1.0),
                            r"all_reduce_tensors_: tensors\[1\] \(list 1, tensor 0\) overlaps tensors\[0\]"),
    "all_reduce_": (lambda x, y: reference.all_reduce_([x, y, x], "sum"),
                    r"all_reduce_: buffers\[2\] aliases another buffer; give distinct buffers"),
    "broadcast_": (lambda x, y: reference.broadcast_(y, [x[0:6], x[2:8]]),
                   r"broadcast_: dsts\[1\] overlaps dsts\[0\] in memory"),
    "broadcast_tensors_": (lambda x, y: reference.broadcast_tensors_([x[0:6]], [[x[1:7]]]),
                           r"broadcast_tensors_: dsts\[0\] overlaps srcs\[0\] in memory"),
}


@pytest.mark.parametrize("op", sorted(REFERENCE_OVERLAPS))
def test_reference_refuses_overlaps_before_writing(op, rand):
    """The pure-PyTorch fallback refuses what the kernels refuse, with their message."""
    x, y = rand.randn(8), rand.randn(6)
    saved = clones([x, y])
    call, match = REFERENCE_OVERLAPS[op]
    with raises_matching(RuntimeError, match):
        call(x, y)
    for t, v in zip([x, y], saved):
        assert_same_bits(t, v, f"{op}: the reference wrote before refusing")


NON_TENSOR_CASES = {
    "all_reduce_": (lambda a, b: ops.all_reduce_([a, None]), r"all_reduce_: buffers\[1\] must be a torch.Tensor, "
                                                             r"got NoneType None"),
    "all_reduce_tensor_as_list": (lambda a, b: ops.all_reduce_(a), r"all_reduce_: buffers must be a list of tensors, "
                                                                   r"got Tensor"),
    "broadcast_": (lambda a, b: ops.broadcast_([1.0] * 5, [a]), r"broadcast_: src must be a torch.Tensor, got list"),
    "reduce_tensors_": (lambda a, b: ops.reduce_tensors_([[a, b], [a.clone(), [1.0, 2.0]]]),
                        r"reduce_tensors_: tensor_lists\[1\]\[1\] must be a torch.Tensor, got list \[1.0, 2.0\]"),
    "reduce_tensors_flat_list": (lambda a, b: ops.reduce_tensors_([a, b]),
                                 r"reduce_tensors_: tensor_lists\[0\] must be a list of tensors, got Tensor"),
    "all_reduce_tensors_": (lambda a, b: ops.all_reduce_tensors_([[a], [3.0]]),
                            r"all_reduce_tensors_: tensor_lists\[1\]\[0\] must be a torch.Tensor, got float 3.0"),
    "broadcast_tensors_": (lambda a, b: ops.broadcast_tensors_([a], [[b], ["x"]]),
                           r"broadcast_tensors_: dst_lists\[1\]\[0\] must be a torch.Tensor, got str 'x'"),
    "broadcast_tensors_not_nested": (lambda a, b: ops.broadcast_tensors_([a], [5]),
                                     r"broadcast_tensors_: dst_lists\[0\] must be a list of tensors, got int 5"),
    "p2p_status": (lambda a, b: ops.p2p_status([a, 1]), r"p2p_status: buffers\[1\] must be a torch.Tensor, got int 1"),
}


@pytest.mark.parametrize("native", [True, False], ids=["extension", "reference-fallback"])
@pytest.mark.parametrize("case", sorted(NON_TENSOR_CASES))
def test_wrappers_name_non_tensor_arguments(case, native, rand, monkeypatch):
    """A non-tensor argument is a TypeError naming it and saying what it is; nothing is written
    (the reference would have written list 0 before reaching a bad entry of a later list)."""
    if not native:
        monkeypatch.setattr(ops._ext, "LOADED", False)
        monkeypatch.setattr(ops._ext, "_warned", True)
    a, b = rand.randn(5), rand.randn(5)
    saved = clones([a, b])
    call, match = NON_TENSOR_CASES[case]
    with raises_matching(TypeError, match):
        call(a, b)
    for t, v in zip([a, b], saved):
        assert_same_bits(t, v, f"{case}: a refused call wrote into its arguments")


# --------------------------------------------------------------------------------------------
# broadcast on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ndst", [1, 2, 3])
@pytest.mark.parametrize("size", [1, 3, 4097])
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
def test_broadcast_cpu(dtype, size, ndst, rand):
    src = rand.randn(size, dtype=dtype)
    saved = src.clone()
    dsts = [torch.full((size,), float("nan"), dtype=dtype) for _ in range(ndst)]
    ops.broadcast_(src, dsts)
    for i, d in enumerate(dsts):
        assert_same_bits(d, src, f"dsts[{i}]")
    assert_same_bits(src, saved, "broadcast_ modified src")


def test_broadcast_tensors_cpu(rand):
    srcs = [rand.randn(*shape, dtype=dtype) for shape, dtype in MIXED_SPECS]
    saved = clones(srcs)
    dst_lists = [[torch.full(s.shape, float("nan"), dtype=s.dtype) for s in srcs] for _ in range(2)]
    ops.broadcast_tensors_(srcs, dst_lists)
    for d, lst in enumerate(dst_lists):
        for p, (t, s) in enumerate(zip(lst, srcs)):
            assert_same_bits(t, s, f"list {d} tensor {p}")
    for s, v in zip(srcs, saved):
        assert_same_bits(s, v, "broadcast_tensors_ modified a source")
    # a destination that is the source itself is fine (and stays the source)
    ops.broadcast_tensors_(srcs, [srcs])
    for s, v in zip(srcs, saved):
        assert_same_bits(s, v)
    # sources may share memory with each other: they are only read
    base = rand.randn(8)
    dsts = [torch.empty(6), torch.empty(6)]
    ops.broadcast_tensors_([base[0:6], base[2:8]], [dsts])
    assert_same_bits(dsts[0], base[0:6])
    assert_same_bits(dsts[1], base[2:8])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_broadcast_copies_flat_whatever_the_shapes(device, rand):
    # The contract is same numel and dtype: the CUDA kernel copied (2, 3) into (3, 2) flat while
    # the CPU kernel raised a broadcasting error.
    src = rand.randn(2, 3).to(device)
    dst, dst2 = torch.zeros(3, 2, device=device), torch.zeros(6, device=device)
    ops.broadcast_(src, [dst])
    ops.broadcast_tensors_([src], [[dst2]])
    assert_same_bits(dst.reshape(-1), src.reshape(-1))
    assert_same_bits(dst2, src.reshape(-1))


def test_opcheck_broadcast(rand):
    torch.library.opcheck(torch.ops.vlseq_ext.broadcast_.default, (rand.randn(10), [torch.empty(10), torch.empty(10)]))
    srcs = [rand.randn(10), rand.randn(2, 3, dtype=torch.float64)]
    torch.library.opcheck(torch.ops.vlseq_ext.broadcast_tensors_.default,
                          (srcs, [torch.empty(10), torch.empty(2, 3, dtype=torch.float64)]))


# --------------------------------------------------------------------------------------------
# p2p_status
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbuf", [1, 2, 3])
def test_p2p_status_cpu(nbuf, rand):
    assert ops.p2p_status([rand.randn(5) for _ in range(nbuf)]) == "cpu"


@pytest.mark.requires_cuda
def test_p2p_status_single_cuda_buffer(rand):
    assert ops.p2p_status([rand.randn(5, device="cuda:0")]) == "single"


@pytest.mark.requires_2gpu
def test_p2p_status_two_gpus(rand):
    assert ops.p2p_status([rand.randn(5, device="cuda:0"), rand.randn(5, device="cuda:1")]) == "p2p"


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


# --------------------------------------------------------------------------------------------
# one GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_all_reduce_single_cuda_buffer_is_unchanged(op, rand):
    b = rand.randn(4097, device="cuda:0")
    saved = b.clone()
    ops.all_reduce_([b], op)
    assert_same_bits(b, saved)


@pytest.mark.requires_cuda
def test_all_reduce_tensors_single_cuda_device(rand):
    lists = _device_lists(rand, 1, MIXED_SPECS, ["cuda:0"])
    expected = [clones(lists[0])]
    reference.all_reduce_tensors_(expected, 0.25)
    ops.all_reduce_tensors_(lists, 0.25)
    for p, (t, e) in enumerate(zip(lists[0], expected[0])):
        assert_same_bits(t, e, f"tensor {p}")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("zero_others", [True, False])
def test_reduce_tensors_several_lists_on_one_gpu(zero_others, rand):
    """Three lists on cuda:0 (e.g. the gradients of three streams): list 0 gets the sum in list
    order, with the reference's bits."""
    lists = _device_lists(rand, 3, MIXED_SPECS, ["cuda:0"] * 3)
    originals = [[t.cpu() for t in lst] for lst in lists]
    expected = [[t.cpu() for t in lst] for lst in lists]
    reference.reduce_tensors_(expected, 0.25, zero_others)
    ops.reduce_tensors_(lists, 0.25, zero_others)
    _check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], originals, expected, 0.25, zero_others,
                          where="cuda:0")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("case", ["reduce_same_tensor_in_two_lists", "all_reduce_tensors_same_tensor_twice",
                                  "broadcast_dsts_overlap", "flatten_input_overlaps_out"])
def test_overlaps_refused_on_cuda(case, rand):
    x, y = rand.randn(8, device="cuda:0"), rand.randn(8, device="cuda:0")
    saved = clones([x, y])
    calls = {
        "reduce_same_tensor_in_two_lists": (lambda: ops.reduce_tensors_([[x], [x]]),
                                            r"reduce_tensors_: tensors\[1\] \(list 1, tensor 0\) overlaps tensors\[0\]"),
        "all_reduce_tensors_same_tensor_twice": (lambda: ops.all_reduce_tensors_([[x, x]]),
                                                 r"all_reduce_tensors_: tensors\[1\] \(list 0, tensor 1\) overlaps"),
        "broadcast_dsts_overlap": (lambda: ops.broadcast_tensors_([y[0:4]], [[x[0:4]], [x[2:6]]]),
                                   r"broadcast_tensors_: dsts\[1\] overlaps dsts\[0\] in memory"),
        "flatten_input_overlaps_out": (lambda: ops.flatten([x[0:4]], out=x[2:6]),
                                       r"flatten_: tensors\[0\] overlaps out in memory"),
    }
    call, match = calls[case]
    with raises_matching(RuntimeError, match):
        call()
    for t, v in zip([x, y], saved):
        assert_same_bits(t, v, f"{case}: a refused call changed a tensor")


_STREAMED_NUMBERS_SCRIPT = textwrap.dedent(r"""
    import torch
    from vlseq_ext import ops

    lists = [[torch.zeros(3, device="cuda:0")] for _ in range(9)]
    try:
        ops.reduce_tensors_(lists)
    except RuntimeError as exc:
        print(str(exc).splitlines()[0])
""")


@pytest.mark.requires_cuda
def test_cuda_error_message_with_streamed_numbers():
    """The one TORCH_CHECK that streams integers (check_rank_count in csrc/cuda/ops_cuda.cpp) reaches
    Python whole. On the GPU machine such a message once crashed the process inside the
    extension's own copy of std::ostream (benchmarks/results/cuda-gdb-bad-input-crash.txt) or, with
    other toolchains, lost everything after the first number. Run in a subprocess, so a crash fails
    this test instead of the run."""
    proc = subprocess.run([sys.executable, "-c", _STREAMED_NUMBERS_SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"the subprocess died (returncode {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip() == "reduce_tensors_: at most 8 lists are supported, got 9", proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# two GPUs
# --------------------------------------------------------------------------------------------

GPU_SIZES = [1, 3, 4097, 1_000_003, 2**24]
DEV0, DEV1 = "cuda:0", "cuda:1"


def _two_gpu_buffers(rand, size, dtype, scale=10.0):
    return [rand.randn(size, dtype=dtype, device=DEV0, scale=scale),
            rand.randn(size, dtype=dtype, device=DEV1, scale=scale)]


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("size", GPU_SIZES)
def test_all_reduce_2gpu(size, dtype, algo, op, rand):
    bufs = _two_gpu_buffers(rand, size, dtype)
    originals = clones(bufs)
    expected = clones(bufs)
    reference.all_reduce_(expected, op)  # on the GPUs; N=2, so the mean's 1/2 is exact either way

    ops.all_reduce_(bufs, op, algo)

    for i, b in enumerate(bufs):
        assert_same_bits(b, expected[i], f"buffer {i} vs reference.all_reduce_")
    assert_same_bits(bufs[1].to(DEV0), bufs[0], "cuda:1 vs cuda:0")
    assert_near_float64(bufs[0], originals, divide=op == "mean", what="float64 reference")
    assert_near_float64(bufs[1], originals, divide=op == "mean", what="float64 reference (cuda:1)")


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
def test_all_reduce_2gpu_misaligned_and_reversed(dtype, algo, rand):
    """Buffers that start at element 1 (no vector path), given in device order 1, 0."""
    n = 100_003
    bases = [rand.randn(n + 2, dtype=dtype, device=DEV1), rand.randn(n + 2, dtype=dtype, device=DEV0)]
    saved = clones(bases)
    bufs = [b[1:1 + n] for b in bases]
    originals = clones(bufs)
    expected = clones(bufs)
    reference.all_reduce_(expected, "sum")
    ops.all_reduce_(bufs, "sum", algo)
    for i, (b, base, s) in enumerate(zip(bufs, bases, saved)):
        assert_same_bits(b, expected[i], f"buffer {i}")
        assert_same_bits(base[0], s[0], "wrote before the view")
        assert_same_bits(base[-1], s[-1], "wrote after the view")
    assert_near_float64(bufs[1], originals)


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("size", [4097, 1_000_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_all_reduce_2gpu_deterministic_across_calls_and_algos(dtype, size, rand):
    inputs = _two_gpu_buffers(rand, size, dtype)
    bufs = clones(inputs)
    ops.all_reduce_(bufs, "sum", "one_shot")
    first = [b.clone() for b in bufs]
    assert_same_bits(first[1].to(DEV0), first[0], "cuda:1 vs cuda:0")
    mismatches = [torch.zeros(100, dtype=torch.int64, device=d) for d in (DEV0, DEV1)]
    for it in range(100):
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        ops.all_reduce_(bufs, "sum")
        for d in range(2):
            with torch.cuda.device(d):
                mismatches[d][it] = (bits(bufs[d]) != bits(first[d])).sum()
    for d in range(2):
        bad = mismatches[d].nonzero()
        assert bad.numel() == 0, f"cuda:{d}: calls {bad.reshape(-1).tolist()[:10]} differ from the first call"
    for algo in ALGOS:
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        ops.all_reduce_(bufs, "sum", algo)
        for d in range(2):
            assert_same_bits(bufs[d], first[d], f"algo={algo} cuda:{d} vs one_shot")


_NO_P2P_SCRIPT = textwrap.dedent(r"""
    import sys
    import torch
    from vlseq_ext import ops

    cases = torch.load(sys.argv[1])
    out = {"status": ops.p2p_status([torch.empty(1, device="cuda:0"), torch.empty(1, device="cuda:1")])}
    for key, (x0, x1, op, algo) in cases["all_reduce"].items():
        bufs = [x0.to("cuda:0", copy=True), x1.to("cuda:1", copy=True)]
        ops.all_reduce_(bufs, op, algo)
        out[key] = [b.cpu() for b in bufs]
    lists = [[t.to(f"cuda:{d}", copy=True) for t in lst] for d, lst in enumerate(cases["lists"])]
    ops.all_reduce_tensors_(lists, cases["scale"])
    out["lists"] = [[t.cpu() for t in lst] for lst in lists]
    lists = [[t.to(f"cuda:{d}", copy=True) for t in lst] for d, lst in enumerate(cases["lists"])]
    ops.reduce_tensors_(lists, cases["scale"], True)
    out["reduced"] = [[t.cpu() for t in lst] for lst in lists]
    shared = [[t.to(dev, copy=True) for t in lst] for dev, lst in zip(["cuda:0", "cuda:1", "cuda:0"], cases["lists3"])]
    ops.reduce_tensors_(shared, cases["scale"], True)
    out["reduced_shared"] = [[t.cpu() for t in lst] for lst in shared]
    srcs = [t.to("cuda:0", copy=True) for t in cases["srcs"]]
    dsts = [torch.full_like(s, float("nan"), device="cuda:1") for s in srcs]
    ops.broadcast_tensors_(srcs, [dsts])
    out["bcast"] = [d.cpu() for d in dsts]
    torch.save(out, sys.argv[2])
""")


@pytest.mark.requires_2gpu
def test_copy_engine_fallback_gives_the_p2p_bits(rand, tmp_path):
    """VLSEQ_DISABLE_P2P=1 forces the copy-engine path. Peer access is probed once per process and
    cached, so the fallback runs in a fresh interpreter; tensors travel through torch.save."""
    cases = {"all_reduce": {}, "scale": 0.25}
    for size in [1, 3, 4097, 1_000_003]:
        for dtype in FLOATS:
            for op in REDUCE_OPS:
                x0, x1 = rand.randn(size, dtype=dtype, scale=10.0), rand.randn(size, dtype=dtype, scale=10.0)
                algo = ALGOS[(size + len(op)) % len(ALGOS)]  # any algo must degrade to copy_engine
                cases["all_reduce"][f"{size}-{dname(dtype)}-{op}"] = (x0, x1, op, algo)
    cases["lists"] = _device_lists(rand, 2, MIXED_SPECS)
    cases["lists3"] = _device_lists(rand, 3, MIXED_SPECS)
    cases["srcs"] = [rand.randn(*shape, dtype=dtype) for shape, dtype in MIXED_SPECS]
    inp, outp = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(cases, inp)
    env = dict(os.environ, VLSEQ_DISABLE_P2P="1")
    proc = subprocess.run([sys.executable, "-c", _NO_P2P_SCRIPT, str(inp), str(outp)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    got = torch.load(outp)
    assert got["status"] == "copy_engine: VLSEQ_DISABLE_P2P=1"

    assert ops.p2p_status([torch.empty(1, device=DEV0), torch.empty(1, device=DEV1)]) == "p2p"
    for key, (x0, x1, op, _) in cases["all_reduce"].items():
        for algo in [a for a in ALGOS if a != "copy_engine"]:
            bufs = [x0.to(DEV0, copy=True), x1.to(DEV1, copy=True)]
            ops.all_reduce_(bufs, op, algo)
            for d in range(2):
                assert_same_bits(got[key][d], bufs[d].cpu(), f"{key} cuda:{d}: copy engine vs P2P {algo}")
    for algo in TENSOR_ALGOS:
        lists = [[t.to(f"cuda:{d}", copy=True) for t in lst] for d, lst in enumerate(cases["lists"])]
        all_reduce_tensors(lists, cases["scale"], algo)
        for d in range(2):
            for p, t in enumerate(lists[d]):
                assert_same_bits(got["lists"][d][p], t.cpu(),
                                 f"all_reduce_tensors_ tensor {p} cuda:{d}: copy engine vs P2P {algo}")
    lists = [[t.to(f"cuda:{d}", copy=True) for t in lst] for d, lst in enumerate(cases["lists"])]
    ops.reduce_tensors_(lists, cases["scale"], True)
    for d in range(2):
        for p, t in enumerate(lists[d]):
            assert_same_bits(got["reduced"][d][p], t.cpu(), f"reduce_tensors_ tensor {p} cuda:{d}: copy engine vs P2P")
    expected = [clones(lst) for lst in cases["lists3"]]
    reference.reduce_tensors_(expected, cases["scale"], True)
    _check_reduce_tensors(got["reduced_shared"], cases["lists3"], expected, cases["scale"], True,
                          where="copy engine, lists on cuda:0, cuda:1, cuda:0")
    for p, (g, s) in enumerate(zip(got["bcast"], cases["srcs"])):
        assert_same_bits(g, s, f"broadcast_tensors_ without P2P, tensor {p}")


def _stress_patterns(rand, numel, K):
    """K known fp32 patterns per device; small integers plus 4096*k, so every sum is exact and a
    value from any other pattern (a stale read) differs at every element."""
    known = [[rand.randint(-1000, 1000, numel, device=dev) + 4096.0 * k for k in range(K)] for dev in (DEV0, DEV1)]
    sums = [known[0][k] + known[1][k].to(DEV0) for k in range(K)]
    expected = [[s for s in sums], [s.to(DEV1) for s in sums]]
    return known, expected


RACE_CASES = [("all_reduce_", a) for a in ALGOS] + [("all_reduce_tensors_", a) for a in TENSOR_ALGOS]
RACE_IDS = [f"{k}-{a}" for k, a in RACE_CASES]


def _reduce(kind, bufs, algo):
    """all_reduce_ of the flat buffers, or all_reduce_tensors_ of three views of each (shapes
    that do not split on a vector boundary)."""
    if kind == "all_reduce_":
        ops.all_reduce_(bufs, "sum", algo)
        return
    n = bufs[0].numel()
    cuts = [0, n // 3 + 1, 2 * n // 3 + 3, n]
    all_reduce_tensors([[b[cuts[i]:cuts[i + 1]] for i in range(3)] for b in bufs], 1.0, algo)


def _pattern_sequence(rand, iters, K):
    seq = [rand.py.randrange(K)]
    for _ in range(iters - 1):
        seq.append((seq[-1] + 1 + rand.py.randrange(K - 1)) % K)  # never the previous pattern
    return seq


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("kind,algo", RACE_CASES, ids=RACE_IDS)
@pytest.mark.parametrize("numel", [4097, 1 << 20])
def test_all_reduce_race_stress(numel, kind, algo, rand):
    """1000 back-to-back calls. Before each, every device's current stream sleeps a random time and
    then writes known values into its buffer, so devices reach the call at different times; the
    op must still read each peer's new values (entry ordering) and leave every buffer holding the
    sum. Results are checked on the devices, without a host sync inside the loop."""
    iters, K = 1000, 4
    known, expected = _stress_patterns(rand, numel, K)
    bufs = [torch.empty(numel, device=DEV0), torch.empty(numel, device=DEV1)]
    errors = [torch.zeros(iters, dtype=torch.int64, device=d) for d in (DEV0, DEV1)]
    seq = _pattern_sequence(rand, iters, K)
    sleeps = [[rand.py.randrange(0, 200_000) for _ in range(2)] for _ in range(iters)]
    torch.cuda.synchronize(DEV0)
    torch.cuda.synchronize(DEV1)
    for i in range(iters):
        k = seq[i]
        for d in range(2):
            with torch.cuda.device(d):
                torch.cuda._sleep(sleeps[i][d])
                bufs[d].copy_(known[d][k])
        _reduce(kind, bufs, algo)
        for d in range(2):
            with torch.cuda.device(d):
                errors[d][i] = (bufs[d] != expected[d][k]).sum()
    for d in range(2):
        torch.cuda.synchronize(d)
        bad = errors[d].nonzero().reshape(-1)
        assert bad.numel() == 0, (f"cuda:{d}: {bad.numel()} of {iters} calls gave a wrong sum; first calls "
                                  f"{bad.tolist()[:10]} with {errors[d][bad[:10]].tolist()} wrong elements")


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("kind,algo", RACE_CASES, ids=RACE_IDS)
@pytest.mark.parametrize("numel", [4097, 1 << 20])
def test_all_reduce_callers_next_kernel_does_not_corrupt_peers(numel, kind, algo, rand):
    """Right after the op returns, one device overwrites its buffer with new values while the other
    device is kept busy (a side-stream matmul competes for its SMs). The op must not let a peer
    still be reading or writing that buffer: the busy device's result stays the exact sum, and the
    overwriting device's new values are not clobbered by late peer stores."""
    iters, K = 1000, 4
    known, expected = _stress_patterns(rand, numel, K)
    fresh = [rand.randint(-1000, 1000, numel, device=dev) - 8192.0 for dev in (DEV0, DEV1)]
    bufs = [torch.empty(numel, device=DEV0), torch.empty(numel, device=DEV1)]
    errors = [torch.zeros(iters, dtype=torch.int64, device=d) for d in (DEV0, DEV1)]
    clobbered = [torch.zeros(iters, dtype=torch.int64, device=d) for d in (DEV0, DEV1)]
    side = [torch.cuda.Stream(DEV0), torch.cuda.Stream(DEV1)]
    mats = [torch.randn(1024, 1024, device=dev) for dev in (DEV0, DEV1)]
    seq = _pattern_sequence(rand, iters, K)
    sleeps = [[rand.py.randrange(0, 200_000) for _ in range(2)] for _ in range(iters)]
    torch.cuda.synchronize(DEV0)
    torch.cuda.synchronize(DEV1)
    for i in range(iters):
        k = seq[i]
        w = i % 2          # overwrites its buffer right after the op
        c = 1 - w          # is busy, then checks its result
        for d in range(2):
            with torch.cuda.device(d):
                torch.cuda._sleep(sleeps[i][d])
                bufs[d].copy_(known[d][k])
        with torch.cuda.device(c), torch.cuda.stream(side[c]):
            for _ in range(2):
                torch.mm(mats[c], mats[c])
        _reduce(kind, bufs, algo)
        with torch.cuda.device(w):
            bufs[w].copy_(fresh[w])
        with torch.cuda.device(c):
            errors[c][i] = (bufs[c] != expected[c][k]).sum()
        with torch.cuda.device(w):
            torch.cuda._sleep(100_000)  # give a late peer store time to land before the check
            clobbered[w][i] = (bufs[w] != fresh[w]).sum()
    for d in range(2):
        torch.cuda.synchronize(d)
    for d in range(2):
        bad = errors[d].nonzero().reshape(-1)
        assert bad.numel() == 0, f"cuda:{d}: calls {bad.tolist()[:10]} gave a wrong sum after the peer's next kernel"
        bad = clobbered[d].nonzero().reshape(-1)
        assert bad.numel() == 0, f"cuda:{d}: calls {bad.tolist()[:10]}: a peer wrote into the buffer after the op returned"


def _specs(count):
    """MIXED_SPECS, or `count` tensors cycling through them. Each dtype's segment table travels
    in the kernel's parameters up to 16 rows and through device memory beyond: 100 tensors give
    44 fp32 rows."""
    return list(MIXED_SPECS) if not count else [MIXED_SPECS[i % len(MIXED_SPECS)] for i in range(count)]


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("algo", TENSOR_ALGOS)
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("count", [0, 100], ids=["mixed", "100-tensors"])
def test_all_reduce_tensors_2gpu(count, scale, algo, rand):
    specs = _specs(count)
    lists = _device_lists(rand, 2, specs, [DEV0, DEV1])
    originals = [clones(lst) for lst in lists]
    expected = [[t.to("cpu", copy=True) for t in lst] for lst in lists]
    reference.all_reduce_tensors_(expected, scale)
    all_reduce_tensors(lists, scale, algo)
    for p in range(len(specs)):
        for d in range(2):
            assert_same_bits(lists[d][p].cpu(), expected[d][p], f"tensor {p} of cuda:{d} vs reference")
        assert_same_bits(lists[1][p].to(DEV0), lists[0][p], f"tensor {p}: cuda:1 vs cuda:0")
        if lists[0][p].numel():
            assert_near_float64(lists[0][p], [originals[d][p] for d in range(2)], scale=scale, what=f"tensor {p}")


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("zero_others", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("count", [0, 100], ids=["mixed", "100-tensors"])
def test_reduce_tensors_2gpu(count, scale, zero_others, rand):
    specs = _specs(count)
    lists = _device_lists(rand, 2, specs, [DEV0, DEV1])
    originals = [clones(lst) for lst in lists]
    expected = [[t.to("cpu", copy=True) for t in lst] for lst in lists]
    reference.reduce_tensors_(expected, scale, zero_others)
    ops.reduce_tensors_(lists, scale, zero_others)
    _check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], [[t.cpu() for t in lst] for lst in originals],
                          expected, scale, zero_others, where="cuda:1")


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("zero_others", [True, False])
@pytest.mark.parametrize("count", [0, 100], ids=["mixed", "100-tensors"])
@pytest.mark.parametrize("layout", ["0,0,1", "0,1,0", "1,0,0"])
def test_reduce_tensors_lists_sharing_a_gpu(layout, count, zero_others, rand):
    """Two lists on one GPU and one on the other, in every order: events go once per distinct
    device, the kernel reads every list, and list 0 gets the reference's bits (sum in list order)."""
    specs = _specs(count)
    devices = [f"cuda:{d}" for d in layout.split(",")]
    lists = _device_lists(rand, 3, specs, devices)
    originals = [[t.cpu() for t in lst] for lst in lists]
    expected = [[t.cpu() for t in lst] for lst in lists]
    reference.reduce_tensors_(expected, 0.25, zero_others)
    ops.reduce_tensors_(lists, 0.25, zero_others)
    _check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], originals, expected, 0.25, zero_others,
                          where=layout)


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("size", [1, 3, 4097, 1_000_003])
@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_2gpu(root, dtype, size, rand):
    src_dev, dst_dev = f"cuda:{root}", f"cuda:{1 - root}"
    src = rand.randn(size + 1, dtype=dtype, device=src_dev)[1:]  # misaligned source
    saved = src.clone()
    dst = torch.full((size,), float("nan"), dtype=dtype, device=dst_dev)
    same_dev = torch.full((size,), float("nan"), dtype=dtype, device=src_dev)
    ops.broadcast_(src, [dst, same_dev])
    assert_same_bits(dst, src, "peer destination")
    assert_same_bits(same_dev, src, "destination on the source's device")
    assert_same_bits(src, saved, "broadcast_ modified src")


@pytest.mark.requires_2gpu
@pytest.mark.parametrize("count", [0, 100], ids=["mixed", "100-tensors"])
def test_broadcast_tensors_2gpu(count, rand):
    specs = _specs(count)
    srcs = [rand.randn(*shape, dtype=dtype, device=DEV0) for shape, dtype in specs]
    saved = clones(srcs)
    dst_lists = [[torch.full(s.shape, float("nan"), dtype=s.dtype, device=dev) for s in srcs] for dev in (DEV1, DEV0)]
    ops.broadcast_tensors_(srcs, dst_lists)
    for d, lst in enumerate(dst_lists):
        for p, (t, s) in enumerate(zip(lst, srcs)):
            assert_same_bits(t, s, f"list {d} tensor {p}")
    for s, v in zip(srcs, saved):
        assert_same_bits(s, v, "broadcast_tensors_ modified a source")


@pytest.mark.requires_2gpu
def test_broadcast_then_source_overwritten(rand):
    """The source's stream must wait for the peers' reads: overwriting src right after the call
    (on its current stream) must not leak into the destination, even when the destination's
    stream is busy first."""
    n = 1 << 20
    bad = torch.zeros(200, dtype=torch.int64, device=DEV1)
    for i in range(200):
        src = rand.randint(-1000, 1000, n, device=DEV0)
        saved = src.clone()
        dst = torch.empty(n, device=DEV1)
        with torch.cuda.device(1):
            torch.cuda._sleep(rand.py.randrange(0, 200_000))
        ops.broadcast_(src, [dst])
        with torch.cuda.device(0):
            src.fill_(1e9)
        expected = saved.to(DEV1)
        with torch.cuda.device(1):
            bad[i] = (dst != expected).sum()
    torch.cuda.synchronize(DEV1)
    assert bad.sum().item() == 0, f"iterations {bad.nonzero().reshape(-1).tolist()[:10]} read a wrong/overwritten source"
