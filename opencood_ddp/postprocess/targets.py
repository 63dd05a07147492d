"""Training targets of the PointPillar head: which anchors are positive / negative and their residuals.

Upstream counterparts: ``VoxelPostprocessor.generate_label`` and the Cython ``bbox_overlaps``
(``opencood/utils/box_overlaps.pyx``, the Fast R-CNN routine). Anchors and GT boxes are matched on their
axis-aligned BEV footprints ("standup" boxes: min / max of the corners' x and y), with the legacy pixel
convention of that routine, ``extent + 1``, kept because checkpoints were trained with it:

    iw = min(x2) - max(x1) + 1,  ih = min(y2) - max(y1) + 1  (pairs with iw <= 0 or ih <= 0 have IoU 0)
    IoU = iw * ih / ((x2 - x1 + 1) * (y2 - y1 + 1) of the anchor + the same of the GT - iw * ih)

Rules, in upstream's order:
- positive: IoU > pos_threshold with some GT (the first such GT in index order gives the residuals), plus,
  for each GT whose best IoU is > 0, its best anchor (``argmax``: the first anchor in (H, W, A) order);
- de-duplication with ``np.unique(return_index=True)``: an anchor listed twice keeps its first listing, so a
  threshold match wins over a best-anchor match;
- negative: IoU < neg_threshold with every GT, minus the best anchors. A frame without GT has every anchor
  negative and zero targets.

Only the non-zero IoU entries (pairs whose footprints overlap) are materialised; the results equal those of
upstream's rules on the dense (anchors, GT) matrix.

Outputs as upstream: ``pos_equal_one`` and ``neg_equal_one`` (H, W, A) and ``targets`` (H, W, 7A), all
float64. Departures (numerically minute): the standup coordinates come from float64 corners rounded to
float32 (upstream builds the corners in float32, so a coordinate may differ by one float32 ulp), and the
residuals index the valid GT rows rather than the padded array (the same rows whenever the mask is a prefix,
as the datasets make it).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from opencood_ddp.data.geometry import boxes_to_corners
from opencood_ddp.postprocess.box_coder import encode


def standup_boxes(corners: np.ndarray) -> np.ndarray:
    """(K, C, >=2) corners -> (K, 4) ``[x_min, y_min, x_max, y_max]`` (upstream ``corner2d_to_standup_box``)."""
    xy = np.asarray(corners)[..., :2]
    return np.concatenate([xy.min(axis=1), xy.max(axis=1)], axis=1)


def _plus_one(extent32: np.ndarray) -> np.ndarray:
    """C's ``float_value + 1.0``: the sum is taken in double and stored back into a float32 variable."""
    return (extent32.astype(np.float64) + 1.0).astype(np.float32)


def _area_plus_one(boxes32: np.ndarray) -> np.ndarray:
    """(x2 - x1 + 1) * (y2 - y1 + 1) with the differences in float32 and the rest in double, as the C code."""
    width = (boxes32[:, 2] - boxes32[:, 0]).astype(np.float64) + 1.0
    height = (boxes32[:, 3] - boxes32[:, 1]).astype(np.float64) + 1.0
    return width * height


def standup_iou_pairs(boxes: np.ndarray, query_boxes: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero entries of ``standup_iou(boxes, query_boxes)``: rows, cols (row-major order) and values.

    Upstream's ``bbox_overlaps`` evaluated only where ``iw`` and ``ih`` are positive, which is where it writes
    a value; see ``standup_iou`` for the arithmetic.
    """
    b = np.ascontiguousarray(boxes, dtype=np.float32).reshape(-1, 4)
    q = np.ascontiguousarray(query_boxes, dtype=np.float32).reshape(-1, 4)
    # iw > 0 exactly when the float32 difference exceeds -1 (the double sum is then >= 2^-24, which stays
    # positive in float32), so one dense comparison finds the candidate pairs.
    rows, cols = np.nonzero(np.minimum(b[:, None, 2], q[None, :, 2]) - np.maximum(b[:, None, 0], q[None, :, 0]) > -1)
    iw = _plus_one(np.minimum(b[rows, 2], q[cols, 2]) - np.maximum(b[rows, 0], q[cols, 0]))
    ih = _plus_one(np.minimum(b[rows, 3], q[cols, 3]) - np.maximum(b[rows, 1], q[cols, 1]))
    hit = (iw > 0) & (ih > 0)
    rows, cols, iw, ih = rows[hit], cols[hit], iw[hit], ih[hit]
    inter = iw * ih  # float32 product, as in C
    query_area = _area_plus_one(q).astype(np.float32)  # stored in a float32 variable upstream
    union = (_area_plus_one(b)[rows] + query_area[cols].astype(np.float64)
             - inter.astype(np.float64)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        return rows, cols, inter / union


def standup_iou(boxes: np.ndarray, query_boxes: np.ndarray) -> np.ndarray:
    """(N, K) float32 IoU of standup boxes, reproducing upstream's ``bbox_overlaps(boxes, query_boxes)``.

    Both inputs are cast to float32 as upstream. The compiled routine mixes precisions, and so does this:
    coordinate differences in float32, ``+ 1`` and the area products in double, ``iw``, ``ih``, the query
    box's area and the union stored as float32, the intersection ``iw * ih`` and the quotient in float32.
    Pairs whose ``iw`` or ``ih`` is not positive have IoU 0, as upstream.
    """
    overlaps = np.zeros((len(np.reshape(boxes, (-1, 4))), len(np.reshape(query_boxes, (-1, 4)))), dtype=np.float32)
    rows, cols, values = standup_iou_pairs(boxes, query_boxes)
    overlaps[rows, cols] = values
    return overlaps


def _best_anchor_per_gt(rows: np.ndarray, cols: np.ndarray, values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(anchor, gt) of each GT's highest IoU, the lowest anchor index among ties, as a dense ``argmax``.

    GTs without any overlap are left out (upstream keeps a best anchor only when its IoU is > 0).
    """
    overlapping = values > 0
    rows, cols, values = rows[overlapping], cols[overlapping], values[overlapping]
    order = np.lexsort((rows, -values, cols))  # by GT, then IoU descending, then anchor index
    gts, first = np.unique(cols[order], return_index=True)
    return rows[order][first], gts


def anchor_standup_boxes(anchors: np.ndarray) -> np.ndarray:
    """(H*W*A, 4) standup boxes of (H, W, A, 7) 'hwl' anchors, from their corners."""
    return standup_boxes(boxes_to_corners(np.asarray(anchors, dtype=np.float64).reshape(-1, 7)))


def assign_targets(gt_boxes: np.ndarray, anchors: np.ndarray, pos_threshold: float, neg_threshold: float,
                   anchor_standup: Optional[np.ndarray] = None) -> Dict[str, np.ndarray]:
    """Labels of one frame: ``gt_boxes`` (M, 7) valid 'hwl' boxes, ``anchors`` (H, W, A, 7) 'hwl'.

    ``anchor_standup`` may pass ``anchor_standup_boxes(anchors)`` computed once (the anchors never change).
    Works on the non-zero IoU entries only, with the results of upstream's dense rules; ``pos_threshold``
    must not be negative (a negative one would make every zero-IoU pair positive).
    """
    anchors = np.asarray(anchors, dtype=np.float64)
    if anchors.ndim != 4 or anchors.shape[3] != 7:
        raise ValueError(f"anchors must be (H, W, anchor_num, 7), got {anchors.shape}")
    if pos_threshold < 0:
        raise ValueError(f"pos_threshold must be >= 0, got {pos_threshold}")
    gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 7)
    rows, cols, num = anchors.shape[:3]
    flat = anchors.reshape(-1, 7)
    if anchor_standup is None:
        anchor_standup = anchor_standup_boxes(anchors)
    if anchor_standup.shape != (len(flat), 4):
        raise ValueError(f"anchor_standup must be ({len(flat)}, 4), got {anchor_standup.shape}")
    pair_anchor, pair_gt, iou = standup_iou_pairs(anchor_standup, standup_boxes(boxes_to_corners(gt_boxes)))
    best_anchor, best_gt = _best_anchor_per_gt(pair_anchor, pair_gt, iou)

    # The thresholds compare in float32, as upstream's float32 IoU against a Python float. Positives in
    # np.nonzero's row-major order (anchor, then GT), as the pairs come.
    above = iou > np.float32(pos_threshold)
    pos_anchor, pos_gt = pair_anchor[above], pair_gt[above]
    # Negative: IoU < neg_threshold with every GT. Zero entries pass exactly when 0 < neg_threshold.
    negative = np.full(len(flat), len(gt_boxes) == 0 or np.float32(0) < np.float32(neg_threshold))
    negative[pair_anchor[iou >= np.float32(neg_threshold)]] = False

    pos_anchor = np.concatenate([pos_anchor, best_anchor])
    pos_gt = np.concatenate([pos_gt, best_gt])
    pos_anchor, first = np.unique(pos_anchor, return_index=True)  # the first listing of each anchor wins
    pos_gt = pos_gt[first]
    negative[best_anchor] = False

    pos_equal_one = np.zeros(len(flat))
    pos_equal_one[pos_anchor] = 1
    targets = np.zeros((len(flat), 7))
    targets[pos_anchor] = encode(gt_boxes[pos_gt], flat[pos_anchor])
    return {"pos_equal_one": pos_equal_one.reshape(rows, cols, num),
            "neg_equal_one": negative.astype(np.float64).reshape(rows, cols, num),
            # (H*W*A, 7) row-major is (H, W, 7A) with anchor a's residuals in channels 7a..7a+6.
            "targets": targets.reshape(rows, cols, num * 7)}


__all__ = ["standup_boxes", "standup_iou", "standup_iou_pairs", "anchor_standup_boxes", "assign_targets"]
