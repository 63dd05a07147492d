"""The direction classifier (CoAlign's and HEAL's dir_args) against values derived by hand from its rules.

Sectors of 2 pi / num_bins start at dir_offset; a positive anchor's target sector is that of its ground-truth
heading (the yaw residual plus the anchor's yaw); the loss is the softmax cross entropy weighted as the
regression; decoding folds the regressed yaw into one sector's width and moves it into the predicted sector.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import yaml

from launch import REPO, dairv2x_overrides, explain, in_process, train
from zoo import hypes_of
from opencood_ddp.data import geometry as geo
from opencood_ddp.errors import ConfigError
from opencood_ddp.loss import create_loss
from opencood_ddp.models import create_model
from opencood_ddp.postprocess import create_postprocessor, encode
from opencood_ddp.engine.logs import read_step_log
from opencood_ddp.postprocess.direction import DirectionArgs, apply_direction, direction_targets
from opencood_ddp.tasks.opencood import eval_file_name

COALIGN = DirectionArgs(dir_offset=0.7853, num_bins=2, anchor_yaw=(0.0, 90.0))
DIR = "{dir_offset: 0.7853, num_bins: 2, anchor_yaw: [0, 90]}"
WITH_DIR = (f"model.args.dir_args={DIR}", f"loss.args.dir={{weight: 0.2, args: {DIR}}}", f"postprocess.dir_args={DIR}")
TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"


def targets_with_yaws(residuals) -> np.ndarray:
    """(1, cells, 7A) regression targets of 2 anchors per cell whose yaw codes are ``residuals`` (cell, anchor)."""
    residuals = np.asarray(residuals, dtype=np.float64).reshape(1, -1, 2)
    targets = np.zeros((1, residuals.shape[1], 2, 7))
    targets[..., 6] = residuals
    return targets.reshape(1, residuals.shape[1], 14)


def test_target_sectors_by_hand():
    # Two cells x anchors [0, 90 deg]; headings 0.1, pi/2, 3.0 and pi/2 - 2.0 (= -0.4292). Sector 0 holds headings in
    # [0.7853, 0.7853 + pi), sector 1 the rest of the circle.
    assert direction_targets(targets_with_yaws([0.1, 0.0, 3.0, -2.0]), COALIGN).tolist() == [[[1, 0], [0, 1]]]
    # Four bins of pi/2 from 0: headings 0.2, pi/2 + 0.1 (anchor 90 deg + 0.1), 3.5, -0.2 (= 2 pi - 0.2).
    four = DirectionArgs(dir_offset=0.0, num_bins=4, anchor_yaw=(0.0, 90.0))
    assert direction_targets(targets_with_yaws([0.2, 0.1, 3.5, -0.2 - math.pi / 2]), four).tolist() == \
        [[[0, 1], [2, 3]]]


def test_the_post_processor_labels_each_anchor_with_its_targets_sector():
    post = create_postprocessor(hypes_of(TOY, *WITH_DIR), train=True)
    anchors = post.generate_anchor_box()
    center, mask = np.zeros((100, 7)), np.zeros(100)
    center[:2], mask[:2] = [[5.0, 3.0, -1.0, 1.5, 1.8, 4.2, 0.1], [-12.0, 8.0, -1.0, 1.5, 1.8, 4.2, 2.0]], 1
    labels = post.generate_label(gt_box_center=center, anchors=anchors, mask=mask)
    positive = labels["pos_equal_one"] > 0
    assert positive.sum() >= 2 and labels["dir_targets"].shape == positive.shape
    heading = labels["targets"].reshape(*positive.shape, 7)[..., 6] + anchors[..., 6]
    for yaw, sector in zip(heading[positive], labels["dir_targets"][positive]):
        assert sector == (1 if yaw % (2 * math.pi) < 0.7853 or yaw % (2 * math.pi) >= 0.7853 + math.pi else 0)
    assert set(labels["dir_targets"][positive].tolist()) == {0, 1}  # yaw 0.1 -> sector 1, yaw 2.0 -> sector 0
    batch = post.collate_batch([labels, labels])
    assert batch["dir_targets"].dtype == torch.int64 and batch["dir_targets"].shape == (2, *positive.shape)
    assert "dir_targets" not in create_postprocessor(hypes_of(TOY), train=True).generate_label(
        gt_box_center=center, anchors=anchors, mask=mask)


def test_decoding_moves_the_yaw_into_the_predicted_sector():
    yaw = torch.tensor([0.1, 0.1, -2.5, 2.0], dtype=torch.float64)
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [3.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
    # Each yaw's line (yaw + k pi) meets the chosen sector [dir_offset + pi * sector, ... + pi) once: 0.1 lies in
    # sector 1 already (as 0.1 + 2 pi), and asked for sector 0 it turns by pi.
    expected = []
    for value, sector in zip(yaw.tolist(), (1, 0, 0, 1)):
        low = 0.7853 + math.pi * sector  # the chosen sector is [low, low + pi)
        folded = value + math.pi * math.ceil((low - value) / math.pi)  # the one yaw of value's line in it
        expected.append(folded)
    got = apply_direction(yaw, logits, COALIGN)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)
    assert got[0].item() == pytest.approx(0.1 + 2 * math.pi) and got[1].item() == pytest.approx(0.1 + math.pi)


def test_loss_term_is_the_weighted_softmax_cross_entropy_by_hand():
    hypes = hypes_of(TOY, *WITH_DIR)
    loss = create_loss(hypes)
    anchors, rows, cols = 2, 1, 2  # one sample, 2 cells x 2 anchors: N = 4 in (cell, anchor) order
    psm = torch.zeros((1, anchors, rows, cols))
    rm = torch.zeros((1, 7 * anchors, rows, cols))
    dm = torch.tensor([0.3, -0.2, 1.0, 0.5, -1.0, 2.0, 0.0, 0.7]).reshape(1, rows, cols, 4).permute(0, 3, 1, 2)
    targets = torch.zeros((1, rows, cols, 7 * anchors))
    targets[0, 0, 0, 6], targets[0, 0, 1, 7 + 6] = 0.1, -2.0  # cell 0 anchor 0, cell 1 anchor 1
    pos = torch.zeros((1, rows, cols, anchors))
    pos[0, 0, 0, 0] = pos[0, 0, 1, 1] = 1  # two positives: sectors 1 (heading 0.1) and 1 (pi/2 - 2)
    sectors = torch.tensor([[[[1, 0], [0, 1]]]])  # what direction_targets gives these targets (test above)
    terms = loss({"psm": psm, "rm": rm, "dm": dm}, {"pos_equal_one": pos, "targets": targets,
                                                     "neg_equal_one": 1 - pos, "dir_targets": sectors})

    def cross_entropy(logits, sector):
        return -(logits[sector] - math.log(sum(math.exp(v) for v in logits)))

    by_hand = 0.2 * (cross_entropy([0.3, -0.2], 1) + cross_entropy([0.0, 0.7], 1)) / 2
    assert terms.parts["dir"].item() == pytest.approx(by_hand, rel=1e-6)
    assert terms.total.item() == pytest.approx(sum(p.item() for p in terms.parts.values()), rel=1e-6)


def test_the_model_has_coaligns_head_and_the_post_processor_decodes_with_it():
    hypes = hypes_of(TOY, *WITH_DIR)
    model = create_model(hypes)
    channels = model.cls_head.in_channels
    assert tuple(model.state_dict()["dir_head.weight"].shape) == (2 * 2, channels, 1, 1)
    assert "dir_head.bias" in model.state_dict()
    assert "dir_head" not in dict(create_model(hypes_of(TOY)).named_children())  # only with dir_args

    post = create_postprocessor(hypes, train=False)
    anchors = post.generate_anchor_box()
    rows, cols, num = anchors.shape[:3]
    box = np.array([5.0, 3.0, -1.0, 1.5, 1.8, 4.2, math.pi / 2 + 0.2])  # on the 90-degree anchor of its cell
    row = int(np.argmin(np.abs(anchors[:, 0, 0, 1] - box[1])))
    col = int(np.argmin(np.abs(anchors[0, :, 0, 0] - box[0])))
    psm = torch.full((1, num, rows, cols), -10.0)
    rm = torch.zeros((1, 7 * num, rows, cols))
    dm = torch.zeros((1, 2 * num, rows, cols))
    psm[0, 1, row, col] = 4.0
    rm[0, 7:14, row, col] = torch.from_numpy(encode(box[None], anchors[row, col, 1][None])[0]).float()
    entry = {"anchor_box": torch.from_numpy(anchors), "transformation_matrix": torch.eye(4)}
    for sector, heading in ((0, box[6]), (1, box[6] + math.pi)):  # pi/2 + 0.2 lies in sector 0
        dm[0, 2:4, row, col] = torch.tensor([1.0, -1.0] if sector == 0 else [-1.0, 1.0])
        corners, _ = post.post_process({"ego": entry}, {"ego": {"psm": psm, "rm": rm, "dm": dm}})
        expected = geo.boxes_to_corners(np.array([[*box[:6], heading]]))
        np.testing.assert_allclose(corners.numpy(), expected, atol=2e-4)


@pytest.mark.parametrize("overrides,fragments", [
    (WITH_DIR[:1], ["model.args.dir_args", "but not loss.args.dir, postprocess.dir_args"]),
    (WITH_DIR[1:], ["model.args.dir_args", "not model.args.dir_args"]),
    (WITH_DIR[:2] + ("postprocess.dir_args={dir_offset: 0, num_bins: 2, anchor_yaw: [0, 90]}",),
     ["must hold the same dir_args"]),
    (tuple(w.replace("[0, 90]", "[0, 45]") for w in WITH_DIR), ["must be the anchors' yaws"]),
    ((WITH_DIR[0].replace("num_bins: 2", "num_bins: 0"),) + WITH_DIR[1:], ["model.args.dir_args has"]),
])
def test_inconsistent_direction_blocks_are_one_line(overrides, fragments):
    hypes = hypes_of(TOY, *overrides)
    with pytest.raises(ConfigError) as error:
        create_postprocessor(hypes, train=True)
    message = str(error.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_a_malformed_loss_block_is_one_line():
    with pytest.raises(ConfigError) as error:
        create_loss(hypes_of(TOY, *WITH_DIR[:1], "loss.args.dir={weight: -1, args: {num_bins: 2}}", *WITH_DIR[2:]))
    assert "loss.args.dir must be" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_run_with_the_classifier_trains_and_evaluates_on_the_dair_copy(toy_dairv2x, tmp_path):
    """The whole path on DAIR-V2X-C's toy copy, as its configs use it: labels, loss part, checkpoint, decoding."""
    run = tmp_path / "run"
    flags = [flag for pair in zip(["--set"] * len(WITH_DIR), WITH_DIR) for flag in pair]
    trained = train(0, "--hypes_yaml", TOY, "--model_dir", run, "--num_workers", "0", *dairv2x_overrides(toy_dairv2x),
                    *flags, "--set", "train_params.epoches=1")
    assert trained.returncode == 0, explain(trained)
    assert "dir" in read_step_log(run / "train_steps.csv")[0]
    weights = torch.load(run / "net_epoch1.pth", map_location="cpu", weights_only=True)
    assert tuple(weights["dir_head.weight"].shape)[0] == 4
    evaluated = in_process(REPO / "tools" / "inference_ddp.py", "--model_dir", run, "--fusion_method", "intermediate",
                           "--num_workers", "0", "--eval_preset", "heal")
    assert evaluated.returncode == 0, explain(evaluated)
    assert yaml.safe_load((run / eval_file_name(False, "heal")).read_text())["frames"] == 4


def test_coaligns_own_spelling_of_the_blocks_is_read(tmp_path):
    """CoAlign writes dir_args once as a YAML anchor and names the loss term's type."""
    text = TOY.read_text().replace("postprocess:\n", f"postprocess:\n  dir_args: &dir_args {DIR}\n", 1)
    text = text.replace("loss:\n  core_method: point_pillar_loss\n  args:\n",
                        "loss:\n  core_method: point_pillar_loss\n  args:\n    dir: {type: "
                        "'WeightedSoftmaxClassificationLoss', weight: 0.2, args: *dir_args}\n", 1)
    text = text.replace("model:\n  core_method: point_pillar_intermediate\n  args:\n",
                        "model:\n  core_method: point_pillar_intermediate\n  args:\n    dir_args: *dir_args\n", 1)
    assert text.count("*dir_args") == 2
    (tmp_path / "coalign.yaml").write_text(text)
    hypes = hypes_of(tmp_path / "coalign.yaml")
    assert create_loss(hypes).dir_weight == 0.2 and create_postprocessor(hypes, train=False).direction == COALIGN
    assert "dir_head" in dict(create_model(hypes).named_children())
