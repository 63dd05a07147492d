"""A whole frame as the ego sees it before fusion: every CAV's point cloud in the ego's LiDAR frame.

For diagnostics that count points per object (``metrics.visibility``). The fusion datasets build the same clouds
themselves, shuffled and augmented, on the way to voxels.
"""
from __future__ import annotations

from typing import List, Mapping

import numpy as np

from opencood_ddp.data.geometry import mask_ego_points, transform_points, x1_to_x2
from opencood_ddp.data.opv2v import Opv2vIndex, read_frame
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.data.sources import source_entry
from opencood_ddp.data.sources.opv2v import Opv2vSource
from opencood_ddp.errors import ConfigError


def check_reads_opv2v_clouds(hypes: Mapping, run: object) -> None:
    """frame_clouds reads OPV2V's frames: a run whose data set another source reads (DAIR-V2X-C's, V2V4Real's
    numpy poses) is refused by name. Every registered name of the OPV2V source passes (opv2v, v2xset)."""
    if source_entry(hypes).obj is not Opv2vSource:
        layout = (hypes.get("fusion") or {}).get("dataset")
        raise ConfigError(f"{run}: fusion.dataset is {layout!r}; this tool reads runs on OPV2V-layout data "
                          f"(fusion.dataset opv2v or v2xset)")


def frame_clouds(index: Opv2vIndex, frame_number: int) -> List[np.ndarray]:
    """Every CAV's cloud (x, y, z) in the ego frame, ego first, without each car's own hits (as the datasets
    read them)."""
    cavs = list(read_frame(index, frame_number).values())
    ego_pose = cavs[0].lidar_pose
    return [transform_points(mask_ego_points(read_pcd(cav.pcd_path))[:, :3], x1_to_x2(cav.lidar_pose, ego_pose))
            for cav in cavs]
