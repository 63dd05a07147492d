"""Per-frame true/false positives of 3D detections against ground truth, by rotated bird's-eye-view IoU.

Upstream counterpart: ``opencood/utils/eval_utils.py: caluclate_tp_fp`` (sic), which appends into a shared
``result_stat`` dict. Here each frame yields an immutable, picklable ``FrameStats`` instead, so that frames
evaluated on different processes can be gathered and concatenated in dataset order (``accumulate``); the
numbers are the same as upstream's. One departure: detections are ordered by a STABLE descending sort of
their scores (ties keep their input order). Upstream uses ``np.argsort(-score)`` (quicksort, not stable), whose
order among equal scores depends on the sort algorithm; ours never does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from opencood_ddp.postprocess import bev_iou_matrix

IOU_THRESHOLDS: tuple[float, ...] = (0.3, 0.5, 0.7)


@dataclass(frozen=True)
class DetectionStats:
    """Detections at one IoU threshold, for one frame or concatenated over frames.

    tp[i], fp[i]: 1/0 flags of the i-th detection (tp[i] + fp[i] == 1); scores[i]: its score. Within a frame
    the detections are in descending score order. gt: number of ground-truth boxes.
    """

    tp: tuple[int, ...]
    fp: tuple[int, ...]
    scores: tuple[float, ...]
    gt: int

    def __post_init__(self) -> None:
        if not len(self.tp) == len(self.fp) == len(self.scores):
            raise ValueError(f"tp, fp and scores differ in length: {len(self.tp)}, {len(self.fp)}, "
                             f"{len(self.scores)}")


@dataclass(frozen=True)
class FrameStats:
    """The statistics of one frame at every IoU threshold: ``frame[0.5]`` is its DetectionStats at 0.5.

    Plain Python content only (tuples of ints and floats), so it pickles small and compares with ==.
    ``bands`` holds the same frame's statistics per distance band where a convention asks for them (V2V4Real's:
    ``metrics/conventions.py``), keyed by band name; each band is matched on its own, so it is a FrameStats of
    its own, not a subset of this one's flags. Keyword-only, so that subclasses' positional fields stay theirs.
    """

    by_threshold: Mapping[float, DetectionStats]
    bands: Mapping[str, "FrameStats"] = field(default_factory=dict, kw_only=True)

    @property
    def iou_thresholds(self) -> tuple[float, ...]:
        return tuple(self.by_threshold)

    def __getitem__(self, iou_threshold: float) -> DetectionStats:
        return self.by_threshold[iou_threshold]


def _to_numpy(value: Any) -> Optional[np.ndarray]:
    """numpy view of a numpy array, torch tensor (any device) or nested sequence; None stays None."""
    if value is None:
        return None
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _corners(value: Any, name: str) -> np.ndarray:
    arr = _to_numpy(value)
    if arr is None or arr.size == 0:
        return np.zeros((0, 8, 3), dtype=np.float64)
    if arr.ndim != 3 or arr.shape[1:] != (8, 3):
        raise ValueError(f"{name} must have shape (K, 8, 3), got {arr.shape}")
    return arr


def _match_sorted(iou: np.ndarray, iou_threshold: float) -> list[int]:
    """Greedy matching of detections (rows, already in score order) to ground truth (columns).

    Each detection takes the remaining GT of highest IoU (the first one on ties, as upstream's np.argmax
    over its shrinking list); it is a tp when that IoU is >= the threshold, and the GT is then used up.
    """
    num_gt = iou.shape[1]
    remaining = np.ones(num_gt, dtype=bool)
    tp = []
    for row in iou:
        if not remaining.any():
            tp.append(0)
            continue
        candidates = np.where(remaining, row, -np.inf)
        best = int(np.argmax(candidates))
        if candidates[best] < iou_threshold:
            tp.append(0)
            continue
        tp.append(1)
        remaining[best] = False
    return tp


def frame_stats(pred_corners: Any, scores: Any, gt_corners: Any,
                iou_thresholds: Iterable[float] = IOU_THRESHOLDS) -> FrameStats:
    """TP/FP flags of one frame's detections at each IoU threshold (upstream ``caluclate_tp_fp``).

    pred_corners: (N, 8, 3) detected boxes (numpy or torch; None or empty: no detection); scores: (N,).
    gt_corners: (G, 8, 3) ground truth (None or empty: no object). The GT count is recorded even when
    there is no detection, so missed objects lower the recall.
    """
    pred = _corners(pred_corners, "pred_corners")
    gt = _corners(gt_corners, "gt_corners")
    score = _to_numpy(scores)
    score = np.zeros(0, dtype=np.float64) if score is None else score.reshape(-1)
    if len(score) != len(pred):
        raise ValueError(f"{len(pred)} predicted boxes but {len(score)} scores")
    order = np.argsort(-score, kind="stable")  # descending; ties keep the input order
    iou = bev_iou_matrix(pred[order], gt)
    sorted_scores = tuple(score[order].tolist())
    by_threshold = {}
    for threshold in iou_thresholds:
        tp = _match_sorted(iou, float(threshold))
        by_threshold[float(threshold)] = DetectionStats(
            tp=tuple(tp), fp=tuple(1 - flag for flag in tp), scores=sorted_scores, gt=int(len(gt)))
    return FrameStats(by_threshold=by_threshold)


def accumulate(frames: Sequence[FrameStats],
               iou_thresholds: Optional[Iterable[float]] = None) -> dict[float, DetectionStats]:
    """Concatenate the frames' statistics per threshold, in the given order (the caller's dataset order).

    The thresholds are ``iou_thresholds`` when given, else the first frame's (every frame must have them),
    else 0.3/0.5/0.7 when there is no frame.
    """
    thresholds = _common_thresholds(frames, iou_thresholds)
    merged = {}
    for threshold in thresholds:
        tp: list[int] = []
        fp: list[int] = []
        scores: list[float] = []
        gt = 0
        for frame in frames:
            stats = frame[threshold]
            tp.extend(stats.tp)
            fp.extend(stats.fp)
            scores.extend(stats.scores)
            gt += stats.gt
        merged[threshold] = DetectionStats(tp=tuple(tp), fp=tuple(fp), scores=tuple(scores), gt=gt)
    return merged


def _common_thresholds(frames: Sequence[FrameStats],
                       iou_thresholds: Optional[Iterable[float]]) -> tuple[float, ...]:
    if iou_thresholds is not None:
        wanted = tuple(float(t) for t in iou_thresholds)
    elif frames:
        wanted = frames[0].iou_thresholds
    else:
        wanted = IOU_THRESHOLDS
    for index, frame in enumerate(frames):
        missing = [t for t in wanted if t not in frame.by_threshold]
        if missing:
            raise ValueError(f"frame {index} has no statistics at IoU {missing} "
                             f"(it has {list(frame.iou_thresholds)})")
    return wanted


__all__ = ["IOU_THRESHOLDS", "DetectionStats", "FrameStats", "frame_stats", "accumulate"]
