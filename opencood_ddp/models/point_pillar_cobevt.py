"""CoBEVT on LiDAR (upstream ``opencood/models/point_pillar_cobevt.py``): PointPillar features fused by
SwapFusion, CoBEVT's fused axial attention.

Per CAV: pillars -> BEV -> backbone -> shrink header. Each CAV's map is warped into its sample's ego frame,
the maps of a sample are laid into ``max_cav`` slots (absent CAVs zero and masked as attention keys), and
``depth`` swap-fusion layers (local window attention, then dilated grid attention, each across all slots,
each with a feed-forward block; ``modules/swap_fusion.py``) mix them. The head averages the slots into one
map per sample, which the class and box heads read.

Departures from upstream (docs/compatibility.md):
- OpenCOOD does not warp (it relies on proj_first); here every non-ego map is resampled in the ego's frame
  from ``pairwise_t_matrix``, normalised by ``lidar_range`` (the identity with proj_first: true).
- The heads read ``fax_fusion.input_dim`` channels, where upstream hard-codes 256.

``point_pillar_fax`` names the same model: the V2V4Real fork's ``point_pillar_fax.py`` is upstream's class under
another name (the same layers, parameter names and forward), and its hypes files and its runs' config.yaml say
``point_pillar_fax``.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Tuple

import torch

from opencood_ddp.models.checks import (SHRINK_HEADER_KEYS, check_anchor_stride, check_max_cav, check_shrink_neck,
                                        check_windows_divide, head_stride, refuse)
from opencood_ddp.models.modules.shrink_neck import ShrinkNeck
from opencood_ddp.models.modules.swap_fusion import SwapFusionEncoder
from opencood_ddp.models.modules.cav_layout import counts, sample_and_slot, to_device
from opencood_ddp.models.modules.ego_warp import to_ego_frame
from opencood_ddp.models.point_pillar import PILLAR_KEYS, PILLAR_OPTIONAL_KEYS, PointPillar, check_pillar_args
from opencood_ddp.registry import MODELS

_ARGS = "model.args."
FAX = _ARGS + "fax_fusion"

COBEVT_KEYS = PILLAR_KEYS + tuple((_ARGS + key, kind) for key, kind in (
    ("max_cav", "positive_int"), ("fax_fusion.input_dim", "positive_int"), ("fax_fusion.mlp_dim", "positive_int"),
    ("fax_fusion.agent_size", "positive_int"), ("fax_fusion.window_size", "positive_int"),
    ("fax_fusion.dim_head", "positive_int"), ("fax_fusion.drop_out", "number"),
    ("fax_fusion.depth", "count")))
COBEVT_OPTIONAL_KEYS = PILLAR_OPTIONAL_KEYS + ((_ARGS + "fax_fusion.mask", "bool"),) + SHRINK_HEADER_KEYS


# ------------------------------------------------------------------------------------------ hypes checks
def _check_block(source: str, args: Mapping) -> None:
    fax = args["fax_fusion"]
    if fax.get("mask", False) is not True:
        refuse(source, f"{FAX}.mask must be true (upstream's unmasked block, its default when the key is absent, "
                       f"lets padded CAV slots into the attention and is not built)")
    if fax["input_dim"] % fax["dim_head"] != 0:
        refuse(source, f"{FAX}.input_dim ({fax['input_dim']}) must be a multiple of {FAX}.dim_head "
                       f"({fax['dim_head']}): the heads split the channels")
    if not 0 <= fax["drop_out"] < 1:
        refuse(source, f"{FAX}.drop_out must be in [0, 1), got {fax['drop_out']}")


def _check_widths(source: str, args: Mapping) -> None:
    channels = check_shrink_neck(args, source)
    if args["fax_fusion"]["input_dim"] != channels:
        refuse(source, f"{FAX}.input_dim ({args['fax_fusion']['input_dim']}) must equal the channels of the fused "
                       f"map ({channels}: model.args.shrink_header.dim[-1], else the backbone's output)")
    if args["fax_fusion"]["agent_size"] != args["max_cav"]:
        refuse(source, f"{FAX}.agent_size ({args['fax_fusion']['agent_size']}) must equal model.args.max_cav "
                       f"({args['max_cav']}): one attention slot per CAV")


def _check_map(hypes: Mapping, source: str) -> None:
    """The fused map's stride matches the anchors, and window_size divides both of its sides."""
    args = hypes["model"]["args"]
    stride = head_stride(args)
    if stride is None:
        refuse(source, "model.args.base_bev_backbone.upsample_strides must have one entry per layer_strides entry "
                       "(the extra deblock is not built with fax_fusion)")
    check_anchor_stride(hypes, source, stride)
    grid = args["point_pillar_scatter"]["grid_size"]
    sides = (grid[0] / stride, grid[1] / stride)  # (W, H) cells of the fused map
    check_windows_divide(source, f"{FAX}.window_size", [args["fax_fusion"]["window_size"]], sides[1], sides[0],
                         f"model.args.point_pillar_scatter.grid_size {list(grid[:2])} over the stride {stride:g}")


def check_cobevt_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, then the fusion block, widths, max_cav and map sizes that agree."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    _check_block(source, args)
    _check_widths(source, args)
    check_max_cav(hypes, source)
    _check_map(hypes, source)


# ------------------------------------------------------------------------------------------ the model
class Slots(NamedTuple):
    """Where each CAV map goes among a batch's ``max_cav`` slots per sample: ``index`` (sum(record_len),) long,
    sample * slots + slot, and ``present`` (B, slots) bool, both on the maps' device."""

    index: torch.Tensor
    present: torch.Tensor
    count: int  # slots per sample


def slots_of(record_len: torch.Tensor, slots: int, device: torch.device) -> Slots:
    """The slots of a batch, worked out where record_len is (the host: modules/cav_layout.py)."""
    samples = len(record_len)
    if max(counts(record_len), default=0) > slots:
        raise ValueError(f"a sample has {max(counts(record_len))} CAVs, more than max_cav = {slots}")
    sample, slot = sample_and_slot(record_len)
    index = sample * slots + slot
    present = torch.zeros(samples * slots, dtype=torch.bool, device=index.device)
    present[index] = True
    return Slots(to_device(index, device), to_device(present, device).view(samples, slots), slots)


def to_slots(x: torch.Tensor, record_len: torch.Tensor, slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, C, H, W) CAV maps -> ((B, slots, C, H, W) zero-padded, (B, slots) bool: the slot holds a CAV)."""
    return place_in_slots(x, slots_of(record_len, slots, x.device))


def place_in_slots(x: torch.Tensor, slots: Slots) -> Tuple[torch.Tensor, torch.Tensor]:
    """`to_slots` with the slots already worked out. The slots are laid out channels-last (each cell's C values
    together), the layout the fusion works in."""
    samples = slots.present.shape[0]
    channels, height, width = x.shape[1:]
    cells = x.new_zeros(samples * slots.count, height, width, channels).index_copy(0, slots.index,
                                                                                  x.permute(0, 2, 3, 1))
    return cells.view(samples, slots.count, height, width, channels).permute(0, 1, 4, 2, 3), slots.present


# One entry's keys, rules and meta under both names: ours (upstream's) and the V2V4Real fork's (module docstring).
_ENTRY = dict(fusion="intermediate (CoBEVT fused axial attention)", required=COBEVT_KEYS,
              optional=COBEVT_OPTIONAL_KEYS, check=check_cobevt_args)


@MODELS.register("point_pillar_cobevt", **_ENTRY)
class PointPillarCoBEVT(ShrinkNeck, PointPillar):
    """PointPillar with CoBEVT's SwapFusion of the CAVs' shrunk maps."""

    warps_to_ego = True  # the shrunk maps, before the fusion

    def build_neck(self, args: Mapping) -> None:
        self.build_shrink_neck(args)
        fax = args["fax_fusion"]
        self.fusion_net = SwapFusionEncoder(int(fax["input_dim"]), int(fax["mlp_dim"]), int(fax["agent_size"]),
                                            int(fax["window_size"]), int(fax["dim_head"]), float(fax["drop_out"]),
                                            int(fax["depth"]))
        self.max_cav = int(args["max_cav"])

    def layout(self, data_dict: Mapping) -> dict:
        """The pillar layout (with the maps' warp) and the CAVs' attention slots."""
        slots = slots_of(data_dict["record_len"], self.max_cav, self.maps_device(data_dict))
        return {**super().layout(data_dict), "slots": slots}

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        features = to_ego_frame(self.shrink_and_compress(features), layout["ego_warp"])
        return self.fusion_net(*place_in_slots(features, layout["slots"]))


# V2V4Real's name for this model: the fork's files and checkpoints are read as they are.
MODELS.register("point_pillar_fax", **_ENTRY)(PointPillarCoBEVT)
