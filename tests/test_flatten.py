"""flatten / unflatten_ against vlseq_ext.reference, on CPU and (requires_cuda) CUDA.

Exactness: the kernels (csrc/include/vlseq/dtypes.h) and reference.py use the same conversion rule,
out = To(OpMath(x) * scale) with OpMath = float64 if either side is float64 else float32, and an
IEEE multiply followed by one round-to-nearest-even conversion has exactly one correct answer.
So every comparison with the reference is bit-exact: assert_close(..., rtol=0, atol=0), which
also rejects a NaN left over from the poisoned output.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from vlseq_ext import ops, reference

from helpers import assert_same_bits, bits, dname
from vlseq_ext.models import SeqModel
from flatten_cases import DEVICES, DTYPE_PAIRS, FLOATS, PAIR_IDS, SHAPES, exact, numel_of, poisoned

pytestmark = pytest.mark.usefixtures("compiled_ops")


@pytest.mark.parametrize("scale", [1.0, -0.37])
@pytest.mark.parametrize("tensor_dtype,flat_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_matches_reference(device, tensor_dtype, flat_dtype, scale, rand):
    tensors = [rand.randn(*s, dtype=tensor_dtype, device=device) for s in SHAPES]
    before = [t.clone() for t in tensors]
    numels = [t.numel() for t in tensors]
    n, tail = sum(numels), 37
    out = poisoned(n + tail, flat_dtype, device)
    expected = poisoned(n + tail, flat_dtype, device)

    ret = ops.flatten(tensors, out=out, scale=scale)
    reference.flatten_(tensors, numels, expected, scale)

    assert ret is out
    assert not out[:n].isnan().any(), "flatten left poisoned (unwritten) elements"
    exact(out[:n], expected[:n])
    assert out[n:].isnan().all(), "flatten wrote past sum(numels)"
    for t, b in zip(tensors, before):
        assert_same_bits(t, b, "flatten modified an input")


@pytest.mark.parametrize("scale", [1.0, 0.125, -3.0])
@pytest.mark.parametrize("tensor_dtype,flat_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_unflatten_matches_reference(device, tensor_dtype, flat_dtype, scale, rand):
    n = sum(numel_of(s) for s in SHAPES)
    flat = rand.randn(n + 11, dtype=flat_dtype, device=device)  # longer than needed: tail ignored
    flat_before = flat.clone()
    dests = [torch.full(s, float("nan"), dtype=tensor_dtype, device=device) for s in SHAPES]
    expected = [d.clone() for d in dests]

    ops.unflatten_(flat, dests, scale)
    reference.unflatten_(flat, expected, scale)

    for i, (d, e) in enumerate(zip(dests, expected)):
        assert not d.isnan().any(), f"unflatten_ left poisoned elements in tensors[{i}]"
        exact(d, e, f"tensors[{i}]")
    assert_same_bits(flat, flat_before, "unflatten_ modified flat")


@pytest.mark.usefixtures("several_threads")  # the kernels' threaded split (at::parallel_for)
@pytest.mark.parametrize(
    "tensor_dtype,flat_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
     (torch.float64, torch.float16)],
    ids=["f32-f32", "bf16-f32", "f32-bf16", "f64-f16"])
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_unflatten_large(device, tensor_dtype, flat_dtype, rand):
    shapes = [(1_000_003,), (3,), (4097,)]
    tensors = [rand.randn(*s, dtype=tensor_dtype, device=device) for s in shapes]
    numels = [t.numel() for t in tensors]
    n = sum(numels)
    out = poisoned(n + 5, flat_dtype, device)
    expected = poisoned(n + 5, flat_dtype, device)
    ops.flatten(tensors, out=out, scale=0.5)
    reference.flatten_(tensors, numels, expected, 0.5)
    assert not out[:n].isnan().any()
    exact(out[:n], expected[:n])
    assert out[n:].isnan().all()

    dests = [torch.full_like(t, float("nan")) for t in tensors]
    ref_dests = [d.clone() for d in dests]
    ops.unflatten_(out, dests, 2.0)
    reference.unflatten_(out, ref_dests, 2.0)
    for d, e in zip(dests, ref_dests):
        assert not d.isnan().any()
        exact(d, e)


@pytest.mark.parametrize("scale", [1.0, -2.0])
@pytest.mark.parametrize("flat_dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("device", DEVICES)
def test_flatten_none_entries_are_zeros(device, flat_dtype, scale, rand):
    a = rand.randn(4, 5, device=device)
    b = rand.randn(4097, dtype=torch.bfloat16, device=device)
    tensors = [None, a, None, b, None, None]
    numels = [5, a.numel(), 1, b.numel(), 4097, 0]
    n = sum(numels)
    out = poisoned(n + 3, flat_dtype, device)
    expected = poisoned(n + 3, flat_dtype, device)

    ops.flatten(tensors, out=out, scale=scale, numels=numels)
    reference.flatten_(tensors, numels, expected, scale)

    assert not out[:n].isnan().any()
    exact(out[:n], expected[:n])
    assert out[n:].isnan().all()
    offsets = [0] + list(itertools.accumulate(numels))
    for i, t in enumerate(tensors):
        seg = out[offsets[i]:offsets[i + 1]]
        if t is None:
            # +0.0 exactly (a scaled garbage value or -0.0 would be a different bit pattern)
            assert (bits(seg) == 0).all(), f"slice of None entry {i} is not all +0.0"
        else:
            assert (seg != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_all_none_writes_zeros(device):
    out = poisoned(12, torch.float32, device)
    ops.flatten([None, None], out=out, numels=[3, 7])
    assert (bits(out[:10]) == 0).all()
    assert out[10:].isnan().all()


@pytest.mark.parametrize("tensor_dtype,flat_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_misaligned_views(device, tensor_dtype, flat_dtype, rand):
    """Inputs, out, flat and destinations are slices starting at element 1 of larger tensors,
    so none of them is 16-byte aligned (the vector path must not be taken for them)."""
    sizes = [1, 3, 7, 4097, 1000]
    bases = [rand.randn(s + 2, dtype=tensor_dtype, device=device) for s in sizes]
    tensors = [base[1:1 + s] for base, s in zip(bases, sizes)]
    tensors.append(rand.randn(64, dtype=tensor_dtype, device=device))  # one aligned in the same list
    numels = [t.numel() for t in tensors]
    n = sum(numels)

    big_out = poisoned(n + 9, flat_dtype, device)
    out = big_out[1:1 + n]
    assert out.data_ptr() % 16 != 0
    expected = poisoned(n, flat_dtype, device)
    ops.flatten(tensors, out=out, scale=0.75)
    reference.flatten_(tensors, numels, expected, 0.75)
    exact(out, expected)
    assert big_out[0].isnan() and big_out[1 + n:].isnan().all(), "flatten wrote outside the out view"

    # unflatten_ from a misaligned flat into misaligned destinations
    flat_base = rand.randn(n + 3, dtype=flat_dtype, device=device)
    flat = flat_base[1:1 + n]
    dest_bases = [torch.full((k + 2,), float("nan"), dtype=tensor_dtype, device=device) for k in numels]
    dests = [db[1:1 + k] for db, k in zip(dest_bases, numels)]
    ref = [torch.full((k,), float("nan"), dtype=tensor_dtype, device=device) for k in numels]
    ops.unflatten_(flat, dests, -1.5)
    reference.unflatten_(flat, ref, -1.5)
    for i, (d, e, db) in enumerate(zip(dests, ref, dest_bases)):
        exact(d, e, f"tensors[{i}]")
        assert db[0].isnan() and db[-1].isnan(), f"unflatten_ wrote outside destination view {i}"


def _strided_inputs(rand, dtype, device):
    return [
        rand.randn(5, 7, dtype=dtype, device=device).t(),                      # transposed
        rand.randn(3, 4, 5, dtype=dtype, device=device).permute(2, 0, 1),      # permuted
        rand.randn(6, 8, dtype=dtype, device=device)[:, ::2],                  # step slice
        rand.randn(4097, 2, dtype=dtype, device=device)[:, 1],                 # strided, misaligned
        rand.randn(1, 3, dtype=dtype, device=device).expand(4, 3),             # stride 0
    ]


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=dname)
@pytest.mark.parametrize("tensor_dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_inputs(device, tensor_dtype, flat_dtype, rand):
    tensors = _strided_inputs(rand, tensor_dtype, device)
    assert not any(t.is_contiguous() for t in tensors)
    numels = [t.numel() for t in tensors]
    n = sum(numels)
    out = poisoned(n, flat_dtype, device)
    expected = poisoned(n, flat_dtype, device)
    ops.flatten(tensors, out=out, scale=3.0)
    reference.flatten_(tensors, numels, expected, 3.0)
    exact(out, expected)
    # Independent of the reference: slice i is tensors[i] in logical (row-major) order.
    if tensor_dtype == flat_dtype:
        out2 = poisoned(n, flat_dtype, device)
        ops.flatten(tensors, out=out2)
        exact(out2, torch.cat([t.reshape(-1) for t in tensors]))


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.float16], ids=dname)
@pytest.mark.parametrize("tensor_dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_unflatten_destinations(device, tensor_dtype, flat_dtype, rand):
    bases = [
        rand.randn(7, 5, dtype=tensor_dtype, device=device),
        rand.randn(6, 8, dtype=tensor_dtype, device=device),
        rand.randn(4, 3, 5, dtype=tensor_dtype, device=device),
        rand.randn(4097, 2, dtype=tensor_dtype, device=device),
    ]
    saved = [b.clone() for b in bases]
    dests = [bases[0].t(), bases[1][:, ::2], bases[2].permute(2, 0, 1), bases[3][:, 1]]
    assert not any(d.is_contiguous() for d in dests)
    n = sum(d.numel() for d in dests)
    flat = rand.randn(n, dtype=flat_dtype, device=device)
    ref = [torch.empty(d.shape, dtype=tensor_dtype, device=device) for d in dests]

    ops.unflatten_(flat, dests, 0.5)
    reference.unflatten_(flat, ref, 0.5)
    for i, (d, e) in enumerate(zip(dests, ref)):
        exact(d, e, f"tensors[{i}]")
    # Elements of the bases outside the strided views keep their values.
    assert_same_bits(bases[1][:, 1::2], saved[1][:, 1::2], "unflatten_ wrote outside a strided view")
    assert_same_bits(bases[3][:, 0], saved[3][:, 0], "unflatten_ wrote outside a strided view")
    # Independent of the reference: logical row-major order, same dtype, scale 1.
    if tensor_dtype == flat_dtype:
        ops.unflatten_(flat, dests, 1.0)
        exact(torch.cat([d.reshape(-1) for d in dests]), flat)


@pytest.mark.parametrize("dtype", FLOATS, ids=dname)
@pytest.mark.parametrize("device", DEVICES)
def test_roundtrip(device, dtype, rand):
    tensors = [rand.randn(*s, dtype=dtype, device=device) for s in SHAPES]
    flat = ops.flatten(tensors)
    assert flat.dtype == dtype and flat.device == tensors[0].device
    assert flat.numel() == sum(t.numel() for t in tensors)
    back = [torch.full_like(t, float("nan")) for t in tensors]
    ops.unflatten_(flat, back)
    for t, b in zip(tensors, back):
        assert_same_bits(b, t, "flatten -> unflatten_ roundtrip")


@pytest.mark.parametrize("device", DEVICES)
def test_flatten_allocates_when_out_is_omitted(device, rand):
    a = rand.randn(3, 4, dtype=torch.bfloat16, device=device)
    b = rand.randn(5, device=device)
    flat = ops.flatten([None, a, b], numels=[2, 12, 5])
    assert flat.dtype == torch.bfloat16 and flat.shape == (19,) and flat.device == a.device
    exact(flat[:2], torch.zeros(2, dtype=torch.bfloat16, device=device))
    exact(flat[2:14], a.reshape(-1))
    exact(flat[14:], b.to(torch.bfloat16))
    flat64 = ops.flatten([a, b], dtype=torch.float64, scale=0.5)
    assert flat64.dtype == torch.float64
    exact(flat64, torch.cat([a.reshape(-1).double(), b.double()]) * 0.5)


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_flatten(device, rand):
    a = rand.randn(3, 4, device=device)
    b = rand.randn(5, dtype=torch.float16, device=device)
    c = rand.randn(2, 2, dtype=torch.float64, device=device).t()
    samples = [
        ([a, None, b], [12, 2, 5], torch.empty(20, device=device), 0.5),
        ([a, b, c], [12, 5, 4], torch.empty(21, dtype=torch.bfloat16, device=device), 1.0),
        ([None], [7], torch.empty(7, dtype=torch.float64, device=device), 1.0),
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.vlseq_ext.flatten_.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_unflatten(device, rand):
    flat = rand.randn(40, device=device)
    samples = [
        (flat, [torch.empty(3, 4, device=device), torch.empty(5, dtype=torch.float16, device=device)], 0.5),
        (flat.to(torch.bfloat16), [torch.empty(4, 2, dtype=torch.float64, device=device).t()], 1.0),
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.vlseq_ext.unflatten_.default, args)


# --------------------------------------------------------------------------------------------
# GPU only
# --------------------------------------------------------------------------------------------


def _seed_grads(rand, device):
    """The seed model's 6 gradients after one backward on a random sample."""
    model = SeqModel().to(device)
    x = rand.randn(57, 36, device=device)
    y = rand.randn(1, 1, device=device)
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert len(grads) == 6 and all(g is not None and g.is_contiguous() for g in grads)
    return grads


@pytest.mark.requires_cuda
def test_flatten_seed_grads_is_one_kernel(rand):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda", 0)
    grads = _seed_grads(rand, dev)
    out = torch.empty(sum(g.numel() for g in grads), device=dev)
    ops.flatten(grads, out=out)  # warm-up: the first call caches the SM count
    torch.cuda.synchronize(dev)
    out.fill_(float("nan"))
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.flatten(grads, out=out)
        torch.cuda.synchronize(dev)
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kinds = [getattr(e, "activity_type", None) for e in gpu]
    names = [(e.name, k) for e, k in zip(gpu, kinds)]
    kernels = [e for e, k in zip(gpu, kinds)
               if (k == "kernel" if k else not e.name.lower().startswith(("memcpy", "memset")))]
    assert len(kernels) == 1, f"expected one CUDA kernel for the seed model's 6 grads, got {names}"
    assert "flatten" in kernels[0].name, names
    assert len(gpu) == 1, f"flatten issued GPU work besides its kernel: {names}"
    expected = torch.cat([g.reshape(-1) for g in grads])
    exact(out, expected)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16], ids=dname)
def test_flatten_more_tensors_than_the_inline_table(flat_dtype, rand):
    """300 tensors of mixed dtypes: one launch per dtype, each with ~75 rows, more than the 48
    that travel by value, so the table goes through device memory; still the reference's bits."""
    dev = torch.device("cuda", 0)
    tensors, numels = [], []
    for i in range(300):
        k = rand.py.randint(0, 5000) if i % 17 else rand.py.randint(5000, 70000)
        dtype = FLOATS[rand.py.randrange(4)]
        t = None if i % 23 == 5 else rand.randn(k, dtype=dtype, device=dev)
        tensors.append(t)
        numels.append(k)
    n = sum(numels)
    out = poisoned(n + 1, flat_dtype, dev)
    expected = poisoned(n + 1, flat_dtype, dev)
    ops.flatten(tensors, out=out, scale=0.25, numels=numels)
    reference.flatten_(tensors, numels, expected, 0.25)
    assert not out[:n].isnan().any()
    exact(out[:n], expected[:n])
    assert out[n:].isnan().all()

    present = [t for t in tensors if t is not None]
    m = sum(t.numel() for t in present)
    dests = [torch.full_like(t, float("nan")) for t in present]
    ref = [d.clone() for d in dests]
    ops.unflatten_(out[:m], dests, 4.0)
    reference.unflatten_(out[:m], ref, 4.0)
    for i, (d, e) in enumerate(zip(dests, ref)):
        exact(d, e, f"tensors[{i}]")


@pytest.mark.requires_cuda
def test_device_tables_are_reused_only_for_the_same_list(rand):
    """Device-memory tables are cached by content: the same list again (new values), another list
    of the same sizes, the first again, and the first from another stream must each be right."""
    dev = torch.device("cuda", 0)
    sizes = [rand.py.randint(1, 3000) for _ in range(60)]
    a = [rand.randn(k, device=dev) for k in sizes]
    b = [rand.randn(k, device=dev) for k in sizes]
    out = torch.empty(sum(sizes), device=dev)

    def check(tensors, what):
        out.fill_(float("nan"))
        ops.flatten(tensors, out=out, scale=0.5)
        exact(out, torch.cat([t.reshape(-1) for t in tensors]) * 0.5, what)
        back = [torch.full_like(t, float("nan")) for t in tensors]
        ops.unflatten_(out, back, 2.0)
        for i, (x, t) in enumerate(zip(back, tensors)):
            exact(x, t, f"{what}: unflatten tensors[{i}]")

    check(a, "first call")
    for t in a:
        t.normal_()
    check(a, "same list, new values")
    check(b, "another list of the same sizes")
    check(a, "first list again")
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream lags: its kernels must still find a complete table
        for t in a:
            t.mul_(3.0)
        check(a, "first list from a side stream")
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    # a new list whose table is uploaded on a lagging side stream, then used at once on the
    # main stream: the main stream must wait for the upload
    c = [rand.randn(k + 1, device=dev) for k in sizes]
    out_c = torch.empty(sum(k + 1 for k in sizes), device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        ops.flatten(c, out=torch.empty_like(out_c))
    ops.flatten(c, out=out_c)
    exact(out_c, torch.cat([t.reshape(-1) for t in c]), "table uploaded on a lagging side stream")
    torch.cuda.synchronize(dev)


@pytest.mark.requires_cuda
def test_bf16_grads_into_fp32_buffer(rand):
    dev = torch.device("cuda", 0)
    # bf16 grads as a bf16 replica (or autocast) would hold them; cuDNN's LSTM is not asked to
    # run in bf16 here, only the gradient tensors' dtype matters to flatten.
    grads = [g.to(torch.bfloat16) for g in _seed_grads(rand, dev)]
    n = sum(g.numel() for g in grads)
    out = poisoned(n + 8, torch.float32, dev)
    ops.flatten(grads, out=out)
    exact(out[:n], torch.cat([g.reshape(-1).float() for g in grads]))  # bf16 -> fp32 is exact
    assert out[n:].isnan().all()
    expected = poisoned(n + 8, torch.float32, dev)
    reference.flatten_(grads, [g.numel() for g in grads], expected, 1.0 / 3.0)
    ops.flatten(grads, out=out, scale=1.0 / 3.0)
    exact(out[:n], expected[:n])
    # and back into the bf16 grads, scaled
    back = [torch.full_like(g, float("nan")) for g in grads]
    ref = [b.clone() for b in back]
    ops.unflatten_(out, back, 3.0)
    reference.unflatten_(out, ref, 3.0)
    for b, r in zip(back, ref):
        exact(b, r)


@pytest.mark.requires_cuda
def test_flatten_and_unflatten_run_on_the_current_stream(rand):
    """The input is written on a side stream after a long sleep; a kernel queued on any stream
    other than the current one would read it too early."""
    dev = torch.device("cuda", 0)
    x = rand.randn(100_003, device=dev)
    new = rand.randn(100_003, device=dev)
    out = poisoned(100_003, torch.float32, dev)
    back = torch.full_like(x, float("nan"))
    torch.cuda.synchronize(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.copy_(new)
        ops.flatten([x], out=out)
        torch.cuda._sleep(20_000_000)
        out.mul_(2.0)
        ops.unflatten_(out, [back], 0.5)
    side.synchronize()
    exact(out, new * 2.0)
    exact(back, new)


@pytest.mark.requires_2gpu
def test_flatten_on_a_device_other_than_the_current_one(rand):
    dev1 = torch.device("cuda", 1)
    tensors = [rand.randn(*s, dtype=torch.bfloat16, device=dev1) for s in SHAPES]
    numels = [t.numel() for t in tensors]
    with torch.cuda.device(0):
        out = poisoned(sum(numels), torch.float32, dev1)
        ops.flatten(tensors, out=out, scale=2.0)
        dests = [torch.full_like(t, float("nan")) for t in tensors]
        ops.unflatten_(out, dests, 0.5)
    expected = poisoned(sum(numels), torch.float32, dev1)
    reference.flatten_(tensors, numels, expected, 2.0)
    exact(out, expected)
    for d, t in zip(dests, tensors):
        exact(d, t)
