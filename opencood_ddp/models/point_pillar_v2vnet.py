"""V2VNet (upstream ``opencood/models/point_pillar_v2vnet.py``): PointPillar features fused by message passing.

Per CAV: pillars -> BEV -> backbone -> optional shrink header; then ``modules/v2vnet.py``'s graph fusion
(``num_iteration`` rounds of warped messages, aggregation and a ConvGRU update per CAV) returns one map per
sample, the ego's, which the heads read. Submodules are built in upstream's order, so its checkpoints load
strictly.

Every key of upstream's ``v2vfusion`` block is declared. ``conv_gru.H``/``W``, ``voxel_size`` and
``downsample_rate`` are checked but not needed: the hidden state takes the map's size and the warp is
normalised by ``lidar_range`` (docs/compatibility.md). ``gru_flag: false`` is upstream's residual update instead
of the ConvGRU (the V2X-ViT repository's V2XSet file sets it): the ConvGRU is still built, as upstream's, and
frozen, since it never runs.

``v2vfusion.use_temporal_encoding: true`` is the V2V4Real fork's temporal encoding: before the message passing,
a 3x3 convolution ``fusion_net.cnn`` maps each CAV's [map, its delay in 100 ms frames] back to the map's
channels, so that the fusion sees how old each map is (``prior_encoding``'s time delay, 0 without
``wild_setting.async``). Absent or false, nothing is built: upstream OpenCOOD's model and state dict (the fork
builds the layer unused with false, so its checkpoints of such a run carry two keys ours do not).
"""
from __future__ import annotations

from typing import Mapping

import torch

from opencood_ddp.models.checks import SHRINK_HEADER_KEYS, check_anchor_stride, check_shrink_neck, head_stride, refuse
from opencood_ddp.models.modules.cav_layout import counts, to_device
from opencood_ddp.models.modules.shrink_neck import ShrinkNeck
from opencood_ddp.models.modules.v2vnet import AGGREGATORS, V2VNetFusion, geometry
from opencood_ddp.models.point_pillar import PILLAR_KEYS, PILLAR_OPTIONAL_KEYS, PointPillar, check_pillar_args
from opencood_ddp.registry import MODELS

_ARGS = "model.args."
_BLOCK = _ARGS + "v2vfusion."
V2VNET_KEYS = PILLAR_KEYS + tuple((_BLOCK + key, kind) for key, kind in (
    ("in_channels", "positive_int"), ("num_iteration", "count"), ("agg_operator", "str"),
    ("gru_flag", "bool"), ("conv_gru.num_layers", "count"), ("conv_gru.kernel_size", "list")))
V2VNET_OPTIONAL_KEYS = (PILLAR_OPTIONAL_KEYS + ((_ARGS + "max_cav", "positive_int"),) + SHRINK_HEADER_KEYS
                        + tuple((_ARGS + key, kind) for key, kind in (
                            ("v2vfusion", "dict"), ("v2vfusion.voxel_size", "list"),
                            ("v2vfusion.downsample_rate", "positive_int"), ("v2vfusion.conv_gru", "dict"),
                            ("v2vfusion.conv_gru.H", "positive_int"), ("v2vfusion.conv_gru.W", "positive_int"),
                            ("v2vfusion.use_temporal_encoding", "bool"))))


def _check_fusion(hypes: Mapping, source: str, args: Mapping) -> None:
    block, channels = args["v2vfusion"], check_shrink_neck(args, source)
    if block["in_channels"] != channels:
        refuse(source, f"model.args.v2vfusion.in_channels ({block['in_channels']}) must equal the channels the "
                       f"heads see ({channels}: model.args.shrink_header.dim[-1], else the backbone's output)")
    if block["agg_operator"] not in AGGREGATORS:
        refuse(source, f"model.args.v2vfusion.agg_operator {block['agg_operator']!r} must be one of "
                       f"{', '.join(AGGREGATORS)}")
    gru = block["conv_gru"]
    kernels = gru["kernel_size"]
    if len(kernels) not in (1, gru["num_layers"]) or not all(
            isinstance(k, list) and len(k) == 2 and all(isinstance(v, int) and v > 0 and v % 2 == 1 for v in k)
            for k in kernels):
        refuse(source, f"model.args.v2vfusion.conv_gru.kernel_size must be a list of 1 or num_layers "
                       f"({gru['num_layers']}) [height, width] pairs of odd positive integers, got {kernels!r}")
    if "voxel_size" in block and list(block["voxel_size"]) != list(args["voxel_size"]):
        refuse(source, f"model.args.v2vfusion.voxel_size {block['voxel_size']} must equal model.args.voxel_size "
                       f"{args['voxel_size']}")
    stride = head_stride(args)
    rate = block.get("downsample_rate")
    if rate is not None and stride is not None and rate != stride:
        refuse(source, f"model.args.v2vfusion.downsample_rate ({rate}) must equal the stride of the fused map "
                       f"({stride:g}: layer_strides[0] / upsample_strides[0] x the shrink_header strides)")
    check_anchor_stride(hypes, source, stride)


def check_v2vnet_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, then a shrink header and a fusion block whose widths and strides agree."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    _check_fusion(hypes, source, args)


def kernel_sizes(gru: Mapping) -> list:
    """One [kh, kw] per ConvGRU layer (a single pair serves every layer, as upstream)."""
    kernels = gru["kernel_size"]
    return list(kernels) if len(kernels) == gru["num_layers"] else list(kernels) * int(gru["num_layers"])


@MODELS.register("point_pillar_v2vnet", fusion="intermediate (V2VNet graph)", required=V2VNET_KEYS,
                 optional=V2VNET_OPTIONAL_KEYS, check=check_v2vnet_args)
class PointPillarV2VNet(ShrinkNeck, PointPillar):
    """PointPillar with V2VNet's message-passing fusion of the CAVs' (shrunk) backbone output."""

    def build_neck(self, args: Mapping) -> None:
        self.build_shrink_neck(args)
        block = args["v2vfusion"]
        self.fusion_net = V2VNetFusion(int(block["in_channels"]), int(block["num_iteration"]),
                                       block["agg_operator"], kernel_sizes(block["conv_gru"]), args["lidar_range"],
                                       temporal=bool(block.get("use_temporal_encoding", False)),
                                       gru=bool(block["gru_flag"]))

    def layout(self, data_dict: Mapping) -> dict:
        """The pillar layout, how the CAVs see each other (`v2vnet.geometry`, from the pairwise transforms, where
        they are) and, with the temporal encoding, each CAV's delay."""
        record_len, device = data_dict["record_len"], self.maps_device(data_dict)
        delays = None
        if self.fusion_net.cnn is not None:
            delays = to_device(cav_delays(data_dict["prior_encoding"], record_len), device)
        seen = geometry(data_dict["pairwise_t_matrix"], counts(record_len), self.fusion_net.lidar_range, device)
        return {**super().layout(data_dict), "geometry": seen, "delays": delays}

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        return self.fusion_net(self.shrink_and_compress(features), layout["record_len"], layout["geometry"],
                               layout["delays"])


def cav_delays(prior_encoding: torch.Tensor, record_len: torch.Tensor) -> torch.Tensor:
    """(B, max_cav, 3) [speed, delay, infra] -> (sum(record_len),) each CAV's delay in whole 100 ms frames,
    truncated as the fork's ``.to(torch.int)``."""
    rows = [prior_encoding[b, :n, 1] for b, n in enumerate(counts(record_len))]
    return torch.cat(rows).to(torch.int)
