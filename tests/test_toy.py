"""The synthetic toy world: OPV2V layout and fields, sensor-frame points, real occlusion, determinism,
cooperation that helps, and the manifest's reuse / refusal rules."""
import dataclasses
import re
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import yaml

from launch import load_tool
from opencood_ddp.data.geometry import pose_to_matrix
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.errors import DataError
from opencood_ddp.toy import lidar
from opencood_ddp.toy.config import GROUND_Z, SPLITS, LidarConfig, ToyWorldConfig
from opencood_ddp.toy.manifest import MANIFEST_NAME, read_toy_manifest
from opencood_ddp.toy.world import TIMESTAMP_STEP, build_scene, lidar_pose, scene_boxes
from opencood_ddp.toy.writer import generate_toy_opv2v

SEED = 7
# The region the toy hypes detect in, ego frame: x +-48 m, y +-24 m.
ROI = (-48.0, -24.0, 48.0, 24.0)
TINY = dataclasses.replace(ToyWorldConfig.preset("small"), train_scenarios=1, validate_scenarios=0,
                           test_scenarios=1, frames_per_scenario=2,
                           lidar=LidarConfig(beams=8, azimuth_steps=128))


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "opv2v"
    summary = generate_toy_opv2v(out, seed=SEED, scale="small")
    assert not summary["skipped"]
    return out


def _data_files(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def _frames(root: Path, split: str):
    """(scenario folder, sorted CAV ids, timestamps) of every scenario of a split."""
    for scenario in sorted((root / split).iterdir()):
        cavs = sorted(p.name for p in scenario.iterdir())
        stamps = sorted(p.stem for p in (scenario / cavs[0]).glob("*.yaml"))
        yield scenario, cavs, stamps


# ------------------------------------------------------------------------------------------- determinism
def test_same_seed_gives_byte_identical_files_and_another_seed_differs(tmp_path):
    first = generate_toy_opv2v(tmp_path / "a", seed=3, config=TINY)
    generate_toy_opv2v(tmp_path / "b", seed=3, config=TINY)
    generate_toy_opv2v(tmp_path / "c", seed=4, config=TINY)
    a, b, c = (_data_files(tmp_path / name) for name in "abc")
    assert first["clouds"] > 0 and len(a) == 2 * first["clouds"]
    assert a == b
    assert a != c


# ---------------------------------------------------------------------------------------- layout, yaml
def test_layout_follows_opv2v(small_set):
    assert sorted(p.name for p in small_set.iterdir()) == sorted(SPLITS + (MANIFEST_NAME,))
    config = ToyWorldConfig.preset("small")
    for split in SPLITS:
        scenarios = list(_frames(small_set, split))
        assert len(scenarios) == config.scenarios_in(split)
        for scenario, cavs, stamps in scenarios:
            assert re.fullmatch(r"\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2}", scenario.name)
            assert config.min_cavs <= len(cavs) <= config.max_cavs
            assert all(re.fullmatch(r"[1-9]\d*", cav) for cav in cavs)
            assert len(stamps) == config.frames_per_scenario
            assert all(re.fullmatch(r"\d{6}", s) for s in stamps)
            assert np.all(np.diff([int(s) for s in stamps]) == TIMESTAMP_STEP)
            for cav in cavs:
                names = sorted(p.name for p in (scenario / cav).iterdir())
                assert names == sorted([f"{s}.pcd" for s in stamps] + [f"{s}.yaml" for s in stamps])


def _check_pose(value, name):
    assert isinstance(value, list) and len(value) == 6, name
    assert all(isinstance(v, float) for v in value), name


def test_yaml_has_the_fields_opencood_reads(small_set):
    for scenario, cavs, stamps in _frames(small_set, "train"):
        for cav in cavs:
            for stamp in stamps:
                meta = yaml.safe_load((scenario / cav / f"{stamp}.yaml").read_text())
                for key in ("lidar_pose", "true_ego_pos", "predicted_ego_pos"):
                    _check_pose(meta[key], key)
                assert isinstance(meta["ego_speed"], float) and meta["ego_speed"] >= 0
                pose, body = meta["lidar_pose"], meta["true_ego_pos"]
                assert pose[3] == pose[5] == 0.0 and pose[4] == body[4]
                assert pose[2] - body[2] == pytest.approx(1.9)
                vehicles = meta["vehicles"]
                assert int(cav) not in vehicles, "a CAV must not list itself"
                assert {int(c) for c in cavs if c != cav} <= set(vehicles), "other CAVs are vehicles too"
                for vid, v in vehicles.items():
                    assert isinstance(vid, int)
                    assert set(v) == {"location", "center", "angle", "extent", "speed"}
                    for key in ("location", "center", "angle", "extent"):
                        assert len(v[key]) == 3 and all(isinstance(x, float) for x in v[key])
                    assert isinstance(v["speed"], float)
                    assert all(0.5 < e < 3.0 for e in v["extent"]), "extents are half sizes of a car"


def test_vehicles_move_consistently_between_timestamps(small_set):
    scenario, cavs, stamps = next(_frames(small_set, "train"))
    config = ToyWorldConfig.preset("small")
    metas = [yaml.safe_load((scenario / cavs[0] / f"{s}.yaml").read_text()) for s in stamps]
    for vid, first in metas[0]["vehicles"].items():
        later = metas[-1]["vehicles"].get(vid)
        if later is None:
            continue
        moved = np.hypot(*np.subtract(later["location"][:2], first["location"][:2]))
        expected = first["speed"] / 3.6 * config.frame_interval_s * (len(stamps) - 1)
        assert moved == pytest.approx(expected, abs=1e-3)
        assert later["angle"] == first["angle"] and later["extent"] == first["extent"]


# ------------------------------------------------------------------------------------------ point clouds
def _load(scenario: Path, cav: str, stamp: str):
    meta = yaml.safe_load((scenario / cav / f"{stamp}.yaml").read_text())
    return read_pcd(scenario / cav / f"{stamp}.pcd"), meta


def test_points_are_in_the_sensor_frame_with_intensity_in_unit_range(small_set):
    scenario, cavs, stamps = next(_frames(small_set, "train"))
    for cav in cavs:
        points, meta = _load(scenario, cav, stamps[-1])
        assert points.shape[1] == 4 and 3000 < len(points) < 40000
        assert points[:, 3].min() >= 0.0 and points[:, 3].max() <= 1.0
        # The ground is the most common surface: around -1.9 m in the sensor frame ...
        near_ground = np.abs(points[:, 2] + 1.9) < 0.1
        assert near_ground.mean() > 0.3
        # ... and at z = 0 in the world once the lidar pose is applied.
        world = points[:, :3] @ pose_to_matrix(meta["lidar_pose"])[:3, :3].T + meta["lidar_pose"][:3]
        assert np.median(world[near_ground, 2]) == pytest.approx(GROUND_Z, abs=0.02)
        assert len(np.unique(np.round(points[:, 3], 2))) > 10, "intensity carries information"


def _world_points(points: np.ndarray, meta: dict) -> np.ndarray:
    matrix = pose_to_matrix(meta["lidar_pose"])
    return points[:, :3] @ matrix[:3, :3].T + matrix[:3, 3]


def _points_in_box(world: np.ndarray, vehicle: dict, margin: float = 0.1) -> int:
    """Points inside an OPV2V box: centre = location + center (world frame), yaw = angle[1]."""
    centre = np.add(vehicle["location"], vehicle["center"])
    yaw = np.radians(vehicle["angle"][1])
    rel = world - centre
    local_x = rel[:, 0] * np.cos(yaw) + rel[:, 1] * np.sin(yaw)
    local_y = -rel[:, 0] * np.sin(yaw) + rel[:, 1] * np.cos(yaw)
    ext = np.asarray(vehicle["extent"]) + margin
    return int(np.count_nonzero((np.abs(local_x) <= ext[0]) & (np.abs(local_y) <= ext[1])
                                & (np.abs(rel[:, 2]) <= ext[2])))


def _in_roi(vehicle: dict, ego_pose: List[float]) -> bool:
    centre = np.append(np.add(vehicle["location"], vehicle["center"]), 1.0)
    x, y = (np.linalg.inv(pose_to_matrix(ego_pose)) @ centre)[:2]
    return ROI[0] <= x <= ROI[2] and ROI[1] <= y <= ROI[3]


def test_cooperation_sees_more_vehicles_than_the_ego_alone(small_set):
    seen_by_ego = seen_by_all = total = 0
    min_points = 5
    for split in SPLITS:
        for scenario, cavs, stamps in _frames(small_set, split):
            for stamp in stamps:
                clouds = {cav: _load(scenario, cav, stamp) for cav in cavs}
                ego_meta = clouds[cavs[0]][1]
                vehicles = {}
                for _, meta in clouds.values():
                    vehicles.update(meta["vehicles"])
                vehicles.pop(int(cavs[0]), None)
                worlds = {cav: _world_points(points, meta) for cav, (points, meta) in clouds.items()}
                for vehicle in vehicles.values():
                    if not _in_roi(vehicle, ego_meta["lidar_pose"]):
                        continue
                    counts = {cav: _points_in_box(world, vehicle) for cav, world in worlds.items()}
                    total += 1
                    seen_by_ego += counts[cavs[0]] >= min_points
                    seen_by_all += sum(counts.values()) >= min_points
    assert total >= 30
    # The ego sees a fair share on its own (points and boxes agree), the others add a clear margin.
    assert seen_by_ego / total > 0.3
    assert seen_by_all / total >= seen_by_ego / total + 0.1


# ------------------------------------------------------------------------------------------ ray casting
def _car(x: float, y: float, yaw: float = 0.0) -> List[float]:
    return [x, y, 0.8, 2.25, 0.95, 0.8, yaw]


def test_a_car_behind_a_building_gets_no_points():
    building = [15.0, 0.0, 4.0, 1.0, 6.0, 4.0, 0.0]
    boxes = np.array([building, _car(30.0, 0.0, 0.3), _car(0.0, 20.0, 1.2)])
    rays = lidar.lidar_directions(LidarConfig(beams=32, azimuth_steps=1024)).reshape(-1, 3)
    origin = np.array([0.0, 0.0, 1.9])
    hits = lidar.cast_rays(origin, rays, boxes, max_range=80.0)
    assert np.count_nonzero(hits.target == 0) > 100
    assert np.count_nonzero(hits.target == 1) == 0, "hidden behind the building"
    assert np.count_nonzero(hits.target == 2) > 20, "in plain view"
    assert np.count_nonzero(hits.target == lidar.GROUND) > 1000
    without_building = lidar.cast_rays(origin, rays, boxes[1:], max_range=80.0)
    assert np.count_nonzero(without_building.target == 0) > 20


def test_ray_hits_are_exact_and_chunking_changes_nothing():
    origin = np.array([0.0, 0.0, 1.9])
    forward = np.array([[1.0, 0.0, 0.0]])
    low = np.array([0.0, 0.0, 1.0])  # below the roof of the cars
    hit = lidar.cast_rays(low, forward, np.array([_car(10.0, 0.0)]), max_range=80.0)
    assert hit.target[0] == 0 and hit.distance[0] == pytest.approx(10.0 - 2.25)
    assert hit.cos_incidence[0] == pytest.approx(1.0)
    down = np.array([[np.cos(np.radians(-30)), 0.0, np.sin(np.radians(-30))]])
    ground = lidar.cast_rays(origin, down, np.zeros((0, 7)), max_range=80.0)
    assert ground.target[0] == lidar.GROUND and ground.distance[0] == pytest.approx(3.8)
    assert lidar.cast_rays(low, forward, np.array([_car(100.0, 0.0)]), max_range=80.0).target[0] == lidar.NO_HIT
    rng = np.random.default_rng(0)
    boxes = np.array([_car(*rng.uniform(-30, 30, 2), rng.uniform(-3, 3)) for _ in range(20)])
    rays = lidar.lidar_directions(LidarConfig(beams=8, azimuth_steps=256)).reshape(-1, 3)
    whole = lidar.cast_rays(origin, rays, boxes, 80.0, chunk_elements=1 << 22)
    chunked = lidar.cast_rays(origin, rays, boxes, 80.0, chunk_elements=50)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)


def test_azimuth_culling_gives_the_same_hits_as_casting_against_every_box():
    config = ToyWorldConfig.preset("small")
    scene = build_scene(np.random.default_rng((SEED, 0, 0)), config)
    cav = scene.cav_ids[0]
    boxes, _ = scene_boxes(scene, 0.0, exclude_id=cav)
    matrix = pose_to_matrix(lidar_pose(scene, cav, 0.0, config.lidar))
    dirs_world = lidar.lidar_directions(config.lidar) @ matrix[:3, :3].T
    culled = lidar._cast_by_sector(matrix[:3, 3], dirs_world, boxes, config.lidar)
    full = lidar.cast_rays(matrix[:3, 3], dirs_world.reshape(-1, 3), boxes, config.lidar.max_range_m)
    for a, b in zip(culled, full):
        np.testing.assert_array_equal(a.reshape(-1), b)


# ------------------------------------------------------------------------------ manifest, reuse, refusal
def test_a_complete_set_is_reused_and_an_interrupted_one_replaced(small_set, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in small_set.rglob("*.pcd")}
    again = generate_toy_opv2v(small_set, seed=SEED, scale="small")
    assert again["skipped"] and again["clouds"] == len(before)
    assert {p: p.stat().st_mtime_ns for p in small_set.rglob("*.pcd")} == before

    out = tmp_path / "toy"
    generate_toy_opv2v(out, seed=1, config=TINY)
    manifest = read_toy_manifest(out)
    (out / MANIFEST_NAME).write_text(yaml.safe_dump(dict(manifest, complete=False)))
    (out / "train" / "stale_scenario").mkdir()
    redone = generate_toy_opv2v(out, seed=1, config=TINY)
    assert not redone["skipped"] and not (out / "train" / "stale_scenario").exists()
    assert read_toy_manifest(out)["complete"] is True
    assert generate_toy_opv2v(out, seed=2, config=TINY)["skipped"] is False, "another seed regenerates"


def test_a_non_empty_folder_that_is_not_a_toy_set_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DataError) as error:
        generate_toy_opv2v(tmp_path, seed=0, config=TINY)
    assert "\n" not in str(error.value) and "not empty" in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_out_under_a_file_is_one_error_not_a_traceback(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DataError) as error:  # was NotADirectoryError from mkdir
        generate_toy_opv2v(tmp_path / "notes.txt" / "world", seed=0, config=TINY)
    assert "\n" not in str(error.value) and "cannot make" in str(error.value) and "--out" in str(error.value)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_command_line_reuses_the_set_and_reports_errors(small_set, tmp_path, capsys):
    main = load_tool("make_toy_opv2v.py").main
    assert main(["--out", str(small_set), "--seed", str(SEED), "--scale", "small"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Reused") and "points per cloud" in out
    (tmp_path / "foreign").write_text("x")
    assert main(["--out", str(tmp_path), "--seed", "0", "--scale", "small"]) == DataError.exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing" in err
    with pytest.raises(SystemExit) as stopped:  # was ignored, and --out written as a toy OPV2V set
        main(["--out", str(tmp_path / "x"), "--source", str(small_set)])
    assert stopped.value.code == 2 and "argument --source: only with --layout" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_dense_scale_has_opv2v_size_clouds(tmp_path):
    """'dense': small's scenarios seen by a 64-beam, 120 m LiDAR, so that a loading cost measured on it (gpu_check's
    loader check) is one of OPV2V-size clouds, about 60-100 k points (docs/toy_world.md)."""
    small, dense = ToyWorldConfig.preset("small"), ToyWorldConfig.preset("dense")
    assert dataclasses.replace(dense, lidar=small.lidar) == small
    assert (dense.lidar.beams, dense.lidar.max_range_m) == (64, 120.0)
    summary = generate_toy_opv2v(tmp_path / "dense", seed=0, scale="dense", binary=True)
    assert 60_000 <= summary["points_per_cloud"]["min"] <= summary["points_per_cloud"]["max"] <= 100_000
    cloud = next((tmp_path / "dense" / "train").glob("*/*/*.pcd"))
    assert len(read_pcd(cloud)) >= 60_000


def test_a_tool_reads_the_complete_world_in_its_folder_whatever_its_scale(toy_small):
    """toy_world_in (tools/demo.py, benchmark_dataset.py): a complete small world is read as it is, not replaced
    by the demo scale the tool would write into an empty folder."""
    from opencood_ddp.toy.writer import toy_world_in

    manifest = toy_small / "toy_manifest.yaml"
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    summary = toy_world_in(toy_small, scale="demo")
    assert summary["skipped"] and summary["scale"] == "small"
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before


def test_a_tool_writes_its_world_again_where_one_was_interrupted(toy_small, tmp_path):
    """toy_world_in (the demo and every benchmark tool): a world whose manifest says it was interrupted is not read
    as it is, which would time or train on part of a world, but written again in full."""
    from opencood_ddp.toy.writer import toy_world_in

    out = tmp_path / "toy"
    shutil.copytree(toy_small, out)
    manifest = read_toy_manifest(out)
    (out / MANIFEST_NAME).write_text(yaml.safe_dump(dict(manifest, complete=False)))
    shutil.rmtree(out / "test")
    summary = toy_world_in(out, scale="small")
    assert summary["skipped"] is False and read_toy_manifest(out)["complete"] is True
    assert sorted(p.relative_to(out) for p in out.rglob("*.pcd")) == \
        sorted(p.relative_to(toy_small) for p in toy_small.rglob("*.pcd"))
