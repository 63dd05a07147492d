"""A whole frame as the ego sees it before fusion: every CAV's point cloud in the ego's LiDAR frame.

For diagnostics that count points per object (``metrics.visibility``). The fusion datasets build the same clouds
themselves, shuffled and augmented, on the way to voxels.
"""
from __future__ import annotations

from typing import List

import numpy as np

from opencood_ddp.data.geometry import mask_ego_points, transform_points, x1_to_x2
from opencood_ddp.data.opv2v import Opv2vIndex, read_frame
from opencood_ddp.data.pcd import read_pcd


def frame_clouds(index: Opv2vIndex, frame_number: int) -> List[np.ndarray]:
    """Every CAV's cloud (x, y, z) in the ego frame, ego first, without each car's own hits (as the datasets
    read them)."""
    cavs = list(read_frame(index, frame_number).values())
    ego_pose = cavs[0].lidar_pose
    return [transform_points(mask_ego_points(read_pcd(cav.pcd_path))[:, :3], x1_to_x2(cav.lidar_pose, ego_pose))
            for cav in cavs]
