"""Rotated bird's-eye-view IoU of 3D boxes given as (K, 8, 3) corners: shared by NMS and the AP metrics.

Upstream (``opencood/utils/common_utils.py``: ``convert_format``, ``compute_iou``) builds one shapely polygon
per box from its bottom four corners and loops over pairs in Python. Here the polygons are built as shapely 2
arrays and only pairs whose axis-aligned footprints overlap are intersected (a rotated box lies inside its
axis-aligned footprint, so every other pair has IoU 0 exactly). The numbers are the same as upstream's:
intersection area / union area of the same polygons, in float64.
"""
from __future__ import annotations

import numpy as np
import shapely


def _as_corners(corners: np.ndarray, name: str) -> np.ndarray:
    c = np.asarray(corners, dtype=np.float64)
    if c.ndim != 3 or c.shape[1:] != (8, 3):
        raise ValueError(f"{name} must have shape (K, 8, 3), got {c.shape}")
    return c


def bev_polygons(corners: np.ndarray) -> np.ndarray:
    """(K,) array of shapely polygons from the bottom four corners' x, y (upstream's ``convert_format``)."""
    c = _as_corners(corners, "corners")
    return shapely.polygons(np.ascontiguousarray(c[:, :4, :2]))


def _footprints(corners: np.ndarray) -> np.ndarray:
    xy = corners[:, :4, :2]
    return np.concatenate([xy.min(axis=1), xy.max(axis=1)], axis=1)  # (K, 4): x0, y0, x1, y1


def bev_iou_matrix(corners_a: np.ndarray, corners_b: np.ndarray) -> np.ndarray:
    """(Ka, Kb) float64 IoU of every box of ``a`` with every box of ``b`` in bird's-eye view."""
    a, b = _as_corners(corners_a, "corners_a"), _as_corners(corners_b, "corners_b")
    iou = np.zeros((len(a), len(b)), dtype=np.float64)
    if len(a) == 0 or len(b) == 0:
        return iou
    fa, fb = _footprints(a), _footprints(b)
    overlap = ((fa[:, None, 0] <= fb[None, :, 2]) & (fb[None, :, 0] <= fa[:, None, 2])
               & (fa[:, None, 1] <= fb[None, :, 3]) & (fb[None, :, 1] <= fa[:, None, 3]))
    rows, cols = np.nonzero(overlap)
    if len(rows) == 0:
        return iou
    poly_a, poly_b = bev_polygons(a), bev_polygons(b)
    inter = shapely.area(shapely.intersection(poly_a[rows], poly_b[cols]))
    union = shapely.area(poly_a)[rows] + shapely.area(poly_b)[cols] - inter
    # A degenerate pair (both areas 0) has IoU 0 rather than 0/0.
    iou[rows, cols] = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return iou


__all__ = ["bev_polygons", "bev_iou_matrix"]
