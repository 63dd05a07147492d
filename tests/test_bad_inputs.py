"""The bad-input table (issue 7, point 7), row by row: every row in this process, through the tool's own
`__main__` and the engine's one entry path (`run_distributed` at world size 1, as a plain `python` start takes;
the unwritable-run rows as root in a new plain `python` process that permission bits bind, `honouring_modes`),
and one row per way of failing also on 2 torchrun ranks (3 where the row is about the world size): a refused
config, data that cannot be read mid-epoch (in training and in evaluation), a bad checkpoint. How a row fails does
not depend on the process count except through those paths: the agreement of the ranks on one rank's error is
what the torchrun rows prove.

Every bad input must end the same way: exactly one `error: ...` line on stderr, from rank 0, naming the file or
the hypes key at fault and the fix; a non-zero exit within seconds (a hang would be a 30-minute collective
timeout); and, where the bad input comes with the --model_dir of an existing run, not one file of that run
changed. docs/reliability.md ("Bad inputs") is this file as a table; the test ids read as its rows.

Two tiny real runs serve as "existing runs" (copied before each use): a synthetic one for the rows that have
nothing to do with OPV2V, and a 1-epoch F-Cooper run on the toy world for the checkpoint and inference rows.

"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import yaml

from launch import (REPO, TRAIN, dairv2x_overrides, explain, in_process, python, split_set_flags, torchrun,
                    v2v4real_overrides)


INFERENCE = REPO / "tools" / "inference_ddp.py"
TOY = REPO / "hypes_yaml" / "toy"
FCOOPER = TOY / "point_pillar_fcooper.yaml"
EARLY = TOY / "point_pillar_early_fusion.yaml"
SYNTHETIC = TOY / "synthetic_bn.yaml"
WALL_LIMIT_S = 60  # generous on a loaded 2-core machine; the point is "seconds, not a 30-minute timeout"
WORLDS = {0: "in-process", 2: "2ranks", 3: "3ranks"}  # 0: this process, as a plain `python` start


def root_ignores_modes() -> bool:
    """True when running as root with the capability to write into a chmod 0o555 folder (the usual root; not a
    root whose CAP_DAC_OVERRIDE was dropped, e.g. `setpriv --bounding-set=-dac_override,-dac_read_search`)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "read_only"
        folder.mkdir(mode=0o555)
        try:
            return os.access(folder, os.W_OK)
        finally:
            folder.chmod(0o755)




# ------------------------------------------------------------------------------------------------ existing runs
@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> Path:
    """A finished 1-epoch run of the synthetic task (config.yaml, net_epoch1.pth, training state, logs)."""
    run_dir = tmp_path_factory.mktemp("bad_inputs") / "synthetic"
    result = in_process(TRAIN, "--hypes_yaml", SYNTHETIC, "--model_dir", run_dir, "--num_workers", "0",
                        "--set", "train_params.epoches=1")
    assert result.returncode == 0, explain(result)
    return run_dir


@pytest.fixture(scope="module")
def toy_run(toy_small, tmp_path_factory) -> Path:
    """A finished 1-epoch F-Cooper run on the small toy world: 4 steps of 2 frames, validated on 4 frames."""
    run_dir = tmp_path_factory.mktemp("bad_inputs") / "fcooper"
    result = in_process(TRAIN, "--hypes_yaml", FCOOPER, "--model_dir", run_dir, "--num_workers", "0",
                        *split_set_flags(toy_small), "--set", "train_params.epoches=1")
    assert result.returncode == 0, explain(result)
    assert (run_dir / "net_epoch1.pth").is_file()
    return run_dir


def snapshot(folder: Path) -> dict:
    """relative path -> (size, sha256) of every file under `folder`."""
    return {str(p.relative_to(folder)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def changed_files(before: dict, after: dict) -> list[str]:
    return sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


# ------------------------------------------------------------------------------------------------ the table
@dataclass
class Call:
    """One bad invocation and what its error line must contain."""

    script: Path
    args: list
    needles: list  # substrings of the one error line: the file or key at fault, and the fix
    existing_run: Optional[Path] = None  # a folder that must come out byte for byte as it went in
    not_created: Optional[Path] = None  # a new --model_dir that a refused run must not leave behind
    resumes: bool = False  # train_ddp.py resuming existing_run (see WRITTEN_BEFORE_RESTORE)
    needs_modes: bool = False  # the row is a folder's permission bits: run where they hold (`honouring_modes`)


@dataclass
class World:
    """What a row's setup may use: a private tmp folder, the toy world and the two existing runs."""

    tmp: Path
    toy_root: Path
    runs: dict = field(default_factory=dict)  # name -> fixture run (never modified: copy_run first)
    dairv2x_root: Optional[Path] = None  # the DAIR-V2X-C-layout toy copy (its data_dir; copy_dairv2x first)
    v2v4real_root: Optional[Path] = None  # the V2V4Real-layout toy copy

    def copy_run(self, name: str) -> Path:
        target = self.tmp / f"existing_{name}"
        shutil.copytree(self.runs[name], target)
        return target

    def toy_args(self, *extra: str) -> list:
        return ["--hypes_yaml", FCOOPER, "--model_dir", self.tmp / "new_run", *split_set_flags(self.toy_root),
                "--num_workers", "0", "--set", "train_params.epoches=1", *extra]

    def copy_train_split(self) -> Path:
        target = self.tmp / "train"
        shutil.copytree(self.toy_root / "train", target)
        return target

    def copy_dairv2x(self) -> Path:
        target = self.tmp / "dairv2x"
        shutil.copytree(self.dairv2x_root, target)
        return target

    def dairv2x_args(self, data_dir: Path) -> list:
        """A new toy F-Cooper run on a DAIR-V2X-C data_dir."""
        return [*self.toy_args(), *dairv2x_overrides(data_dir)]

    def v2v4real_args(self, root: Path) -> list:
        return [*self.toy_args(), *v2v4real_overrides(root)]


def first_sample_of_last_rank(samples: int, world: int, seed: int = 0) -> int:
    """The first training sample the last rank reads (the only rank at world 1): the trainer deals samples with
    torch's DistributedSampler(shuffle=True, seed=train_params.seed, drop_last)."""
    from torch.utils.data import DistributedSampler

    replicas = max(world, 1)
    return list(DistributedSampler(range(samples), num_replicas=replicas, rank=replicas - 1, shuffle=True,
                                   seed=seed, drop_last=True))[0]


def first_frame_of_last_rank(split: Path, world: int, seed: int = 0) -> tuple[Path, Path]:
    """(yaml, pcd) of the ego CAV in the first training sample the last rank reads (the only rank at world 1).

    The frame rank 0 does not read is the case the per-step agreement exists for."""

    from opencood_ddp.data.opv2v import scan_split

    index = scan_split(split)
    scenario, timestamp = index.locate(first_sample_of_last_rank(len(index), world, seed))
    return scenario.ego.yaml_path(timestamp), scenario.ego.pcd_path(timestamp)


def early_fusion_weights(path: Path) -> None:
    """A state_dict of the early-fusion PointPillar (no shrink header, other head widths) written at `path`."""
    from opencood_ddp.models import create_model
    from zoo import hypes_of

    torch.save(create_model(hypes_of(EARLY)).state_dict(), path)


# One function per row (variant): World, world size -> Call.
def malformed_yaml(w: World, world: int) -> Call:
    bad = w.tmp / "bad.yaml"
    bad.write_text("name: x\ntrain_params: {batch_size: 2\noptimizer: {lr: 0.1}\n")
    return Call(TRAIN, ["--hypes_yaml", bad, "--model_dir", w.tmp / "new_run"],
                [str(bad), "malformed YAML at line", "fix the file"], not_created=w.tmp / "new_run")


def python_tag_in_hypes(w: World, world: int) -> Call:
    """A hypes file whose tag would run a command under PyYAML's unsafe loader (upstream's): refused, never run.
    The command would create the run folder's path, which a refused run does not create either."""
    bad, run = w.tmp / "tagged.yaml", w.tmp / "new_run"
    bad.write_text(f"name: x\nroot_dir: !!python/object/apply:os.system ['touch {run}']\n")
    return Call(TRAIN, ["--hypes_yaml", bad, "--model_dir", run],
                [str(bad), "unsupported YAML tag at line 2", "os.system", "fix the file"], not_created=run)


def unknown_name(key: str, value: str) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        return Call(TRAIN, w.toy_args("--set", f"{key}={value}"),
                    [f"{FCOOPER} with --set (hypes point_pillar_fcooper_toy): {key}", repr(value), "one of",
                     "fix the hypes"], not_created=w.tmp / "new_run")
    return setup


def mistyped_key(w: World, world: int) -> Call:
    """--set train_params.batch_sise=4 once trained with the baseline's batch, exit 0 (issue 17 item 1)."""
    return Call(TRAIN, w.toy_args("--set", "train_params.batch_sise=4"),
                ["unknown key train_params.batch_sise", "did you mean train_params.batch_size?", "fix the spelling"],
                not_created=w.tmp / "new_run")


def mistyped_key_in_file(w: World, world: int) -> Call:
    hypes = yaml.safe_load(FCOOPER.read_text())
    hypes["model"]["args"]["pillar_vfe"]["use_nrom"] = hypes["model"]["args"]["pillar_vfe"].pop("use_norm")
    path = w.tmp / "mistyped.yaml"
    path.write_text(yaml.safe_dump(hypes, sort_keys=False))
    return Call(TRAIN, ["--hypes_yaml", path, *w.toy_args()[2:]],
                [f"{path} with --set (hypes point_pillar_fcooper_toy): unknown key model.args.pillar_vfe.use_nrom",
                 "did you mean model.args.pillar_vfe.use_norm?"],
                not_created=w.tmp / "new_run")


def mistyped_key_on_resume(w: World, world: int) -> Call:
    run = w.copy_run("fcooper")
    return Call(TRAIN, ["--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2",
                        "--set", "optimizer.lr_decay=0.5"],
                [f"{run / 'config.yaml'} with --set (hypes point_pillar_fcooper_toy): unknown key optimizer.lr_decay"],
                existing_run=run,
                resumes=True)


def not_utf8_hypes(w: World, world: int) -> Call:
    path = w.tmp / "latin1.yaml"
    path.write_bytes(FCOOPER.read_text().replace("# F-Cooper", "# F-Cooper caf\u00e9").encode("latin-1"))
    return Call(TRAIN, ["--hypes_yaml", path, *w.toy_args()[2:]], [str(path), "not UTF-8 text", "save it as UTF-8"],
                not_created=w.tmp / "new_run")


def negative_lr(w: World, world: int) -> Call:
    return Call(TRAIN, w.toy_args("--set", "optimizer.lr=-0.1"),
                ["optimizer.lr rejected by torch.optim.Adam", "Invalid learning rate: -0.1", "--set optimizer.lr"],
                not_created=w.tmp / "new_run")


def heads_off_the_anchors(w: World, world: int) -> Call:
    """The heads made for 3 anchors per cell, the anchors 2 (was: trained, then a traceback in the loss)."""
    return Call(TRAIN, w.toy_args("--set", "model.args.anchor_number=3"),
                ["differs from model.args.anchor_number (3)", "make them equal"], not_created=w.tmp / "new_run")


def size_beyond_memory(w: World, world: int) -> Call:
    """A voxel buffer of 238 GiB (was: spconv's allocation error, a traceback from the loader's first sample)."""
    return Call(TRAIN, w.toy_args("--set", "preprocess.args.max_voxel_train=1000000000"),
                ["preprocess.args.max_voxel_train (1000000000) x max_points_per_voxel", "the voxelizer's voxel buffer",
                 "more than this machine's", "lower them"], not_created=w.tmp / "new_run")


def width_beyond_memory(w: World, world: int) -> Call:
    """A width whose weights no machine's address space holds (was: torch's allocator's traceback)."""
    return Call(TRAIN, w.toy_args("--set", "model.args.base_bev_backbone.num_filters.0=1000000000000"),
                ["its parameters do not fit in this machine's", "was refused",
                 "lower model.args.base_bev_backbone.num_filters[0] (1000000000000)"], not_created=w.tmp / "new_run")


def repeats_beyond_count(w: World, world: int) -> Call:
    """10**9 convolutions in a level (was: built one by one, for ever, with no error)."""
    return Call(TRAIN, w.toy_args("--set", "model.args.base_bev_backbone.layer_nums.0=1000000000"),
                ["base_bev_backbone.layer_nums must be a non-empty list of integers from 0 to 1000"],
                not_created=w.tmp / "new_run")


def parser_derived_key_set(w: World, world: int) -> Call:
    """A key the yaml_parser writes whatever the hypes held (was: trained with the parser's 240, without a word)."""
    return Call(TRAIN, w.toy_args("--set", "postprocess.anchor_args.W=100"),
                ["--set postprocess.anchor_args.W=100: yaml_parser load_point_pillar_params derives "
                 "postprocess.anchor_args.W from preprocess.cav_lidar_range and preprocess.args.voxel_size",
                 "set those instead"], not_created=w.tmp / "new_run")


def model_changed_on_resume(w: World, world: int) -> Call:
    """Another model whose weights happen to fit (here: the synthetic task's data seed, a data section) once
    resumed silently (issue 17 item 4)."""
    run = w.copy_run("synthetic")
    return Call(TRAIN, ["--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2",
                        "--set", "synthetic.data_seed=5"],
                ["net_epoch1.pth was trained with other hypes sections synthetic", "--allow_config_change"],
                existing_run=run, resumes=True)


def history_without_checkpoint(w: World, world: int) -> Call:
    """A run whose checkpoints are gone once printed "(resuming)", trained from scratch and replaced its history."""
    run = w.copy_run("synthetic")
    for path in list(run.glob("net_*.pth")) + list(run.glob("training_state_*.pt")):
        path.unlink()
    return Call(TRAIN, ["--model_dir", run, "--num_workers", "0"],
                [str(run), "has a history (train_steps.csv: 10 steps) but no checkpoint", "--restart"],
                existing_run=run, resumes=True)


def batch_larger_than_the_split(w: World, world: int) -> Call:
    """Refused after the new run's folder was made: it left config.yaml, and the corrected command then resumed
    the old settings (issue 18 item 2)."""
    return Call(TRAIN, ["--hypes_yaml", SYNTHETIC, "--model_dir", w.tmp / "new_run", "--num_workers", "0",
                        "--set", "synthetic.num_train=4"],
                ["the training split has 4 samples, fewer than one effective batch of 8"],
                not_created=w.tmp / "new_run")


def missing_key(w: World, world: int) -> Call:
    hypes = yaml.safe_load(FCOOPER.read_text())
    del hypes["preprocess"]["args"]["voxel_size"]
    path = w.tmp / "no_voxel_size.yaml"
    path.write_text(yaml.safe_dump(hypes, sort_keys=False))
    return Call(TRAIN, ["--hypes_yaml", path, *w.toy_args()[2:]],
                [str(path), "missing key preprocess.args.voxel_size", "--set"], not_created=w.tmp / "new_run")


def impossible_batch_split(w: World, world: int) -> Call:
    run = w.copy_run("synthetic")  # batch_size 8: resumed on 3 ranks, or with 3 per process on 1 and 2
    flags = [] if world == 3 else ["--per_gpu_batch", "3"]
    fix = "world size in [1, 2, 4, 8]"
    return Call(TRAIN, ["--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2", *flags],
                ["train_params.batch_size 8 cannot be split", fix], existing_run=run, resumes=True)


def missing_data_folder_train(w: World, world: int) -> Call:
    missing = w.tmp / "no_such_split"
    return Call(TRAIN, w.toy_args("--set", f"root_dir={missing}"), [f"root_dir {missing}", "not found", "set root_dir"],
                not_created=w.tmp / "new_run")


def missing_data_folder_inference(w: World, world: int) -> Call:
    run, missing = w.copy_run("fcooper"), w.tmp / "no_such_split"
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir", missing,
                            "--num_workers", "0"], [f"--dataset_dir {missing}", "not found", "pass --dataset_dir"],
                existing_run=run)


def moved_run_inference(w: World, world: int) -> Call:
    """A run folder from another machine (ours or upstream's): its config.yaml's validate_dir is a path that does
    not exist here. inference_ddp has no --set: the line names the flag it has."""
    run, missing = w.copy_run("fcooper"), w.tmp / "elsewhere" / "validate"
    config = run / "config.yaml"
    text, moved = re.subn(r"(?m)^validate_dir: .*$", f"validate_dir: {missing}", config.read_text())
    assert moved == 1
    config.write_text(text)
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--num_workers", "0"],
                [f"validate_dir {missing}", "not found", "pass --dataset_dir (or edit validate_dir in the run's "
                 "config.yaml"], existing_run=run)


def missing_key_inference(w: World, world: int) -> Call:
    """A run whose config.yaml lacks a key the model needs (edited by hand, or written by upstream's training,
    which checks less): the line names that config.yaml, not the run's name alone."""
    run = w.copy_run("fcooper")
    config = run / "config.yaml"
    hypes = yaml.safe_load(config.read_text())
    del hypes["model"]["args"]["anchor_number"]
    config.write_text(yaml.safe_dump(hypes, sort_keys=False))
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--num_workers", "0"],
                [f"{config} (hypes point_pillar_fcooper_toy): missing key model.args.anchor_number"],
                existing_run=run)


def empty_split(w: World, world: int) -> Call:
    empty = w.tmp / "empty_split"
    empty.mkdir()
    return Call(TRAIN, w.toy_args("--set", f"validate_dir={empty}"),
                [f"validate_dir {empty}", "empty split", "set validate_dir"], not_created=w.tmp / "new_run")


def corrupt_pcd(workers: int) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        split = w.copy_train_split()
        _, pcd = first_frame_of_last_rank(split, world)
        data = pcd.read_bytes()
        pcd.write_bytes(data[: len(data) // 2])  # an interrupted copy: the header is whole, the body ends mid-line
        return Call(TRAIN, w.toy_args("--set", f"root_dir={split}", "--num_workers", str(workers)),
                    [str(pcd), "re-download or re-export"])
    return setup


def frame_file_unwritable(w: World, world: int) -> Call:
    """A folder where --save_npy puts a frame's file (was an IsADirectoryError traceback on the rank that
    evaluated the frame and a peer's "Connection closed" traceback on 2 ranks). No npy/ is published."""
    run, frame = w.copy_run("fcooper"), 3  # the test split's last frame
    blocked = run / "npy.eval.partial" / f"{frame:04d}_pred.npy"
    blocked.mkdir(parents=True)
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir",
                            w.toy_root / "test", "--num_workers", "0", "--save_npy"],
                [f"cannot write frame {frame}'s --save_npy / --save_vis file {blocked}", "Is a directory",
                 "then evaluate again"], not_created=run / "npy")


def eval_yaml_a_folder(w: World, world: int) -> Call:
    """Rank 0's result file cannot be written after the whole evaluation (was a traceback)."""
    run = w.copy_run("fcooper")
    (run / "eval.yaml").mkdir()
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir",
                            w.toy_root / "test", "--num_workers", "0"],
                [f"cannot write eval.yaml {run / 'eval.yaml'}", "Is a directory"])


def corrupt_pcd_inference(w: World, world: int) -> Call:
    """A truncated .pcd in the split being evaluated, in the last rank's shard (its first frame)."""
    from opencood_ddp.data.opv2v import scan_split
    from opencood_ddp.distributed.samplers import shard_bounds

    run, split = w.copy_run("fcooper"), w.copy_train_split()
    index = scan_split(split)
    scenario, timestamp = index.locate(shard_bounds(len(index), max(world, 1), max(world, 1) - 1)[0])
    pcd = scenario.ego.pcd_path(timestamp)
    pcd.write_bytes(pcd.read_bytes()[: pcd.stat().st_size // 2])
    return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir", split,
                            "--num_workers", "0"], [str(pcd), "re-download or re-export"], existing_run=run)


def no_lidar_pose(w: World, world: int) -> Call:
    split = w.copy_train_split()
    frame_yaml, _ = first_frame_of_last_rank(split, world)
    params = yaml.safe_load(frame_yaml.read_text())
    del params["lidar_pose"]
    frame_yaml.write_text(yaml.safe_dump(params))
    return Call(TRAIN, w.toy_args("--set", f"root_dir={split}"), [str(frame_yaml), "lidar_pose", "re-export"])


def truncated_checkpoint(tool: str) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        run = w.copy_run("fcooper")
        weights = run / "net_epoch1.pth"  # the run's only epoch checkpoint
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        fix = "delete" if tool == "train" else "restore it, or take another checkpoint of the run"
        return _checkpoint_call(tool, run, [str(weights), "truncated or corrupt", fix])
    return setup


def foreign_checkpoint(tool: str) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        run = w.copy_run("fcooper")  # config.yaml: point_pillar_fcooper; weights: the early-fusion model's
        early_fusion_weights(run / "net_epoch1.pth")
        needles = [str(run / "net_epoch1.pth"), "does not match the model"]
        # resume: no other checkpoint to fall back to; inference: the file asked for
        needles.append("no earlier checkpoint of this run loads; restore or delete" if tool == "train"
                       else "model.core_method")
        return _checkpoint_call(tool, run, needles)
    return setup


def dairv2x_missing_label(w: World, world: int) -> Call:
    """A training frame (the last rank's first) whose cooperative label file was never installed: mid-epoch."""
    data_dir = w.copy_dairv2x()
    frames = json.loads((data_dir / "train.json").read_text())
    label = data_dir / "cooperative" / "label_world" / f"{frames[first_sample_of_last_rank(len(frames), world)]}.json"
    label.unlink()
    return Call(TRAIN, w.dairv2x_args(data_dir), [str(label), "label file not found", "complemented labels go in"],
                not_created=w.tmp / "new_run")


def dairv2x_empty_offset(w: World, world: int) -> Call:
    data_dir = w.copy_dairv2x()
    info = data_dir / "cooperative" / "data_info.json"
    entries = json.loads(info.read_text())
    entries[0]["system_error_offset"] = {}
    info.write_text(json.dumps(entries))
    return Call(TRAIN, w.dairv2x_args(data_dir), [str(info), "system_error_offset of vehicle frame", "(no offset)"],
                not_created=w.tmp / "new_run")


def dairv2x_unknown_frame(w: World, world: int) -> Call:
    data_dir = w.copy_dairv2x()
    split = data_dir / "train.json"
    split.write_text(json.dumps(json.loads(split.read_text()) + ["999999"]))
    return Call(TRAIN, w.dairv2x_args(data_dir), [f"root_dir {split}", "vehicle frame 999999", "no entry in",
                                                  "use the split files"], not_created=w.tmp / "new_run")


def v2v4real_pose_not_4x4(w: World, world: int) -> Call:
    root = w.tmp / "v2v4real"
    shutil.copytree(w.v2v4real_root, root)
    frame_yaml, _ = first_frame_of_last_rank(root / "train", world)
    six_numbers = "lidar_pose: [1.0, 2.0, 0.0, 0.0, 90.0, 0.0]\n"
    frame_yaml.write_text(re.sub(r"lidar_pose: !!python[^\n]*\n(  .*\n)*", six_numbers, frame_yaml.read_text()))
    return Call(TRAIN, w.v2v4real_args(root), [str(frame_yaml), "4x4 LiDAR-to-world matrix", "re-export"],
                not_created=w.tmp / "new_run")


def _checkpoint_call(tool: str, run: Path, needles: list) -> Call:
    if tool == "inference":
        return Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--num_workers", "0"],
                    needles, existing_run=run)
    return Call(TRAIN, ["--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2"], needles,
                existing_run=run, resumes=True)


def unwritable_run(tool: str) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        if tool == "inference":
            run = w.copy_run("fcooper")
            call = Call(INFERENCE, ["--model_dir", run, "--fusion_method", "intermediate", "--num_workers", "0"],
                        [str(run), "not writable", "permissions"], existing_run=run)
        else:
            run = w.copy_run("synthetic")
            call = Call(TRAIN, ["--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2"],
                        [str(run), "not writable", "permissions"], existing_run=run, resumes=True)
        run.chmod(0o555)
        call.needs_modes = True
        return call
    return setup


def not_a_run(tool: str) -> Callable[[World, int], Call]:
    def setup(w: World, world: int) -> Call:
        folder = w.tmp / "someone_elses"
        folder.mkdir()
        (folder / "notes.txt").write_text("keep me\n")
        (folder / "net_epoch1.pth").write_bytes(b"not a checkpoint either")
        if tool == "inference":
            return Call(INFERENCE, ["--model_dir", folder, "--fusion_method", "intermediate", "--num_workers", "0"],
                        [str(folder / "config.yaml"), "does not exist", "pass --model_dir of a training run"],
                        existing_run=folder)
        return Call(TRAIN, ["--hypes_yaml", SYNTHETIC, "--model_dir", folder, "--num_workers", "0"],
                    [str(folder), "is not a run", "pass a run folder"], existing_run=folder)
    return setup


# Root writes into a chmod 0o555 folder through CAP_DAC_OVERRIDE. setpriv drops it (and CAP_DAC_READ_SEARCH) from
# the bounding set of the program it starts, which for root leaves them out of that program's capabilities: the
# folder's bits then hold, as for any other user.
DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def can_drop_dac() -> bool:
    """Whether setpriv is there and may drop those capabilities (it needs CAP_SETPCAP, which a container may lack)."""
    if shutil.which("setpriv") is None:
        return False
    return subprocess.run([*DROP_DAC, "true"], capture_output=True).returncode == 0


ROOT_IGNORES_MODES = root_ignores_modes()
UNWRITABLE = pytest.mark.skipif(ROOT_IGNORES_MODES and not can_drop_dac(),
                                reason="running as root, which ignores permission bits, and setpriv cannot drop that "
                                       "capability here: a chmod 0o555 folder stays writable, so this row cannot be "
                                       "produced")


def honouring_modes(call: Call) -> subprocess.CompletedProcess:
    """The row's tool as a plain `python` start where permission bits hold: in this process for a user they bind,
    as root a new process without CAP_DAC_OVERRIDE (DROP_DAC)."""
    if not ROOT_IGNORES_MODES:
        return in_process(call.script, *call.args)
    return python(call.script, *call.args, timeout=3 * WALL_LIMIT_S, wrapper=DROP_DAC)


# (row id, setup, world sizes, marks by world size)
ROWS = [
    ("malformed-yaml", malformed_yaml, (0,), {}),
    ("python-tag-in-hypes", python_tag_in_hypes, (0,), {}),
    ("unknown-model", unknown_name("model.core_method", "point_pilar"), (0,), {}),
    ("unknown-loss", unknown_name("loss.core_method", "focal_loss"), (0,), {}),
    ("unknown-fusion", unknown_name("fusion.core_method", "IntermediateFusion"), (0,), {}),
    ("missing-key", missing_key, (0,), {}),
    ("mistyped-key", mistyped_key, (0, 2), {}),
    ("not-utf8-hypes", not_utf8_hypes, (0,), {}),
    ("negative-lr", negative_lr, (0,), {}),
    ("heads-off-the-anchors", heads_off_the_anchors, (0,), {}),
    ("size-beyond-memory", size_beyond_memory, (0,), {}),
    ("width-beyond-memory", width_beyond_memory, (0,), {}),
    ("repeats-beyond-count", repeats_beyond_count, (0,), {}),
    ("parser-derived-key-set", parser_derived_key_set, (0,), {}),
    ("mistyped-key-in-file", mistyped_key_in_file, (0,), {}),
    ("mistyped-key-on-resume", mistyped_key_on_resume, (0,), {}),
    ("model-changed-on-resume", model_changed_on_resume, (0,), {}),
    ("history-without-checkpoint", history_without_checkpoint, (0,), {}),
    ("batch-larger-than-the-split", batch_larger_than_the_split, (0,), {}),
    ("impossible-batch-split", impossible_batch_split, (0, 3), {}),
    ("missing-data-folder", missing_data_folder_train, (0,), {}),
    ("missing-data-folder-inference", missing_data_folder_inference, (0,), {}),
    ("moved-run-inference", moved_run_inference, (0,), {}),
    ("missing-key-inference", missing_key_inference, (0,), {}),
    ("empty-split", empty_split, (0,), {}),
    ("corrupt-pcd", corrupt_pcd(workers=0), (0, 2), {}),
    ("corrupt-pcd-inference", corrupt_pcd_inference, (0, 2), {}),
    ("frame-file-unwritable", frame_file_unwritable, (0, 2), {}),
    ("eval-yaml-a-folder", eval_yaml_a_folder, (0, 2), {}),
    ("corrupt-pcd-loader-worker", corrupt_pcd(workers=1), (0,), {}),
    ("no-lidar-pose", no_lidar_pose, (0,), {}),
    ("truncated-checkpoint-inference", truncated_checkpoint("inference"), (0,), {}),
    ("truncated-checkpoint-resume", truncated_checkpoint("train"), (0, 2), {}),
    ("foreign-checkpoint-inference", foreign_checkpoint("inference"), (0,), {}),
    ("foreign-checkpoint-resume", foreign_checkpoint("train"), (0,), {}),
    ("unwritable-run-resume", unwritable_run("train"), (0,), {0: UNWRITABLE}),
    ("unwritable-run-inference", unwritable_run("inference"), (0,), {0: UNWRITABLE}),
    ("not-a-run-train", not_a_run("train"), (0,), {}),
    ("not-a-run-inference", not_a_run("inference"), (0,), {}),
    ("dairv2x-missing-label-file", dairv2x_missing_label, (0, 2), {}),
    ("dairv2x-empty-system-error-offset", dairv2x_empty_offset, (0, 2), {}),
    ("dairv2x-split-id-without-data-info", dairv2x_unknown_frame, (0, 2), {}),
    ("v2v4real-pose-not-4x4", v2v4real_pose_not_4x4, (0, 2), {}),
]

# The torchrun rows start processes: `make test` runs them, `make test-fast` does not.
CASES = [pytest.param(setup, world, id=f"{row}-{WORLDS[world]}",
                      marks=[*([marks[world]] if world in marks else []), *([pytest.mark.slow] if world else [])])
         for row, setup, worlds, marks in ROWS for world in worlds]


# An error line, alone or glued to the end of a progress bar that the failing loop left open ("... 0/4 [00:00<?,
# ?it/s]error: ..."): the second is a known defect, reported apart from the message itself.
ERROR_LINE = re.compile(r"^(?P<bar>.*\d+/\d+ \[[^\]]*\])?(?P<line>error: .*)$")


def error_lines(stderr: str) -> list[tuple[str, bool]]:
    """(the `error:` line, whether a progress bar precedes it on the same line) for every error line."""
    found = (ERROR_LINE.match(line) for line in stderr.splitlines())
    return [(match["line"], bool(match["bar"])) for match in found if match]


def restore_modes(folder: Path) -> None:
    """Undo a chmod 0o555 so that pytest can remove the tmp folder."""
    if folder.exists():
        folder.chmod(0o755)


@pytest.mark.parametrize("setup, world", CASES)
def test_bad_input(setup, world, tmp_path, toy_small, synthetic_run, toy_run, toy_dairv2x, toy_v2v4real):
    w = World(tmp_path, toy_small, {"synthetic": synthetic_run, "fcooper": toy_run}, toy_dairv2x, toy_v2v4real)
    call = setup(w, world)
    before = snapshot(call.existing_run) if call.existing_run is not None else None
    started = time.monotonic()
    try:
        if world == 0:
            result = honouring_modes(call) if call.needs_modes else in_process(call.script, *call.args)
        else:
            result = torchrun(world, call.script, *call.args, timeout=3 * WALL_LIMIT_S)
    finally:
        if call.existing_run is not None:
            restore_modes(call.existing_run)
    seconds = time.monotonic() - started

    assert result.returncode != 0, explain(result)
    assert seconds < WALL_LIMIT_S, f"took {seconds:.0f} s\n{explain(result)}"
    lines = error_lines(result.stderr)
    assert len(lines) == 1, explain(result)
    line, glued = lines[0]
    missing = [needle for needle in call.needles if needle not in line]
    assert not missing, f"{missing} not in {line!r}"
    assert f'File "{REPO / "opencood_ddp"}' not in result.stderr, f"a traceback from the project\n{explain(result)}"
    if call.not_created is not None:
        assert not call.not_created.exists(), "a refused run left its folder behind"
    if before is not None:
        changed = changed_files(before, snapshot(call.existing_run))
        assert not changed, f"files of the existing run changed: {changed}"
    assert not glued, f"the error line does not start a line of its own\n{explain(result)}"
    if world:  # torchrun's summary: our line for the rank that said it, and one exit code for every rank
        assert f"traceback : {line}" in result.stderr, explain(result)
        codes = set(re.findall(r"exitcode  : (-?\d+)", result.stderr))
        assert len(codes) == 1 and not codes & {"-15", "-9"}, explain(result)


def test_allow_config_change_resumes_with_a_warning_and_an_unchanged_config_resumes_quietly(synthetic_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(synthetic_run, run)
    same = in_process(TRAIN, "--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=2")
    assert same.returncode == 0 and "other hypes sections" not in same.stdout + same.stderr, explain(same)
    changed = in_process(TRAIN, "--model_dir", run, "--num_workers", "0", "--set", "train_params.epoches=3",
                         "--set", "synthetic.data_seed=5", "--allow_config_change")
    assert changed.returncode == 0, explain(changed)
    assert "net_epoch2.pth was trained with other hypes sections synthetic than this run has now; resuming " \
           "anyway (--allow_config_change)" in changed.stdout


def test_restart_trains_a_history_without_checkpoint_anew_and_config_yaml_wins_is_said(synthetic_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(synthetic_run, run)
    for path in list(run.glob("net_*.pth")) + list(run.glob("training_state_*.pt")):
        path.unlink()
    result = in_process(TRAIN, "--model_dir", run, "--hypes_yaml", SYNTHETIC, "--num_workers", "0", "--restart")
    assert result.returncode == 0, explain(result)
    assert f"its config.yaml wins over --hypes_yaml {SYNTHETIC} (upstream's rule); using {run / 'config.yaml'}" \
        in result.stdout
    assert (run / "net_epoch1.pth").is_file()

