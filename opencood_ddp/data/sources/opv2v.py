"""OPV2V and V2XSet: upstream OpenCOOD's layout (``data/opv2v.py`` scans and reads it).

Poses are CARLA 6-vectors; each CAV's yaml lists the objects around it in the world frame (``vehicles``), which
every CAV projects into the target frame (``geometry.project_world_objects``); objects are de-duplicated by their
simulator id. A non-ego CAV is received within upstream's 70 m (``data/opv2v.py``: ``COMM_RANGE``) in every
fusion. V2XSet adds road-side units under negative folder ids: the same reader.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from opencood_ddp.data.geometry import project_world_objects
from opencood_ddp.data.opv2v import (NOT_FRAMES, CavFrame, FrameReader, Opv2vIndex, ScenarioFrames, check_split_shape,
                                     ego_speed_of, read_opv2v_frame, scan_split)
from opencood_ddp.data.sources import Objects, SplitSource
from opencood_ddp.errors import DataError
from opencood_ddp.registry import SOURCES


@SOURCES.register("opv2v")
@SOURCES.register("v2xset")
class Opv2vSource(SplitSource):
    """A split folder ``<scenario>/<cav_id>/<timestamp>.{yaml,pcd}`` (``data/opv2v.py``'s rules)."""

    required_keys = ()
    optional_keys = ()

    def __init__(self, hypes: Mapping, split_key: str, *, train: bool, seed: int, max_cav: int):
        super().__init__(hypes, split_key, train=train, seed=seed, max_cav=max_cav)
        self.index: Opv2vIndex = self.scan(hypes[split_key], split_key)
        self.root = self.index.root

    # Words of yaml names that are not frames (upstream: OPV2V's "additional" files).
    not_frames = NOT_FRAMES

    def scan(self, folder: Any, split_key: str) -> Opv2vIndex:
        """The split's index; the scan raises DataError naming ``split_key`` for a missing folder or empty split."""
        return scan_split(folder, self.max_cav, key=split_key, not_frames=self.not_frames)

    @classmethod
    def split_path(cls, path: Any, key: str, fix: Optional[str] = None) -> Path:
        """The folder and the shape of its first scenario, so that what is wrong inside it (another data set's
        root, a scenario given for a split) is said under ``key``, not under the hypes key it stands in for."""
        return check_split_shape(path, key, fix, cls.not_frames)

    # What reads one CAV's frame: the OPV2V yaml (V2V4Real replaces it).
    read_frame: FrameReader = staticmethod(read_opv2v_frame)

    def __len__(self) -> int:
        return len(self.index)

    def sample_frames(self, index: int, epoch: int = 0) -> ScenarioFrames:
        scenario, position = self.index.locate_position(index)
        return ScenarioFrames(scenario, position, self.read_frame)

    def comm_range(self, fusion: str) -> Optional[float]:
        return self.index.comm_range

    def ego_speed_kmh(self, frame: CavFrame) -> float:
        return ego_speed_of(frame.params, frame.meta_path)

    def objects(self, frame: CavFrame, target_pose: np.ndarray, gt_range: Sequence[float]) -> Objects:
        """The frame's ``vehicles`` (world frame) projected into the frame of ``target_pose``, all 8 corners kept
        inside ``gt_range`` (upstream's ``project_world_objects``)."""
        vehicles = vehicles_of(frame)
        projected = project_world_objects(vehicles, target_pose, gt_range, self.order, source=str(frame.meta_path))
        return boxes_and_ids(projected)


def vehicles_of(frame: CavFrame) -> Mapping:
    """The frame yaml's ``vehicles`` mapping; DataError naming the yaml when absent or not a mapping."""
    vehicles = frame.params.get("vehicles")
    if vehicles is None:
        raise DataError(f"{frame.meta_path}: no 'vehicles' mapping (use 'vehicles: {{}}' for an empty frame); "
                        f"re-export this frame's yaml")
    if not isinstance(vehicles, Mapping):
        raise DataError(f"{frame.meta_path}: 'vehicles' must be a mapping of id -> object, got "
                        f"{type(vehicles).__name__}; re-export this frame's yaml")
    return vehicles


def boxes_and_ids(projected: Mapping) -> Objects:
    """{id: box (7,)} -> ((K, 7) float64 boxes, [ids]) in the mapping's order."""
    return np.array(list(projected.values()), dtype=np.float64).reshape(-1, 7), list(projected)
