"""What the reduction tests share (test_reduce*.py): the dtypes and algorithms swept, and the float64
oracle with its error bound.

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
import re

import torch

from vlseq_ext import ops

from helpers import assert_same_bits, bits

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


MIXED_SPECS = [
    ((3, 4), torch.float32), ((7,), torch.bfloat16), ((1,), torch.float16), ((5, 2, 3), torch.float64),
    ((0,), torch.float32), ((4097,), torch.float32), ((70_001,), torch.bfloat16), ((), torch.float32),
    ((33, 3), torch.float16),
]


def device_lists(rand, ndev, specs, devices=None):
    devices = devices or ["cpu"] * ndev
    return [[rand.randn(*shape, dtype=dtype, device=devices[d]) for shape, dtype in specs] for d in range(ndev)]


def check_reduce_tensors(lists, originals, expected, scale, zero_others, where="cpu"):
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


def assert_broadcast(srcs, saved, dst_lists) -> None:
    """Every destination list holds the sources' bits, and the sources are as `saved`."""
    for d, lst in enumerate(dst_lists):
        for p, (t, s) in enumerate(zip(lst, srcs)):
            assert_same_bits(t, s, f"list {d} tensor {p}")
    for s, v in zip(srcs, saved):
        assert_same_bits(s, v, "broadcast_tensors_ modified a source")
