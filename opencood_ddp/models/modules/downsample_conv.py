"""F-Cooper's shrink header (upstream ``sub_modules/downsample_conv.py``): DoubleConv blocks that reduce channels.

Names as upstream: ``layers.{i}.double_conv`` = [Conv(k, stride, padding), ReLU, Conv(3, padding 1), ReLU],
both convolutions with bias.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn


class DoubleConv(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding), nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class DownsampleConv(nn.Module):
    """``shrink_header`` {kernal_size (sic), stride, padding, dim: one entry per block, input_dim}."""

    def __init__(self, cfg: Mapping):
        super().__init__()
        channels = int(cfg["input_dim"])
        self.layers = nn.ModuleList()
        for kernel, stride, padding, dim in zip(cfg["kernal_size"], cfg["stride"], cfg["padding"], cfg["dim"]):
            self.layers.append(DoubleConv(channels, int(dim), int(kernel), int(stride), int(padding)))
            channels = int(dim)
        self.out_channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
