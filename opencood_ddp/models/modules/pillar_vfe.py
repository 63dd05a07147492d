"""Pillar feature net: the points of each pillar -> one feature vector (upstream ``sub_modules/pillar_vfe.py``).

Parameter names follow upstream (``pfn_layers.{i}.linear``, ``pfn_layers.{i}.norm``) so that its checkpoints
load strictly. Each point is decorated with its offset from the pillar's point mean (3) and from the pillar's
geometric centre (3), optionally its raw x, y, z (``use_absolute_xyz``) and its range (``with_distance``);
padded rows are zeroed before the shared linear layers and the max over the pillar's points.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from opencood_ddp.models.modules.cav_layout import device_constant
from opencood_ddp.models.modules.precision import in_full_precision


class PFNLayer(nn.Module):
    """Linear (+ BatchNorm1d) + ReLU over points, then max over the pillar; inner layers concatenate both."""

    def __init__(self, in_channels: int, out_channels: int, use_norm: bool, last_layer: bool):
        super().__init__()
        self.last_layer = last_layer
        if not last_layer:
            out_channels //= 2  # the max-pooled copy is concatenated back: 2 x out/2 channels
        self.use_norm = use_norm
        self.linear = nn.Linear(in_channels, out_channels, bias=not use_norm)
        if use_norm:
            self.norm = nn.BatchNorm1d(out_channels, eps=1e-3, momentum=0.01)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        pillars, points, channels = inputs.shape
        # Rows are (pillar, point) pairs: BatchNorm1d's statistics run over pillars x points either way, and the
        # contiguous (M*P, C) layout is 2.6x faster on CPU (forward + backward) than upstream's permuted (M, C, P).
        # Sizes are spelled out, never -1: a batch without a single pillar (no point in range) is (0, P, C), and
        # reshape cannot infer a dimension from 0 elements. That batch still runs every layer, BatchNorm
        # included (a (0, C) input leaves its running statistics alone and gives its weight and bias zero
        # gradients), so every parameter is in the graph and every rank makes the same collectives.
        rows = inputs.reshape(pillars * points, channels)
        if self.use_norm:
            # In float32 under --half. The BatchNorm: a rank without a pillar must send SyncBN float32 statistics.
            # The Linear: its inputs are coordinates in metres, which bfloat16 holds 0.5 m apart at 100 m, more
            # than a pillar's width; and in float32 the step casts neither its input nor its weight, nor back for
            # the BatchNorm (5 casts fewer, forward and backward). Its arithmetic is 2 x 10 x 64 FLOPs a point.
            x = in_full_precision(lambda r: self.norm(self.linear(r)), rows)
        else:
            x = self.linear(rows)
        # In place: neither the Linear nor BatchNorm keeps its output for the backward (modules/activation.py).
        x = torch.relu_(x).reshape(pillars, points, x.shape[-1])
        x_max = x.max(dim=1, keepdim=True).values
        if self.last_layer:
            return x_max
        return torch.cat([x, x_max.expand(-1, inputs.shape[1], -1)], dim=2)


class PillarVFE(nn.Module):
    """(M, P, 4) padded pillar points -> (M, C) pillar features."""

    def __init__(self, cfg: Mapping, num_point_features: int, voxel_size: Sequence[float],
                 point_cloud_range: Sequence[float]):
        super().__init__()
        self.use_norm = bool(cfg["use_norm"])
        self.with_distance = bool(cfg["with_distance"])
        self.use_absolute_xyz = bool(cfg["use_absolute_xyz"])
        in_channels = num_point_features + (6 if self.use_absolute_xyz else 3) + (1 if self.with_distance else 0)
        filters = [in_channels] + list(cfg["num_filters"])
        self.pfn_layers = nn.ModuleList(
            PFNLayer(filters[i], filters[i + 1], self.use_norm, last_layer=i >= len(filters) - 2)
            for i in range(len(filters) - 1))
        self.voxel_size = [float(v) for v in voxel_size]
        self.offset = [float(voxel_size[i]) / 2 + float(point_cloud_range[i]) for i in range(3)]
        self.num_filters = filters[-1]

    def get_output_feature_dim(self) -> int:
        return self.num_filters

    def decorate(self, voxels: torch.Tensor, num_points: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        """Per point: [raw features, offset from the pillar mean, offset from the pillar centre, (range)].

        Padded rows are zeroed first: spconv writes zeros there, which upstream's mean relies on; zeroing makes
        the result independent of what a padded row holds. The decorated padded rows are zeroed again at the
        end (their centre offset is not zero), as upstream; they still enter the max after the linear layer.
        """
        real = torch.arange(voxels.shape[1], device=voxels.device).view(1, -1) < num_points.view(-1, 1)
        voxels = torch.where(real.unsqueeze(-1), voxels, voxels.new_zeros(()))
        xyz = voxels[:, :, :3]
        counts = num_points.clamp(min=1).to(voxels.dtype).view(-1, 1, 1)
        from_mean = xyz - xyz.sum(dim=1, keepdim=True) / counts
        # coords are (batch, z, y, x): the centre of the pillar on each axis. A flip, not coords[:, [3, 2, 1]]:
        # on a GPU a Python list index is a blocking host-to-device copy (so is new_tensor; device_constant).
        grid = coords[:, 1:4].flip(1).to(voxels.dtype)
        centre = grid * device_constant(self.voxel_size, xyz) + device_constant(self.offset, xyz)
        from_centre = xyz - centre.unsqueeze(1)
        raw = voxels if self.use_absolute_xyz else voxels[:, :, 3:]
        parts = [raw, from_mean, from_centre]
        if self.with_distance:
            parts.append(torch.linalg.vector_norm(xyz, dim=2, keepdim=True))
        features = torch.cat(parts, dim=-1)
        return features * real.unsqueeze(-1).to(features.dtype)

    def forward(self, batch_dict: dict) -> dict:
        features = self.decorate(batch_dict["voxel_features"], batch_dict["voxel_num_points"],
                                 batch_dict["voxel_coords"])
        for pfn in self.pfn_layers:
            features = pfn(features)
        batch_dict["pillar_features"] = features.squeeze(1)
        return batch_dict
