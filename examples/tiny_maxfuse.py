"""A model from outside the package: the worked example of docs/adding_a_model.md.

List this module under the hypes' ``imports:`` (``imports: [tiny_maxfuse]``, with ``examples/`` on
``PYTHONPATH``) and name it in ``model.core_method``; train_ddp.py then trains it with no edit of opencood_ddp.
It reuses the package's pillar encoder and scatter, runs one strided convolution per CAV, fuses the CAVs of
each sample by an element-wise max (F-Cooper's rule) and ends in upstream's two 1x1 heads, so the
IntermediateFusionDataset, VoxelPostprocessor and point_pillar_loss of a PointPillar config work unchanged.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.models.modules.pillar_vfe import PillarVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter
from opencood_ddp.registry import MODELS

_ARGS = "model.args."


def check_tiny_args(hypes: Mapping, source: str) -> None:
    """Cross-key rule of this model: the heads run at the anchors' feature stride."""
    stride = hypes["postprocess"]["anchor_args"].get("feature_stride", 2)
    if hypes["model"]["args"]["stride"] != stride:
        raise ConfigError(f"{source}: model.args.stride ({hypes['model']['args']['stride']}) must equal "
                          f"postprocess.anchor_args.feature_stride ({stride}); fix the hypes")


@MODELS.register("tiny_maxfuse", fusion="intermediate (max)", check=check_tiny_args, required=(
        (_ARGS + "voxel_size", "list"), (_ARGS + "lidar_range", "list"), (_ARGS + "anchor_number", "positive_int"),
        (_ARGS + "pillar_vfe", "dict"), (_ARGS + "point_pillar_scatter.grid_size", "list"),
        (_ARGS + "width", "positive_int"), (_ARGS + "stride", "positive_int")))
class TinyMaxFuse(nn.Module):
    def __init__(self, args: Mapping):
        super().__init__()
        width = int(args["width"])
        self.pillar_vfe = PillarVFE(args["pillar_vfe"], 4, args["voxel_size"], args["lidar_range"])
        features = self.pillar_vfe.get_output_feature_dim()
        self.scatter = PointPillarScatter({"num_features": features,
                                           "grid_size": args["point_pillar_scatter"]["grid_size"]})
        self.conv = nn.Sequential(nn.Conv2d(features, width, 3, stride=int(args["stride"]), padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.cls_head = nn.Conv2d(width, int(args["anchor_number"]), kernel_size=1)
        self.reg_head = nn.Conv2d(width, 7 * int(args["anchor_number"]), kernel_size=1)

    def forward(self, data_dict: Mapping) -> dict:
        lidar, record_len = data_dict["processed_lidar"], data_dict["record_len"]
        batch = self.pillar_vfe({**lidar, "record_len": record_len})
        bev = self.conv(self.scatter(batch, int(record_len.sum()))["spatial_features"])
        fused = torch.stack([cavs.max(dim=0).values for cavs in torch.split(bev, record_len.tolist())])
        return {"psm": self.cls_head(fused), "rm": self.reg_head(fused)}
