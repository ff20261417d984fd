"""Helpers shared by the tests: bit-exact comparisons, message-checking raises, work done once per session."""
from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Dict

import pytest
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, for bit-exact comparisons (-0.0 != +0.0, NaN == NaN)."""
    itype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(itype)


def float64_reference_grads(model: torch.nn.Module, xs, ys, reduction: str = "sum") -> Dict[str, torch.Tensor]:
    """Every parameter's gradient, by name, of the per-sample MSE losses summed (or averaged) over
    (xs, ys), from a float64 copy of `model` on the CPU that runs one sample at a time on torch's own
    RNN modules: what every training path must equal."""
    import vlseq_ext.nn as vnn
    ref = copy.deepcopy(model).double().cpu()
    vnn.use_kernels(ref, "cudnn")
    for x, y in zip(xs, ys):
        loss = torch.nn.MSELoss()(ref(x.double()), y.double().reshape(1, 1))
        (loss / (len(xs) if reduction == "mean" else 1)).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    a, e = actual.reshape(-1), expected.to(actual.device).reshape(-1)
    diff = (bits(a) != bits(e)).nonzero().reshape(-1)
    if diff.numel():
        k = diff[0].item()
        raise AssertionError(f"{what}: {diff.numel()} of {a.numel()} elements differ, first at flat index {k}: "
                             f"{a[k].item()!r} vs {e[k].item()!r}")


def dname(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


class raises_matching:
    """pytest.raises(exc, match=...), except that a message that does not match is shown cut to 300
    characters (the dispatcher's "no tensor arguments" message runs to several kilobytes)."""

    def __init__(self, exc, match: str) -> None:
        self.exc, self.match = exc, match

    def __enter__(self) -> "raises_matching":
        return self

    def __exit__(self, etype, value, tb) -> bool:
        if etype is None:
            pytest.fail(f"DID NOT RAISE {self.exc}")
        if not issubclass(etype, self.exc):
            return False
        msg = str(value)
        if not re.search(self.match, msg):
            raise AssertionError(f"{etype.__name__} raised, but its message does not match {self.match!r}:\n"
                                 f"{msg[:300]}") from None
        return True


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this test session sees (the session's own temporary folder
    without xdist), for work done once per session (see `once`)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    if run is None:
        return base
    shared = base.parent / f"shared-{run}"
    shared.mkdir(exist_ok=True)
    return shared


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """make(folder) once per test session, whichever xdist worker asks first (the others wait for it
    and then read its folder). A failed make fails every test that asks (each tries again)."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory)
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def mm_operands(rand, m, k, n, layout, device="cpu"):
    """a (m, k) and b (k, n) as the layer's GEMMs pass them: row-major, transposed views, row slices
    (an offset and a leading dimension past the width), or strided columns (neither layout: copied)."""
    r = lambda *shape: rand.randn(*shape, device=device)  # noqa: E731
    if layout == "rows":
        return r(m, k), r(k, n)
    if layout == "transposed":
        return r(k, m).t(), r(n, k).t()
    if layout == "slices":
        return r(m + 1, k + 3)[1:, :k], r(k + 2, n)[1:-1]
    return r(m, 2 * k)[:, ::2], r(k, 3 * n)[:, ::3]
