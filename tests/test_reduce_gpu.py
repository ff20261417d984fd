"""The reductions and broadcasts on one GPU and on two (requires_2gpu: a 2-GPU machine), against the
two oracles of reduce_oracles.py, including races between the GPUs and the copy-engine fallback."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vlseq_ext import ops, reference

from helpers import assert_same_bits, bits, dname, raises_matching
from reduce_oracles import (ALGOS, all_reduce_tensors, assert_broadcast, assert_near_float64,
                            check_reduce_tensors, clones, device_lists, FLOATS, MIXED_SPECS, REDUCE_OPS,
                            TENSOR_ALGOS)

pytestmark = pytest.mark.usefixtures("compiled_ops")

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
    lists = device_lists(rand, 1, MIXED_SPECS, ["cuda:0"])
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
    lists = device_lists(rand, 3, MIXED_SPECS, ["cuda:0"] * 3)
    originals = [[t.cpu() for t in lst] for lst in lists]
    expected = [[t.cpu() for t in lst] for lst in lists]
    reference.reduce_tensors_(expected, 0.25, zero_others)
    ops.reduce_tensors_(lists, 0.25, zero_others)
    check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], originals, expected, 0.25, zero_others,
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
    cases["lists"] = device_lists(rand, 2, MIXED_SPECS)
    cases["lists3"] = device_lists(rand, 3, MIXED_SPECS)
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
    check_reduce_tensors(got["reduced_shared"], cases["lists3"], expected, cases["scale"], True,
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


def _two_gpu_lists(rand, count):
    """(specs, one list per GPU, their copies, the copies on the CPU for the reference)."""
    specs = _specs(count)
    lists = device_lists(rand, 2, specs, [DEV0, DEV1])
    return specs, lists, [clones(lst) for lst in lists], [[t.to("cpu", copy=True) for t in lst] for lst in lists]

@pytest.mark.requires_2gpu
@pytest.mark.parametrize("algo", TENSOR_ALGOS)
@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("count", [0, 100], ids=["mixed", "100-tensors"])
def test_all_reduce_tensors_2gpu(count, scale, algo, rand):
    specs, lists, originals, expected = _two_gpu_lists(rand, count)
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
    specs, lists, originals, expected = _two_gpu_lists(rand, count)
    reference.reduce_tensors_(expected, scale, zero_others)
    ops.reduce_tensors_(lists, scale, zero_others)
    check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], [[t.cpu() for t in lst] for lst in originals],
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
    lists = device_lists(rand, 3, specs, devices)
    originals = [[t.cpu() for t in lst] for lst in lists]
    expected = [[t.cpu() for t in lst] for lst in lists]
    reference.reduce_tensors_(expected, 0.25, zero_others)
    ops.reduce_tensors_(lists, 0.25, zero_others)
    check_reduce_tensors([[t.cpu() for t in lst] for lst in lists], originals, expected, 0.25, zero_others,
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
    assert_broadcast(srcs, saved, dst_lists)


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
