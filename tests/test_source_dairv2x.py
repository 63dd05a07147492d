"""The DAIR-V2X-C reader (``fusion.dataset: dairv2x``, opencood_ddp/data/sources/dairv2x.py) against the facts.

Every expected value is derived by hand from /work/shared/reference/DATASET_FACTS.md section 1 and from the raw
files of the toy copy (``toy_dairv2x``: json read with ``json``, pcds with ``read_pcd``): the calibration chain, the
offset rule, corner_to_center, the label range, the single-side merge by BEV IoU (shapely polygons here), the pcd
reading. Nothing below calls the reader's helper functions; the reader is reached through the fusion datasets and
``source.sample_frames`` / ``source.points`` only.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Tuple

import numpy as np
import pytest
from shapely.geometry import Polygon

from launch import one_line_error as named_line
from test_datasets import assert_identical
from zoo import hypes_of
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.geometry import pose_to_matrix
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.errors import ConfigError, DataError

SEED = 3
SPLIT_FILES = {"train": "train.json", "validate": "val.json", "test": "test.json"}
VEHICLE_CLASSES = {"Car", "Van", "Truck", "Bus"}  # facts 1.5: exact case
LABEL_Z_MARGIN = 1.0  # facts 1.5: cav_lidar_range with z widened by 1 m each way
MERGE_IOU = 0.05  # facts 1.5: HEAL's heterogeneous merge
# Facts 1.5: DAIR's corners are (+l,+w), (+l,-w), (-l,-w), (-l,+w) bottom, then top; OpenCOOD's are (+l,-w), (+l,+w),
# (-l,+w), (-l,-w). OpenCOOD corner k is DAIR corner OC_FROM_DAIR[k].
OC_FROM_DAIR = [1, 0, 3, 2, 5, 4, 7, 6]
# OpenCOOD's template (facts 1.5): signs of (l/2, w/2, h/2) per corner.
OC_SIGNS = np.array([[1, -1, -1], [1, 1, -1], [-1, 1, -1], [-1, -1, -1],
                     [1, -1, 1], [1, 1, 1], [-1, 1, 1], [-1, -1, 1]], dtype=np.float64)
CAMERA_CALIBS = ("vehicle-side/calib/lidar_to_camera", "vehicle-side/calib/camera_intrinsic",
                 "infrastructure-side/calib/virtuallidar_to_camera", "infrastructure-side/calib/camera_intrinsic")


def one_line_error(exc_info, *fragments: str) -> str:
    """One line naming every fragment, then a fix after a semicolon."""
    message = named_line(exc_info, *fragments)
    assert "; " in message and message.rsplit("; ", 1)[1].strip(), message
    return message


# ------------------------------------------------------------------------------------------------ by hand


def load(path: Path):
    return json.loads(Path(path).read_text())


def dair_hypes(kind: str, data_dir: Path, *extra: str) -> dict:
    return hypes_of(f"toy/point_pillar_{kind}_fusion", *extra, toy_root=data_dir, layout="dairv2x")


def dataset(kind: str, data_dir: Path, *extra: str, split: str = "test", train: bool = False, seed: int = SEED):
    return build_dataset(dair_hypes(kind, data_dir, *extra), split, train=train, seed=seed)


def frame_id(path: str) -> str:
    """Facts 1.1: a frame id is the image path's basename without '.jpg'."""
    return path.split("/")[-1].replace(".jpg", "")


def data_info(data_dir: Path) -> Dict[str, dict]:
    return {frame_id(entry["vehicle_image_path"]): entry for entry in load(data_dir / "cooperative/data_info.json")}


def infra_id(entry: dict) -> str:
    return frame_id(entry["infrastructure_image_path"])


def calib_matrix(rotation, translation) -> np.ndarray:
    """Facts 1.3: rotation 3x3 row-major, translation 3x1 nested."""
    matrix = np.identity(4)
    matrix[:3, :3] = np.asarray(rotation, dtype=np.float64)
    matrix[:3, 3] = np.asarray(translation, dtype=np.float64)[:, 0]
    return matrix


def vehicle_to_world(data_dir: Path, veh: str) -> np.ndarray:
    """Facts 1.4: T_world_lidar = [[R_n2w R_l2n, R_n2w t_l2n + t_n2w], [0, 0, 0, 1]]."""
    l2n = load(data_dir / "vehicle-side/calib/lidar_to_novatel" / f"{veh}.json")["transform"]
    n2w = load(data_dir / "vehicle-side/calib/novatel_to_world" / f"{veh}.json")
    r_l2n, t_l2n = np.array(l2n["rotation"], dtype=np.float64), np.array(l2n["translation"], dtype=np.float64)
    r_n2w, t_n2w = np.array(n2w["rotation"], dtype=np.float64), np.array(n2w["translation"], dtype=np.float64)
    matrix = np.identity(4)
    matrix[:3, :3] = r_n2w @ r_l2n
    matrix[:3, 3:] = r_n2w @ t_l2n + t_n2w
    return matrix


def offset_xy(entry: dict) -> Tuple[float, float]:
    """Facts 1.4: system_error_offset {delta_x, delta_y}, "" meaning no offset (DAIR's calib_i2v)."""
    offset = entry["system_error_offset"]
    return (0.0, 0.0) if offset == "" else (float(offset["delta_x"]), float(offset["delta_y"]))


def infra_to_world(data_dir: Path, entry: dict) -> np.ndarray:
    """Facts 1.4: T_world_vlidar = [[R, t + (delta_x, delta_y, 0)], [0, 0, 0, 1]]."""
    record = load(data_dir / "infrastructure-side/calib/virtuallidar_to_world" / f"{infra_id(entry)}.json")
    matrix = calib_matrix(record["rotation"], record["translation"])
    matrix[:2, 3] += offset_xy(entry)
    return matrix


def apply(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points @ matrix[:3, :3].T + matrix[:3, 3]


def corner_to_center(corners: np.ndarray) -> np.ndarray:
    """Facts 1.5 (HEAL's corner_to_center), OpenCOOD corner order -> [x, y, z, h, w, l, yaw]: centre = mean of
    corners 0, 3, 5, 6; h = mean |z top - z bottom|; l from edges 0-3, 1-2, 4-7, 5-6; w from 0-1, 2-3, 4-5, 6-7;
    yaw = mean of the atan2 headings of 1-2, 0-3, 5-6, 4-7 (rear -> front)."""
    c = np.asarray(corners, dtype=np.float64)
    centre = c[[0, 3, 5, 6]].mean(axis=0)
    height = abs(float(np.mean(c[4:, 2] - c[:4, 2])))
    length = np.mean([np.linalg.norm(c[a, :2] - c[b, :2]) for a, b in ((0, 3), (1, 2), (4, 7), (5, 6))])
    width = np.mean([np.linalg.norm(c[a, :2] - c[b, :2]) for a, b in ((0, 1), (2, 3), (4, 5), (6, 7))])
    yaw = np.mean([math.atan2(*(c[front, :2] - c[rear, :2])[::-1]) for front, rear in ((1, 2), (0, 3), (5, 6),
                                                                                          (4, 7))])
    return np.array([*centre, height, width, length, yaw])


def box_corners(box: np.ndarray) -> np.ndarray:
    """[x, y, z, h, w, l, yaw] -> (8, 3) corners in OpenCOOD's order (yaw about +z, counter-clockwise from +x)."""
    x, y, z, h, w, l, yaw = (float(v) for v in box)
    local = OC_SIGNS * np.array([l / 2, w / 2, h / 2])
    cos, sin = math.cos(yaw), math.sin(yaw)
    rotation = np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]])
    return local @ rotation.T + np.array([x, y, z])


def label_range(hypes: dict) -> np.ndarray:
    rng = np.array(hypes["postprocess"]["anchor_args"]["cav_lidar_range"], dtype=np.float64)
    return rng + np.array([0, 0, -LABEL_Z_MARGIN, 0, 0, LABEL_Z_MARGIN])


def corners_inside(corners: np.ndarray, rng: np.ndarray) -> bool:
    """All 8 corners inside the range, faces included; asserts the case is not decided by rounding."""
    low, high = rng[:3], rng[3:]
    margin = np.minimum(corners - low, high - corners)  # (8, 3): > 0 inside
    assert np.abs(margin).min() > 1e-6, "a corner lies on a face of the range: pick another frame"
    return bool((margin >= 0).all())


def cooperative_gt(data_dir: Path, veh: str, entry: dict, rng: np.ndarray, folder: str = "label_world"):
    """Facts 1.5 (label_type lidar: label_world; camera: label_world_backup): world_8_points -> inv(T_world_ego)
    -> corner_to_center; kept when all 8 corners lie in the label range; id = position in the file.
    Returns ({id: box}, number of objects in the file)."""
    path = data_dir / entry["cooperative_label_path"].replace("label_world", folder)
    labels = load(path)
    to_ego = np.linalg.inv(vehicle_to_world(data_dir, veh))
    boxes = {}
    for position, label in enumerate(labels):
        corners = apply(to_ego, np.asarray(label["world_8_points"], dtype=np.float64))[OC_FROM_DAIR]
        box = corner_to_center(corners)
        if corners_inside(box_corners(box), rng):
            boxes[position] = box
    return boxes, len(labels)


def single_side_boxes(path: Path) -> List[np.ndarray]:
    """Facts 1.5: [x, y, z, h, w, l, rotation] of the Car/Van/Truck/Bus labels with no zero size, own frame."""
    boxes = []
    for label in load(path):
        dims = label["3d_dimensions"]
        h, w, l = (float(dims[k]) for k in "hwl")
        if label["type"] not in VEHICLE_CLASSES or 0.0 in (h, w, l):
            continue
        loc = label["3d_location"]
        boxes.append(np.array([float(loc["x"]), float(loc["y"]), float(loc["z"]), h, w, l, float(label["rotation"])]))
    return boxes


def moved(box: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """A box carried by a rigid transform: its corners mapped, then corner_to_center."""
    return corner_to_center(apply(matrix, box_corners(box)))


def bev_iou(a: np.ndarray, b: np.ndarray) -> float:
    pa, pb = (Polygon(box_corners(box)[:4, :2]) for box in (a, b))
    union = pa.union(pb).area
    return pa.intersection(pb).area / union if union else 0.0


def gt_of(sample: dict, key: str = "object_bbx_center", mask_key: str = "object_bbx_mask") -> np.ndarray:
    ego = sample["ego"]
    return ego[key][ego[mask_key] == 1]


def assert_same_box(actual: np.ndarray, expected: np.ndarray, tol: float) -> None:
    np.testing.assert_allclose(actual[:6], expected[:6], atol=tol, rtol=0)
    assert abs(math.remainder(actual[6] - expected[6], 2 * math.pi)) < tol, (actual, expected)


def assert_same_boxes(actual: np.ndarray, expected: List[np.ndarray], tol: float) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected):
        assert_same_box(a, e, tol)


@pytest.fixture(scope="module")
def dair(toy_dairv2x) -> SimpleNamespace:
    data_dir = toy_dairv2x
    hypes = dair_hypes("intermediate", data_dir)
    return SimpleNamespace(data_dir=data_dir, info=data_info(data_dir), rng=label_range(hypes),
                           splits={split: load(data_dir / name) for split, name in SPLIT_FILES.items()},
                           inter=build_dataset(hypes, "test", train=False, seed=SEED))


@pytest.fixture()
def data_copy(dair, tmp_path) -> Path:
    """A private copy of the toy data_dir (6 MB) that a test may damage."""
    out = tmp_path / "cooperative-vehicle-infrastructure"
    shutil.copytree(dair.data_dir, out)
    return out


# ------------------------------------------------------------------------------------------------- poses


def test_poses_compose_the_calibration_chain_and_add_the_offset(dair):
    source = dair.inter.source
    test_ids = dair.splits["test"]
    offsets = [dair.info[veh]["system_error_offset"] for veh in test_ids]
    assert "" in offsets and any(isinstance(o, dict) for o in offsets), "the test split needs both offset forms"
    for index, veh in enumerate(test_ids):
        entry = dair.info[veh]
        frames = source.sample_frames(index)
        vehicle, infra = frames.frame(0), frames.frame(1)
        assert (vehicle.cav_id, infra.cav_id) == ("0", "1") and not vehicle.infra and infra.infra  # facts 1.2
        np.testing.assert_allclose(pose_to_matrix(vehicle.lidar_pose), vehicle_to_world(dair.data_dir, veh),
                                   atol=1e-9, rtol=0)
        np.testing.assert_allclose(pose_to_matrix(infra.lidar_pose), infra_to_world(dair.data_dir, entry),
                                   atol=1e-9, rtol=0)
        if entry["system_error_offset"] != "":  # the offset really moved the pose
            raw = load(dair.data_dir / "infrastructure-side/calib/virtuallidar_to_world" / f"{infra_id(entry)}.json")
            assert abs(pose_to_matrix(infra.lidar_pose)[0, 3] - raw["translation"][0][0]) > 1e-3


# ------------------------------------------------------------------------------------------ ground truth


def test_cooperative_labels_are_world_corners_in_the_ego_frame(dair):
    kept = dropped = 0
    for index, veh in enumerate(dair.splits["test"]):
        expected, count = cooperative_gt(dair.data_dir, veh, dair.info[veh], dair.rng)
        sample = dair.inter[index]
        boxes, ids = gt_of(sample), sample["ego"]["object_ids"]
        assert sorted(ids) == sorted(expected), (veh, ids, sorted(expected))  # ids: positions in the file
        for box, object_id in zip(boxes, ids):
            assert_same_box(box, expected[object_id], 1e-6)
        kept, dropped = kept + len(expected), dropped + count - len(expected)
    assert kept and dropped, "the test split must show both kept and out-of-range objects"


def rsu_distance(vehicle_pose: np.ndarray, infra_pose: np.ndarray) -> float:
    """Facts 1.2: sqrt(dx^2 + dy^2) of the two lidar poses' x, y."""
    return math.hypot(*(infra_pose[:2, 3] - vehicle_pose[:2, 3]))


def merged_expectation(data_dir: Path, veh: str, entry: dict, rng: np.ndarray, comm_range: float = 100.0,
                       vehicle_folder: str = "lidar"):
    """Facts 1.5 (HEAL's heterogeneous datasets): the vehicle's single-side boxes in its frame, then the road-side
    unit's in the vehicle frame that overlap no vehicle box by a BEV IoU above 0.05; each side range-filtered.
    Returns (boxes, how many of them are the road-side unit's, how many road-side boxes the IoU rule removed)."""
    vehicle = [box for box in single_side_boxes(data_dir / "vehicle-side/label" / vehicle_folder / f"{veh}.json")
               if corners_inside(box_corners(box), rng)]
    vehicle_pose, infra_pose = vehicle_to_world(data_dir, veh), infra_to_world(data_dir, entry)
    if rsu_distance(vehicle_pose, infra_pose) > comm_range:  # facts 1.2: the RSU is dropped beyond comm_range
        return vehicle, 0, 0
    to_ego = np.linalg.inv(vehicle_pose) @ infra_pose
    infra = [moved(box, to_ego)
             for box in single_side_boxes(data_dir / "infrastructure-side/label/virtuallidar"
                                          / f"{infra_id(entry)}.json")]
    infra = [box for box in infra if corners_inside(box_corners(box), rng)]
    added = [box for box in infra if all(bev_iou(box, v) <= MERGE_IOU for v in vehicle)]
    return vehicle + added, len(added), len(infra) - len(added)


def test_merged_single_side_labels(dair):
    ds = dataset("intermediate", dair.data_dir, "fusion.args.dair_labels=merged_single_side")
    junk = suppressed = added = 0
    for index, veh in enumerate(dair.splits["test"]):
        entry = dair.info[veh]
        expected, from_infra, removed = merged_expectation(dair.data_dir, veh, entry, dair.rng)
        assert_same_boxes(gt_of(ds[index]), expected, 1e-6)
        vehicle_labels = load(dair.data_dir / "vehicle-side/label/lidar" / f"{veh}.json")
        junk += sum(label["type"] not in VEHICLE_CLASSES or label["3d_dimensions"]["l"] == 0
                    for label in vehicle_labels)
        suppressed, added = suppressed + removed, added + from_infra
    assert junk and suppressed and added, "the test split must hold labels to drop, road-side duplicates and " \
                                          "road-side boxes the vehicle lacks"


def single_side_label(box: np.ndarray, kind: str = "Car") -> dict:
    """A single-side label of DAIR's schema (facts 1.5) for a box [x, y, z, h, w, l, yaw] in the sensor's frame."""
    x, y, z, h, w, l, yaw = (float(v) for v in box)
    return {"type": kind, "truncated_state": 0, "occluded_state": 0, "alpha": 0.0,
            "2d_box": {"xmin": 0.0, "ymin": 0.0, "xmax": 0.0, "ymax": 0.0},
            "3d_dimensions": {"h": h, "w": w, "l": l}, "3d_location": {"x": x, "y": y, "z": z}, "rotation": yaw}


def contains(boxes: List[np.ndarray], box: np.ndarray) -> bool:
    return any(np.allclose(b, box, atol=1e-6, rtol=0) for b in boxes)


def test_road_side_boxes_merge_by_a_bev_iou_of_0_05(dair, data_copy):
    """Two road-side boxes beside a vehicle box, shifted sideways to BEV IoUs of 0.08 (the same object: dropped)
    and 0.03 (another object: kept)."""
    index, veh = 0, dair.splits["test"][0]
    entry = dair.info[veh]
    vehicle = [box for box in single_side_boxes(data_copy / "vehicle-side/label/lidar" / f"{veh}.json")
               if abs(box[0]) < 30 and abs(box[1]) < 15]
    anchor = vehicle[0]
    width, yaw = anchor[4], anchor[6]
    side = np.array([-math.sin(yaw), math.cos(yaw), 0.0])
    to_infra = np.linalg.inv(infra_to_world(data_copy, entry)) @ vehicle_to_world(data_copy, veh)
    shifted = {}
    for iou, sign in ((0.08, 1.0), (0.03, -1.0)):  # same-size boxes shifted by s sideways: IoU = (w - s) / (w + s)
        box = anchor.copy()
        box[:3] += sign * width * (1 - iou) / (1 + iou) * side
        assert bev_iou(box, anchor) == pytest.approx(iou)
        shifted[iou] = box
    path = data_copy / "infrastructure-side/label/virtuallidar" / f"{infra_id(entry)}.json"
    labels = load(path) + [single_side_label(moved(shifted[iou], to_infra)) for iou in (0.08, 0.03)]
    path.write_text(json.dumps(labels))
    expected, _, _ = merged_expectation(data_copy, veh, entry, dair.rng)
    assert contains(expected, shifted[0.03]) and not contains(expected, shifted[0.08])
    ds = dataset("intermediate", data_copy, "fusion.args.dair_labels=merged_single_side")
    assert_same_boxes(gt_of(ds[index]), expected, 1e-6)


def test_the_label_range_widens_z_by_1_m(dair, data_copy):
    """Copies of an in-range cooperative object moved in the ego's z: bottom at z_min - 0.5 and top at z_max + 0.5
    are kept, bottom at z_min - 1.5 and top at z_max + 1.5 are not (facts 1.5: z widened by 1 m each way)."""
    index, veh = 0, dair.splits["test"][0]
    entry = dair.info[veh]
    path = data_copy / entry["cooperative_label_path"]
    labels = load(path)
    ego_pose = vehicle_to_world(data_copy, veh)
    z_min, z_max = (float(v) for v in dair_hypes("intermediate", data_copy)["postprocess"]["anchor_args"]
                    ["cav_lidar_range"][2::3])
    kept, _ = cooperative_gt(data_copy, veh, entry, dair.rng)
    source = labels[next(p for p, box in kept.items() if abs(box[0]) < 30 and abs(box[1]) < 15)]
    corners = apply(np.linalg.inv(ego_pose), np.asarray(source["world_8_points"], dtype=np.float64))
    placed = {}
    for name, shift in (("low_kept", z_min - 0.5 - corners[:, 2].min()),
                        ("low_dropped", z_min - 1.5 - corners[:, 2].min()),
                        ("high_kept", z_max + 0.5 - corners[:, 2].max()),
                        ("high_dropped", z_max + 1.5 - corners[:, 2].max())):
        placed[name] = len(labels)
        labels.append(dict(source, world_8_points=apply(ego_pose, corners + [0.0, 0.0, shift]).tolist()))
    path.write_text(json.dumps(labels))
    expected, _ = cooperative_gt(data_copy, veh, entry, dair.rng)
    assert {placed["low_kept"], placed["high_kept"]} <= set(expected)
    assert not {placed["low_dropped"], placed["high_dropped"]} & set(expected)
    sample = dataset("intermediate", data_copy)[index]
    assert sorted(sample["ego"]["object_ids"]) == sorted(expected)
    for box, object_id in zip(gt_of(sample), sample["ego"]["object_ids"]):
        assert_same_box(box, expected[object_id], 1e-6)


def test_the_road_side_unit_is_dropped_beyond_comm_range(dair):
    distances = [rsu_distance(vehicle_to_world(dair.data_dir, veh), infra_to_world(dair.data_dir, dair.info[veh]))
                 for veh in dair.splits["test"]]
    comm_range = float(np.median(distances))
    assert min(abs(d - comm_range) for d in distances) > 1e-3
    inter = dataset("intermediate", dair.data_dir, f"comm_range={comm_range}")
    merged = dataset("intermediate", dair.data_dir, f"comm_range={comm_range}",
                     "fusion.args.dair_labels=merged_single_side")
    for index, (veh, distance) in enumerate(zip(dair.splits["test"], distances)):
        assert inter[index]["ego"]["cav_num"] == (2 if distance <= comm_range else 1)
        expected, _, _ = merged_expectation(dair.data_dir, veh, dair.info[veh], dair.rng, comm_range=comm_range)
        assert_same_boxes(gt_of(merged[index]), expected, 1e-6)
    assert all(dair.inter[index]["ego"]["cav_num"] == 2 for index in range(len(distances)))  # within 100 m


def test_camera_labels_read_the_backups_and_camera_calibs_are_not_needed(dair, data_copy):
    for folder in ("cooperative/label_world", "vehicle-side/label/lidar", *CAMERA_CALIBS):
        shutil.rmtree(data_copy / folder)
    info = data_info(data_copy)
    cooperative = dataset("intermediate", data_copy, "label_type=camera")
    merged = dataset("intermediate", data_copy, "label_type=camera", "fusion.args.dair_labels=merged_single_side")
    fewer = 0
    for index, veh in enumerate(dair.splits["test"]):
        expected, _ = cooperative_gt(data_copy, veh, info[veh], dair.rng, folder="label_world_backup")
        sample = cooperative[index]
        assert sorted(sample["ego"]["object_ids"]) == sorted(expected)
        for box, object_id in zip(gt_of(sample), sample["ego"]["object_ids"]):
            assert_same_box(box, expected[object_id], 1e-6)
        fewer += len(load(dair.data_dir / f"cooperative/label_world/{veh}.json")) > len(
            load(data_copy / f"cooperative/label_world_backup/{veh}.json"))
        merged_boxes, _, _ = merged_expectation(data_copy, veh, info[veh], dair.rng, vehicle_folder="lidar_backup")
        assert_same_boxes(gt_of(merged[index]), merged_boxes, 1e-6)
    assert fewer, "the backups must differ from the complemented labels somewhere"


def test_a_missing_camera_calibration_is_no_error(dair, data_copy):
    for folder in CAMERA_CALIBS:
        shutil.rmtree(data_copy / folder)
    for kind in ("early", "intermediate", "late"):  # the same samples as with the calibrations there
        damaged, whole = dataset(kind, data_copy), dataset(kind, dair.data_dir)
        assert len(damaged) == len(whole) > 0
        for index in range(len(damaged)):
            assert_identical(damaged[index], whole[index])


@pytest.mark.parametrize("missing", ["cooperative/label_world_backup/{veh}.json",
                                     "vehicle-side/label/lidar_backup/{veh}.json"])
def test_a_missing_backup_label_is_one_line_naming_it(dair, data_copy, missing):
    veh = dair.splits["test"][1]
    path = data_copy / missing.format(veh=veh)
    path.unlink()
    extra = ["label_type=camera"]
    if "vehicle-side" in missing:
        extra.append("fusion.args.dair_labels=merged_single_side")
    ds = dataset("intermediate", data_copy, *extra)
    ds[0]  # another frame still reads
    with pytest.raises(DataError) as info:
        ds[1]
    one_line_error(info, str(path), "label_type")


# ------------------------------------------------------------------------------------------------- points


def heal_points(path: Path) -> np.ndarray:
    """Facts 1.6: x, y, z, intensity / 256 as float32, rows with a NaN deleted; sorted rows (datasets shuffle)."""
    raw = read_pcd(path)
    expected = raw[~np.isnan(raw).any(axis=1)].copy()
    expected[:, 3] = expected[:, 3] / np.float32(256.0)
    return expected[np.lexsort(expected.T[::-1])]


def sorted_rows(points: np.ndarray) -> np.ndarray:
    return points[np.lexsort(points.T[::-1])]


def test_points_are_xyz_and_intensity_over_256_without_nan_rows(dair):
    nan_clouds = 0
    for split in SPLIT_FILES:
        source = dataset("intermediate", dair.data_dir, split=split).source
        for index, veh in enumerate(dair.splits[split]):
            entry = dair.info[veh]
            frames = source.sample_frames(index)
            for slot, key in ((0, "vehicle_pointcloud_path"), (1, "infrastructure_pointcloud_path")):
                raw = read_pcd(dair.data_dir / entry[key])
                nan_clouds += bool(np.isnan(raw).any())
                assert raw[:, 3].max() > 1.0  # the files hold the raw 0..255 intensity (facts 1.6)
                points = source.points(frames.frame(slot))
                assert points.dtype == np.float32 and points.shape[1] == 4
                np.testing.assert_array_equal(sorted_rows(points), heal_points(dair.data_dir / entry[key]))
    assert nan_clouds, "some cloud must carry NaN rows"


def test_frame_ids_come_from_image_paths_and_clouds_from_data_info(dair, data_copy):
    """Facts 1.1: data_info is indexed by the image basename; the clouds are the files it names."""
    index, veh = 1, dair.splits["test"][1]
    path = data_copy / "cooperative/data_info.json"
    entries = load(path)
    entry = next(e for e in entries if frame_id(e["vehicle_image_path"]) == veh)
    renamed = {"vehicle_pointcloud_path": "vehicle-side/velodyne/lidar_sweep_a.pcd",
               "infrastructure_pointcloud_path": "infrastructure-side/velodyne/lidar_sweep_b.pcd"}
    for key, name in renamed.items():
        (data_copy / entry[key]).rename(data_copy / name)
        entry[key] = name
    path.write_text(json.dumps(entries))
    ds = dataset("intermediate", data_copy)
    frames = ds.source.sample_frames(index)
    for slot, name in enumerate(renamed.values()):
        np.testing.assert_array_equal(sorted_rows(ds.source.points(frames.frame(slot))), heal_points(data_copy / name))
    np.testing.assert_array_equal(ds[index]["ego"]["object_bbx_center"], dair.inter[index]["ego"]["object_bbx_center"])


# ------------------------------------------------------------------------------------------- late fusion


def test_late_fusion_trains_each_cav_on_its_own_labels_in_its_own_frame(dair):
    ds = dataset("late", dair.data_dir, split="train", train=True)
    chosen = set()
    for index, veh in enumerate(dair.splits["train"]):
        entry = dair.info[veh]
        own = {
            "vehicle": single_side_boxes(dair.data_dir / "vehicle-side/label/lidar" / f"{veh}.json"),
            "infra": single_side_boxes(dair.data_dir / "infrastructure-side/label/virtuallidar"
                                       / f"{infra_id(entry)}.json"),
        }
        own = {side: [b for b in boxes if corners_inside(box_corners(b), dair.rng)] for side, boxes in own.items()}
        boxes = gt_of(ds[index])
        matches = [side for side, expected in own.items()
                   if len(expected) == len(boxes) and all(np.allclose(a, e, atol=1e-9, rtol=0)
                                                          for a, e in zip(boxes, expected))]
        assert matches, f"sample {index}: its GT is neither CAV's own single-side labels"
        chosen.update(matches)
    assert chosen == {"vehicle", "infra"}


def test_late_fusion_test_ground_truth_is_the_samples(dair):
    ds = dataset("late", dair.data_dir)
    for index, veh in enumerate(dair.splits["test"]):
        sample, reference = ds[index], dair.inter[index]
        np.testing.assert_array_equal(sample["ego"]["gt_object_bbx_center"], reference["ego"]["object_bbx_center"])
        np.testing.assert_array_equal(sample["ego"]["gt_object_bbx_mask"], reference["ego"]["object_bbx_mask"])
        expected, _ = cooperative_gt(dair.data_dir, veh, dair.info[veh], dair.rng)
        assert sorted(sample["ego"]["gt_object_ids"]) == sorted(expected)
        for box, object_id in zip(gt_of(sample, "gt_object_bbx_center", "gt_object_bbx_mask"),
                                  sample["ego"]["gt_object_ids"]):
            assert_same_box(box, expected[object_id], 1e-6)


# --------------------------------------------------------------------------------------------- bad inputs


def test_a_missing_label_file_is_one_line_naming_it(dair, data_copy):
    veh = dair.splits["test"][2]
    path = data_copy / f"cooperative/label_world/{veh}.json"
    path.unlink()
    ds = dataset("intermediate", data_copy)
    with pytest.raises(DataError) as info:
        ds[2]
    one_line_error(info, str(path), "restore")


def test_an_empty_mapping_offset_is_one_line_naming_data_info(dair, data_copy):
    path = data_copy / "cooperative/data_info.json"
    entries = load(path)
    entries[3]["system_error_offset"] = {}
    path.write_text(json.dumps(entries))
    with pytest.raises(DataError) as info:
        dataset("intermediate", data_copy)
    one_line_error(info, str(path), "system_error_offset", "restore")


def test_a_split_id_without_data_info_entry_is_one_line(dair, data_copy):
    split = data_copy / "test.json"
    split.write_text(json.dumps(dair.splits["test"] + ["999999"]))
    with pytest.raises(DataError) as info:
        dataset("intermediate", data_copy)
    one_line_error(info, "test_dir", str(split), "999999", "data_info.json")


def test_a_missing_data_dir_is_one_line(dair, tmp_path):
    hypes = dair_hypes("intermediate", dair.data_dir, f"data_dir={tmp_path / 'nowhere'}")
    with pytest.raises(DataError) as info:
        build_dataset(hypes, "test", train=False, seed=SEED)
    one_line_error(info, "data_dir", str(tmp_path / "nowhere"), "set data_dir")


def test_async_is_refused_as_one_line(dair):
    hypes = dair_hypes("intermediate", dair.data_dir, "wild_setting={async: true, async_overhead: 100}")
    with pytest.raises(ConfigError) as info:
        build_dataset(hypes, "test", train=False, seed=SEED)
    one_line_error(info, "wild_setting.async", "set wild_setting.async: false")


# ------------------------------------------------------------------------------------- HEAL's ego swap
SWAP = "fusion.args.swap_ego_probability"


def test_a_swapped_training_sample_is_seen_from_the_road_side_unit(dair):
    """Probability 1: the road-side unit is every training sample's ego (slot 0, CAV id 1, its calibrated pose), the
    vehicle the other agent, and the cooperative labels are the world corners mapped into the road-side unit's
    frame (facts 1.5 with T_world_ego = virtuallidar_to_world + offset)."""
    ds = dataset("intermediate", dair.data_dir, f"{SWAP}=1.0", split="train", train=True)
    checked = 0
    for index, veh in enumerate(dair.splits["train"]):
        entry = dair.info[veh]
        vehicle_pose, infra_pose = vehicle_to_world(dair.data_dir, veh), infra_to_world(dair.data_dir, entry)
        if rsu_distance(vehicle_pose, infra_pose) > 100.0:
            continue  # the vehicle, which carries the cooperative labels, is out of range
        frames = ds.source.sample_frames(index, 0)
        ego, other = frames.frame(0), frames.frame(1)
        assert (ego.cav_id, ego.infra, ego.ego, other.cav_id, other.infra, other.ego) == \
               ("1", True, True, "0", False, False)
        np.testing.assert_allclose(pose_to_matrix(ego.lidar_pose), infra_pose, atol=1e-9, rtol=0)
        to_ego = np.linalg.inv(infra_pose)
        labels = load(dair.data_dir / entry["cooperative_label_path"])
        expected = [corner_to_center(apply(to_ego, np.asarray(label["world_8_points"], dtype=np.float64))
                                     [OC_FROM_DAIR]) for label in labels]
        expected = [box for box in expected if corners_inside(box_corners(box), dair.rng)]
        assert_same_boxes(gt_of(ds[index]), expected, 1e-6)
        checked += 1
        if checked == 3:
            break
    assert checked == 3


def test_the_swap_is_drawn_per_sample_and_epoch_from_the_seed_and_never_at_test(dair):
    def swaps(ds, epoch):
        return [ds.source.sample_frames(index, epoch).frame(0).infra for index in range(len(ds.source))]

    train = dataset("intermediate", dair.data_dir, f"{SWAP}=0.5", split="train", train=True)
    again = dataset("intermediate", dair.data_dir, f"{SWAP}=0.5", split="train", train=True)
    draws = [swaps(train, epoch) for epoch in range(3)]
    assert draws[0] == swaps(again, 0)  # another process (a rank, a worker) draws the same
    assert any(draws[0]) and not all(draws[0])  # both egos in one epoch
    assert draws[0] != draws[1] or draws[1] != draws[2]  # and a sample's ego changes with the epoch
    train.set_epoch(1)  # the dataset reads its epoch's draw
    assert [train.received_cavs(index)[0].sent.infra for index in range(len(train.source))] == draws[1]
    test = dataset("intermediate", dair.data_dir, f"{SWAP}=1.0")
    assert not any(swaps(test, 0))  # validation and test keep the vehicle the ego


def test_a_swap_probability_outside_0_1_is_one_error_line(dair):
    with pytest.raises(ConfigError) as error:
        dataset("intermediate", dair.data_dir, f"{SWAP}=1.5", split="train", train=True)
    assert SWAP in named_line(error) and "0.5" in str(error.value)
