"""opencood_ddp/schema.py: every key of a hypes file must be one that this project or upstream's hypes use."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import zoo

from opencood_ddp.errors import ConfigError
from opencood_ddp.schema import UPSTREAM_CARRIED, check_known_keys, unknown_keys
from opencood_ddp.tasks import synthetic
from opencood_ddp.tasks.opencood import TASK_KEYS

ROOT = Path(__file__).resolve().parents[1]
FCOOPER = ROOT / "hypes_yaml" / "toy" / "point_pillar_fcooper.yaml"
EARLY = ROOT / "hypes_yaml" / "toy" / "point_pillar_early_fusion.yaml"
SHIPPED = sorted(p for p in (ROOT / "hypes_yaml").rglob("*.yaml") if p.name != "synthetic_bn.yaml")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_uses_only_known_keys(path):
    assert unknown_keys(zoo.hypes_of(path), TASK_KEYS) == []


def test_the_synthetic_bench_declares_its_keys():
    hypes = zoo.hypes_of(ROOT / "hypes_yaml" / "toy" / "synthetic_bn.yaml")
    assert unknown_keys(hypes, synthetic.REQUIRED_KEYS + synthetic.OPTIONAL_KEYS) == []


def test_a_mistyped_key_is_one_error_with_the_closest_key():
    with pytest.raises(ConfigError) as caught:
        check_known_keys(zoo.hypes_of(FCOOPER, "train_params.batch_sise=4"), "x.yaml", TASK_KEYS)
    message = str(caught.value)
    assert message.startswith("x.yaml: unknown key train_params.batch_sise (did you mean train_params.batch_size?)")
    assert "\n" not in message and "fix the spelling" in message


def test_every_unknown_key_is_named_at_once():
    hypes = zoo.hypes_of(FCOOPER, "model.args.pillar_vfe.use_nrom=true", "fusion.args.proj_frist=true", "lr_sheduler=1")
    assert sorted(unknown_keys(hypes, TASK_KEYS)) == ["fusion.args.proj_frist", "lr_sheduler",
                                                      "model.args.pillar_vfe.use_nrom"]


def test_a_dict_with_no_declared_keys_below_takes_any_key():
    # optimizer.args are torch's keyword arguments, which torch checks (engine/optim.py names the key)
    assert unknown_keys(zoo.hypes_of(FCOOPER, "optimizer.args.amsgrad=true"), TASK_KEYS) == []
    # ... but a declared dict with declared keys below it does not: model.args is checked key by key
    assert unknown_keys(zoo.hypes_of(FCOOPER, "model.args.widht=3"), TASK_KEYS) == ["model.args.widht"]


def test_a_section_that_a_dataset_does_not_read_takes_no_keys():
    assert unknown_keys(zoo.hypes_of(EARLY), TASK_KEYS) == []  # upstream's `args: []`
    assert unknown_keys(zoo.hypes_of(EARLY, "fusion.args={proj_first: true}"), TASK_KEYS) == ["fusion.args.proj_first"]


def test_upstream_keys_that_nothing_reads_are_accepted():
    hypes = zoo.hypes_of(FCOOPER, "wild_setting={async: false, loc_err: false, xyz_std: 0.2}", "model.args.max_cav=5")
    assert unknown_keys(hypes, TASK_KEYS) == []
    assert unknown_keys(zoo.hypes_of(FCOOPER, "wild_setting={asyncc: false}"), TASK_KEYS) == ["wild_setting.asyncc"]
    assert all(reason for reason in UPSTREAM_CARRIED.values())


def test_an_unregistered_name_leaves_the_error_to_its_registry():
    # every model key would look unknown; the model lookup's own error (with its list of names) is the useful one
    hypes = zoo.hypes_of(FCOOPER, "model.core_method=point_pilar", "model.args.anything=1")
    assert unknown_keys(hypes, TASK_KEYS) == []


def test_an_out_of_tree_model_declares_its_own_keys(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    example = ROOT / "examples" / "tiny_maxfuse.yaml"
    assert unknown_keys(zoo.hypes_of(example), TASK_KEYS) == []
    assert unknown_keys(zoo.hypes_of(example, "model.args.widht=8"), TASK_KEYS) == ["model.args.widht"]
    sys.modules.pop("tiny_maxfuse", None)


# Upstream's own hypes of the zoo models (tests/reference/upstream_hypes): they load unchanged and every key they
# hold is read here or carried (UPSTREAM_CARRIED).
UPSTREAM = ROOT / "tests" / "reference" / "upstream_hypes"
ZOO_FILES = [f"{stem}.yaml" for stem in zoo.MODELS.values()]


@pytest.mark.parametrize("name", ZOO_FILES)
def test_upstreams_zoo_hypes_hold_only_known_keys(name):
    from opencood_ddp.schema import selected_entries

    hypes = zoo.hypes_of(UPSTREAM / name, "root_dir=/data/opv2v/train", "validate_dir=/data/opv2v/validate")
    assert selected_entries(hypes) is not None, "its model must be registered"
    assert unknown_keys(hypes, TASK_KEYS) == []
