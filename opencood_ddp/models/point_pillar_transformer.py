"""V2X-ViT (upstream ``opencood/models/point_pillar_transformer.py``, Xu et al., ECCV 2022).

PointPillar encoder per CAV (pillars, scatter, BEV backbone), ``shrink_header`` (a strided DoubleConv that halves
the map), then the V2X transformer (``fusion_net``, see ``modules/v2xvit_encoder.py``): time-delay encoding,
warp into the ego frame, heterogeneous agent attention and multi-scale window attention, ``depth`` times; the
ego's fused map goes to upstream's two 1x1 heads. One fused map per sample.

The batch's per-CAV priors (``prior_encoding``, ``spatial_correction_matrix``) are optional: absent, every
CAV is a vehicle without delay or pose correction (OPV2V). See ``modules/v2xvit_agents.py``.

Where this departs from upstream (docs/compatibility.md): the heads and split attention take the transformer's
width instead of a hard-coded 256; a dataset without ``proj_first`` gets its maps warped by
``pairwise_t_matrix``; upstream's unused ``prior_feed`` is frozen; a delay beyond the table is an error.
"""
from __future__ import annotations

import math
from typing import Mapping, Tuple

import torch

from opencood_ddp.models.checks import (SHRINK_HEADER_KEYS, check_max_cav, check_shrink_neck, check_windows_divide,
                                        positive_ints, refuse, shrink_header, shrunk_map_size)
from opencood_ddp.models.modules.shrink_neck import ShrinkNeck
from opencood_ddp.models.modules.v2xvit_agents import Agents
from opencood_ddp.models.modules.v2xvit_encoder import V2XTransformer
from opencood_ddp.models.point_pillar import (PILLAR_KEYS, PILLAR_OPTIONAL_KEYS, PointPillar,
                                              check_heads_fit_the_anchors, check_pillar_args)
from opencood_ddp.registry import MODELS

_ARGS = "model.args."
_ENC = _ARGS + "transformer.encoder."
_CAV = _ENC + "cav_att_config."
_WIN = _ENC + "pwindow_att_config."
_SHRINK = _ARGS + "shrink_header."

V2XVIT_KEYS: Tuple[Tuple[str, str], ...] = PILLAR_KEYS + ((_ARGS + "max_cav", "positive_int"),) + tuple(
    (_ENC + key, kind) for key, kind in (
        ("num_blocks", "count"), ("depth", "count"), ("use_roi_mask", "bool"), ("use_RTE", "bool"),
        ("RTE_ratio", "positive_int"), ("sttf.voxel_size", "list"), ("sttf.downsample_rate", "positive_int"),
        ("cav_att_config.dim", "positive_int"), ("cav_att_config.use_hetero", "bool"),
        ("cav_att_config.use_RTE", "bool"), ("cav_att_config.RTE_ratio", "positive_int"),
        ("cav_att_config.heads", "positive_int"), ("cav_att_config.dim_head", "positive_int"),
        ("cav_att_config.dropout", "number"),
        ("pwindow_att_config.dim", "positive_int"), ("pwindow_att_config.heads", "list"),
        ("pwindow_att_config.dim_head", "list"), ("pwindow_att_config.dropout", "number"),
        ("pwindow_att_config.window_size", "list"), ("pwindow_att_config.relative_pos_embedding", "bool"),
        ("pwindow_att_config.fusion_method", "str"),
        ("feed_forward.mlp_dim", "positive_int"), ("feed_forward.dropout", "number")))
V2XVIT_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = PILLAR_OPTIONAL_KEYS + SHRINK_HEADER_KEYS
FUSION_METHODS = ("split_attn", "naive")
SPLIT_ATTN_BRANCHES = 3


def _check_transformer(hypes: Mapping, args: Mapping, source: str) -> None:
    enc = args["transformer"]["encoder"]
    cav, win, feed = enc["cav_att_config"], enc["pwindow_att_config"], enc["feed_forward"]
    for key, value in (("cav_att_config.dropout", cav["dropout"]), ("pwindow_att_config.dropout", win["dropout"]),
                       ("feed_forward.dropout", feed["dropout"])):
        if not 0 <= value < 1:
            refuse(source, f"{_ENC}{key} must be in [0, 1), got {value!r}")
    for key in ("use_RTE", "RTE_ratio"):
        if enc[key] != cav[key]:
            refuse(source, f"{_ENC}{key} ({enc[key]!r}) must equal {_CAV}{key} ({cav[key]!r}); upstream reads "
                           f"the latter and its configs set both from one anchor")
    if cav["use_RTE"] and cav["dim"] % 2:
        refuse(source, f"{_CAV}dim must be even with use_RTE (sine and cosine columns of the delay table), got "
                       f"{cav['dim']}")
    if win["dim"] != cav["dim"]:
        refuse(source, f"{_WIN}dim ({win['dim']}) must equal {_CAV}dim ({cav['dim']}): both attentions work on "
                       f"the same features")
    lists = {key: win[key] for key in ("heads", "dim_head", "window_size")}
    if len({len(v) for v in lists.values()}) != 1 or not lists["heads"] or not all(map(positive_ints, lists.values())):
        refuse(source, f"{_WIN}heads, dim_head and window_size must be lists of positive integers, one per window "
                       f"branch, of equal length; got {list(lists.values())}")
    if win["fusion_method"] not in FUSION_METHODS:
        refuse(source, f"{_WIN}fusion_method must be one of {', '.join(FUSION_METHODS)}, got "
                       f"{win['fusion_method']!r}")
    if win["fusion_method"] == "split_attn" and len(win["window_size"]) != SPLIT_ATTN_BRANCHES:
        refuse(source, f"{_WIN}window_size needs exactly {SPLIT_ATTN_BRANCHES} windows with fusion_method "
                       f"split_attn, got {win['window_size']}; use 3 windows or fusion_method naive")
    channels = check_shrink_neck(args, source)
    if channels != cav["dim"]:
        where = f"{_SHRINK}dim[-1]" if shrink_header(args) is not None else \
            "the sum of model.args.base_bev_backbone.num_upsample_filter"
        refuse(source, f"{_CAV}dim ({cav['dim']}) must equal the channels of the maps it fuses ({where} = "
                       f"{channels})")
    _check_geometry(hypes, args, source)


def _check_geometry(hypes: Mapping, args: Mapping, source: str) -> None:
    """STTF's cell size and the window sizes against the feature map the transformer sees."""
    sttf = args["transformer"]["encoder"]["sttf"]
    win = args["transformer"]["encoder"]["pwindow_att_config"]
    voxel = args["voxel_size"]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in list(sttf["voxel_size"]) + voxel)
    if not numbers or len(sttf["voxel_size"]) < 2 or not math.isclose(sttf["voxel_size"][0], voxel[0]) or \
            not math.isclose(voxel[0], voxel[1]):
        refuse(source, f"{_ENC}sttf.voxel_size ({sttf['voxel_size']}) must start with model.args.voxel_size's x "
                       f"size ({voxel}), and the voxels must be square in x and y (the warp uses one cell size)")
    grid = args["point_pillar_scatter"]["grid_size"]
    height, width = shrunk_map_size(args)
    if sttf["downsample_rate"] * width != grid[0] or sttf["downsample_rate"] * height != grid[1]:
        refuse(source, f"{_ENC}sttf.downsample_rate ({sttf['downsample_rate']}) must be the fused map's stride: "
                       f"point_pillar_scatter.grid_size {grid[0]} x {grid[1]} becomes {width} x {height} after "
                       f"the backbone and shrink_header")
    check_windows_divide(source, f"{_WIN}window_size", win["window_size"], height, width,
                         "model.args.lidar_range / voxel_size / sttf.downsample_rate")


def check_v2xvit_args(hypes: Mapping, source: str) -> None:
    """What the kinds cannot say: widths, windows, strides and max_cav agree (one ConfigError line each)."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    _check_transformer(hypes, args, source)
    check_heads_fit_the_anchors(hypes, source)
    check_max_cav(hypes, source)


@MODELS.register("point_pillar_transformer", fusion="intermediate (V2X-ViT)", required=V2XVIT_KEYS,
                 optional=V2XVIT_OPTIONAL_KEYS, check=check_v2xvit_args)
class PointPillarTransformer(ShrinkNeck, PointPillar):
    """V2X-ViT: per-CAV PointPillar maps fused by the V2X transformer into one map per sample."""

    def build_neck(self, args: Mapping) -> None:
        self.max_cav = int(args["max_cav"])
        self.build_shrink_neck(args)
        self.fusion_net = V2XTransformer(args["transformer"])

    def layout(self, data_dict: Mapping) -> dict:
        """The pillar layout and the CAVs' agents (kinds, delays, where each sits), worked out on the host."""
        agents = Agents.from_batch(data_dict, self.max_cav, self.maps_device(data_dict))
        return {**super().layout(data_dict), "agents": agents}

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        return self.fusion_net(self.shrink_and_compress(features), layout["agents"])
