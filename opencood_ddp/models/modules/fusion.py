"""Feature fusion across the CAVs of one sample: AttFuse's attention and F-Cooper's max.

A batch holds the CAVs of all its samples one after the other; ``record_len[b]`` says how many belong to
sample ``b`` (the ego first). Both fusions return one map per sample. Neither has parameters, so they add no
state-dict keys (as upstream's ``AttFusion`` and ``SpatialFusion``). Given an ``EgoWarp`` (``proj_first:
false``), both first resample every CAV's map in its ego's frame, as CoAlign's ``Att_w_Warp`` and
``Max_w_Warp`` (``modules/ego_warp.py``); without one they fuse the maps as they come, as OpenCOOD's.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import nn

from opencood_ddp.models.modules.cav_layout import counts
from opencood_ddp.models.modules.ego_warp import EgoWarp, to_ego_frame
from opencood_ddp.models.modules.precision import in_full_precision


def regroup(x: torch.Tensor, record_len: torch.Tensor) -> List[torch.Tensor]:
    """(sum(record_len), C, H, W) -> one (record_len[b], C, H, W) tensor per sample."""
    return list(torch.split(x, list(counts(record_len))))


class AttFusion(nn.Module):
    """Per BEV cell, scaled dot-product self-attention over the sample's CAV features; keeps the ego's row.

    Upstream ``sub_modules/self_attn.py``: query = key = value = the CAVs' C-vectors at that cell, scaled by
    sqrt(C). Only the ego's output is kept, so this is attention of the ego's feature over all CAVs.
    """

    def __init__(self, feature_dim: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(feature_dim)

    def ego_weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """(cells, cavs, C) -> (cells, 1, cavs): the ego row of the attention matrix (only it is used)."""
        # float32 logits under --half: a dot product of C-vectors overflows float16 (modules/precision.py)
        return in_full_precision(
            lambda t: torch.softmax(torch.bmm(t[:, :1], t.transpose(1, 2)) * self.scale, dim=-1), tokens)

    def forward(self, x: torch.Tensor, record_len: torch.Tensor, warp: Optional[EgoWarp] = None) -> torch.Tensor:
        fused = []
        for cavs in regroup(to_ego_frame(x, warp), record_len):
            n, c, h, w = cavs.shape
            tokens = cavs.reshape(n, c, h * w).permute(2, 0, 1)  # (cells, cavs, C)
            out = torch.bmm(self.ego_weights(tokens), tokens)  # (cells, 1, C)
            fused.append(out.permute(1, 2, 0).reshape(1, c, h, w))
        return torch.cat(fused, dim=0)


class MaxFusion(nn.Module):
    """F-Cooper's maxout fusion (upstream ``SpatialFusion``): element-wise max over the sample's CAVs."""

    def forward(self, x: torch.Tensor, record_len: torch.Tensor, warp: Optional[EgoWarp] = None) -> torch.Tensor:
        return torch.cat([cavs.max(dim=0, keepdim=True).values
                          for cavs in regroup(to_ego_frame(x, warp), record_len)], dim=0)
