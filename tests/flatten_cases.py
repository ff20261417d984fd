"""What the flatten tests share (test_flatten*.py): the dtypes, devices and shapes swept, and the
bit-exact comparison (see test_flatten.py)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPE_PAIRS = list(itertools.product(FLOATS, FLOATS))  # (tensor dtype, flat dtype)
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in DTYPE_PAIRS]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]

# Mixed shapes in one list: odd sizes 1, 3, 7, 4097, a 0-dim tensor, a 3-d one, a 2-d one.
SHAPES = [(1,), (3,), (7,), (4097,), (2, 3, 5), (), (33, 65)]


def numel_of(shape) -> int:
    return math.prod(shape)


def poisoned(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full((n,), float("nan"), dtype=dtype, device=device)


def exact(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    # rtol=0, atol=0: same conversion rule on both sides, see the module docstring.
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{msg}\n{m}" if msg else m)
