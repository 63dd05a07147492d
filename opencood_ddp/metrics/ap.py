"""VOC all-points average precision over concatenated per-frame statistics, and the eval.yaml summary.

Upstream counterparts: ``opencood/utils/eval_utils.py``: ``calculate_ap``, ``voc_ap`` and
``eval_final_results``. Departures, all on inputs where upstream fails or is unspecified:

- no ground truth at all: AP is ``float('nan')`` and the curve is empty (upstream divides by zero when there
  are detections, and reports 0 when there are none);
- global sort is a STABLE descending sort (upstream ``np.argsort(-score)`` leaves ties to quicksort);
- the statistics are never modified (upstream's cumulative sums write into its ``result_stat`` lists).

The sum that gives the AP runs left to right as upstream's loop does, so the float is the same bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from opencood_ddp.metrics.detection import IOU_THRESHOLDS, DetectionStats, FrameStats, accumulate

# eval.yaml's keys, spelled as upstream writes them (note 'ap30' without the underscore).
AP_KEYS = {0.3: "ap30", 0.5: "ap_50", 0.7: "ap_70"}
CURVE_THRESHOLDS = (0.5, 0.7)


def ordered_flags(stats: DetectionStats, global_sort: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tp, fp, scores in ranking order: concatenation order (each frame sorted within itself, upstream's
    default), or a stable descending sort of all detections by score when ``global_sort``."""
    tp = np.asarray(stats.tp, dtype=np.int64)
    fp = np.asarray(stats.fp, dtype=np.int64)
    scores = np.asarray(stats.scores, dtype=np.float64)
    if global_sort:
        order = np.argsort(-scores, kind="stable")
        tp, fp, scores = tp[order], fp[order], scores[order]
    return tp, fp, scores


def precision_recall(stats: DetectionStats, global_sort: bool) -> tuple[np.ndarray, np.ndarray]:
    """Raw precision and recall after each ranked detection (float64). Recall is NaN without ground truth."""
    tp, fp, _ = ordered_flags(stats, global_sort)
    cum_tp, cum_fp = np.cumsum(tp), np.cumsum(fp)
    precision = cum_tp / np.maximum(cum_tp + cum_fp, 1)  # the denominator is the rank, >= 1
    if stats.gt == 0:
        recall = np.full(len(tp), np.nan)
    else:
        recall = cum_tp / stats.gt
    return precision, recall


def voc_ap(recall: Sequence[float], precision: Sequence[float]) -> tuple[float, list[float], list[float]]:
    """VOC 2010 all-points AP (upstream ``voc_ap``) -> (ap, mrec, mpre).

    mrec = [0, *recall, 1], mpre = [0, *precision, 0] made non-increasing from the right; the AP sums
    (mrec[i] - mrec[i-1]) * mpre[i] over the indices where the recall changes.
    """
    mrec = [0.0, *(float(r) for r in recall), 1.0]
    mpre_raw = np.array([0.0, *(float(p) for p in precision), 0.0], dtype=np.float64)
    mpre = np.maximum.accumulate(mpre_raw[::-1])[::-1].tolist()
    ap = 0.0
    for i in range(1, len(mrec)):
        if mrec[i] != mrec[i - 1]:
            # A plain left-to-right sum, as upstream's loop: np.sum / math.fsum would round differently.
            ap += (mrec[i] - mrec[i - 1]) * mpre[i]
    return float(ap), mrec, mpre


def average_precision(stats: DetectionStats, global_sort: bool) -> tuple[float, list[float], list[float]]:
    """(ap, mrec, mpre) of one threshold's accumulated statistics (upstream ``calculate_ap``).

    No ground truth: (nan, [], []). Ground truth but no detection: AP 0 with mrec [0, 1], mpre [0, 0].
    """
    if stats.gt == 0:
        return float("nan"), [], []
    precision, recall = precision_recall(stats, global_sort)
    return voc_ap(recall.tolist(), precision.tolist())


@dataclass(frozen=True)
class PrCurve:
    """One threshold's raw curve: precision[i], recall[i] after the i-th ranked detection of score scores[i];
    ``ap`` is the VOC AP of the same ranking."""

    precision: np.ndarray
    recall: np.ndarray
    scores: np.ndarray
    ap: float


def pr_curve(frames: Sequence[FrameStats], global_sort: bool = False,
             iou_thresholds: Optional[Iterable[float]] = None) -> dict[float, PrCurve]:
    """Precision/recall curves per IoU threshold over the frames concatenated in the given order."""
    curves = {}
    for threshold, stats in accumulate(frames, iou_thresholds).items():
        precision, recall = precision_recall(stats, global_sort)
        _, _, scores = ordered_flags(stats, global_sort)
        curves[threshold] = PrCurve(precision=precision, recall=recall, scores=scores,
                                    ap=average_precision(stats, global_sort)[0])
    return curves


def eval_summary(frames: Sequence[FrameStats], global_sort: bool = False) -> dict:
    """upstream ``eval_final_results``' eval.yaml content: ap30, ap_50, ap_70 (floats) and mpre_50, mrec_50,
    mpre_70, mrec_70 (lists), all plain Python floats so that ``yaml.safe_dump`` writes them.

    Upstream names the file eval_global_sort.yaml when detections are sorted globally; choosing the file
    name is the caller's business.
    """
    merged = accumulate(frames, IOU_THRESHOLDS)
    results = {threshold: average_precision(merged[threshold], global_sort) for threshold in IOU_THRESHOLDS}
    summary: dict = {key: results[threshold][0] for threshold, key in AP_KEYS.items()}
    for threshold in CURVE_THRESHOLDS:
        _, mrec, mpre = results[threshold]
        suffix = f"{round(threshold * 100):d}"
        summary[f"mpre_{suffix}"] = mpre
        summary[f"mrec_{suffix}"] = mrec
    return summary


__all__ = ["AP_KEYS", "PrCurve", "average_precision", "eval_summary", "ordered_flags", "pr_curve",
           "precision_recall", "voc_ap"]
