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

from typing import Mapping, Optional

import torch
from torch import nn

from opencood_ddp.models.modules.bev_backbone import BaseBEVBackbone
from opencood_ddp.models.modules.downsample_conv import DownsampleConv
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion
from opencood_ddp.models.modules.pillar_vfe import PillarVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter

NUM_POINT_FEATURES = 4  # x, y, z, intensity


def anchor_number(args: Mapping) -> int:
    return int(args["anchor_number"])


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


class PointPillarIntermediate(PointPillar):
    """AttFuse: attention fusion of the CAVs' features at every backbone level."""

    fusion_factory = AttFusion


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
