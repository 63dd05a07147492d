"""The VoxelPostprocessor family against hand-computed cases and brute-force references.

Anchors, box coding, upstream's standup IoU (with its +1 term) and label rules, the torch box helpers,
rotated NMS (against a pure-Python shapely greedy), post_process on synthetic head outputs (early and late
fusion) and generate_gt_bbx.
"""
import math
import pickle

import numpy as np
import pytest
import torch
from shapely.geometry import Polygon

from launch import REPO
from zoo import hypes_of
from opencood_ddp.data import geometry as geo
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.ground_truth import GT_RANGE, upstream_unique_indices
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import load_hypes
from opencood_ddp.postprocess import (NMS_TOP_K, VoxelPostprocessor, bev_iou_matrix, boxes_to_corners,
                                      create_postprocessor, delta_to_boxes3d, encode, nms_rotated, normal_size_mask,
                                      normal_z_mask, project_corners, standup_boxes, standup_iou, within_range_mask)

TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
ROWS, COLS, NUM = 60, 120, 2
LOGIT_OFF = -10.0


@pytest.fixture(scope="module")
def post():
    return create_postprocessor(hypes_of(TOY), train=False)


@pytest.fixture(scope="module")
def anchors(post):
    return post.generate_anchor_box()


def labels_for(post, anchors, boxes):
    center, mask = np.zeros((100, 7)), np.zeros(100)
    boxes = np.reshape(np.asarray(boxes, dtype=np.float64), (-1, 7))
    center[:len(boxes)], mask[:len(boxes)] = boxes, 1
    return post.generate_label(gt_box_center=center, anchors=anchors, mask=mask)


def flat_index(row, col, a):
    return (row * COLS + col) * NUM + a


# ------------------------------------------------------------------------------------------- anchors


def test_anchor_grid_of_the_toy_hypes(anchors):
    assert anchors.shape == (ROWS, COLS, NUM, 7) and anchors.dtype == np.float64
    # Range [-48, -24, 48, 24], voxel 0.4, stride 2: centres from min + 0.4 to max - 0.4, 0.8 m apart.
    np.testing.assert_allclose(anchors[0, 0, 0, :3], [-47.6, -23.6, -1.0])
    np.testing.assert_allclose(anchors[-1, -1, 1, :3], [47.6, 23.6, -1.0])
    np.testing.assert_allclose(anchors[0, 1, 0, 0] - anchors[0, 0, 0, 0], 0.8)
    np.testing.assert_allclose(anchors[1, 0, 0, 1] - anchors[0, 0, 0, 1], 0.8)
    assert np.all(anchors[:, 0, :, 0] == anchors[0, 0, 0, 0])  # rows walk y, columns walk x
    np.testing.assert_array_equal(anchors[..., 3:6], np.broadcast_to([1.56, 1.6, 3.9], (ROWS, COLS, NUM, 3)))
    assert np.all(anchors[..., 0, 6] == 0.0) and np.all(anchors[..., 1, 6] == math.pi / 2)


def test_anchor_feature_stride_and_yaws():
    post = create_postprocessor(hypes_of(TOY, "postprocess.anchor_args.feature_stride=4",
                                          "postprocess.anchor_args.r=[0, 45, 90]",
                                          "postprocess.anchor_args.num=3"), train=True)
    anchors = post.generate_anchor_box()
    assert anchors.shape == (30, 60, 3, 7)
    np.testing.assert_allclose(anchors[0, 0, :, 6], np.radians([0, 45, 90]))
    np.testing.assert_allclose(anchors[0, 1, 0, 0] - anchors[0, 0, 0, 0], 95.2 / 59)


# ---------------------------------------------------------------------------------------- box coding


def test_encode_matches_the_formulas():
    anchor = np.array([[1.0, 2.0, -1.0, 1.56, 1.6, 3.9, 0.0]])
    box = np.array([[2.0, 1.5, -0.5, 1.7, 2.0, 4.5, 0.3]])
    d = math.sqrt(1.6 ** 2 + 3.9 ** 2)
    expected = [1.0 / d, -0.5 / d, 0.5 / 1.56, math.log(1.7 / 1.56), math.log(2.0 / 1.6), math.log(4.5 / 3.9), 0.3]
    np.testing.assert_allclose(encode(box, anchor)[0], expected, rtol=1e-12)


def test_decode_layout_and_dtype():
    rng = np.random.default_rng(0)
    anchors = torch.from_numpy(rng.uniform(1, 3, (3, 4, 2, 7)))
    deltas = torch.from_numpy(rng.normal(size=(2, 14, 3, 4))).half()
    boxes = delta_to_boxes3d(deltas, anchors)
    assert boxes.shape == (2, 3 * 4 * 2, 7) and boxes.dtype == torch.float32
    # Box (b, h, w, a) is anchor (h, w, a) moved by channels 7a..7a+6 at pixel (h, w).
    b, h, w, a = 1, 2, 3, 1
    delta = deltas[b, 7 * a:7 * a + 7, h, w].float()
    anchor = anchors[h, w, a].float()
    expected = torch.cat([delta[:2] * torch.sqrt(anchor[4] ** 2 + anchor[5] ** 2) + anchor[:2],
                          delta[2:3] * anchor[3:4] + anchor[2:3], torch.exp(delta[3:6]) * anchor[3:6],
                          delta[6:] + anchor[6:]])
    torch.testing.assert_close(boxes[b, (h * 4 + w) * 2 + a], expected)
    with pytest.raises(ValueError, match="anchors"):
        delta_to_boxes3d(torch.zeros(1, 14, 3, 5), anchors)


def test_encode_decode_round_trip_through_the_labels(post, anchors):
    rng = np.random.default_rng(1)
    n = 12
    boxes = np.column_stack([rng.uniform(-20, 20, n), rng.uniform(-15, 15, n), rng.uniform(-1.5, -0.5, n),
                             rng.uniform(1.3, 2.0, n), rng.uniform(1.5, 2.2, n), rng.uniform(3.5, 5.0, n),
                             rng.uniform(-math.pi, math.pi, n)])
    label = labels_for(post, anchors, boxes)
    positive = np.flatnonzero(label["pos_equal_one"].reshape(-1))
    assert len(positive) >= n  # at least every GT's best anchor
    regression = torch.from_numpy(label["targets"]).permute(2, 0, 1)[None]  # (1, 7A, H, W), as the head's map
    decoded = delta_to_boxes3d(regression, torch.from_numpy(anchors))[0].double().numpy()[positive]
    # Every positive anchor decodes to one of the GT boxes, and every GT is recovered.
    distance = np.abs(decoded[:, None, :] - boxes[None, :, :]).max(axis=2)
    assert np.all(distance.min(axis=1) < 1e-5)
    assert set(distance.argmin(axis=1)) == set(range(n))


# ------------------------------------------------------------------------------------------- targets


def c_style_standup_iou(box, query):
    """Upstream's Cython bbox_overlaps for one pair, with C's float32 / double mixing spelled out."""
    f32 = np.float32
    b, q = [f32(v) for v in box], [f32(v) for v in query]
    iw = f32(float(min(b[2], q[2]) - max(b[0], q[0])) + 1.0)
    if not iw > 0:
        return f32(0)
    ih = f32(float(min(b[3], q[3]) - max(b[1], q[1])) + 1.0)
    if not ih > 0:
        return f32(0)
    query_area = f32((float(q[2] - q[0]) + 1.0) * (float(q[3] - q[1]) + 1.0))
    union = f32((float(b[2] - b[0]) + 1.0) * (float(b[3] - b[1]) + 1.0) + float(query_area) - float(iw * ih))
    return f32(iw * ih) / union


def test_standup_iou_hand_values_and_brute_force():
    # The +1 convention: a unit box has "area" 4 and boxes touching at an edge overlap.
    iou = standup_iou(np.array([[0, 0, 1, 1], [1, 1, 2, 2], [3, 3, 4, 4]]), np.array([[0, 0, 1, 1]]))
    assert iou.dtype == np.float32
    np.testing.assert_allclose(iou[:, 0], [1.0, 1 / 7, 0.0], rtol=1e-6)
    rng = np.random.default_rng(2)
    lo = rng.uniform(-6, 6, (40, 2))
    boxes = np.concatenate([lo, lo + rng.uniform(0.1, 5, (40, 2))], axis=1)
    lo_q = rng.uniform(-6, 6, (15, 2))
    query = np.concatenate([lo_q, lo_q + rng.uniform(0.1, 5, (15, 2))], axis=1)
    expected = np.array([[c_style_standup_iou(b, q) for q in query] for b in boxes], dtype=np.float32)
    result = standup_iou(boxes, query)
    assert np.count_nonzero(expected) > 50
    np.testing.assert_array_equal(result, expected)


def test_gt_on_an_anchor_and_its_neighbours(post, anchors):
    row, col = 10, 20
    gt = anchors[row, col, 0].copy()  # exactly the yaw-0 anchor: IoU 1
    label = labels_for(post, anchors, [gt])
    pos, neg, targets = label["pos_equal_one"], label["neg_equal_one"], label["targets"]
    # Standup IoU with the +1 term, anchors 0.8 m apart: footprints 3.9 x 1.6 -> "areas" 4.9 x 2.6.
    area = 4.9 * 2.6
    x_shift_1 = 4.1 * 2.6 / (2 * area - 4.1 * 2.6)  # 0.72 > 0.6: positive
    x_shift_2 = 3.3 * 2.6 / (2 * area - 3.3 * 2.6)  # 0.51: neither
    x_shift_3 = 2.5 * 2.6 / (2 * area - 2.5 * 2.6)  # 0.34 < 0.45: negative
    y_shift_1 = 4.9 * 1.8 / (2 * area - 4.9 * 1.8)  # 0.53: neither
    rotated = 2.6 * 2.6 / (2 * area - 2.6 * 2.6)  # the yaw-90 anchor of the same cell: 0.36, negative
    assert x_shift_1 > 0.6 and 0.45 < x_shift_2 < 0.6 and x_shift_3 < 0.45 and 0.45 < y_shift_1 < 0.6
    assert rotated < 0.45
    assert pos.sum() == 3
    for c in (col - 1, col, col + 1):
        assert pos[row, c, 0] == 1 and neg[row, c, 0] == 0
    for r, c in ((row, col + 2), (row, col - 2), (row + 1, col), (row - 1, col)):
        assert pos[r, c, 0] == 0 and neg[r, c, 0] == 0
    for r, c, a in ((row, col + 3, 0), (row + 2, col, 0), (row, col, 1)):
        assert pos[r, c, a] == 0 and neg[r, c, a] == 1
    assert neg.sum() == ROWS * COLS * NUM - 3 - 4  # every other anchor (diagonal neighbours: 0.41) is negative
    np.testing.assert_array_equal(targets[row, col], np.zeros(14))
    d = math.hypot(1.6, 3.9)
    np.testing.assert_allclose(targets[row, col + 1, :7], [-0.8 / d, 0, 0, 0, 0, 0, 0], rtol=0, atol=3e-8)
    # float32, the dtype the loss reads (upstream's labels are float64: the values rounded once)
    assert all(label[key].dtype == np.float32 for key in ("pos_equal_one", "neg_equal_one", "targets"))
    assert targets.shape == (ROWS, COLS, 14)


def test_best_anchor_rule_for_a_small_gt(post, anchors):
    gt = np.array([0.3, 0.2, -1.0, 1.0, 0.5, 0.5, 0.0])  # far smaller than the anchors: IoU < 0.6 everywhere
    label = labels_for(post, anchors, [gt])
    flat = anchors.reshape(-1, 7)
    iou = standup_iou(standup_boxes(geo.boxes_to_corners(flat)), standup_boxes(geo.boxes_to_corners(gt[None])))
    assert 0 < iou.max() < 0.6
    best = int(np.argmax(iou[:, 0]))  # the first of the tied anchors that contain it
    pos = label["pos_equal_one"].reshape(-1)
    neg = label["neg_equal_one"].reshape(-1)
    assert np.flatnonzero(pos).tolist() == [best]
    assert neg[best] == 0  # a best anchor is never negative, though its IoU is below neg_threshold
    expected_neg = (iou[:, 0] < 0.45)
    expected_neg[best] = False
    np.testing.assert_array_equal(neg, expected_neg.astype(float))
    np.testing.assert_array_equal(label["targets"].reshape(-1, 7)[best],
                                  encode(gt[None], flat[best:best + 1])[0].astype(np.float32))


def dense_rules(gt, anchors, pos_threshold, neg_threshold):
    """Upstream's label rules stated on the dense (anchors, GT) IoU matrix, in upstream's float64."""
    flat = anchors.reshape(-1, 7)
    iou = standup_iou(standup_boxes(geo.boxes_to_corners(flat)), standup_boxes(geo.boxes_to_corners(gt)))
    best = np.argmax(iou, axis=0)
    has_overlap = iou[best, np.arange(len(gt))] > 0
    best, best_gt = best[has_overlap], np.arange(len(gt))[has_overlap]
    above_anchor, above_gt = np.where(iou > pos_threshold)
    listed = np.concatenate([above_anchor, best])
    listed_gt = np.concatenate([above_gt, best_gt])
    pos_anchor, first = np.unique(listed, return_index=True)
    pos, neg, targets = np.zeros(len(flat)), np.zeros(len(flat)), np.zeros((len(flat), 7))
    pos[pos_anchor] = 1
    neg[np.all(iou < neg_threshold, axis=1)] = 1
    neg[best] = 0
    targets[pos_anchor] = encode(gt[listed_gt[first]], flat[pos_anchor])
    return pos, neg, targets


@pytest.mark.parametrize("pos_threshold,neg_threshold", [(0.6, 0.45), (0.3, 0.3), (0.5, 0.0)])
def test_labels_equal_the_dense_rules_on_crowded_frames(anchors, pos_threshold, neg_threshold):
    rng = np.random.default_rng(5)
    gt = random_boxes(rng, 40, 8.0)
    gt[:, 3:6] *= rng.uniform(0.2, 1.5, (40, 1))  # small and large boxes
    gt = np.concatenate([gt, gt[:3], [[300.0, 0, -1, 1.5, 1.6, 3.9, 0]]])  # duplicates: ties; one unreachable
    post = create_postprocessor(hypes_of(TOY, f"postprocess.target_args.pos_threshold={pos_threshold}",
                                          f"postprocess.target_args.neg_threshold={neg_threshold}"), train=True)
    label = labels_for(post, anchors, gt)
    pos, neg, targets = dense_rules(gt, anchors, pos_threshold, neg_threshold)
    assert pos.sum() > 40
    np.testing.assert_array_equal(label["pos_equal_one"].reshape(-1), pos)
    np.testing.assert_array_equal(label["neg_equal_one"].reshape(-1), neg)
    # upstream's float64 residuals rounded once to the labels' float32
    assert label["targets"].dtype == np.float32
    np.testing.assert_array_equal(label["targets"].reshape(-1, 7), targets.astype(np.float32))


def test_no_gt_and_unreachable_gt(post, anchors):
    for boxes in ([], [[500.0, 0, -1, 1.5, 1.6, 3.9, 0]]):  # none, and one that overlaps no anchor
        label = labels_for(post, anchors, boxes)
        assert label["pos_equal_one"].sum() == 0
        assert np.all(label["neg_equal_one"] == 1)
        assert not label["targets"].any()


def test_labels_collate_pickle_and_determinism(post, anchors):
    boxes = [[5.0, 3.0, -1.0, 1.5, 1.8, 4.2, 0.4], [-12.0, 8.0, -0.8, 1.6, 1.7, 4.0, 1.2]]
    first = labels_for(post, anchors, boxes)
    clone = pickle.loads(pickle.dumps(post))
    again = labels_for(clone, clone.generate_anchor_box(), boxes)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    batch = post.collate_batch([first, again])
    assert set(batch) == {"targets", "pos_equal_one", "neg_equal_one"}
    assert batch["targets"].shape == (2, ROWS, COLS, 14)
    assert batch["pos_equal_one"].shape == (2, ROWS, COLS, NUM)
    assert all(batch[key].dtype == torch.float32 for key in ("targets", "pos_equal_one", "neg_equal_one"))
    # labels handed in as float64 (upstream's dtype) are collated into the same float32 tensors
    wide = post.collate_batch([{key: value.astype(np.float64) for key, value in first.items()}, again])
    assert all(wide[key].dtype == torch.float32 and torch.equal(wide[key], batch[key]) for key in batch)


# ---------------------------------------------------------------------------------------- box helpers


@pytest.mark.parametrize("order", ["hwl", "lwh"])
def test_torch_corners_equal_numpy_corners(order):
    rng = np.random.default_rng(3)
    boxes = np.column_stack([rng.uniform(-50, 50, (20, 3)), rng.uniform(0.5, 5, (20, 3)),
                             rng.uniform(-4, 4, 20)])
    expected = geo.boxes_to_corners(boxes, order)
    result = boxes_to_corners(torch.from_numpy(boxes), order)
    assert result.dtype == torch.float64
    np.testing.assert_allclose(result.numpy(), expected, rtol=0, atol=1e-12)
    result32 = boxes_to_corners(torch.from_numpy(boxes).float(), order)
    assert result32.dtype == torch.float32
    np.testing.assert_allclose(result32.numpy(), expected, atol=1e-4)


def test_projection_and_keep_masks():
    corners = boxes_to_corners(torch.tensor([[1.0, 2.0, -1.0, 1.5, 1.6, 4.0, 0.3]]))
    yaw90 = torch.tensor([[0.0, -1, 0, 10], [1, 0, 0, 5], [0, 0, 1, 0.5], [0, 0, 0, 1]])
    moved = project_corners(corners, yaw90)
    expected = boxes_to_corners(torch.tensor([[8.0, 6.0, -0.5, 1.5, 1.6, 4.0, 0.3 + math.pi / 2]]))
    torch.testing.assert_close(moved, expected)

    boxes = torch.tensor([[0, 0, -1, 1.56, 1.6, 6.0, 0],  # x extent exactly 6 m: kept
                          [0, 0, -1, 1.56, 1.6, 6.01, 0],  # 6.01 m: dropped
                          [0, 0, -1, 1.56, 2.0, 5.0, math.pi / 4],  # diagonal, extents 4.95 m: kept
                          [0, 0, -1, 0.0, 1.6, 3.9, 0],  # height 0: dropped (upstream's non-zero z extent)
                          [0, 0, 0.5, 1.56, 1.6, 3.9, 0],  # top at 1.28 > 1: abnormal z
                          [0, 0, -2.2, 1.56, 1.6, 3.9, 0]], dtype=torch.float64)  # bottom at -2.98: normal
    corners = boxes_to_corners(boxes)
    assert normal_size_mask(corners).tolist() == [True, False, True, False, True, True]
    assert normal_z_mask(corners).tolist() == [True, True, True, True, False, True]

    rng = (-10.0, -5.0, -3.0, 10.0, 5.0, 1.0)
    inside = boxes_to_corners(torch.tensor([[8.05, 0, -1, 1.5, 1.6, 3.9, 0],  # x max exactly 10: kept
                                            [8.06, 0, -1, 1.5, 1.6, 3.9, 0],
                                            [0, 0, 9.0, 1.5, 1.6, 3.9, 0]], dtype=torch.float64))  # z not tested
    assert within_range_mask(inside, rng).tolist() == [True, False, True]


# ----------------------------------------------------------------------------------------------- NMS


def reference_nms(corners, scores, threshold, top_k=NMS_TOP_K):
    """Pure-Python greedy NMS over all pairs with shapely polygons (upstream's rule, stable tie order)."""
    polygons = [Polygon(c[:4, :2]) for c in corners]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_k]
    kept = []
    while order:
        i, rest = order[0], order[1:]
        kept.append(i)
        order = [j for j in rest if not np.float32(polygons[i].intersection(polygons[j]).area
                                                   / polygons[i].union(polygons[j]).area) > np.float32(threshold)]
    return kept


def random_boxes(rng, n, extent):
    return np.column_stack([rng.uniform(-extent, extent, (n, 2)), rng.uniform(-1.5, -0.5, n),
                            rng.uniform(1.2, 2.0, n), rng.uniform(1.0, 3.0, n), rng.uniform(2.0, 6.0, n),
                            rng.uniform(-math.pi, math.pi, n)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nms_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    corners = geo.boxes_to_corners(random_boxes(rng, 300, 25.0)).astype(np.float32)
    scores = np.round(rng.uniform(0, 1, 300), 1).astype(np.float32)  # many equal scores
    for threshold in (0.15, 0.5):
        kept = nms_rotated(torch.from_numpy(corners), torch.from_numpy(scores), threshold)
        assert kept.dtype == torch.long
        expected = reference_nms(corners.astype(np.float64), scores, threshold)
        assert kept.tolist() == expected
        assert 10 < len(expected) < 300


def test_nms_strict_threshold_ties_and_top_k():
    # Two unit-area boxes sharing half their length: IoU (2/3) / (4/3) = 0.5 exactly.
    boxes = np.array([[0, 0, -1, 1, 1, 2, 0], [2 / 3, 0, -1, 1, 1, 2, 0]], dtype=np.float64)
    corners = torch.from_numpy(geo.boxes_to_corners(boxes))
    equal = torch.tensor([0.5, 0.5])
    assert nms_rotated(corners, equal, 0.5).tolist() == [0, 1]  # IoU 0.5 is not > 0.5
    assert nms_rotated(corners, equal, 0.49).tolist() == [0]  # equal scores: the first index wins
    assert nms_rotated(corners, torch.tensor([0.4, 0.6]), 0.49).tolist() == [1]
    assert nms_rotated(torch.zeros(0, 8, 3), torch.zeros(0), 0.15).tolist() == []
    # Only the top 1000 boxes are candidates, even when nothing overlaps.
    grid = np.stack(np.meshgrid(np.arange(40) * 10.0, np.arange(30) * 10.0), axis=-1).reshape(-1, 2)
    far = np.column_stack([grid, np.full((1200, 1), -1.0), np.tile([1.5, 1.6, 3.9, 0.0], (1200, 1))])
    scores = torch.from_numpy(np.random.default_rng(4).permutation(1200).astype(np.float32))
    kept = nms_rotated(torch.from_numpy(geo.boxes_to_corners(far)), scores, 0.15)
    assert len(kept) == NMS_TOP_K
    assert kept.tolist() == torch.argsort(scores, descending=True)[:NMS_TOP_K].tolist()


# -------------------------------------------------------------------------------------- post_process


class HeadOutput:
    """Synthetic psm / rm maps of one CAV: chosen anchors fire with chosen logits and decode to chosen boxes."""

    def __init__(self, anchors):
        self.anchors = anchors
        self.psm = torch.full((1, NUM, ROWS, COLS), LOGIT_OFF)
        self.rm = torch.zeros((1, 7 * NUM, ROWS, COLS))

    def fire(self, box, logit, at=None):
        """Make an anchor (the nearest yaw-0 one unless ``at`` = (row, col, a)) predict ``box``."""
        box = np.asarray(box, dtype=np.float64)
        if at is None:
            row = int(np.argmin(np.abs(self.anchors[:, 0, 0, 1] - box[1])))
            col = int(np.argmin(np.abs(self.anchors[0, :, 0, 0] - box[0])))
            at = (row, col, 0)
        row, col, a = at
        delta = encode(box[None], self.anchors[row, col, a][None])[0]
        self.psm[0, a, row, col] = logit
        self.rm[0, 7 * a:7 * a + 7, row, col] = torch.from_numpy(delta).float()
        return self

    def output(self):
        return {"psm": self.psm, "rm": self.rm}


def cav_entry(anchors, matrix=None):
    matrix = torch.eye(4) if matrix is None else torch.as_tensor(matrix, dtype=torch.float32)
    return {"anchor_box": torch.from_numpy(anchors), "transformation_matrix": matrix}


def assert_corners(actual, boxes, atol=2e-4):
    np.testing.assert_allclose(actual.numpy(), geo.boxes_to_corners(np.asarray(boxes, dtype=np.float64)),
                               atol=atol)


def test_post_process_decodes_thresholds_filters_and_suppresses(post, anchors):
    a = [5.0, 3.0, -1.0, 1.5, 1.8, 4.2, 0.4]
    b = [-12.0, 8.0, -0.8, 1.6, 1.7, 4.0, 1.2]
    head = HeadOutput(anchors).fire(a, 4.0).fire(b, 2.0)
    head.fire([5.1, 3.05, -1.0, 1.5, 1.8, 4.2, 0.42], 3.0, at=(35, 67, 1))  # a duplicate of a, lower score
    head.fire([20.0, -10.0, -1.0, 1.5, 1.8, 4.2, 0.0], -2.0)  # sigmoid 0.12 < score_threshold 0.2
    head.fire([-30.0, -15.0, -1.0, 1.5, 1.8, 7.0, 0.0], 5.0)  # 7 m long: removed as too large
    head.fire([30.0, 15.0, 1.5, 1.5, 1.8, 4.2, 0.0], 5.0)  # above z = 1: removed as abnormal
    head.fire([47.0, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0], 5.0)  # crosses x = 48 of gt_range: removed
    corners, scores = post.post_process({"ego": cav_entry(anchors)}, {"ego": head.output()})
    assert corners.dtype == torch.float32 and corners.shape == (2, 8, 3)
    torch.testing.assert_close(scores, torch.sigmoid(torch.tensor([4.0, 2.0])))
    assert_corners(corners, [a, b])


def test_post_process_gt_range_default_is_upstreams(anchors):
    hypes = hypes_of(TOY)
    del hypes["postprocess"]["gt_range"]
    post = create_postprocessor(hypes, train=False)
    assert post.gt_range == tuple(GT_RANGE)
    head = HeadOutput(anchors).fire([47.0, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0], 5.0)
    corners, _ = post.post_process({"ego": cav_entry(anchors)}, {"ego": head.output()})
    assert len(corners) == 1  # inside upstream's 280 m x 80 m range


def yaw_transform(yaw, tx, ty):
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0, tx], [s, c, 0, ty], [0, 0, 1, 0], [0, 0, 0, 1]])


def to_frame(box, matrix):
    """An ego-frame box expressed in the frame that ``matrix`` maps into the ego frame (yaw-only matrices)."""
    inverse = np.linalg.inv(matrix)
    xyz = inverse[:3, :3] @ np.asarray(box[:3]) + inverse[:3, 3]
    return [*xyz, *box[3:6], box[6] - math.atan2(matrix[1, 0], matrix[0, 0])]


def test_post_process_late_fusion_merges_cavs_in_the_ego_frame(post, anchors):
    cav_to_ego = yaw_transform(math.pi / 2, 10.0, 5.0)
    shared = [12.0, 4.0, -1.0, 1.5, 1.8, 4.2, 0.3]  # seen by both
    only_cav = [2.0, 14.0, -1.0, 1.6, 1.7, 4.0, -0.7]  # seen by the other CAV only
    ego = HeadOutput(anchors).fire(shared, 3.0)
    other = HeadOutput(anchors).fire(to_frame(shared, cav_to_ego), 2.5).fire(to_frame(only_cav, cav_to_ego), 1.0)
    data = {"ego": cav_entry(anchors), 7: cav_entry(anchors, cav_to_ego)}
    corners, scores = post.post_process(data, {"ego": ego.output(), 7: other.output()})
    assert corners.shape == (2, 8, 3)
    torch.testing.assert_close(scores, torch.sigmoid(torch.tensor([3.0, 1.0])))
    assert_corners(corners, [shared, only_cav])
    # Without fusion the other CAV's view of the shared box survives, in the ego frame.
    corners, scores = post.post_process({7: data[7]}, {7: other.output()})
    assert_corners(corners, [shared, only_cav])


@pytest.mark.cuda
def test_post_process_on_cuda_equals_cpu(post, anchors):
    head = HeadOutput(anchors).fire([5.0, 3.0, -1.0, 1.5, 1.8, 4.2, 0.4], 4.0).fire([-12.0, 8.0, -0.8, 1.6, 1.7, 4.0,
                                                                                     1.2], 2.0)
    on_cpu = post.post_process({"ego": cav_entry(anchors)}, {"ego": head.output()})
    data = {"ego": {key: value.cuda() for key, value in cav_entry(anchors).items()}}
    output = {"ego": {key: value.cuda() for key, value in head.output().items()}}
    on_cuda = post.post_process(data, output)
    assert on_cuda[0].is_cuda and on_cuda[1].is_cuda
    for expected, actual in zip(on_cpu, on_cuda):
        torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=1e-4)


def test_post_process_empty_and_batch_errors(post, anchors):
    head = HeadOutput(anchors)
    corners, scores = post.post_process({"ego": cav_entry(anchors)}, {"ego": head.output()})
    assert corners.shape == (0, 8, 3) and corners.dtype == torch.float32 and scores.shape == (0,)
    batch2 = {"psm": head.psm.repeat(2, 1, 1, 1), "rm": head.rm.repeat(2, 1, 1, 1)}
    with pytest.raises(ValueError, match="batch size 2"):
        post.post_process({"ego": cav_entry(anchors)}, {"ego": batch2})
    with pytest.raises(ValueError, match="no entry for CAV 3"):
        post.post_process({"ego": cav_entry(anchors), 3: cav_entry(anchors)}, {"ego": head.output()})


def gt_entry(boxes, ids, matrix=None, max_num=100):
    center, mask = np.zeros((1, max_num, 7)), np.zeros((1, max_num))
    center[0, :len(boxes)], mask[0, :len(boxes)] = boxes, 1
    entry = cav_entry(np.zeros((1, 1, 1, 7)), matrix)
    entry.update(object_bbx_center=torch.from_numpy(center), object_bbx_mask=torch.from_numpy(mask),
                 object_ids=list(ids))
    return entry


def test_generate_gt_bbx_dedupes_by_id_in_the_ego_frame(post):
    cav_to_ego = yaw_transform(-math.pi / 2, -3.0, 2.0)
    one, two, three = ([1.0, 2.0, -1.0, 1.5, 1.8, 4.2, 0.1], [-8.0, 6.0, -1.0, 1.6, 1.7, 4.0, 1.0],
                       [20.0, -9.0, -0.9, 1.5, 1.9, 4.4, -0.4])
    outside = [46.5, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0]  # crosses x = 48
    two_elsewhere = list(two)
    two_elsewhere[0] += 0.5  # the other CAV's (slightly different) box of object 2 is not kept
    data = {"ego": gt_entry([one, two], [1, 2]),
            5: gt_entry([to_frame(b, cav_to_ego) for b in (two_elsewhere, three, outside)], [2, 3, 4], cav_to_ego)}
    corners = post.generate_gt_bbx(data)
    assert corners.dtype == torch.float32
    assert_corners(corners, [one, two, three], atol=1e-5)


# ------------------------------------------------------------------------------------------- hypes


@pytest.mark.parametrize("override,key", [
    ("postprocess.core_method=Bev", "postprocess.core_method"),
    ("postprocess.anchor_args.num=3", "postprocess.anchor_args.num"),
    ("postprocess.order=lwh", "postprocess.order"),
    ("postprocess.gt_range=[1, 2]", "postprocess.gt_range"),
    ("postprocess.nms_thresh=high", "postprocess.nms_thresh"),
    ("postprocess.target_args.pos_threshold=-0.1", "postprocess.target_args.pos_threshold"),
    # taken before: NMS that keeps one box a frame or none suppressed, a score no sigmoid reaches, anchors labelled
    # positive and negative at once, log(size / anchor size) of a negative anchor (NaN targets the loss dropped)
    ("postprocess.nms_thresh=-0.1", "postprocess.nms_thresh must be an IoU in [0, 1]"),
    ("postprocess.nms_thresh=1.5", "postprocess.nms_thresh must be an IoU in [0, 1]"),
    ("postprocess.target_args.score_threshold=1.5", "postprocess.target_args.score_threshold must be a score"),
    ("postprocess.target_args.pos_threshold=0.3", "postprocess.target_args.pos_threshold (0.3) must not be below"),
    ("postprocess.anchor_args.l=-3.9", "postprocess.anchor_args.l must be a positive number"),
    ("postprocess.anchor_args.feature_stride=1000", "postprocess.anchor_args.feature_stride"),
])
def test_create_postprocessor_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        create_postprocessor(hypes_of(TOY, override), train=True)
    message = str(info.value)
    assert key in message and "point_pillar_intermediate_fusion_toy" in message and "\n" not in message


def test_missing_keys_and_missing_yaml_parser():
    hypes = hypes_of(TOY)
    del hypes["postprocess"]["target_args"]["score_threshold"]
    with pytest.raises(ConfigError, match="missing key postprocess.target_args.score_threshold"):
        create_postprocessor(hypes, train=False)
    raw = load_hypes(TOY)  # the yaml_parser has not written W, H, vw, vh
    with pytest.raises(ConfigError, match="yaml_parser: load_point_pillar_params"):
        create_postprocessor(raw, train=False)
    with pytest.raises(ConfigError, match="postprocess.core_method"):
        create_postprocessor({"name": "x", "postprocess": {}}, train=False)
    # The postprocess section alone (no hypes name) builds, with the toy hypes' values (by hand from the file).
    post = VoxelPostprocessor(hypes_of(TOY)["postprocess"], train=True)
    assert (post.pos_threshold, post.neg_threshold, post.score_threshold, post.nms_thresh, post.anchor_num) == \
        (0.6, 0.45, 0.2, 0.15, 2) and post.train


# ------------------------------------------------------------------------------------------- toy data


@pytest.mark.parametrize("kind", ["early", "intermediate", "late"])
def test_labels_decode_back_to_the_gt_of_a_toy_frame(toy_small, kind):
    """Dataset labels fed back as a perfect head output: post_process returns each GT box once."""
    hypes = hypes_of(f"toy/point_pillar_{kind}_fusion", toy_root=toy_small)
    post = create_postprocessor(hypes, train=False)
    dataset = build_dataset(hypes, "validate", train=False, seed=0, post_processor=post)
    batch = dataset.collate_batch_test([dataset[0]])
    assert (len(batch) > 1) == (kind == "late")
    ego = batch["ego"]
    gt = post.generate_gt_bbx(batch)
    ego_corners = geo.boxes_to_corners(ego["object_bbx_center"][0][ego["object_bbx_mask"][0] == 1].numpy())
    if kind == "late":
        # Every ego box is there (other CAVs add the objects only they see), each object once.
        distance = np.abs(gt.numpy()[:, None] - ego_corners[None]).max(axis=(2, 3))
        assert np.all(distance.min(axis=0) < 1e-4) and len(gt) >= len(ego_corners) > 0
        assert len(set(sum((list(cav["object_ids"]) for cav in batch.values()), []))) >= len(gt)
    else:
        # Upstream's order: the set order of the id list (not idempotent: int ids can collide in the set).
        order = upstream_unique_indices(list(ego["object_ids"]))
        np.testing.assert_allclose(gt.numpy(), ego_corners[order], atol=1e-4)
    outputs = {}
    for key, cav in batch.items():
        label = cav["label_dict"]
        outputs[key] = {"psm": torch.where(label["pos_equal_one"][0] == 1, 10.0, -10.0).permute(2, 0, 1)[None],
                        "rm": label["targets"][0].permute(2, 0, 1)[None].float()}
    corners, scores = post.post_process(batch, outputs)
    assert corners.shape == gt.shape
    iou = bev_iou_matrix(corners.numpy(), gt.numpy())
    assert np.all(iou.max(axis=0) > 0.9999)
