"""Hypes rules that several models share, and the one form of their error line.

Each rule raises ``ConfigError("<hypes file>: <what is wrong and what it must equal>; fix the hypes")`` through
``refuse``, so every model's errors read alike. The map geometry the rules need (the backbone's output channels,
the channels and stride of the map the heads see) is computed here from ``model.args`` with the same rules as
``BaseBEVBackbone`` and ``DownsampleConv``, before anything is built.
"""
from __future__ import annotations

import math
from typing import Mapping, NoReturn, Optional, Sequence

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key

ARGS = "model.args."
SHRINK = ARGS + "shrink_header."
SHRINK_LISTS = ("kernal_size", "stride", "padding", "dim")  # upstream's spelling of kernal_size
# train_params.max_cav when the hypes leave it out: the datasets' default, as upstream's.
DEFAULT_MAX_CAV = 7


def refuse(source: str, text: str) -> NoReturn:
    raise ConfigError(f"{source}: {text}; fix the hypes")


def positive_ints(values: Sequence) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _non_negative_ints(values: Sequence) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


# ------------------------------------------------------------------------------------------ map geometry
def backbone_channels(args: Mapping) -> int:
    """Channels of the base backbone's output (BaseBEVBackbone's rule)."""
    bev = args["base_bev_backbone"]
    return int(sum(bev["num_upsample_filter"])) if bev["num_upsample_filter"] else int(bev["num_filters"][-1])


def head_channels(args: Mapping) -> int:
    """Channels of the map the heads see: the shrink header's last width, else the backbone's output."""
    shrink = args.get("shrink_header")
    return int(shrink["dim"][-1]) if shrink else backbone_channels(args)


def head_stride(args: Mapping) -> Optional[float]:
    """Stride of the heads' map over the voxel grid, or None when the backbone adds its extra deblock."""
    bev = args["base_bev_backbone"]
    if len(bev["upsample_strides"]) != len(bev["layer_strides"]):
        return None
    if bev["upsample_strides"]:
        stride = float(bev["layer_strides"][0]) / float(bev["upsample_strides"][0])
    else:
        stride = float(math.prod(bev["layer_strides"]))
    for step in (args.get("shrink_header") or {}).get("stride", []):
        stride *= float(step)
    return stride


# ------------------------------------------------------------------------------------------ shared rules
def check_shrink_header(args: Mapping, source: str) -> int:
    """A shrink header, when there is one, has upstream's keys, one block per list entry, and takes the backbone's
    output; returns the channels of the map after it (the backbone's output when there is none)."""
    shrink = args.get("shrink_header")
    if shrink is None:
        return backbone_channels(args)
    for key in SHRINK_LISTS + ("input_dim",):
        if key not in shrink:
            refuse(source, f"key {SHRINK}{key} is missing (upstream's shrink_header has kernal_size, stride, "
                           f"padding and dim, one entry per block, and input_dim)")
    lists = [shrink[key] for key in SHRINK_LISTS]
    if not all(isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1 or not shrink["dim"] or \
            not all(positive_ints(shrink[key]) for key in ("kernal_size", "stride", "dim")) or \
            not _non_negative_ints(shrink["padding"]):
        refuse(source, f"{SHRINK}kernal_size, stride, padding and dim must be lists of one integer per block, of "
                       f"equal length (padding 0 or more, the others positive); got {lists}")
    if shrink["input_dim"] != backbone_channels(args):
        refuse(source, f"{SHRINK}input_dim ({shrink['input_dim']}) must equal the backbone's output channels "
                       f"({backbone_channels(args)}: sum of model.args.base_bev_backbone.num_upsample_filter)")
    return int(shrink["dim"][-1])


def check_max_cav(hypes: Mapping, source: str) -> None:
    """model.args.max_cav sizes the model's CAV slots; the dataset pads every sample to train_params.max_cav."""
    data = get_key(hypes, "train_params.max_cav", DEFAULT_MAX_CAV)
    model = hypes["model"]["args"]["max_cav"]
    if model != data:
        default = "" if get_key(hypes, "train_params.max_cav") is not None else ", the default"
        refuse(source, f"{ARGS}max_cav ({model}) must equal train_params.max_cav ({data}{default}: the most CAVs "
                       f"the dataset gives a sample)")


def check_anchor_stride(hypes: Mapping, source: str, stride: Optional[float]) -> None:
    """The anchors are laid on the grid of the heads' map: their feature_stride is that map's stride."""
    anchors = get_key(hypes, "postprocess.anchor_args.feature_stride")
    if anchors is not None and stride is not None and anchors != stride:
        refuse(source, f"postprocess.anchor_args.feature_stride ({anchors}) must equal the stride of the heads' "
                       f"map ({stride:g}: layer_strides[0] / upsample_strides[0] x the shrink_header strides)")


__all__ = ["refuse", "positive_ints", "backbone_channels", "head_channels", "head_stride", "check_shrink_header",
           "check_max_cav", "check_anchor_stride", "DEFAULT_MAX_CAV", "ARGS", "SHRINK", "SHRINK_LISTS"]
