"""point_pillar_loss in CoAlign's and HEAL's spelling (pos_cls_weight, cls and reg blocks): values derived by hand
from the formulas (focal loss, smooth L1 with sigma), the anchors between the thresholds costing nothing, the
OpenCOOD spelling unchanged, and one error line for a block that is not CoAlign's."""
from __future__ import annotations

import math

import pytest
import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.loss import PointPillarLoss, create_loss

COALIGN = {"pos_cls_weight": 2.0,
           "cls": {"type": "SigmoidFocalLoss", "alpha": 0.25, "gamma": 2.0, "weight": 2.0},
           "reg": {"type": "WeightedSmoothL1Loss", "sigma": 3.0, "codewise": True, "weight": 2.0}}
LN2 = math.log(2.0)


def _loss(args: dict) -> PointPillarLoss:
    return create_loss({"name": "unit", "loss": {"core_method": "point_pillar_loss", "args": args}})


def _one_cell(positive, negative, logits=(0.0, 0.0, 0.0), yaw_targets=(0.0, 0.0, 0.0), x_target=0.0):
    """One sample, one cell, three anchors: outputs (psm (1, 3, 1, 1), rm (1, 21, 1, 1)) all zero but the logits,
    labels with the given positive and negative anchors; the positive anchors' x target is `x_target`."""
    psm = torch.tensor(logits, dtype=torch.float64).view(1, 3, 1, 1)
    rm = torch.zeros(1, 21, 1, 1, dtype=torch.float64)
    targets = torch.zeros(1, 1, 1, 21, dtype=torch.float64)
    for anchor in range(3):
        targets[0, 0, 0, 7 * anchor + 6] = yaw_targets[anchor]
        if positive[anchor]:
            targets[0, 0, 0, 7 * anchor] = x_target
    labels = {"pos_equal_one": torch.tensor(positive, dtype=torch.float64).view(1, 1, 1, 3),
              "neg_equal_one": torch.tensor(negative, dtype=torch.float64).view(1, 1, 1, 3), "targets": targets}
    return {"psm": psm, "rm": rm}, labels


def test_positive_weight_and_the_anchors_between_the_thresholds():
    """Logits 0 (p = 0.5): a positive's focal term is 0.25 * 0.5^2 * ln 2, a negative's 0.75 * 0.5^2 * ln 2.
    Anchor 0 positive (weight 2), anchor 1 negative (weight 1), anchor 2 between the thresholds (weight 0); one
    positive, so the normaliser is 1. cls = 2.0 * (2 * 0.0625 + 0.1875) ln 2. OpenCOOD counts anchor 2 as a
    negative and weighs the positive 1: cls_weight * (0.0625 + 2 * 0.1875) ln 2."""
    outputs, labels = _one_cell(positive=(1, 0, 0), negative=(0, 1, 0))
    ours = _loss(COALIGN)(outputs, labels)
    assert ours.parts["cls"].item() == pytest.approx(2.0 * (2 * 0.0625 + 0.1875) * LN2, rel=1e-12)
    opencood = _loss({"cls_weight": 2.0, "reg": 2.0})(outputs, labels)
    assert opencood.parts["cls"].item() == pytest.approx(2.0 * (0.0625 + 2 * 0.1875) * LN2, rel=1e-12)


def test_focal_alpha_and_gamma_are_read():
    """alpha 0.5, gamma 0: plain balanced cross entropy, 0.5 ln 2 per anchor at p = 0.5."""
    args = {**COALIGN, "pos_cls_weight": 1.0, "cls": {**COALIGN["cls"], "alpha": 0.5, "gamma": 0.0, "weight": 1.0}}
    outputs, labels = _one_cell(positive=(1, 0, 0), negative=(0, 1, 1))
    assert _loss(args)(outputs, labels).parts["cls"].item() == pytest.approx(3 * 0.5 * LN2, rel=1e-12)


@pytest.mark.parametrize("sigma,expected", [
    (3.0, 0.5 - 0.5 / 9.0),  # |0.5| >= 1/9: the linear part, |x| - 0.5 / sigma^2
    (1.0, 0.5 * 0.5 ** 2),  # |0.5| < 1: the quadratic part, 0.5 (sigma x)^2
])
def test_smooth_l1_sigma_is_read(sigma, expected):
    """One positive anchor whose x target is 0.5 from the prediction; the yaw code is sin(0 - 0) = 0."""
    args = {**COALIGN, "reg": {**COALIGN["reg"], "sigma": sigma, "weight": 1.0}}
    outputs, labels = _one_cell(positive=(1, 0, 0), negative=(0, 1, 0), x_target=0.5)
    assert _loss(args)(outputs, labels).parts["reg"].item() == pytest.approx(expected, rel=1e-12)


def test_the_same_weights_give_opencoods_loss_where_no_anchor_is_between_the_thresholds():
    """pos_cls_weight 1, every non-positive anchor a negative: CoAlign's arithmetic is OpenCOOD's."""
    generator = torch.Generator().manual_seed(0)
    outputs = {"psm": torch.randn(2, 2, 3, 4, generator=generator, dtype=torch.float64),
               "rm": torch.randn(2, 14, 3, 4, generator=generator, dtype=torch.float64)}
    positive = (torch.rand(2, 3, 4, 2, generator=generator) > 0.7).double()
    labels = {"pos_equal_one": positive, "neg_equal_one": 1 - positive,
              "targets": torch.randn(2, 3, 4, 14, generator=generator, dtype=torch.float64)}
    coalign = _loss({**COALIGN, "pos_cls_weight": 1.0})(outputs, labels)
    opencood = _loss({"cls_weight": 2.0, "reg": 2.0})(outputs, labels)
    assert coalign.total.item() == pytest.approx(opencood.total.item(), rel=1e-12)


@pytest.mark.parametrize("change,named", [
    ({"cls_weight": 1.0}, "cls_weight is OpenCOOD's spelling"),
    ({"pos_cls_weight": None}, "loss.args.pos_cls_weight"),
    ({"cls": {**COALIGN["cls"], "type": "SoftmaxFocalLoss"}}, "cls must be"),
    ({"cls": {**COALIGN["cls"], "alpha": 1.5}}, "cls.alpha"),
    ({"reg": {**COALIGN["reg"], "codewise": False}}, "code-wise"),
    ({"reg": {**COALIGN["reg"], "sigma": 0}}, "reg.sigma"),
    ({"reg": {**COALIGN["reg"], "beta": 0.1}}, "reg must be"),
])
def test_a_block_that_is_not_coaligns_is_one_error_line(change, named):
    args = {key: value for key, value in {**COALIGN, **change}.items() if value is not None}
    with pytest.raises(ConfigError) as error:
        _loss(args)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_coaligns_dair_loss_block_builds_as_written():
    loss = _loss({**COALIGN, "dir": {"type": "WeightedSoftmaxClassificationLoss", "weight": 0.2,
                                     "args": {"dir_offset": 0.7853, "num_bins": 2, "anchor_yaw": [0, 90]}}})
    assert (loss.pos_cls_weight, loss.cls_weight, loss.reg_coe, loss.dir_weight) == (2.0, 2.0, 2.0, 0.2)
    assert (loss.alpha, loss.gamma, loss.beta) == (0.25, 2.0, 1.0 / 9.0)


def test_a_mistyped_key_in_coaligns_blocks_is_named_with_the_closest_key():
    from opencood_ddp.schema import unknown_keys
    from opencood_ddp.tasks.opencood import TASK_KEYS
    from zoo import hypes_of

    hypes = hypes_of("dairv2x/point_pillar_intermediate_fusion", "loss.args.reg.sigmaa=3.0")
    assert unknown_keys(hypes, TASK_KEYS) == ["loss.args.reg.sigmaa"]
