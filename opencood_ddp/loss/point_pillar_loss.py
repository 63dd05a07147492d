"""PointPillar detection loss: sigmoid focal classification plus smooth-L1 box regression.

Upstream counterpart: ``opencood/loss/point_pillar_loss.py`` (``PointPillarLoss`` with its
``WeightedSmoothL1Loss``). The arithmetic is upstream's; the departures are about robustness:

- the loss is computed in (at least) float32 with autocast disabled, so a bf16/fp16 forward pass is safe;
- labels may arrive in any float dtype (the collate makes float32, upstream's float64) and are cast to the
  computation's dtype;
- there is no branch on the presence of positives: a frame without objects contributes through zero weights,
  so every rank of a DDP job builds the same autograd graph and every head parameter receives a gradient;
- a NaN regression target costs nothing on every code, yaw included (upstream: a NaN yaw target gives a NaN
  loss, because its NaN replacement runs after the sin encoding has spread the NaN to the prediction);
- the logged parts are returned (detached) instead of kept in a ``loss_dict`` attribute.

With ``loss.args.dir`` (CoAlign's and HEAL's configs) a third term classifies each positive anchor's heading
into the sector the post-processor's label ``dir_targets`` names (``postprocess/direction.py``); its part is
``dir``.

``loss.args`` comes in two spellings under the one name ``point_pillar_loss``, as in the two code bases:
- OpenCOOD's: ``cls_weight`` and ``reg`` (numbers); focal alpha 0.25, gamma 2, smooth-L1 sigma 3; every anchor
  that is not positive is a negative of weight 1.
- CoAlign's and HEAL's: ``pos_cls_weight``, ``cls: {type: SigmoidFocalLoss, alpha, gamma, weight}`` and
  ``reg: {type: WeightedSmoothL1Loss, sigma, codewise: true, weight}``. A positive anchor's focal term weighs
  ``pos_cls_weight``, a negative's 1, and the negatives are the anchors of ``neg_equal_one`` (IoU below the
  negative threshold): an anchor between the two thresholds costs nothing, where OpenCOOD counts it negative.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.loss.terms import LossTerms
from opencood_ddp.numerics.autocast import autocast_off
from opencood_ddp.registry import LOSSES

FOCAL_ALPHA = 0.25
FOCAL_GAMMA = 2.0
SMOOTH_L1_BETA = 1.0 / 9.0
BOX_CODE_SIZE = 7
YAW_CODE = 6


def sigmoid_cross_entropy_with_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Element-wise binary cross entropy on logits in its overflow-free form (upstream's helper of that name):
    max(x, 0) - x * z + log(1 + exp(-|x|))."""
    return torch.clamp(logits, min=0) - logits * target + torch.log1p(torch.exp(-torch.abs(logits)))


def sigmoid_focal_loss(logits: torch.Tensor, target: torch.Tensor,
                       alpha: float = FOCAL_ALPHA, gamma: float = FOCAL_GAMMA) -> torch.Tensor:
    """Element-wise focal loss (upstream ``PointPillarLoss.cls_loss_func`` before its weighting).

    alpha weighs positives (1 - alpha negatives); (1 - p_t) ** gamma down-weights easy anchors. Not reduced.
    """
    prob = torch.sigmoid(logits)
    alpha_weight = target * alpha + (1.0 - target) * (1.0 - alpha)
    one_minus_pt = target * (1.0 - prob) + (1.0 - target) * prob
    return alpha_weight * torch.pow(one_minus_pt, gamma) * sigmoid_cross_entropy_with_logits(logits, target)


def smooth_l1(diff: torch.Tensor, beta: float = SMOOTH_L1_BETA) -> torch.Tensor:
    """0.5 x^2 / beta where |x| < beta, |x| - 0.5 beta elsewhere; plain |x| when beta < 1e-5 (as upstream)."""
    n = torch.abs(diff)
    if beta < 1e-5:
        return n
    return torch.where(n < beta, 0.5 * n ** 2 / beta, n - 0.5 * beta)


def add_sin_difference(pred: torch.Tensor, target: torch.Tensor,
                       dim: int = YAW_CODE) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the yaw code of pred by sin(a)cos(b) and of target by cos(a)sin(b) (a: predicted, b: target yaw).

    Their difference is sin(a - b), so a yaw error of pi costs nothing (upstream ``add_sin_difference``).
    """
    pred_yaw, target_yaw = pred[..., dim:dim + 1], target[..., dim:dim + 1]
    pred_code = torch.sin(pred_yaw) * torch.cos(target_yaw)
    target_code = torch.cos(pred_yaw) * torch.sin(target_yaw)
    pred = torch.cat([pred[..., :dim], pred_code, pred[..., dim + 1:]], dim=-1)
    target = torch.cat([target[..., :dim], target_code, target[..., dim + 1:]], dim=-1)
    return pred, target


def weighted_smooth_l1(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
                       beta: float = SMOOTH_L1_BETA) -> torch.Tensor:
    """(B, N, C) code-wise smooth-L1 weighted per anchor by (B, N) weights (upstream ``WeightedSmoothL1Loss``).

    A NaN target is replaced by the prediction itself, so that code costs 0 (upstream's "ignore nan targets").
    """
    target = torch.where(torch.isnan(target), pred, target)
    return smooth_l1(pred - target, beta) * weights.unsqueeze(-1)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half-precision outputs (autocast), float64 kept for double-precision parity checks."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


class PointPillarLoss(nn.Module):
    """OpenCOOD's PointPillar loss: total = cls_weight * focal + reg * smooth-L1.

    Classification: sigmoid focal loss (alpha 0.25, gamma 2) on every anchor; the target is 1 where
    ``pos_equal_one`` > 0 and 0 elsewhere (``neg_equal_one`` is not read, as upstream: an anchor that is not
    positive is a negative). Each anchor weighs 1 / max(1, positives of its sample).

    Regression: smooth-L1 (beta 1/9) on the 7 box codes with the sin-difference trick on yaw, on positive
    anchors only, each weighing 1 / max(1, positives of its sample).

    Reduction: each term is summed over anchors and divided by the batch size B, i.e. it is the MEAN OVER
    SAMPLES of a per-sample loss. That is what makes DDP's gradient average over N ranks (each holding B
    samples) equal to the gradient of the 1-process loss over the N*B samples of the global batch.

    ``parts`` are detached and already weighted, as upstream logs them (its ``conf_loss`` is
    ``cls_weight * cls`` and its ``reg_loss`` is ``reg * smooth-L1``), so total == parts['cls'] + parts['reg'].
    """

    def __init__(self, cls_weight: float, reg: float, dir_weight: Optional[float] = None, dir_bins: int = 2, *,
                 pos_cls_weight: Optional[float] = None, alpha: float = FOCAL_ALPHA, gamma: float = FOCAL_GAMMA,
                 beta: float = SMOOTH_L1_BETA):
        """``pos_cls_weight`` None: OpenCOOD's classification weights; a number: CoAlign's (see the module)."""
        super().__init__()
        self.cls_weight = float(cls_weight)
        self.reg_coe = float(reg)
        self.dir_weight, self.dir_bins = (None if dir_weight is None else float(dir_weight)), int(dir_bins)
        self.pos_cls_weight = None if pos_cls_weight is None else float(pos_cls_weight)
        self.alpha, self.gamma, self.beta = float(alpha), float(gamma), float(beta)

    def forward(self, output_dict: Mapping[str, torch.Tensor],
                label_dict: Mapping[str, torch.Tensor]) -> LossTerms:
        psm, rm = output_dict["psm"], output_dict["rm"]
        dtype = _compute_dtype(psm, rm)
        # Autocast would run some of the element-wise ops below in bf16/fp16; the loss is cheap, keep it exact.
        with autocast_off(psm.device.type):
            positives = self._positives(label_dict["pos_equal_one"], psm, dtype)
            normalizer = torch.clamp(positives.sum(dim=1, keepdim=True), min=1.0)  # (B, 1): per sample
            cls_loss = self._cls_loss(psm.to(dtype), positives, normalizer, self._cls_weights(label_dict, positives))
            reg_loss = self._reg_loss(rm.to(dtype), label_dict["targets"], positives, normalizer)
            conf_part = self.cls_weight * cls_loss
            reg_part = self.reg_coe * reg_loss
            total = conf_part + reg_part
            parts = {"cls": conf_part.detach(), "reg": reg_part.detach()}
            if self.dir_weight is not None:
                dir_part = self.dir_weight * self._dir_loss(output_dict["dm"].to(dtype), label_dict, positives,
                                                            normalizer)
                total = total + dir_part
                parts["dir"] = dir_part.detach()
        return LossTerms(total=total, parts=parts)

    @staticmethod
    def _positives(pos_equal_one: torch.Tensor, psm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, H*W*A) 1.0 on positive anchors; (B, H, W, A) labels flatten in the order of psm's (B, H, W, A)."""
        labels = pos_equal_one.to(device=psm.device).reshape(psm.shape[0], -1)
        return (labels > 0).to(dtype)

    def _cls_weights(self, label_dict: Mapping[str, torch.Tensor], positives: torch.Tensor) -> Optional[torch.Tensor]:
        """CoAlign's per-anchor focal weights before the normaliser: ``pos_cls_weight`` on positives, 1 on the
        negatives of ``neg_equal_one``, 0 between the thresholds; None for OpenCOOD's (1 everywhere)."""
        if self.pos_cls_weight is None:
            return None
        negatives = (label_dict["neg_equal_one"].to(device=positives.device).reshape(positives.shape) > 0)
        return positives * self.pos_cls_weight + negatives.to(positives.dtype)

    def _cls_loss(self, psm: torch.Tensor, positives: torch.Tensor, normalizer: torch.Tensor,
                  weights: Optional[torch.Tensor]) -> torch.Tensor:
        batch = psm.shape[0]
        logits = psm.permute(0, 2, 3, 1).reshape(batch, -1)  # (B, H*W*A), anchor-major per cell
        focal = sigmoid_focal_loss(logits, positives, self.alpha, self.gamma)
        per_anchor = focal / normalizer if weights is None else focal * (weights / normalizer)
        return per_anchor.sum() / batch

    def _reg_loss(self, rm: torch.Tensor, targets: torch.Tensor, positives: torch.Tensor,
                  normalizer: torch.Tensor) -> torch.Tensor:
        batch = rm.shape[0]
        pred = rm.permute(0, 2, 3, 1).reshape(batch, -1, BOX_CODE_SIZE)  # (B, H*W*A, 7)
        target = targets.to(device=rm.device, dtype=rm.dtype).reshape(batch, -1, BOX_CODE_SIZE)
        # NaN targets are replaced before the sin encoding: upstream replaces them after it, where a NaN yaw
        # target has already turned the prediction's code into NaN too, so its loss becomes NaN.
        target = torch.where(torch.isnan(target), pred, target)
        pred, target = add_sin_difference(pred, target)
        # Zero weights on non-positive anchors keep rm in the graph even when a batch has no object.
        per_code = weighted_smooth_l1(pred, target, positives / normalizer, self.beta)
        return per_code.sum() / batch

    def _dir_loss(self, dm: torch.Tensor, label_dict: Mapping[str, torch.Tensor], positives: torch.Tensor,
                  normalizer: torch.Tensor) -> torch.Tensor:
        """CoAlign's direction term: softmax cross entropy of each anchor's heading sector (the label
        ``dir_targets``, made by the post-processor from ``postprocess.dir_args``), on positive anchors weighted as
        the regression (1 / positives of the sample), summed and divided by the batch size."""
        if "dir_targets" not in label_dict:
            raise ValueError("loss.args.dir needs the label dir_targets, which the post-processor makes with "
                             "postprocess.dir_args; add it to the hypes (the same dir_args as the loss's)")
        batch = dm.shape[0]
        logits = dm.permute(0, 2, 3, 1).reshape(-1, self.dir_bins)  # (B*H*W*A, bins): the anchors' order
        sector = label_dict["dir_targets"].to(device=dm.device, dtype=torch.long).reshape(-1)
        per_anchor = nn.functional.cross_entropy(logits, sector, reduction="none")
        return (per_anchor.reshape(batch, -1) * positives / normalizer).sum() / batch


OPENCOOD_KEYS = ("cls_weight", "reg")
COALIGN_KEYS = ("pos_cls_weight", "cls", "reg")
FOCAL_TYPE, SMOOTH_L1_TYPE = "SigmoidFocalLoss", "WeightedSmoothL1Loss"  # CoAlign's `type` of each term
_COALIGN_EXAMPLE = (f"pos_cls_weight: 2.0, cls: {{type: {FOCAL_TYPE}, alpha: 0.25, gamma: 2.0, weight: 2.0}}, "
                    f"reg: {{type: {SMOOTH_L1_TYPE}, sigma: 3.0, codewise: true, weight: 2.0}}")


def _is_weight(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def is_coalign_spelling(args: Mapping) -> bool:
    """CoAlign's and HEAL's spelling of loss.args (its regression term a mapping), else OpenCOOD's."""
    return isinstance(args.get("reg"), Mapping) or "pos_cls_weight" in args or "cls" in args


def check_loss_weights(hypes: Mapping, source: str) -> None:
    args = hypes["loss"]["args"]
    if is_coalign_spelling(args):
        _check_coalign_terms(args, source)
    else:
        _check_opencood_weights(args, source)
    direction = args.get("dir")
    if direction is not None and not _direction_block(direction):
        raise ConfigError(f"{source}: key loss.args.dir must be {{weight: number >= 0, args: {{dir_offset, num_bins: "
                          f"integer >= 1, anchor_yaw}}[, type: {DIR_LOSS_TYPE}]}}, got {direction!r}; CoAlign's is "
                          f"{{type: {DIR_LOSS_TYPE}, weight: 0.2, args: *dir_args}} (postprocess.dir_args and "
                          f"model.args.dir_args the same)")


def _check_opencood_weights(args: Mapping, source: str) -> None:
    for key in OPENCOOD_KEYS:
        if key not in args:
            raise ConfigError(f"{source}: missing key loss.args.{key}; OpenCOOD's point_pillar_loss takes "
                              f"cls_weight and reg (numbers), CoAlign's {{{_COALIGN_EXAMPLE}}}")
        if not _is_weight(args[key]):
            raise ConfigError(f"{source}: key loss.args.{key} must be a finite number >= 0, got {args[key]!r}; "
                              f"fix the hypes or pass --set loss.args.{key}=VALUE")


def _check_coalign_terms(args: Mapping, source: str) -> None:
    """CoAlign's spelling, whole: each key present, each term of its one type, every number in its range."""
    problem = _coalign_problem(args)
    if problem:
        raise ConfigError(f"{source}: loss.args in CoAlign's spelling: {problem}; CoAlign's DAIR-V2X-C configs "
                          f"write {{{_COALIGN_EXAMPLE}}}")


def _coalign_problem(args: Mapping) -> Optional[str]:
    if "cls_weight" in args:
        return "cls_weight is OpenCOOD's spelling (CoAlign's is cls.weight); use one spelling"
    missing = [key for key in COALIGN_KEYS if key not in args]
    if missing:
        return f"missing key{'s' if len(missing) > 1 else ''} " + ", ".join(f"loss.args.{k}" for k in missing)
    cls, reg = args["cls"], args["reg"]
    if not _is_weight(args["pos_cls_weight"]):
        return f"pos_cls_weight must be a finite number >= 0, got {args['pos_cls_weight']!r}"
    if not isinstance(cls, Mapping) or set(cls) != {"type", "alpha", "gamma", "weight"} or cls["type"] != FOCAL_TYPE:
        return f"cls must be {{type: {FOCAL_TYPE}, alpha, gamma, weight}}, got {cls!r}"
    if not (_is_weight(cls["alpha"]) and cls["alpha"] <= 1 and _is_weight(cls["gamma"]) and _is_weight(cls["weight"])):
        return f"cls.alpha must be in [0, 1], cls.gamma and cls.weight finite numbers >= 0, got {cls!r}"
    if not isinstance(reg, Mapping) or not {"type", "sigma", "weight"} <= set(reg) <= {"type", "sigma", "weight",
                                                                                     "codewise"} \
            or reg["type"] != SMOOTH_L1_TYPE or reg.get("codewise", True) is not True:
        return (f"reg must be {{type: {SMOOTH_L1_TYPE}, sigma, codewise: true, weight}} (its loss is code-wise), "
                f"got {reg!r}")
    if not (_is_weight(reg["sigma"]) and reg["sigma"] > 0 and _is_weight(reg["weight"])):
        return f"reg.sigma must be a finite number > 0 and reg.weight one >= 0, got {reg!r}"
    return None


DIR_LOSS_TYPE = "WeightedSoftmaxClassificationLoss"  # CoAlign's and HEAL's `type` of the term, the only one


def _direction_block(block) -> bool:
    if not isinstance(block, Mapping) or not {"weight", "args"} <= set(block) <= {"weight", "args", "type"} \
            or block.get("type", DIR_LOSS_TYPE) != DIR_LOSS_TYPE or not isinstance(block["args"], Mapping):
        return False
    bins = block["args"].get("num_bins")
    return _is_weight(block["weight"]) and isinstance(bins, int) and not isinstance(bins, bool) and bins >= 1


@LOSSES.register("point_pillar_loss", required=(), optional=(
    ("loss.args.cls_weight", "number"), ("loss.args.reg", "any"),  # OpenCOOD's: reg a number; CoAlign's: a mapping
    ("loss.args.pos_cls_weight", "number"), ("loss.args.cls", "dict"), ("loss.args.cls.type", "str"),
    ("loss.args.cls.alpha", "number"), ("loss.args.cls.gamma", "number"), ("loss.args.cls.weight", "number"),
    ("loss.args.reg.type", "str"), ("loss.args.reg.sigma", "number"), ("loss.args.reg.codewise", "bool"),
    ("loss.args.reg.weight", "number"), ("loss.args.dir", "dict")), check=check_loss_weights)
def build_point_pillar_loss(args: Mapping) -> PointPillarLoss:
    direction = args.get("dir")
    heads = {} if direction is None else {"dir_weight": direction["weight"], "dir_bins": direction["args"]["num_bins"]}
    if not is_coalign_spelling(args):
        return PointPillarLoss(cls_weight=args["cls_weight"], reg=args["reg"], **heads)
    cls, reg = args["cls"], args["reg"]
    return PointPillarLoss(cls_weight=cls["weight"], reg=reg["weight"], pos_cls_weight=args["pos_cls_weight"],
                           alpha=cls["alpha"], gamma=cls["gamma"], beta=1.0 / float(reg["sigma"]) ** 2, **heads)


__all__ = ["PointPillarLoss", "build_point_pillar_loss", "sigmoid_focal_loss", "sigmoid_cross_entropy_with_logits", "smooth_l1",
           "add_sin_difference", "weighted_smooth_l1"]
