"""PointPillarLoss: upstream's arithmetic checked by hand, the mean-over-samples (DDP) invariant, empty frames,
half-precision safety and create_loss errors."""
import math

import pytest
import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.loss import PointPillarLoss, create_loss

ALPHA, GAMMA, BETA = 0.25, 2.0, 1.0 / 9.0


# ------------------------------------------------------------------------------------------- hand formulas
def focal_by_hand(logit: float, positive: bool) -> float:
    """alpha-balanced focal loss written the textbook way: -alpha_t (1 - p_t)^gamma log p_t."""
    p = 1.0 / (1.0 + math.exp(-logit))
    if positive:
        return -ALPHA * (1.0 - p) ** GAMMA * math.log(p)
    return -(1.0 - ALPHA) * p ** GAMMA * math.log(1.0 - p)


def smooth_l1_by_hand(x: float) -> float:
    return 0.5 * x * x / BETA if abs(x) < BETA else abs(x) - 0.5 * BETA


def expected_loss(psm, rm, pos, targets):
    """(cls, reg) from nested lists: psm[b][a][h][w], rm[b][7a+c][h][w], pos[b][h][w][a], targets[b][h][w][7a+c]."""
    batch, anchors, height, width = len(psm), len(psm[0]), len(psm[0][0]), len(psm[0][0][0])
    cls_total, reg_total = 0.0, 0.0
    for b in range(batch):
        cells = [(h, w, a) for h in range(height) for w in range(width) for a in range(anchors)]
        num_pos = max(1, sum(1 for h, w, a in cells if pos[b][h][w][a] > 0))
        cls_sample, reg_sample = 0.0, 0.0
        for h, w, a in cells:
            positive = pos[b][h][w][a] > 0
            cls_sample += focal_by_hand(psm[b][a][h][w], positive)
            if positive:
                for c in range(7):
                    pred, target = rm[b][7 * a + c][h][w], targets[b][h][w][7 * a + c]
                    if math.isnan(target):  # upstream ignores NaN targets
                        continue
                    # yaw: sin(a)cos(b) - cos(a)sin(b) == sin(a - b)
                    diff = math.sin(pred - target) if c == 6 else pred - target
                    reg_sample += smooth_l1_by_hand(diff)
        cls_total += cls_sample / num_pos
        reg_total += reg_sample / num_pos
    return cls_total / batch, reg_total / batch


def make_case(batch=2, anchors=2, height=2, width=2, seed=0, pos_counts=None, dtype=torch.float32):
    """Random outputs and labels; sample b gets pos_counts[b] positive anchors (default: 2, 1, 0, 3, ...)."""
    gen = torch.Generator().manual_seed(seed)
    psm = torch.randn(batch, anchors, height, width, generator=gen, dtype=dtype) * 2
    rm = torch.randn(batch, 7 * anchors, height, width, generator=gen, dtype=dtype) * 0.5
    targets = torch.randn(batch, height, width, 7 * anchors, generator=gen, dtype=torch.float64) * 0.5
    pos = torch.zeros(batch, height, width, anchors, dtype=torch.float64)
    counts = pos_counts or [(2, 1, 0, 3)[b % 4] for b in range(batch)]
    for b, count in enumerate(counts):
        flat = pos[b].view(-1)
        flat[torch.randperm(flat.numel(), generator=gen)[:count]] = 1.0
    labels = {"pos_equal_one": pos, "neg_equal_one": 1.0 - pos, "targets": targets}
    return {"psm": psm, "rm": rm}, labels


def take(outputs, labels, index):
    return ({k: v[index] for k, v in outputs.items()}, {k: v[index] for k, v in labels.items()})


# ------------------------------------------------------------------------------------------- arithmetic
def test_hand_computed_case():
    psm = [[[[1.5, -0.5], [0.2, -2.0]], [[-1.0, 0.7], [3.0, 0.0]]],
           [[[-0.3, 2.2], [-1.7, 0.4]], [[0.9, -2.5], [1.1, -0.8]]]]
    pos = [[[[1, 0], [0, 0]], [[0, 0], [1, 0]]],     # sample 0: two positives
           [[[0, 0], [0, 1]], [[0, 0], [0, 0]]]]     # sample 1: one positive
    gen = torch.Generator().manual_seed(3)
    rm = (torch.randn(2, 14, 2, 2, generator=gen) * 0.4).tolist()
    rm[0][6][0][0] = 0.03  # yaw codes near their targets: the quadratic branch of smooth-L1
    targets = (torch.randn(2, 2, 2, 14, generator=gen) * 0.4).tolist()
    targets[0][0][0][6] = 0.0
    outputs = {"psm": torch.tensor(psm), "rm": torch.tensor(rm)}
    pos_t = torch.tensor(pos, dtype=torch.float64)
    labels = {"pos_equal_one": pos_t, "neg_equal_one": 1 - pos_t, "targets": torch.tensor(targets)}

    out = PointPillarLoss(cls_weight=1.5, reg=2.0)(outputs, labels)
    cls, reg = expected_loss(psm, outputs["rm"].tolist(), pos, labels["targets"].tolist())
    assert out.total.dtype == torch.float32 and out.total.shape == ()
    assert out.parts["cls"].item() == pytest.approx(1.5 * cls, rel=1e-6, abs=1e-7)
    assert out.parts["reg"].item() == pytest.approx(2.0 * reg, rel=1e-6, abs=1e-7)
    assert out.total.item() == pytest.approx(1.5 * cls + 2.0 * reg, rel=1e-6, abs=1e-7)
    assert not out.parts["cls"].requires_grad and not out.parts["reg"].requires_grad


def test_random_case_matches_hand_formula_in_float64():
    outputs, labels = make_case(batch=4, anchors=2, height=3, width=2, seed=1, dtype=torch.float64)
    out = PointPillarLoss(1.0, 2.0)(outputs, labels)
    assert out.total.dtype == torch.float64  # double precision is kept for parity checks
    cls, reg = expected_loss(outputs["psm"].tolist(), outputs["rm"].tolist(),
                             labels["pos_equal_one"].tolist(), labels["targets"].tolist())
    assert out.parts["cls"].item() == pytest.approx(cls, rel=1e-12)
    assert out.parts["reg"].item() == pytest.approx(2.0 * reg, rel=1e-12)


def test_normalised_by_positive_count_per_sample():
    """Two positives with the same error cost what one costs: each sample is divided by its positive count."""
    outputs, labels = make_case(batch=2, anchors=1, height=2, width=2, pos_counts=[0, 0])
    outputs["rm"].zero_()
    labels["targets"].zero_()
    labels["targets"][:, 0, 0, 0] = 0.5    # anchor (0, 0): x error 0.5 in both samples
    labels["targets"][1, 1, 1, 0] = 0.5    # sample 1 also has anchor (1, 1) with the same error
    labels["pos_equal_one"][0, 0, 0, 0] = 1
    labels["pos_equal_one"][1, 0, 0, 0] = 1
    labels["pos_equal_one"][1, 1, 1, 0] = 1
    loss = PointPillarLoss(1.0, 1.0)
    single = loss(*take(outputs, labels, slice(0, 1))).parts["reg"].item()
    double = loss(*take(outputs, labels, slice(1, 2))).parts["reg"].item()
    assert single == pytest.approx(0.5 - 0.5 * BETA, rel=1e-6)
    assert double == pytest.approx(single, rel=1e-6)
    both = loss(outputs, labels).parts["reg"].item()
    assert both == pytest.approx(single, rel=1e-6)  # divided by the batch size 2, not summed


def test_negatives_are_every_non_positive_anchor():
    """neg_equal_one is not read (upstream): changing it leaves the loss unchanged."""
    outputs, labels = make_case(batch=2, seed=4)
    loss = PointPillarLoss(1.0, 2.0)
    reference = loss(outputs, labels).total
    labels["neg_equal_one"] = torch.zeros_like(labels["neg_equal_one"])
    assert torch.equal(loss(outputs, labels).total, reference)


def test_nan_targets_cost_nothing():
    """A NaN code is replaced by the prediction (upstream's WeightedSmoothL1Loss): it adds 0, never NaN."""
    outputs, labels = make_case(batch=1, anchors=1, height=1, width=2, pos_counts=[2], dtype=torch.float64)
    labels["targets"][0, 0, 0, 0] = float("nan")  # x of the first positive
    labels["targets"][0, 0, 1, 6] = float("nan")  # yaw of the second
    labels["targets"][0, 0, 1, 2] = float("nan")
    psm = outputs["psm"].clone().requires_grad_(True)
    rm = outputs["rm"].clone().requires_grad_(True)
    out = PointPillarLoss(1.0, 1.0)({"psm": psm, "rm": rm}, labels)
    _, reg = expected_loss(psm.tolist(), rm.tolist(), labels["pos_equal_one"].tolist(), labels["targets"].tolist())
    assert out.parts["reg"].item() == pytest.approx(reg, rel=1e-12)
    out.total.backward()
    assert torch.isfinite(rm.grad).all()
    assert rm.grad[0, 0, 0, 0] == 0 and rm.grad[0, 6, 0, 1] == 0 and rm.grad[0, 2, 0, 1] == 0


def test_yaw_error_of_pi_is_free():
    outputs, labels = make_case(batch=1, anchors=1, height=1, width=1, pos_counts=[1])
    labels["targets"][0, 0, 0] = torch.tensor([0.1, -0.2, 0.3, 0.1, 0.0, -0.1, 0.4], dtype=torch.float64)
    outputs["rm"] = labels["targets"].permute(0, 3, 1, 2).float().clone()
    outputs["rm"][0, 6] += math.pi
    assert PointPillarLoss(1.0, 1.0)(outputs, labels).parts["reg"].item() == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------------------- DDP invariants
def test_batch_loss_is_mean_of_its_halves():
    """loss(4 samples) == mean(loss(first 2), loss(last 2)): DDP's gradient average equals the 1-GPU gradient."""
    outputs, labels = make_case(batch=4, anchors=2, height=4, width=3, seed=7, pos_counts=[3, 0, 1, 5])
    loss = PointPillarLoss(1.0, 2.0)
    full = loss(outputs, labels)
    first, second = loss(*take(outputs, labels, slice(0, 2))), loss(*take(outputs, labels, slice(2, 4)))
    assert full.total.item() == pytest.approx((first.total.item() + second.total.item()) / 2, rel=1e-6)
    for key in ("cls", "reg"):
        assert full.parts[key].item() == pytest.approx((first.parts[key] + second.parts[key]).item() / 2,
                                                       rel=1e-6)


def test_batch_gradient_is_mean_of_its_halves_gradients():
    outputs, labels = make_case(batch=4, seed=8)
    loss = PointPillarLoss(1.0, 2.0)
    psm = outputs["psm"].clone().requires_grad_(True)
    rm = outputs["rm"].clone().requires_grad_(True)
    loss({"psm": psm, "rm": rm}, labels).total.backward()
    half_grads = []
    for half in (slice(0, 2), slice(2, 4)):
        p = outputs["psm"][half].clone().requires_grad_(True)
        r = outputs["rm"][half].clone().requires_grad_(True)
        loss({"psm": p, "rm": r}, {k: v[half] for k, v in labels.items()}).total.backward()
        half_grads.append((p.grad, r.grad))
    torch.testing.assert_close(psm.grad, torch.cat([g[0] for g in half_grads]) / 2, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(rm.grad, torch.cat([g[1] for g in half_grads]) / 2, rtol=1e-6, atol=1e-8)


def test_batch_with_an_empty_frame_is_finite():
    outputs, labels = make_case(batch=2, seed=2, pos_counts=[3, 0])
    loss = PointPillarLoss(1.0, 2.0)
    out = loss(outputs, labels)
    assert math.isfinite(out.total.item())
    alone = [loss(*take(outputs, labels, slice(b, b + 1))).total.item() for b in (0, 1)]
    assert out.total.item() == pytest.approx(sum(alone) / 2, rel=1e-6)


def test_no_positive_in_batch_still_gives_input_gradients():
    outputs, labels = make_case(batch=2, pos_counts=[0, 0])
    psm = outputs["psm"].clone().requires_grad_(True)
    rm = outputs["rm"].clone().requires_grad_(True)
    out = PointPillarLoss(1.0, 2.0)({"psm": psm, "rm": rm}, labels)
    out.total.backward()
    assert out.parts["reg"].item() == 0.0 and math.isfinite(out.total.item())
    assert psm.grad is not None and rm.grad is not None
    assert torch.count_nonzero(psm.grad) > 0      # every anchor is a negative
    assert torch.count_nonzero(rm.grad) == 0      # zero, but present: the same graph on every rank


class TinyHead(nn.Module):
    """A shared feature conv feeding a classification and a regression 1x1 conv, as PointPillar's heads."""

    def __init__(self, anchors: int = 2):
        super().__init__()
        self.shared = nn.Conv2d(3, 8, 3, padding=1)
        self.cls_head = nn.Conv2d(8, anchors, 1)
        self.reg_head = nn.Conv2d(8, 7 * anchors, 1)

    def forward(self, x):
        feature = torch.relu(self.shared(x))
        return {"psm": self.cls_head(feature), "rm": self.reg_head(feature)}


def test_every_head_parameter_gets_a_gradient_on_an_empty_batch():
    torch.manual_seed(0)
    model = TinyHead()
    _, labels = make_case(batch=2, height=4, width=4, pos_counts=[0, 0])
    out = PointPillarLoss(1.0, 2.0)(model(torch.randn(2, 3, 4, 4)), labels)
    out.total.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
    assert torch.count_nonzero(model.reg_head.weight.grad) == 0


# ------------------------------------------------------------------------------------------- precision
def test_half_precision_outputs_are_lifted_to_float32():
    outputs, labels = make_case(batch=2, seed=5)
    half = {k: v.bfloat16() for k, v in outputs.items()}
    lifted = {k: v.float() for k, v in half.items()}
    loss = PointPillarLoss(1.0, 2.0)
    out = loss(half, labels)
    assert out.total.dtype == torch.float32
    assert torch.equal(out.total, loss(lifted, labels).total)


def test_bf16_autocast_gives_float32_loss_close_to_fp32():
    torch.manual_seed(1)
    model = TinyHead()
    x = torch.randn(2, 3, 4, 4)
    _, labels = make_case(batch=2, height=4, width=4, pos_counts=[3, 1])
    loss = PointPillarLoss(1.0, 2.0)
    reference = loss(model(x), labels).total
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(x)
        assert outputs["psm"].dtype == torch.bfloat16
        out = loss(outputs, labels)
    assert out.total.dtype == torch.float32
    assert out.total.item() == pytest.approx(reference.item(), rel=2e-2)
    out.total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ------------------------------------------------------------------------------------------- create_loss
def hypes(**loss):
    return {"name": "unit", "loss": loss}


def test_create_loss_from_hypes():
    loss = create_loss(hypes(core_method="point_pillar_loss", args={"cls_weight": 1.0, "reg": 2}))
    assert isinstance(loss, PointPillarLoss)
    assert (loss.cls_weight, loss.reg_coe) == (1.0, 2.0)


@pytest.mark.parametrize("loss_section,key", [
    ({"core_method": "voxel_net_loss", "args": {"cls_weight": 1.0, "reg": 2.0}}, "loss.core_method"),
    ({"args": {"cls_weight": 1.0, "reg": 2.0}}, "loss.core_method"),
    ({"core_method": "point_pillar_loss"}, "loss.args"),
    ({"core_method": "point_pillar_loss", "args": {"cls_weight": 1.0}}, "loss.args.reg"),
    ({"core_method": "point_pillar_loss", "args": {"cls_weight": "one", "reg": 2.0}}, "loss.args.cls_weight"),
    ({"core_method": "point_pillar_loss", "args": {"cls_weight": 1.0, "reg": -2.0}}, "loss.args.reg"),
])
def test_create_loss_errors_name_the_key(loss_section, key):
    with pytest.raises(ConfigError) as info:
        create_loss(hypes(**loss_section))
    message = str(info.value)
    assert key in message and "hypes unit" in message
    assert "\n" not in message


def test_detection_step_logs_a_models_scalar_outputs_with_the_loss_parts():
    """Where2comm's comm_rate: a 0-d model output joins the logged parts (detached), never the loss."""
    from opencood_ddp.tasks.opencood import DetectionStep

    outputs, labels = make_case(batch=2)
    psm = outputs["psm"].clone().requires_grad_(True)

    def model(ego):
        return {"psm": psm, "rm": outputs["rm"], "comm_rate": psm.sigmoid().mean(), "cls": torch.tensor(9.0),
                "per_cav": torch.ones(3)}

    step = DetectionStep(PointPillarLoss(1.0, 2.0))
    out = step(model, {"ego": {"label_dict": labels}})
    alone = PointPillarLoss(1.0, 2.0)(outputs, labels)
    assert torch.equal(out.total.detach(), alone.total.detach())  # the scalar output adds nothing to the loss
    assert set(out.parts) == {"cls", "reg", "comm_rate"}  # the loss's own 'cls' wins; vectors are not logged
    assert not out.parts["comm_rate"].requires_grad
    assert out.parts["comm_rate"].item() == pytest.approx(outputs["psm"].sigmoid().mean().item())
