"""The DAIR-V2X-C layout copy of a toy set with RSU (opencood_ddp/toy/dairv2x_layout.py).

Every expected value is derived by hand from shared/reference/DATASET_FACTS.md section 1 and the toy source files
(no DAIR reader exists yet): the calib compositions, the offset rule, the corner orders, the label frames.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import pytest
import yaml

from opencood_ddp.data.geometry import box_corners_from_object, corners_to_boxes, pose_to_matrix, wrap_angle
from opencood_ddp.data.opv2v import load_opv2v_yaml, order_cav_ids
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.errors import DataError
from opencood_ddp.toy.dairv2x_layout import format_dairv2x_summary, write_dairv2x_copy
from opencood_ddp.toy.manifest import MANIFEST_NAME
from opencood_ddp.toy.writer import generate_toy_opv2v

SPLIT_FILES = {"train": "train.json", "validate": "val.json", "test": "test.json"}
DATA_INFO_KEYS = {"vehicle_image_path", "infrastructure_image_path", "vehicle_pointcloud_path",
                  "infrastructure_pointcloud_path", "cooperative_label_path", "system_error_offset"}
VEHICLE_TYPES = {"Car", "Van", "Truck", "Bus"}
# DAIR's corner order in the box frame: signs of (l, w, h) offsets from the centre (facts 1.5, corner order).
DAIR_SIGNS = [(1, 1, -1), (1, -1, -1), (-1, -1, -1), (-1, 1, -1), (1, 1, 1), (1, -1, 1), (-1, -1, 1), (-1, 1, 1)]
# DAIR corner k -> position k of OpenCOOD's order (+l-w, +l+w, -l+w, -l-w, then top) is DAIR index OC_FROM_DAIR[k].
OC_FROM_DAIR = [1, 0, 3, 2, 5, 4, 7, 6]
PCD_HEADER = ("# .PCD v0.7 - Point Cloud Data file format\nVERSION 0.7\nFIELDS x y z intensity\nSIZE 4 4 4 4\n"
              "TYPE F F F F\nCOUNT 1 1 1 1\nWIDTH {n}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS {n}\nDATA binary\n")


def _source_frames(src: Path) -> List[SimpleNamespace]:
    """Source frames in generation order: splits, sorted scenarios, ego = first CAV in OpenCOOD order, sorted stamps."""
    frames = []
    for split in SPLIT_FILES:
        for scenario in sorted(p for p in (src / split).iterdir() if p.is_dir()):
            names = [p.name for p in scenario.iterdir() if p.is_dir()]
            ego = order_cav_ids(names, len(names))[0]
            for stamp in sorted(p.stem for p in (scenario / ego).glob("*.yaml")):
                frames.append(SimpleNamespace(split=split, ego=scenario / ego, rsu=scenario / "-1", stamp=stamp,
                                              ego_id=int(ego)))
    return frames


def _load(path: Path):
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("dairv2x")
    src = root / "opv2v"
    generate_toy_opv2v(src, seed=0, scale="small", rsu=True)
    out = root / "dair"
    summary = write_dairv2x_copy(src, out, seed=0)
    data_info = _load(out / "cooperative" / "data_info.json")
    by_veh = {entry["vehicle_image_path"].split("/")[-1].replace(".jpg", ""): entry for entry in data_info}
    splits = {split: _load(out / name) for split, name in SPLIT_FILES.items()}
    listed = [veh for split in SPLIT_FILES for veh in splits[split]]
    pairs = []
    for veh, frame in zip(listed, _source_frames(src)):
        entry = by_veh[veh]
        inf = entry["infrastructure_image_path"].split("/")[-1].replace(".jpg", "")
        pairs.append(SimpleNamespace(veh=veh, inf=inf, entry=entry, frame=frame,
                                     ego_yaml=load_opv2v_yaml(frame.ego / f"{frame.stamp}.yaml"),
                                     rsu_yaml=load_opv2v_yaml(frame.rsu / f"{frame.stamp}.yaml")))
    return SimpleNamespace(root=root, src=src, out=out, summary=summary, data_info=data_info, by_veh=by_veh,
                           splits=splits, listed=listed, pairs=pairs)


def _vehicle_pose_from_calib(out: Path, veh: str) -> np.ndarray:
    """Facts 1.4: T_world_lidar = [R_n2w R_l2n, R_n2w t_l2n + t_n2w]."""
    l2n = _load(out / "vehicle-side" / "calib" / "lidar_to_novatel" / f"{veh}.json")["transform"]
    n2w = _load(out / "vehicle-side" / "calib" / "novatel_to_world" / f"{veh}.json")
    r_l2n, t_l2n = np.array(l2n["rotation"]), np.array(l2n["translation"])
    r_n2w, t_n2w = np.array(n2w["rotation"]), np.array(n2w["translation"])
    matrix = np.eye(4)
    matrix[:3, :3] = r_n2w @ r_l2n
    matrix[:3, 3:] = r_n2w @ t_l2n + t_n2w
    return matrix


def _offset(entry: dict) -> tuple:
    offset = entry["system_error_offset"]
    return (0.0, 0.0) if offset == "" else (offset["delta_x"], offset["delta_y"])


def _in_front_fov(x: float, y: float) -> bool:
    return x > 0 and abs(math.atan2(y, x)) < math.radians(60.0)


def _world_centre(vehicle: dict) -> np.ndarray:
    return np.add(vehicle["location"], vehicle["center"])


# ------------------------------------------------------------------------------------------------- layout


def test_summary_and_split_files(copy):
    assert copy.summary["frames"] == {"train": 8, "validate": 4, "test": 4}
    assert copy.summary["skipped"] is False and copy.summary["seed"] == 0
    assert copy.summary["out_dir"] == str(copy.out)
    assert str(copy.out) in format_dairv2x_summary(copy.summary)
    # Vehicle ids count up in generation order, one flat list per split.
    assert copy.listed == [f"{n:06d}" for n in range(16)]
    assert [len(copy.splits[s]) for s in SPLIT_FILES] == [8, 4, 4]
    assert len(copy.pairs) == 16


def test_data_info_names_existing_files(copy):
    for entry in copy.data_info:
        assert set(entry) == DATA_INFO_KEYS
        veh = entry["vehicle_image_path"].split("/")[-1].replace(".jpg", "")
        inf = entry["infrastructure_image_path"].split("/")[-1].replace(".jpg", "")
        assert len(veh) == len(inf) == 6 and veh.isdigit() and inf.isdigit()
        assert entry["vehicle_image_path"] == f"vehicle-side/image/{veh}.jpg"
        assert entry["infrastructure_image_path"] == f"infrastructure-side/image/{inf}.jpg"
        assert entry["vehicle_pointcloud_path"] == f"vehicle-side/velodyne/{veh}.pcd"
        assert entry["infrastructure_pointcloud_path"] == f"infrastructure-side/velodyne/{inf}.pcd"
        assert entry["cooperative_label_path"] == f"cooperative/label_world/{veh}.json"
        # Every file HEAL reads for a sample (facts 1.1), the camera calibs included; images are not written.
        needed = [entry["vehicle_pointcloud_path"], entry["infrastructure_pointcloud_path"],
                  entry["cooperative_label_path"], entry["cooperative_label_path"].replace("label_world",
                                                                                           "label_world_backup")]
        needed += [f"vehicle-side/calib/{kind}/{veh}.json"
                   for kind in ("lidar_to_novatel", "novatel_to_world", "lidar_to_camera", "camera_intrinsic")]
        needed += [f"vehicle-side/label/{kind}/{veh}.json" for kind in ("lidar", "lidar_backup")]
        needed += [f"infrastructure-side/calib/{kind}/{inf}.json"
                   for kind in ("virtuallidar_to_world", "virtuallidar_to_camera", "camera_intrinsic")]
        needed += [f"infrastructure-side/label/virtuallidar/{inf}.json"]
        for relative in needed:
            assert (copy.out / relative).is_file(), relative
        assert not (copy.out / entry["vehicle_image_path"]).exists()


def test_ids_split_coverage_and_unlisted_pairs(copy):
    vehicle_ids = set(copy.by_veh)
    infra_ids = {e["infrastructure_image_path"].split("/")[-1][:-4] for e in copy.data_info}
    assert len(vehicle_ids) == len(infra_ids) == len(copy.data_info)
    assert not vehicle_ids & infra_ids  # a reader must take the infra id from data_info
    assert set(copy.listed) <= vehicle_ids
    unlisted = vehicle_ids - set(copy.listed)
    assert 1 <= len(unlisted) <= 2


def test_calib_schemas(copy):
    pair = copy.pairs[0]
    l2n = _load(copy.out / "vehicle-side" / "calib" / "lidar_to_novatel" / f"{pair.veh}.json")
    assert set(l2n) == {"transform"} and set(l2n["transform"]) == {"rotation", "translation"}
    assert np.shape(l2n["transform"]["rotation"]) == (3, 3) and np.shape(l2n["transform"]["translation"]) == (3, 1)
    n2w = _load(copy.out / "vehicle-side" / "calib" / "novatel_to_world" / f"{pair.veh}.json")
    assert set(n2w) == {"rotation", "translation"} and np.shape(n2w["translation"]) == (3, 1)
    v2w = _load(copy.out / "infrastructure-side" / "calib" / "virtuallidar_to_world" / f"{pair.inf}.json")
    assert set(v2w) == {"rotation", "translation", "relative_error"}
    assert np.shape(v2w["translation"]) == (3, 1) and set(v2w["relative_error"]) == {"delta_x", "delta_y"}
    for relative in (f"vehicle-side/calib/lidar_to_camera/{pair.veh}.json",
                     f"infrastructure-side/calib/virtuallidar_to_camera/{pair.inf}.json"):
        extrinsic = _load(copy.out / relative)
        assert np.shape(extrinsic["rotation"]) == (3, 3) and np.shape(extrinsic["translation"]) == (3, 1)
    for relative in (f"vehicle-side/calib/camera_intrinsic/{pair.veh}.json",
                     f"infrastructure-side/calib/camera_intrinsic/{pair.inf}.json"):
        intrinsic = _load(copy.out / relative)
        assert len(intrinsic["cam_K"]) == 9 and len(intrinsic["cam_D"]) == 5


# -------------------------------------------------------------------------------------------------- poses


def test_vehicle_calib_composes_to_the_lidar_pose(copy):
    for pair in copy.pairs:
        expected = pose_to_matrix(pair.ego_yaml["lidar_pose"])
        np.testing.assert_allclose(_vehicle_pose_from_calib(copy.out, pair.veh), expected, rtol=0, atol=1e-9)
    # The mount is not the identity, so the composition is really exercised.
    l2n = _load(copy.out / "vehicle-side" / "calib" / "lidar_to_novatel" / f"{copy.pairs[0].veh}.json")
    assert np.abs(np.array(l2n["transform"]["translation"])).max() > 0.1


def test_infra_translation_plus_offset_is_the_true_pose(copy):
    offsets = [pair.entry["system_error_offset"] for pair in copy.pairs]
    assert "" in offsets and any(isinstance(o, dict) for o in offsets)  # both kinds occur
    for pair in copy.pairs:
        calib = _load(copy.out / "infrastructure-side" / "calib" / "virtuallidar_to_world" / f"{pair.inf}.json")
        truth = pose_to_matrix(pair.rsu_yaml["lidar_pose"])
        dx, dy = _offset(pair.entry)
        translation = np.array(calib["translation"])[:, 0] + [dx, dy, 0.0]
        np.testing.assert_allclose(translation, truth[:3, 3], rtol=0, atol=1e-9)
        np.testing.assert_allclose(np.array(calib["rotation"]), truth[:3, :3], rtol=0, atol=1e-12)
        assert calib["relative_error"] == {"delta_x": "", "delta_y": ""}
        if isinstance(pair.entry["system_error_offset"], dict):
            assert abs(dx) + abs(dy) > 0  # a non-empty offset really moves the written pose


# ------------------------------------------------------------------------------------------------- labels


def test_label_world_is_the_union_with_dair_corners(copy):
    for pair in copy.pairs:
        labels = _load(copy.out / pair.entry["cooperative_label_path"])
        union: Dict[int, dict] = {**pair.rsu_yaml["vehicles"], **pair.ego_yaml["vehicles"]}
        union.pop(pair.frame.ego_id, None)
        assert len(labels) == len(union)
        expected = corners_to_boxes(np.stack([
            box_corners_from_object(v["location"], v["center"], v["extent"], v["angle"])
            for _, v in sorted(union.items())]))
        dair = np.array([label["world_8_points"] for label in labels])
        from_dair = corners_to_boxes(dair)
        from_opencood = corners_to_boxes(dair[:, OC_FROM_DAIR])
        np.testing.assert_allclose(from_dair, from_opencood, rtol=0, atol=1e-9)
        np.testing.assert_allclose(from_dair, expected, rtol=0, atol=1e-9)
        for label, corners in zip(labels, dair):
            assert label["type"] == ("Car" if label["3d_dimensions"]["l"] < 5.0 else "Van")
            assert label["system_error_offset"] == pair.entry["system_error_offset"]
            centre = np.array([label["3d_location"][k] for k in "xyz"])
            yaw = label["rotation"]
            axes = np.array([[math.cos(yaw), math.sin(yaw), 0.0], [-math.sin(yaw), math.cos(yaw), 0.0],
                             [0.0, 0.0, 1.0]])
            signs = np.sign(np.round((corners - centre) @ axes.T, 9))
            assert signs.tolist() == [list(s) for s in DAIR_SIGNS]


def _check_sensor_labels(labels: List[dict], vehicles: dict, sensor_pose: np.ndarray) -> None:
    """Each vehicle label, mapped to world by the sensor pose, is the source object (centre, yaw, sizes, type)."""
    kept = [label for label in labels if label["type"] in VEHICLE_TYPES and label["3d_dimensions"]["l"] > 0]
    assert len(kept) == len(vehicles)
    sensor_yaw = math.atan2(sensor_pose[1, 0], sensor_pose[0, 0])
    for label, vehicle in zip(kept, vehicles.values()):
        centre = np.array([label["3d_location"][k] for k in "xyz"])
        np.testing.assert_allclose(sensor_pose[:3, :3] @ centre + sensor_pose[:3, 3], _world_centre(vehicle),
                                   rtol=0, atol=1e-9)
        assert -math.pi <= label["rotation"] < math.pi
        assert abs(wrap_angle(label["rotation"] + sensor_yaw - math.radians(vehicle["angle"][1]))) < 1e-9
        dims = label["3d_dimensions"]
        np.testing.assert_allclose([dims["l"], dims["w"], dims["h"]], np.multiply(vehicle["extent"], 2.0),
                                   rtol=0, atol=1e-12)
        assert label["type"] == ("Car" if dims["l"] < 5.0 else "Van")
        assert set(label) == {"type", "truncated_state", "occluded_state", "alpha", "2d_box", "3d_dimensions",
                              "3d_location", "rotation"}


def test_single_side_labels_map_back_to_the_world(copy):
    junk_frames = 0
    for pair in copy.pairs:
        vehicle_labels = _load(copy.out / "vehicle-side" / "label" / "lidar" / f"{pair.veh}.json")
        _check_sensor_labels(vehicle_labels, pair.ego_yaml["vehicles"], pose_to_matrix(pair.ego_yaml["lidar_pose"]))
        infra_labels = _load(copy.out / "infrastructure-side" / "label" / "virtuallidar" / f"{pair.inf}.json")
        _check_sensor_labels(infra_labels, pair.rsu_yaml["vehicles"], pose_to_matrix(pair.rsu_yaml["lidar_pose"]))
        junk = [label for label in vehicle_labels
                if label["type"] not in VEHICLE_TYPES or label["3d_dimensions"]["l"] == 0]
        if junk:
            junk_frames += 1
            assert sorted(label["type"] for label in junk) == ["Car", "Pedestrian", "TrafficCone"]
            for label in junk:
                assert math.hypot(label["3d_location"]["x"], label["3d_location"]["y"]) <= 30.0
    assert 0 < junk_frames < len(copy.pairs)  # "in some frames"


def test_backup_labels_are_the_front_camera_subsets(copy):
    for pair in copy.pairs:
        world = _load(copy.out / "cooperative" / "label_world" / f"{pair.veh}.json")
        backup = _load(copy.out / "cooperative" / "label_world_backup" / f"{pair.veh}.json")
        to_lidar = np.linalg.inv(pose_to_matrix(pair.ego_yaml["lidar_pose"]))
        front = []
        for label in world:
            centre = to_lidar[:3, :3] @ [label["3d_location"][k] for k in "xyz"] + to_lidar[:3, 3]
            if _in_front_fov(centre[0], centre[1]):
                front.append(label)
        assert backup == front and len(backup) < len(world)
        single = _load(copy.out / "vehicle-side" / "label" / "lidar" / f"{pair.veh}.json")
        single_backup = _load(copy.out / "vehicle-side" / "label" / "lidar_backup" / f"{pair.veh}.json")
        assert single_backup == [label for label in single
                                 if _in_front_fov(label["3d_location"]["x"], label["3d_location"]["y"])]


# ------------------------------------------------------------------------------------------------- clouds


def test_point_clouds_are_xyzi_binary_with_raw_intensity(copy):
    nan_clouds = 0
    for pair in copy.pairs:
        for relative, source in ((pair.entry["vehicle_pointcloud_path"], pair.frame.ego),
                                 (pair.entry["infrastructure_pointcloud_path"], pair.frame.rsu)):
            raw = (copy.out / relative).read_bytes()
            points = read_pcd(copy.out / relative)
            assert raw.startswith(PCD_HEADER.format(n=len(points)).encode("ascii"))
            assert len(raw) == len(PCD_HEADER.format(n=len(points))) + 16 * len(points)
            nan_rows = np.isnan(points[:, :3]).any(axis=1)
            assert nan_rows.sum() in (0, 2) and np.isnan(points[nan_rows, :3]).all()
            nan_clouds += bool(nan_rows.any())
            finite = points[~nan_rows]
            intensity = finite[:, 3]
            assert intensity.min() >= 0 and intensity.max() <= 255 and np.all(intensity == np.round(intensity))
            expected = read_pcd(source / f"{pair.frame.stamp}.pcd")
            np.testing.assert_array_equal(finite[:, :3], expected[:, :3])
            np.testing.assert_array_equal(intensity, np.round(expected[:, 3].astype(np.float64) * 255.0))
            assert intensity.max() > 1  # raw bytes, not the source's 0..1
    assert 0 < nan_clouds < 2 * len(copy.pairs)  # "a few clouds"


# ------------------------------------------------------------------------------------ determinism and reuse


def _files(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def test_a_second_copy_is_byte_identical(copy):
    other = copy.root / "dair_again"
    summary = write_dairv2x_copy(copy.src, other, seed=0)
    assert summary["skipped"] is False
    first, second = _files(copy.out), _files(other)
    assert sorted(first) == sorted(second)
    assert all(first[name] == second[name] for name in first)
    manifests = [yaml.safe_load((root / MANIFEST_NAME).read_text()) for root in (copy.out, other)]
    for manifest in manifests:
        manifest["summary"].pop("seconds")
    assert manifests[0] == manifests[1]


def test_a_complete_copy_is_reused(copy):
    before = (copy.out / "cooperative" / "data_info.json").stat().st_mtime_ns
    summary = write_dairv2x_copy(copy.src, copy.out, seed=0)
    assert summary["skipped"] is True and summary["frames"] == copy.summary["frames"]
    assert (copy.out / "cooperative" / "data_info.json").stat().st_mtime_ns == before
    assert format_dairv2x_summary(summary).startswith("Reused")


# ---------------------------------------------------------------------------------------------- refusals


def test_refuses_a_folder_that_is_not_a_toy_set(copy, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("not a toy set")
    with pytest.raises(DataError) as info:
        write_dairv2x_copy(tmp_path / "src", tmp_path / "out")
    assert str(tmp_path / "src") in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_refuses_a_toy_set_without_rsu(tmp_path):
    src = tmp_path / "plain"
    generate_toy_opv2v(src, seed=0, scale="small", rsu=False)
    with pytest.raises(DataError, match="--rsu") as info:
        write_dairv2x_copy(src, tmp_path / "out")
    assert str(src) in str(info.value) and "\n" not in str(info.value)


def test_refuses_a_scenario_without_rsu_folder(copy, tmp_path):
    # A hard-linked copy of the source, one RSU folder removed and its clouds taken off the manifest's count, so
    # that only the folder check can catch it. The manifest is rewritten, never edited through its link.
    src = tmp_path / "src"
    shutil.copytree(copy.src, src, copy_function=os.link)
    scenario = sorted((src / "validate").iterdir())[0]
    removed = len(list((scenario / "-1").glob("*.pcd")))
    shutil.rmtree(scenario / "-1")
    manifest = yaml.safe_load((src / MANIFEST_NAME).read_text())
    manifest["summary"]["clouds"] -= removed
    (src / MANIFEST_NAME).unlink()
    (src / MANIFEST_NAME).write_text(yaml.safe_dump(manifest))
    with pytest.raises(DataError, match="road-side unit folder -1") as info:
        write_dairv2x_copy(src, tmp_path / "out")
    assert str(scenario) in str(info.value)


def test_refuses_a_non_empty_out_dir_without_manifest(copy, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("someone's file")
    with pytest.raises(DataError, match="not empty"):
        write_dairv2x_copy(copy.src, out)
    assert (out / "keep.txt").read_text() == "someone's file"
