"""``create_model(hypes)``: the model class named by ``model.core_method``, built from ``model.args``.

As upstream's ``opencood/tools/train_utils.create_model``: point_pillar (early and late fusion),
point_pillar_intermediate (AttFuse) and point_pillar_fcooper. The hypes must have been through their
``yaml_parser`` (``load_point_pillar_params`` fills ``point_pillar_scatter.grid_size``).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Tuple, Type

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key, hypes_source, validate
from opencood_ddp.models.point_pillar import PointPillar, PointPillarFCooper, PointPillarIntermediate

MODELS: Dict[str, Type[PointPillar]] = {
    "point_pillar": PointPillar,
    "point_pillar_intermediate": PointPillarIntermediate,
    "point_pillar_fcooper": PointPillarFCooper,
}

_ARGS = "model.args."
REQUIRED_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("voxel_size", "list"), ("lidar_range", "list"), ("anchor_number", "positive_int"),
    ("pillar_vfe.use_norm", "bool"), ("pillar_vfe.with_distance", "bool"),
    ("pillar_vfe.use_absolute_xyz", "bool"), ("pillar_vfe.num_filters", "list"),
    ("point_pillar_scatter.num_features", "positive_int"), ("point_pillar_scatter.grid_size", "list"),
    ("base_bev_backbone.layer_nums", "list"), ("base_bev_backbone.layer_strides", "list"),
    ("base_bev_backbone.num_filters", "list"), ("base_bev_backbone.upsample_strides", "list"),
    ("base_bev_backbone.num_upsample_filter", "list")))
OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("base_bev_backbone.compression", "int"), ("compression", "int"), ("backbone_fix", "bool"),
    ("shrink_header", "dict"), ("anchor_num", "positive_int"), ("bn_momentum", "number"),
    ("cls_head_prior", "number")))


def create_model(hypes: Mapping) -> nn.Module:
    source = hypes_source(hypes)
    validate(hypes, (("model.core_method", "str"),), source)
    name = hypes["model"]["core_method"]
    if name not in MODELS:
        raise ConfigError(f"{source}: model.core_method {name!r} is not one of {', '.join(MODELS)}; fix the hypes")
    if get_key(hypes, "model.args.point_pillar_scatter.grid_size") is None and "yaml_parser" not in hypes:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.grid_size is missing; add "
                          f"'yaml_parser: load_point_pillar_params' to the hypes so that it is computed")
    validate(hypes, REQUIRED_KEYS, source, OPTIONAL_KEYS)
    _check_supported(hypes, source)
    args = hypes["model"]["args"]
    if args["point_pillar_scatter"]["num_features"] != args["pillar_vfe"]["num_filters"][-1]:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.num_features "
                          f"({args['point_pillar_scatter']['num_features']}) must equal the last of "
                          f"model.args.pillar_vfe.num_filters ({args['pillar_vfe']['num_filters'][-1]}); fix the hypes")
    try:
        model = MODELS[name](args)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{source}: model.args do not build a {name} ({type(exc).__name__}: {exc}); "
                          f"fix the hypes") from None
    if "bn_momentum" in args:
        set_bn_momentum(model, args["bn_momentum"], source)
    if "cls_head_prior" in args:
        init_cls_prior(model, args["cls_head_prior"], source)
    return model


def init_cls_prior(model: nn.Module, prior: float, source: str) -> None:
    """Our extension ``model.args.cls_head_prior``: start every anchor at this foreground probability.

    Upstream leaves the class head's bias at PyTorch's default (scores start near 0.5), so the first few
    thousand steps of the focal loss go into pushing the ~10^4 background anchors of each frame down. The
    focal-loss paper (and OpenPCDet's PointPillars) initialise the bias to logit(0.01) instead; learning then
    starts on the objects at once. Only the initial value changes: checkpoints and parameter names do not.
    """
    if not 0 < prior < 1:
        raise ConfigError(f"{source}: model.args.cls_head_prior must be in (0, 1), got {prior!r}; fix the hypes")
    with torch.no_grad():
        model.cls_head.bias.fill_(-math.log((1 - prior) / prior))


def set_bn_momentum(model: nn.Module, momentum: float, source: str) -> None:
    """Our extension ``model.args.bn_momentum``: the BatchNorm running-statistics momentum of every layer.

    Upstream hard-codes 0.01, which suits ~10^5 steps: the running statistics used at evaluation reach
    1 - 0.99^n of the batch statistics after n steps. A toy run of a few hundred steps evaluates with
    half-converged statistics, so the toy configs set 0.1 (PyTorch's default). Absent, upstream's values.
    """
    if not 0 < momentum <= 1:
        raise ConfigError(f"{source}: model.args.bn_momentum must be in (0, 1], got {momentum!r}; fix the hypes")
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = float(momentum)


def _check_supported(hypes: Mapping, source: str) -> None:
    """Upstream options these baselines do not use, refused rather than silently ignored."""
    for key in ("model.args.base_bev_backbone.compression", "model.args.compression"):
        if get_key(hypes, key, 0):
            raise ConfigError(f"{source}: {key} > 0 (feature compression) is not implemented; set it to 0")
    if get_key(hypes, "model.args.backbone_fix", False):
        raise ConfigError(f"{source}: model.args.backbone_fix true is not supported (upstream freezes every "
                          f"parameter of the model with it, heads included); set it to false")


__all__ = ["create_model", "MODELS", "PointPillar", "PointPillarIntermediate", "PointPillarFCooper"]
