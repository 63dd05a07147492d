"""SECOND's voxel feature encoder (upstream ``sub_modules/mean_vfe.py``): the mean of each voxel's points.

No parameters. Padded rows are zeroed before the sum: spconv's voxelizer writes zeros there, which upstream's
mean relies on; masking makes the result independent of what a padded row holds (as ``PillarVFE`` does).
"""
from __future__ import annotations

import torch
from torch import nn


class MeanVFE(nn.Module):
    """(V, P, C) padded voxel points and (V,) real-point counts -> (V, C) mean point of each voxel."""

    def __init__(self, num_point_features: int):
        super().__init__()
        self.num_point_features = int(num_point_features)

    def get_output_feature_dim(self) -> int:
        return self.num_point_features

    def forward(self, batch_dict: dict) -> dict:
        voxels, counts = batch_dict["voxel_features"], batch_dict["voxel_num_points"]
        # Broadcasting and type promotion do what views and casts would: (P,) < (V, 1) is the (V, P) mask, and a
        # float times a bool, or over an integer, computes in the float's type, as the cast operands would, with
        # the same results. Nine ops instead of twelve (issue 52's op budget).
        real = torch.arange(voxels.shape[1], device=voxels.device) < counts.view(-1, 1)
        total = (voxels * real.unsqueeze(-1)).sum(dim=1)
        # A voxel always has a point; the clamp only keeps a malformed count of 0 from dividing by zero.
        batch_dict["voxel_features"] = total / counts.clamp(min=1).view(-1, 1)
        return batch_dict
