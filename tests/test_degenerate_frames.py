"""Empty and degenerate frames: the same graph, the same steps and the same collectives on every rank.

Degenerate frames are made by editing copies of the small toy world: no object (``vehicles: {}``, or every vehicle
moved 1 km away, outside the GT range), no LiDAR point in the detection range (a .pcd with 0 points, or every point
lifted 100 m, above cav_lidar_range), and one CAV only (the cooperators' folders deleted). In every fusion style a
batch made only of such frames gives a finite loss and gradients on exactly the parameters of a normal batch, so
DDP without find_unused_parameters neither hangs nor errors; with 2 real torchrun ranks, a rank whose whole epoch
is empty frames, a world where every frame is empty, and a world of lone CAVs all train and checkpoint.
"""
from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import pytest
import torch
import yaml

from launch import REPO, explain, split_set_flags, train
from zoo import hypes_of
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.opv2v import load_opv2v_yaml
from opencood_ddp.data.pcd import read_pcd, write_pcd
from opencood_ddp.distributed.samplers import make_train_batch_sampler
from opencood_ddp.engine.evaluator import EvalRequest
from opencood_ddp.tasks.opencood import DetectionEvalOptions, build_eval, build_task

# The in-process checks run in both lanes; the real-rank trainings below are marked slow.

CONFIGS = ("point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
           "point_pillar_fcooper")
FUSION = {"point_pillar_early_fusion": "early", "point_pillar_late_fusion": "late",
          "point_pillar_intermediate_fusion": "intermediate", "point_pillar_fcooper": "intermediate"}


# ------------------------------------------------------------------------------------------- making frames
def frame_files(split: Path) -> Iterable[Tuple[Path, Path]]:
    """(yaml, pcd) of every CAV at every timestamp of a split folder."""
    for path in sorted(split.glob("*/*/*.yaml")):
        yield path, path.with_suffix(".pcd")


def drop_objects(yaml_path: Path) -> None:
    params = load_opv2v_yaml(yaml_path)
    params["vehicles"] = {}
    yaml_path.write_text(yaml.safe_dump(params))


def move_objects_away(yaml_path: Path) -> None:
    """Every vehicle 1 km away: the yaml still lists them, but none is inside the GT range."""
    params = load_opv2v_yaml(yaml_path)
    for vehicle in params["vehicles"].values():
        vehicle["location"] = [vehicle["location"][0] + 1000.0, vehicle["location"][1] + 1000.0,
                               vehicle["location"][2]]
    yaml_path.write_text(yaml.safe_dump(params))


def zero_points(pcd_path: Path) -> None:
    write_pcd(pcd_path, np.zeros((0, 4), dtype=np.float32))


def lift_points(pcd_path: Path) -> None:
    """The cloud is kept, 100 m up: above the detection range's z max, so cropping leaves nothing."""
    points = read_pcd(pcd_path)
    points[:, 2] += 100.0
    write_pcd(pcd_path, points)


def empty_frame(yaml_path: Path, pcd_path: Path, points: Callable[[Path], None] = zero_points) -> None:
    """No object and no point in range."""
    drop_objects(yaml_path)
    points(pcd_path)


def keep_ego_only(split: Path) -> None:
    for scenario in split.iterdir():
        cavs = sorted(p for p in scenario.iterdir() if p.is_dir())
        for cav in cavs[1:]:  # the reader's ego: the first folder in string order (the toy world has no RSU)
            shutil.rmtree(cav)


def edit_every_frame(split: Path, kind: str) -> None:
    """Make every frame of `split` degenerate; the two ways of having no object (or no point in range) alternate
    from one timestamp to the next, so a batch of two consecutive frames holds both."""
    if kind == "one_cav":
        keep_ego_only(split)
        return
    edits = {"no_objects": (lambda y, p: drop_objects(y), lambda y, p: move_objects_away(y)),
             "no_points": (lambda y, p: zero_points(p), lambda y, p: lift_points(p)),
             "empty": (lambda y, p: empty_frame(y, p, zero_points), lambda y, p: empty_frame(y, p, lift_points))}[kind]
    for n, (yaml_path, pcd_path) in enumerate(frame_files(split)):
        edits[n % 2](yaml_path, pcd_path)


KINDS = ("no_objects", "no_points", "empty", "one_cav")


def toy_hypes(config: str, split: Path) -> dict:
    """A toy config reading `split` for training and validation (the validation set is built, never read)."""
    return hypes_of(f"toy/{config}", f"root_dir={split}", f"validate_dir={split}")


@pytest.fixture(scope="module")
def worlds(toy_small, tmp_path_factory) -> Dict[str, Path]:
    """kind -> a train split in which every frame is degenerate that way ('normal': the toy split itself)."""
    root = tmp_path_factory.mktemp("degenerate_worlds")
    out = {"normal": toy_small / "train"}
    for kind in KINDS:
        split = root / kind / "train"
        shutil.copytree(toy_small / "train", split)
        edit_every_frame(split, kind)
        out[kind] = split
    return out


# ------------------------------------------------------------------------------------------- in-process
def one_step(config: str, split: Path, indices: Sequence[int] = (0, 1)):
    """A training batch of `indices`, forward + loss + backward on a fresh model (same seed every call)."""
    torch.manual_seed(0)
    task = build_task(toy_hypes(config, split), for_training=True)
    batch = task.collate_train([task.train_set[i] for i in indices])
    model = task.model.train()
    out = task.step(model, batch)
    out.total.backward()
    return task, batch, model, out


@pytest.fixture(scope="module")
def normal_params(worlds) -> Dict[str, set]:
    """config -> names of the parameters a normal batch gives a gradient (all of them)."""
    found = {}
    for config in CONFIGS:
        _, _, model, _ = one_step(config, worlds["normal"])
        found[config] = {name for name, p in model.named_parameters() if p.grad is not None}
        assert found[config] == {name for name, _ in model.named_parameters()}
    return found


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", CONFIGS)
def test_degenerate_batch_has_a_finite_loss_and_the_normal_gradient_set(worlds, normal_params, config, kind):
    _, batch, model, out = one_step(config, worlds[kind])
    assert math.isfinite(out.total.item())
    assert all(math.isfinite(v.item()) for v in out.parts.values())
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == normal_params[config]
    assert all(torch.isfinite(g).all() for g in grads.values())

    ego = batch["ego"]
    pillars = ego["processed_lidar"]["voxel_features"].shape[0]
    objects = int(ego["object_bbx_mask"].sum())
    if kind in ("no_objects", "empty"):
        assert objects == 0
        assert out.parts["reg"].item() == 0.0  # no positive anchor: regression weighs nothing...
        assert out.parts["cls"].item() > 0.0  # ...every anchor is a negative of the focal loss
        assert torch.count_nonzero(model.reg_head.weight.grad) == 0  # present, and zero
    if kind in ("no_points", "empty"):
        assert pillars == 0
        assert torch.count_nonzero(model.pillar_vfe.pfn_layers[0].linear.weight.grad) == 0
    if kind == "no_points":
        assert objects > 0 and out.parts["reg"].item() > 0.0  # the labels do not depend on the points
    if kind == "one_cav":
        assert pillars > 0 and objects > 0
        if "record_len" in ego:
            assert ego["record_len"].tolist() == [1, 1]


def test_pillar_batchnorm_on_a_batch_without_points(worlds):
    """What BatchNorm does with no pillar at world size 1: the pillar BatchNorm1d gets a (0, C) input, normalises
    nothing and keeps its running statistics (plain BatchNorm does not raise on 0 rows, only on 1); the BEV
    backbone's BatchNorm2d sees an all-zero canvas and moves its running statistics towards mean 0, variance 0
    (upstream's arithmetic, which its scatter never reaches: it raises on a batch without a pillar)."""
    torch.manual_seed(0)
    task = build_task(toy_hypes("point_pillar_intermediate_fusion", worlds["empty"]), for_training=True)
    model = task.model.train()
    norm = model.pillar_vfe.pfn_layers[0].norm
    first_bev_norm = model.backbone.blocks[0][2]
    before = {"pillar": (norm.running_mean.clone(), norm.running_var.clone()),
              "bev": (first_bev_norm.running_mean.clone(), first_bev_norm.running_var.clone())}
    out = task.step(model, task.collate_train([task.train_set[0], task.train_set[1]]))
    out.total.backward()
    assert torch.equal(norm.running_mean, before["pillar"][0]) and torch.equal(norm.running_var, before["pillar"][1])
    assert int(norm.num_batches_tracked) == 1
    assert torch.count_nonzero(norm.weight.grad) == 0 and torch.count_nonzero(norm.bias.grad) == 0
    assert torch.all(first_bev_norm.running_var < before["bev"][1])  # pulled towards the canvas' variance 0


@pytest.mark.parametrize("config", CONFIGS)
def test_empty_frames_between_normal_ones_keep_their_place(worlds, config):
    """A batch normal / empty / normal: in eval mode (batch-independent BatchNorm) its loss is the mean of the
    three frames' own losses, so an empty frame (its CAVs without a pillar) keeps its BEV images and its labels
    in its place; a trailing one is covered by tests/test_models.py's scatter test."""
    torch.manual_seed(0)
    task = build_task(toy_hypes(config, worlds["normal"]), for_training=True)
    empty = build_task(toy_hypes(config, worlds["empty"]), for_training=True).train_set
    samples = [task.train_set[0], empty[1], task.train_set[2]]
    model = task.model.eval()
    with torch.no_grad():
        together = task.step(model, task.collate_train(samples)).total.item()
        alone = [task.step(model, task.collate_train([s])).total.item() for s in samples]
    assert together == pytest.approx(sum(alone) / len(alone), rel=1e-5)
    assert alone[1] < min(alone[0], alone[2])  # the empty frame: no regression term


@pytest.mark.parametrize("kind", ("empty", "one_cav"))
@pytest.mark.parametrize("fusion", ("early", "late", "intermediate"))
def test_evaluation_of_degenerate_frames(worlds, tmp_path, fusion, kind):
    """Post-processing and AP on empty and lone-CAV frames: no detection is an empty (0, 8, 3) result, no GT
    object gives AP nan (undefined), a lone CAV is evaluated like any frame."""
    config = next(c for c in CONFIGS if FUSION[c] == fusion)
    request = EvalRequest(dataset_dir=str(worlds[kind]), batch_size=1 if fusion == "late" else 2,
                          run_dir=str(tmp_path), task_options=DetectionEvalOptions(fusion, save_npy=True))
    spec = build_eval(toy_hypes(config, worlds[kind]), request)
    model = spec.model.eval()
    indices = [0] if fusion == "late" else [0, 1]
    with torch.no_grad():
        records = spec.evaluator.evaluate_batch(model, spec.collate([spec.dataset[i] for i in indices]), indices)
    summary = spec.evaluator.metric(records)
    spec.evaluator.finish(records)  # as the engine does after the metric: the staged npy files published
    assert len(records) == len(indices)
    if kind == "empty":
        assert all(np.load(tmp_path / "npy" / f"{i:04d}_gt.npy").shape == (0, 8, 3) for i in indices)
        assert all(np.load(tmp_path / "npy" / f"{i:04d}_pcd.npy").shape[0] == 0 for i in indices)
        assert math.isnan(summary["ap_50"])
    else:
        assert all(np.load(tmp_path / "npy" / f"{i:04d}_gt.npy").shape[0] > 0 for i in indices)
        assert 0.0 <= summary["ap_50"] <= 1.0


# ------------------------------------------------------------------------------------------- real ranks
def step_rows(run_dir: Path) -> List[dict]:
    with open(run_dir / "train_steps.csv", newline="") as handle:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def train_toy(world: int, config: str, run_dir: Path, train_dir: Path, validate_dir: Path, batch: int,
              *flags: str) -> List[dict]:
    result = train(world, "--hypes_yaml", REPO / "hypes_yaml" / "toy" / f"{config}.yaml", "--model_dir", run_dir,
                   "--num_workers", "0", "--set", "train_params.epoches=1", "--set", f"train_params.batch_size={batch}",
                   "--set", f"root_dir={train_dir}", "--set", f"validate_dir={validate_dir}",
                   "--set", f"test_dir={validate_dir}", *flags, timeout=300)
    assert result.returncode == 0, explain(result)
    rows = step_rows(run_dir)
    for row in rows:
        assert all(math.isfinite(row[key]) for key in ("loss", "cls", "reg")), row
    assert (run_dir / "net_epoch1.pth").is_file()
    return rows


def rank_indices(dataset, per_rank: int, world_size: int, rank: int, seed: int) -> List[int]:
    """The sample indices `rank` reads in epoch 0, from the trainer's own batch sampler."""
    sampler = make_train_batch_sampler(dataset, per_rank, world_size=world_size, rank=rank, seed=seed,
                                       accumulation=1)
    sampler.sampler.set_epoch(0)
    return [index for batch in sampler for index in batch]


@pytest.mark.slow
def test_two_ranks_train_when_rank_1_reads_only_empty_frames(toy_small, tmp_path):
    """Every frame rank 1 of 2 reads in epoch 0 has no object and no point in range (half of them a .pcd with 0
    points, half a cloud lifted out of range): rank 1's pillar BatchNorm sees 0 rows in every step while rank 0's
    does not. The run finishes, each step is logged once with finite losses, and step 1 (before rounding can
    make the weights drift apart) has the loss of the 1-process run over the same 4 frames to 1e-4:
    GlooSyncBatchNorm counts rank 1 as contributing no value, exactly as one BatchNorm over the global batch."""
    config, batch, world_size = "point_pillar_intermediate_fusion", 4, 2
    split = tmp_path / "world" / "train"
    shutil.copytree(toy_small / "train", split)
    hypes = toy_hypes(config, split)
    seed = int(hypes["train_params"]["seed"])
    dataset = build_dataset(hypes, "train", train=True, seed=seed)
    per_rank = batch // world_size
    rank1 = rank_indices(dataset, per_rank, world_size, 1, seed)
    rank0 = rank_indices(dataset, per_rank, world_size, 0, seed)
    assert len(rank1) == len(dataset) // world_size and not set(rank0) & set(rank1)
    for n, index in enumerate(rank1):
        scenario, timestamp = dataset.source.index.locate(index)
        for cav in scenario.cavs:
            empty_frame(cav.yaml_path(timestamp), cav.pcd_path(timestamp), zero_points if n % 2 else lift_points)
    emptied = build_dataset(hypes, "train", train=True, seed=seed)
    for index in rank1:
        ego = emptied[index]["ego"]
        assert sum(len(v) for v in ego["processed_lidar"]["voxel_features"]) == 0 and ego["object_bbx_mask"].sum() == 0
    assert all(len(emptied[i]["ego"]["processed_lidar"]["voxel_features"][0]) > 0 for i in rank0)

    two = train_toy(2, config, tmp_path / "w2", split, toy_small / "validate", batch)
    steps = len(dataset) // batch
    assert [int(row["step"]) for row in two] == list(range(1, steps + 1))
    one = train_toy(0, config, tmp_path / "w1", split, toy_small / "validate", batch)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("config, kind", [("point_pillar_fcooper", "one_cav"), ("point_pillar_late_fusion", "empty")])
def test_two_ranks_train_on_a_degenerate_world(worlds, toy_small, tmp_path, config, kind):
    """2 ranks on a world of lone CAVs (F-Cooper fuses one CAV with itself), and on a world where every frame is
    empty on every rank, validation split included (late fusion: no rank has a single pillar, so the
    synchronized BatchNorm's global count is 0, which the 1-process BatchNorm also runs)."""
    validate = worlds[kind] if kind == "empty" else toy_small / "validate"
    rows = train_toy(2, config, tmp_path / "run", worlds[kind], validate, 4)
    assert [int(row["step"]) for row in rows] == [1, 2]
    if kind == "empty":
        assert all(row["reg"] == 0.0 and row["cls"] > 0.0 for row in rows)
    state = torch.load(tmp_path / "run" / "net_epoch1.pth", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(value).all() for value in state.values() if value.is_floating_point())


def _nan_rows_in_first_ego_cloud(root: Path, rows: int) -> Path:
    """Copy of the toy world whose first training scenario's ego cloud has `rows` points with NaN coordinates."""
    from opencood_ddp.data.opv2v import scan_split
    from opencood_ddp.data.pcd import read_pcd, write_pcd

    index = scan_split(root / "train")
    scenario, timestamp = index.locate(0)
    path = scenario.ego.pcd_path(timestamp)
    points = read_pcd(path)
    points[:rows, :3] = np.nan
    write_pcd(path, points)
    return path


@pytest.mark.slow
def test_non_finite_points_are_dropped_and_told_once_per_file_in_each_ranks_log(toy_small, tmp_path):
    root = tmp_path / "toy"
    shutil.copytree(toy_small, root)
    damaged = _nan_rows_in_first_ego_cloud(root, rows=7)
    run_dir = tmp_path / "run"
    result = train(2, "--hypes_yaml", REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml",
                   "--model_dir", run_dir, "--num_workers", "0", *split_set_flags(root),
                   "--set", "train_params.epoches=2", timeout=600)
    assert result.returncode == 0, explain(result)
    told = {rank: [line for line in (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines()
                   if f"{damaged}: 7 of" in line] for rank in (0, 1)}
    # the frame is read by one rank per epoch (2 epochs, shuffled): each rank that read it said so once
    assert 1 <= sum(len(lines) for lines in told.values()) <= 2 and all(len(lines) <= 1 for lines in told.values())
    assert "non-finite coordinates and are dropped" in next(line for lines in told.values() for line in lines)
    # dropped before the voxels: every step of both epochs trained on finite losses, none skipped
    rows = step_rows(run_dir)
    assert rows and all(np.isfinite([row["loss"], row["cls"], row["reg"]]).all() and row["skipped"] == 0
                        for row in rows), rows
