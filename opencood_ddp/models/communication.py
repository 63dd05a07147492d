"""Communication volume: the bytes a non-ego CAV sends per frame, by model and compression.

Definitions (docs/compatibility.md, "Communication volume"), float32 values of 4 bytes, no header, index or
entropy coding counted:

- intermediate fusion (F-Cooper, V2VNet, V2X-ViT, CoBEVT, AttFuse, SECOND): every value of the maps the model
  fuses, as its class's ``sent_maps(model.args)`` names them: ``4 x sum(C x H x W)``. With
  ``model.args.compression`` = r the shrunk map is sent as the compressor's bottleneck, ``C / r`` channels; with
  AttFuse's ``base_bev_backbone.compression`` = L, level l is sent as its auto-encoder's bottleneck, channels and
  both sides divided by ``2^(L - l)`` (l < L).
- Where2comm: the same dense figure is what a CAV would send with every cell (level 0 of the backbone,
  uncompressed, with ``multi_scale``); it sends the share ``comm_rate`` of it (the model's output).
- late fusion: ``BOX_BYTES`` per box a CAV sends, a box being an anchor whose score passes the post-processor's
  ``score_threshold`` (what upstream's late fusion merges): 7 box values and the score.
- early fusion: the CAV's points, which the batch no longer tells apart; not counted (None).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

import torch

from opencood_ddp.hypes import hypes_source
from opencood_ddp.registry import MODELS

FLOAT32_BYTES = 4
BOX_VALUES = 8  # x, y, z, h, w, l, yaw and the score
BOX_BYTES = BOX_VALUES * FLOAT32_BYTES


def map_bytes(maps: Sequence[Tuple[int, int, int]]) -> int:
    """Bytes of float32 maps given as (channels, rows, cols)."""
    return FLOAT32_BYTES * sum(int(c) * int(h) * int(w) for c, h, w in maps)


def bytes_per_cav_frame(hypes: Mapping) -> Optional[int]:
    """Bytes of the maps one non-ego CAV sends per frame under the hypes' model and compression (every cell:
    Where2comm sends ``comm_rate`` of it); None for a model that sends no feature map (early and late fusion)
    or does not say (a model without ``sent_maps``). The hypes must have been through their yaml_parser."""
    entry = MODELS.get(hypes["model"]["core_method"], hypes_source(hypes))
    sent_maps = getattr(entry.obj, "sent_maps", None)
    maps = sent_maps(hypes["model"].get("args", {})) if sent_maps is not None else None
    return map_bytes(maps) if maps is not None else None


def boxes_above(psm: torch.Tensor, score_threshold: float) -> int:
    """How many anchors of (N, A, H, W) class logits score above the threshold: the boxes a late-fusion CAV
    sends (upstream's late post-processing keeps exactly these before its joint NMS)."""
    return int((psm.detach().sigmoid() > score_threshold).sum().item())


__all__ = ["FLOAT32_BYTES", "BOX_VALUES", "BOX_BYTES", "map_bytes", "bytes_per_cav_frame", "boxes_above"]
