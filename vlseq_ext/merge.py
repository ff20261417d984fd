"""How a step's gradients are merged: within this process (P2P kernel), or within it and then
across processes (torch.distributed). The trainer talks to one interface and never branches on
which.

Both leave the merged gradient and loss in the master's lane 0 (replicas zeroed, in the same
kernel) and answer the same questions about the group: rank, world size, this rank's share of a
global step, and whether a stop was requested.
"""
from __future__ import annotations

from typing import Any, List, Sequence

from . import ops
from .training.replicas import ReplicaSet
from .training.scheduling import lpt_shard

__all__ = ["LocalMerge", "CrossProcessMerge", "make_merge"]


class LocalMerge:
    """One process: master <- scale x sum of every device's gradients, in one kernel."""

    rank = 0
    world_size = 1

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def merge(self, n: int, mean: bool) -> None:
        """n: the step's samples; with mean, the gradient and loss are divided by it."""
        ops.reduce_tensors_(self.replicas.merge_lists(), 1.0 / n if mean else 1.0, zero_others=True)

    def shard(self, lengths: Sequence[int], samples_per_device: int, devices_per_rank: int) -> List[int]:
        return list(range(len(lengths)))

    def request_stop(self) -> None:  # a signal in one process needs no agreement
        pass

    def stop_requested(self) -> bool:
        return False

    def barrier(self) -> None:
        pass

    def check_same(self, what: str, value: int, show: bool = True) -> None:  # one process: nothing to compare
        pass


class CrossProcessMerge(LocalMerge):
    """Several processes: the local merge (sum only), then one all-reduce of the master's flat
    gradient and loss over the group, divided by the global sample count for "mean"
    (vlseq_ext.distributed.CrossProcessMerge)."""

    def __init__(self, replicas: ReplicaSet, collective: Any) -> None:
        super().__init__(replicas)
        self.collective = collective
        self.rank, self.world_size = collective.rank, collective.world_size

    def merge(self, n: int, mean: bool) -> None:
        ops.reduce_tensors_(self.replicas.merge_lists(), 1.0, zero_others=True)
        self.collective.all_reduce_(n, mean)

    def shard(self, lengths: Sequence[int], samples_per_device: int, devices_per_rank: int) -> List[int]:
        return lpt_shard(lengths, self.rank, self.world_size, devices_per_rank, samples_per_device)

    def request_stop(self) -> None:
        self.collective.request_stop()

    def stop_requested(self) -> bool:
        return self.collective.stop_requested()

    def barrier(self) -> None:
        self.collective.barrier()

    def check_same(self, what: str, value: int, show: bool = True) -> None:
        self.collective.check_same(what, value, show)


def make_merge(replicas: ReplicaSet, process_group: Any, samples_per_step: int) -> LocalMerge:
    """The merge for `process_group` ("auto", None or a ProcessGroup; see ParallelTrainer)."""
    from . import distributed

    master = replicas.master
    collective = distributed.CrossProcessMerge.create(process_group, master.grads, master.loss,
                                                      samples_per_step=samples_per_step)
    if collective is None:
        return LocalMerge(replicas)
    collective.broadcast_from_rank0(replicas.params[replicas.master_index] + list(replicas.model.buffers()))
    return CrossProcessMerge(replicas, collective)
