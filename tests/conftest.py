"""Markers and fixtures shared by the op tests.

Markers (registered in pytest_configure, so `-m requires_cuda` / `-m "not requires_2gpu"` work):
  requires_cuda   CUDA is available AND the extension registered its CUDA kernels. When CUDA is
                  available but the kernels are missing (a CPU-only build), the skip reason says
                  so loudly and the session header repeats it, so a GPU CI job that silently lost
                  its kernels is obvious instead of "all green".
  requires_2gpu   requires_cuda, plus at least two devices and peer access between 0 and 1.

There is deliberately no autouse seed fixture: tests draw fresh random data on every run. The
`rand` fixture hands a test its own generators, seeded from os.urandom; the seed is printed (pytest
shows it for a failing test) and VLSEQ_TEST_SEED=<seed> replays a failure.
"""
from __future__ import annotations

import os
import random
from typing import Dict, Optional

import pytest
import torch

from vlseq_ext import ops

NO_CUDA_KERNELS = (
    "CUDA IS AVAILABLE BUT vlseq_ext WAS BUILT WITHOUT CUDA KERNELS (extension built without CUDA kernels): "
    "GPU tests are skipped. Rebuild with a CUDA toolkit (CUDA_HOME set, nvcc on PATH): "
    "pip install --no-build-isolation ."
)


def cuda_skip_reason() -> Optional[str]:
    """Why requires_cuda tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not ops.has_extension():
        return "CUDA is available but the vlseq_ext extension is not loaded at all, so no CUDA kernels either"
    if not ops.has_cuda_kernels():
        return NO_CUDA_KERNELS
    return None


def two_gpu_skip_reason() -> Optional[str]:
    """Why requires_2gpu tests cannot run here, or None when they can."""
    reason = cuda_skip_reason()
    if reason is not None:
        return reason
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA devices, found {torch.cuda.device_count()}"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "cuda:0 cannot access cuda:1 as a peer"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread in every test process (several_threads aside): the tests' ops are small, and
    # OpenMP threads spin on a busy machine. 16 xdist workers x 16 threads on 16 cores spent most of
    # their time spinning; on a loaded 2-core machine 20 merges of a tiny model took 3.9 s with 2
    # threads and 0.08 s with one.
    torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", "requires_cuda: needs CUDA and the extension's CUDA kernels (skipped loudly when they are missing)")
    config.addinivalue_line(
        "markers", "requires_2gpu: needs 2 CUDA devices with peer access between cuda:0 and cuda:1")


def pytest_report_header(config: pytest.Config) -> str:
    reason = cuda_skip_reason()
    if reason is None:
        return (f"vlseq_ext: CUDA kernels registered, {torch.cuda.device_count()} device(s); "
                f"2-GPU tests: {two_gpu_skip_reason() or 'enabled'}")
    if reason == NO_CUDA_KERNELS:
        return "vlseq_ext: WARNING: " + NO_CUDA_KERNELS
    return f"vlseq_ext: GPU tests skipped ({reason}); CPU kernels loaded: {ops.has_extension()}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("requires_2gpu") is not None:
        reason = two_gpu_skip_reason()
        if reason is not None:
            pytest.skip(reason)
    if item.get_closest_marker("requires_cuda") is not None:
        reason = cuda_skip_reason()
        if reason is not None:
            pytest.skip(reason)


def _shape(shape) -> tuple:
    """randn(3, 4), randn((3, 4)) and randn() (0-dim) all work."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


class Rand:
    """One test's random source. Every draw is fresh (os.urandom seed) unless VLSEQ_TEST_SEED is
    set; generators are per device so CUDA data is drawn on the device."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.py = random.Random(seed)
        self._gens: Dict[str, torch.Generator] = {}

    def generator(self, device="cpu") -> torch.Generator:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self._gens:
            g = torch.Generator(device=device)
            g.manual_seed((self.seed * 1000003 + len(self._gens)) % (2**63))
            self._gens[key] = g
        return self._gens[key]

    def randn(self, *shape, dtype: torch.dtype = torch.float32, device="cpu", scale: float = 1.0) -> torch.Tensor:
        """Standard normal values (times `scale`), drawn in float32/float64 and rounded to `dtype`."""
        draw = torch.float64 if dtype == torch.float64 else torch.float32
        t = torch.randn(_shape(shape), dtype=draw, device=device, generator=self.generator(device))
        if scale != 1.0:
            t.mul_(scale)
        return t.to(dtype)

    def uniform(self, *shape, low: float, high: float, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        draw = torch.float64 if dtype == torch.float64 else torch.float32
        t = torch.rand(_shape(shape), dtype=draw, device=device, generator=self.generator(device))
        return (t * (high - low) + low).to(dtype)

    def randint(self, low: int, high: int, *shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        t = torch.randint(low, high, _shape(shape), device=device, generator=self.generator(device))
        return t.to(dtype)


@pytest.fixture
def rand() -> Rand:
    env = os.environ.get("VLSEQ_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(6), "little")
    print(f"random seed: {seed} (replay with VLSEQ_TEST_SEED={seed})")
    return Rand(seed)


@pytest.fixture(scope="module")
def compiled_ops() -> None:
    """For test modules about the compiled ops (`pytestmark = pytest.mark.usefixtures("compiled_ops")`):
    without the extension the wrappers fall back to vlseq_ext.reference and every comparison
    with the reference would be vacuous, so such tests error instead of passing."""
    assert ops.has_extension(), (
        "vlseq_ext._C is not built/importable, so these tests would compare the reference with itself: "
        f"{ops._ext.LOAD_ERROR or 'not built'}")


@pytest.fixture
def no_tf32():
    """cuDNN's RNNs use TF32 by default on Hopper (~3e-4 relative error): GPU correctness tests
    compare in full fp32."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def several_threads():
    """Four intra-op threads for the test: the CPU kernels split large tensors over threads
    (at::parallel_for) only then."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(n)
