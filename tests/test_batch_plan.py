"""BatchPlan: global and per-GPU batch semantics, accumulation, lr scaling and the errors of impossible splits."""
import math

import pytest

from opencood_ddp.distributed.batch_plan import BatchPlan, make_batch_plan
from opencood_ddp.errors import ConfigError

LR = 2e-3


# ------------------------------------------------------------------------------------------- global semantics
@pytest.mark.parametrize("world,per_rank", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_8_split_over_worlds(world, per_rank):
    plan = make_batch_plan(8, world, LR)
    assert (plan.world_size, plan.per_rank, plan.accumulation, plan.global_batch) == (world, per_rank, 1, 8)
    assert plan.semantics == "global" and plan.lr_scaling == "none"
    assert plan.effective_lr == LR and plan.base_lr == LR


@pytest.mark.parametrize("world,per_gpu,accumulation", [
    (1, 8, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8),
    (2, 4, 1), (2, 2, 2), (2, 1, 4),
    (4, 2, 1), (4, 1, 2),
    (8, 1, 1),
])
def test_global_with_per_gpu_batch_becomes_accumulation(world, per_gpu, accumulation):
    plan = make_batch_plan(8, world, LR, per_gpu_batch=per_gpu)
    assert plan.per_rank == per_gpu
    assert plan.accumulation == accumulation
    assert plan.per_rank * plan.world_size * plan.accumulation == 8 == plan.global_batch
    assert plan.effective_lr == LR


@pytest.mark.parametrize("batch", [1, 2, 6, 8, 12, 16, 24])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_global_invariant_whenever_possible(batch, world):
    if batch % world:
        with pytest.raises(ConfigError):
            make_batch_plan(batch, world, LR)
        return
    plan = make_batch_plan(batch, world, LR)
    assert plan.per_rank * plan.world_size * plan.accumulation == batch
    assert plan.global_batch == batch and plan.effective_lr == LR


def test_impossible_global_split_batch_2_world_4():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(2, 4, LR)
    msg = str(info.value)
    assert "train_params.batch_size 2" in msg
    assert "4 processes" in msg
    assert "[1, 2]" in msg  # workable world sizes
    assert "per_gpu" in msg and "effective batch 8" in msg


def test_impossible_global_split_batch_8_world_3():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 3, LR)
    msg = str(info.value)
    assert "train_params.batch_size 8" in msg and "3 processes" in msg
    assert "[1, 2, 4, 8]" in msg


def test_impossible_per_gpu_batch_3_on_batch_8():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 2, LR, per_gpu_batch=3)
    msg = str(info.value)
    assert "train_params.batch_size 8" in msg
    assert "--per_gpu_batch 3" in msg
    assert "--per_gpu_batch in [1, 2, 4]" in msg  # workable per-GPU batches at world size 2
    assert "world size in [1, 2, 4, 8]" in msg


def test_impossible_per_gpu_batch_on_world_1():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 1, LR, per_gpu_batch=3)
    assert "--per_gpu_batch in [1, 2, 4, 8]" in str(info.value)


def test_impossible_per_gpu_batch_with_no_workable_choice():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 3, LR, per_gpu_batch=1)
    msg = str(info.value)
    assert "none (change the world size)" in msg
    assert "[1, 2, 4, 8]" in msg


def test_per_gpu_batch_larger_than_share_is_an_error():
    with pytest.raises(ConfigError, match="train_params.batch_size 8"):
        make_batch_plan(8, 4, LR, per_gpu_batch=4)


# ------------------------------------------------------------------------------------------- per-GPU semantics
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("scaling,factor", [("none", lambda w: 1.0), ("linear", lambda w: float(w)),
                                            ("sqrt", math.sqrt)])
def test_per_gpu_semantics_and_lr_scaling(world, scaling, factor):
    plan = make_batch_plan(4, world, LR, semantics="per_gpu", lr_scaling=scaling)
    assert plan.semantics == "per_gpu" and plan.lr_scaling == scaling
    assert (plan.per_rank, plan.accumulation, plan.global_batch) == (4, 1, 4 * world)
    assert plan.effective_lr == pytest.approx(LR * factor(world))
    assert plan.base_lr == LR


def test_per_gpu_lr_values_world_4():
    assert make_batch_plan(4, 4, 0.1, semantics="per_gpu").effective_lr == pytest.approx(0.1)
    assert make_batch_plan(4, 4, 0.1, semantics="per_gpu", lr_scaling="linear").effective_lr == pytest.approx(0.4)
    assert make_batch_plan(4, 4, 0.1, semantics="per_gpu", lr_scaling="sqrt").effective_lr == pytest.approx(0.2)


@pytest.mark.parametrize("per_gpu,accumulation", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_per_gpu_semantics_per_gpu_batch_turns_into_accumulation(per_gpu, accumulation):
    plan = make_batch_plan(8, 3, LR, per_gpu_batch=per_gpu, semantics="per_gpu")
    assert (plan.per_rank, plan.accumulation, plan.global_batch) == (per_gpu, accumulation, 24)
    assert plan.per_rank * plan.world_size * plan.accumulation == plan.global_batch


def test_per_gpu_semantics_bad_per_gpu_batch():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 2, LR, per_gpu_batch=3, semantics="per_gpu")
    msg = str(info.value)
    assert "--per_gpu_batch 3" in msg and "train_params.batch_size" in msg and "[1, 2, 4, 8]" in msg


# ------------------------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("scaling", ["linear", "sqrt"])
def test_scale_lr_with_global_semantics_is_an_error(scaling):
    with pytest.raises(ConfigError, match="--scale_lr"):
        make_batch_plan(8, 2, LR, lr_scaling=scaling)


def test_unknown_semantics():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 2, LR, semantics="local")
    assert "'local'" in str(info.value) and "['global', 'per_gpu']" in str(info.value)


def test_unknown_scaling():
    with pytest.raises(ConfigError) as info:
        make_batch_plan(8, 2, LR, semantics="per_gpu", lr_scaling="cubic")
    assert "'cubic'" in str(info.value) and "['none', 'linear', 'sqrt']" in str(info.value)


@pytest.mark.parametrize("batch", [0, -4, 2.0, "8", None])
def test_bad_batch_size(batch):
    with pytest.raises(ConfigError, match="train_params.batch_size must be a positive integer"):
        make_batch_plan(batch, 1, LR)


@pytest.mark.parametrize("per_gpu", [0, -1])
def test_bad_per_gpu_batch(per_gpu):
    with pytest.raises(ConfigError, match="--per_gpu_batch must be a positive integer"):
        make_batch_plan(8, 1, LR, per_gpu_batch=per_gpu)


# ------------------------------------------------------------------------------------------- description
def test_describe_global():
    plan = make_batch_plan(8, 2, 0.002, per_gpu_batch=2)
    text = plan.describe()
    assert text == ("batch plan: 2 process(es) x 2 per rank x 2 accumulation step(s) = effective batch 8 "
                    "(global semantics); lr 0.002 (base 0.002, scaling none)")


def test_describe_per_gpu():
    text = make_batch_plan(4, 4, 0.1, semantics="per_gpu", lr_scaling="linear").describe()
    assert "4 process(es) x 4 per rank x 1 accumulation step(s) = effective batch 16" in text
    assert "per_gpu semantics" in text and "lr 0.4" in text and "base 0.1" in text and "scaling linear" in text


def test_as_dict_and_frozen():
    plan = make_batch_plan(8, 4, LR)
    assert plan.as_dict() == dict(world_size=4, per_rank=2, accumulation=1, global_batch=8, semantics="global",
                                  base_lr=LR, lr_scaling="none", effective_lr=LR)
    assert BatchPlan(**plan.as_dict()) == plan
    with pytest.raises(AttributeError):
        plan.per_rank = 1
