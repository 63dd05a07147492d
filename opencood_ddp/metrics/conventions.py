"""The mechanics of the evaluation conventions besides OpenCOOD's: a range test that includes z (HEAL's, on
predictions) and AP per distance band (V2V4Real's). The presets that combine them are ``tasks/eval_presets.py``.

V2V4Real's bands (``opencood/utils/eval_utils.py: caluclate_tp_fp`` with ``left_range``/``right_range``, called
from ``opencood/tools/inference.py``): the distance of a box is that of its bird's-eye-view polygon's centroid
(bottom four corners) from the ego origin; a band keeps the detections and, independently, the ground truth whose
distance lies strictly between its bounds, and matches them afresh (a detection of one band never takes a GT of
another). One departure: for a frame without any detection V2V4Real adds the frame's whole GT count to every
band; here a band counts only its own GT, with or without detections.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import numpy as np
import shapely

from opencood_ddp.metrics.ap import average_precision
from opencood_ddp.metrics.detection import FrameStats, accumulate, frame_stats
from opencood_ddp.postprocess import bev_polygons

DistanceBand = Tuple[float, float]  # (low, high) metres, both exclusive
V2V4REAL_BANDS: Tuple[DistanceBand, ...] = ((0.0, 30.0), (30.0, 50.0), (50.0, 100.0))
BAND_IOU_THRESHOLDS: Tuple[float, ...] = (0.5, 0.7)  # V2V4Real reports its bands at these two only
AP_CONVENTIONS = {False: "frame order", True: "global sort"}  # eval.yaml's and noise_sweep.yaml's ap_convention


def band_name(band: DistanceBand) -> str:
    """'0_30m' for (0, 30): the suffix of the band's keys in eval.yaml."""
    return f"{band[0]:g}_{band[1]:g}m"


def band_ap_key(threshold: float, band: DistanceBand) -> str:
    """'ap_50_0_30m': AP at IoU 0.5 of the band 0-30 m (upstream's 'ap_50' spelling plus the band)."""
    return f"ap_{round(threshold * 100):d}_{band_name(band)}"


def corners_inside_range(corners: np.ndarray, eval_range: Sequence[float], with_z: bool) -> np.ndarray:
    """(K,) bool: all 8 corners inside ``eval_range`` [x_min, y_min, z_min, x_max, y_max, z_max], faces
    included; z is tested only ``with_z`` (HEAL's test on predictions: ``mask_boxes_outside_range_numpy`` with 8
    corners). Compared in float64, as numpy compares HEAL's float32 corners with its list of bounds."""
    c = np.asarray(corners, dtype=np.float64).reshape(-1, 8, 3)
    axes = 3 if with_z else 2
    lower = np.asarray(eval_range[:3], dtype=np.float64)[:axes]
    upper = np.asarray(eval_range[3:6], dtype=np.float64)[:axes]
    xyz = c[..., :axes]
    return np.all((xyz >= lower) & (xyz <= upper), axis=(1, 2))


def centroid_distances(corners: np.ndarray) -> np.ndarray:
    """(K,) distance of each box's BEV polygon centroid from the origin (V2V4Real's ``polygon.centroid``).

    A degenerate polygon (zero area) has no centroid in shapely, where V2V4Real would fail; it takes the mean
    of its four corners instead."""
    c = np.asarray(corners, dtype=np.float64).reshape(-1, 8, 3)
    if len(c) == 0:
        return np.zeros(0, dtype=np.float64)
    centroids = shapely.centroid(bev_polygons(c))
    x, y = shapely.get_x(centroids), shapely.get_y(centroids)
    mean = c[:, :4, :2].mean(axis=1)
    x = np.where(np.isnan(x), mean[:, 0], x)
    y = np.where(np.isnan(y), mean[:, 1], y)
    return np.sqrt(x ** 2 + y ** 2)


def in_band(distances: np.ndarray, band: DistanceBand) -> np.ndarray:
    """Strictly between the band's bounds, as V2V4Real's ``left_range < distance < right_range``: a box at
    exactly 30 m belongs to no band."""
    return (band[0] < distances) & (distances < band[1])


def band_stats(pred_corners: np.ndarray, scores: np.ndarray, gt_corners: np.ndarray,
               bands: Sequence[DistanceBand], iou_thresholds: Sequence[float] = BAND_IOU_THRESHOLDS
               ) -> Dict[str, FrameStats]:
    """One frame's statistics per band (numpy inputs: (N, 8, 3), (N,), (G, 8, 3)): detections and GT of the band
    only, matched within the band."""
    # The dtypes are kept: the scores recorded per band are the same floats as the frame's overall ones.
    pred, gt = np.asarray(pred_corners).reshape(-1, 8, 3), np.asarray(gt_corners).reshape(-1, 8, 3)
    score = np.asarray(scores).reshape(-1)
    pred_distance, gt_distance = centroid_distances(pred), centroid_distances(gt)
    result = {}
    for band in bands:
        keep_pred, keep_gt = in_band(pred_distance, band), in_band(gt_distance, band)
        result[band_name(band)] = frame_stats(pred[keep_pred], score[keep_pred], gt[keep_gt], iou_thresholds)
    return result


def band_summary(frames: Sequence[FrameStats], bands: Sequence[DistanceBand], global_sort: bool,
                 iou_thresholds: Sequence[float] = BAND_IOU_THRESHOLDS) -> dict:
    """{'ap_50_0_30m': ..., ...}: each band's AP over the frames in the given order (dataset order), ranked as
    the convention ranks the overall AP. NaN for a band without ground truth."""
    summary = {}
    for band in bands:
        name = band_name(band)
        per_frame = [_band_of(frame, name, index) for index, frame in enumerate(frames)]
        merged = accumulate(per_frame, iou_thresholds)
        for threshold in iou_thresholds:
            summary[band_ap_key(threshold, band)] = average_precision(merged[float(threshold)], global_sort)[0]
    return summary


def _band_of(frame: FrameStats, name: str, index: int) -> FrameStats:
    bands: Mapping[str, FrameStats] = frame.bands
    if name not in bands:
        raise ValueError(f"frame {index} has no statistics for the distance band {name} (it has {list(bands)})")
    return bands[name]


__all__ = ["AP_CONVENTIONS", "BAND_IOU_THRESHOLDS", "DistanceBand", "V2V4REAL_BANDS",
           "band_ap_key", "band_name", "band_stats", "band_summary", "centroid_distances",
           "corners_inside_range", "in_band"]
