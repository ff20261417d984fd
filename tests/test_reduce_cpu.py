"""all_reduce_, broadcast_, all_reduce_tensors_, reduce_tensors_, broadcast_tensors_ and p2p_status on
CPU: several distinct buffers stand in for several devices. The CPU kernels sum in the same fixed
order 0..N-1 with the same widened accumulation as the CUDA kernels, so CI checks the semantics the
GPUs must meet (test_reduce_gpu.py); against the two oracles of reduce_oracles.py."""
from __future__ import annotations

import math

import pytest
import torch

from vlseq_ext import ops, reference

from helpers import assert_same_bits, bits, dname, raises_matching
from reduce_oracles import (ALGOS, all_reduce_tensors, assert_broadcast, assert_near_float64,
                            check_reduce_tensors, clones, CORE_ALGOS, device_lists, FLOATS, MIXED_SPECS,
                            REDUCE_OPS, TENSOR_ALGOS, TENSORS_TAKE_ALGO)

pytestmark = pytest.mark.usefixtures("compiled_ops")

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


@pytest.mark.usefixtures("several_threads")  # the kernels' threaded split (at::parallel_for)
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

@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_all_reduce_tensors_cpu(ndev, scale, rand):
    lists = device_lists(rand, ndev, MIXED_SPECS)
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
    lists = device_lists(rand, 3, MIXED_SPECS)
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
    lists = device_lists(rand, 3, specs)
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
    lists = device_lists(rand, 2, [((3, 4), torch.float32), ((5,), torch.bfloat16)])
    torch.library.opcheck(torch.ops.vlseq_ext.all_reduce_tensors_.default,
                          ([t for lst in lists for t in lst], 2, 0.5))


# --------------------------------------------------------------------------------------------
# reduce_tensors_ (the merge onto device list 0) on CPU
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_others", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("ndev", [1, 2, 3])
def test_reduce_tensors_cpu(ndev, scale, zero_others, rand):
    lists = device_lists(rand, ndev, MIXED_SPECS)
    originals = [clones(lst) for lst in lists]
    expected = [clones(lst) for lst in lists]
    reference.reduce_tensors_(expected, scale, zero_others)
    ops.reduce_tensors_(lists, scale, zero_others)
    check_reduce_tensors(lists, originals, expected, scale, zero_others)


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
    check_reduce_tensors(views, originals, expected, 0.5, zero_others)


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
    assert_broadcast(srcs, saved, dst_lists)
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


