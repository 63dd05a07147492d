"""The PointPillar detector family of the OPV2V benchmark (upstream ``opencood/models/point_pillar*.py``).

- ``PointPillar`` (``point_pillar``): one point cloud per sample; no fusion (early and late fusion use it).
- ``PointPillarIntermediate`` (``point_pillar_intermediate``, AttFuse): one BEV map per CAV, fused by
  attention at every backbone level (``record_len`` groups the CAVs of each sample).
- ``PointPillarFCooper`` (``point_pillar_fcooper``): per-CAV backbone output, optional shrink header, then
  F-Cooper's element-wise max over CAVs.
- ``PointPillarOPV2V`` (``point_pillar_opv2v``, the V2V4Real fork's): F-Cooper's pipeline with AttFuse's attention
  over the shrunk maps instead of the max.

The fusions work with ``fusion.args.proj_first`` true (OpenCOOD's: the clouds come projected into the ego's
frame, the fusion is OpenCOOD's bit for bit) and false (HEAL's and CoAlign's: each CAV's map is warped into
the ego's frame from ``pairwise_t_matrix`` before it is fused, ``modules/ego_warp.py``).

All take the batch's ``ego`` dict (``processed_lidar``; ``record_len`` for the fusion models) and return
``{'psm': (N, A, H, W) class logits, 'rm': (N, 7A, H, W) box residuals}`` with upstream's parameter names, so
upstream checkpoints load strictly (``tests/test_models.py`` checks every key and shape against the reference).

Two robustness options of upstream are built here for every pillar model that has them upstream:
- feature compression (``modules/compressor.py``): ``model.args.compression`` puts ``naive_compressor`` between
  the shrink header and the fusion, in the neck that F-Cooper here and V2VNet, V2X-ViT, CoBEVT and Where2comm
  share (``modules/shrink_neck.py``: the shrink header, the compressor, the maps sent, the heads' width);
  AttFuse's ``model.args.base_bev_backbone.compression`` adds per-level auto-encoders to its backbone. A model
  refuses the key it does not build rather than ignoring it.
- ``model.args.backbone_fix: true`` freezes what upstream's ``backbone_fix()`` freezes (``BACKBONE_FIX``), so
  that only the fusion trains. As upstream, only ``requires_grad`` changes: in train mode the frozen BatchNorm
  layers still normalise with batch statistics and update their running statistics. A model with no trainable
  fusion parameter is refused by ``create_model`` (nothing would train).

``sent_maps(args)`` gives the (channels, rows, cols) of the float32 maps a non-ego CAV sends per frame, the
bottleneck's when compressed (``models/communication.py``).
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key
from opencood_ddp.models.checks import (BACKBONE_COMPRESSION, COMPRESSION, backbone_compression_steps,
                                        check_anchor_stride, check_backbone_compression, check_bev_backbone,
                                        check_grid_agreement, check_shrink_header, check_shrink_neck, head_stride,
                                        level_map_sizes, positive_ints, refuse, refuse_compression)
from opencood_ddp.models.modules.bev_backbone import BaseBEVBackbone
from opencood_ddp.models.modules.cav_layout import counts
from opencood_ddp.models.modules.ego_warp import EgoWarp, batch_ego_warp
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion
from opencood_ddp.models.modules.pillar_vfe import PillarVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter
from opencood_ddp.models.modules.shrink_neck import ShrinkNeck
from opencood_ddp.registry import MODELS

NUM_POINT_FEATURES = 4  # x, y, z, intensity

_ARGS = "model.args."
PILLAR_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("voxel_size", "list"), ("lidar_range", "list"), ("anchor_number", "positive_int"),
    ("pillar_vfe.use_norm", "bool"), ("pillar_vfe.with_distance", "bool"),
    ("pillar_vfe.use_absolute_xyz", "bool"), ("pillar_vfe.num_filters", "list"),
    ("point_pillar_scatter.num_features", "positive_int"), ("base_bev_backbone.layer_nums", "list"),
    ("base_bev_backbone.layer_strides", "list"),
    ("base_bev_backbone.num_filters", "list"), ("base_bev_backbone.upsample_strides", "list"),
    ("base_bev_backbone.num_upsample_filter", "list")))
# Upstream keys these models read or carry; a compression a model does not build is refused when switched on.
PILLAR_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = tuple((_ARGS + key, kind) for key, kind in (
    ("base_bev_backbone.compression", "int"), ("compression", "int"), ("backbone_fix", "bool"),
    ("anchor_num", "positive_int"),
    ("dir_args", "dict"),  # CoAlign's and HEAL's direction classifier (postprocess/direction.py)
    # Written by the yaml_parser; its absence gets its own hint in check_pillar_args.
    ("point_pillar_scatter.grid_size", "list")))
FCOOPER_OPTIONAL_KEYS = PILLAR_OPTIONAL_KEYS + ((_ARGS + "shrink_header", "dict"),)
# Early and late fusion's: the V2X-ViT repository's and the V2V4Real fork's point_pillar add a shrink header before
# heads of cls_head_dim channels.
POINT_PILLAR_OPTIONAL_KEYS = FCOOPER_OPTIONAL_KEYS + ((_ARGS + "cls_head_dim", "positive_int"),)
# What upstream's backbone_fix() freezes, by attribute name (the same list in every model that has the method):
# everything but the fusion. Absent modules (no shrink header, no compressor) are skipped.
BACKBONE_FIX = ("pillar_vfe", "scatter", "backbone", "naive_compressor", "shrink_conv", "cls_head", "reg_head",
                "dir_head")
Map = Tuple[int, int, int]  # (channels, rows, cols) of a float32 map


def check_pillar_args(hypes: Mapping, source: str) -> None:
    """What the kinds of PILLAR_KEYS cannot say: the parser ran, the widths agree, the model's grid and anchor
    count are the data's and the anchors'. Each model's check adds its compression rule (models/checks.py) and,
    once its neck is checked, the heads' stride against the anchors' (`check_heads_fit_the_anchors`)."""
    if get_key(hypes, _ARGS + "point_pillar_scatter.grid_size") is None:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.grid_size is missing; add "
                          f"'yaml_parser: load_point_pillar_params' to the hypes so that it is computed")
    args = hypes["model"]["args"]
    filters = args["pillar_vfe"]["num_filters"]
    if not filters or not positive_ints(filters):
        refuse(source, f"{_ARGS}pillar_vfe.num_filters must be a non-empty list of positive integers (the "
                       f"encoder's widths), got {filters!r}")
    check_bev_backbone(args, source)
    check_grid_agreement(hypes, source)
    if args["point_pillar_scatter"]["num_features"] != args["pillar_vfe"]["num_filters"][-1]:
        raise ConfigError(f"{source}: model.args.point_pillar_scatter.num_features "
                          f"({args['point_pillar_scatter']['num_features']}) must equal the last of "
                          f"model.args.pillar_vfe.num_filters ({args['pillar_vfe']['num_filters'][-1]}); fix the hypes")


def check_heads_fit_the_anchors(hypes: Mapping, source: str) -> None:
    """The anchors are laid at postprocess.anchor_args.feature_stride: the heads' map must have that stride (the
    loss would otherwise meet maps and labels of different sizes)."""
    bev = hypes["model"]["args"]["base_bev_backbone"]
    for key in ("layer_strides", "upsample_strides"):
        if not positive_ints(bev[key]):
            refuse(source, f"{_ARGS}base_bev_backbone.{key} must be a list of positive integers, got {bev[key]!r}")
    check_anchor_stride(hypes, source, head_stride(hypes["model"]["args"]))


def check_point_pillar_args(hypes: Mapping, source: str) -> None:
    """Early and late fusion exchange points or boxes, no feature map: neither compression applies. A shrink header
    takes the backbone's output, and cls_head_dim (the forks' width of the heads) is the channels they see."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    channels = check_shrink_header(args, source)
    if args.get("cls_head_dim", channels) != channels:
        refuse(source, f"{_ARGS}cls_head_dim ({args['cls_head_dim']}) must equal the channels the heads see "
                       f"({channels}: {_ARGS}shrink_header.dim[-1], else the backbone's output)")
    check_heads_fit_the_anchors(hypes, source)
    for key in (COMPRESSION, BACKBONE_COMPRESSION):
        refuse_compression(args, source, key, "early and late fusion send no feature map")


def anchor_number(args: Mapping) -> int:
    return int(args["anchor_number"])


class PointPillar(nn.Module):
    """Pillars -> BEV -> backbone -> 1x1 heads: the shared encoder of the pillar models (early and late fusion's
    is `SinglePointPillar`, the fusion variants below and in their own modules)."""

    fusion_factory = None
    backbone_compresses = False  # AttFuse: base_bev_backbone.compression builds per-level auto-encoders
    warps_to_ego = False  # AttFuse and F-Cooper: fuse maps warped into the ego's frame (proj_first: false)

    def __init__(self, args: Mapping):
        super().__init__()
        self.lidar_range = [float(v) for v in args["lidar_range"]]
        self.pillar_vfe = PillarVFE(args["pillar_vfe"], NUM_POINT_FEATURES, args["voxel_size"], args["lidar_range"])
        self.scatter = PointPillarScatter(args["point_pillar_scatter"])
        bev = args["base_bev_backbone"]
        self.backbone = BaseBEVBackbone(bev, self.pillar_vfe.get_output_feature_dim(),
                                        fusion_factory=self.fusion_factory,
                                        compression=int(bev.get("compression", 0) or 0) if self.backbone_compresses
                                        else 0)
        self.build_neck(args)
        channels = self.head_channels()
        self.cls_head = nn.Conv2d(channels, anchor_number(args), kernel_size=1)
        self.reg_head = nn.Conv2d(channels, 7 * anchor_number(args), kernel_size=1)
        direction = args.get("dir_args")
        if direction is not None:  # CoAlign's name and shape: num_bins logits per anchor
            self.dir_head = nn.Conv2d(channels, int(direction["num_bins"]) * anchor_number(args), kernel_size=1)
        if args.get("backbone_fix", False):
            self.backbone_fix()

    def backbone_fix(self) -> None:
        """Freeze every module of BACKBONE_FIX (requires_grad False), as upstream's method: only the fusion trains.

        Nothing else changes: the frozen BatchNorm layers keep their train-mode behaviour (batch statistics,
        running statistics updated), as upstream's, which sets requires_grad alone."""
        for name in BACKBONE_FIX:
            module = getattr(self, name, None)
            if module is not None:
                module.requires_grad_(False)

    @classmethod
    def sent_maps(cls, args: Mapping) -> Optional[List[Map]]:
        """The maps a non-ego CAV sends per frame; None: no feature map (early fusion sends points, late boxes)."""
        return None

    def build_neck(self, args: Mapping) -> None:
        """Modules between the backbone and the heads (none here)."""

    def head_channels(self) -> int:
        """Channels of the map the heads read: the backbone's output here; the shrink-neck models' own
        (modules/shrink_neck.py) after the shrink header."""
        return self.backbone.num_bev_features

    @staticmethod
    def num_images(data_dict: Mapping) -> Optional[int]:
        """How many BEV maps the batch has: CAVs when grouped by record_len, else samples."""
        if data_dict.get("record_len") is not None:
            return sum(counts(data_dict["record_len"]))
        if data_dict.get("object_bbx_center") is not None:
            return int(data_dict["object_bbx_center"].shape[0])
        return None

    def ego_warp(self, data_dict: Mapping) -> Optional[EgoWarp]:
        """How the batch's CAV maps move into their ego's frame; None for a model that does not warp here, or
        when no map moves (proj_first: true)."""
        return batch_ego_warp(data_dict, self.lidar_range, self.maps_device(data_dict)) if self.warps_to_ego else None

    # The forward pass in two stages, the seam of engine/capture.py's --capture: `front` (pillars and the BEV
    # scatter, whose input has as many rows as the clouds have pillars) and `dense` (backbone, neck, heads: shapes
    # fixed by the grid and the CAV layout). `layout` is what `dense` reads of the batch besides the map, derived
    # where the batch keeps it (record_len on the host), so that a compiled `dense` is given it rather than
    # computing it from tensors. Eager, forward = dense(front, layout): the same operations in the same order.
    def front(self, data_dict: Mapping) -> torch.Tensor:
        """(sum(record_len) or samples, C, H, W): the pillars scattered onto the BEV grid."""
        lidar = data_dict["processed_lidar"]
        batch = {"voxel_features": lidar["voxel_features"], "voxel_coords": lidar["voxel_coords"],
                 "voxel_num_points": lidar["voxel_num_points"], "record_len": data_dict.get("record_len")}
        batch = self.pillar_vfe(batch)
        return self.scatter(batch, self.num_images(data_dict))["spatial_features"]

    def layout(self, data_dict: Mapping) -> dict:
        """What `dense` reads of the batch besides the map: ``record_len`` and the maps' warp into their ego's
        frame (None where nothing moves); the fusion models add their own keys."""
        return {"record_len": data_dict.get("record_len"), "ego_warp": self.ego_warp(data_dict)}

    @staticmethod
    def maps_device(data_dict: Mapping) -> torch.device:
        """Where the maps will be, for a layout's tensors: the pillars' device (the layout runs before `front`'s
        map exists, on keys the batch keeps on the host)."""
        return data_dict["processed_lidar"]["voxel_features"].device

    def dense(self, features: torch.Tensor, layout: Mapping) -> dict:
        """Backbone, neck and heads on the scattered map."""
        return self.heads(self.neck(self.backbone_map(features, layout), layout))

    def backbone_map(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        """The backbone's output on the scattered map: one per CAV, or fused level by level (AttFuse)."""
        batch = {"spatial_features": features, "record_len": layout["record_len"]}
        if self.fusion_factory is not None:  # fused inside the backbone, level by level
            batch["ego_warp"] = layout["ego_warp"]
        return self.backbone(batch)["spatial_features_2d"]

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        """Modules between the backbone and the heads (none here); `layout` is `layout(data_dict)`."""
        return features

    def heads(self, features: torch.Tensor) -> dict:
        """The 1x1 heads on the fused map: class scores ``psm``, box residuals ``rm`` and, with
        ``model.args.dir_args``, the direction logits ``dm``."""
        out = {"psm": self.cls_head(features), "rm": self.reg_head(features)}
        if hasattr(self, "dir_head"):
            out["dm"] = self.dir_head(features)
        return out

    def forward(self, data_dict: Mapping) -> dict:
        return self.dense(self.front(data_dict), self.layout(data_dict))


@MODELS.register("point_pillar", fusion="none", required=PILLAR_KEYS, optional=POINT_PILLAR_OPTIONAL_KEYS,
                 check=check_point_pillar_args)
class SinglePointPillar(ShrinkNeck, PointPillar):
    """Early and late fusion's detector, one point cloud per map (upstream's ``point_pillar``): OpenCOOD's heads on
    the backbone's output; with ``model.args.shrink_header``, the V2X-ViT repository's and the V2V4Real fork's, a
    shrink header before heads of ``cls_head_dim`` channels (``shrink_conv``, upstream's name and order)."""

    def build_neck(self, args: Mapping) -> None:
        self.build_shrink_neck(args)  # no compressor: check_point_pillar_args refuses compression

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        return self.shrink(features)

    @classmethod
    def sent_maps(cls, args: Mapping) -> Optional[List[Map]]:
        """None: early fusion sends points and late fusion boxes, no feature map (models/communication.py)."""
        return None


def _grid_rows_cols(args: Mapping) -> Tuple[int, int]:
    grid = args["point_pillar_scatter"]["grid_size"]
    return int(grid[1]), int(grid[0])


def attfuse_sent_maps(bev: Mapping, rows: int, cols: int) -> List[Map]:
    """(channels, rows, cols) per level of a backbone fused at every level (AttFuse, SECOND): the level's output,
    or its auto-encoder's bottleneck under base_bev_backbone.compression."""
    sizes = level_map_sizes(bev, rows, cols)
    steps = backbone_compression_steps(int(bev.get("compression", 0) or 0), len(sizes))
    return [(int(filters) // 2 ** k, r // 2 ** k, c // 2 ** k)
            for filters, (r, c), k in zip(bev["num_filters"], sizes, steps)]


def check_attfuse_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, and a backbone compression whose auto-encoders give back every level's map."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    check_backbone_compression(args, source, *_grid_rows_cols(args))
    check_heads_fit_the_anchors(hypes, source)


@MODELS.register("point_pillar_intermediate", fusion="intermediate (attention)", required=PILLAR_KEYS,
                 optional=PILLAR_OPTIONAL_KEYS, check=check_attfuse_args)
class PointPillarIntermediate(PointPillar):
    """AttFuse: attention fusion of the CAVs' features at every backbone level."""

    fusion_factory = AttFusion
    backbone_compresses = True
    warps_to_ego = True

    @classmethod
    def sent_maps(cls, args: Mapping) -> Optional[List[Map]]:
        """Every level's map, fused level by level; a compressed level sends its auto-encoder's bottleneck
        (channels and both sides halved per step)."""
        return attfuse_sent_maps(args["base_bev_backbone"], *_grid_rows_cols(args))


def check_fcooper_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, a shrink header (when there is one) that takes the backbone's output, a compression
    ratio that divides the shrunk map's channels."""
    check_pillar_args(hypes, source)
    check_shrink_neck(hypes["model"]["args"], source)
    check_heads_fit_the_anchors(hypes, source)


@MODELS.register("point_pillar_fcooper", fusion="intermediate (max)", required=PILLAR_KEYS,
                 optional=FCOOPER_OPTIONAL_KEYS, check=check_fcooper_args)
class PointPillarFCooper(ShrinkNeck, PointPillar):
    """F-Cooper: max fusion of the CAVs' backbone output (after the optional shrink header and compressor)."""

    warps_to_ego = True

    def build_neck(self, args: Mapping) -> None:
        self.build_shrink_neck(args)
        self.fusion_net = self.build_fusion()

    def build_fusion(self) -> nn.Module:
        return MaxFusion()

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        features = self.shrink_and_compress(features)
        return self.fusion_net(features, layout["record_len"], layout["ego_warp"])


@MODELS.register("point_pillar_opv2v", fusion="intermediate (attention, on the shrunk map)", required=PILLAR_KEYS,
                 optional=FCOOPER_OPTIONAL_KEYS, check=check_fcooper_args)
class PointPillarOPV2V(PointPillarFCooper):
    """The V2V4Real fork's ``point_pillar_opv2v``: F-Cooper's pipeline (backbone, shrink header, naive compressor)
    with AttFuse's per-cell attention over the CAVs' shrunk maps in place of the max, one fusion on the heads' map.
    The attention has no parameters, so its state dict is F-Cooper's, names and order included."""

    def build_fusion(self) -> nn.Module:
        return AttFusion(self.shrunk_channels())
