"""Copy a toy OPV2V set with a road-side unit into the on-disk layout of DAIR-V2X-C, as HEAL and CoAlign read it.

DAIR-V2X-C (cooperative-vehicle-infrastructure) pairs one vehicle with one infrastructure LiDAR per frame. The
copy pairs each toy scenario's ego CAV (the first CAV folder in OpenCOOD's order) with its road-side unit (folder
``-1``), frame by frame, and writes, under ``out_dir`` (= HEAL's ``data_dir``; paths relative to it)::

    toy_manifest.yaml                                     what was copied from what (reuse, like the toy set)
    train.json  val.json  test.json                       flat lists of 6-digit vehicle frame ids per split
    cooperative/data_info.json                            one entry per vehicle/infrastructure frame pair
    cooperative/label_world/{veh}.json                    complemented cooperative labels, world corners
    cooperative/label_world_backup/{veh}.json             the "original" labels: the front-camera subset
    vehicle-side/velodyne/{veh}.pcd                       the ego CAV's cloud, vehicle LiDAR frame
    vehicle-side/calib/lidar_to_novatel/{veh}.json        fixed LiDAR mount on the GNSS/INS box
    vehicle-side/calib/novatel_to_world/{veh}.json        INS pose, so that the composition is the LiDAR pose
    vehicle-side/calib/lidar_to_camera/{veh}.json         constant (camera readers only)
    vehicle-side/calib/camera_intrinsic/{veh}.json        constant (camera readers only)
    vehicle-side/label/lidar/{veh}.json                   complemented single-side labels, vehicle LiDAR frame
    vehicle-side/label/lidar_backup/{veh}.json            their front-camera subset
    infrastructure-side/velodyne/{inf}.pcd                the RSU's cloud, its (virtual) LiDAR frame
    infrastructure-side/calib/virtuallidar_to_world/{inf}.json   RSU pose minus the frame's system error offset
    infrastructure-side/calib/virtuallidar_to_camera/{inf}.json  constant (camera readers only)
    infrastructure-side/calib/camera_intrinsic/{inf}.json        constant (camera readers only)
    infrastructure-side/label/virtuallidar/{inf}.json     the RSU's labels, its LiDAR frame

No images are written: LiDAR readers only take the frame id from ``vehicle_image_path`` and never open it.

What a reader must get right, so the copy makes it visible (facts: shared/reference/DATASET_FACTS.md section 1):

- vehicle ids count ``000000, 000001, ...`` in generation order (train, validate, test; scenarios and frames
  sorted); infrastructure ids are numbered apart (from ``010000``), so the infra id must come from data_info;
- ``data_info.json`` also holds a couple of pairs that no split lists (real data_info is larger than the splits);
- ``system_error_offset`` is ``{"delta_x", "delta_y"}``, or ``""`` for about one pair in five (read as zero); the
  written RSU translation is the true one minus the offset, so translation + offset is the true pose;
- the clouds are ``x y z intensity`` float32 binary PCDs with the raw 0..255 intensity (readers divide by 256),
  and a few carry two NaN rows (HEAL drops them);
- the cooperative corners are in DAIR's own order, not OpenCOOD's; the single-side labels hold box centres, yaw
  in radians, and, in some frames, a Pedestrian, a TrafficCone and a zero-length Car that readers must drop.

Deterministic: every random draw comes from a numpy Generator keyed (seed, split index, scenario index, frame),
so the same source and seed give byte-identical files (the manifest's timing aside).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np

from opencood_ddp.data.geometry import box_corners_from_object, pose_to_matrix, wrap_angle
from opencood_ddp.data.opv2v import is_rsu_id, lidar_pose_of, load_opv2v_yaml, order_cav_ids
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.toy.config import SPLITS
from opencood_ddp.toy.manifest import (MANIFEST_NAME, ToySetKind, is_complete_match, read_toy_manifest,
                                       write_toy_set)

PathLike = Union[str, Path]

LAYOUT = "dairv2x"
LAYOUT_VERSION = 1  # bump whenever the written bytes change for a given source and seed
# The manifest's format differs from the toy OPV2V set's, so neither writer mistakes the other's folder for its own.
LAYOUT_FORMAT = "opencood_ddp-toy-dairv2x"
RSU_FOLDER = "-1"

# Split file of each toy split (DAIR/CoAlign call the validation list val.json).
SPLIT_FILES: Dict[str, str] = {"train": "train.json", "validate": "val.json", "test": "test.json"}
# Infrastructure ids start here (a multiple of it above the vehicle count), so that they never equal a vehicle id.
INFRA_ID_START = 10000
# Pairs in data_info.json that no split lists.
UNLISTED_PAIRS = 2
# Share of pairs whose system_error_offset is "" (DAIR: frames without a fused label), and the offsets' range (m).
EMPTY_OFFSET_SHARE = 0.2
OFFSET_MAX_M = 1.5
# Share of clouds given two NaN rows, and of vehicle frames given the three labels a reader must drop.
NAN_CLOUD_SHARE = 0.25
JUNK_LABEL_SHARE = 0.5
JUNK_RADIUS_M = 30.0
# The original DAIR labels cover the vehicle's front camera only: centres with x > 0 and |bearing| < 60 degrees.
FRONT_FOV_HALF_DEG = 60.0
# Boxes at least this long are labelled "Van", shorter ones "Car" (toy vehicles are 3.7-5.8 m long).
VAN_MIN_LENGTH_M = 5.0

# The fixed LiDAR mount on the vehicle's NovAtel box: [x, y, z, roll, yaw, pitch] (metres, degrees).
LIDAR_TO_NOVATEL_POSE = (0.6, -0.1, 1.2, 0.0, 0.8, 0.0)
# DAIR's corners: bottom (+l,+w), (+l,-w), (-l,-w), (-l,+w), then the top in the same order. Index k of that order
# is corner _DAIR_FROM_OPENCOOD[k] of OpenCOOD's order (bottom (+,-), (+,+), (-,+), (-,-), then the top).
_DAIR_FROM_OPENCOOD = (1, 0, 3, 2, 5, 4, 7, 6)

# Camera calibrations: constant and plausible, read by camera pipelines only. A camera looks along the LiDAR's +x
# with its x to the right and y down: camera = R @ lidar with rows (-y, -z, x).
_LIDAR_TO_CAMERA_ROTATION = ((0.0, -1.0, 0.0), (0.0, 0.0, -1.0), (1.0, 0.0, 0.0))
_VEHICLE_CAMERA = {"translation": (0.0, -0.3, -0.5),
                   "cam_K": (1000.0, 0.0, 960.0, 0.0, 1000.0, 540.0, 0.0, 0.0, 1.0),
                   "cam_D": (-0.12, 0.05, 0.0, 0.0, 0.0)}
_INFRA_CAMERA = {"translation": (0.0, 0.2, -0.3),
                 "cam_K": (2200.0, 0.0, 960.0, 0.0, 2200.0, 540.0, 0.0, 0.0, 1.0),
                 "cam_D": (-0.3, 0.1, 0.0, 0.0, 0.0)}

# (type, l, w, h) of the labels readers must drop: two non-vehicle classes and a vehicle of zero length.
_JUNK_LABELS = (("Pedestrian", 0.6, 0.6, 1.7), ("TrafficCone", 0.4, 0.4, 0.7), ("Car", 0.0, 1.8, 1.5))

_VELODYNE = ("vehicle-side/velodyne", "infrastructure-side/velodyne")
_FOLDERS = (
    "cooperative/label_world", "cooperative/label_world_backup",
    *_VELODYNE,
    "vehicle-side/calib/lidar_to_novatel", "vehicle-side/calib/novatel_to_world",
    "vehicle-side/calib/lidar_to_camera", "vehicle-side/calib/camera_intrinsic",
    "vehicle-side/label/lidar", "vehicle-side/label/lidar_backup",
    "infrastructure-side/calib/virtuallidar_to_world", "infrastructure-side/calib/virtuallidar_to_camera",
    "infrastructure-side/calib/camera_intrinsic", "infrastructure-side/label/virtuallidar",
)
# Everything this module writes at the top of out_dir (a folder holding anything else is never deleted) and where its
# clouds are (the reuse check counts them).
DAIRV2X_SET = ToySetKind(LAYOUT_FORMAT, (*SPLIT_FILES.values(), "cooperative", "vehicle-side", "infrastructure-side"),
                         tuple(f"{folder}/*.pcd" for folder in _VELODYNE), "the DAIR-V2X-C-layout toy copy")


@dataclass(frozen=True)
class _SourceFrame:
    """One ego timestamp of the source: where its vehicle and RSU files are, and its Generator key."""

    split_index: int
    scenario_index: int
    frame_index: int
    ego_folder: Path
    rsu_folder: Path
    timestamp: str

    def key(self, seed: int) -> Tuple[int, int, int, int]:
        return (int(seed), self.split_index, self.scenario_index, self.frame_index)


@dataclass(frozen=True)
class _Box:
    """One toy vehicle at one frame: its world pose (4x4 object-to-world), full sizes and world corners."""

    vehicle_id: int
    pose: np.ndarray  # (4, 4): box frame (centre, x along l) -> world
    size_lwh: Tuple[float, float, float]
    corners: np.ndarray  # (8, 3) world corners, OpenCOOD's order

    @property
    def kind(self) -> str:
        return "Car" if self.size_lwh[0] < VAN_MIN_LENGTH_M else "Van"


# ------------------------------------------------------------------------------------------------ public API


def write_dairv2x_copy(opv2v_root: PathLike, out_dir: PathLike, seed: int = 0) -> dict:
    """Write the toy OPV2V set with RSU at opv2v_root into out_dir in DAIR-V2X-C's layout; return a summary.

    A complete copy of the same source identity and seed already in out_dir is reused (summary['skipped'] True);
    an earlier copy of another identity, or an interrupted one, is replaced; any other non-empty folder is refused.
    DataError when the source is not a complete toy OPV2V set or a scenario has no road-side unit folder ``-1``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"DAIR-V2X copy seed {seed!r} must be a non-negative integer; pass e.g. seed=0")
    seed = int(seed)
    source = Path(opv2v_root)
    out = Path(out_dir)
    identity = {"format": LAYOUT_FORMAT, "layout": LAYOUT, "layout_version": LAYOUT_VERSION, "seed": seed,
                "source": _source_identity(source)}
    def plan():  # the source's frames, checked before an earlier copy is replaced
        splits = _source_frames(source)
        return lambda: {"frames": {split: len(frames) for split, frames in zip(SPLITS, splits)},
                        "clouds": _write_copy(out, splits, seed), "seed": seed}

    return write_toy_set(out, identity, DAIRV2X_SET, plan)


def format_dairv2x_summary(summary: Mapping[str, Any]) -> str:
    """One paragraph for people: what was written (or reused) where, how many frame pairs, how long it took."""
    frames = summary["frames"]
    if summary.get("skipped"):
        verb, timing = "Reused the complete DAIR-V2X-C layout copy in", f"written earlier in {summary['seconds']:.1f} s"
    else:
        verb, timing = "Wrote a DAIR-V2X-C layout copy of the toy set to", f"in {summary['seconds']:.1f} s"
    return (f"{verb} {summary['out_dir']} (seed {summary['seed']}): {frames['train']} train / "
            f"{frames['validate']} val / {frames['test']} test vehicle-infrastructure frame pairs (train.json, "
            f"val.json, test.json) plus {UNLISTED_PAIRS} pairs listed only in cooperative/data_info.json, "
            f"{summary.get('clouds', '?')} point clouds, no camera images, {timing}.")


# --------------------------------------------------------------------------------------------- the source


def _source_identity(source: Path) -> dict:
    """The source's manifest minus summary and completion; DataError unless it is a complete toy set with RSUs."""
    regenerate = f"generate it with tools/make_toy_opv2v.py --out {source} --rsu (API: rsu=True)"
    if not source.is_dir():
        raise DataError(f"{source}: toy OPV2V folder not found; {regenerate}")
    manifest = read_toy_manifest(source)
    if manifest is None:
        raise DataError(f"{source}: not a toy OPV2V set (no generator {MANIFEST_NAME}); {regenerate}")
    identity = {k: v for k, v in manifest.items() if k not in ("summary", "complete")}
    if not is_complete_match(source, manifest, identity):
        raise DataError(f"{source}: the toy OPV2V set is incomplete (interrupted, or clouds missing); {regenerate}")
    if not (manifest.get("config") or {}).get("rsu"):
        raise DataError(f"{source}: the toy OPV2V set has no road-side unit (DAIR-V2X-C needs one per frame); "
                        f"{regenerate}")
    return identity


def _subfolders(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _stamps(folder: Path) -> List[str]:
    """Sorted yaml stems of a CAV folder, as the OPV2V reader takes them."""
    return sorted(p.stem for p in folder.glob("*.yaml") if "additional" not in p.name)


def _source_frames(source: Path) -> List[List[_SourceFrame]]:
    """Per split, every ego timestamp in generation order (scenarios and frames sorted)."""
    splits = []
    for split_index, split in enumerate(SPLITS):
        frames: List[_SourceFrame] = []
        for scenario_index, name in enumerate(_subfolders(source / split)):
            scenario = source / split / name
            names = _subfolders(scenario)
            cav_ids = order_cav_ids(names, len(names))
            if RSU_FOLDER not in cav_ids:
                raise DataError(f"{scenario}: no road-side unit folder {RSU_FOLDER} (DAIR-V2X-C pairs every vehicle "
                                f"frame with one); generate the set with tools/make_toy_opv2v.py --rsu")
            if is_rsu_id(cav_ids[0]):
                raise DataError(f"{scenario}: no vehicle folder beside the road-side unit; generate the set again "
                                f"with tools/make_toy_opv2v.py --rsu")
            ego, rsu = scenario / cav_ids[0], scenario / RSU_FOLDER
            stamps = _stamps(ego)
            missing = sorted(set(stamps).difference(_stamps(rsu)))
            if missing:
                raise DataError(f"{rsu / (missing[0] + '.yaml')}: the road-side unit lacks timestamp {missing[0]} of "
                                f"the ego {cav_ids[0]}; generate the set again with tools/make_toy_opv2v.py --rsu")
            frames.extend(_SourceFrame(split_index, scenario_index, k, ego, rsu, stamp)
                          for k, stamp in enumerate(stamps))
        splits.append(frames)
    if not any(splits):
        raise DataError(f"{source}: the toy OPV2V set holds no frame; generate it again with "
                        f"tools/make_toy_opv2v.py --rsu")
    return splits


# ------------------------------------------------------------------------------------- manifest and folder


# ------------------------------------------------------------------------------------------------ the copy


def _frame_id(number: int) -> str:
    return f"{number:06d}"


def _write_copy(out: Path, splits: Sequence[Sequence[_SourceFrame]], seed: int) -> int:
    """Every file of the copy; returns the number of point clouds written."""
    for folder in _FOLDERS:
        (out / folder).mkdir(parents=True, exist_ok=True)
    listed = [frame for frames in splits for frame in frames]  # never empty: _source_frames refuses that
    # The unlisted pairs repeat the first and last source frames under new ids, drawing from Generators of a split
    # index no split has, so adding them changes no listed pair.
    unlisted = [(listed[0], (seed, len(SPLITS), 0, 0)), (listed[-1], (seed, len(SPLITS), 0, 1))][:UNLISTED_PAIRS]
    pairs = [(frame, frame.key(seed)) for frame in listed] + unlisted
    infra_start = INFRA_ID_START * (1 + len(pairs) // INFRA_ID_START)
    if infra_start + len(pairs) > 10 ** 6:
        raise DataError(f"{out}: {len(pairs)} frame pairs do not fit DAIR's 6-digit ids; copy a smaller toy set")
    data_info = [_write_pair(out, _frame_id(n), _frame_id(infra_start + n), frame, np.random.default_rng(key))
                 for n, (frame, key) in enumerate(pairs)]
    _write_json(out / "cooperative" / "data_info.json", data_info)
    number = 0
    for split, frames in zip(SPLITS, splits):
        _write_json(out / SPLIT_FILES[split], [_frame_id(number + k) for k in range(len(frames))])
        number += len(frames)
    return 2 * len(pairs)


def _write_pair(out: Path, veh: str, inf: str, frame: _SourceFrame, rng: np.random.Generator) -> dict:
    """All files of one vehicle/infrastructure frame pair; returns its data_info entry.

    The draws come in a fixed order (offset, the two clouds' NaN rows, the junk labels) from the pair's own
    Generator, so each pair's bytes depend on its key only.
    """
    ego_yaml = frame.ego_folder / f"{frame.timestamp}.yaml"
    rsu_yaml = frame.rsu_folder / f"{frame.timestamp}.yaml"
    ego, rsu = load_opv2v_yaml(ego_yaml), load_opv2v_yaml(rsu_yaml)
    vehicle_pose = pose_to_matrix(lidar_pose_of(ego, ego_yaml))
    infra_pose = pose_to_matrix(lidar_pose_of(rsu, rsu_yaml))
    offset = _draw_offset(rng)

    _write_cloud(out / "vehicle-side" / "velodyne" / f"{veh}.pcd",
                 frame.ego_folder / f"{frame.timestamp}.pcd", rng)
    _write_cloud(out / "infrastructure-side" / "velodyne" / f"{inf}.pcd",
                 frame.rsu_folder / f"{frame.timestamp}.pcd", rng)
    _write_vehicle_calib(out, veh, vehicle_pose)
    _write_infra_calib(out, inf, infra_pose, offset)

    ego_id = int(frame.ego_folder.name)
    ego_boxes = _boxes(ego.get("vehicles") or {}, ego_yaml)
    rsu_boxes = _boxes(rsu.get("vehicles") or {}, rsu_yaml)
    vehicle_labels = [_single_side_label(box, vehicle_pose) for box in ego_boxes.values()]
    if rng.random() < JUNK_LABEL_SHARE:
        vehicle_labels.extend(_junk_labels(rng, ground_z=-float(vehicle_pose[2, 3])))
    _write_json(out / "vehicle-side" / "label" / "lidar" / f"{veh}.json", vehicle_labels)
    _write_json(out / "vehicle-side" / "label" / "lidar_backup" / f"{veh}.json",
                [label for label in vehicle_labels if _in_front_fov(_location(label))])
    _write_json(out / "infrastructure-side" / "label" / "virtuallidar" / f"{inf}.json",
                [_single_side_label(box, infra_pose) for box in rsu_boxes.values()])

    # The union of both sensors' lists, the ego itself left out (the RSU lists it), ordered by toy vehicle id.
    union = {**rsu_boxes, **ego_boxes}
    world = [union[vid] for vid in sorted(union) if vid != ego_id]
    to_vehicle = np.linalg.inv(vehicle_pose)
    _write_json(out / "cooperative" / "label_world" / f"{veh}.json",
                [_world_label(box, offset) for box in world])
    _write_json(out / "cooperative" / "label_world_backup" / f"{veh}.json",
                [_world_label(box, offset) for box in world if _in_front_fov(_apply(to_vehicle, box.pose[:3, 3]))])

    return {"vehicle_image_path": f"vehicle-side/image/{veh}.jpg",
            "infrastructure_image_path": f"infrastructure-side/image/{inf}.jpg",
            "vehicle_pointcloud_path": f"vehicle-side/velodyne/{veh}.pcd",
            "infrastructure_pointcloud_path": f"infrastructure-side/velodyne/{inf}.pcd",
            "cooperative_label_path": f"cooperative/label_world/{veh}.json",
            "system_error_offset": offset}


def _draw_offset(rng: np.random.Generator) -> Union[dict, str]:
    """The pair's system_error_offset: DAIR's manual infra-to-vehicle correction, "" where it has none."""
    empty = rng.random() < EMPTY_OFFSET_SHARE
    delta = rng.uniform(-OFFSET_MAX_M, OFFSET_MAX_M, size=2)  # drawn either way: the draw count stays fixed
    return "" if empty else {"delta_x": float(delta[0]), "delta_y": float(delta[1])}


def _offset_xy(offset: Union[dict, str]) -> Tuple[float, float]:
    """DAIR's reading of the offset: "" means none (DAIR's calib_i2v does the same)."""
    return (0.0, 0.0) if offset == "" else (float(offset["delta_x"]), float(offset["delta_y"]))


# ---------------------------------------------------------------------------------------------------- clouds


def _write_cloud(path: Path, source_pcd: Path, rng: np.random.Generator) -> None:
    """The source cloud (already in its sensor frame) with DAIR's raw 0..255 intensity, sometimes 2 NaN rows."""
    points = read_pcd(source_pcd).astype(np.float64)
    # The toy intensity is byte / 255 (OPV2V's colour channel): rounding recovers the byte exactly.
    points[:, 3] = np.round(points[:, 3] * 255.0)
    if rng.random() < NAN_CLOUD_SHARE:
        rows = np.sort(rng.integers(0, len(points) + 1, size=2))
        points = np.insert(points, rows, [np.nan, np.nan, np.nan, 0.0], axis=0)
    _write_xyzi_pcd(path, points)


def _write_xyzi_pcd(path: Path, points: np.ndarray) -> None:
    """(N, 4) x, y, z, intensity as a binary PCD of four float32 fields, as pypcd reads DAIR's clouds."""
    count = len(points)
    header = "\n".join((
        "# .PCD v0.7 - Point Cloud Data file format",
        "VERSION 0.7",
        "FIELDS x y z intensity",
        "SIZE 4 4 4 4",
        "TYPE F F F F",
        "COUNT 1 1 1 1",
        f"WIDTH {count}",
        "HEIGHT 1",
        "VIEWPOINT 0 0 0 1 0 0 0",
        f"POINTS {count}",
        "DATA binary",
    )) + "\n"
    with open(path, "wb") as handle:
        handle.write(header.encode("ascii"))
        handle.write(np.ascontiguousarray(points, dtype="<f4").tobytes())


# ----------------------------------------------------------------------------------------------- calibration


def _rotation(matrix: np.ndarray) -> List[List[float]]:
    return [[float(v) for v in row] for row in matrix[:3, :3]]


def _column(values: Sequence[float]) -> List[List[float]]:
    """A translation as DAIR writes it: a 3x1 nested list (HEAL indexes translation[0][0])."""
    return [[float(v)] for v in values]


def _write_vehicle_calib(out: Path, veh: str, vehicle_pose: np.ndarray) -> None:
    """lidar_to_novatel (fixed mount) and novatel_to_world such that their composition is the LiDAR pose.

    Readers compute T_world_lidar = [R_n2w R_l2n, R_n2w t_l2n + t_n2w], i.e. T_n2w @ T_l2n, so
    T_n2w = T_world_lidar @ inv(T_l2n).
    """
    lidar_to_novatel = pose_to_matrix(LIDAR_TO_NOVATEL_POSE)
    novatel_to_world = vehicle_pose @ np.linalg.inv(lidar_to_novatel)
    calib = out / "vehicle-side" / "calib"
    _write_json(calib / "lidar_to_novatel" / f"{veh}.json",
                {"transform": {"rotation": _rotation(lidar_to_novatel),
                               "translation": _column(lidar_to_novatel[:3, 3])}})
    _write_json(calib / "novatel_to_world" / f"{veh}.json",
                {"rotation": _rotation(novatel_to_world), "translation": _column(novatel_to_world[:3, 3])})
    _write_camera_calib(calib / "lidar_to_camera" / f"{veh}.json", calib / "camera_intrinsic" / f"{veh}.json",
                        _VEHICLE_CAMERA)


def _write_infra_calib(out: Path, inf: str, infra_pose: np.ndarray, offset: Union[dict, str]) -> None:
    """virtuallidar_to_world holds the true pose minus the pair's offset: readers add the offset back."""
    dx, dy = _offset_xy(offset)
    translation = infra_pose[:3, 3] - np.array([dx, dy, 0.0])
    calib = out / "infrastructure-side" / "calib"
    # relative_error is "" as in DAIR's files; HEAL and CoAlign take the offset from data_info instead.
    _write_json(calib / "virtuallidar_to_world" / f"{inf}.json",
                {"rotation": _rotation(infra_pose), "translation": _column(translation),
                 "relative_error": {"delta_x": "", "delta_y": ""}})
    _write_camera_calib(calib / "virtuallidar_to_camera" / f"{inf}.json", calib / "camera_intrinsic" / f"{inf}.json",
                        _INFRA_CAMERA)


def _write_camera_calib(extrinsic: Path, intrinsic: Path, camera: Mapping[str, Sequence[float]]) -> None:
    _write_json(extrinsic, {"rotation": [list(row) for row in _LIDAR_TO_CAMERA_ROTATION],
                            "translation": _column(camera["translation"])})
    _write_json(intrinsic, {"cam_K": list(camera["cam_K"]), "cam_D": list(camera["cam_D"])})


# ---------------------------------------------------------------------------------------------------- labels


def _boxes(vehicles: Mapping[Any, Mapping[str, Any]], source: Path) -> Dict[int, _Box]:
    """The toy yaml's ``vehicles`` as world boxes, keyed by toy vehicle id, in the file's order."""
    boxes = {}
    for vid, entry in vehicles.items():
        try:
            location, center, angle, extent = (np.asarray(entry[k], dtype=np.float64)
                                               for k in ("location", "center", "angle", "extent"))
            pose = pose_to_matrix(np.concatenate([location + center, angle]))
            corners = box_corners_from_object(location, center, extent, angle)
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{source}: vehicle {vid} needs location, center, angle and extent as 3 numbers each; "
                            f"generate the toy set again") from None
        boxes[int(vid)] = _Box(int(vid), pose, tuple(float(2.0 * e) for e in extent), corners)
    return boxes


def _apply(matrix: np.ndarray, point: np.ndarray) -> np.ndarray:
    return matrix[:3, :3] @ point + matrix[:3, 3]


def _yaw(matrix: np.ndarray) -> float:
    """Heading of a rotation's x axis about +z, radians in [-pi, pi) (boxes and sensors are level here)."""
    return float(wrap_angle(math.atan2(matrix[1, 0], matrix[0, 0])))


def _in_front_fov(centre: Sequence[float]) -> bool:
    """Inside the vehicle's front camera view, the only region DAIR's original vehicle labels cover."""
    x, y = float(centre[0]), float(centre[1])
    return x > 0.0 and abs(math.atan2(y, x)) < math.radians(FRONT_FOV_HALF_DEG)


def _location(label: Mapping[str, Any]) -> Tuple[float, float, float]:
    loc = label["3d_location"]
    return (loc["x"], loc["y"], loc["z"])


def _sensor_label(kind: str, centre: Sequence[float], size_lwh: Sequence[float], yaw: float) -> dict:
    """A single-side label of DAIR's schema: box centre in the sensor frame, full sizes, yaw in radians."""
    length, width, height = (float(v) for v in size_lwh)
    return {"type": kind, "truncated_state": 0, "occluded_state": 0, "alpha": 0.0,
            "2d_box": {"xmin": 0.0, "ymin": 0.0, "xmax": 0.0, "ymax": 0.0},
            "3d_dimensions": {"h": height, "w": width, "l": length},
            "3d_location": {"x": float(centre[0]), "y": float(centre[1]), "z": float(centre[2])},
            "rotation": float(yaw)}


def _single_side_label(box: _Box, sensor_pose: np.ndarray) -> dict:
    """A world box in the frame of a LiDAR at sensor_pose (the box stays upright: both are level)."""
    in_sensor = np.linalg.inv(sensor_pose) @ box.pose
    return _sensor_label(box.kind, in_sensor[:3, 3], box.size_lwh, _yaw(in_sensor))


def _junk_labels(rng: np.random.Generator, ground_z: float) -> List[dict]:
    """A Pedestrian, a TrafficCone and a zero-length Car within JUNK_RADIUS_M, standing on the ground."""
    labels = []
    for kind, length, width, height in _JUNK_LABELS:
        radius = JUNK_RADIUS_M * math.sqrt(float(rng.random()))
        bearing, yaw = (float(v) for v in rng.uniform(-math.pi, math.pi, size=2))
        centre = (radius * math.cos(bearing), radius * math.sin(bearing), ground_z + height / 2.0)
        labels.append(_sensor_label(kind, centre, (length, width, height), yaw))
    return labels


def _world_label(box: _Box, offset: Union[dict, str]) -> dict:
    """A cooperative label: world corners in DAIR's order (the field readers use) and the other fields."""
    length, width, height = box.size_lwh
    centre = box.pose[:3, 3]
    return {"type": box.kind,
            "world_8_points": [[float(v) for v in box.corners[k]] for k in _DAIR_FROM_OPENCOOD],
            "3d_dimensions": {"h": height, "w": width, "l": length},
            "3d_location": {"x": float(centre[0]), "y": float(centre[1]), "z": float(centre[2])},
            "rotation": _yaw(box.pose),
            "system_error_offset": offset}


def _write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content))
