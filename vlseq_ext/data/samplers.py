"""Every sampler of vlseq_ext: which samples form each step, resumably. Length-bucketed batches for
vlseq-train (LengthBucketSampler, and DistributedLengthSampler: global steps that several processes
share, resumable with another step size), and consecutive steps for ParallelTrainer.fit
(OrderedBatches over an indexable dataset, IterableBatches over an iterable one).

All follow the protocol of vlseq_ext.training.loop: attributes `epoch` and `position` (batches of
this epoch handed out), `__iter__` over the rest of the epoch, `set_epoch`, `state_dict` /
`load_state_dict`, and `__len__` or `epoch_over()`. A state holds (epoch, position), so a checkpoint
resumes exactly where it was."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Sampler


__all__ = ["LengthBucketSampler", "DistributedLengthSampler", "OrderedBatches", "IterableBatches"]


class LengthBucketSampler(Sampler[List[int]]):
    """Batches of `batch_size` sample indices with similar lengths, for steps of one trainer.step.

    Each epoch (order fixed by (seed, epoch)): shuffle all indices, cut them into buckets of
    `batch_size * bucket_batches` ("sortish": sorted within a bucket only, so batches still vary
    from epoch to epoch), sort each bucket by length, cut it into batches, shuffle the batch order,
    and put the batch holding the longest sample first, so an out-of-memory shows up at once.

    The sampler is resumable: `position` counts the batches of `epoch` already handed out, and
    iterating continues from there; `state_dict()` / `load_state_dict()` save and restore both,
    so a resumed run continues at exactly the next batch. Call `set_epoch(e)` to start epoch e.
    (As a DataLoader's batch_sampler, use num_workers=0: workers prefetch batches, so `position`
    would run ahead of the batches actually trained on.)
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, shuffle: bool = True, seed: int = 0,
                 bucket_batches: int = 50, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise ValueError("LengthBucketSampler: no samples")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.bucket_batches, self.drop_last = bucket_batches, drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int) -> List[List[int]]:
        """Every batch of `epoch`, in order."""
        n, bs = len(self.lengths), self.batch_size
        if not self.shuffle:  # longest first, e.g. for evaluation
            order = np.argsort(-self.lengths, kind="stable")
            return [order[i:i + bs].tolist() for i in range(0, len(self) * bs, bs)]
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(n)
        out: List[List[int]] = []
        chunk = bs * self.bucket_batches
        for s in range(0, n, chunk):
            bucket = perm[s:s + chunk]
            bucket = bucket[np.argsort(-self.lengths[bucket], kind="stable")]
            out += [bucket[i:i + bs].tolist() for i in range(0, len(bucket), bs)]
        if self.drop_last:
            out = [b for b in out if len(b) == bs][:len(self)]
        out = [out[i] for i in rng.permutation(len(out))]
        longest = max(range(len(out)), key=lambda i: (int(self.lengths[out[i]].max()), -i))
        out.insert(0, out.pop(longest))
        return out

    def __iter__(self) -> Iterator[List[int]]:
        epoch = self.epoch
        batches = self.batches(epoch)
        # Stops early if set_epoch/load_state_dict is called while iterating.
        while self.epoch == epoch and self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "num_samples": len(self.lengths), "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore epoch and position; the batch size and sample count must match, or the
        position would point at different samples."""
        for key, mine in (("batch_size", self.batch_size), ("num_samples", len(self.lengths))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {mine}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class DistributedLengthSampler(LengthBucketSampler):
    """LengthBucketSampler over global steps: batches of world_size x devices_per_rank x
    samples_per_device sample indices, the same on every rank (same lengths, seed and epoch); each
    rank trains its share (ParallelTrainer.shard). Every sample is used once per epoch; the last step
    may be short, leaving some ranks few or no samples. With world_size=1 it is exactly
    LengthBucketSampler(lengths, devices x k).

    Checkpoints (state_dict) hold the global step size and position only, so they resume on any
    world size: with the same global step size the run continues exactly; with another one, the
    rest of the interrupted epoch (the samples not yet used, in the same order) is cut into steps
    of the new size, and later epochs follow the new size.
    """

    def __init__(self, lengths: Sequence[int], samples_per_device: int, devices_per_rank: int = 1,
                 world_size: int = 1, shuffle: bool = True, seed: int = 0, bucket_batches: int = 50,
                 drop_last: bool = False) -> None:
        if min(samples_per_device, devices_per_rank, world_size) < 1:
            raise ValueError("samples_per_device, devices_per_rank and world_size must be >= 1")
        super().__init__(lengths, samples_per_device * devices_per_rank * world_size, shuffle=shuffle, seed=seed,
                         bucket_batches=bucket_batches, drop_last=drop_last)
        # Earlier parts of the current epoch that ran with other step sizes: [(batch_size, batches used)].
        self.resized: List[Tuple[int, int]] = []
        self._cache: Optional[Tuple[Any, List[List[int]]]] = None

    def _cut(self, order: List[int], bs: int) -> List[List[int]]:
        out = [order[i:i + bs] for i in range(0, len(order), bs)]
        return [b for b in out if len(b) == bs] if self.drop_last else out

    def batches(self, epoch: int) -> List[List[int]]:
        if epoch != self.epoch or not self.resized:
            return super().batches(epoch)
        key = (epoch, self.batch_size, tuple(self.resized))
        if self._cache is None or self._cache[0] != key:
            left: Optional[List[int]] = None
            for bs, used in self.resized:
                if left is None:
                    seg = LengthBucketSampler(self.lengths, bs, shuffle=self.shuffle, seed=self.seed,
                                              bucket_batches=self.bucket_batches,
                                              drop_last=self.drop_last).batches(epoch)
                else:
                    seg = self._cut(left, bs)
                left = [i for b in seg[used:] for i in b]
            self._cache = (key, self._cut(left or [], self.batch_size))
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.batches(self.epoch)) if self.resized else super().__len__()

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.resized = []

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = super().state_dict()
        if self.resized:
            state["resized"] = [list(r) for r in self.resized]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore epoch and position, written with this or any other global step size (a resume on
        another world size, number of devices or samples_per_device)."""
        if "num_samples" in state and int(state["num_samples"]) != len(self.lengths):
            raise ValueError(f"sampler state has num_samples={state['num_samples']}, this sampler has "
                             f"{len(self.lengths)}")
        resized = [(int(a), int(b)) for a, b in state.get("resized", [])]
        epoch, position = int(state["epoch"]), int(state["position"])
        saved_bs = int(state.get("batch_size", self.batch_size))
        if saved_bs != self.batch_size and (position or resized):
            resized.append((saved_bs, position))
            position = 0
        self.epoch, self.position, self.resized, self._cache = epoch, position, resized, None


class OrderedBatches:
    """Resumable steps of `batch_size` consecutive indices 0..num_samples-1 (the last may be short),
    in order, or with shuffle=True in the order torch.randperm(num_samples) draws from a generator
    seeded with seed + epoch."""

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool = False, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_samples, self.batch_size, self.shuffle, self.seed = int(num_samples), int(batch_size), shuffle, seed
        self.epoch = self.position = 0

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def order(self, epoch: int) -> List[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[List[int]]:
        epoch, order, bs = self.epoch, self.order(self.epoch), self.batch_size
        while self.epoch == epoch and self.position < len(self):
            self.position += 1
            yield order[(self.position - 1) * bs:self.position * bs]

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size,
                "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key, mine in (("batch_size", self.batch_size), ("num_samples", self.num_samples)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state has {key}={state[key]}, this sampler has {mine}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class IterableBatches:
    """Resumable steps of `batch_size` consecutive items of an iterable that is read again every
    epoch (a DataLoader, a generator-backed dataset): the batches hold the items themselves (use
    get_item=lambda item: item). It reads one item ahead, so it knows at the last batch that the
    epoch is over. Resuming at position p re-reads and skips the first p batches."""

    def __init__(self, data: Any, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data, self.batch_size = data, int(batch_size)
        self.epoch = self.position = 0
        self._over = False

    def epoch_over(self) -> bool:
        return self._over

    def __iter__(self) -> Iterator[List[Any]]:
        epoch, it = self.epoch, iter(self.data)
        sentinel = object()
        nxt = next(it, sentinel)
        for _ in range(self.position * self.batch_size):  # resume: skip what was trained on
            if nxt is sentinel:
                break
            nxt = next(it, sentinel)
        self._over = nxt is sentinel
        while self.epoch == epoch and not self._over:
            batch = []
            while nxt is not sentinel and len(batch) < self.batch_size:
                batch.append(nxt)
                nxt = next(it, sentinel)
            self._over = nxt is sentinel
            self.position += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._over = int(epoch), 0, False

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "batch_size" in state and int(state["batch_size"]) != self.batch_size:
            raise ValueError(f"sampler state has batch_size={state['batch_size']}, this sampler has {self.batch_size}")
        self.epoch, self.position, self._over = int(state["epoch"]), int(state["position"]), False
