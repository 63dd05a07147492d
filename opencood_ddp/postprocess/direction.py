"""The direction classifier of CoAlign's and HEAL's PointPillar configs (``dir_args``).

The box regression encodes yaw through sin(a - b) (``loss.add_sin_difference``), which cannot tell a heading from
its opposite. These configs add a 1x1 head (``dir_head``, output ``dm``: ``num_bins`` logits per anchor) trained
to classify the heading into ``num_bins`` sectors of 2 pi / ``num_bins`` starting at ``dir_offset``; at decoding
the regressed yaw is folded into one sector's width and moved into the predicted sector. Three hypes blocks carry
the same values (CoAlign writes them once, as a YAML anchor):

- ``model.args.dir_args``: ``{dir_offset: radians, num_bins, anchor_yaw: degrees per anchor}`` builds the head;
- ``loss.args.dir``: ``{weight, args: <dir_args>}`` adds the softmax cross entropy on positive anchors;
- ``postprocess.dir_args``: ``<dir_args>`` makes the training label ``dir_targets`` (the sector of each anchor's
  target heading) beside the regression targets, and applies the head to the decoded boxes.

The arithmetic (CoAlign@64d1987 ``point_pillar_loss.get_direction_target``, ``voxel_postprocessor.post_process``):
the target sector of a positive anchor is ``floor(limit_period(yaw_gt - dir_offset, 0, 2 pi) / (2 pi / num_bins))``
clamped to [0, num_bins - 1], where ``yaw_gt`` is the regression target plus the anchor's yaw; the decoded yaw is
``limit_period(yaw - dir_offset, 0, period) + dir_offset + period * argmax(dm)`` with period 2 pi / num_bins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import numpy as np
import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key

MODEL_KEY = "model.args.dir_args"
LOSS_KEY = "loss.args.dir"
POST_KEY = "postprocess.dir_args"


@dataclass(frozen=True)
class DirectionArgs:
    dir_offset: float  # radians: where the first sector starts
    num_bins: int
    anchor_yaw: Tuple[float, ...]  # degrees, one per anchor of a cell, in the anchors' order

    @property
    def period(self) -> float:
        return 2 * math.pi / self.num_bins

    @classmethod
    def read(cls, block: Any, key: str, source: str) -> "DirectionArgs":
        """The ``dir_args`` mapping at hypes key ``key``, checked; one ConfigError line naming it otherwise."""
        fix = (f"; {key} is {{dir_offset: radians, num_bins: integer >= 1, anchor_yaw: [degrees per anchor]}} "
               f"(CoAlign: 0.7853, 2, [0, 90])")
        if not isinstance(block, Mapping) or set(block) != {"dir_offset", "num_bins", "anchor_yaw"}:
            raise ConfigError(f"{source}: key {key} must hold exactly dir_offset, num_bins and anchor_yaw, got "
                              f"{block!r}{fix}")
        offset, bins, yaws = block["dir_offset"], block["num_bins"], block["anchor_yaw"]
        numbers = isinstance(yaws, list) and yaws and all(_is_number(y) for y in yaws)
        if not (_is_number(offset) and isinstance(bins, int) and not isinstance(bins, bool) and bins >= 1 and numbers):
            raise ConfigError(f"{source}: key {key} has {block!r}{fix}")
        return cls(float(offset), bins, tuple(float(y) for y in yaws))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def limit_period(value, offset: float, period: float):
    """``value - floor(value / period + offset) * period`` (numpy or torch): into [-offset * period,
    (1 - offset) * period)."""
    floor = torch.floor if isinstance(value, torch.Tensor) else np.floor
    return value - floor(value / period + offset) * period


def direction_targets(targets: np.ndarray, args: DirectionArgs) -> np.ndarray:
    """(H, W, A) int64 sectors of the headings whose regression targets are ``targets`` (H, W, 7A): the yaw
    residual to the anchor (code 6) plus the anchor's yaw. A training label, made beside the regression targets."""
    rows, cols = targets.shape[:2]
    anchors = len(args.anchor_yaw)
    return heading_sectors(targets.reshape(rows, cols, anchors, 7)[..., 6], np.asarray(args.anchor_yaw), args)


def heading_sectors(yaw_residual: np.ndarray, anchor_yaw_deg: np.ndarray, args: DirectionArgs) -> np.ndarray:
    """int64 sectors of headings ``yaw_residual + anchor yaw`` (arrays that broadcast), one operation at a time
    per element: any subset of anchors gets the sectors ``direction_targets`` gives them."""
    heading = yaw_residual + np.deg2rad(anchor_yaw_deg)
    sector = np.floor(limit_period(heading - args.dir_offset, 0.0, 2 * math.pi) / args.period)
    return np.clip(np.nan_to_num(sector), 0, args.num_bins - 1).astype(np.int64)


def direction_logits(dm: torch.Tensor, num_bins: int) -> torch.Tensor:
    """(B, A * num_bins, H, W) head output -> (B, H * W * A, num_bins): the anchors' order, bins innermost."""
    return dm.permute(0, 2, 3, 1).reshape(dm.shape[0], -1, num_bins)


def apply_direction(yaw: torch.Tensor, logits: torch.Tensor, args: DirectionArgs) -> torch.Tensor:
    """Decoded yaws (N,) moved into the sectors their (N, num_bins) logits pick."""
    sector = torch.argmax(logits, dim=-1).to(yaw.dtype)
    return limit_period(yaw - args.dir_offset, 0.0, args.period) + args.dir_offset + args.period * sector


def check_direction_agreement(hypes: Mapping, source: str) -> None:
    """The three blocks are present together and hold the same values, one per anchor yaw of
    postprocess.anchor_args.r: a head without its loss would not train (and DDP would find it unused), one
    without its decoding would be ignored."""
    present = {key: get_key(hypes, key) is not None for key in (MODEL_KEY, LOSS_KEY, POST_KEY)}
    if not any(present.values()):
        return
    if not all(present.values()):
        have = ", ".join(key for key, there in present.items() if there)
        lack = ", ".join(key for key, there in present.items() if not there)
        raise ConfigError(f"{source}: the direction classifier needs {MODEL_KEY}, {LOSS_KEY} and {POST_KEY} "
                          f"together; the hypes have {have} but not {lack}: add it (CoAlign: the same dir_args "
                          f"in all three) or remove the others")
    loss = get_key(hypes, LOSS_KEY)
    if not isinstance(loss, Mapping) or not {"weight", "args"} <= set(loss) <= {"weight", "args", "type"} \
            or not _is_number(loss["weight"]) or loss["weight"] < 0:
        raise ConfigError(f"{source}: key {LOSS_KEY} must be {{weight: number >= 0, args: <dir_args>}}, got "
                          f"{loss!r}; CoAlign's is {{weight: 0.2, args: *dir_args}}")
    found = {key: DirectionArgs.read(get_key(hypes, key), key, source)
             for key in (MODEL_KEY, LOSS_KEY + ".args", POST_KEY)}
    if len(set(found.values())) != 1:
        raise ConfigError(f"{source}: {', '.join(found)} must hold the same dir_args, got "
                          f"{'; '.join(f'{k}: {v}' for k, v in found.items())}; write it once (a YAML anchor)")
    args = found[MODEL_KEY]
    yaws = get_key(hypes, "postprocess.anchor_args.r")
    if isinstance(yaws, list) and tuple(float(y) for y in yaws) != args.anchor_yaw:
        raise ConfigError(f"{source}: {MODEL_KEY}.anchor_yaw {list(args.anchor_yaw)} must be the anchors' yaws, "
                          f"postprocess.anchor_args.r {yaws}; fix the hypes")


__all__ = ["DirectionArgs", "apply_direction", "check_direction_agreement", "direction_logits", "direction_targets",
           "heading_sectors", "limit_period"]
