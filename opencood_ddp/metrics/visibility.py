"""How well the ego's own LiDAR sees each ground-truth object: cooperative perception pays off on the objects it
cannot see, which an overall AP hides. tools/analysis/recall_by_visibility.py splits recall by these groups and
tools/analysis/attention_by_visibility.py AttFuse's attention.

An object's group comes from the LiDAR points inside its box: in the ego's own cloud, and in all CAVs' clouds
together (``data.ego_view.frame_clouds`` gives both in the ego frame).
"""
from __future__ import annotations

from typing import List

import numpy as np
import shapely

from opencood_ddp.postprocess import bev_polygons

# Index = group number of visibility_groups.
GROUPS = ("ego sees it", "only others see it", "barely seen")


def points_in_boxes(points: np.ndarray, corners: np.ndarray) -> np.ndarray:
    """Per box (M, 8, 3): how many points lie inside its footprint and between its lowest and highest z."""
    counts = np.zeros(len(corners), dtype=np.int64)
    for i, (polygon, box) in enumerate(zip(bev_polygons(corners), corners)):
        in_height = (points[:, 2] >= box[:, 2].min()) & (points[:, 2] <= box[:, 2].max())
        candidates = points[in_height]
        counts[i] = int(shapely.contains_xy(polygon, candidates[:, 0], candidates[:, 1]).sum())
    return counts


def visibility_groups(clouds: List[np.ndarray], gt: np.ndarray, min_points: int) -> np.ndarray:
    """Group number (index into GROUPS) of each GT box; clouds are every CAV's points in the ego frame, ego first."""
    ego_points = points_in_boxes(clouds[0], gt)
    all_points = points_in_boxes(np.concatenate(clouds), gt)
    return np.where(ego_points >= min_points, 0, np.where(all_points >= min_points, 1, 2))
