"""Training across processes (torchrun, several machines) on torch.distributed.

Placeholder interface used by ParallelTrainer; the implementation is being written.
"""
from __future__ import annotations

from typing import Any, List, Optional

from torch import Tensor


class CrossProcessMerge:
    """Sums the master's merged gradient and loss over every process of a group."""

    @classmethod
    def create(cls, process_group: Any, grads: List[Tensor], loss: Tensor) -> Optional["CrossProcessMerge"]:
        """None when training runs in one process (no group, or a group of one)."""
        return None

    def all_reduce_(self, local_count: int, mean: bool) -> None:
        raise NotImplementedError

    def broadcast_from_rank0(self, tensors: List[Tensor]) -> None:
        raise NotImplementedError
