"""--eval_preset opencood|heal|v2v4real: each preset's range rules, V2V4Real's distance bands, the AP ranking and
the eval.yaml keys, on hand-made boxes whose numbers are derived by hand in the comments; then one toy run
evaluated with every preset on 1 process and on 2 ranks (the same eval files).

Boxes are [x, y, z, h, w, l, yaw] ('hwl'); with yaw 0 a box spans x +- l/2, y +- w/2, z +- h/2.
"""
from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launch import REPO, WORKERS, explain, in_process, one_line_error, split_set_flags, torchrun, train
from zoo import hypes_of
from opencood_ddp.data import geometry as geo
from opencood_ddp.data.ground_truth import evaluation_gt_range
from opencood_ddp.engine.evaluator import EvalResult
from opencood_ddp.engine.options import EvalOptions, parse_eval_options
from opencood_ddp.errors import ConfigError
from opencood_ddp.metrics import frame_stats
from opencood_ddp.metrics.communication import MeteredFrameStats
from opencood_ddp.metrics.conventions import band_stats, centroid_distances, corners_inside_range, in_band
from opencood_ddp.postprocess import create_postprocessor, within_range_mask
from opencood_ddp.tasks import sweep
from opencood_ddp.tasks.eval_presets import PRESETS, EvalConvention, eval_convention, preset_global_sort
from opencood_ddp.tasks.opencood import DetectionEvalOptions, Report, eval_file_name

TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
INFERENCE = REPO / "tools" / "inference_ddp.py"
UPSTREAM_KEYS = ["ap30", "ap_50", "ap_70", "mpre_50", "mrec_50", "mpre_70", "mrec_70"]


def convention(preset: str, global_sort: bool = False) -> EvalConvention:
    """The preset for the toy hypes: cav_lidar_range and gt_range [-48, -24, -3, 48, 24, 1]."""
    return eval_convention(preset, global_sort, hypes_of(TOY), "toy")


def corners(*boxes) -> np.ndarray:
    return geo.boxes_to_corners(np.array(boxes, dtype=np.float64).reshape(-1, 7))


def car(x: float, y: float = 0.0, z: float = -1.0, length: float = 4.0, width: float = 2.0) -> list:
    return [x, y, z, 1.5, width, length, 0.0]


# --------------------------------------------------------------------------------------------- ranges
def test_each_preset_resolves_its_range_and_ranking():
    assert convention("opencood") == EvalConvention("opencood", False, (-48.0, -24.0, -3.0, 48.0, 24.0, 1.0))
    assert convention("opencood", global_sort=True).global_sort  # the explicit override
    # HEAL: x +-102.4, y +-51.2 (--range 102.4,51.2), z of cav_lidar_range; global sort; detections tested on z.
    assert convention("heal") == EvalConvention("heal", True, (-102.4, -51.2, -3.0, 102.4, 51.2, 1.0), True)
    assert convention("heal", global_sort=True) == convention("heal")  # what it does anyway
    v2v4real = convention("v2v4real")
    assert (v2v4real.global_sort, v2v4real.eval_range) == (False, (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0))
    assert v2v4real.bands == ((0.0, 30.0), (30.0, 50.0), (50.0, 100.0)) and not v2v4real.pred_range_z


def test_the_preset_range_reaches_the_datasets_and_the_post_processor_and_opencood_changes_nothing():
    hypes = hypes_of(TOY)
    assert convention("opencood").eval_hypes(hypes) is hypes
    for preset in ("heal", "v2v4real"):
        evaluated = convention(preset).eval_hypes(hypes)
        # evaluation_gt_range is what the datasets project test-time GT with and the post-processor filters by.
        assert evaluation_gt_range(evaluated, "toy") == convention(preset).eval_range
        assert create_postprocessor(evaluated, train=False).gt_range == convention(preset).eval_range
    assert hypes["postprocess"]["gt_range"] == [-48, -24, -3, 48, 24, 1]  # the run's hypes untouched


def test_range_tests_on_hand_made_boxes():
    far_x = car(100.5, length=2.0)  # x 99.5..101.5, y -1..1, z -1.75..-0.25
    high = car(0.0, y=50.0, z=1.5, width=1.6)  # y 49.2..50.8, z 0.75..2.25 (above HEAL's z max 1)
    edge = car(100.4)  # x 98.4..102.4: on HEAL's face, which counts as inside
    boxes = corners(far_x, high, edge)
    heal, v2v4real = convention("heal").eval_range, convention("v2v4real").eval_range
    assert corners_inside_range(boxes, heal, with_z=False).tolist() == [True, True, True]
    assert corners_inside_range(boxes, heal, with_z=True).tolist() == [True, False, True]
    assert corners_inside_range(boxes, v2v4real, with_z=False).tolist() == [False, False, False]
    # The post-processor's test (GT and detections, x and y only) agrees with the numpy one.
    tensor = torch.from_numpy(boxes).float()
    assert within_range_mask(tensor, heal).tolist() == [True, True, True]
    assert within_range_mask(tensor, v2v4real).tolist() == [False, False, False]


def gt_entry(boxes: list, ids: list) -> dict:
    center, mask = np.zeros((1, 10, 7)), np.zeros((1, 10))
    center[0, :len(boxes)], mask[0, :len(boxes)] = boxes, 1
    return {"object_bbx_center": torch.from_numpy(center), "object_bbx_mask": torch.from_numpy(mask),
            "object_ids": ids, "transformation_matrix": torch.eye(4, dtype=torch.float64)}


def test_gt_rules_x_y_of_all_corners_and_heal_drops_detections_outside_z():
    high = car(0.0, y=50.0, z=1.5, width=1.6)  # z 0.75..2.25: x, y inside HEAL's area, z not
    far_x = car(100.5, length=2.0)  # inside HEAL's x +-102.4, outside V2V4Real's +-100
    mid = car(70.0)  # x 68..72: inside V2V4Real's and HEAL's areas, outside the toy's +-48
    near = car(10.0)
    frame = {"ego": gt_entry([near, high, far_x, mid], [1, 2, 3, 4])}
    kept = {}
    for preset in PRESETS:
        post = create_postprocessor(convention(preset).eval_hypes(hypes_of(TOY)), train=False)
        kept[preset] = len(post.generate_gt_bbx(frame))
    # GT: all 8 corners' x, y inside, z never tested (HEAL keeps `high`); y 50.8 > 40 and > 24 drop it elsewhere.
    assert kept == {"opencood": 1, "heal": 4, "v2v4real": 2}
    # Detections: HEAL also tests z, so the same `high` box as a detection is dropped; other presets keep all.
    boxes, scores = torch.from_numpy(corners(near, high, mid)).float(), torch.tensor([0.9, 0.8, 0.7])
    heal_boxes, heal_scores = convention("heal").predictions(boxes, scores)
    assert heal_scores.tolist() == pytest.approx([0.9, 0.7]) and torch.equal(heal_boxes, boxes[[0, 2]])
    for preset in ("opencood", "v2v4real"):
        same_boxes, same_scores = convention(preset).predictions(boxes, scores)
        assert same_boxes is boxes and same_scores is scores


# --------------------------------------------------------------------------------------------- bands
def test_band_membership_is_strict_and_distance_is_the_polygon_centroids():
    distances = np.array([0.0, 10.0, 30.0, 30.000001, 50.0, 99.9, 100.0])
    assert in_band(distances, (0.0, 30.0)).tolist() == [False, True, False, False, False, False, False]
    assert in_band(distances, (30.0, 50.0)).tolist() == [False, False, False, True, False, False, False]
    assert in_band(distances, (50.0, 100.0)).tolist() == [False, False, False, False, False, True, False]
    # Centroid (3, 4) whatever the yaw: 5 m; (-6, -8): 10 m.
    rotated = corners([3.0, 4.0, -1.0, 1.5, 2.0, 4.0, 0.7], [-6.0, -8.0, 0.0, 1.5, 1.8, 4.5, -2.0])
    assert centroid_distances(rotated) == pytest.approx([5.0, 10.0], abs=1e-12)


def band_frame():
    """GT A (10, 0), B (30.5, 0), C (70, 0); detections a (10, 0) 0.9, b (29.5, 0) 0.8, c (45, 0) 0.7.
    b overlaps B on x 28.5..31.5: IoU 6 / (8 + 8 - 6) = 0.6, so overall b is a TP at 0.3 and 0.5. In the bands
    b (29.5 m) is in 0-30 and B (30.5 m) in 30-50: each band matches alone, so there b is a FP and B a miss."""
    gt = corners(car(10.0), car(30.5), car(70.0))
    pred = corners(car(10.0), car(29.5), car(45.0))
    return pred, np.array([0.9, 0.8, 0.7], dtype=np.float32), gt


def test_each_band_filters_gt_and_detections_independently_and_matches_alone():
    pred, scores, gt = band_frame()
    overall = frame_stats(pred, scores, gt)
    assert (overall[0.5].tp, overall[0.7].tp, overall[0.5].gt) == ((1, 1, 0), (1, 0, 0), 3)
    bands = band_stats(pred, scores, gt, convention("v2v4real").bands)
    assert list(bands) == ["0_30m", "30_50m", "50_100m"]
    assert [(b[0.5].tp, b[0.5].gt) for b in bands.values()] == [((1, 0), 1), ((0,), 1), ((), 1)]
    assert bands["0_30m"][0.7].tp == (1, 0) and bands["0_30m"][0.5].scores == pytest.approx((0.9, 0.8))


def records(preset: str) -> list:
    """Two frames, each detection at 10 m. Frame 1: a detection (score 0.3) of a car that is not there, its
    GT at (-10, 0) missed. Frame 2: a detection (0.9) on its GT at (10, 0).
    Frame order [FP, TP]: precision (0, 1/2), recall (0, 1/2) -> AP = 1/2 x 1/2 = 0.25.
    Global sort [TP, FP]: precision (1, 1/2), recall (1/2, 1/2) -> AP = 1/2 x 1 = 0.5."""
    chosen = convention(preset)
    frames = []
    for pred_x, score, gt_x in ((10.0, 0.3, -10.0), (10.0, 0.9, 10.0)):
        pred, scores, gt = corners(car(pred_x)), np.array([score], dtype=np.float32), corners(car(gt_x))
        frames.append(chosen.with_bands(frame_stats(pred, scores, gt), pred, scores, gt))
    return frames


def test_global_sort_and_frame_order_differ_on_two_frames():
    ap = {preset: convention(preset).metric()(records(preset))["ap_50"] for preset in PRESETS}
    assert ap == {"opencood": 0.25, "heal": 0.5, "v2v4real": 0.25}
    assert convention("opencood", global_sort=True).metric()(records("opencood"))["ap_50"] == 0.5
    bands = convention("v2v4real").metric()(records("v2v4real"))
    # Both frames lie in 0-30 m: the same ranking as overall; nothing in the other bands (no GT: NaN).
    assert bands["ap_50_0_30m"] == bands["ap_70_0_30m"] == 0.25
    assert all(math.isnan(bands[key]) for key in ("ap_50_30_50m", "ap_70_30_50m", "ap_50_50_100m"))


# --------------------------------------------------------------------------------------------- eval.yaml
def test_eval_yaml_keys_put_the_convention_beside_its_numbers():
    band_keys = [f"ap_{iou}_{band}" for band in ("0_30m", "30_50m", "50_100m") for iou in (50, 70)]
    convention_keys = ["eval_preset", "ap_convention", "eval_range", "pred_range_test"]
    expected = {"opencood": convention_keys + UPSTREAM_KEYS, "heal": convention_keys + UPSTREAM_KEYS,
                "v2v4real": convention_keys + ["distance_bands"] + UPSTREAM_KEYS + band_keys}
    for preset in PRESETS:
        summary = convention(preset).metric()(records(preset))
        assert list(summary) == expected[preset], preset
        assert yaml.safe_load(yaml.safe_dump(summary)).keys() == summary.keys()  # plain YAML types
    heal = convention("heal").metric()(records("heal"))
    assert (heal["eval_preset"], heal["ap_convention"], heal["pred_range_test"]) == ("heal", "global sort", "xyz")
    assert heal["eval_range"] == [-102.4, -51.2, -3.0, 102.4, 51.2, 1.0]
    v2v4real = convention("v2v4real").metric()(records("v2v4real"))
    assert v2v4real["distance_bands"] == [[0.0, 30.0], [30.0, 50.0], [50.0, 100.0]]
    assert v2v4real["ap_convention"] == "frame order" and v2v4real["pred_range_test"] == "xy"
    assert {preset: eval_file_name(False, preset) for preset in PRESETS} == {
        "opencood": "eval.yaml", "heal": "eval_heal.yaml", "v2v4real": "eval_v2v4real.yaml"}
    assert eval_file_name(True) == "eval_global_sort.yaml" and eval_file_name(True, "heal") == "eval_heal.yaml"
    # No fusion evaluates a late-fusion run: its files never overwrite the late-fusion ones.
    assert eval_file_name(False, "heal", "nofusion") == "eval_nofusion_heal.yaml"
    assert eval_file_name(False, "opencood", "late") == "eval.yaml"
    assert sweep.sweep_file_stem(True, "opencood", "nofusion") == "noise_sweep_nofusion_global_sort"
    assert sweep.sweep_file_stem(False, "v2v4real", "late") == "noise_sweep_v2v4real"
    assert sweep.sweep_file_stem(False, "heal", "", "heal") == "noise_sweep_heal_noise_heal"  # mode, then preset
    assert sweep.sweep_file_stem(True, "opencood", "", "upstream") == "noise_sweep_upstream_noise_global_sort"


def test_the_report_names_the_convention_and_the_bands():
    summary = convention("v2v4real").metric()(records("v2v4real"))
    text = Report(DetectionEvalOptions("intermediate", eval_preset="v2v4real"), None, convention("v2v4real"))(
        EvalResult(summary=summary, frames=2, seconds=1.0, world_size=1))
    assert text.splitlines()[0] == "eval preset v2v4real: frame order, range [-100, -40, -5, 100, 40, 3] (xy)"
    assert "| 0-30 m | 0.2500 | 0.2500 |" in text and "| 50-100 m | nan | nan |" in text


def test_flags_and_the_one_contradiction():
    parsed = parse_eval_options(["--model_dir", "RUN", "--fusion_method", "late", "--eval_preset", "heal"],
                                DetectionEvalOptions)
    assert parsed.task == DetectionEvalOptions("late", eval_preset="heal")
    assert parse_eval_options(["--model_dir", "RUN", "--fusion_method", "late"],
                              DetectionEvalOptions).task.eval_preset == "opencood"
    assert preset_global_sort("heal", True) and not preset_global_sort("v2v4real", False)
    with pytest.raises(ConfigError) as exc_info:
        convention("v2v4real", global_sort=True)
    one_line_error(exc_info, "--global_sort_detections contradicts --eval_preset v2v4real", "drop one")


def test_records_with_bands_pickle_and_keep_their_communication():
    pred, scores, gt = band_frame()
    metered = MeteredFrameStats.of(frame_stats(pred, scores, gt), communication="sent")
    record = convention("v2v4real").with_bands(metered, torch.from_numpy(pred), torch.from_numpy(scores), gt)
    assert type(record) is MeteredFrameStats and record.communication == "sent" and len(record.bands) == 3
    assert pickle.loads(pickle.dumps(record)) == record


def test_the_sweep_carries_the_preset(tmp_path):
    task = DetectionEvalOptions(fusion_method="intermediate", eval_preset="heal")
    options = sweep.SweepOptions(eval=EvalOptions(model_dir="RUN", task=task), pos_std=(0.0,))
    levels = sweep.sweep_levels(options)
    summary = {"ap30": 0.5, "ap_50": 0.4, "ap_70": 0.1, sweep.DETECTIONS: 1, sweep.SCORE_DIGEST: "x",
               "eval_range": [-102.4, -51.2, -3.0, 102.4, 51.2, 1.0]}
    run = sweep.SweepRun(levels, [EvalResult(summary, 4, 0.5, 1)], Path("RUN/net_epoch1.pth"), "data/test", 25)
    table = sweep.sweep_table(options, run)
    assert (table["eval_preset"], table["ap_convention"]) == ("heal", "global sort")
    assert table["eval_range"] == summary["eval_range"]
    assert [path.name for path in sweep.write_sweep(tmp_path, table)][0] == "noise_sweep_heal.yaml"


# --------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def toy_run(toy_small, tmp_path_factory) -> Path:
    """AttFuse after one epoch with a score threshold low enough that it detects (badly)."""
    run_dir = tmp_path_factory.mktemp("eval_presets") / "attfuse"
    trained = train(0, "--hypes_yaml", TOY, "--model_dir", run_dir, "--num_workers", "0",
                    "--set", "train_params.epoches=1", "--set", "train_params.batch_size=2",
                    "--set", "postprocess.target_args.score_threshold=0.01", *split_set_flags(toy_small))
    assert trained.returncode == 0, explain(trained)
    return run_dir


def read_results(run_dir: Path) -> dict:
    return {preset: yaml.safe_load((run_dir / eval_file_name(False, preset)).read_text()) for preset in PRESETS}


@pytest.mark.slow
def test_every_preset_gives_the_same_eval_files_on_1_process_and_2_ranks(toy_run, toy_small):
    common = ("--model_dir", toy_run, "--fusion_method", "intermediate", "--dataset_dir", toy_small / "test",
              "--num_workers", "0")
    for preset in PRESETS:
        result = in_process(INFERENCE, *common, "--eval_preset", preset)
        assert result.returncode == 0, explain(result)
    one = read_results(toy_run)
    # Every preset on 2 ranks in one launch (tools/inference_ddp.py's recipe once per preset).
    result = torchrun(2, WORKERS / "eval_presets_worker.py", *common)
    assert result.returncode == 0, explain(result)
    two = read_results(toy_run)
    run_keys = ("world_size", "seconds")
    for preset in PRESETS:
        assert (one[preset]["world_size"], two[preset]["world_size"]) == (1, 2)
        assert {k: v for k, v in one[preset].items() if k not in run_keys} == \
            {k: v for k, v in two[preset].items() if k not in run_keys}, preset
        assert one[preset]["eval_preset"] == preset and one[preset]["frames"] == 4
    assert one["heal"]["ap_convention"] == "global sort" and one["v2v4real"]["eval_range"][:2] == [-100.0, -40.0]
    assert "ap_50_0_30m" in one["v2v4real"] and "ap_50_0_30m" not in one["heal"]
    rejected = in_process(INFERENCE, *common, "--eval_preset", "v2v4real", "--global_sort_detections")
    assert rejected.returncode == 2 and "contradicts --eval_preset v2v4real" in rejected.stderr
