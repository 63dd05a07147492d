"""Torch helpers on 3D boxes for post-processing: corners, projection, standup boxes and the keep masks.

Upstream counterparts in ``opencood/utils/box_utils.py``: ``boxes_to_corners_3d``, ``project_box3d``,
``corner_to_standup_box_torch``, ``remove_large_pred_bbx``, ``remove_bbx_abnormal_z`` and
``get_mask_for_boxes_within_range_torch``. Everything here works on any device and keeps the input's
floating dtype (upstream computes corners in float32); the corner order is the one documented in
``opencood_ddp.data.geometry``.
"""
from __future__ import annotations

from typing import Sequence

import torch

# Box-frame signs of the 8 corners, in geometry's (and upstream's) corner order.
_CORNER_SIGNS = (
    (1, -1, -1), (1, 1, -1), (-1, 1, -1), (-1, -1, -1),
    (1, -1, 1), (1, 1, 1), (-1, 1, 1), (-1, -1, 1),
)

# Upstream's fixed post-processing limits (metres).
MAX_BOX_EXTENT = 6.0  # remove_large_pred_bbx: x and y extents of the corners
Z_LIMITS = (-3.0, 1.0)  # remove_bbx_abnormal_z: every corner's z inside [-3, 1]


def _check_corners(corners: torch.Tensor) -> None:
    if corners.dim() != 3 or corners.shape[1] != 8 or corners.shape[2] != 3:
        raise ValueError(f"corners must have shape (K, 8, 3), got {tuple(corners.shape)}")


def boxes_to_corners(boxes: torch.Tensor, order: str = "hwl") -> torch.Tensor:
    """(K, 7) boxes ``[x, y, z, d0, d1, d2, yaw]`` -> (K, 8, 3) corners, rotated by yaw about +z.

    The torch twin of ``opencood_ddp.data.geometry.boxes_to_corners`` (same formula, same corner order);
    the input is never modified (upstream swaps the 'hwl' columns in place).
    """
    if order not in ("hwl", "lwh"):
        raise ValueError(f"box order must be 'hwl' or 'lwh', got {order!r}")
    if boxes.dim() != 2 or boxes.shape[1] != 7:
        raise ValueError(f"boxes must have shape (K, 7), got {tuple(boxes.shape)}")
    dims = boxes[:, [5, 4, 3]] if order == "hwl" else boxes[:, 3:6]  # -> (l, w, h)
    signs = torch.tensor(_CORNER_SIGNS, dtype=boxes.dtype, device=boxes.device)
    offsets = (dims / 2.0)[:, None, :] * signs[None]
    cos, sin = torch.cos(boxes[:, 6])[:, None], torch.sin(boxes[:, 6])[:, None]
    x = offsets[..., 0] * cos - offsets[..., 1] * sin
    y = offsets[..., 0] * sin + offsets[..., 1] * cos
    return torch.stack([x, y, offsets[..., 2]], dim=-1) + boxes[:, None, :3]


def project_corners(corners: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """(K, 8, 3) corners mapped by a (4, 4) rigid transform, in the corners' dtype and device."""
    _check_corners(corners)
    if tuple(matrix.shape) != (4, 4):
        raise ValueError(f"transformation matrix must have shape (4, 4), got {tuple(matrix.shape)}")
    mat = torch.as_tensor(matrix).to(device=corners.device, dtype=corners.dtype)
    return corners @ mat[:3, :3].T + mat[:3, 3]


def corners_to_standup(corners: torch.Tensor) -> torch.Tensor:
    """(K, C, >=2) corners -> (K, 4) axis-aligned ``[x_min, y_min, x_max, y_max]``."""
    xy = corners[..., :2]
    return torch.cat([xy.amin(dim=1), xy.amax(dim=1)], dim=1)


def normal_size_mask(corners: torch.Tensor, max_extent: float = MAX_BOX_EXTENT) -> torch.Tensor:
    """(K,) bool keep mask, upstream ``remove_large_pred_bbx``: x and y extents of the corners <= 6 m.

    Upstream also requires a non-zero z extent (``logical_and(index, z_len)``); a box of height 0 is dropped.
    """
    _check_corners(corners)
    extent = corners.amax(dim=1) - corners.amin(dim=1)  # (K, 3)
    return (extent[:, 0] <= max_extent) & (extent[:, 1] <= max_extent) & (extent[:, 2] != 0)


def normal_z_mask(corners: torch.Tensor, z_limits: Sequence[float] = Z_LIMITS) -> torch.Tensor:
    """(K,) bool keep mask, upstream ``remove_bbx_abnormal_z``: all corners' z in [-3, 1] (fixed, inclusive)."""
    _check_corners(corners)
    z = corners[..., 2]
    return (z.amin(dim=1) >= z_limits[0]) & (z.amax(dim=1) <= z_limits[1])


def within_range_mask(corners: torch.Tensor, gt_range: Sequence[float]) -> torch.Tensor:
    """(K,) bool: all corners' x and y inside ``gt_range``'s x-y rectangle, edges included (z not tested).

    Upstream ``get_mask_for_boxes_within_range_torch`` (with its GT_RANGE passed in); the bounds take the
    corners' dtype, as upstream's float32 bound tensors meet float32 corners.
    """
    if corners.dim() != 3 or corners.shape[2] < 2:
        raise ValueError(f"corners must have shape (K, C, >=2), got {tuple(corners.shape)}")
    if len(gt_range) != 6:
        raise ValueError(f"gt_range must be [x_min, y_min, z_min, x_max, y_max, z_max], got {gt_range}")
    lower = torch.tensor([gt_range[0], gt_range[1]], dtype=corners.dtype, device=corners.device)
    upper = torch.tensor([gt_range[3], gt_range[4]], dtype=corners.dtype, device=corners.device)
    xy = corners[..., :2]
    return ((xy >= lower) & (xy <= upper)).all(dim=2).all(dim=1)


__all__ = ["MAX_BOX_EXTENT", "Z_LIMITS", "boxes_to_corners", "project_corners", "corners_to_standup",
           "normal_size_mask", "normal_z_mask", "within_range_mask"]
