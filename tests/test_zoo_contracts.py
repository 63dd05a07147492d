"""The contracts every zoo model keeps (tests/zoo.py), one row per model: upstream's state dict from our opv2v
config and from upstream's own hypes file, a strict load of upstream's weights, batch independence and a state-dict
round trip, in process; and in one shared torchrun launch, one real 2-rank DDP step of every model against the
1-process step on the union batch. What the engine guarantees on top (2 ranks follow 1 over many steps, an exact
resume, distributed evaluation equal to 1 process) does not depend on the model and is proven once per engine path
on real processes: tests/test_end_to_end.py, test_opencood_training.py, test_resilience.py. What is specific to a
model lives in its own tests/test_zoo_<model>.py."""
from __future__ import annotations

import json

import pytest

import zoo
from launch import REPO, WORKERS, explain, torchrun

CORES = list(zoo.MODELS)
# Every toy config of the zoo, the four PointPillar baselines included: the in-process contracts and the DDP step.
TOY_CONFIGS = sorted(p for p in (REPO / "hypes_yaml" / "toy").glob("*.yaml") if p.stem != "synthetic_bn")
# Models' options no toy config takes, stepped in the same launch: (name, config, one more --set). V2VNet's
# residual update (V2XSet's file) keeps its ConvGRU built and frozen, which DDP without find_unused_parameters
# must leave out of its buckets.
DDP_VARIANTS = [("point_pillar_v2vnet_gru_flag_false", REPO / "hypes_yaml" / "toy" / "point_pillar_v2vnet.yaml",
                 "model.args.v2vfusion.gru_flag=false")]


def opv2v(core: str):
    return REPO / "hypes_yaml" / "opv2v" / f"{zoo.MODELS[core]}.yaml"


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("source", ["opv2v", "upstream_file"])
def test_state_dict_equals_upstream_reference(core, source):
    config = opv2v(core) if source == "opv2v" else zoo.UPSTREAM_HYPES / f"{zoo.MODELS[core]}.yaml"
    zoo.assert_reference_state_dict(config, core)


@pytest.mark.parametrize("core", CORES)
def test_upstream_checkpoint_loads_strictly(core):
    zoo.assert_upstream_checkpoint_loads(opv2v(core), core)


@pytest.fixture(scope="module", params=TOY_CONFIGS, ids=lambda p: p.stem)
def toy_model(request, toy_small):
    return request.param, zoo.toy_samples(request.param, toy_small, count=2)


def test_a_sample_does_not_depend_on_its_batch(toy_model):
    config, toy = toy_model
    zoo.assert_batch_independent(config, toy)


def test_state_dict_round_trips(toy_model):
    config, toy = toy_model
    zoo.assert_state_dict_round_trips(config, toy)


@pytest.mark.slow
def test_one_ddp_step_on_two_ranks_equals_the_one_process_step_for_every_model(toy_small, tmp_path):
    """DDP as the trainer wraps it (gloo SyncBatchNorm, no find_unused_parameters, no broadcast of rank 0's
    buffers before the forward): every parameter is reduced on every rank, every rank's buffers stay equal, and the gradient is as close to the exact (float64) 1-process gradient on the union batch as the
    float32 1-process step is, within a factor of 10: both are float32 sums of the same terms in other orders."""
    variants = [word for variant in DDP_VARIANTS for word in ("--variant", *variant)]
    result = torchrun(2, WORKERS / "zoo_ddp_step_worker.py", "--toy", toy_small, "--out", tmp_path, *variants,
                      *TOY_CONFIGS, timeout=600)
    assert result.returncode == 0, explain(result)
    failures = []
    for name in [config.stem for config in TOY_CONFIGS] + [name for name, _, _ in DDP_VARIANTS]:
        found = json.loads((tmp_path / f"{name}.json").read_text())
        if not found["replicas_equal"] or not found["buffers_equal"] or found["none_grads"] \
                or found["ddp_error"] > 10 * found["floor"]:
            failures.append(f"{name}: {found}")
    frozen = json.loads((tmp_path / "point_pillar_v2vnet_gru_flag_false.json").read_text())["frozen"]
    assert frozen and all(name.startswith("fusion_net.conv_gru.") for name in frozen), frozen
    assert not failures, "\n".join(failures)
