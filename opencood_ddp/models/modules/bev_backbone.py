"""The 2D BEV backbone: strided conv levels, each upsampled to a common stride and concatenated.

Upstream ``sub_modules/base_bev_backbone.py`` (and ``att_bev_backbone.py`` for AttFuse). Module indices are
upstream's: ``blocks.{level}`` = [ZeroPad2d, Conv(stride), BN, ReLU, (Conv, BN, ReLU) x layer_nums],
``deblocks.{level}`` = [ConvTranspose2d (or Conv2d for an upsample stride < 1), BN, ReLU]; BatchNorm eps 1e-3,
momentum 0.01. With a ``fusion`` module per level (AttFuse), each level's output is fused across CAVs before
its deblock (warped into the ego's frame first when the batch dict holds an ``ego_warp``), while the next level
keeps working on every CAV's unfused map.

``compression`` L > 0 (AttFuse's ``base_bev_backbone.compression``, upstream's ``AttBEVBackbone``) adds an
``AutoEncoder`` of L - level steps after each level's blocks while L - level > 0 (``compression_modules.{level}``):
every CAV's map goes through it before the fusion, and the decoded map also feeds the next level, as upstream's.
"""
from __future__ import annotations

from typing import Callable, List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from opencood_ddp.models.modules.activation import relu_after_norm
from opencood_ddp.models.modules.compressor import AutoEncoder


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)


def _level(c_in: int, c_out: int, stride: int, extra_layers: int) -> nn.Sequential:
    layers: List[nn.Module] = [nn.ZeroPad2d(1), nn.Conv2d(c_in, c_out, 3, stride=stride, padding=0, bias=False),
                               _bn(c_out), relu_after_norm()]
    for _ in range(extra_layers):
        layers += [nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), _bn(c_out), relu_after_norm()]
    return nn.Sequential(*layers)


def _deblock(c_in: int, c_out: int, stride: float) -> nn.Sequential:
    if stride >= 1:
        conv: nn.Module = nn.ConvTranspose2d(c_in, c_out, int(stride), stride=int(stride), bias=False)
    else:
        down = int(np.round(1 / stride))
        conv = nn.Conv2d(c_in, c_out, down, stride=down, bias=False)
    return nn.Sequential(conv, _bn(c_out), relu_after_norm())


class BaseBEVBackbone(nn.Module):
    """(N, C_in, H, W) -> (N, sum(num_upsample_filter), H / s, W / s); optionally fused per level."""

    def __init__(self, cfg: Mapping, input_channels: int,
                 fusion_factory: Optional[Callable[[int], nn.Module]] = None, compression: int = 0):
        super().__init__()
        layer_nums, strides = list(cfg["layer_nums"]), list(cfg["layer_strides"])
        filters = list(cfg["num_filters"])
        up_strides = list(cfg.get("upsample_strides", []))
        up_filters = list(cfg.get("num_upsample_filter", []))
        if not len(layer_nums) == len(strides) == len(filters) or len(up_strides) != len(up_filters):
            raise ValueError("base_bev_backbone: layer_nums, layer_strides and num_filters must have one entry per "
                             "level, upsample_strides and num_upsample_filter the same length")
        c_in = [input_channels] + filters[:-1]
        self.blocks = nn.ModuleList(_level(c_in[i], filters[i], strides[i], layer_nums[i])
                                    for i in range(len(filters)))
        self.deblocks = nn.ModuleList(_deblock(filters[i], up_filters[i], up_strides[i])
                                      for i in range(min(len(filters), len(up_strides))))
        channels = sum(up_filters) if up_filters else filters[-1]
        if len(up_strides) > len(filters):  # one extra deblock on the concatenation, as upstream
            self.deblocks.append(_deblock(channels, channels, up_strides[-1]))
        self.fuse_modules = (nn.ModuleList(fusion_factory(f) for f in filters)
                             if fusion_factory is not None else None)
        # Registered after the deblocks: upstream's state-dict order.
        self.compression_modules = (nn.ModuleList(AutoEncoder(f, compression - level) for level, f in
                                                  enumerate(filters) if compression - level > 0)
                                    if compression > 0 else None)
        self.num_bev_features = channels

    def forward(self, batch_dict: dict) -> dict:
        x = batch_dict["spatial_features"]
        record_len = batch_dict.get("record_len")
        ups = []
        for level, block in enumerate(self.blocks):
            x = block(x)
            if self.compression_modules is not None and level < len(self.compression_modules):
                x = self.compression_modules[level](x)
            out = (x if self.fuse_modules is None
                   else self.fuse_modules[level](x, record_len, batch_dict.get("ego_warp")))
            ups.append(self.deblocks[level](out) if len(self.deblocks) > 0 else out)
        x = torch.cat(ups, dim=1) if len(ups) > 1 else ups[0]
        if len(self.deblocks) > len(self.blocks):
            x = self.deblocks[-1](x)
        batch_dict["spatial_features_2d"] = x
        return batch_dict
