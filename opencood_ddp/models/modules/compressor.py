"""Feature compression before fusion: what a CAV would send is the encoder's output, not the map itself.

Two designs, as upstream builds them (the module and parameter names are upstream's, so compressed checkpoints
load strictly both ways):

- ``NaiveCompressor`` (upstream ``sub_modules/naive_compress.py``; F-Cooper, V2VNet, V2X-ViT, CoBEVT, Where2comm,
  ``model.args.compression``): a 3x3 convolution squeezes the C channels to C / ratio, two 3x3 convolutions
  expand them back; every convolution with bias, each followed by BatchNorm (eps 1e-3, momentum 0.01) and ReLU.
  ``encoder`` = [Conv, BN, ReLU], ``decoder`` = [Conv, BN, ReLU, Conv, BN, ReLU].
- ``AutoEncoder`` (upstream ``sub_modules/auto_encoder.py``; AttFuse's ``base_bev_backbone.compression``): each
  of ``layers`` encoder steps halves the map's sides (a stride-2 3x3 convolution) and then its channels; the
  decoder undoes them in reverse order with stride-2 transposed convolutions. Convolutions without bias.
  ``encoder.{i}`` = [ZeroPad2d, Conv(stride 2), BN, ReLU, Conv(C -> C/2), BN, ReLU];
  ``decoder.{i}`` = [[ConvTranspose(C/2 -> C), BN, ReLU], [Conv(C -> C), BN, ReLU]], C = channels / 2^i.

Both run on every CAV's map, the ego's included, in training and evaluation: the model learns with the
bottleneck it will be evaluated with. Neither quantises: the saving is in the number of float32 values.
"""
from __future__ import annotations

from typing import List, Mapping, Optional

import torch
from torch import nn

from opencood_ddp.models.modules.activation import relu_after_norm


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)  # upstream's values for every compressor layer


def _conv_bn_relu(c_in: int, c_out: int, bias: bool) -> List[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride=1, padding=1, bias=bias), _bn(c_out), relu_after_norm()]


class NaiveCompressor(nn.Module):
    """(N, C, H, W) -> (N, C, H, W) through a (N, C / ratio, H, W) bottleneck: ``encoder``'s output."""

    def __init__(self, channels: int, ratio: int):
        super().__init__()
        if ratio < 1 or channels % ratio:
            raise ValueError(f"compression ratio {ratio} must be a positive divisor of {channels} channels")
        squeezed = channels // ratio
        self.encoder = nn.Sequential(*_conv_bn_relu(channels, squeezed, bias=True))
        self.decoder = nn.Sequential(*_conv_bn_relu(squeezed, channels, bias=True),
                                     *_conv_bn_relu(channels, channels, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def compression_ratio(args: Mapping) -> int:
    """``model.args.compression``: the naive compressor's channel ratio, 0 for none (absent or null too)."""
    return int(args.get("compression", 0) or 0)


def naive_compressor(args: Mapping, channels: int) -> Optional[NaiveCompressor]:
    """The compressor ``model.args.compression`` asks for on a map of ``channels`` (None for 0 or absent).

    Upstream fixes the compressor's width at 256 (its shrunk map); here it takes the map's own channels, which
    are 256 in upstream's configs."""
    ratio = compression_ratio(args)
    return NaiveCompressor(channels, ratio) if ratio > 0 else None


def _encoder_step(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.ZeroPad2d(1), nn.Conv2d(channels, channels, 3, stride=2, padding=0, bias=False),
                         _bn(channels), relu_after_norm(), *_conv_bn_relu(channels, channels // 2, bias=False))


def _decoder_step(channels: int) -> nn.Sequential:
    up = nn.Sequential(nn.ConvTranspose2d(channels // 2, channels, 2, stride=2, bias=False), _bn(channels),
                       relu_after_norm())
    return nn.Sequential(up, nn.Sequential(*_conv_bn_relu(channels, channels, bias=False)))


class AutoEncoder(nn.Module):
    """(N, C, H, W) -> (N, C, H, W) through (N, C / 2^layers, H / 2^layers, W / 2^layers).

    The sides come back to H and W only when 2^layers divides them (a stride-2 step rounds an odd side up), and
    the channels stay positive only when 2^layers divides C: ``models/checks.py`` refuses other settings, which
    upstream builds and then fails on (2^32-fold upsampling at ``compression: 32``)."""

    def __init__(self, channels: int, layers: int):
        super().__init__()
        widths = [channels // 2 ** i for i in range(layers)]
        self.encoder = nn.ModuleList(_encoder_step(c) for c in widths)
        self.decoder = nn.ModuleList(_decoder_step(c) for c in widths)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.encoder:
            x = step(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encode(x)
        for step in reversed(self.decoder):
            x = step(x)
        return x


__all__ = ["NaiveCompressor", "AutoEncoder", "compression_ratio", "naive_compressor"]
