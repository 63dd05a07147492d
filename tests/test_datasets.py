"""Augmentation, voxelization and the three fusion datasets on the small toy world.

The key property: a sample is a pure function of (seed, epoch, index), so 1, 2 or 3 DistributedSampler shards
and 0 or 2 DataLoader workers load bit-identical tensors for every sample index.
"""
from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from zoo import hypes_of

from opencood_ddp.data.augment import (Flip, Rotation, Scaling, WorldAugmentor, WorldTransform, sample_rng,
                                       shuffle_points)
from opencood_ddp.data.datasets import GT_RANGE, build_dataset
from opencood_ddp.data.ground_truth import upstream_unique_indices
from opencood_ddp.data.geometry import (boxes_in_range_mask, boxes_to_corners, ego_points_mask, mask_ego_points,
                                        mask_points_by_range, project_world_objects, transform_points, x1_to_x2)
from opencood_ddp.data.opv2v import read_frame
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.data.voxelize import Voxelizer, collate_voxels
from opencood_ddp.distributed.samplers import make_train_batch_sampler
from opencood_ddp.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]
KINDS = ("early", "intermediate", "late")
SEED = 3


def toy_hypes(kind: str, root: Path, *overrides: str) -> dict:
    return hypes_of(f"toy/point_pillar_{kind}_fusion", *overrides, toy_root=root)


def flatten(tree, prefix: str = "") -> dict:
    """Nested dicts/lists of tensors and arrays -> {path: value}."""
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}/{key}"))
    elif isinstance(tree, (list, tuple)) and tree and isinstance(tree[0], (np.ndarray, torch.Tensor, dict, list)):
        for k, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}[{k}]"))
    else:
        out[prefix] = tree
    return out


def assert_identical(a, b) -> None:
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        x, y = fa[key], fb[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), key
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        else:
            assert x == y, key


# ------------------------------------------------------------------------------------------ augmentation


AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-0.785, 0.785]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.95, 1.05]}]
# The toy early and late hypes train without augmentation; tests of augmented datasets put a list back.
AUGMENT_OVERRIDE = "data_augment=" + json.dumps(AUGMENT)


def assert_same_corner_sets(a: np.ndarray, b: np.ndarray) -> None:
    """(K, 8, 3) corners equal per box as sets (flips permute the corner order)."""
    distances = np.linalg.norm(a[:, :, None, :] - b[:, None, :, :], axis=3)  # (K, 8, 8)
    assert distances.min(axis=2).max() < 1e-6 and distances.min(axis=1).max() < 1e-6


@pytest.mark.parametrize("operation", [Flip("x"), Flip("y"), Rotation(0.6), Scaling(1.04)])
def test_each_operation_moves_boxes_with_their_points(operation):
    rng = np.random.default_rng(0)
    boxes = np.column_stack([rng.uniform(-30, 30, (5, 2)), rng.uniform(-2, 0, 5), rng.uniform(1, 5, (5, 3)),
                             rng.uniform(-np.pi, np.pi, 5)])
    transform = WorldTransform((operation,))
    moved_corners = transform.points(boxes_to_corners(boxes).reshape(-1, 3)).reshape(-1, 8, 3)
    assert_same_corner_sets(boxes_to_corners(transform.boxes(boxes)), moved_corners)


def test_upstream_semantics_of_each_operation():
    box = np.array([[1.0, 2.0, -1.0, 1.5, 1.6, 3.9, 0.3]])
    np.testing.assert_allclose(Flip("x").boxes(box)[0], [1, -2, -1, 1.5, 1.6, 3.9, -0.3])
    np.testing.assert_allclose(Flip("y").boxes(box)[0], [-1, 2, -1, 1.5, 1.6, 3.9, -(0.3 + np.pi)])
    np.testing.assert_allclose(Rotation(np.pi / 2).boxes(box)[0], [-2, 1, -1, 1.5, 1.6, 3.9, 0.3 + np.pi / 2])
    np.testing.assert_allclose(Scaling(2.0).boxes(box)[0], [2, 4, -2, 3, 3.2, 7.8, 0.3])
    points = np.array([[1.0, 2.0, -1.0, 0.7]], dtype=np.float32)
    rotated = Rotation(np.pi / 2).points(points)
    assert rotated.dtype == np.float32 and rotated[0, 3] == np.float32(0.7)  # intensity untouched
    np.testing.assert_allclose(rotated[0, :3], [-2, 1, -1], atol=1e-6)


def test_sampling_depends_only_on_the_key():
    augmentor = WorldAugmentor(AUGMENT)
    same = [augmentor.sample(sample_rng(1, 2, 3)) for _ in range(2)]
    assert same[0] == same[1]
    others = {augmentor.sample(sample_rng(1, epoch, 3)) for epoch in range(8)}
    assert len(others) == 8
    # A degenerate scaling range draws nothing (upstream returns early), so later draws are unchanged.
    narrow = WorldAugmentor([{"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [1.0, 1.0]}])
    assert narrow.sample(sample_rng(0, 0, 0)).operations == ()
    # A single rotation number a means [-a, a].
    rotation = WorldAugmentor([{"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": 0.1}]).sample(sample_rng(0, 0, 0))
    assert abs(rotation.operations[0].angle) <= 0.1


def test_shuffle_points_is_one_permutation_of_the_rows_drawn_from_the_samples_generator():
    """The rows in the order of one Generator.permutation draw: the draw a sample's key gives stays the same
    whatever the gather (np.take since the ninth session), and the next draw follows it."""
    points = np.arange(40, dtype=np.float32).reshape(10, 4)
    rng, again = sample_rng(1, 2, 3), sample_rng(1, 2, 3)
    shuffled = shuffle_points(points, rng)
    order = again.permutation(10)
    np.testing.assert_array_equal(shuffled, points[order])
    assert sorted(shuffled[:, 0]) == sorted(points[:, 0]) and shuffled.dtype == np.float32
    assert rng.random() == again.random()


@pytest.mark.parametrize("config,fragment", [
    ([{"NAME": "random_world_zoom"}], "data_augment[0]: NAME"),
    ([{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["z"]}], "ALONG_AXIS_LIST"),
    ([{"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [1.1, 0.9]}], "low <= high"),
    ({"NAME": "random_world_flip"}, "must be a list"),
])
def test_bad_augment_config_is_one_line(config, fragment):
    with pytest.raises(ConfigError) as info:
        WorldAugmentor(config)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ voxelization


def test_voxelizer_layout_and_determinism():
    voxelizer = Voxelizer([0.4, 0.4, 4], [-48, -24, -3, 48, 24, 1], max_points_per_voxel=2, max_voxels=3)
    points = np.array([[0.1, 0.1, 0, 1], [0.2, 0.1, 0, 2], [0.3, 0.1, 0, 3],  # one voxel, 3 points -> 2 kept
                       [-47.9, -23.9, -2.9, 4], [48.5, 0, 0, 5],              # corner voxel; out of range
                       [47.9, 23.9, 0.9, 6], [10, 10, 0, 7]], dtype=np.float32)  # last voxel past max_voxels
    out = voxelizer(points)
    assert out["voxel_features"].dtype == np.float32 and out["voxel_features"].shape == (3, 2, 4)
    assert out["voxel_coords"].dtype == np.int32 and out["voxel_num_points"].dtype == np.int32
    # (z, y, x) order; voxels in order of their first point.
    assert out["voxel_coords"].tolist() == [[0, 60, 120], [0, 0, 0], [0, 119, 239]]
    assert out["voxel_num_points"].tolist() == [2, 1, 1]
    assert out["voxel_features"][0, :, 3].tolist() == [1, 2] and out["voxel_features"][1, 1].tolist() == [0] * 4
    again = pickle.loads(pickle.dumps(voxelizer))(points)  # a worker's copy builds its own generator
    assert all(np.array_equal(out[k], again[k]) for k in out)
    batch = collate_voxels([out, out])
    assert batch["voxel_coords"].shape == (6, 4) and batch["voxel_coords"][:, 0].tolist() == [0, 0, 0, 1, 1, 1]


SPCONV_BEFORE_THE_FORK = """
import sys
import numpy as np
import torch
from opencood_ddp.data.voxelize import Voxelizer
print("spconv.pytorch.utils" in sys.modules)
voxelizer = Voxelizer([0.4, 0.4, 4], [-48, -24, -3, 48, 24, 1], max_points_per_voxel=2, max_voxels=3)
print("spconv.pytorch.utils" in sys.modules)

class Probe(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        loaded = "spconv.pytorch.utils" in sys.modules  # before this worker's first voxelization
        return loaded and voxelizer(np.full((1, 4), 0.1, np.float32))["voxel_num_points"].tolist() == [1]

print(all(torch.utils.data.DataLoader(Probe(), batch_size=None, num_workers=2, multiprocessing_context="fork")))
"""


def test_spconv_is_loaded_where_the_voxelizer_is_made_not_in_forked_workers():
    """Importing the data modules loads nothing of spconv; making a Voxelizer (the main process, building the
    datasets) loads its PointToVoxel, so that forked loader workers inherit it and never load a CUDA build of
    spconv for the first time after the fork."""
    done = subprocess.run([sys.executable, "-c", SPCONV_BEFORE_THE_FORK], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["False", "True", "True"], done.stderr[-2000:]


def test_a_missing_spconv_is_one_error_line_when_the_voxelizer_is_made(monkeypatch):
    monkeypatch.setitem(sys.modules, "spconv.pytorch.utils", None)
    with pytest.raises(ConfigError) as caught:
        Voxelizer([0.4, 0.4, 4], [-48, -24, -3, 48, 24, 1], max_points_per_voxel=2, max_voxels=3)
    assert "needs spconv 2.x" in str(caught.value) and "\n" not in str(caught.value)


def test_voxelizer_picks_max_voxel_by_mode(toy_small):
    preprocess = toy_hypes("early", toy_small)["preprocess"]
    assert Voxelizer.from_hypes(preprocess, train=True).max_voxels == preprocess["args"]["max_voxel_train"]
    assert Voxelizer.from_hypes(preprocess, train=False).max_voxels == preprocess["args"]["max_voxel_test"]
    assert Voxelizer.from_hypes(preprocess, True).grid_size.tolist() == [240, 120, 1]


@pytest.mark.parametrize("kind, train, override, fragment", [
    ("early", True, "preprocess.args.max_voxel_train=1000000000000",
     "preprocess.args.max_voxel_train (1000000000000) x max_points_per_voxel (16): the voxelizer's voxel buffer "
     "would take 253,319.7 GiB"),
    ("early", False, "preprocess.args.max_points_per_voxel=1000000000000",
     "preprocess.args.max_voxel_test (70000) x max_points_per_voxel (1000000000000): the voxelizer's voxel buffer "
     "would take 1,043,081,283.6 GiB"),
    ("late", False, "preprocess.args.voxel_size=[0.000001, 0.000001, 4]",
     "preprocess.args.voxel_size [1e-06, 1e-06, 4.0] over preprocess.cav_lidar_range (96000000 x 48000000 x 1 "
     "cells): the voxelizer's hash of every grid cell (int32) would take 17,166,137.7 GiB"),
    ("late", True, "postprocess.max_num=1000000000000",
     "postprocess.max_num (1000000000000): each sample's padded ground truth (8 float64 per box) would take "
     "59,604.6 GiB"),
    ("intermediate", False, "train_params.max_cav=1000000000",
     "train_params.max_cav (1000000000): each sample's CAV-by-CAV transforms (16 float64 per pair) would take "
     "119,209,289,550.8 GiB"),
])
def test_a_buffer_no_machine_holds_is_refused_before_it_is_allocated(toy_small, kind, train, override, fragment):
    """Each was an allocation error from spconv or numpy in the loader's first sample (memory_fit). The figures
    are the buffers' bytes by hand: 4-byte words, (max_voxels, points, 4 features) + 4 per voxel; a hash word per
    grid cell; 64 bytes per padded box; 128 per CAV pair."""
    hypes = toy_hypes(kind, toy_small, override)
    with pytest.raises(ConfigError) as caught:
        build_dataset(hypes, "validate", train, SEED)
    message = str(caught.value)
    assert fragment in message and "more than this machine's" in message and message.endswith("; fix the hypes")


@pytest.mark.parametrize("kind", ("early", "intermediate"))
def test_fusion_args_is_a_mapping_or_upstreams_empty_list(toy_small, kind):
    """`fusion.args: 0` (or a list of names) was read as no arguments; upstream's files write [] or a mapping."""
    for fine in ("fusion.args=[]", "fusion.args=null", "fusion.args={}"):
        build_dataset(toy_hypes(kind, toy_small, fine), "validate", False, SEED)
    for bad in ("0", "[proj_first]", "true"):
        with pytest.raises(ConfigError, match=r"key fusion.args must be a mapping, or \[\] where none is read, got"):
            build_dataset(toy_hypes(kind, toy_small, f"fusion.args={bad}"), "validate", False, SEED)


# ------------------------------------------------------------------------------------------ datasets


def check_voxels(voxels: dict, max_voxels: int, max_points: int) -> None:
    features, coords, counts = voxels["voxel_features"], voxels["voxel_coords"], voxels["voxel_num_points"]
    assert features.dtype == np.float32 and coords.dtype == np.int32 and counts.dtype == np.int32
    assert 0 < len(features) <= max_voxels and features.shape[1:] == (max_points, 4)
    assert coords.shape == (len(features), 3) and counts.shape == (len(features),)
    assert counts.min() >= 1 and counts.max() <= max_points
    assert (coords[:, 0] == 0).all() and coords[:, 1].max() < 120 and coords[:, 2].max() < 240
    padding = np.arange(max_points)[None, :] >= counts[:, None]
    assert not features[padding].any()


def check_objects(ego: dict, max_num: int) -> None:
    center, mask = ego["object_bbx_center"], ego["object_bbx_mask"]
    assert center.shape == (max_num, 7) and mask.shape == (max_num,)
    assert center.dtype == np.float64 and mask.dtype == np.float64
    n = len(ego["object_ids"])
    assert n == int(mask.sum()) > 0 and (mask[:n] == 1).all() and not center[n:].any()
    assert len(set(ego["object_ids"])) == n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("train", [True, False])
def test_sample_and_batch_layout(toy_small, kind, train):
    hypes = toy_hypes(kind, toy_small, "fusion.args.augment=true" if kind == "intermediate" else AUGMENT_OVERRIDE)
    dataset = build_dataset(hypes, "train" if train else "test", train, SEED)
    max_voxels = hypes["preprocess"]["args"]["max_voxel_train" if train else "max_voxel_test"]
    points = hypes["preprocess"]["args"]["max_points_per_voxel"]
    samples = [dataset[0], dataset[1]]
    for sample in samples:
        for key, entry in sample.items():
            check_objects(entry, 100)
            if kind == "intermediate":
                assert entry["cav_num"] == len(read_frame(dataset.source.index, 0 if sample is samples[0] else 1))
                for k in range(entry["cav_num"]):
                    check_voxels({name: v[k] for name, v in entry["processed_lidar"].items()}, max_voxels, points)
                assert entry["pairwise_t_matrix"].shape == (5, 5, 4, 4)
            else:
                check_voxels(entry["processed_lidar"], max_voxels, points)
            assert "anchor_box" not in entry and "label_dict" not in entry
            assert (kind == "late" and not train) == ("transformation_matrix" in entry)

    batch = dataset.collate_batch_train(samples)["ego"]
    assert batch["object_bbx_center"].shape == (2, 100, 7) and batch["object_bbx_mask"].shape == (2, 100)
    lidar = batch["processed_lidar"]
    assert lidar["voxel_coords"].shape[1] == 4 and lidar["voxel_features"].dtype == torch.float32
    groups = lidar["voxel_coords"][:, 0]
    if kind == "intermediate":
        record_len = batch["record_len"]
        assert record_len.dtype == torch.int64 and record_len.tolist() == [s["ego"]["cav_num"] for s in samples]
        assert groups.unique().tolist() == list(range(int(record_len.sum())))
    else:
        assert groups.unique().tolist() == [0, 1]

    if kind == "late" and train:
        return  # training samples of late fusion carry no transformation matrix: not a test batch
    test_batch = dataset.collate_batch_test(samples[:1])
    assert set(test_batch) == set(samples[0])
    for entry in test_batch.values():
        assert entry["object_bbx_center"].shape == (1, 100, 7)
        assert entry["transformation_matrix"].dtype == torch.float32
    with pytest.raises(ConfigError, match="batch size 1"):
        dataset.collate_batch_test(samples)


def expected_objects(frame, target_pose, gt_range):
    """GT by hand: every CAV's vehicles projected with geometry, first CAV's box kept per id."""
    boxes = {}
    for cav in frame.values():
        for object_id, box in project_world_objects(cav.params["vehicles"], target_pose, gt_range).items():
            boxes.setdefault(object_id, box)
    return boxes


@pytest.mark.parametrize("kind", ["early", "intermediate"])
def test_gt_in_ego_frame_deduplicated_with_upstream_ranges(toy_small, kind):
    # Without postprocess.gt_range the test-time GT range is upstream's GT_RANGE.
    hypes = toy_hypes(kind, toy_small)
    del hypes["postprocess"]["gt_range"]
    cav_range = hypes["preprocess"]["cav_lidar_range"]
    checked_duplicates = 0
    for train, split in ((True, "validate"), (False, "test")):
        dataset = build_dataset(copy.deepcopy(hypes), split, train, SEED)
        dataset.augmentor = None  # compare geometry without the random transform
        for i in range(len(dataset)):
            frame = read_frame(dataset.source.index, i)
            ego_pose = next(iter(frame.values())).lidar_pose
            expected = expected_objects(frame, ego_pose, cav_range if train else GT_RANGE)
            if kind == "early":  # early fusion re-filters to cav_lidar_range, also at test time
                ids = list(expected)
                keep = boxes_in_range_mask(boxes_to_corners(np.array([expected[k] for k in ids])), cav_range)
                expected = {k: expected[k] for k, flag in zip(ids, keep) if flag}
            ego = dataset[i]["ego"]
            assert sorted(ego["object_ids"]) == sorted(expected)
            n = len(ego["object_ids"])
            got = dict(zip(ego["object_ids"], ego["object_bbx_center"][:n]))
            for object_id, box in expected.items():
                np.testing.assert_array_equal(got[object_id], box)
            all_ids = [oid for cav in frame.values() for oid in
                       project_world_objects(cav.params["vehicles"], ego_pose, cav_range if train else GT_RANGE)]
            checked_duplicates += len(all_ids) - len(set(all_ids))
            if train:
                assert len(ego["object_ids"]) <= len(set(all_ids))
    assert checked_duplicates > 0  # the toy world has objects seen by several CAVs


def test_upstream_unique_order():
    ids = [5, 3, 5, 9, 3]
    assert upstream_unique_indices(ids) == [ids.index(x) for x in set(ids)]
    assert upstream_unique_indices(["b", "a", "b"]) == [1, 0]


def test_points_projected_cropped_and_ego_hits_removed(toy_small):
    hypes = toy_hypes("early", toy_small)
    dataset = build_dataset(hypes, "test", False, SEED, visualize=True)
    frame = read_frame(dataset.source.index, 2)
    ego_pose = next(iter(frame.values())).lidar_pose
    expected = np.concatenate([transform_points(mask_ego_points(read_pcd(cav.pcd_path)),
                                                x1_to_x2(cav.lidar_pose, ego_pose)) for cav in frame.values()])
    expected = mask_points_by_range(expected, hypes["preprocess"]["cav_lidar_range"])
    got = dataset[2]["ego"]["origin_lidar"]
    # The same multiset of points (the order is the sample's shuffle).
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.unique(got, axis=0), np.unique(expected, axis=0))
    lidar_range = np.array(hypes["preprocess"]["cav_lidar_range"])
    lo, hi = lidar_range[:3], lidar_range[3:]
    assert ((got[:, :3] > lo) & (got[:, :3] < hi)).all()

    late = build_dataset(toy_hypes("late", toy_small), "test", False, SEED, visualize=True)
    for key, cav in late[2].items():  # late fusion keeps each cloud in its own frame: no own-car hits at all
        assert not ego_points_mask(cav["origin_lidar"]).any()
        # Every point is in range, so each lands in a voxel, which keeps at most 32 of them.
        assert cav["processed_lidar"]["voxel_num_points"].sum() <= len(cav["origin_lidar"])


def test_late_fusion_training_picks_a_cav_with_its_own_gt(toy_small):
    hypes = toy_hypes("late", toy_small, "data_augment=[]")
    dataset = build_dataset(hypes, "train", True, SEED)
    chosen = set()
    for epoch in range(4):
        dataset.set_epoch(epoch)
        for i in range(len(dataset)):
            frame = read_frame(dataset.source.index, i, apply_comm_range=False)
            ego = dataset[i]["ego"]
            # Identify the chosen CAV by its GT: the boxes must equal that CAV's own projection.
            matches = [cav_id for cav_id, cav in frame.items()
                       if list(project_world_objects(cav.params["vehicles"], cav.lidar_pose,
                                                     hypes["postprocess"]["anchor_args"]["cav_lidar_range"]))
                       == ego["object_ids"]]
            assert len(matches) >= 1
            chosen.add((i, matches[0]))
    assert len({cav for _, cav in chosen}) > 2  # not always the ego


class RecordingPostProcessor:
    """The interface the datasets call (see datasets/base.py), with trivial outputs."""

    def __init__(self):
        self.anchor_calls = 0

    def generate_anchor_box(self):
        self.anchor_calls += 1
        return np.zeros((60, 120, 2, 7))

    def generate_label(self, *, gt_box_center, anchors, mask):
        assert gt_box_center.shape == (100, 7) and mask.shape == (100,) and anchors.shape == (60, 120, 2, 7)
        return {"pos_equal_one": np.full((60, 120, 2), mask.sum())}

    def collate_batch(self, label_list):
        return {"pos_equal_one": torch.from_numpy(np.array([d["pos_equal_one"] for d in label_list]))}


@pytest.mark.parametrize("kind", KINDS)
def test_post_processor_interface(toy_small, kind):
    post = RecordingPostProcessor()
    dataset = build_dataset(toy_hypes(kind, toy_small), "validate", False, SEED, post_processor=post)
    samples = [dataset[0], dataset[1]]
    assert post.anchor_calls == 1  # generated once per dataset and process
    ego = samples[0]["ego"]
    assert ego["anchor_box"].shape == (60, 120, 2, 7)
    assert ego["label_dict"]["pos_equal_one"][0, 0, 0] == ego["object_bbx_mask"].sum()
    batch = dataset.collate_batch_train(samples)["ego"]
    assert batch["label_dict"]["pos_equal_one"].shape == (2, 60, 120, 2)
    test_ego = dataset.collate_batch_test(samples[:1])["ego"]
    assert test_ego["anchor_box"].shape == (60, 120, 2, 7) and "label_dict" in test_ego


# ------------------------------------------------------------------------------------------ invariance


def load_through_shards(dataset, world: int, epoch: int, workers: int) -> dict:
    """{index: collated one-sample batch} over the ranks of a `world`-process run."""
    loaded = {}
    for rank in range(world):
        batches = make_train_batch_sampler(dataset, 1, world, rank, seed=SEED)
        batches.sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        order = [b[0] for b in batches]
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=dataset.collate_batch_train,
                            num_workers=workers)
        for index, batch in zip(order, loader):
            loaded[index] = batch
    return loaded


@pytest.mark.parametrize("kind,extra", [("early", AUGMENT_OVERRIDE), ("intermediate", "fusion.args.augment=true")],
                         ids=["early", "intermediate"])
def test_samples_identical_across_world_sizes_and_workers(toy_small, kind, extra):
    dataset = build_dataset(toy_hypes(kind, toy_small, extra), "train", True, SEED)
    assert dataset.augmentor is not None
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        reference = {i: dataset.collate_batch_train([dataset[i]]) for i in range(len(dataset))}
        runs = [(1, 0), (2, 0), (3, 0), (2, 2)] if epoch == 0 else [(3, 2)]
        for world, workers in runs:
            loaded = load_through_shards(dataset, world, epoch, workers)
            assert len(loaded) == len(dataset) // world * world
            for index, batch in loaded.items():
                assert_identical(batch, reference[index])
        if epoch == 0:
            first_epoch = reference
    # Another epoch draws another augmentation (and shuffle) for every sample.
    for i in range(len(dataset)):
        a, b = first_epoch[i]["ego"], reference[i]["ego"]
        assert not torch.equal(a["object_bbx_center"], b["object_bbx_center"])


def test_augmentation_is_applied_jointly(toy_small):
    """Intermediate with augment: every CAV's cloud and the GT move by the same transform."""
    plain = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED, visualize=True)
    augmented = build_dataset(toy_hypes("intermediate", toy_small, "fusion.args.augment=true"), "train", True, SEED,
                              visualize=True)
    assert plain.augmentor is None
    sample_a, sample_b = plain[4]["ego"], augmented[4]["ego"]
    transform = augmented.sample_transform(_rng_after_shuffles(augmented, 4))
    n = len(sample_a["object_ids"])
    moved = dict(zip(sample_a["object_ids"], transform.boxes(sample_a["object_bbx_center"][:n])))
    m = len(sample_b["object_ids"])
    assert m > 0
    for object_id, box in zip(sample_b["object_ids"], sample_b["object_bbx_center"][:m]):
        np.testing.assert_allclose(box, moved[object_id], atol=1e-9)


def _rng_after_shuffles(dataset, index):
    """The sample's RNG advanced past its per-CAV shuffles: the next draws are the augmentation's."""
    rng = sample_rng(dataset.seed, dataset.epoch, index)
    for cav in read_frame(dataset.source.index, index).values():
        rng.permutation(len(read_pcd(cav.pcd_path)))
    return rng


# ------------------------------------------------------------------------------------------ errors


def test_missing_folder_empty_split_and_missing_key(toy_small, tmp_path):
    hypes = toy_hypes("early", toy_small, f"validate_dir={tmp_path / 'nowhere'}")
    with pytest.raises(DataError) as info:
        build_dataset(hypes, "validate", False, SEED)
    assert str(tmp_path / "nowhere") in str(info.value) and "\n" not in str(info.value)

    (tmp_path / "empty").mkdir()
    hypes = toy_hypes("early", toy_small, f"validate_dir={tmp_path / 'empty'}")
    with pytest.raises(DataError, match="empty split"):
        build_dataset(hypes, "validate", False, SEED)

    hypes = toy_hypes("intermediate", toy_small)
    del hypes["preprocess"]["args"]["max_points_per_voxel"]
    del hypes["test_dir"]
    with pytest.raises(ConfigError) as info:
        build_dataset(hypes, "test", False, SEED)
    message = str(info.value)
    assert "missing key preprocess.args.max_points_per_voxel" in message and "missing key test_dir" in message
    assert "\n" not in message


@pytest.mark.parametrize("override,fragment", [
    ("fusion.core_method=MiddleFusionDataset", "fusion.core_method"),
    ("postprocess.order=xyz", "postprocess.order"),
    ("preprocess.cav_lidar_range=[1, 2, 3]", "preprocess.cav_lidar_range"),
])
def test_bad_hypes_values(toy_small, override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_dataset(toy_hypes("early", toy_small, override), "train", True, SEED)


def test_intermediate_augment_needs_proj_first(toy_small):
    hypes = toy_hypes("intermediate", toy_small, "fusion.args.augment=true", "fusion.args.proj_first=false")
    with pytest.raises(ConfigError, match="proj_first"):
        build_dataset(hypes, "train", True, SEED)


def test_dataset_pickles_for_spawned_workers(toy_small):
    """A spawn-started worker receives a pickled copy: it must load the same sample (epoch included)."""
    dataset = build_dataset(toy_hypes("early", toy_small), "train", True, SEED)
    dataset.set_epoch(5)
    before = dataset.collate_batch_train([dataset[3]])
    copy_in_worker = pickle.loads(pickle.dumps(dataset))
    assert copy_in_worker.voxelizer._generator is None and copy_in_worker.epoch == 5
    assert_identical(copy_in_worker.collate_batch_train([copy_in_worker[3]]), before)


@pytest.mark.parametrize("kind", KINDS)
def test_a_samples_cost_is_its_scenarios_cav_folders(kind, toy_small):
    """sample_cost (what memory plans rank samples by) is the number of CAV folders of the sample's scenario on
    disk, read from the index: the frame files are not opened."""
    dataset = build_dataset(toy_hypes(kind, toy_small), "train", True, SEED)
    for index in range(len(dataset)):
        scenario, _ = dataset.source.index.locate_position(index)
        on_disk = sum(1 for p in scenario.folder.iterdir() if p.is_dir() and p.name.lstrip("-").isdigit())
        assert dataset.sample_cost(index) == on_disk


@pytest.mark.parametrize("reader, good", [("opv2v", [1.0, 2.0, 0.0, 0.0, 90.0, 0.0]),
                                          ("v2v4real", np.identity(4).tolist())])
def test_one_pose_check_refuses_a_missing_misshapen_or_non_finite_pose(reader, good):
    """OPV2V's 6-number pose and V2V4Real's 4x4 matrix through the one check (data/opv2v.py checked_pose): a NaN
    pose used to pass OPV2V's reader and put every point of the frame at NaN."""
    from opencood_ddp.data.opv2v import lidar_pose_of
    from opencood_ddp.data.sources.v2v4real import pose_matrix_of

    read = lidar_pose_of if reader == "opv2v" else pose_matrix_of
    assert np.array_equal(read({"lidar_pose": good}, "f.yaml"), np.asarray(good))
    bad = np.asarray(good)
    bad.flat[1] = np.nan
    for params, fragment in (({}, "no 'lidar_pose'"), ({"lidar_pose": [1, 2]}, "must be"),
                             ({"lidar_pose": bad.tolist()}, "finite"), ({"lidar_pose": "x"}, "must be")):
        with pytest.raises(DataError, match=f"f.yaml: .*{fragment}") as error:
            read(params, "f.yaml")
        assert "\n" not in str(error.value)
