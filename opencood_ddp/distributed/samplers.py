"""Which sample indices a rank reads.

Training: BatchSampler(drop_last) over DistributedSampler(shuffle, seed, drop_last) at every world size,
including 1. DistributedSampler deals the epoch's permutation out round-robin (rank r takes positions
r, r+W, r+2W, ...), so rank r's b-sample batch t holds permutation positions W*b*t + r + W*j. Over all
ranks that is the contiguous block [W*b*t, W*b*(t+1)): exactly the 1-process batch t of size W*b. With
accumulation the same holds per optimizer step (A consecutive micro-batches). That identity is what lets
an N-rank run follow the 1-rank run.

Evaluation: contiguous, unpadded shards whose sizes differ by at most one, so every sample is seen once
and concatenating the shards in rank order restores the dataset order.
"""
from __future__ import annotations

from typing import Iterator, Sized

from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from opencood_ddp.errors import ConfigError


class ReversedBatchSampler(BatchSampler):
    """The same batches with their indices in reverse order.

    Every loss and statistic is a mean over the batch, so this is the same training in exact arithmetic; only
    the float summation order changes, as it does between world sizes. tools/parity_check.py uses it to measure
    how far two runs drift from rounding alone."""

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            yield batch[::-1]


def make_train_batch_sampler(dataset: Sized, per_rank: int, world_size: int, rank: int, seed: int,
                             accumulation: int = 1, reverse: bool = False) -> BatchSampler:
    """Batches of `per_rank` indices for `rank`; call `.sampler.set_epoch(epoch)` before each epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    batches = (ReversedBatchSampler if reverse else BatchSampler)(sampler, batch_size=per_rank, drop_last=True)
    if len(batches) < accumulation:
        raise ConfigError(f"the training split has {len(dataset)} samples, fewer than one effective batch of "
                          f"{per_rank * world_size * accumulation}; add data or lower train_params.batch_size")
    return batches


def steps_per_epoch(batch_sampler: BatchSampler, accumulation: int) -> int:
    """Optimizer steps per epoch; trailing micro-batches that do not fill a step are dropped on every rank."""
    return len(batch_sampler) // accumulation


def shard_bounds(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous evaluation shard; the first num_samples % world_size shards get one more."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class EvalShardSampler(Sampler[int]):
    """This rank's contiguous, unpadded slice of [0, num_samples), in dataset order."""

    def __init__(self, num_samples: int, world_size: int, rank: int):
        self.start, self.end = shard_bounds(num_samples, world_size, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start
