"""tools/export_upstream.py: a folder upstream's scripts load as it is, and a refusal for widths upstream's code
cannot build."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launch import REPO
from zoo import hypes_of, reference_shapes
from opencood_ddp import hypes as hypes_lib
from opencood_ddp.models import create_model

sys.path.insert(0, str(REPO / "tools"))
import export_upstream  # noqa: E402  (a tool, imported for its table)

EXPORT = REPO / "tools" / "export_upstream.py"
REFERENCE = REPO / "tests" / "reference" / "opencood_state_dict"


def make_run(folder: Path, config: Path, *extra: str, overrides: tuple[str, ...] = ()) -> Path:
    """A run folder as train_ddp.py leaves it: config.yaml (parsed, with a batch plan; `overrides` as --set gives
    them) and checkpoints."""
    hypes = hypes_of(config, *overrides)
    folder.mkdir(parents=True)
    hypes_lib.save_hypes(dict(hypes, batch_plan={"global_batch": 2}), folder / "config.yaml")
    torch.manual_seed(0)
    state = create_model(hypes).state_dict()
    for name in extra:
        torch.save(state, folder / name)
    return folder


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, EXPORT, *map(str, args)], capture_output=True, text=True, cwd=REPO)


# Upstream's `second` has second_intermediate's parameters for upstream's configs (derived in
# tests/test_zoo_second_single.py), and no list of its own in the references.
REFERENCE_LIST = {"second": "second_intermediate"}


@pytest.mark.parametrize("core_method", sorted(export_upstream.FIXED_WIDTHS))
def test_the_fixed_widths_are_upstreams_shapes(core_method):
    shapes = dict(reference_shapes(REFERENCE_LIST.get(core_method, core_method)))
    if (REFERENCE / "compression32" / f"{core_method}.tsv").is_file():  # the naive compressor's layers
        shapes.update(reference_shapes(f"compression32/{core_method}"))
    for key, width in export_upstream.FIXED_WIDTHS[core_method].items():
        shape = shapes[key]
        # spconv's 3-D convolutions keep their input channels last ([out, kz, ky, kx, in]), the others at dim 1.
        assert shape[-1 if len(shape) == 5 else 1] == width, key


def test_an_opv2v_run_exports_one_net_epoch_file_that_loads_strictly(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/opv2v/point_pillar_intermediate_fusion.yaml",
                   "net_epoch1.pth", "net_epoch_bestval_at1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up", "--bestval")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == ["config.yaml", "net_epoch1.pth"]
    config = hypes_lib.load_hypes(tmp_path / "up" / "config.yaml")  # as written: the loader would drop batch_plan
    assert "batch_plan" not in config and config["model"]["core_method"] == "point_pillar_intermediate"
    exported = torch.load(tmp_path / "up" / "net_epoch1.pth", weights_only=True)
    # upstream's names, order and shapes
    assert [(k, list(v.shape)) for k, v in exported.items()] == reference_shapes("point_pillar_intermediate")


def test_a_toy_run_is_refused_with_the_widths_upstream_fixes(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/toy/point_pillar_intermediate_fusion.yaml", "net_epoch1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and not (tmp_path / "up").exists()
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert "backbone.blocks.0.1.weight takes 32 channels, upstream's code fixes 64" in result.stderr
    assert "cls_head.weight takes 192 channels, upstream's code fixes 384" in result.stderr


# V2VNet, V2X-ViT, CoBEVT and SECOND: the hypes files of each (hypes_yaml/opv2v/ and toy/), and what upstream's code
# fixes that the toy configs change, derived from upstream's classes (see export_upstream.FIXED_WIDTHS).
SPLIT_ATTN = "fusion_net.encoder.layers.0.0.layers.0.1.fn.split_attn."
BASELINES = {
    "point_pillar_v2vnet": ("point_pillar_v2vnet.yaml", {
        "backbone.blocks.0.1.weight": (32, 64), "cls_head.weight": (32, 256), "reg_head.weight": (32, 256)}),
    "point_pillar_transformer": ("point_pillar_v2xvit.yaml", {
        "backbone.blocks.0.1.weight": (32, 64), SPLIT_ATTN + "fc1.weight": (64, 256),
        SPLIT_ATTN + "fc2.weight": (64, 256), "cls_head.weight": (64, 256), "reg_head.weight": (64, 256)}),
    "point_pillar_cobevt": ("point_pillar_cobevt.yaml", {
        "backbone.blocks.0.1.weight": (32, 64), "cls_head.weight": (64, 256), "reg_head.weight": (64, 256)}),
    "second_intermediate": ("second_intermediate_fusion.yaml", {
        "backbone_2d.blocks.0.1.weight": (128, 256), "cls_head.weight": (128, 512), "reg_head.weight": (128, 512)}),
    "second": ("second_early_fusion.yaml", {
        "backbone_2d.blocks.0.1.weight": (128, 256), "cls_head.weight": (128, 512), "reg_head.weight": (128, 512)}),
}


@pytest.mark.parametrize("core_method", sorted(BASELINES))
def test_an_opv2v_run_of_each_baseline_exports_upstreams_state_dict(tmp_path, core_method):
    config = REPO / "hypes_yaml" / "opv2v" / BASELINES[core_method][0]
    run = make_run(tmp_path / "run", config, "net_epoch2.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == ["config.yaml", "net_epoch2.pth"]
    assert hypes_lib.load_hypes(tmp_path / "up" / "config.yaml")["model"]["core_method"] == core_method
    exported = torch.load(tmp_path / "up" / "net_epoch2.pth", weights_only=True)
    expected = reference_shapes(REFERENCE_LIST.get(core_method, core_method))
    assert [(k, list(v.shape)) for k, v in exported.items()] == expected
    if core_method == "second":  # upstream's Second makes batch_size maps; its inference.py feeds one sample a call
        assert hypes_lib.load_hypes(tmp_path / "up" / "config.yaml")["model"]["args"]["batch_size"] == 1


def test_a_run_of_v2v4reals_point_pillar_fax_exports_as_upstreams_cobevt(tmp_path):
    """The fork's name for upstream's CoBEVT class is written as upstream's name, with upstream's parameter names
    (the shapes are the fork's config's: its window of 4 makes a smaller relative-position table than OpenCOOD's 8)."""
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/v2v4real/point_pillar_cobevt.yaml", "net_epoch1.pth",
                   overrides=("model.core_method=point_pillar_fax",))
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 0, result.stderr
    assert hypes_lib.load_hypes(tmp_path / "up" / "config.yaml")["model"]["core_method"] == "point_pillar_cobevt"
    exported = torch.load(tmp_path / "up" / "net_epoch1.pth", weights_only=True)
    assert list(exported) == [name for name, _ in reference_shapes("point_pillar_cobevt")]
    assert all(torch.equal(exported[k], v) for k, v in torch.load(run / "net_epoch1.pth", weights_only=True).items())


def test_a_config_yaml_without_a_model_key_is_named_as_the_file_to_fix(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/opv2v/point_pillar_intermediate_fusion.yaml", "net_epoch1.pth")
    config = run / "config.yaml"
    hypes = yaml.safe_load(config.read_text())
    del hypes["model"]["args"]["anchor_number"]
    config.write_text(yaml.safe_dump(hypes, sort_keys=False))
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and not (tmp_path / "up").exists()
    assert result.stderr.startswith(f"error: {config} (hypes point_pillar_intermediate_fusion): missing key "
                                    f"model.args.anchor_number"), result.stderr


# The forks' layers upstream OpenCOOD's classes lack, in the configs that build them: (config, the key named).
FORKS = {"v2xset/point_pillar_v2vnet": "model.args.v2vfusion.use_temporal_encoding",
         "v2v4real/point_pillar_v2vnet": "model.args.v2vfusion.use_temporal_encoding",
         "v2v4real/point_pillar_early_fusion": "model.args.shrink_header",
         "v2xset/point_pillar_late_fusion": "model.args.shrink_header",
         "dairv2x/point_pillar_intermediate_fusion": "model.args.dir_args"}


@pytest.mark.parametrize("config", sorted(FORKS))
def test_the_forks_layers_are_named(config):
    """Upstream's load_saved_model loads with strict=False: a layer its class lacks would be dropped without a word,
    and upstream would run another model than the one trained. OpenCOOD's own configs have none."""
    hypes = hypes_of(config)
    said = export_upstream.fork_layers(hypes["model"]["core_method"], create_model(hypes).state_dict())
    assert len(said) == 1 and said[0].startswith(FORKS[config] + " ("), said
    opv2v = hypes_of(f"opv2v/{config.split('/')[1]}")
    assert export_upstream.fork_layers(opv2v["model"]["core_method"], create_model(opv2v).state_dict()) == []


def test_a_run_with_a_forks_layer_is_refused_before_its_widths(tmp_path):
    config = REPO / "hypes_yaml" / "v2xset" / "point_pillar_early_fusion.yaml"
    run = make_run(tmp_path / "run", config, "net_epoch1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and not (tmp_path / "up").exists()
    lines = result.stderr.strip().splitlines()
    said = "builds layers upstream OpenCOOD's point_pillar does not have: model.args.shrink_header"
    assert len(lines) == 1 and said in lines[0] and "takes 256 channels" not in lines[0], lines


@pytest.mark.parametrize("core_method", sorted(BASELINES))
def test_a_toy_run_of_each_baseline_is_refused_with_the_widths_upstream_fixes(tmp_path, core_method):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml" / "toy" / BASELINES[core_method][0], "net_epoch1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and not (tmp_path / "up").exists()
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    said = result.stderr.split(": ", 2)[2].split("; export a run")[0].split("; ")
    assert said == [f"{key} takes {ours} channels, upstream's code fixes {theirs}"
                    for key, (ours, theirs) in BASELINES[core_method][1].items()]


@pytest.mark.parametrize("core_method", [m for m in sorted(BASELINES) if not m.startswith("second")])
def test_the_naive_compressor_takes_upstreams_256_channels(core_method):
    """model.args.compression adds NaiveCompressor(256, ratio) upstream: the full-size config's compressor passes and
    its state dict is upstream's compressed one; the toy's compressor (on 32 or 64 channels) is named."""
    stem = BASELINES[core_method][0][:-len(".yaml")]
    full = create_model(hypes_of(f"opv2v/{stem}", "model.args.compression=32")).state_dict()
    assert export_upstream.width_problems(core_method, full) == []
    assert [(k, list(v.shape)) for k, v in full.items()] == reference_shapes(f"compression32/{core_method}")
    toy = create_model(hypes_of(f"toy/{stem}", "model.args.compression=32")).state_dict()
    ours = toy["naive_compressor.encoder.0.weight"].shape[1]
    assert (f"naive_compressor.encoder.0.weight takes {ours} channels, upstream's code fixes 256"
            in export_upstream.width_problems(core_method, toy))


def test_a_layer_the_config_leaves_out_is_not_asked_for_but_a_fixed_one_is():
    """No compressor under compression 0: upstream builds none either. A head, which upstream's class always builds,
    is named when missing."""
    state = create_model(hypes_of("opv2v/point_pillar_cobevt")).state_dict()
    assert "naive_compressor.encoder.0.weight" not in state
    assert export_upstream.width_problems("point_pillar_cobevt", state) == []
    state.pop("cls_head.weight")
    assert export_upstream.width_problems("point_pillar_cobevt", state) == [
        "cls_head.weight is missing, upstream's code builds it with 256 input channels"]


def test_a_run_of_step_checkpoints_only_is_said(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/opv2v/point_pillar_fcooper.yaml", "net_step5.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and "no net_epoch*.pth checkpoint (steps on disk: [5])" in result.stderr
    assert "--step K" in result.stderr


def test_a_step_without_its_training_state_names_the_missing_file(tmp_path):
    """The state says which epoch the step was saved in; without it the line was 'check --model_dir / --epoch'."""
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/opv2v/point_pillar_fcooper.yaml", "net_step5.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up", "--step", "5")
    assert result.returncode == 2, result.stderr
    assert "net_step5.pth has no training_state_step5.pt beside it" in result.stderr and "--epoch N" in result.stderr
    assert not (tmp_path / "up").exists()
