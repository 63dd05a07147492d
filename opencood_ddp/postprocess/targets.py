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
upstream's rules on the dense (anchors, GT) matrix. The anchors lie on a grid, so each GT box's candidate
anchors are found from the grid's per-row and per-column bounds (``StandupGrid``) rather than by comparing it
with all H * W * A anchors; the exact pair test then runs on those candidates only.

Outputs as upstream: ``pos_equal_one`` and ``neg_equal_one`` (H, W, A) and ``targets`` (H, W, 7A), float64
by default; the post-processor asks for float32, the dtype the loss reads (``dtype``). Departures (numerically
minute): the standup coordinates come from float64 corners rounded to float32 (upstream builds the corners in
float32, so a coordinate may differ by one float32 ulp), and the residuals index the valid GT rows rather than
the padded array (the same rows whenever the mask is a prefix, as the datasets make it).
"""
from __future__ import annotations

from dataclasses import dataclass
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


def _kept_pairs(boxes32: np.ndarray, query32: np.ndarray, rows: np.ndarray,
                cols: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of the candidate pairs (``rows``, ``cols``), those with positive ``iw`` and ``ih``, and their IoU.

    The arithmetic of each pair depends on that pair's two boxes alone, so any superset of the overlapping pairs,
    listed in row-major order, gives the same entries in the same order as the dense matrix.
    """
    box, query = boxes32[rows], query32[cols]
    iw = _plus_one(np.minimum(box[:, 2], query[:, 2]) - np.maximum(box[:, 0], query[:, 0]))
    ih = _plus_one(np.minimum(box[:, 3], query[:, 3]) - np.maximum(box[:, 1], query[:, 1]))
    hit = (iw > 0) & (ih > 0)
    rows, cols, box, query, iw, ih = rows[hit], cols[hit], box[hit], query[hit], iw[hit], ih[hit]
    inter = iw * ih  # float32 product, as in C
    query_area = _area_plus_one(query).astype(np.float32)  # stored in a float32 variable upstream
    union = (_area_plus_one(box) + query_area.astype(np.float64) - inter.astype(np.float64)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        return rows, cols, inter / union


def _as_boxes32(boxes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(boxes, dtype=np.float32).reshape(-1, 4)


def standup_iou_pairs(boxes: np.ndarray, query_boxes: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zero entries of ``standup_iou(boxes, query_boxes)``: rows, cols (row-major order) and values.

    Upstream's ``bbox_overlaps`` evaluated only where ``iw`` and ``ih`` are positive, which is where it writes
    a value; see ``standup_iou`` for the arithmetic. Compares every box with every query box: anchors on a grid
    take ``StandupGrid.iou_pairs``, which finds the same entries from each query box's neighbourhood.
    """
    b, q = _as_boxes32(boxes), _as_boxes32(query_boxes)
    # iw > 0 exactly when the float32 difference exceeds -1 (the double sum is then >= 2^-24, which stays
    # positive in float32), so one dense comparison finds the candidate pairs.
    rows, cols = np.nonzero(np.minimum(b[:, None, 2], q[None, :, 2]) - np.maximum(b[:, None, 0], q[None, :, 0]) > -1)
    return _kept_pairs(b, q, rows, cols)


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
    best = np.full(int(cols.max(initial=-1)) + 1, -np.inf, dtype=values.dtype)
    np.maximum.at(best, cols, values)
    tied = values == best[cols]
    # The pairs come in row-major order, so a GT's first tied entry is its lowest anchor index.
    gts, first = np.unique(cols[tied], return_index=True)
    return rows[tied][first], gts


def anchor_standup_boxes(anchors: np.ndarray) -> np.ndarray:
    """(H*W*A, 4) standup boxes of (H, W, A, 7) 'hwl' anchors, from their corners."""
    return standup_boxes(boxes_to_corners(np.asarray(anchors, dtype=np.float64).reshape(-1, 7)))


def _reaches(bounds: np.ndarray, query_span: np.ndarray) -> np.ndarray:
    """(A * M, K): whether query interval m can overlap, with the +1 convention, line k's bounds of yaw a.

    ``bounds`` (A, K, 2) and ``query_span`` (M, 2) float32 [low, high]; the test of ``standup_iou_pairs`` (the
    float32 difference above -1) on a grid line's extreme coordinates instead of one anchor's.
    """
    high = np.minimum(bounds[:, None, :, 1], query_span[None, :, None, 1])
    low = np.maximum(bounds[:, None, :, 0], query_span[None, :, None, 0])
    return (high - low > -1).reshape(-1, bounds.shape[1])


def _grid_products(rows_ok: np.ndarray, cols_ok: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
    """(cell, query) pairs of each query's reachable rows x reachable columns; cell = row * width + column.

    ``rows_ok`` (Q, H) and ``cols_ok`` (Q, W) booleans. Vectorised over the queries: each (query, row) entry is
    repeated once per column of that query, and the columns are read from the query's slice of the column list.
    """
    query_of_row, row = np.nonzero(rows_ok)
    query_of_col, col = np.nonzero(cols_ok)
    col_count = np.bincount(query_of_col, minlength=len(cols_ok))
    col_start = np.cumsum(col_count) - col_count
    repeats = col_count[query_of_row]
    entry_start = np.cumsum(repeats) - repeats
    rank = np.arange(int(repeats.sum())) - np.repeat(entry_start, repeats)  # position among the entry's columns
    columns = col[np.repeat(col_start[query_of_row], repeats) + rank]
    return np.repeat(row, repeats) * width + columns, np.repeat(query_of_row, repeats)


def _line_bounds(low: np.ndarray, high: np.ndarray, axis: int) -> np.ndarray:
    """(A, K, 2) [min low, max high] per yaw a and grid line k, over ``axis`` (the other of H and W) of (H, W, A)
    coordinates.

    fmin / fmax skip NaN: an anchor with a NaN coordinate overlaps nothing (every comparison with NaN is false),
    so the bounds need only cover the others; a line with none gets [inf, -inf], which reaches nothing.
    """
    bounds = np.stack([np.fmin.reduce(low, axis=axis, initial=np.inf),
                       np.fmax.reduce(high, axis=axis, initial=-np.inf)], axis=-1)  # (K, A, 2)
    return np.ascontiguousarray(bounds.transpose(1, 0, 2), dtype=np.float32)


@dataclass(frozen=True, eq=False)
class StandupGrid:
    """The float32 standup boxes of an (H, W, A, 7) anchor grid, and the bounds that find a box's neighbours.

    ``column_x[a, w]`` is [min x1, max x2] over the H anchors of yaw a in grid column w, ``row_y[a, h]``
    [min y1, max y2] over the W anchors of yaw a in row h: whatever the grid's spacing, yaws, sizes or order,
    anchor (h, w, a) lies inside column (a, w)'s x bounds and row (a, h)'s y bounds (per yaw, so that the
    narrow side of a rotated anchor does not widen its neighbours' reach). Made once per anchor array (``of``).
    """

    shape: Tuple[int, int, int]
    boxes: np.ndarray  # (H*W*A, 4) float32 [x1, y1, x2, y2], the anchors' (H, W, A) order
    column_x: np.ndarray  # (A, W, 2) float32
    row_y: np.ndarray  # (A, H, 2) float32

    @classmethod
    def of(cls, anchors: np.ndarray) -> "StandupGrid":
        anchors = np.asarray(anchors, dtype=np.float64)
        if anchors.ndim != 4 or anchors.shape[3] != 7:
            raise ValueError(f"anchors must be (H, W, anchor_num, 7), got {anchors.shape}")
        rows, cols, num = anchors.shape[:3]
        boxes = _as_boxes32(anchor_standup_boxes(anchors))
        cells = boxes.reshape(rows, cols, num, 4)
        return cls((rows, cols, num), boxes, _line_bounds(cells[..., 0], cells[..., 2], axis=0),
                   _line_bounds(cells[..., 1], cells[..., 3], axis=1))

    def candidate_pairs(self, query32: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(anchor, query) pairs, in np.nonzero's row-major order, that include every pair of positive iw and ih.

        Why a superset: a pair (anchor i = (h, w, a), query j) has a positive iw exactly when
        fl(min(x2_i, x2_j) - max(x1_i, x1_j)) > -1 (fl: float32 rounding; see ``standup_iou_pairs``), and a
        positive ih likewise in y. Column (a, w)'s
        bounds satisfy X1 <= x1_i and X2 >= x2_i, so min(X2, x2_j) >= min(x2_i, x2_j) and
        max(X1, x1_j) <= max(x1_i, x1_j); float subtraction is monotone (a >= a', b <= b' gives
        fl(a - b) >= fl(a' - b'), rounding to nearest being monotone), so column (a, w) passes the same test, and
        row (a, h) the y test. Infinities keep this: a bound's difference that is NaN (inf - inf) forces the pair's
        own difference to be -inf or NaN, not above -1. Each (query, yaw) pairs with the anchors of that yaw in
        its passing rows x passing columns, each listed once.
        """
        _, cols, num = self.shape
        count = len(query32)
        cells, yaw_query = _grid_products(_reaches(self.row_y, query32[:, [1, 3]]),
                                          _reaches(self.column_x, query32[:, [0, 2]]), cols)
        yaw, query = np.divmod(yaw_query, max(count, 1))
        # The key anchor * M + query sorts into row-major order; the pairs are distinct, so any sort will do.
        key = np.sort((cells * num + yaw) * count + query)
        return np.divmod(key, max(count, 1))

    def iou_pairs(self, query_boxes: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``standup_iou_pairs(self.boxes, query_boxes)``, bit for bit and in the same order, from each query
        box's neighbourhood on the grid rather than from every anchor."""
        query32 = _as_boxes32(query_boxes)
        rows, cols = self.candidate_pairs(query32)
        return _kept_pairs(self.boxes, query32, rows, cols)


# The dtype the training labels cross to the trainer in: the loss reads pos_equal_one and neg_equal_one only through
# ``> 0`` and casts targets to float32 for float32 and half models, so float32 labels give it bit-identical inputs
# (numpy's float64 -> float32 rounding is torch's) at half the bytes of upstream's float64.
LABEL_DTYPE = np.float32


@dataclass(frozen=True)
class Assignment:
    """One frame's targets as indices: what ``assign_targets`` spreads over the (H, W, A) anchors."""

    shape: Tuple[int, int, int]
    positive: np.ndarray    # (P,) int64 anchor indices (flat, (H, W, A) order), ascending
    residuals: np.ndarray   # (P, 7) float64: each positive's box code against its GT (box_coder.encode)
    negative: np.ndarray    # (H*W*A,) bool


def assign(gt_boxes: np.ndarray, anchors: np.ndarray, pos_threshold: float, neg_threshold: float,
           anchor_standup: Optional[StandupGrid] = None) -> Assignment:
    """Upstream's rules on one frame: ``gt_boxes`` (M, 7) valid 'hwl' boxes, ``anchors`` (H, W, A, 7) 'hwl'.

    ``anchor_standup`` may pass ``StandupGrid.of(anchors)`` made once (the anchors never change). Works on the
    non-zero IoU entries only, with the results of upstream's dense rules; ``pos_threshold`` must not be negative
    (a negative one would make every zero-IoU pair positive).
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
        anchor_standup = StandupGrid.of(anchors)
    if anchor_standup.shape != (rows, cols, num):
        raise ValueError(f"anchor_standup is of a {anchor_standup.shape} grid, the anchors {(rows, cols, num)}")
    pair_anchor, pair_gt, iou = anchor_standup.iou_pairs(standup_boxes(boxes_to_corners(gt_boxes)))
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
    return Assignment((rows, cols, num), pos_anchor.astype(np.int64), encode(gt_boxes[pos_gt], flat[pos_anchor]),
                      negative)


def dense_labels(assignment: Assignment, dtype: np.dtype = np.float64) -> Dict[str, np.ndarray]:
    """Upstream's label arrays of an assignment: ``pos_equal_one``, ``neg_equal_one`` (H, W, A) and ``targets``
    (H, W, 7A), in ``dtype`` (the residuals rounded once from float64)."""
    rows, cols, num = assignment.shape
    count = rows * cols * num
    pos_equal_one = np.zeros(count, dtype=dtype)
    pos_equal_one[assignment.positive] = 1
    targets = np.zeros((count, 7), dtype=dtype)
    targets[assignment.positive] = assignment.residuals
    return {"pos_equal_one": pos_equal_one.reshape(rows, cols, num),
            "neg_equal_one": assignment.negative.astype(dtype).reshape(rows, cols, num),
            # (H*W*A, 7) row-major is (H, W, 7A) with anchor a's residuals in channels 7a..7a+6.
            "targets": targets.reshape(rows, cols, num * 7)}


def assign_targets(gt_boxes: np.ndarray, anchors: np.ndarray, pos_threshold: float, neg_threshold: float,
                   anchor_standup: Optional[StandupGrid] = None, dtype: np.dtype = np.float64) -> Dict[str, np.ndarray]:
    """Labels of one frame (``assign``) as upstream's arrays (``dense_labels``): float64 by default, the dtype of
    upstream's labels; the post-processor asks for float32, the loss's."""
    return dense_labels(assign(gt_boxes, anchors, pos_threshold, neg_threshold, anchor_standup), dtype)


__all__ = ["LABEL_DTYPE", "standup_boxes", "standup_iou", "standup_iou_pairs", "anchor_standup_boxes", "StandupGrid", "Assignment",
           "assign", "dense_labels", "assign_targets"]
