"""tools/export_upstream.py: a folder upstream's scripts load as it is, and a refusal for widths upstream's code
cannot build."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import REPO
from zoo import hypes_of
from opencood_ddp import hypes as hypes_lib
from opencood_ddp.models import create_model

sys.path.insert(0, str(REPO / "tools"))
import export_upstream  # noqa: E402  (a tool, imported for its table)

EXPORT = REPO / "tools" / "export_upstream.py"
REFERENCE = REPO / "tests" / "reference" / "opencood_state_dict"


def make_run(folder: Path, config: Path, *extra: str) -> Path:
    """A run folder as train_ddp.py leaves it: config.yaml (parsed, with a batch plan) and checkpoints."""
    hypes = hypes_of(config)
    folder.mkdir(parents=True)
    hypes_lib.save_hypes(dict(hypes, batch_plan={"global_batch": 2}), folder / "config.yaml")
    torch.manual_seed(0)
    state = create_model(hypes).state_dict()
    for name in extra:
        torch.save(state, folder / name)
    return folder


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, EXPORT, *map(str, args)], capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize("core_method", sorted(export_upstream.FIXED_WIDTHS))
def test_the_fixed_widths_are_upstreams_shapes(core_method):
    shapes = dict((name, ast.literal_eval(shape)) for name, shape in
                  (row.split("\t") for row in (REFERENCE / f"{core_method}.tsv").read_text().splitlines()))
    for key, width in export_upstream.FIXED_WIDTHS[core_method].items():
        assert shapes[key][1] == width, key


def test_an_opv2v_run_exports_one_net_epoch_file_that_loads_strictly(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/opv2v/point_pillar_intermediate_fusion.yaml",
                   "net_epoch1.pth", "net_epoch_bestval_at1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up", "--bestval")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "up").iterdir()) == ["config.yaml", "net_epoch1.pth"]
    config = hypes_lib.load_hypes(tmp_path / "up" / "config.yaml")  # as written: the loader would drop batch_plan
    assert "batch_plan" not in config and config["model"]["core_method"] == "point_pillar_intermediate"
    exported = torch.load(tmp_path / "up" / "net_epoch1.pth", weights_only=True)
    reference = [(row.split("\t")[0], ast.literal_eval(row.split("\t")[1]))
                 for row in (REFERENCE / "point_pillar_intermediate.tsv").read_text().splitlines()]
    assert [(k, list(v.shape)) for k, v in exported.items()] == reference  # upstream's names, order, shapes


def test_a_toy_run_is_refused_with_the_widths_upstream_fixes(tmp_path):
    run = make_run(tmp_path / "run", REPO / "hypes_yaml/toy/point_pillar_intermediate_fusion.yaml", "net_epoch1.pth")
    result = export("--model_dir", run, "--out", tmp_path / "up")
    assert result.returncode == 2 and not (tmp_path / "up").exists()
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert "backbone.blocks.0.1.weight takes 32 channels, upstream's code fixes 64" in result.stderr
    assert "cls_head.weight takes 192 channels, upstream's code fixes 384" in result.stderr


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
