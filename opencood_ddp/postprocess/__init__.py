"""Post-processing of the PointPillar family: anchors, training targets, box decoding, rotated NMS.

``create_postprocessor(hypes, train)`` builds the class registered in ``opencood_ddp.registry.POSTPROCESSORS``
under ``postprocess.core_method`` (upstream's ``opencood/data_utils/post_processor/__init__.py``); every
module of this package is imported on the first lookup. An entry is called as
``entry(hypes['postprocess'], train, source)``.
"""
from __future__ import annotations

from typing import Any, Mapping

from opencood_ddp.hypes import hypes_source
from opencood_ddp.postprocess.anchors import AnchorSpec, generate_anchors
from opencood_ddp.data.bev_iou import bev_iou_matrix, bev_polygons
from opencood_ddp.postprocess.box_coder import delta_to_boxes3d, encode
from opencood_ddp.postprocess.boxes import (boxes_to_corners, corners_to_standup, normal_size_mask, normal_z_mask,
                                            project_corners, within_range_mask)
from opencood_ddp.postprocess.nms import NMS_TOP_K, nms_rotated
from opencood_ddp.postprocess.targets import assign_targets, standup_boxes, standup_iou
from opencood_ddp.postprocess.voxel_postprocessor import VoxelPostprocessor
from opencood_ddp.registry import POSTPROCESSORS


def create_postprocessor(hypes: Mapping, train: bool) -> Any:
    """The post-processor named by ``postprocess.core_method``, built from ``hypes['postprocess']``."""
    source = hypes_source(hypes)
    entry = POSTPROCESSORS.lookup(hypes, source)
    return entry.obj(hypes["postprocess"], train, source)


__all__ = [
    "create_postprocessor", "VoxelPostprocessor",
    "AnchorSpec", "generate_anchors",
    "encode", "delta_to_boxes3d",
    "assign_targets", "standup_boxes", "standup_iou",
    "boxes_to_corners", "project_corners", "corners_to_standup", "normal_size_mask", "normal_z_mask",
    "within_range_mask",
    "NMS_TOP_K", "nms_rotated",
    "bev_iou_matrix", "bev_polygons",
]
