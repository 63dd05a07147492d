"""Post-processing of the PointPillar family: anchors, training targets, box decoding, rotated NMS.

``create_postprocessor(hypes, train)`` builds the class named by ``postprocess.core_method`` (upstream's
``opencood/data_utils/post_processor/__init__.py``); only ``VoxelPostprocessor`` exists.
"""
from __future__ import annotations

from typing import Dict, Mapping, Type

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source, validate
from opencood_ddp.postprocess.anchors import AnchorSpec, generate_anchors
from opencood_ddp.postprocess.bev_iou import bev_iou_matrix, bev_polygons
from opencood_ddp.postprocess.box_coder import delta_to_boxes3d, encode
from opencood_ddp.postprocess.boxes import (boxes_to_corners, corners_to_standup, normal_size_mask, normal_z_mask,
                                            project_corners, within_range_mask)
from opencood_ddp.postprocess.nms import NMS_TOP_K, nms_rotated
from opencood_ddp.postprocess.targets import assign_targets, standup_boxes, standup_iou
from opencood_ddp.postprocess.voxel_postprocessor import VoxelPostprocessor

POSTPROCESSORS: Dict[str, Type[VoxelPostprocessor]] = {"VoxelPostprocessor": VoxelPostprocessor}


def create_postprocessor(hypes: Mapping, train: bool) -> VoxelPostprocessor:
    """The post-processor named by ``postprocess.core_method``, built from ``hypes['postprocess']``."""
    source = hypes_source(hypes)
    validate(hypes, (("postprocess", "dict"), ("postprocess.core_method", "str")), source)
    name = hypes["postprocess"]["core_method"]
    if name not in POSTPROCESSORS:
        raise ConfigError(f"{source}: key postprocess.core_method {name!r} is not supported; use one of "
                          f"{sorted(POSTPROCESSORS)} (--set postprocess.core_method=VoxelPostprocessor)")
    return POSTPROCESSORS[name](hypes["postprocess"], train, source)


__all__ = [
    "POSTPROCESSORS", "create_postprocessor", "VoxelPostprocessor",
    "AnchorSpec", "generate_anchors",
    "encode", "delta_to_boxes3d",
    "assign_targets", "standup_boxes", "standup_iou",
    "boxes_to_corners", "project_corners", "corners_to_standup", "normal_size_mask", "normal_z_mask",
    "within_range_mask",
    "NMS_TOP_K", "nms_rotated",
    "bev_iou_matrix", "bev_polygons",
]
