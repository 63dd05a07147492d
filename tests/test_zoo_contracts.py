"""The contracts every zoo model keeps (tests/zoo.py), one row per model of `zoo.MODELS`: upstream's state dict from
our opv2v config and from upstream's own hypes file, a strict load of upstream's weights, and, on real torchrun
processes, 2 ranks following 1, an exact resume and distributed evaluation equal to 1 process. What is specific to a
model lives in its own tests/test_zoo_<model>.py."""
from __future__ import annotations

import pytest

import zoo
from launch import REPO

CORES = list(zoo.MODELS)


def opv2v(core: str):
    return REPO / "hypes_yaml" / "opv2v" / f"{zoo.MODELS[core]}.yaml"


def toy(core: str):
    return REPO / "hypes_yaml" / "toy" / f"{zoo.MODELS[core]}.yaml"


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("source", ["opv2v", "upstream_file"])
def test_state_dict_equals_upstream_reference(core, source):
    config = opv2v(core) if source == "opv2v" else zoo.UPSTREAM_HYPES / f"{zoo.MODELS[core]}.yaml"
    zoo.assert_reference_state_dict(config, core)


@pytest.mark.parametrize("core", CORES)
def test_upstream_checkpoint_loads_strictly(core):
    zoo.assert_upstream_checkpoint_loads(opv2v(core), core)


@pytest.mark.slow
@pytest.mark.parametrize("core", CORES)
def test_two_ranks_follow_one(core, toy_small, tmp_path):
    zoo.assert_two_ranks_follow_one(toy(core), toy_small, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("core", CORES)
def test_resume_is_exact(core, toy_small, tmp_path):
    zoo.assert_resume_is_exact(toy(core), toy_small, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("core", CORES)
def test_distributed_eval_equals_one_process(core, toy_small, tmp_path):
    zoo.assert_distributed_eval_equals_one_process(toy(core), toy_small, tmp_path, "intermediate")
