"""Upstream OpenCOOD's own run folders: the config.yaml its train.py writes, read as upstream reads it back.

Upstream's train.py writes a run's config.yaml with PyYAML's default Dumper (`yaml.dump`), after its yaml_parser has
run, and the parsers put a numpy int64 array in the hypes: `grid_size = round(range / voxel_size)`
(tests/reference/OPENCOOD_FACTS.md), under `model.args.point_pillar_scatter` for the pillar models and `model.args`
for SECOND. `yaml.dump` writes that array as a `!!python/object/apply:numpy...multiarray._reconstruct` call, which
upstream reads back with PyYAML's unsafe Loader (`--model_dir`: evaluation, and a training that goes on). Until
this file, our safe loader refused every such folder as "malformed YAML". The files here are written by PyYAML's own
`yaml.dump`, never by hand; what ours reads is compared with what PyYAML's unsafe loader builds from the same text.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launch import REPO, in_process
from zoo import hypes_of
from opencood_ddp.hypes import load_hypes, save_hypes
from opencood_ddp.models import create_model
from opencood_ddp.yaml_parsers import load_parsed_hypes

GRID_KEYS = {"opv2v/point_pillar_intermediate_fusion": ("model", "args", "point_pillar_scatter", "grid_size"),
             "opv2v/second_intermediate_fusion": ("model", "args", "grid_size")}
ATTFUSE = "toy/point_pillar_intermediate_fusion"


def as_upstream_holds_it(hypes: dict, grid_keys: tuple) -> dict:
    """The parsed hypes with the grid as upstream's yaml_parser leaves it: a numpy int64 array of the rounded
    range over the voxel size (the facts), in place of our list of ints."""
    *parents, last = grid_keys
    section = hypes
    for key in parents:
        section = section[key]
    preprocess = hypes["preprocess"]
    lidar_range, voxel = np.array(preprocess["cav_lidar_range"]), np.array(preprocess["args"]["voxel_size"])
    section[last] = np.round((lidar_range[3:] - lidar_range[:3]) / voxel).astype(np.int64)
    return hypes


def unsafe_plain(text: str):
    """What upstream's loader (PyYAML's unsafe Loader) builds from `text`, with its numpy arrays as lists."""
    def plain(value):
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
    return plain(yaml.load(text, Loader=yaml.UnsafeLoader))


@pytest.mark.parametrize("numpy_module", ["numpy._core", "numpy.core"], ids=["numpy2", "numpy1"])
@pytest.mark.parametrize("config", sorted(GRID_KEYS))
def test_a_config_yaml_dumped_as_upstream_dumps_it_reads_as_pyyamls_own_loader_reads_it(tmp_path, config,
                                                                                       numpy_module):
    """Both module names numpy writes (numpy 2's `numpy._core`, numpy 1's `numpy.core`, whose text is the same
    otherwise); the array reads as a list of Python ints, and the parsed hypes equal the shipped file's."""
    parsed = hypes_of(config)
    text = yaml.dump(as_upstream_holds_it(hypes_of(config), GRID_KEYS[config]))
    assert "grid_size: !!python/object/apply:numpy._core.multiarray._reconstruct" in text  # numpy 2 here
    text = text.replace("numpy._core.multiarray", f"{numpy_module}.multiarray")
    path = tmp_path / "config.yaml"
    path.write_text(text)

    ours = load_hypes(path)
    assert ours == unsafe_plain(text)
    grid = ours
    for key in GRID_KEYS[config]:
        grid = grid[key]
    assert all(type(size) is int for size in grid) and len(grid) == 3
    assert load_parsed_hypes(path) == parsed


def test_a_tuple_in_a_dumped_config_reads_as_a_list(tmp_path):
    """`!!python/tuple` (a parser that makes a tuple, e.g. upstream's BEV `input_shape`) reads as a list, as the
    hypes of the file's other sequences."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.dump({"geometry_param": {"input_shape": (704, 200, 1), "res": 0.4}}))
    assert "!!python/tuple" in path.read_text()
    assert load_hypes(path) == {"geometry_param": {"input_shape": [704, 200, 1], "res": 0.4}}


def upstream_run_folder(folder: Path, toy_root: Path, dumped: bool) -> Path:
    """A run folder as upstream's train.py leaves it after one epoch: config.yaml (`yaml.dump` of its parsed
    hypes if `dumped`, else our own plain writer's) and net_epoch1.pth, a bare state_dict saved by torch.save."""
    folder.mkdir()
    hypes = hypes_of(ATTFUSE, toy_root=toy_root)
    if dumped:
        (folder / "config.yaml").write_text(yaml.dump(as_upstream_holds_it(hypes, GRID_KEYS[
            "opv2v/point_pillar_intermediate_fusion"])))
    else:
        save_hypes(hypes, folder / "config.yaml")
    torch.manual_seed(0)
    torch.save(create_model(hypes_of(ATTFUSE, toy_root=toy_root)).state_dict(), folder / "net_epoch1.pth")
    return folder


def test_an_upstream_run_folder_is_evaluated_as_ours_and_goes_on_training(toy_small, tmp_path):
    """inference_ddp on the folder gives the eval.yaml of the same weights under our plain config.yaml, and
    train_ddp goes on from its weights (upstream's `--model_dir`), as from weights alone."""
    evals = {}
    for dumped in (True, False):
        run = upstream_run_folder(tmp_path / f"dumped_{dumped}", toy_small, dumped)
        result = in_process(REPO / "tools" / "inference_ddp.py", "--model_dir", run, "--fusion_method",
                            "intermediate", "--num_workers", "0")
        assert result.returncode == 0, result.stderr
        evals[dumped] = {key: value for key, value in yaml.safe_load((run / "eval.yaml").read_text()).items()
                         if key != "seconds"}
    assert evals[True] == evals[False]
    assert all(math.isfinite(evals[True][key]) for key in ("ap30", "ap_50", "ap_70"))
    assert evals[True]["frames"] > 0 and evals[True]["checkpoint"] == "net_epoch1.pth"

    run = tmp_path / "dumped_True"
    result = in_process(REPO / "tools" / "train_ddp.py", "--model_dir", run, "--num_workers", "0", "--set",
                        "train_params.epoches=2")
    assert result.returncode == 0, result.stderr
    assert "resumed from net_epoch1.pth (epoch 1)" in result.stdout
    assert (run / "net_epoch2.pth").is_file()
