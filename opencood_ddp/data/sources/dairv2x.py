"""DAIR-V2X-C: a vehicle and a road-side unit at Beijing intersections, as HEAL and CoAlign read it.

Facts: tests/reference/DATASET_FACTS.md section 1; the departures from the anchors are rows of
docs/compatibility.md. Hypes (the anchors' keys): ``data_dir`` (the ``cooperative-vehicle-infrastructure``
folder), ``root_dir`` / ``validate_dir`` / ``test_dir`` (split files: JSON lists of vehicle frame ids),
``fusion.dataset: dairv2x``; optional ``label_type`` (``lidar``: CoAlign's complemented labels, the default;
``camera``: the original DAIR labels), ``input_source`` (must hold ``lidar``), ``comm_range`` (metres, 100) and our
``fusion.args.dair_labels``, ``fusion.args.dair_late_gt`` and ``fusion.args.swap_ego_probability`` (below).

- A sample is one vehicle frame id of the split list. ``cooperative/data_info.json`` (parsed once, when the
  dataset is built) pairs it with its road-side frame, matched by the basename of ``vehicle_image_path``; the
  infrastructure id comes from ``infrastructure_image_path``. A split id without an entry is one error line.
- Agents: the vehicle is the ego (slot 0, CAV id ``0``), the road-side unit slot 1 (CAV id ``1``, ``infra``: V2X-ViT's
  road-side flag). ``train_params.max_cav`` 1 keeps the vehicle alone. ``fusion.args.swap_ego_probability`` p
  (HEAL's heterogeneous datasets: 0.5; default 0) makes the road-side unit the ego of a training sample with
  probability p, drawn per sample and epoch from the dataset's seed (HEAL draws from the process's global
  generator, so ranks disagree); validation and test samples keep the vehicle the ego.
- Poses: the vehicle's ``T_world_lidar`` composes ``vehicle-side/calib/lidar_to_novatel`` (its ``transform``) and
  ``novatel_to_world``; the road-side unit's is ``infrastructure-side/calib/virtuallidar_to_world`` with the frame's
  ``system_error_offset`` added to x and y. ``""`` (DAIR's value for frames without a fused label; HEAL fails on
  it) and ``""`` inside the mapping are read as no offset, as DAIR's devkit does; any other form is one error line.
  As HEAL, each matrix is stored as a CARLA 6-vector (``geometry.matrix_to_pose``), so a calibration rotation that
  is not orthonormal is orthonormalised, and localisation noise applies to x, y and yaw as on OPV2V.
- Point clouds: the pcds' ``x y z intensity``, intensity / 256 (HEAL's pypcd reading), rows with a NaN dropped.
- Ground truth (``fusion.args.dair_labels``):
  - ``cooperative`` (CoAlign's, the default): the vehicle's ``cooperative/label_world`` (``label_world_backup``
    with ``label_type: camera``): world corners (``world_8_points``) mapped into the target frame and turned into
    boxes with OpenCOOD's corner_to_center; the road-side unit adds nothing. Ids are positions in the file.
  - ``merged_single_side`` (HEAL's heterogeneous datasets): the vehicle's single-side labels
    (``vehicle-side/label/lidar``, or ``lidar_backup`` with ``label_type: camera``) plus the road-side unit's
    (``infrastructure-side/label/virtuallidar``) that overlap no vehicle box by a BEV IoU above 0.05, both mapped
    into the target frame; classes Car, Van, Truck and Bus; boxes with a zero size skipped. Ids are the positions
    in the merged list, also when the road-side unit is out of range (HEAL's ``np.arange``).
  Either way a box is kept when its 8 corners lie in ``postprocess.anchor_args.cav_lidar_range`` with z widened by
  1 m each way, in training and at test (the evaluation range is applied by the post-processor).
- Late fusion: each CAV trains on its own single-side labels in its own frame, ids counted as HEAL counts them
  (each side from 0, so the same id names different objects on the two sides). It is evaluated against
  (``fusion.args.dair_late_gt``):
  - ``sample`` (the default): the sample's ground truth above (``gt_by_sample``), the one early and intermediate
    fusion are evaluated against;
  - ``by_iou``: HEAL's and CoAlign's own late-fusion ground truth (``generate_gt_bbx_by_iou``), whatever
    ``dair_labels`` says: each received agent's single-side boxes, kept in the label range of its own frame, as 8
    corners carried into the ego's frame by the true poses and left as they land (tilted where the two frames
    are: no refit), then the road-side unit's that overlap no vehicle box by a BEV IoU above 0.05
    (``late_ground_truth``).
- No delay: a split lists single frame pairs, not sequences (``wild_setting.async`` is refused); localisation error
  (``wild_setting.loc_err``, ``noise_setting``) works. DAIR records no speed: V2X-ViT's speed prior is 0.
- Files are read only where the chosen mode needs them: no camera file, and a backup label only with
  ``label_type: camera``. A missing file that is needed is one error line naming it and how it is installed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from opencood_ddp.data.bev_iou import bev_iou_matrix
from opencood_ddp.data.geometry import (as_pose_matrix, boxes_in_range_mask, boxes_to_corners, corners_to_boxes,
                                        matrix_to_pose, x1_to_x2)
from opencood_ddp.data.opv2v import CavFrame
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.data.sources import Objects, SplitSource
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.hypes import get_key, hypes_source, range6
from opencood_ddp.registry import SOURCES

DEFAULT_COMM_RANGE = 100.0  # metres: every DAIR-V2X config of HEAL and CoAlign sets comm_range 100
INTENSITY_SCALE = 256.0  # HEAL's read_pcd divides DAIR's raw intensity by 256
LABEL_Z_MARGIN = 1.0  # metres added below and above cav_lidar_range's z for the labels (HEAL and CoAlign)
MERGE_IOU = 0.05  # a road-side box overlapping a vehicle box by more than this BEV IoU is the same object
VEHICLE_CLASSES = ("Car", "Van", "Truck", "Bus")  # the single-side classes HEAL keeps
LABEL_MODES = ("cooperative", "merged_single_side")
LATE_GT_MODES = ("sample", "by_iou")  # late fusion's evaluation ground truth (module docstring)
LABEL_TYPES = ("lidar", "camera")
VEHICLE, INFRA = 0, 1  # the agents
EGO_SWAP_DRAWS = 13  # the last word of the generator key that decides a training sample's ego (see wild.py)

# Where CoAlign's complemented labels go, for the error line of a missing label file (docs/datasets.md).
LABEL_INSTALL = ("CoAlign's complemented labels go in cooperative/label_world and vehicle-side/label/lidar, and the "
                 "original DAIR labels move to cooperative/label_world_backup and vehicle-side/label/lidar_backup "
                 "(docs/datasets.md)")


# --------------------------------------------------------------------------------------------------- files


def read_json(path: Path, what: str, fix: str) -> Any:
    """A JSON file's value; one DataError line naming the file, what it is and ``fix`` when it is missing or bad."""
    try:
        with open(path, "rb") as stream:
            return json.load(stream)
    except FileNotFoundError:
        raise DataError(f"{path}: {what} not found; {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: {what} is not valid JSON ({' '.join(str(exc).split())}); {fix}") from None


def matrix_from(record: Any, path: Path, wrapper: Optional[str] = None) -> np.ndarray:
    """A calibration file's ``rotation`` (3x3) and ``translation`` (3x1 nested, as HEAL indexes it) as a 4x4."""
    body = record.get(wrapper) if wrapper and isinstance(record, Mapping) else record
    try:
        rotation = np.asarray(body["rotation"], dtype=np.float64)
        translation = np.asarray(body["translation"], dtype=np.float64)
    except (TypeError, KeyError, ValueError):
        rotation = translation = np.empty(0)
    if rotation.shape != (3, 3) or translation.shape != (3, 1):
        where = f"'{wrapper}': " if wrapper else ""
        raise DataError(f"{path}: expected {where}{{rotation: 3x3, translation: [[x], [y], [z]]}}; restore this "
                        f"calibration file from the DAIR-V2X-C download")
    matrix = np.identity(4)
    matrix[:3, :3], matrix[:3, 3] = rotation, translation[:, 0]
    return matrix


def offset_of(value: Any, frame_id: str, path: Path) -> Tuple[float, float]:
    """``system_error_offset`` -> (delta_x, delta_y) metres; ``""`` (whole or per entry) is no offset, as DAIR's
    devkit reads it."""
    if value == "":
        return 0.0, 0.0
    try:
        return tuple(0.0 if value[key] == "" else float(value[key]) for key in ("delta_x", "delta_y"))  # type: ignore
    except (TypeError, KeyError, ValueError):
        raise DataError(f"{path}: system_error_offset of vehicle frame {frame_id} must be {{delta_x, delta_y}} in "
                        f"metres or \"\" (no offset), got {value!r}; restore data_info.json from the DAIR-V2X-C "
                        f"download") from None


def frame_id_of(entry: Mapping, key: str, path: Path) -> str:
    """HEAL's frame id: the basename of an image path without '.jpg' (the pcd paths may be named otherwise)."""
    value = entry.get(key) if isinstance(entry, Mapping) else None
    if not isinstance(value, str) or not value:
        raise DataError(f"{path}: an entry has no '{key}' (e.g. \"vehicle-side/image/000010.jpg\"); restore "
                        f"data_info.json from the DAIR-V2X-C download")
    return value.split("/")[-1].replace(".jpg", "")


@dataclass(frozen=True)
class FramePair:
    """One cooperative frame: the vehicle's and the road-side unit's ids, files and the offset to apply."""

    vehicle_id: str
    infra_id: str
    vehicle_pcd: str
    infra_pcd: str
    cooperative_label: str
    offset: Tuple[float, float]


def read_data_info(data_dir: Path) -> Dict[str, FramePair]:
    """``cooperative/data_info.json`` indexed by vehicle frame id (the image basename), every entry checked."""
    path = data_dir / "cooperative" / "data_info.json"
    entries = read_json(path, "the cooperative frame list",
                        "data_dir must be DAIR-V2X-C's cooperative-vehicle-infrastructure folder")
    if not isinstance(entries, list):
        raise DataError(f"{path}: expected a list of frame pairs; restore it from the DAIR-V2X-C download")
    pairs = {}
    for entry in entries:
        vehicle_id = frame_id_of(entry, "vehicle_image_path", path)
        files = [entry.get(key) for key in ("vehicle_pointcloud_path", "infrastructure_pointcloud_path",
                                            "cooperative_label_path")]
        if not all(isinstance(name, str) and name for name in files) or "system_error_offset" not in entry:
            raise DataError(f"{path}: the entry of vehicle frame {vehicle_id} lacks a point cloud, label or "
                            f"system_error_offset field; restore data_info.json from the DAIR-V2X-C download")
        pairs[vehicle_id] = FramePair(vehicle_id, frame_id_of(entry, "infrastructure_image_path", path), *files,
                                      offset_of(entry["system_error_offset"], vehicle_id, path))
    return pairs


def read_split(path: Path, key: str) -> List[str]:
    """A split file: a JSON list of 6-digit vehicle frame ids."""
    ids = read_json(path, "split file", f"set {key} to a JSON list of DAIR-V2X-C vehicle frame ids (train.json, "
                                        f"val.json)")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise DataError(f"{key} {path}: expected a non-empty JSON list of vehicle frame id strings "
                        f"(e.g. [\"000211\", ...]); point {key} at a DAIR-V2X-C split file")
    return ids


# --------------------------------------------------------------------------------------------------- labels


def world_corners_of(labels: Any, path: Path) -> np.ndarray:
    """(K, 8, 3) ``world_8_points`` of a cooperative label file (its other 3D fields are not valid: DAIR)."""
    try:
        corners = np.asarray([label["world_8_points"] for label in labels], dtype=np.float64).reshape(-1, 8, 3)
    except (TypeError, KeyError, ValueError):
        raise DataError(f"{path}: every cooperative label needs 'world_8_points' (8 [x, y, z] corners); restore the "
                        f"label file ({LABEL_INSTALL})") from None
    return corners


def single_side_boxes(labels: Any, path: Path, order: str) -> Tuple[np.ndarray, List[int]]:
    """A single-side label file -> (K, 7) boxes of the vehicle classes in the agent's own LiDAR frame and their ids,
    as HEAL: ids count the boxes of non-zero size of every class, boxes of zero size are skipped."""
    boxes, ids, counted = [], [], 0
    if not isinstance(labels, list):
        raise DataError(f"{path}: expected a list of labels; restore the label file ({LABEL_INSTALL})")
    for label in labels:
        try:
            size = {axis: float(label["3d_dimensions"][axis]) for axis in "hwl"}
            centre = [float(label["3d_location"][axis]) for axis in "xyz"]  # camera labels write numbers as text
            yaw, kind = float(label["rotation"]), label["type"]
        except (TypeError, KeyError, ValueError):
            raise DataError(f"{path}: a label lacks a number in 3d_dimensions {{h, w, l}}, 3d_location {{x, y, z}} "
                            f"or rotation, or its type; restore the label file ({LABEL_INSTALL})") from None
        if 0.0 in size.values():
            continue
        if kind in VEHICLE_CLASSES:
            dims = [size["h"], size["w"], size["l"]] if order == "hwl" else [size["l"], size["w"], size["h"]]
            boxes.append(centre + dims + [yaw])
            ids.append(counted)
        counted += 1
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 7), ids


def merge_by_iou(ego: Objects, other: Objects, order: str) -> Objects:
    """HEAL's merge: the ego's boxes (the vehicle's, unless swapped), then the other agent's boxes that overlap
    none of them by a BEV IoU above ``MERGE_IOU``; ids are the positions in the result (HEAL numbers the merged
    boxes)."""
    (ego_boxes, _), (other_boxes, _) = ego, other
    iou = bev_iou_matrix(boxes_to_corners(other_boxes, order), boxes_to_corners(ego_boxes, order))
    kept = other_boxes[~(iou > MERGE_IOU).any(axis=1)]
    merged = np.concatenate([ego_boxes, kept]).reshape(-1, 7)
    return merged, list(range(len(merged)))


def corners_merged_by_iou(own: Sequence[np.ndarray], to_ego: Sequence[np.ndarray], order: str) -> np.ndarray:
    """(M, 8, 3) corners in the ego's frame, HEAL's ``generate_gt_bbx_by_iou``: each agent's (K, 7) boxes of its own
    frame as 8 corners carried by its (4, 4) ``to_ego``, kept as they land (a box of a frame tilted against the
    ego's stays tilted: HEAL evaluates these corners, it refits no box); the ego's, then the other agent's whose
    bottom face overlaps none of them by a BEV IoU above ``MERGE_IOU``."""
    corners = [boxes_to_corners(boxes, order).reshape(-1, 8, 3) @ matrix[:3, :3].T + matrix[:3, 3]
               for boxes, matrix in zip(own, to_ego)]
    if len(corners) == 1:  # the road-side unit out of range: HEAL's "only ego agent"
        return corners[0]
    ego, other = corners
    kept = other[~(bev_iou_matrix(other, ego) > MERGE_IOU).any(axis=1)]
    return np.concatenate([ego, kept]).reshape(-1, 8, 3)


# --------------------------------------------------------------------------------------------------- source


class DairFrames:
    """One frame pair as ``SampleFrames``: the ego at slot 0 (the vehicle, or the road-side unit when ``swapped``)
    and (with max_cav >= 2) the other agent, no history."""

    position = 0  # a split lists single frame pairs: there is no earlier frame

    def __init__(self, source: "DairV2XSource", pair: FramePair, swapped: bool = False):
        self.source, self.pair = source, pair
        self.count = min(2, source.max_cav)
        self.agents = (INFRA, VEHICLE) if swapped else (VEHICLE, INFRA)  # slot -> agent
        self._frames: Dict[int, CavFrame] = {}

    def frame(self, slot: int, lag: int = 0) -> CavFrame:
        if lag:
            raise ValueError(f"DAIR-V2X-C frame pairs have no earlier frame (lag {lag})")
        if slot not in self._frames:
            self._frames[slot] = self.source.read_agent(self.pair, self.agents[slot], ego=slot == 0)
        return self._frames[slot]


def _check_hypes(hypes: Mapping, source: str) -> None:
    """The DAIR-V2X-C keys' values, and the settings it cannot give, each as one line."""
    for key, choices, default in (("label_type", LABEL_TYPES, "lidar"),
                                  ("fusion.args.dair_labels", LABEL_MODES, "cooperative"),
                                  ("fusion.args.dair_late_gt", LATE_GT_MODES, "sample")):
        if get_key(hypes, key, default) not in choices:
            raise ConfigError(f"{source}: key {key} must be one of {', '.join(choices)}, got "
                              f"{get_key(hypes, key)!r}; fix the hypes")
    inputs = get_key(hypes, "input_source", ["lidar"])
    if inputs != ["lidar"]:
        raise ConfigError(f"{source}: key input_source {inputs!r}: the zoo's models read LiDAR only; set "
                          f"input_source: ['lidar']")
    if get_key(hypes, "wild_setting.async", False):
        raise ConfigError(f"{source}: wild_setting.async needs earlier frames, and a DAIR-V2X-C split lists single "
                          f"frame pairs; set wild_setting.async: false (localisation error works)")
    swap = get_key(hypes, "fusion.args.swap_ego_probability", 0.0)
    if not 0.0 <= swap <= 1.0:
        raise ConfigError(f"{source}: key fusion.args.swap_ego_probability must be a probability in [0, 1], got "
                          f"{swap!r}; HEAL's heterogeneous DAIR-V2X-C training uses 0.5, 0 keeps the vehicle the ego")
    comm_range = get_key(hypes, "comm_range", DEFAULT_COMM_RANGE)
    if not comm_range > 0 or math.isinf(comm_range):
        raise ConfigError(f"{source}: key comm_range must be a positive number of metres, got {comm_range!r}; "
                          f"HEAL's and CoAlign's DAIR-V2X configs use 100")


@SOURCES.register("dairv2x", required=(("data_dir", "str"),),
                  optional=(("label_type", "str"), ("input_source", "list"), ("comm_range", "number"),
                            ("fusion.args.dair_labels", "str"), ("fusion.args.dair_late_gt", "str"),
                            ("fusion.args.swap_ego_probability", "number")),
                  check=_check_hypes)
class DairV2XSource(SplitSource):
    """A DAIR-V2X-C split (module docstring)."""

    gt_by_sample = True

    def __init__(self, hypes: Mapping, split_key: str, *, train: bool, seed: int, max_cav: int):
        super().__init__(hypes, split_key, train=train, seed=seed, max_cav=max_cav)
        self.data_dir = self.data_folder(hypes)
        self.root = Path(hypes[split_key])
        self.camera_labels = get_key(hypes, "label_type", "lidar") == "camera"
        self.merged = get_key(hypes, "fusion.args.dair_labels", "cooperative") == "merged_single_side"
        self.late_by_iou = get_key(hypes, "fusion.args.dair_late_gt", "sample") == "by_iou"
        self.range = float(get_key(hypes, "comm_range", DEFAULT_COMM_RANGE))
        self.swap_probability = float(get_key(hypes, "fusion.args.swap_ego_probability", 0.0)) if self.train else 0.0
        anchor_range = np.array(range6(hypes, "postprocess.anchor_args.cav_lidar_range", hypes_source(hypes)))
        self.label_range = anchor_range + np.array([0, 0, -LABEL_Z_MARGIN, 0, 0, LABEL_Z_MARGIN])
        known = read_data_info(self.data_dir)
        ids = read_split(self.root, split_key)
        missing = [frame_id for frame_id in ids if frame_id not in known]
        if missing:
            raise DataError(f"{split_key} {self.root}: vehicle frame {missing[0]} ({len(missing)} of {len(ids)}) has "
                            f"no entry in {self.data_dir / 'cooperative' / 'data_info.json'}; use the split files "
                            f"that come with data_dir's version of DAIR-V2X-C")
        self.pairs: Tuple[FramePair, ...] = tuple(known[frame_id] for frame_id in ids)

    @staticmethod
    def data_folder(hypes: Mapping) -> Path:
        folder = Path(hypes["data_dir"])
        if not folder.is_dir():
            raise DataError(f"data_dir {folder}: folder not found; set data_dir in the hypes (an evaluation's: the "
                            f"run's config.yaml; training also takes --set data_dir=PATH) to DAIR-V2X-C's "
                            f"cooperative-vehicle-infrastructure folder")
        return folder

    @staticmethod
    def split_path(path: Any, key: str, fix: Optional[str] = None) -> Path:
        split = Path(path)
        if not split.is_file():
            raise DataError(f"{key} {split}: split file not found; {fix or 'pass'} a DAIR-V2X-C split file (a JSON "
                            f"list of vehicle frame ids, e.g. val.json)")
        return split

    def __len__(self) -> int:
        return len(self.pairs)

    def sample_frames(self, index: int, epoch: int = 0) -> DairFrames:
        return DairFrames(self, self.pairs[index], self.swaps_ego(index, epoch))

    def swaps_ego(self, index: int, epoch: int) -> bool:
        """Whether the road-side unit is this training sample's ego in this epoch (HEAL's heterogeneous swap)."""
        if self.swap_probability == 0.0:
            return False
        draw = np.random.default_rng([self.seed, epoch, index, EGO_SWAP_DRAWS]).random()
        return bool(draw < self.swap_probability)

    def comm_range(self, fusion: str) -> Optional[float]:
        return self.range

    # ------------------------------------------------------------------------------------------ agents

    def read_agent(self, pair: FramePair, agent: int, ego: bool) -> CavFrame:
        """The vehicle (CAV id 0) or the road-side unit (CAV id 1) of a pair: its pose from its calibration files."""
        if agent == VEHICLE:
            pose_path = self.data_dir / "vehicle-side/calib/novatel_to_world" / f"{pair.vehicle_id}.json"
            return CavFrame("0", {"pair": pair}, matrix_to_pose(self.vehicle_to_world(pair)),
                            self.data_dir / pair.vehicle_pcd, pose_path, ego, float("nan"))
        pose_path = self.data_dir / "infrastructure-side/calib/virtuallidar_to_world" / f"{pair.infra_id}.json"
        return CavFrame("1", {"pair": pair}, matrix_to_pose(self.infra_to_world(pair, pose_path)),
                        self.data_dir / pair.infra_pcd, pose_path, ego, float("nan"), infra=True)

    def vehicle_to_world(self, pair: FramePair) -> np.ndarray:
        """``T_world_lidar = T_novatel_to_world @ T_lidar_to_novatel`` (HEAL's and the devkit's composition),
        multiplied as HEAL does (R_n2w R_l2n, R_n2w t_l2n + t_n2w) so that the values are its own bit for bit."""
        calib = self.data_dir / "vehicle-side/calib"
        lidar_to_novatel, novatel_to_world = (calib / name / f"{pair.vehicle_id}.json"
                                              for name in ("lidar_to_novatel", "novatel_to_world"))
        mount = matrix_from(self.calibration(lidar_to_novatel), lidar_to_novatel, wrapper="transform")
        place = matrix_from(self.calibration(novatel_to_world), novatel_to_world)
        matrix = np.identity(4)
        matrix[:3, :3] = np.dot(place[:3, :3], mount[:3, :3])
        matrix[:3, 3] = (np.dot(place[:3, :3], mount[:3, 3:]) + place[:3, 3:])[:, 0]
        return matrix

    def infra_to_world(self, pair: FramePair, path: Path) -> np.ndarray:
        """``virtuallidar_to_world`` with the pair's ``system_error_offset`` added to its x and y."""
        matrix = matrix_from(self.calibration(path), path)
        matrix[:2, 3] += pair.offset
        return matrix

    @staticmethod
    def calibration(path: Path) -> Any:
        return read_json(path, "calibration file", "restore it from the DAIR-V2X-C download")

    # ------------------------------------------------------------------------------------------ data

    def points(self, frame: CavFrame) -> np.ndarray:
        """HEAL's reading: x, y, z and intensity / 256 as float32, rows with a NaN dropped."""
        points = read_pcd(frame.pcd_path)
        points[:, 3] /= np.float32(INTENSITY_SCALE)
        return points[~np.isnan(points).any(axis=1)]

    def ego_speed_kmh(self, frame: CavFrame) -> float:
        return 0.0  # DAIR-V2X-C records no speed; V2X-ViT's speed prior is 0 (docs/datasets.md)

    def objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The agent's part of the sample's ground truth in the frame of ``target_pose`` (module docstring)."""
        if self.merged:
            return self.single_side_in(frame, x1_to_x2(frame.lidar_pose, target_pose))
        if frame.infra:
            return np.zeros((0, 7)), []
        return self.cooperative_in(frame.params["pair"], target_pose)

    def own_objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The agent's single-side labels in its own LiDAR frame (late fusion, as HEAL and CoAlign): DAIR-V2X-C has
        no delay, so the frame a CAV detects in is always its current one."""
        return self.single_side_in(frame, None)

    def merge(self, per_cav: Sequence[Objects]) -> Objects:
        """HEAL's rule with ``merged_single_side``: the ego's boxes, then the other agent's that overlap none; ids
        are the positions in the result, the ego's alone included (HEAL numbers ``np.arange`` either way, not the
        label file's positions)."""
        if not self.merged:
            return super().merge(per_cav)
        if len(per_cav) == 1:  # the other agent is out of range, or max_cav is 1
            boxes = per_cav[0][0].reshape(-1, 7)
            return boxes, list(range(len(boxes)))
        return merge_by_iou(per_cav[0], per_cav[1], self.order)

    def late_ground_truth(self, frames: Sequence[CavFrame], to_ego: Sequence[np.ndarray]) -> Optional[np.ndarray]:
        """With ``dair_late_gt: by_iou``, HEAL's and CoAlign's late-fusion ground truth: (M, 8, 3) corners in the ego's
        frame from the received agents' own labels (``frames``, ego first) and their true ``to_ego``
        (``corners_merged_by_iou``); None otherwise (the sample's ground truth)."""
        if not self.late_by_iou:
            return None
        own = [self.single_side_in(frame, None)[0] for frame in frames]
        return corners_merged_by_iou(own, to_ego, self.order)

    def cooperative_in(self, pair: FramePair, target_pose: np.ndarray) -> Objects:
        """The cooperative labels (world corners) in the target frame, 8 corners in the label range."""
        path = self.data_dir / pair.cooperative_label
        if self.camera_labels:
            path = self.data_dir / pair.cooperative_label.replace("label_world", "label_world_backup")
        corners = world_corners_of(self.labels(path), path)
        world_to_target = np.linalg.inv(as_pose_matrix(target_pose))
        boxes = corners_to_boxes(corners @ world_to_target[:3, :3].T + world_to_target[:3, 3], self.order)
        return self.in_label_range(boxes, list(range(len(boxes))))

    def single_side_in(self, frame: CavFrame, to_target: Optional[np.ndarray]) -> Objects:
        """An agent's single-side labels, mapped by ``to_target`` (None: left in its own frame, as HEAL's
        ``load_single_objects_dairv2x``), 8 corners in the label range."""
        boxes, ids = self.single_side_labels(frame)
        if to_target is not None and len(boxes):
            corners = boxes_to_corners(boxes, self.order)
            boxes = corners_to_boxes(corners @ to_target[:3, :3].T + to_target[:3, 3], self.order)
        return self.in_label_range(boxes, ids)

    def single_side_labels(self, frame: CavFrame) -> Tuple[np.ndarray, List[int]]:
        """The agent's single-side boxes in its own frame, read once per sample: late fusion's test samples ask for
        them twice with ``merged_single_side`` (each CAV's own labels, and the sample's merged ground truth)."""
        if "single_side" not in frame.params:  # the frame's dict is the sample's own (``DairFrames``)
            pair = frame.params["pair"]
            if frame.infra:
                path = self.data_dir / "infrastructure-side/label/virtuallidar" / f"{pair.infra_id}.json"
            else:
                folder = "lidar_backup" if self.camera_labels else "lidar"
                path = self.data_dir / "vehicle-side/label" / folder / f"{pair.vehicle_id}.json"
            frame.params["single_side"] = single_side_boxes(self.labels(path), path, self.order)
        return frame.params["single_side"]

    def in_label_range(self, boxes: np.ndarray, ids: List[int]) -> Objects:
        keep = boxes_in_range_mask(boxes_to_corners(boxes, self.order), self.label_range) if len(boxes) else []
        return boxes[np.asarray(keep, dtype=bool)].reshape(-1, 7), [i for i, k in zip(ids, keep) if k]

    def labels(self, path: Path) -> Any:
        if self.camera_labels:
            fix = ("label_type: camera reads the original DAIR labels, kept in cooperative/label_world_backup and "
                   "vehicle-side/label/lidar_backup by the complemented labels' install (docs/datasets.md); restore "
                   "them, or set label_type: lidar")
        else:
            fix = LABEL_INSTALL + "; restore the file, or set label_type: camera to train on the original labels"
        return read_json(path, "label file", fix)


__all__ = ["DairV2XSource", "FramePair", "read_data_info", "single_side_boxes", "merge_by_iou",
           "corners_merged_by_iou"]
