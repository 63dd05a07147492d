"""The PointPillar detector family of the OPV2V benchmark (upstream ``opencood/models/point_pillar*.py``).

- ``PointPillar`` (``point_pillar``): one point cloud per sample; no fusion (early and late fusion use it).
- ``PointPillarIntermediate`` (``point_pillar_intermediate``, AttFuse): one BEV map per CAV, fused by
  attention at every backbone level (``record_len`` groups the CAVs of each sample).
- ``PointPillarFCooper`` (``point_pillar_fcooper``): per-CAV backbone output, optional shrink header, then
  F-Cooper's element-wise max over CAVs.

All take the batch's ``ego`` dict (``processed_lidar``; ``record_len`` for the fusion models) and return
``{'psm': (N, A, H, W) class logits, 'rm': (N, 7A, H, W) box residuals}`` with upstream's parameter names, so
upstream checkpoints load strictly (``tests/test_models.py`` checks every key and shape against the reference).
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key
from opencood_ddp.models.checks import check_shrink_header
from opencood_ddp.models.modules.bev_backbone import BaseBEVBackbone
from opencood_ddp.models.modules.downsample_conv import DownsampleConv
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion
from opencood_ddp.models.modules.pillar_vfe import PillarVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter
from opencood_ddp.registry import MODELS

NUM_POINT_FEATURES = 4  # x, y, z, intensity

_ARGS = "model.args."
PILLAR_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("voxel_size", "list"), ("lidar_range", "list"), ("anchor_number", "positive_int"),
    ("pillar_vfe.use_norm", "bool"), ("pillar_vfe.with_distance", "bool"),
    ("pillar_vfe.use_absolute_xyz", "bool"), ("pillar_vfe.num_filters", "list"),
    ("point_pillar_scatter.num_features", "positive_int"), ("base_bev_backbone.layer_nums", "list"), ("base_bev_backbone.layer_strides", "list"),
    ("base_bev_backbone.num_filters", "list"), ("base_bev_backbone.upsample_strides", "list"),
    ("base_bev_backbone.num_upsample_filter", "list")))
# Upstream keys these models read or carry; compression and backbone_fix are refused when switched on.
PILLAR_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("base_bev_backbone.compression", "int"), ("compression", "int"), ("backbone_fix", "bool"),
    ("anchor_num", "positive_int"),
    # Written by the yaml_parser; its absence gets its own hint in check_pillar_args.
    ("point_pillar_scatter.grid_size", "list")))
FCOOPER_OPTIONAL_KEYS = PILLAR_OPTIONAL_KEYS + ((_ARGS + "shrink_header", "dict"),)


def check_pillar_args(hypes: Mapping, source: str) -> None:
    """What the kinds of PILLAR_KEYS cannot say: the parser ran, the widths agree, no unbuilt upstream option."""
    if get_key(hypes, _ARGS + "point_pillar_scatter.grid_size") is None:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.grid_size is missing; add "
                          f"'yaml_parser: load_point_pillar_params' to the hypes so that it is computed")
    args = hypes["model"]["args"]
    if args["point_pillar_scatter"]["num_features"] != args["pillar_vfe"]["num_filters"][-1]:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.num_features "
                          f"({args['point_pillar_scatter']['num_features']}) must equal the last of "
                          f"model.args.pillar_vfe.num_filters ({args['pillar_vfe']['num_filters'][-1]}); fix the hypes")
    for key in ("model.args.base_bev_backbone.compression", "model.args.compression"):
        if get_key(hypes, key, 0):
            raise ConfigError(f"{source}: {key} > 0 (feature compression) is not implemented; set it to 0")
    if get_key(hypes, "model.args.backbone_fix", False):
        raise ConfigError(f"{source}: model.args.backbone_fix true is not supported (upstream freezes every "
                          f"parameter of the model with it, heads included); set it to false")


def anchor_number(args: Mapping) -> int:
    return int(args["anchor_number"])


_PILLAR = dict(required=PILLAR_KEYS, optional=PILLAR_OPTIONAL_KEYS, check=check_pillar_args)


@MODELS.register("point_pillar", fusion="none", **_PILLAR)
class PointPillar(nn.Module):
    """Pillars -> BEV -> backbone -> 1x1 heads; also the shared encoder of the fusion variants."""

    fusion_factory = None

    def __init__(self, args: Mapping):
        super().__init__()
        self.pillar_vfe = PillarVFE(args["pillar_vfe"], NUM_POINT_FEATURES, args["voxel_size"], args["lidar_range"])
        self.scatter = PointPillarScatter(args["point_pillar_scatter"])
        self.backbone = BaseBEVBackbone(args["base_bev_backbone"], self.pillar_vfe.get_output_feature_dim(),
                                        fusion_factory=self.fusion_factory)
        self.build_neck(args)
        channels = self.head_channels()
        self.cls_head = nn.Conv2d(channels, anchor_number(args), kernel_size=1)
        self.reg_head = nn.Conv2d(channels, 7 * anchor_number(args), kernel_size=1)

    def build_neck(self, args: Mapping) -> None:
        """Modules between the backbone and the heads (none here)."""

    def head_channels(self) -> int:
        return self.backbone.num_bev_features

    @staticmethod
    def num_images(data_dict: Mapping) -> Optional[int]:
        """How many BEV maps the batch has: CAVs when grouped by record_len, else samples."""
        if data_dict.get("record_len") is not None:
            return int(data_dict["record_len"].sum().item())
        if data_dict.get("object_bbx_center") is not None:
            return int(data_dict["object_bbx_center"].shape[0])
        return None

    def encode(self, data_dict: Mapping) -> torch.Tensor:
        lidar = data_dict["processed_lidar"]
        batch = {"voxel_features": lidar["voxel_features"], "voxel_coords": lidar["voxel_coords"],
                 "voxel_num_points": lidar["voxel_num_points"], "record_len": data_dict.get("record_len")}
        batch = self.pillar_vfe(batch)
        batch = self.scatter(batch, self.num_images(data_dict))
        return self.backbone(batch)["spatial_features_2d"]

    def neck(self, features: torch.Tensor, data_dict: Mapping) -> torch.Tensor:
        return features

    def forward(self, data_dict: Mapping) -> dict:
        features = self.neck(self.encode(data_dict), data_dict)
        return {"psm": self.cls_head(features), "rm": self.reg_head(features)}


@MODELS.register("point_pillar_intermediate", fusion="intermediate (attention)", **_PILLAR)
class PointPillarIntermediate(PointPillar):
    """AttFuse: attention fusion of the CAVs' features at every backbone level."""

    fusion_factory = AttFusion


def check_fcooper_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, and a shrink header (when there is one) that takes the backbone's output."""
    check_pillar_args(hypes, source)
    check_shrink_header(hypes["model"]["args"], source)


@MODELS.register("point_pillar_fcooper", fusion="intermediate (max)", required=PILLAR_KEYS,
                 optional=FCOOPER_OPTIONAL_KEYS, check=check_fcooper_args)
class PointPillarFCooper(PointPillar):
    """F-Cooper: max fusion of the CAVs' backbone output (after the optional shrink header)."""

    def build_neck(self, args: Mapping) -> None:
        self.shrink_conv = DownsampleConv(args["shrink_header"]) if "shrink_header" in args else None
        self.fusion_net = MaxFusion()

    def head_channels(self) -> int:
        return self.shrink_conv.out_channels if self.shrink_conv is not None else self.backbone.num_bev_features

    def neck(self, features: torch.Tensor, data_dict: Mapping) -> torch.Tensor:
        if self.shrink_conv is not None:
            features = self.shrink_conv(features)
        return self.fusion_net(features, data_dict["record_len"])
