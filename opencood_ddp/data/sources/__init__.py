"""Data sources: the data set a split is read from, chosen by ``fusion.dataset`` (HEAL's and CoAlign's key).

A fusion dataset (``data/datasets``: early, intermediate, late) knows what a sample is made of; a source knows how
one data set stores it. Registered in ``registry.SOURCES`` (every module of this package is imported on the first
lookup, so a new data set is one new file here):

- ``opv2v`` (the default, upstream OpenCOOD's only layout) and ``v2xset`` (the same layout with road-side units):
  ``sources/opv2v.py`` over ``data/opv2v.py``;
- ``v2v4real``: OPV2V's folders with (4, 4) poses and labels in each car's own LiDAR frame (V2V4Real's fork);
- ``dairv2x``: DAIR-V2X-C's vehicle and road-side unit, calibration chains and cooperative labels, as HEAL and
  CoAlign read it.

What a dataset asks of a source (``SplitSource``; each method's docstring says what upstream does):

- ``len(source)`` and ``sample_frames(index)``: the sample's CAVs (``SampleFrames``: ``count``, ``position``, the
  earlier frames a delay may reach, and ``frame(slot, lag) -> CavFrame``, slot 0 the ego);
- ``comm_range(fusion)``: the range a CAV must be within to be received, or None (V2V4Real tests it only in
  intermediate fusion);
- ``points(frame)``: the (N, 4) float32 cloud of a frame, in its own LiDAR frame; ``stored_points(frame)`` the same
  as the file stores it, for the device to decode;
- ``ego_speed_kmh(frame)``: V2X-ViT's prior encoding;
- ``objects(frame, target_pose, gt_range)``: the frame's contribution to the sample's ground truth in the target
  frame, ``merge(per_cav)`` the sample's ground truth from them; ``own_objects`` a CAV's own labels (late fusion);
  ``late_ground_truth`` late fusion's evaluation ground truth where the anchor's is not the sample's (corners);
  ``objects_through(frame, transform, gt_range)`` where ``labels_follow_points`` (V2V4Real's fork under delay).

A source is built once per dataset in the main process and pickled into DataLoader workers: it holds plain data
(indexes, parsed metadata), never open files, and draws nothing at random but from keys of its own (the seed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable, List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np

from opencood_ddp.data.ground_truth import upstream_unique_indices
from opencood_ddp.data.opv2v import CavFrame
from opencood_ddp.data.pcd import read_pcd, read_pcd_records
from opencood_ddp.hypes import hypes_source
from opencood_ddp.registry import SOURCES

Objects = Tuple[np.ndarray, List[Hashable]]  # (K, 7) boxes and their K object ids

FUSIONS = ("early", "intermediate", "late")


class SampleFrames(Protocol):
    """The CAVs of one sample, as a source reads them (``data.opv2v.ScenarioFrames`` for the OPV2V layout)."""

    count: int  # CAVs of the sample, ego first
    position: int  # how many earlier frames the sample's scene has: a delay is clamped to it

    def frame(self, slot: int, lag: int = 0) -> CavFrame: ...


class SplitSource:
    """One split of a data set. Subclasses implement ``__len__``, ``sample_frames``, ``comm_range`` and
    ``objects``; the defaults below are upstream OpenCOOD's rules."""

    # Corners of a box that must lie in the GT range (and in cav_lidar_range when a dataset re-filters): all 8 in
    # OpenCOOD and HEAL, 2 in V2V4Real's fork (its mask_boxes_outside_range_numpy default).
    min_corners: int = 8
    # Intermediate fusion re-filters the boxes to cav_lidar_range in training and at test (V2V4Real's fork).
    refilters_each_cav: bool = False
    # Late fusion's test-time ground truth is the sample's (as early and intermediate fusion build it), not the union
    # of what each CAV labels (DAIR-V2X-C: the road-side unit's labels do not share the vehicle's ids).
    gt_by_sample: bool = False
    # Early and intermediate fusion map each CAV's current labels with the transform its points were received with
    # (its delayed, noisy pose: ``objects_through``) instead of its current true pose: V2V4Real's fork, whose Async
    # column is measured that way (``fusion.args.gt_transform: as_received``).
    labels_follow_points: bool = False

    root: Path  # the split's folder or file, named in messages

    def __init__(self, hypes: Mapping, split_key: str, *, train: bool, seed: int, max_cav: int):
        self.order: str = hypes["postprocess"]["order"]  # the boxes' size order, 'hwl' (checked by the dataset)
        self.train, self.seed, self.max_cav = bool(train), int(seed), int(max_cav)

    @staticmethod
    def split_path(path: Any, key: str, fix: Optional[str] = None) -> Path:
        """``path`` checked to be a split of this data set (DataError naming ``key`` otherwise, and ``fix``: how to
        point it at another split, where the data set's own words for setting ``key`` do not fit the tool)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_frames(self, index: int, epoch: int = 0) -> SampleFrames:
        """Sample ``index``'s frames; ``epoch`` keys a source's per-epoch training draws (DAIR-V2X-C's ego swap)."""
        raise NotImplementedError

    def comm_range(self, fusion: str) -> Optional[float]:
        """Metres within which (x-y, LiDAR positions) a CAV is received by ``fusion``; None: always."""
        raise NotImplementedError

    def points(self, frame: CavFrame) -> np.ndarray:
        """The frame's (N, 4) float32 cloud ``x, y, z, intensity`` in its LiDAR frame (OPV2V: open3d's reading)."""
        return read_pcd(frame.pcd_path)

    def stored_points(self, frame: CavFrame) -> Tuple[np.ndarray, bool]:
        """The frame's cloud as ``pcd.read_pcd_records`` reads it for the device (``preprocess.on_device``): (N, 4)
        float32 rows and whether column 3 still holds packed colour bits. A source whose ``points`` does more than
        read the file (DAIR-V2X-C's scaling) gives its ``points``."""
        if type(self).points is not SplitSource.points:
            return self.points(frame), False
        return read_pcd_records(frame.pcd_path)

    def ego_speed_kmh(self, frame: CavFrame) -> float:
        raise NotImplementedError

    def objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The boxes the frame contributes to the sample's ground truth, in the frame of ``target_pose`` (a pose of
        the frame's kind), kept by ``gt_range`` (``min_corners`` corners inside)."""
        raise NotImplementedError

    def objects_through(self, frame: CavFrame, transform: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The frame's boxes mapped by the (4, 4) ``transform`` from its LiDAR frame, kept by ``gt_range``: for a
        source whose labels are in each CAV's own frame and that sets ``labels_follow_points``."""
        raise NotImplementedError

    def own_objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """A CAV's own labels in the frame of ``target_pose`` (late fusion: the CAV that detects them)."""
        return self.objects(frame, target_pose, gt_range)

    def late_ground_truth(self, frames: Sequence[CavFrame], to_ego: Sequence[np.ndarray]) -> Optional[np.ndarray]:
        """Late fusion's test-time ground truth as (M, 8, 3) corners in the ego's frame, built from the received CAVs'
        current ``frames`` (ego first) and their true (4, 4) ``to_ego``, for a ``gt_by_sample`` source whose anchor
        evaluates late fusion against other boxes than the sample's (DAIR-V2X-C's ``dair_late_gt: by_iou``); None:
        the sample's ground truth."""
        return None

    def merge(self, per_cav: Sequence[Objects]) -> Objects:
        """The sample's ground truth from every CAV's ``objects``: upstream's de-duplication by object id, the first
        CAV's box kept, in ``upstream_unique_indices`` order."""
        boxes_list = [boxes for boxes, _ in per_cav]
        ids = [object_id for _, cav_ids in per_cav for object_id in cav_ids]
        stacked = np.concatenate(boxes_list) if boxes_list else np.zeros((0, 7))
        keep = upstream_unique_indices(ids)
        return stacked[keep].reshape(-1, 7), [ids[k] for k in keep]


def source_entry(hypes: Mapping):
    """The registry entry of the hypes' ``fusion.dataset`` (``opv2v`` when absent), its keys validated."""
    return SOURCES.lookup(hypes, hypes_source(hypes))


def build_source(hypes: Mapping, split_key: str, *, train: bool, seed: int, max_cav: int) -> SplitSource:
    """The source of the split at hypes key ``split_key`` (root_dir, validate_dir, test_dir). ``train`` selects
    training behaviour where a data set has one (V2V4Real: the order of a scene's CAVs), ``seed`` keys it."""
    return source_entry(hypes).obj(hypes, split_key, train=train, seed=seed, max_cav=max_cav)


def check_split_path(hypes: Mapping, path: Any, key: str, fix: Optional[str] = None) -> str:
    """``path`` (a split another key or flag names: test_dir, --dataset_dir) checked the way the data set stores
    its splits; DataError naming ``key`` (and ``fix``) otherwise. Returns it as a string for the hypes."""
    return str(source_entry(hypes).obj.split_path(path, key, fix))


__all__ = ["FUSIONS", "Objects", "SampleFrames", "SplitSource", "build_source", "check_split_path", "source_entry"]
