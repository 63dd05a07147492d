"""Training batches: the union of the ranks' batches at step t is the 1-process batch t. Eval shards: no padding."""
import numpy as np
import pytest

from opencood_ddp.distributed.samplers import (EvalShardSampler, balanced_shards, make_train_batch_sampler,
                                               shard_bounds, steps_per_epoch)
from opencood_ddp.errors import ConfigError

SEED = 7


def _steps(batch_sampler, accumulation):
    """The list of optimizer steps: each step the flat list of indices of its `accumulation` micro-batches."""
    micro = list(batch_sampler)
    n_steps = steps_per_epoch(batch_sampler, accumulation)
    return [[i for mb in micro[s * accumulation:(s + 1) * accumulation] for i in mb] for s in range(n_steps)]


def _rank_samplers(n, per_rank, world, accumulation, seed=SEED):
    return [make_train_batch_sampler(range(n), per_rank, world, rank, seed, accumulation) for rank in range(world)]


def _reference(n, global_batch, seed=SEED):
    """The 1-process run of the same global batch (per_rank = global batch, no accumulation)."""
    return make_train_batch_sampler(range(n), global_batch, 1, 0, seed, 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [24, 25, 31, 50, 97])
@pytest.mark.parametrize("per_rank,accumulation", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3)])
def test_union_of_ranks_equals_one_process_batch(world, n, per_rank, accumulation):
    global_batch = per_rank * world * accumulation
    if n < global_batch:
        pytest.skip("dataset smaller than one global batch (covered by the error test)")
    samplers = _rank_samplers(n, per_rank, world, accumulation)
    reference = _reference(n, global_batch)
    previous = None
    for epoch in range(3):
        for s in samplers:
            s.sampler.set_epoch(epoch)
        reference.sampler.set_epoch(epoch)
        ref_steps = _steps(reference, 1)
        rank_steps = [_steps(s, accumulation) for s in samplers]

        # equal step count on every rank, equal to the 1-process count
        expected_steps = n // global_batch
        assert len(ref_steps) == expected_steps
        assert [steps_per_epoch(s, accumulation) for s in samplers] == [expected_steps] * world
        assert [len(r) for r in rank_steps] == [expected_steps] * world

        for t in range(expected_steps):
            union = [i for r in range(world) for i in rank_steps[r][t]]
            assert len(union) == global_batch
            assert len(set(union)) == global_batch  # no index twice within a step
            assert sorted(union) == sorted(ref_steps[t])
            for r in range(world):
                assert len(rank_steps[r][t]) == per_rank * accumulation

        # no sample is used twice within an epoch
        seen = [i for r in rank_steps for step in r for i in step]
        assert len(seen) == len(set(seen)) == expected_steps * global_batch
        assert set(seen) <= set(range(n))

        order = [tuple(step) for step in ref_steps]
        if previous is not None:
            assert order != previous  # the shuffle changes between epochs
        previous = order


def test_micro_batches_of_a_step_are_consecutive():
    # world 2, per_rank 2, accumulation 3: optimizer step t of rank r uses micro-batches 3t, 3t+1, 3t+2.
    n, world, per_rank, acc = 40, 2, 2, 3
    samplers = _rank_samplers(n, per_rank, world, acc)
    reference = _reference(n, world * per_rank)  # the 1-process micro-batch k of size W*b
    for s in samplers + [reference]:
        s.sampler.set_epoch(1)
    micro = [list(s) for s in samplers]
    ref_micro = list(reference)
    for k in range(len(ref_micro)):
        assert sorted(micro[0][k] + micro[1][k]) == sorted(ref_micro[k])
    for t in range(steps_per_epoch(samplers[0], acc)):
        step_union = [i for r in range(world) for mb in micro[r][t * acc:(t + 1) * acc] for i in mb]
        ref_union = [i for mb in ref_micro[t * acc:(t + 1) * acc] for i in mb]
        assert sorted(step_union) == sorted(ref_union)


def test_round_robin_positions():
    # Rank r's b-sample batch t holds permutation positions W*b*t + r + W*j (module docstring).
    n, world, b = 30, 3, 2
    perm = list(_reference(n, 1).sampler)  # the epoch-0 permutation, dealt to one process
    for r, s in enumerate(_rank_samplers(n, b, world, 1)):
        for t, batch in enumerate(s):
            assert batch == [perm[world * b * t + r + world * j] for j in range(b)]


def test_same_seed_same_batches_and_seed_matters():
    a = [list(s) for s in _rank_samplers(20, 2, 2, 1, seed=3)]
    b = [list(s) for s in _rank_samplers(20, 2, 2, 1, seed=3)]
    c = [list(s) for s in _rank_samplers(20, 2, 2, 1, seed=4)]
    assert a == b
    assert a != c


def test_set_epoch_is_reproducible():
    (s,) = _rank_samplers(16, 4, 1, 1)
    s.sampler.set_epoch(2)
    first = list(s)
    s.sampler.set_epoch(0)
    zero = list(s)
    s.sampler.set_epoch(2)
    assert list(s) == first
    assert zero != first


@pytest.mark.parametrize("n,per_rank,world,acc", [(3, 2, 2, 1), (7, 2, 2, 2), (0, 1, 1, 1), (5, 3, 2, 1),
                                                  (11, 1, 4, 3)])
def test_too_small_dataset_is_an_error(n, per_rank, world, acc):
    with pytest.raises(ConfigError) as info:
        make_train_batch_sampler(range(n), per_rank, world, 0, SEED, acc)
    msg = str(info.value)
    assert f"{n} samples" in msg
    assert f"one effective batch of {per_rank * world * acc}" in msg
    assert "train_params.batch_size" in msg


def test_exactly_one_global_batch_is_enough():
    samplers = _rank_samplers(12, 2, 3, 2)
    assert [steps_per_epoch(s, 2) for s in samplers] == [1, 1, 1]
    union = sorted(i for s in samplers for mb in s for i in mb)
    assert union == list(range(12))


# ------------------------------------------------------------------------------------------- evaluation shards
@pytest.mark.parametrize("n", [0, 1, 5, 37, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_eval_shards_cover_every_index_once(n, world):
    shards = [list(EvalShardSampler(n, world, rank)) for rank in range(world)]
    sizes = [len(s) for s in shards]
    assert [len(EvalShardSampler(n, world, rank)) for rank in range(world)] == sizes
    assert sum(sizes) == n  # no padding
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first n % world shards get the extra sample
    assert [i for s in shards for i in s] == list(range(n))  # rank order restores dataset order
    bounds = [shard_bounds(n, world, rank) for rank in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start


@pytest.mark.parametrize("n,world,expected", [
    (5, 2, [(0, 3), (3, 5)]),
    (37, 4, [(0, 10), (10, 19), (19, 28), (28, 37)]),
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
    (0, 2, [(0, 0), (0, 0)]),
    (100, 5, [(0, 20), (20, 40), (40, 60), (60, 80), (80, 100)]),
])
def test_shard_bounds_values(n, world, expected):
    assert [shard_bounds(n, world, rank) for rank in range(world)] == expected


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_shards_cover_every_index_once_and_carry_equal_work(world, seed):
    """Frames of scenarios with 2 to 7 CAVs, in scenario blocks as a real test split holds them."""
    rng = np.random.default_rng(seed)
    costs = [c for c in rng.integers(2, 8, size=25) for _ in range(int(rng.integers(3, 12)))]
    shards = [list(EvalShardSampler(len(costs), world, rank, costs)) for rank in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(len(costs)))  # every frame once, no padding
    assert all(s == sorted(s) for s in shards)  # each rank reads in dataset order
    work = [sum(costs[i] for i in s) for s in shards]
    assert max(work) - min(work) <= max(costs)  # within one frame's work
    contiguous = [sum(costs[i] for i in EvalShardSampler(len(costs), world, rank)) for rank in range(world)]
    assert max(work) <= max(contiguous)


def test_balanced_shards_by_hand():
    # costs 7,2,2,2,2,2,2,7: longest first gives rank 0 index 0 (7), rank 1 index 7 (7), then the 2s alternate
    shards = balanced_shards([7, 2, 2, 2, 2, 2, 2, 7], 2)
    assert shards == [[0, 1, 3, 5], [2, 4, 6, 7]]
    assert balanced_shards([], 3) == [[], [], []]
    assert balanced_shards([5, 1], 3) == [[0], [1], []]
