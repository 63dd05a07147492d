"""The registries: lookup and its errors, per-entry schemas, upstream's yaml parsers, the lr schedulers against
upstream's loop replayed by hand (tests/upstream_loop.py), preprocess.core_method, and an out-of-tree model brought
in by the hypes' ``imports:`` that trains on 2 ranks."""
from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from launch import REPO, TRAIN, explain, python, split_set_flags, torchrun
from upstream_loop import upstream_step_lrs
from zoo import hypes_of
from opencood_ddp import registry as R
from opencood_ddp.data.datasets import build_dataset, fusion_methods
from opencood_ddp.engine.optim import build_scheduler
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import KIND_CHECKS
from opencood_ddp.yaml_parsers import run_yaml_parser

UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes"
TOY = REPO / "hypes_yaml" / "toy"
EXAMPLE = REPO / "examples" / "tiny_maxfuse.yaml"
GATED = REPO / "examples" / "gated_attfuse.yaml"


# ------------------------------------------------------------------------------------------ the Registry
def test_unknown_name_lists_the_registered_ones_and_the_closest():
    with pytest.raises(ConfigError) as info:
        R.MODELS.get("point_pilar_intermediate", "my.yaml")
    message = str(info.value)
    assert message.startswith("my.yaml: model.core_method 'point_pilar_intermediate' is not one of ")
    assert ", ".join(R.MODELS.names()) in message and "point_pillar_intermediate" in R.MODELS.names()
    assert "(did you mean point_pillar_intermediate?)" in message and "imports:" in message


def test_entries_declare_their_keys_and_validation_names_every_problem():
    registry = R.Registry("widget", "widget.core_method")

    @registry.register("round", required=(("widget.args.radius", "number"), ("widget.args.n", "positive_int")),
                       optional=(("widget.args.label", "str"),), colour="red")
    class Round:
        pass

    entry = registry.get("round")
    assert entry.obj is Round and entry.meta == {"colour": "red"}
    assert [key for key, _ in entry.keys] == ["widget.args.radius", "widget.args.n", "widget.args.label"]
    hypes = {"widget": {"core_method": "round", "args": {"n": 0, "label": 3}}}
    with pytest.raises(ConfigError) as info:
        registry.lookup(hypes, "w.yaml")
    message = str(info.value)
    assert "missing key widget.args.radius" in message and "key widget.args.n must be a positive integer" in message
    assert "key widget.args.label must be a non-empty string" in message and "\n" not in message


def test_a_class_declares_its_keys_as_attributes_and_a_check_runs_after_the_kinds():
    registry = R.Registry("widget", "widget.core_method")

    def at_most_ten(hypes, source):
        if hypes["widget"]["n"] > 10:
            raise ConfigError(f"{source}: key widget.n must be at most 10")

    @registry.register("square", check=at_most_ten)
    class Square:
        required_keys = (("widget.n", "int"),)

    assert registry.get("square").required == (("widget.n", "int"),)
    registry.lookup({"widget": {"core_method": "square", "n": 3}}, "w")
    with pytest.raises(ConfigError, match="at most 10"):
        registry.lookup({"widget": {"core_method": "square", "n": 11}}, "w")


def test_a_subclass_registered_without_keys_takes_its_nearest_registered_bases():
    """Keys, check and facts come from the nearest registered base; add_* extend them, the subclass's own check
    runs after the base's, its meta overrides; keys given outright replace (no inheritance)."""
    reg = R.Registry("widget", "widget.core_method")
    calls = []

    @reg.register("root", required=(("widget.a", "int"),), optional=(("widget.b", "str"),),
                  check=lambda h, s: calls.append("root"), fusion="early", colour="red")
    class Root:
        pass

    class Unregistered(Root):
        pass

    @reg.register("child", add_optional=(("widget.c", "number"), ("widget.b", "int")),
                  check=lambda h, s: calls.append("child"), colour="blue")
    class Child(Unregistered):
        pass

    @reg.register("grandchild")
    class Grandchild(Child):
        pass

    @reg.register("replaced", optional=(("widget.z", "int"),))
    class Replaced(Root):
        pass

    child = reg.get("child")
    assert child.required == (("widget.a", "int"),)
    assert child.optional == (("widget.c", "number"), ("widget.b", "int"))  # widget.b's kind taken from add_optional
    assert dict(child.meta) == {"fusion": "early", "colour": "blue"}
    child.validate({"widget": {"a": 1, "c": 0.5}}, "h")
    assert calls == ["root", "child"]
    assert reg.get("grandchild").keys == child.keys and dict(reg.get("grandchild").meta) == dict(child.meta)
    calls.clear()
    reg.get("grandchild").validate({"widget": {"a": 1}}, "h")
    assert calls == ["root", "child"]
    assert reg.get("replaced").keys == (("widget.z", "int"),) and reg.get("replaced").check is None
    with pytest.raises(ConfigError, match="widget.a"):
        child.validate({"widget": {"c": 0.5}}, "h")


def test_an_out_of_tree_subclass_of_attfuse_keeps_attfuses_keys_and_checks(monkeypatch):
    """examples/gated_attfuse.py declares one key of its own: AttFuse's keys stay known and checked, its own key
    is accepted, a misspelt one is refused, and the model is AttFuse's parameters plus the gate."""
    from opencood_ddp.models import create_model
    from opencood_ddp.schema import check_known_keys
    from opencood_ddp.tasks.opencood import TASK_KEYS

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    hypes = hypes_of(GATED)
    assert R.import_modules(hypes) == ["gated_attfuse"]
    entry, parent = R.MODELS.get("gated_attfuse"), R.MODELS.get("point_pillar_intermediate")
    assert set(entry.keys) == set(parent.keys) | {("model.args.gate_init", "number")}
    assert entry.meta["fusion"] == parent.meta["fusion"]
    check_known_keys(hypes, "gated", extra=TASK_KEYS)  # what the task builder calls before training
    with pytest.raises(ConfigError, match=r"model.args.gate_int \(did you mean model.args.gate_init\?\)"):
        check_known_keys(hypes_of(GATED, "model.args.gate_int=1.0"), "gated", extra=TASK_KEYS)
    with pytest.raises(ConfigError, match="compression"):  # AttFuse's own check still runs
        create_model(hypes_of(GATED, "model.args.base_bev_backbone.compression=32"))
    model, attfuse = create_model(hypes), create_model(hypes_of(GATED, "model.core_method=point_pillar_intermediate"))
    names = dict(model.named_parameters())
    assert set(names) == set(dict(attfuse.named_parameters())) | {"gate"}
    assert torch.allclose(names["gate"], torch.full_like(names["gate"], 2.0))
    sys.modules.pop("gated_attfuse", None)


def test_two_objects_under_one_name_and_unknown_kinds_are_refused():
    registry = R.Registry("widget", "widget.core_method")
    registry.register("a")(int)
    registry.register("a")(int)  # the same object again (a module imported twice): harmless
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(float)
    with pytest.raises(ValueError, match="unknown kind 'colour'"):
        registry.register("b", required=(("widget.x", "colour"),))(str)


def built_in(registry: R.Registry) -> list[str]:
    """The names this package registers (another test may have imported an out-of-tree model)."""
    return [e.name for e in registry.entries() if e.obj.__module__.startswith("opencood_ddp.")]


def test_the_built_in_entries_carry_upstreams_names():
    # point_pillar_fax: the V2V4Real fork's name for upstream's CoBEVT class
    assert built_in(R.MODELS) == ["point_pillar", "point_pillar_cobevt", "point_pillar_fax", "point_pillar_fcooper",
                                  "point_pillar_intermediate", "point_pillar_opv2v", "point_pillar_transformer",
                                  "point_pillar_v2vnet", "point_pillar_where2comm", "second",
                                  "second_intermediate"]
    assert fusion_methods() == {"early": "EarlyFusionDataset", "late": "LateFusionDataset",
                                "nofusion": "LateFusionDataset", "intermediate": "IntermediateFusionDataset"}
    assert R.SOURCES.names() == ["dairv2x", "opv2v", "v2v4real", "v2xset"]  # HEAL's fusion.dataset names
    assert R.PREPROCESSORS.names() == ["SpVoxelPreprocessor"]
    assert R.POSTPROCESSORS.names() == ["VoxelPostprocessor"]
    assert R.LOSSES.names() == ["point_pillar_loss"]
    assert R.YAML_PARSERS.names() == ["load_point_pillar_params", "load_second_params", "load_voxel_params"]
    assert R.SCHEDULERS.names() == ["cosineannealwarm", "exponential", "multistep", "step"]
    for registry in R.ALL_REGISTRIES:
        for entry in registry.entries():
            assert all(kind in KIND_CHECKS for _, kind in entry.keys), (registry.kind, entry.name)


# ------------------------------------------------------------------------------------------ yaml parsers
def test_upstream_hypes_files_parse_unchanged():
    for path in sorted(UPSTREAM.glob("*.yaml")):
        hypes = hypes_of(path)
        anchor = hypes["postprocess"]["anchor_args"]
        assert all(type(anchor[k]) is int for k in "WHD"), path


def test_load_second_params_writes_the_3d_grid_and_the_anchor_grid():
    hypes = hypes_of(UPSTREAM / "second_intermediate_fusion.yaml")
    assert hypes["model"]["args"]["grid_size"] == [2816, 800, 40]
    anchor = hypes["postprocess"]["anchor_args"]
    assert (anchor["W"], anchor["H"], anchor["D"], anchor["vw"], anchor["vd"]) == (2816, 800, 40, 0.1, 0.1)


def test_load_voxel_params_uses_the_anchor_range_and_tells_the_model():
    hypes = {"yaml_parser": "load_voxel_params",
             "preprocess": {"args": {"voxel_size": [0.4, 0.4, 4]}, "cav_lidar_range": [0, 0, 0, 1, 1, 1]},
             "postprocess": {"anchor_args": {"cav_lidar_range": [-140.8, -40, -3, 140.8, 40, 1]}},
             "model": {"args": {}}}
    parsed = run_yaml_parser(copy.deepcopy(hypes))
    assert {k: parsed["model"]["args"][k] for k in "WHD"} == {"W": 704, "H": 200, "D": 1}
    del hypes["model"]
    assert run_yaml_parser(hypes)["postprocess"]["anchor_args"]["W"] == 704  # no model: anchors only


# ------------------------------------------------------------------------------------------ schedulers
def _optimizer(lr: float = 0.001) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(schedule, optimizer, epochs: int, steps_per_epoch: int, first_step: int = 0) -> list:
    """The lr of each optimizer step, the schedule moved as the trainer moves it (from step `first_step` of the
    first epoch)."""
    lrs = []
    for epoch in range(epochs):
        for _ in range(first_step if epoch == 0 else 0, steps_per_epoch):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.after_optimizer_step()
        schedule.after_epoch()
    return lrs


def test_cosineannealwarm_follows_upstreams_per_step_values():
    """CoBEVT's schedule: lr 1e-3, warm-up from 2e-4 over 10 of 90 epochs, floor 2e-5; 7 steps per epoch.
    Upstream's timm scheduler moves after every optimizer step, steps 0 and 1 of an epoch sharing one value."""
    hypes = hypes_of(UPSTREAM / "point_pillar_cobevt.yaml")
    optimizer = _optimizer(hypes["optimizer"]["lr"])
    schedule = build_scheduler(hypes, optimizer, steps_per_epoch=7)
    assert schedule.per_step
    lrs = _lrs(schedule, optimizer, 95, 7)
    assert lrs == pytest.approx(upstream_step_lrs(hypes["lr_scheduler"], 1e-3, 7, 95), rel=1e-12)
    # By hand: warm-up steps of 8e-4 / 70 per update; t = 70 (epoch 10, step 0 and 1) starts the cosine over 630.
    assert lrs[0] == lrs[1] == pytest.approx(2e-4) and lrs[2] == pytest.approx(2e-4 + 8e-4 / 70)
    assert lrs[7] == lrs[8] == pytest.approx(2e-4 + 8e-4 * 7 / 70) and lrs[6] == pytest.approx(2e-4 + 8e-4 * 5 / 70)
    assert lrs[70] == lrs[71] == pytest.approx(2e-5 + 0.5 * 9.8e-4 * (1 + math.cos(math.pi * 70 / 630)))
    assert lrs[630:] == pytest.approx([2e-5] * 35)


def test_cosineannealwarm_resumes_mid_epoch_on_the_same_step():
    hypes = hypes_of(UPSTREAM / "point_pillar_where2comm.yaml")
    lr, n = hypes["optimizer"]["lr"], 5
    optimizer = _optimizer(lr)
    whole = _lrs(build_scheduler(hypes, optimizer, n), optimizer, 30, n)
    first = _optimizer(lr)
    early = build_scheduler(hypes, first, n)
    _lrs(early, first, 12, n)
    for _ in range(3):  # three steps into epoch 13
        first.step()
        early.after_optimizer_step()
    resumed_optimizer = _optimizer(lr)  # the trainer's order: build both, then load both
    resumed = build_scheduler(hypes, resumed_optimizer, n)
    resumed_optimizer.load_state_dict(first.state_dict())
    resumed.load_state_dict(early.state_dict())
    assert resumed.steps_taken() == 12 * n + 3
    assert _lrs(resumed, resumed_optimizer, 18, n, first_step=3) == pytest.approx(whole[12 * n + 3:], rel=1e-12)


@pytest.mark.parametrize("section", [{"core_method": "multistep", "gamma": 0.5, "step_size": [2, 4]},
                                     {"core_method": "multistep", "step_size": 3},
                                     {"core_method": "step", "gamma": 0.3, "step_size": 2},
                                     {"core_method": "exponential", "gamma": 0.9}])
def test_per_epoch_schedulers_follow_upstreams_closed_form(section):
    optimizer = _optimizer(0.01)
    schedule = build_scheduler({"lr_scheduler": section}, optimizer, steps_per_epoch=4)
    assert not schedule.per_step
    assert _lrs(schedule, optimizer, 6, 4) == pytest.approx(upstream_step_lrs(section, 0.01, 4, 6), rel=1e-12)


@pytest.mark.parametrize("override, key", [
    ("lr_scheduler.warmup_epoches=100", "lr_scheduler.warmup_epoches"),
    ("lr_scheduler.lr_min=-1.0", "lr_scheduler.lr_min"),
    ("lr_scheduler.epoches=0", "lr_scheduler.epoches"),
    ("lr_scheduler.core_method=cosineanealwarm", "did you mean cosineannealwarm"),
])
def test_cosineannealwarm_errors_name_the_key(override, key):
    hypes = hypes_of(UPSTREAM / "point_pillar_cobevt.yaml", override)
    with pytest.raises(ConfigError, match=key):
        build_scheduler(hypes, _optimizer(), steps_per_epoch=3)


@pytest.mark.parametrize("gamma", [0, -0.5])
def test_a_plain_schedulers_gamma_must_be_positive(gamma):
    """torch takes any gamma: 0 stops the training at the first milestone, a negative one turns the lr over."""
    for method in ("multistep", "step", "exponential"):
        with pytest.raises(ConfigError, match=f"key lr_scheduler.gamma must be a positive number, got {gamma}"):
            build_scheduler({"lr_scheduler": {"core_method": method, "gamma": gamma, "step_size": 2}}, _optimizer(),
                            1)


def test_plain_schedulers_keep_their_defaults():
    optimizer = _optimizer(1.0)
    schedule = build_scheduler({"lr_scheduler": {"core_method": "multistep", "step_size": 2}}, optimizer, 1)
    assert _lrs(schedule, optimizer, 4, 1) == pytest.approx([1.0, 1.0, 0.1, 0.1])
    assert build_scheduler({"lr_scheduler": None}, optimizer, 1) is None
    with pytest.raises(ConfigError, match="lr_scheduler.step_size"):
        build_scheduler({"lr_scheduler": {"core_method": "multistep", "step_size": ["x"]}}, optimizer, 1)


def test_a_scheduler_declares_when_it_moves(monkeypatch):
    assert {entry.name: entry.meta.get("interval", "epoch") for entry in R.SCHEDULERS.entries()} == {
        "cosineannealwarm": "step", "exponential": "epoch", "multistep": "epoch", "step": "epoch"}
    # an out-of-tree entry with an interval the loop does not know (taken out again when the test ends)
    monkeypatch.setitem(R.SCHEDULERS._entries, "hourly",
                        R.Entry("hourly", lambda section, optimizer: None, meta={"interval": "hour"}))
    with pytest.raises(ConfigError) as info:
        build_scheduler({"lr_scheduler": {"core_method": "hourly"}}, _optimizer(), 1)
    assert "interval='epoch' or interval='step'" in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ preprocess
def test_preprocess_core_method_is_honoured(toy_small):
    hypes = hypes_of(TOY / "point_pillar_early_fusion.yaml", "preprocess.core_method=SpVoxelPreprocesor",
                     toy_root=toy_small)
    with pytest.raises(ConfigError) as info:
        build_dataset(hypes, "train")
    assert "preprocess.core_method 'SpVoxelPreprocesor'" in str(info.value)
    assert "did you mean SpVoxelPreprocessor" in str(info.value)
    del hypes["preprocess"]["core_method"]
    with pytest.raises(ConfigError, match="missing key preprocess.core_method"):
        build_dataset(hypes, "train")


# ------------------------------------------------------------------------------------------ imports:
def test_imports_register_an_out_of_tree_entry(tmp_path, monkeypatch):
    (tmp_path / "my_widgets.py").write_text(
        "from opencood_ddp.registry import LOSSES\n"
        "@LOSSES.register('my_widget_loss', required=(('loss.args.scale', 'number'),))\n"
        "def build(args):\n    return args['scale']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert R.import_modules({"imports": ["my_widgets"]}) == ["my_widgets"]
    assert R.LOSSES.lookup({"loss": {"core_method": "my_widget_loss", "args": {"scale": 2}}}, "h").obj({"scale": 2}) == 2
    sys.modules.pop("my_widgets", None)


@pytest.mark.parametrize("imports, fragment", [
    (["no_such_module_anywhere"], "module 'no_such_module_anywhere' listed under imports cannot be imported"),
    ("my_pkg.models", "key imports must be a list of module names"),
])
def test_bad_imports_are_one_config_error(imports, fragment):
    with pytest.raises(ConfigError) as info:
        R.import_modules({"imports": imports}, "my.yaml")
    assert str(info.value).startswith("my.yaml: ") and fragment in str(info.value) and "\n" not in str(info.value)


def test_a_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('needs CUDA 13')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'broken_models' .* \(RuntimeError: needs CUDA 13\)"):
        R.import_modules({"imports": ["broken_models"]})


def _pythonpath(*folders: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(f) for f in folders] + [os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_an_out_of_tree_model_trains_on_two_ranks(toy_small, tmp_path):
    """examples/tiny_maxfuse.py, named only in the hypes, trains 2 steps on 2 ranks with DataLoader workers;
    its checkpoint holds its own parameters."""
    run_dir = tmp_path / "run"
    result = torchrun(2, TRAIN, "--hypes_yaml", EXAMPLE, "--model_dir", run_dir, "--max_steps", "2",
                      "--num_workers", "2", *split_set_flags(toy_small), extra_env=_pythonpath(REPO / "examples"))
    assert result.returncode == 0, explain(result)
    state = torch.load(run_dir / "net_step2.pth", map_location="cpu")
    assert {"conv.0.weight", "cls_head.weight", "reg_head.weight", "pillar_vfe.pfn_layers.0.linear.weight"} <= set(state)
    assert "hypes: " in result.stderr + result.stdout


@pytest.mark.slow
def test_an_out_of_tree_subclass_of_attfuse_trains_on_two_ranks(toy_small, tmp_path):
    """examples/gated_attfuse.py, a subclass registered with one key of its own, trains 2 steps on 2 ranks through
    `imports:`; its gate is in the checkpoint and has moved."""
    run_dir = tmp_path / "run"
    result = torchrun(2, TRAIN, "--hypes_yaml", GATED, "--model_dir", run_dir, "--max_steps", "2",
                      "--num_workers", "0", *split_set_flags(toy_small), extra_env=_pythonpath(REPO / "examples"))
    assert result.returncode == 0, explain(result)
    state = torch.load(run_dir / "net_step2.pth", map_location="cpu")
    assert {"gate", "cls_head.weight", "pillar_vfe.pfn_layers.0.linear.weight"} <= set(state)
    assert not torch.allclose(state["gate"], torch.full_like(state["gate"], 2.0))


@pytest.mark.slow
def test_a_missing_plugin_is_one_error_line(toy_small, tmp_path):
    result = python(TRAIN, "--hypes_yaml", EXAMPLE, "--model_dir", tmp_path / "run", "--num_workers", "0",
                    *split_set_flags(toy_small))  # examples/ is not on PYTHONPATH
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, explain(result)
    assert "'tiny_maxfuse' listed under imports cannot be imported" in lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
