"""``SpVoxelPreprocessor``: points -> voxels (pillars) with spconv's point-to-voxel generator.

Upstream's ``sp_voxel_preprocessor.py``; the layout and the rules are ``opencood_ddp.data.voxelize``'s.
"""
from __future__ import annotations

from typing import Mapping

from opencood_ddp.data.voxelize import Voxelizer
from opencood_ddp.registry import PREPROCESSORS


@PREPROCESSORS.register("SpVoxelPreprocessor", required=(
        ("preprocess.cav_lidar_range", "list"),
        ("preprocess.args.voxel_size", "list"),
        ("preprocess.args.max_points_per_voxel", "positive_int"),
        ("preprocess.args.max_voxel_train", "positive_int"),
        ("preprocess.args.max_voxel_test", "positive_int")))
def sp_voxel_preprocessor(preprocess: Mapping, train: bool) -> Voxelizer:
    return Voxelizer.from_hypes(preprocess, train)
