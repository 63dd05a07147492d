"""Which sample indices a rank reads.

Training: BatchSampler(drop_last) over DistributedSampler(shuffle, seed, drop_last) at every world size,
including 1. DistributedSampler deals the epoch's permutation out round-robin (rank r takes positions
r, r+W, r+2W, ...), so rank r's b-sample batch t holds permutation positions W*b*t + r + W*j. Over all
ranks that is the contiguous block [W*b*t, W*b*(t+1)): exactly the 1-process batch t of size W*b. With
accumulation the same holds per optimizer step (A consecutive micro-batches). That identity is what lets
an N-rank run follow the 1-rank run.

Evaluation: unpadded shards, every sample seen once. Without costs they are contiguous, their sizes differ by at
most one, and concatenating them in rank order restores the dataset order. With a cost per sample (its CAVs,
known from the dataset's index) they are balanced by work: the costliest samples first, each to the rank with the
least work so far, so that the ranks' work differs by at most one sample's; each rank reads its samples in
dataset order, and the evaluator puts the records back in dataset order by their indices.
"""
from __future__ import annotations

import heapq
from typing import Iterator, Literal, Optional, Sequence, Sized, get_args

from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from opencood_ddp.errors import ConfigError


BatchOrder = Literal["sampled", "reversed", "rotated"]  # --batch_order
BATCH_ORDERS: tuple = get_args(BatchOrder)


class ReorderedBatchSampler(BatchSampler):
    """The same batches with their indices in another order: ``reversed``, or ``rotated`` by one (the first last).

    Every loss and statistic is a mean over the batch, so this is the same training in exact arithmetic; only
    the float summation order changes, as it does between world sizes. tools/parity_check.py uses both to measure
    how far two runs drift from rounding alone: one order is one draw of that drift, and one draw can be lucky
    (on an AVX2 CPU the reversed toy AttFuse run stayed within 1e-7 for three steps, while the rotated run and 2
    ranks both flipped one Adam step at the first)."""

    def __init__(self, sampler: Sampler, batch_size: int, drop_last: bool, order: BatchOrder):
        super().__init__(sampler, batch_size=batch_size, drop_last=drop_last)
        self.order = order

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            yield batch[::-1] if self.order == "reversed" else batch[1:] + batch[:1]


def make_train_batch_sampler(dataset: Sized, per_rank: int, world_size: int, rank: int, seed: int,
                             accumulation: int = 1, order: BatchOrder = "sampled") -> BatchSampler:
    """Batches of `per_rank` indices for `rank`; call `.sampler.set_epoch(epoch)` before each epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    batches = BatchSampler(sampler, batch_size=per_rank, drop_last=True) if order == "sampled" else \
        ReorderedBatchSampler(sampler, batch_size=per_rank, drop_last=True, order=order)
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


def balanced_shards(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Sample indices per rank, each rank's in ascending order, with the ranks' summed costs differing by at most
    the largest single cost: the greedy longest-first rule (costliest sample first, ties by index; to the rank
    with the least work so far, ties by rank). Every rank computes the same assignment from the same costs."""
    loads = [(0.0, rank) for rank in range(world_size)]
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        shards[rank].append(index)
        heapq.heappush(loads, (load + costs[index], rank))
    return [sorted(shard) for shard in shards]


class EvalShardSampler(Sampler[int]):
    """This rank's unpadded shard of [0, num_samples), in dataset order: contiguous, or balanced by `costs` (one
    per sample) when given."""

    def __init__(self, num_samples: int, world_size: int, rank: int, costs: Optional[Sequence[float]] = None):
        if costs is None:
            start, end = shard_bounds(num_samples, world_size, rank)
            self.indices = list(range(start, end))
        else:
            if len(costs) != num_samples:
                raise ValueError(f"{len(costs)} costs for {num_samples} samples")
            self.indices = balanced_shards(costs, world_size)[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
