"""The neck of the pillar models that fuse a shrunk map (F-Cooper, point_pillar_opv2v, V2X-ViT, CoBEVT, V2VNet,
Where2comm): between the backbone and the fusion, upstream's optional shrink header (``DownsampleConv``: fewer
channels and, with a stride, a smaller map) and then its optional naive compressor (``model.args.compression``).
Early and late fusion's ``point_pillar`` (``SinglePointPillar``) takes it too, for the forks' shrink header before
its heads; it fuses nothing, sends no map and refuses compression.

``ShrinkNeck`` is a mixin of the model class, not a submodule: the two layers are the model's own attributes
``shrink_conv`` and ``naive_compressor``, upstream's names, so the state dict keys stay upstream's
(``shrink_conv.layers.0...``, ``naive_compressor.encoder...``); a container module would prefix them and
upstream checkpoints would no longer load. ``BACKBONE_FIX`` (point_pillar.py) freezes them by these names.

Whether there is a shrink header is ``checks.shrink_header(args)``, the rule the hypes checks and the map
geometry follow too. The hypes rules of the neck are ``checks.check_shrink_neck``: the header's keys, and a
compression ratio that divides its width; it returns that width, which each model's check compares with its
fusion's (``SHRINK_HEADER_KEYS`` are the keys a model entry declares for the header).
"""
from __future__ import annotations

from typing import List, Mapping, Tuple

import torch

from opencood_ddp.models.checks import head_channels, shrink_header, shrunk_map_size
from opencood_ddp.models.modules.compressor import compression_ratio, naive_compressor
from opencood_ddp.models.modules.downsample_conv import DownsampleConv


class ShrinkNeck:
    """Mixin for a ``PointPillar`` model whose fusion (or, in ``SinglePointPillar``, whose heads) takes the shrunk,
    compressed map; listed before ``PointPillar`` in the bases, so that its ``head_channels`` and ``sent_maps`` are
    the ones used (``SinglePointPillar`` overrides ``sent_maps``: it sends none).

    The model's ``build_neck`` calls ``build_shrink_neck(args)`` before it builds its fusion (upstream's order:
    the parameters, and the initial weights drawn from a seed, come in that order), and its forward pass runs
    ``shrink_and_compress`` (or ``shrink`` and ``compress`` apart) on every CAV's map before fusing."""

    def build_shrink_neck(self, args: Mapping) -> None:
        header = shrink_header(args)
        self.shrink_conv = DownsampleConv(header) if header is not None else None
        self.naive_compressor = naive_compressor(args, self.shrunk_channels())

    def shrunk_channels(self) -> int:
        """Channels of the backbone's map after the shrink header (the backbone's own without one): what the
        compressor takes and gives back, what the fusion takes, and so what the heads read."""
        if self.shrink_conv is not None:
            return self.shrink_conv.out_channels
        return self.backbone.num_bev_features

    def head_channels(self) -> int:
        # Every fusion here keeps the width: each model's check makes its fusion's width check_shrink_neck's.
        return self.shrunk_channels()

    def shrink(self, features: torch.Tensor) -> torch.Tensor:
        return self.shrink_conv(features) if self.shrink_conv is not None else features

    def compress(self, features: torch.Tensor) -> torch.Tensor:
        """The compressor (encoder and decoder) on every CAV's map, the ego's included, as upstream: the model
        learns with the bottleneck it is evaluated with."""
        return self.naive_compressor(features) if self.naive_compressor is not None else features

    def shrink_and_compress(self, features: torch.Tensor) -> torch.Tensor:
        return self.compress(self.shrink(features))

    @classmethod
    def sent_maps(cls, args: Mapping) -> List[Tuple[int, int, int]]:
        """The one (channels, rows, cols) map a non-ego CAV sends per frame: the shrunk map, or the compressor's
        bottleneck (channels / ratio) when compressed (models/communication.py counts it)."""
        rows, cols = shrunk_map_size(args)
        return [(head_channels(args) // (compression_ratio(args) or 1), rows, cols)]


__all__ = ["ShrinkNeck"]
