"""Target assignment from each GT box's neighbourhood on the anchor grid equals the dense comparison, bit for bit.

``targets.StandupGrid`` finds each GT box's candidate anchors from the grid's per-row and per-column bounds, and
the post-processor hands the labels over in float32. The oracle below is the implementation they replaced: the
dense (all anchors x all GT) candidate search and the label rules as they stood, float64 labels. Every check
compares bits (NaN-aware: the arrays' raw bytes), and the pairs' order as well as their values:

- every label the real datasets make on the small toy world: intermediate (AttFuse), early fusion with
  augmentation over several epochs' draws, late fusion (training's random CAV and every CAV at test time), the
  full-size OPV2V grid, the noisy setting (wild_setting with delay and localisation error; HEAL's noise_setting),
  and CoAlign's direction labels (the DAIR-V2X-C config on its toy copy);
- adversarial frames on several grids (yaws, strides, a transposed and an irregular one): boxes at exactly the
  +1 convention's 1 m reach and one float32 step either side, outside the grid, huge, zero-size, at +-pi/2,
  duplicated, NaN; thresholds 0 included;
- the loss: PointPillarLoss (OpenCOOD's and CoAlign's with its direction term) gives bit-identical values and
  gradients on the float32 labels and on the oracle's float64 labels.
"""
from __future__ import annotations

import json
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch

from zoo import hypes_of
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.geometry import boxes_to_corners
from opencood_ddp.loss import create_loss
from opencood_ddp.postprocess import create_postprocessor
from opencood_ddp.postprocess.anchors import AnchorSpec, generate_anchors
from opencood_ddp.postprocess.direction import direction_targets
from opencood_ddp.postprocess.targets import StandupGrid, assign_targets, standup_boxes, standup_iou_pairs
from opencood_ddp.postprocess.voxel_postprocessor import FLOAT_LABELS

SEED = 3
AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-0.785, 0.785]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.95, 1.05]}]
AUGMENT_OVERRIDE = "data_augment=" + json.dumps(AUGMENT)
# V2X-ViT's "Noisy" setting with a one-frame delay (tests/test_wild_setting.py), and HEAL's pose noise.
NOISY = {"async": True, "async_mode": "sim", "async_overhead": 100, "seed": 25, "loc_err": True, "xyz_std": 0.2,
         "ryp_std": 0.2, "data_size": 1.06, "transmission_speed": 27, "backbone_delay": 10}
HEAL_NOISE = {"add_noise": True, "args": {"pos_std": 0.5, "rot_std": 2.0, "pos_mean": 0.1, "rot_mean": 0.5}}
DAIR = "dairv2x/point_pillar_intermediate_fusion"  # CoAlign's direction classifier (dir_args) and its loss


# --------------------------------------------------------------------------- the oracle: the dense search


def oracle_plus_one(extent32):
    return (extent32.astype(np.float64) + 1.0).astype(np.float32)


def oracle_area_plus_one(boxes32):
    width = (boxes32[:, 2] - boxes32[:, 0]).astype(np.float64) + 1.0
    height = (boxes32[:, 3] - boxes32[:, 1]).astype(np.float64) + 1.0
    return width * height


def oracle_iou_pairs(boxes, query_boxes):
    """The dense standup_iou_pairs as it was: every box against every query box."""
    b = np.ascontiguousarray(boxes, dtype=np.float32).reshape(-1, 4)
    q = np.ascontiguousarray(query_boxes, dtype=np.float32).reshape(-1, 4)
    rows, cols = np.nonzero(np.minimum(b[:, None, 2], q[None, :, 2]) - np.maximum(b[:, None, 0], q[None, :, 0]) > -1)
    iw = oracle_plus_one(np.minimum(b[rows, 2], q[cols, 2]) - np.maximum(b[rows, 0], q[cols, 0]))
    ih = oracle_plus_one(np.minimum(b[rows, 3], q[cols, 3]) - np.maximum(b[rows, 1], q[cols, 1]))
    hit = (iw > 0) & (ih > 0)
    rows, cols, iw, ih = rows[hit], cols[hit], iw[hit], ih[hit]
    inter = iw * ih
    query_area = oracle_area_plus_one(q).astype(np.float32)
    union = (oracle_area_plus_one(b)[rows] + query_area[cols].astype(np.float64)
             - inter.astype(np.float64)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        return rows, cols, inter / union


def oracle_best_anchor(rows, cols, values):
    overlapping = values > 0
    rows, cols, values = rows[overlapping], cols[overlapping], values[overlapping]
    order = np.lexsort((rows, -values, cols))
    gts, first = np.unique(cols[order], return_index=True)
    return rows[order][first], gts


def oracle_labels(gt_boxes, anchors, pos_threshold, neg_threshold) -> Dict[str, np.ndarray]:
    """assign_targets as it was: float64 labels from the dense pairs."""
    anchors = np.asarray(anchors, dtype=np.float64)
    gt_boxes = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 7)
    rows, cols, num = anchors.shape[:3]
    flat = anchors.reshape(-1, 7)
    anchor_standup = standup_boxes(boxes_to_corners(flat))
    pair_anchor, pair_gt, iou = oracle_iou_pairs(anchor_standup, standup_boxes(boxes_to_corners(gt_boxes)))
    best_anchor, best_gt = oracle_best_anchor(pair_anchor, pair_gt, iou)
    above = iou > np.float32(pos_threshold)
    pos_anchor, pos_gt = pair_anchor[above], pair_gt[above]
    negative = np.full(len(flat), len(gt_boxes) == 0 or np.float32(0) < np.float32(neg_threshold))
    negative[pair_anchor[iou >= np.float32(neg_threshold)]] = False
    pos_anchor = np.concatenate([pos_anchor, best_anchor])
    pos_gt = np.concatenate([pos_gt, best_gt])
    pos_anchor, first = np.unique(pos_anchor, return_index=True)
    pos_gt = pos_gt[first]
    negative[best_anchor] = False
    pos_equal_one = np.zeros(len(flat))
    pos_equal_one[pos_anchor] = 1
    targets = np.zeros((len(flat), 7))
    with np.errstate(divide="ignore", invalid="ignore"):  # zero-size and NaN boxes: -inf and NaN residuals
        targets[pos_anchor] = oracle_encode(gt_boxes[pos_gt], flat[pos_anchor])
    return {"pos_equal_one": pos_equal_one.reshape(rows, cols, num),
            "neg_equal_one": negative.astype(np.float64).reshape(rows, cols, num),
            "targets": targets.reshape(rows, cols, num * 7)}


def oracle_encode(boxes, anchors):
    diagonal = np.sqrt(anchors[:, 4] ** 2 + anchors[:, 5] ** 2)
    deltas = np.empty_like(boxes)
    deltas[:, 0] = (boxes[:, 0] - anchors[:, 0]) / diagonal
    deltas[:, 1] = (boxes[:, 1] - anchors[:, 1]) / diagonal
    deltas[:, 2] = (boxes[:, 2] - anchors[:, 2]) / anchors[:, 3]
    deltas[:, 3:6] = np.log(boxes[:, 3:6] / anchors[:, 3:6])
    deltas[:, 6] = boxes[:, 6] - anchors[:, 6]
    return deltas


# ------------------------------------------------------------------------------------------- comparisons


def assert_bitwise(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Same dtype, shape and bytes: NaN payloads and the sign of zero included."""
    actual, expected = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual.dtype, expected.dtype)
    width = actual.dtype.itemsize
    differ = (actual.reshape(-1).view(np.uint8).reshape(-1, width)
              != expected.reshape(-1).view(np.uint8).reshape(-1, width))
    assert not differ.any(), f"{what}: {int(differ.any(axis=1).sum())} of {actual.size} entries differ"


def assert_pairs_equal(anchor_boxes: np.ndarray, grid: StandupGrid, query: np.ndarray) -> int:
    """The grid's pairs are the dense pairs: the same rows, columns, IoU bits and order. Returns their count."""
    expected = oracle_iou_pairs(anchor_boxes, query)
    got = grid.iou_pairs(query)
    for name, a, b in zip(("anchors", "gts", "iou"), got, expected):
        assert_bitwise(a, b, name)
    for name, a, b in zip(("anchors", "gts", "iou"), standup_iou_pairs(anchor_boxes, query), expected):
        assert_bitwise(a, b, f"dense {name}")
    return len(expected[0])


def assert_assignment_equal(gt: np.ndarray, anchors: np.ndarray, grid: StandupGrid, pos_threshold: float,
                            neg_threshold: float) -> Dict[str, np.ndarray]:
    """assign_targets in float64 and float32 against the oracle's float64 labels (rounded once for float32)."""
    expected = oracle_labels(gt, anchors, pos_threshold, neg_threshold)
    with np.errstate(divide="ignore", invalid="ignore"):
        wide = assign_targets(gt, anchors, pos_threshold, neg_threshold, grid)
        narrow = assign_targets(gt, anchors, pos_threshold, neg_threshold, grid, dtype=np.float32)
    for key in FLOAT_LABELS:
        assert_bitwise(wide[key], expected[key], f"float64 {key}")
        assert_bitwise(narrow[key], expected[key].astype(np.float32), f"float32 {key}")
    return expected


def assert_label_matches_the_oracle(post, inputs: dict, labels: dict) -> Tuple[int, int]:
    """One generate_label call of a dataset against the oracle on the same inputs: (GT boxes, positives)."""
    gt = np.asarray(inputs["gt_box_center"], dtype=np.float64).reshape(-1, 7)
    valid = gt[np.asarray(inputs["mask"]).reshape(-1) == 1]
    expected = oracle_labels(valid, inputs["anchors"], post.pos_threshold, post.neg_threshold)
    for key in FLOAT_LABELS:
        assert_bitwise(labels[key], expected[key].astype(np.float32), key)
    if post.direction is not None:
        assert_bitwise(labels["dir_targets"], direction_targets(expected["targets"], post.direction), "dir_targets")
    else:
        assert "dir_targets" not in labels
    return len(valid), int(expected["pos_equal_one"].sum())


# ------------------------------------------------------------------------------- the datasets' labels


def recorded_labels(hypes: dict, split: str, train: bool, epochs: Sequence[int]) -> Tuple[object, List[tuple]]:
    """Every (inputs, labels) of generate_label while the split's dataset loads each sample at each epoch, built
    as the task builds it (tasks/opencood.py: the training post-processor)."""
    post = create_postprocessor(hypes, train=True)
    calls: List[tuple] = []
    make = post.generate_label

    def record(**inputs):
        labels = make(**inputs)
        calls.append((inputs, labels))
        return labels

    post.generate_label = record
    dataset = build_dataset(hypes, split, train, SEED, post)
    for epoch in epochs:
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            dataset[index]
    return post, calls


# name -> (hypes from the world, [(split, train, epochs)])
DATASET_CASES = {
    "intermediate": (lambda w: hypes_of("toy/point_pillar_intermediate_fusion", toy_root=w),
                     [("train", True, (0, 1)), ("validate", False, (0,)), ("test", False, (0,))]),
    "early_augmented": (lambda w: hypes_of("toy/point_pillar_early_fusion", AUGMENT_OVERRIDE, toy_root=w),
                        [("train", True, (0, 1, 2, 3))]),
    "late_augmented": (lambda w: hypes_of("toy/point_pillar_late_fusion", AUGMENT_OVERRIDE, toy_root=w),
                       [("train", True, (0, 1, 2)), ("test", False, (0,))]),
    "opv2v_full_size": (lambda w: hypes_of("opv2v/point_pillar_intermediate_fusion", toy_root=w),
                        [("train", True, (0, 1))]),
    "noisy_wild_setting": (lambda w: hypes_of("toy/point_pillar_intermediate_fusion", "fusion.args.augment=true",
                                              toy_root=w, wild_setting=NOISY),
                           [("train", True, (0, 1))]),
    "noisy_heal_early": (lambda w: hypes_of("toy/point_pillar_early_fusion", AUGMENT_OVERRIDE, toy_root=w,
                                            noise_setting=HEAL_NOISE), [("train", True, (0, 1))]),
}


@pytest.mark.parametrize("case", list(DATASET_CASES))
def test_dataset_labels_equal_the_dense_oracle(case, toy_small):
    make_hypes, runs = DATASET_CASES[case]
    hypes = make_hypes(toy_small)
    boxes = positives = 0
    for split, train, epochs in runs:
        post, calls = recorded_labels(hypes, split, train, epochs)
        assert calls, f"{case} {split}: no label was made"
        for inputs, labels in calls:
            gt, pos = assert_label_matches_the_oracle(post, inputs, labels)
            boxes, positives = boxes + gt, positives + pos
    assert boxes > 0 and positives > boxes  # real frames with objects, not a vacuous comparison
    if case == "opv2v_full_size":
        assert calls[0][0]["anchors"].shape == (100, 352, 2, 7)


def test_coalign_direction_labels_equal_the_dense_oracle(toy_dairv2x):
    hypes = hypes_of(DAIR, toy_root=toy_dairv2x, layout="dairv2x")
    assert hypes["postprocess"].get("dir_args") is not None
    positives = 0
    for split, train, epochs in [("train", True, (0,)), ("validate", False, (0,))]:
        post, calls = recorded_labels(hypes, split, train, epochs)
        assert calls and post.direction is not None
        for inputs, labels in calls:
            assert labels["dir_targets"].dtype == np.int64
            positives += assert_label_matches_the_oracle(post, inputs, labels)[1]
    assert positives > 0


# --------------------------------------------------------------------------------- adversarial frames


def spec(lidar_range, yaws, voxel, stride, size=(3.9, 1.6, 1.56)) -> AnchorSpec:
    grid_w = round((lidar_range[3] - lidar_range[0]) / voxel[0])
    grid_h = round((lidar_range[4] - lidar_range[1]) / voxel[1])
    return AnchorSpec(lidar_range=tuple(lidar_range), length=size[0], width=size[1], height=size[2],
                      yaws_deg=tuple(yaws), grid_w=grid_w, grid_h=grid_h, voxel_w=voxel[0], voxel_h=voxel[1],
                      feature_stride=stride)


def irregular_anchors(rng: np.random.Generator) -> np.ndarray:
    """(6, 9, 3, 7) anchors that form no grid: positions, sizes and yaws drawn per anchor, some degenerate."""
    shape = (6, 9, 3)
    anchors = np.stack([rng.uniform(-12, 12, shape), rng.uniform(-8, 8, shape), np.full(shape, -1.0),
                        rng.uniform(0.5, 2, shape), rng.uniform(0, 3, shape), rng.uniform(0, 6, shape),
                        rng.choice([0, math.pi / 2, -math.pi / 2, 0.3, math.pi], shape)], axis=-1)
    anchors[0, 0, 0, 4:6] = 0.0  # a point-sized anchor
    anchors[1, 1, 1, :2] = np.nan  # an anchor that overlaps nothing
    return anchors


def anchor_grids() -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    three_yaws = generate_anchors(spec((-30.2, -17, -3, 29.8, 13, 1), (0, 45, 90), (0.4, 0.4), 4))
    return {
        "toy": generate_anchors(spec((-48, -24, -3, 48, 24, 1), (0, 90), (0.4, 0.4), 2)),
        "three_yaws_stride4": three_yaws,
        "one_yaw_stride1_fine": generate_anchors(spec((-10, -6, -3, 10, 6, 1), (-90,), (0.25, 0.3), 1,
                                                      size=(4.5, 2.0, 1.56))),
        "four_yaws_lwh": generate_anchors(spec((-16, -8, -3, 16, 8, 1), (0, 30, 60, 120), (0.8, 0.8), 2), "lwh"),
        "zero_size_anchors": generate_anchors(spec((-8, -8, -3, 8, 8, 1), (0, 90), (0.4, 0.4), 2, size=(0, 0, 0))),
        "single_cell": generate_anchors(spec((-1, -1, -3, 1, 1, 1), (0, 90), (1.0, 1.0), 2)),
        # rows walk x, columns walk y: every row's and column's bounds span the grid, so every anchor is a candidate
        "transposed": np.ascontiguousarray(three_yaws.transpose(1, 0, 2, 3)),
        "irregular": irregular_anchors(rng),
    }


GRIDS = anchor_grids()


def edge_boxes(rng: np.random.Generator, anchors: np.ndarray, count: int) -> np.ndarray:
    """Boxes of yaw 0 whose standup edge sits about 1 m (the +1 convention's reach) beyond an anchor's, or just
    inside it, on either side and in x or y."""
    flat = anchors.reshape(-1, 7)
    flat = flat[np.isfinite(flat).all(axis=1)]
    picked = flat[rng.integers(0, len(flat), count)]
    footprint = standup_boxes(boxes_to_corners(picked))
    length, width = rng.uniform(0, 5, count), rng.uniform(0, 2.5, count)
    gap = 1.0 + rng.choice([0.0, 1e-7, -1e-7, 2e-6, -2e-6, -0.5, -1.0], count)
    centre_x = (picked[:, 0] + rng.uniform(-0.3, 0.3, count))
    centre_y = (picked[:, 1] + rng.uniform(-0.3, 0.3, count))
    side = rng.integers(0, 4, count)
    centre_x = np.where(side == 0, footprint[:, 2] + gap + length / 2, centre_x)
    centre_x = np.where(side == 1, footprint[:, 0] - gap - length / 2, centre_x)
    centre_y = np.where(side == 2, footprint[:, 3] + gap + width / 2, centre_y)
    centre_y = np.where(side == 3, footprint[:, 1] - gap - width / 2, centre_y)
    return np.column_stack([centre_x, centre_y, np.full(count, -1.0), np.full(count, 1.5), width, length,
                            np.zeros(count)])


def random_frame(rng: np.random.Generator, anchors: np.ndarray) -> np.ndarray:
    """A GT set mixing every awkward kind of box the label rules can meet."""
    finite = anchors[np.isfinite(anchors).all(axis=-1)]
    low, high = finite[:, :2].min(axis=0) - 6, finite[:, :2].max(axis=0) + 6  # inside and outside the grid
    n = int(rng.integers(1, 30))
    boxes = np.column_stack([rng.uniform(low[0], high[0], n), rng.uniform(low[1], high[1], n),
                             rng.uniform(-1.5, -0.5, n), rng.uniform(1.2, 2.0, n), rng.uniform(0.5, 3.0, n),
                             rng.uniform(1.0, 6.0, n), rng.uniform(-math.pi, math.pi, n)])
    boxes[:, 6] = np.where(rng.random(n) < 0.4, rng.choice([math.pi / 2, -math.pi / 2, math.pi, 0.0], n), boxes[:, 6])
    on_anchor = finite[rng.integers(0, len(finite), 6)].copy()
    on_anchor[:, :2] += rng.choice([0.0, 0.4, 1e-6, -0.8], (6, 2))
    special = [[0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0],  # zero-size
               [low[0] + 3, low[1] + 3, -1.0, 1e-9, 1e-9, 1e-9, 0.3],  # tiny
               [0.0, 0.0, -1.0, 2.0, 300.0, 1000.0, 0.7],  # huge: reaches every anchor
               [1e6, -1e6, -1.0, 1.5, 1.6, 3.9, 0.0],  # far outside
               [2.0, 1.0, -1.0, 1.5, 1.6, 3.9, math.pi / 2], [2.0, 1.0, -1.0, 1.5, 1.6, 3.9, -math.pi / 2]]
    some_special = np.reshape(special[:int(rng.integers(0, 7))], (-1, 7))
    frame = np.concatenate([boxes, on_anchor, edge_boxes(rng, anchors, 12), some_special])
    if rng.random() < 0.5:
        frame = np.concatenate([frame, frame[:3]])  # duplicates: every tie of the best-anchor rule
    if rng.random() < 0.2:
        frame = np.concatenate([frame, [[np.nan, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0]]])
    return frame[rng.permutation(len(frame))]


THRESHOLDS = [(0.6, 0.45), (0.3, 0.3), (0.5, 0.0), (0.0, 0.45), (0.0, 0.0), (1.0, 1.0), (0.2, 0.9)]


@pytest.mark.parametrize("grid_name", list(GRIDS))
def test_random_frames_equal_the_dense_oracle(grid_name):
    anchors = GRIDS[grid_name]
    grid = StandupGrid.of(anchors)
    assert grid.shape == anchors.shape[:3]
    rng = np.random.default_rng(sum(map(ord, grid_name)))
    pairs = positives = 0
    for frame_index in range(10):
        gt = random_frame(rng, anchors) if frame_index else np.zeros((0, 7))  # the first frame has no GT
        with np.errstate(invalid="ignore", over="ignore"):
            query = standup_boxes(boxes_to_corners(gt))
        pairs += assert_pairs_equal(grid.boxes, grid, query)
        for pos_threshold, neg_threshold in (THRESHOLDS[frame_index % 7], THRESHOLDS[(3 * frame_index + 1) % 7]):
            labels = assert_assignment_equal(gt, anchors, grid, pos_threshold, neg_threshold)
            positives += int(labels["pos_equal_one"].sum())
    assert pairs > 0 and positives > 0


@pytest.mark.parametrize("grid_name", ["toy", "three_yaws_stride4", "transposed", "irregular"])
def test_query_boxes_at_the_one_metre_reach_equal_the_dense_pairs(grid_name):
    """Standup boxes written directly in float32: an edge exactly 1 m from an anchor's (float32 difference -1:
    not kept), one float32 step either side of it, inverted and degenerate boxes, infinities."""
    grid = StandupGrid.of(GRIDS[grid_name])
    rng = np.random.default_rng(5)
    boxes = grid.boxes[np.isfinite(grid.boxes).all(axis=1)]
    anchor = boxes[rng.integers(0, len(boxes), 150)]
    one = np.float32(1)
    queries = []
    for step in (None, np.inf, -np.inf):  # exactly at the reach, and one float32 step beyond / within it
        def at(value):
            return value if step is None else np.nextafter(value, np.float32(step))
        extent = rng.uniform(0, 4, (len(anchor), 2)).astype(np.float32)
        right = np.column_stack([at(anchor[:, 2] + one), anchor[:, 1], at(anchor[:, 2] + one) + extent[:, 0],
                                 anchor[:, 3]])
        left = np.column_stack([at(anchor[:, 0] - one) - extent[:, 0], anchor[:, 1], at(anchor[:, 0] - one),
                                anchor[:, 3]])
        above = np.column_stack([anchor[:, 0], at(anchor[:, 3] + one), anchor[:, 2],
                                 at(anchor[:, 3] + one) + extent[:, 1]])
        below = np.column_stack([anchor[:, 0], at(anchor[:, 1] - one) - extent[:, 1], anchor[:, 2],
                                 at(anchor[:, 1] - one)])
        queries += [right, left, above, below]
    odd = np.array([[3, 3, -3, -3], [0, 0, 0, 0], [-np.inf, -np.inf, np.inf, np.inf], [np.inf, 0, np.inf, 1],
                    [-np.inf, -1, -np.inf, 1], [np.nan, 0, 1, 1]], dtype=np.float32)  # inverted, point, infinite
    query = np.concatenate(queries + [odd]).astype(np.float32)
    closest = np.inf
    for chunk in np.array_split(rng.permutation(len(query)), 12):  # GT sets of ~150 boxes
        with np.errstate(invalid="ignore"):
            assert assert_pairs_equal(grid.boxes, grid, query[chunk]) > 0
            closest = min(closest, smallest_overlap(grid.boxes, query[chunk]))
    assert closest < 1e-5  # kept pairs one float32 step inside the reach: the boundary was met, not missed


def smallest_overlap(boxes: np.ndarray, query: np.ndarray) -> float:
    """The smallest iw or ih (with its +1) among the pairs the dense test keeps."""
    rows, cols, _ = oracle_iou_pairs(boxes, query)
    b, q = boxes[rows].astype(np.float64), query[cols].astype(np.float64)
    iw = np.minimum(b[:, 2], q[:, 2]) - np.maximum(b[:, 0], q[:, 0]) + 1
    ih = np.minimum(b[:, 3], q[:, 3]) - np.maximum(b[:, 1], q[:, 1]) + 1
    return float(np.nanmin(np.minimum(iw, ih), initial=np.inf))


def test_a_grid_of_other_anchors_is_refused():
    grid = StandupGrid.of(GRIDS["toy"])
    with pytest.raises(ValueError, match="grid"):
        assign_targets(np.zeros((0, 7)), GRIDS["single_cell"], 0.6, 0.45, grid)
    with pytest.raises(ValueError, match="anchors must be"):
        StandupGrid.of(np.zeros((4, 7)))


def test_the_post_processor_builds_the_grid_once_per_anchor_array(toy_small):
    post = create_postprocessor(hypes_of("toy/point_pillar_intermediate_fusion", toy_root=toy_small), train=True)
    anchors = post.generate_anchor_box()
    grid = post.anchor_standup(anchors)
    assert post.anchor_standup(anchors) is grid
    assert post.anchor_standup(anchors.copy()) is not grid


# ----------------------------------------------------------------------------------------------- the loss


def loss_inputs(post, anchors: np.ndarray, batch: int, seed: int):
    """(new labels collated by the post-processor, the oracle's float64 labels as upstream's collate stacks them,
    float32 head outputs)."""
    rng = np.random.default_rng(seed)
    new, old = [], []
    for _ in range(batch):
        gt = random_frame(rng, anchors)
        gt = gt[np.isfinite(gt).all(axis=1) & (gt[:, 3:6] > 0).all(axis=1)]  # boxes a dataset can hand over
        center, mask = np.zeros((100, 7)), np.zeros(100)
        center[:len(gt)], mask[:len(gt)] = gt[:100], 1
        new.append(post.generate_label(gt_box_center=center, anchors=anchors, mask=mask))
        labels = oracle_labels(gt[:100], anchors, post.pos_threshold, post.neg_threshold)
        if post.direction is not None:
            labels["dir_targets"] = direction_targets(labels["targets"], post.direction)
        old.append(labels)
    rows, cols, num = anchors.shape[:3]
    generator = torch.Generator().manual_seed(seed)
    outputs = {"psm": torch.randn(batch, num, rows, cols, generator=generator),
               "rm": torch.randn(batch, 7 * num, rows, cols, generator=generator),
               "dm": torch.randn(batch, 2 * num, rows, cols, generator=generator)}
    wide = {key: torch.from_numpy(np.array([labels[key] for labels in old])) for key in old[0]}
    assert all(wide[key].dtype == torch.float64 for key in FLOAT_LABELS)
    return post.collate_batch(new), wide, outputs


def loss_and_gradients(loss, outputs, labels):
    leaves = {key: value.clone().requires_grad_() for key, value in outputs.items()}
    terms = loss(leaves, labels)
    terms.total.backward()
    return terms, {key: value.grad for key, value in leaves.items() if value.grad is not None}


@pytest.mark.parametrize("config", ["opencood", "coalign_direction"])
def test_the_loss_is_bit_identical_on_float32_labels(config):
    hypes = hypes_of("toy/point_pillar_intermediate_fusion")
    if config == "coalign_direction":  # the DAIR-V2X-C config's loss and dir_args on the toy grid (a quarter of its
        coalign = hypes_of(DAIR)  # anchors): pos_cls_weight, neg_equal_one's negatives, the direction term
        hypes["loss"] = coalign["loss"]
        hypes["model"]["args"]["dir_args"] = coalign["model"]["args"]["dir_args"]
        hypes["postprocess"]["dir_args"] = coalign["postprocess"]["dir_args"]
        assert hypes["loss"]["args"]["pos_cls_weight"] and hypes["loss"]["args"]["dir"]
    post, loss = create_postprocessor(hypes, train=True), create_loss(hypes)
    anchors = post.generate_anchor_box()
    for seed in range(2):
        narrow, wide, outputs = loss_inputs(post, anchors, batch=2, seed=seed)
        assert all(narrow[key].dtype == torch.float32 for key in FLOAT_LABELS)
        assert int(narrow["pos_equal_one"].sum()) > 0
        new_terms, new_grads = loss_and_gradients(loss, outputs, narrow)
        old_terms, old_grads = loss_and_gradients(loss, outputs, wide)
        assert new_terms.total.dtype == torch.float32 and torch.isfinite(new_terms.total)
        assert torch.equal(new_terms.total, old_terms.total)
        assert new_terms.parts.keys() == old_terms.parts.keys()
        assert all(torch.equal(new_terms.parts[key], old_terms.parts[key]) for key in new_terms.parts)
        assert new_grads.keys() == old_grads.keys() and all(torch.equal(new_grads[k], old_grads[k]) for k in new_grads)
