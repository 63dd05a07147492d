"""Per-frame TP/FP and VOC AP with OpenCOOD's conventions, on boxes whose IoUs and APs are worked out by hand."""
import math
import pickle

import numpy as np
import pytest
import torch
import yaml

from opencood_ddp.data.geometry import boxes_to_corners
from opencood_ddp.metrics import (DetectionStats, accumulate, average_precision, eval_summary,
                                  frame_stats, pr_curve, voc_ap)
from opencood_ddp.data.bev_iou import bev_iou_matrix


def corners(*boxes):
    """(K, 8, 3) corners of axis-aligned boxes given as (x, y) or (x, y, l, w); default l 4 (along x), w 2."""
    rows = []
    for box in boxes:
        x, y, length, width = (*box, 4.0, 2.0) if len(box) == 2 else box
        rows.append([x, y, 0.0, 1.5, width, length, 0.0])  # [x, y, z, h, w, l, yaw]
    return boxes_to_corners(np.array(rows, dtype=np.float64).reshape(-1, 7))


FAR = (100.0, 100.0)


def ap_of(frames, iou=0.5, global_sort=False):
    return average_precision(accumulate(frames)[iou], global_sort)[0]


# ------------------------------------------------------------------------------------------- frame statistics
def test_frame_stats_sorted_by_score_and_greedy():
    gt = corners((0, 0), (10, 0))
    pred = corners((10, 0), FAR, (0, 0))
    frame = frame_stats(pred, np.array([0.5, 0.9, 0.7]), gt)
    for thr in (0.3, 0.5, 0.7):
        assert frame[thr] == DetectionStats(tp=(0, 1, 1), fp=(1, 0, 0), scores=(0.9, 0.7, 0.5), gt=2)
    assert frame.iou_thresholds == (0.3, 0.5, 0.7)


def test_frame_with_no_detection_counts_its_gt():
    gt = corners((0, 0), (10, 0), (20, 0))
    for pred, scores in ((None, None), (np.zeros((0, 8, 3)), np.zeros(0)), (torch.zeros(0, 8, 3), torch.zeros(0))):
        frame = frame_stats(pred, scores, gt)
        assert frame[0.5] == DetectionStats(tp=(), fp=(), scores=(), gt=3)


def test_frame_with_no_gt_makes_every_detection_fp():
    frame = frame_stats(corners((0, 0), (5, 0)), np.array([0.2, 0.8]), None)
    assert frame[0.3] == DetectionStats(tp=(0, 0), fp=(1, 1), scores=(0.8, 0.2), gt=0)


def test_torch_and_numpy_inputs_agree_and_frames_pickle():
    gt, pred, scores = corners((0, 0), (3, 1)), corners((0.5, 0), (3, 1.2), FAR), np.array([0.3, 0.6, 0.9])
    from_numpy = frame_stats(pred, scores, gt)
    from_torch = frame_stats(torch.from_numpy(pred).float(), torch.from_numpy(scores).float(),
                             torch.from_numpy(gt).float())
    assert [s.tp for s in from_numpy.by_threshold.values()] == [s.tp for s in from_torch.by_threshold.values()]
    assert pickle.loads(pickle.dumps(from_numpy)) == from_numpy
    assert all(type(v) is float for v in from_numpy[0.5].scores)


def test_iou_exactly_at_threshold_is_tp():
    gt = corners((0, 0, 4.0, 2.0), (20, 0, 5.0, 2.0))
    pred = corners((0, 0, 2.0, 2.0), (20, 0, 3.5, 2.0))   # inside: 4 / 8 = 0.5 and 7 / 10 = 0.7
    iou = bev_iou_matrix(pred, gt)
    assert iou[0, 0] == 0.5 and iou[1, 1] == 0.7
    frame = frame_stats(pred, np.array([0.9, 0.8]), gt)
    assert frame[0.5].tp == (1, 1)
    assert frame[0.7].tp == (0, 1)
    assert frame[0.3].tp == (1, 1)


def test_detection_takes_the_gt_of_highest_iou_not_the_first_above_threshold():
    gt = corners((2.5, 0), (0, 0))        # a listed first, b has the higher IoU with det 1
    pred = corners((1, 0), (-1.5, 0))     # det 1: 0.6 with b, 5/11 with a; det 2: 5/11 with b, 0 with a
    iou = bev_iou_matrix(pred, gt)
    np.testing.assert_allclose(iou, [[5 / 11, 0.6], [0.0, 5 / 11]], rtol=1e-12, atol=1e-12)
    frame = frame_stats(pred, np.array([0.9, 0.8]), gt)
    # det 1 takes b; det 2 overlaps only b, which is taken -> fp (taking a first would have made both tp)
    assert frame[0.3].tp == (1, 0)
    assert frame[0.5].tp == (1, 0)
    assert frame[0.7].tp == (0, 0)


def test_equal_scores_keep_input_order():
    gt = corners((0, 0))
    miss_then_hit = frame_stats(corners(FAR, (0, 0)), np.array([0.5, 0.5]), gt)
    hit_then_miss = frame_stats(corners((0, 0), FAR), np.array([0.5, 0.5]), gt)
    assert miss_then_hit[0.5].tp == (0, 1)
    assert hit_then_miss[0.5].tp == (1, 0)
    # ranks [fp, tp]: precision 0, 1/2 at recall 0, 1 -> AP 1 * 1/2; ranks [tp, fp]: AP 1
    assert ap_of([miss_then_hit]) == 0.5
    assert ap_of([hit_then_miss]) == 1.0


def test_shape_errors():
    with pytest.raises(ValueError, match="scores"):
        frame_stats(corners((0, 0)), np.array([0.5, 0.4]), None)
    with pytest.raises(ValueError, match=r"\(K, 8, 3\)"):
        frame_stats(np.zeros((2, 4, 2)), np.array([0.5, 0.4]), None)


# ------------------------------------------------------------------------------------------- average precision
def test_perfect_detections_give_ap_1():
    frames = [frame_stats(corners((0, 0), (10, 0)), np.array([0.9, 0.4]), corners((10, 0), (0, 0))),
              frame_stats(corners((5, 5)), np.array([0.7]), corners((5, 5)))]
    for thr in (0.3, 0.5, 0.7):
        for global_sort in (False, True):
            ap, mrec, mpre = average_precision(accumulate(frames)[thr], global_sort)
            assert ap == 1.0
    ap, mrec, mpre = average_precision(accumulate(frames)[0.5], False)
    assert mrec == [0.0, 1 / 3, 2 / 3, 1.0, 1.0]
    assert mpre == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_one_fp_ranked_above_the_tps():
    frame = frame_stats(corners(FAR, (0, 0), (10, 0)), np.array([0.9, 0.8, 0.7]), corners((0, 0), (10, 0)))
    # ranks fp, tp, tp: recall 0, 1/2, 1; precision 0, 1/2, 2/3 -> interpolated 2/3 on both recall steps
    ap, mrec, mpre = average_precision(accumulate([frame])[0.5], global_sort=False)
    assert ap == pytest.approx(0.5 * 2 / 3 + 0.5 * 2 / 3, abs=1e-15)
    assert mrec == [0.0, 0.0, 0.5, 1.0, 1.0]
    assert mpre == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2 / 3, 0.0], abs=1e-15)


def test_frames_without_detections_lower_recall():
    frames = [frame_stats(corners((0, 0)), np.array([0.9]), corners((0, 0))),
              frame_stats(None, None, corners((0, 0), (10, 0)))]
    # one tp out of 3 gt: recall 1/3 at precision 1
    assert ap_of(frames) == pytest.approx(1 / 3, abs=1e-15)


def test_no_detection_at_all_gives_ap_0():
    frames = [frame_stats(None, None, corners((0, 0)))]
    assert average_precision(accumulate(frames)[0.5], False) == (0.0, [0.0, 1.0], [0.0, 0.0])


def test_frames_without_gt_add_false_positives():
    frames = [frame_stats(corners((0, 0)), np.array([0.5]), corners((0, 0))),
              frame_stats(corners((0, 0)), np.array([0.9]), None)]
    # frame order: tp then fp -> AP 1; global sort: fp (0.9) then tp (0.5) -> precision 1/2 at recall 1
    assert ap_of(frames, global_sort=False) == 1.0
    assert ap_of(frames, global_sort=True) == 0.5


def test_global_sort_differs_from_frame_order():
    frames = [frame_stats(corners((0, 0)), np.array([0.3]), corners((0, 0))),
              frame_stats(corners(FAR, (0, 0)), np.array([0.9, 0.8]), corners((0, 0)))]
    # frame order: tp(0.3), fp(0.9), tp(0.8): recall 1/2, 1/2, 1; precision 1, 1/2, 2/3
    #   -> 1/2 * 1 + 1/2 * 2/3
    assert ap_of(frames, global_sort=False) == pytest.approx(0.5 * 1.0 + 0.5 * 2 / 3, abs=1e-15)
    # global: fp(0.9), tp(0.8), tp(0.3): recall 0, 1/2, 1; precision 0, 1/2, 2/3 -> 1/2 * 2/3 + 1/2 * 2/3
    assert ap_of(frames, global_sort=True) == pytest.approx(0.5 * 2 / 3 + 0.5 * 2 / 3, abs=1e-15)


def test_global_sort_ties_keep_frame_order():
    fp_frame = frame_stats(corners((0, 0)), np.array([0.5]), None)
    tp_frame = frame_stats(corners((0, 0)), np.array([0.5]), corners((0, 0)))
    assert ap_of([fp_frame, tp_frame], global_sort=True) == 0.5
    assert ap_of([tp_frame, fp_frame], global_sort=True) == 1.0


def test_no_gt_at_all_gives_nan():
    with_detections = [frame_stats(corners((0, 0)), np.array([0.5]), None)]
    nothing = [frame_stats(None, None, None)]
    for frames in (with_detections, nothing, []):
        for global_sort in (False, True):
            ap, mrec, mpre = average_precision(accumulate(frames)[0.7], global_sort)
            assert math.isnan(ap) and mrec == [] and mpre == []


def test_voc_ap_makes_precision_monotone_from_the_right():
    ap, mrec, mpre = voc_ap([0.25, 0.25, 0.5, 0.75], [1.0, 0.5, 2 / 3, 0.75])
    assert mrec == [0.0, 0.25, 0.25, 0.5, 0.75, 1.0]
    assert mpre == [1.0, 1.0, 0.75, 0.75, 0.75, 0.0]
    assert ap == 0.25 * 1.0 + 0.25 * 0.75 + 0.25 * 0.75


def test_accumulate_concatenates_in_the_given_order_and_leaves_frames_alone():
    a = frame_stats(corners((0, 0), FAR), np.array([0.9, 0.1]), corners((0, 0)))
    b = frame_stats(corners((5, 0)), np.array([0.4]), corners((5, 0), (15, 0)))
    before = pickle.dumps((a, b))
    merged = accumulate([a, b])[0.5]
    assert merged == DetectionStats(tp=(1, 0, 1), fp=(0, 1, 0), scores=(0.9, 0.1, 0.4), gt=3)
    assert accumulate([b, a])[0.5].tp == (1, 1, 0)
    average_precision(merged, False)
    assert pickle.dumps((a, b)) == before


def test_pr_curve():
    frames = [frame_stats(corners(FAR, (0, 0), (10, 0)), np.array([0.9, 0.8, 0.7]), corners((0, 0), (10, 0)))]
    curves = pr_curve(frames)
    assert set(curves) == {0.3, 0.5, 0.7}
    curve = curves[0.5]
    np.testing.assert_allclose(curve.precision, [0.0, 0.5, 2 / 3])
    np.testing.assert_allclose(curve.recall, [0.0, 0.5, 1.0])
    np.testing.assert_allclose(curve.scores, [0.9, 0.8, 0.7])
    assert curve.ap == pytest.approx(2 / 3)


# ------------------------------------------------------------------------------------------- eval.yaml
def test_eval_summary_keys_types_and_yaml_round_trip():
    frames = [frame_stats(corners((0, 0), (10.5, 0), FAR), np.array([0.9, 0.8, 0.7]), corners((0, 0), (10, 0))),
              frame_stats(None, None, corners((3, 3))),
              frame_stats(corners((0, 0)), np.array([0.95]), None)]
    summary = eval_summary(frames, global_sort=False)
    assert list(summary) == ["ap30", "ap_50", "ap_70", "mpre_50", "mrec_50", "mpre_70", "mrec_70"]
    for key in ("ap30", "ap_50", "ap_70"):
        assert type(summary[key]) is float
    for key in ("mpre_50", "mrec_50", "mpre_70", "mrec_70"):
        assert isinstance(summary[key], list) and all(type(v) is float for v in summary[key])
    # det at x=10.5 has IoU 7/9 with its gt: tp at 0.5 and 0.7 -> ranks tp, tp, fp over 3 gt in frame order
    assert summary["ap_50"] == pytest.approx(2 / 3, abs=1e-15)
    assert yaml.safe_load(yaml.safe_dump(summary)) == summary
    assert eval_summary(frames, global_sort=False) == summary
    # globally the 0.95 fp ranks first: precision 1/2, 2/3 at recall 1/3, 2/3 -> interpolated 2/3 on both
    assert eval_summary(frames, global_sort=True)["ap_50"] == pytest.approx(1 / 3 * 2 / 3 + 1 / 3 * 2 / 3)


def test_eval_summary_needs_the_three_thresholds():
    frames = [frame_stats(corners((0, 0)), np.array([0.5]), corners((0, 0)), iou_thresholds=(0.5,))]
    with pytest.raises(ValueError, match="0.3"):
        eval_summary(frames)
