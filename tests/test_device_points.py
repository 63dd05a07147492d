"""The point work on the device (``preprocess.on_device``): the sort-based voxelizer against spconv's CPU
generator, the keyed shuffle, and the whole device path against the CPU path's own steps, on the toy world.

Everything runs through the same code the training process runs on a GPU, with ``device=cpu``: what it proves about
the arithmetic holds on any device, because every step is made of operations that round alike everywhere (sorts,
scatters, comparisons, and float64 products and sums taken one operation at a time).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from zoo import hypes_of

from opencood_ddp.data.augment import Flip, Rotation, Scaling, WorldTransform
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.device_points import (CloudBatch, RawCloud, RawLidar, collate_raw, hash_order,
                                             prepare_batch, shuffle_key, voxel_grid_of)
from opencood_ddp.data.geometry import mask_ego_points, mask_points_by_range, transform_points
from opencood_ddp.data.sorted_voxels import VoxelGrid, voxelize_groups
from opencood_ddp.data.voxelize import Voxelizer, collate_voxels
from opencood_ddp.errors import ConfigError

ON = "preprocess.on_device=true"
AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-0.78539816, 0.78539816]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.95, 1.05]}]
NOISY = {"async": True, "async_mode": "sim", "async_overhead": 100, "seed": 25, "loc_err": True, "xyz_std": 0.2,
         "ryp_std": 0.2, "data_size": 1.06, "transmission_speed": 27, "backbone_delay": 10}


def hypes(config: str, root: Path, *overrides: str, augment: bool = False, noisy: bool = False) -> dict:
    """The config on the toy world `root`, with the augmentation and V2X-ViT's noisy setting where asked."""
    sections = {**({"data_augment": AUGMENT} if augment else {}), **({"wild_setting": NOISY} if noisy else {})}
    return hypes_of(config, *overrides, toy_root=root, **sections)


def bits(array) -> np.ndarray:
    array = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    return array.view(np.uint32) if array.dtype == np.float32 else array


def assert_same_voxels(actual: dict, expected: dict) -> None:
    for key in ("voxel_features", "voxel_coords", "voxel_num_points"):
        assert actual[key].dtype == expected[key].dtype, key
        assert np.array_equal(bits(actual[key]), bits(expected[key])), key


# ------------------------------------------------------------------------------------------ the voxelizer


def spconv_groups(points: np.ndarray, group: np.ndarray, groups: int, grid: VoxelGrid) -> dict:
    """spconv's CPU generator on each group's points, collated as upstream collates voxels."""
    voxelizer = Voxelizer(grid.voxel_size, grid.lidar_range, grid.max_points_per_voxel, grid.max_voxels)
    return collate_voxels([voxelizer(points[group == g]) for g in range(groups)])


def random_cloud(rng: np.random.Generator, count: int, grid: VoxelGrid) -> np.ndarray:
    """Points in and around the grid, some snapped onto cell faces and the range's faces, some not finite."""
    low, high = np.array(grid.lidar_range[:3]), np.array(grid.lidar_range[3:])
    points = np.concatenate([rng.uniform(low - 2, high + 2, (count, 3)), rng.uniform(0, 1, (count, 1))], axis=1)
    points = points.astype(np.float32)
    snap = count // 8
    size = np.array(grid.voxel_size)
    points[:snap, :3] = np.round(points[:snap, :3] / size) * size
    points[snap:2 * snap, 1] = np.float32(grid.lidar_range[1])
    points[2 * snap:3 * snap, 0] = np.float32(grid.lidar_range[3])
    if count > 8:
        points[3, 0], points[4, 1], points[5, 2] = np.nan, np.inf, -np.inf
    return points


@pytest.mark.parametrize("voxel_size, max_points, max_voxels", [
    ((0.4, 0.4, 4.0), 32, 70000),   # OPV2V's pillars
    ((0.4, 0.4, 4.0), 3, 40),       # full pillars and a voxel budget that runs out
    ((0.4, 0.4, 0.4), 5, 3000),     # SECOND-style voxels
    ((0.3, 0.7, 1.3), 1, 500),
])
def test_sorted_voxels_equal_spconvs_generator_bit_for_bit(voxel_size, max_points, max_voxels):
    rng = np.random.default_rng(7)
    grid = VoxelGrid(voxel_size, (-20.8, -8.0, -3.0, 20.8, 8.0, 1.0), max_points, max_voxels)
    for count in (0, 1, 9, 4000, 25000):
        for groups in (1, 3):
            points = random_cloud(rng, count, grid)
            group = np.sort(rng.integers(0, groups, count))
            actual = voxelize_groups(torch.from_numpy(points), torch.from_numpy(group), groups, grid)
            assert_same_voxels(actual, spconv_groups(points, group, groups, grid))


def test_grid_size_is_spconvs():
    """Every count of cells here, the canvas's included (yaml_parsers.voxel_grid_cells), is spconv's: also where
    the extent is a half number of voxels (140.2 / 0.4 = 350.5: 351, where np.round says 350)."""
    for size, extent in (((0.4, 0.4, 4), (-140.8, -40, -3, 140.8, 40, 1)), ((0.1, 0.1, 0.1), (-3, -2, -1, 3, 2, 1)),
                         ((0.3, 0.7, 1.3), (-20.8, -8, -3, 20.8, 8, 1)),
                         ((0.4, 0.4, 4), (-70.1, -40, -3, 70.1, 40, 1)),
                         ((0.4, 0.4, 4), (-102.4, -51.2, -3.5, 102.4, 51.2, 1.5)),
                         ((0.2, 0.2, 2), (-0.5, 0, 0, 0.5, 1, 1))):
        generator = Voxelizer(size, extent, 5, 10)._point_to_voxel()
        spconv_cells = tuple(int(v) for v in generator.grid_size)[::-1]
        assert VoxelGrid(size, extent, 5, 10).grid_size == spconv_cells, extent
        assert tuple(Voxelizer(size, extent, 5, 10).grid_size.tolist()) == spconv_cells, extent
    assert spconv_cells == (5, 5, 1)  # half a voxel in z rounds away from zero, as C's round does (np.round: 0)


# ------------------------------------------------------------------------------------------ the shuffle


def lowbias32(x: int) -> int:
    """The hash in Python's integers, written from its definition: xor-shifts 16, 15, 16 around the multipliers
    0x7FEB352D and 0x1B873593, mod 2^32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x1B873593) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_order_is_each_clouds_points_sorted_by_the_keyed_hash():
    lengths, keys = [5, 0, 300, 7], [(1, 2), (3, 4), (0xFFFFFFFF, 0x80000000), (12345, 67890)]
    order = hash_order(torch.tensor(lengths), torch.tensor(keys)).tolist()
    expected, start = [], 0
    for length, (k0, k1) in zip(lengths, keys):
        local = sorted(range(length), key=lambda i: lowbias32(lowbias32(i ^ k0) ^ k1))
        expected += [start + i for i in local]
        start += length
    assert order == expected


def test_shuffle_key_depends_on_every_part_of_the_sample_key():
    base = shuffle_key(3, 1, 10, 0)
    assert shuffle_key(3, 1, 10, 0) == base
    others = {shuffle_key(4, 1, 10, 0), shuffle_key(3, 2, 10, 0), shuffle_key(3, 1, 11, 0), shuffle_key(3, 1, 10, 1)}
    assert base not in others and len(others) == 4
    assert all(0 <= word < 2 ** 32 for word in base)


# ------------------------------------------------------------------------------------------ the device path


def cpu_steps(batch: CloudBatch) -> dict:
    """The CPU path's own steps (numpy, geometry, augment, spconv) on each cloud, shuffled in the device path's
    order: what ``prepare_batch`` must give bit for bit."""
    grid, per_group, start = batch.grid, [[] for _ in range(batch.groups)], 0
    operations = {cloud: ops for first, end, ops in batch.transforms for cloud in range(first, end)}
    for cloud, (length, key) in enumerate(zip(batch.lengths, batch.keys)):
        points = batch.points[start:start + length].numpy()
        start += length
        if batch.colour_bits[cloud]:
            points = RawCloud(points, (0, 0), "", colour_bits=True).decoded()
        order = hash_order(torch.tensor([length]), torch.from_numpy(key[None])).numpy()
        points = mask_ego_points(np.take(points, order, axis=0))
        if batch.to_ego is not None:
            points = transform_points(points, batch.to_ego[cloud])
        if batch.crop_first:
            points = mask_points_by_range(points, grid.lidar_range)
        points = WorldTransform(operations.get(cloud, ())).points(points)
        if not batch.crop_first:
            points = mask_points_by_range(points, grid.lidar_range)
        per_group[batch.groups_of_clouds[cloud]].append(points)
    voxelizer = Voxelizer(grid.voxel_size, grid.lidar_range, grid.max_points_per_voxel, grid.max_voxels)
    return collate_voxels([voxelizer(np.concatenate(clouds)) for clouds in per_group])


def rotation_about_z(yaw: float, shift) -> np.ndarray:
    matrix = np.identity(4)
    matrix[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
    matrix[:3, 3] = shift
    return matrix


def hand_cloud(rng: np.random.Generator, count: int, packed: bool = False) -> np.ndarray:
    """A cloud with what the toy world's LiDAR never returns: hits on the car itself (on and inside its box's
    faces), points on the range's faces, and non-finite coordinates; ``packed``: column 3 holds colour bits with
    every red byte and other bytes set."""
    points = np.concatenate([rng.uniform(-30, 30, (count, 2)), rng.uniform(-4, 2, (count, 1)),
                             rng.uniform(0, 1, (count, 1))], axis=1).astype(np.float32)
    if packed:
        points[:, 3] = rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ego = count // 5
    points[:ego, 0] = rng.uniform(-2.2, 3.2, ego)
    points[:ego, 1] = rng.uniform(-1.3, 1.3, ego)
    points[ego:ego + 4, :2] = np.float32([[-1.95, 0.0], [2.95, 1.1], [0.0, -1.1], [3.0, 0.0]])
    points[ego + 4:ego + 8, 0] = np.float32(-24.0)
    points[ego + 8, 1], points[ego + 9, 2] = np.nan, np.inf
    return points


@pytest.mark.parametrize("project", [False, True])
@pytest.mark.parametrize("crop_first", [False, True])
@pytest.mark.parametrize("separate", [False, True])
def test_device_steps_on_hand_made_clouds(project, crop_first, separate):
    """Every step on points the toy world never makes, against the CPU path's own functions. The last sample is
    neither projected nor augmented when ``project`` is off, so that its points on the range's faces stay there."""
    rng = np.random.default_rng(11)
    grid = VoxelGrid((0.4, 0.4, 4.0), (-24.0, -16.0, -3.0, 24.0, 16.0, 1.0), 4, 900)
    operations = (Flip("x"), Rotation(0.3), Scaling(1.04), Flip("y"))
    lidars = []
    for sample in range(3):
        # The first CAV's column 3 as a packed colour's bits (a binary OPV2V file), the other's an intensity.
        clouds = [RawCloud(hand_cloud(rng, int(rng.integers(50, 3000)), packed=slot == 0),
                           shuffle_key(1, 2, sample, slot), "x.pcd",
                           rotation_about_z(rng.uniform(-3, 3), rng.uniform(-9, 9, 3)) if project else None,
                           operations[2 * sample:], colour_bits=slot == 0) for slot in range(2)]
        lidars.append(RawLidar(clouds, grid, separate=separate, crop_first=crop_first))
    batch = collate_raw(lidars)
    with np.errstate(invalid="ignore"):  # the non-finite rows through numpy's product
        expected = cpu_steps(batch)
    assert_same_voxels(prepare_batch(batch, "cpu"), expected)


def device_batches(data, indices):
    """Training batches of two samples over ``indices`` and each batch's CloudBatch entries (late fusion's test
    batches hold one per CAV)."""
    train = data.train
    for first in range(0, len(indices) - 1, 2):
        samples = [data[i] for i in indices[first:first + 2]]
        if train or data.fusion != "late":
            batch = data.collate_batch_train(samples)
            yield batch, [batch["ego"]["processed_lidar"]]
        else:
            batch = data.collate_batch_test(samples[:1])
            yield batch, [entry["processed_lidar"] for entry in batch.values()]


CASES = {
    "toy AttFuse": ("toy/point_pillar_intermediate_fusion", (), {}),
    "toy AttFuse, no proj_first, noisy": ("toy/point_pillar_intermediate_fusion",
                                          ("fusion.args.proj_first=false",), {"noisy": True}),
    "toy AttFuse, augmented": ("toy/point_pillar_intermediate_fusion", ("fusion.args.augment=true",),
                               {"augment": True}),
    "toy early, augmented": ("toy/point_pillar_early_fusion", (), {"augment": True}),
    "toy late, augmented": ("toy/point_pillar_late_fusion", (), {"augment": True}),
    "full-size AttFuse": ("opv2v/point_pillar_intermediate_fusion", (), {}),
    "toy SECOND": ("toy/second_intermediate_fusion", (), {}),
}


@pytest.fixture(scope="module")
def toy_binary(tmp_path_factory) -> Path:
    """The small toy world with binary clouds: OPV2V's binary records, handed over as the file stores them."""
    from opencood_ddp.toy.writer import generate_toy_opv2v

    root = tmp_path_factory.mktemp("toy_binary")
    generate_toy_opv2v(root, seed=0, scale="small", binary=True)
    return root


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("train", [True, False])
def test_device_path_equals_the_cpu_paths_steps_in_its_order(toy_small, toy_binary, case, train):
    config, overrides, extra = CASES[case]
    root = toy_binary if "AttFuse" in case else toy_small  # both the reader's floats and the file's records
    data = build_dataset(hypes(config, root, ON, *overrides, **extra), "train" if train else "validate",
                         train=train, seed=5)
    data.set_epoch(2)
    for batch, clouds in device_batches(data, list(range(min(len(data), 6)))):
        prepared = prepare_batch(batch, torch.device("cpu"))
        entries = [prepared["ego"]] if "ego" in prepared and len(clouds) == 1 else list(prepared.values())
        for entry, packed in zip(entries, clouds):
            assert_same_voxels(entry["processed_lidar"], cpu_steps(packed))


def pillars(voxels: dict) -> dict:
    """{(group, z, y, x): sorted point rows} of a collated voxel dict."""
    out = {}
    for coords, count, rows in zip(voxels["voxel_coords"].tolist(), voxels["voxel_num_points"].tolist(),
                                   bits(voxels["voxel_features"])):
        out[tuple(coords)] = (count, sorted(map(tuple, rows[:count].tolist())))
    return out


@pytest.mark.parametrize("config", ["toy/point_pillar_intermediate_fusion", "toy/point_pillar_early_fusion",
                                    "opv2v/point_pillar_intermediate_fusion"])
def test_device_samples_have_the_cpu_paths_pillars_and_points(toy_small, config):
    """The CPU path itself against the device path: the same pillars; a pillar that is not full holds the same
    points (a full one holds a draw of its points, drawn by each path's own shuffle)."""
    cpu = build_dataset(hypes(config, toy_small), "validate", train=False, seed=5)
    device = build_dataset(hypes(config, toy_small, ON), "validate", train=False, seed=5)
    limit = device.voxel_grid
    for index in range(len(cpu)):
        expected = pillars(cpu.collate_batch_train([cpu[index]])["ego"]["processed_lidar"])
        batch = prepare_batch(device.collate_batch_train([device[index]]), torch.device("cpu"))
        actual = pillars(batch["ego"]["processed_lidar"])
        assert actual.keys() == expected.keys()
        for cell, (count, rows) in expected.items():
            if count < limit.max_points_per_voxel:
                assert actual[cell] == (count, rows), cell
            else:
                assert actual[cell][0] == count


def voxels_by_cloud(voxels: dict, cloud: int) -> dict:
    rows = voxels["voxel_coords"][:, 0] == cloud
    return {key: value[rows] for key, value in voxels.items()}


def test_a_samples_pillars_do_not_depend_on_its_batch_its_reader_or_a_resume(toy_small):
    """World size and worker count change which samples share a batch and which process reads them; a resume
    reads an epoch anew in a fresh dataset. None of them changes a sample's pillars."""
    config = hypes("toy/point_pillar_intermediate_fusion", toy_small, ON)
    data = build_dataset(config, "train", train=True, seed=5)
    data.set_epoch(1)
    alone = [prepare_batch(data.collate_batch_train([data[i]]), "cpu")["ego"]["processed_lidar"] for i in (0, 1)]
    loader = DataLoader(data, batch_size=2, num_workers=2, collate_fn=data.collate_batch_train)
    together = prepare_batch(next(iter(loader)), "cpu")["ego"]["processed_lidar"]
    cavs = data[0]["ego"]["cav_num"]
    for cav in range(cavs):
        expected = voxels_by_cloud(alone[0], cav)
        actual = voxels_by_cloud(together, cav)
        assert_same_voxels({**actual, "voxel_coords": actual["voxel_coords"][:, 1:]},
                           {**expected, "voxel_coords": expected["voxel_coords"][:, 1:]})
    resumed = build_dataset(config, "train", train=True, seed=5)
    resumed.set_epoch(1)
    assert_same_voxels(prepare_batch(resumed.collate_batch_train([resumed[1]]), "cpu")["ego"]["processed_lidar"],
                       alone[1])
    resumed.set_epoch(2)  # another epoch draws another shuffle: a pillar that is full keeps other points
    other = prepare_batch(resumed.collate_batch_train([resumed[1]]), "cpu")["ego"]["processed_lidar"]
    assert not torch.equal(other["voxel_features"], alone[1]["voxel_features"])


@pytest.mark.parametrize("binary", [False, True])
def test_the_workers_hand_over_the_clouds_as_read(toy_small, toy_binary, binary):
    """A binary file's records as stored (the colour's bits decoded on the device), an ascii one as read."""
    data = build_dataset(hypes("toy/point_pillar_early_fusion", toy_binary if binary else toy_small, ON), "train",
                         train=True, seed=5)
    sample = data[0]["ego"]
    lidar = sample["processed_lidar"]
    assert isinstance(lidar, RawLidar) and not lidar.separate and not lidar.crop_first
    for cloud in lidar.clouds:
        assert cloud.colour_bits == binary
        if binary:
            stored = np.fromfile(cloud.path, dtype=np.uint8)[-cloud.points.nbytes:]
            assert np.array_equal(cloud.points.view(np.uint8).ravel(), stored)
        assert np.array_equal(bits(cloud.decoded()), bits(data.source.points(_frame_of(data, cloud.path))))
        assert cloud.to_ego.shape == (4, 4) and cloud.to_ego.dtype == np.float64
    assert "anchor_box" in sample or data.post_processor is None


def _frame_of(data, path: str):
    for index in range(len(data)):
        for cav in data.received_cavs(index):
            if str(cav.sent.pcd_path) == path:
                return cav.sent
    raise AssertionError(path)


def test_a_training_step_and_an_evaluation_batch_run_on_prepared_voxels(toy_small):
    from opencood_ddp.engine.evaluator import EvalRequest
    from opencood_ddp.tasks.opencood import build_eval, build_task

    config = hypes("toy/point_pillar_intermediate_fusion", toy_small, ON)
    task = build_task(config, for_training=True)
    batch = task.move_to(task.collate_train([task.train_set[0], task.train_set[1]]), torch.device("cpu"))
    loss = task.step(task.model, batch)
    loss.total.backward()
    assert torch.isfinite(loss.total)
    spec = build_eval(config, EvalRequest(batch_size=2, run_dir=None, test_split=False, dataset_dir=None,
                                          task_options=None))
    spec.model.eval()
    two = spec.move_to(spec.collate([spec.dataset[0], spec.dataset[1]]), torch.device("cpu"))
    assert all("processed_lidar" not in frame["ego"] for frame in two["frames"])
    one = spec.move_to(spec.collate([spec.dataset[0]]), torch.device("cpu"))
    assert one["frames"][0] is one["model_input"]
    first = voxels_by_cloud(two["model_input"]["ego"]["processed_lidar"], 0)
    assert torch.equal(first["voxel_features"],
                       voxels_by_cloud(one["model_input"]["ego"]["processed_lidar"], 0)["voxel_features"])


def test_non_finite_points_are_told_once_per_file(caplog):
    grid = VoxelGrid((0.4, 0.4, 4.0), (-10, -10, -3, 10, 10, 1), 4, 100)
    points = np.zeros((5, 4), dtype=np.float32)
    points[:, 0] = [3, np.nan, 4, 5, np.inf]
    lidar = RawLidar([RawCloud(points, (1, 2), "/data/damaged.pcd")], grid, separate=True, crop_first=False)
    with caplog.at_level(logging.WARNING, logger="opencood_ddp"):
        for _ in range(2):
            voxels = prepare_batch({"lidar": collate_raw([lidar])}, "cpu")["lidar"]
    told = [record.message for record in caplog.records if "damaged.pcd" in record.message]
    assert told == ["/data/damaged.pcd: 2 of 5 points have non-finite coordinates and are dropped; the file is "
                    "damaged (regenerate or restore it if this is not expected)"]
    assert int(voxels["voxel_num_points"].sum()) == 3


def test_the_switch_is_a_checked_key_and_needs_a_device_voxelizer(toy_small):
    with pytest.raises(ConfigError, match="preprocess.on_device must be"):
        build_dataset(hypes("toy/point_pillar_intermediate_fusion", toy_small, "preprocess.on_device=1"),
                      "train", train=True, seed=0)
    with pytest.raises(ConfigError, match="has no voxel_grid"):
        voxel_grid_of(object(), "x.yaml")


@pytest.mark.cuda  # pinned memory and the CUDA path
def test_the_cuda_path_equals_the_cpu_path(toy_small):
    data = build_dataset(hypes("opv2v/point_pillar_intermediate_fusion", toy_small, ON), "train", train=True,
                         seed=5)
    batch = data.collate_batch_train([data[0], data[1]])
    batch["ego"]["processed_lidar"] = batch["ego"]["processed_lidar"].pin_memory()
    on_cpu = prepare_batch(batch, "cpu")["ego"]["processed_lidar"]
    on_gpu = prepare_batch(batch, "cuda")["ego"]["processed_lidar"]
    assert_same_voxels({key: value.cpu() for key, value in on_gpu.items()}, on_cpu)


def write_binary_pcd(path: Path, fields: str, records: np.ndarray) -> None:
    """A binary .pcd of float32 fields ``fields`` (e.g. 'x y z rgb') whose rows are ``records``."""
    names = fields.split()
    header = (f"VERSION 0.7\nFIELDS {fields}\nSIZE {' '.join('4' for _ in names)}\n"
              f"TYPE {' '.join('F' for _ in names)}\nCOUNT {' '.join('1' for _ in names)}\nWIDTH {len(records)}\n"
              f"HEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS {len(records)}\nDATA binary\n")
    path.write_bytes(header.encode("ascii") + np.ascontiguousarray(records, dtype=np.float32).tobytes())


def test_stored_records_are_read_pcds_points_once_decoded(tmp_path):
    """OPV2V's records (x y z rgb) come as stored; any other layout as read_pcd reads it; a short file is refused."""
    from opencood_ddp.data.pcd import read_pcd, read_pcd_records
    from opencood_ddp.errors import DataError

    rng = np.random.default_rng(3)
    rows = rng.uniform(-5, 5, (50, 4)).astype(np.float32)
    rows[:, 3] = (rng.integers(0, 256, 50, dtype=np.uint32) * np.uint32(0x010101)).view(np.float32)
    write_binary_pcd(tmp_path / "rgb.pcd", "x y z rgb", rows)
    stored, packed = read_pcd_records(tmp_path / "rgb.pcd")
    assert packed and np.array_equal(bits(stored), bits(rows))
    decoded = RawCloud(stored, (0, 0), "rgb.pcd", colour_bits=True).decoded()
    assert np.array_equal(bits(decoded), bits(read_pcd(tmp_path / "rgb.pcd")))
    write_binary_pcd(tmp_path / "intensity.pcd", "x y z intensity", rows)
    points, packed = read_pcd_records(tmp_path / "intensity.pcd")
    assert not packed and np.array_equal(bits(points), bits(read_pcd(tmp_path / "intensity.pcd")))
    (tmp_path / "short.pcd").write_bytes((tmp_path / "rgb.pcd").read_bytes()[:-5])
    with pytest.raises(DataError, match="short.pcd: truncated binary data"):
        read_pcd_records(tmp_path / "short.pcd")


def test_a_device_task_asks_for_fewer_gpu_workers_only_on_binary_clouds(toy_small, toy_binary):
    """tasks/opencood.py's Task.gpu_workers: 4 where the workers read binary clouds for the device, else the
    engine's rule (None), in training and evaluation alike."""
    from opencood_ddp.engine.evaluator import EvalRequest
    from opencood_ddp.tasks.opencood import DEVICE_PATH_WORKERS, build_eval, build_task

    for root, on, expected in ((toy_binary, True, DEVICE_PATH_WORKERS), (toy_small, True, None),
                               (toy_binary, False, None)):
        overrides = ["preprocess.on_device=true"] if on else []
        config = hypes("toy/point_pillar_intermediate_fusion", root, *overrides)
        assert build_task(config, for_training=True).gpu_workers == expected
        assert build_eval(config, EvalRequest()).gpu_workers == expected
