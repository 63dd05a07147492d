"""SECOND on one point cloud per map (upstream ``opencood/models/second.py``): early and late fusion's detector.

MeanVFE (the mean point of each voxel) -> VoxelBackBone8x (sparse 3-D convolutions on spconv, stride 8) ->
HeightCompression (height folded into channels) -> the BEV backbone -> 1x1 heads. Early fusion gives it one
merged cloud per sample, late fusion one CAV's cloud per map (a random CAV in training, every CAV in turn at
evaluation); nothing is fused inside the model. ``second_intermediate.py`` is the same detector with AttFuse's
attention at every BEV level: it subclasses ``Second``, and the hypes rules of both are here.

Upstream's ``model.args.batch_size`` is accepted and not read. Upstream hands it to spconv as the number of maps,
so any batch of another size breaks there: a batch of one (its evaluation, late fusion's per-CAV calls) gets a
second, empty map and fails the post-processor's one-sample assertion (docs/compatibility.md). Here the maps are
the batch's samples (``object_bbx_center``'s rows), or its CAVs where ``record_len`` groups them. Upstream
hard-codes the BEV backbone's input (256) and the heads' width (512); here they follow
``height_compression.feature_num`` and the backbone's output, which equal those numbers for upstream's hypes, so
the thin toy configurations can be built too.

spconv is imported when the model is built (``modules/spconv_compat.py``), not when this module is.
"""
from __future__ import annotations

import math
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key
from opencood_ddp.models.checks import (BACKBONE_COMPRESSION, check_bev_backbone, check_grid_agreement,
                                        check_levels_concatenate, deblock_cells, refuse_compression)
from opencood_ddp.models.modules.bev_backbone import BaseBEVBackbone
from opencood_ddp.models.modules.cav_layout import maps_of_coords
from opencood_ddp.models.modules.mean_vfe import MeanVFE
from opencood_ddp.models.modules.sparse_backbone import (HeightCompression, VoxelBackBone8x, num_features_out,
                                                         output_shape)
from opencood_ddp.models.point_pillar import (NUM_POINT_FEATURES, PILLAR_KEYS, PILLAR_OPTIONAL_KEYS, Map,
                                              PointPillar)
from opencood_ddp.registry import MODELS

_ARGS = "model.args."
_SHARED = ("voxel_size", "lidar_range", "anchor_number", "base_bev_backbone", "anchor_num")


def _shared(keys: Sequence[Tuple[str, str]]) -> Tuple[Tuple[str, str], ...]:
    """The PointPillar keys whose meaning SECOND shares: range, voxel, anchors, the BEV backbone."""
    return tuple(key for key in keys if key[0][len(_ARGS):].split(".")[0] in _SHARED)


SECOND_KEYS: Tuple[Tuple[str, str], ...] = _shared(PILLAR_KEYS) + tuple((_ARGS + key, kind) for key, kind in (
    ("mean_vfe.feature_points", "positive_int"), ("height_compression.feature_num", "positive_int")))
# backbone_3d itself is upstream's [] or a mapping: a kind cannot say "either", so check_sparse_front does.
SECOND_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = _shared(PILLAR_OPTIONAL_KEYS) + tuple(
    (_ARGS + key, kind) for key, kind in (
        ("batch_size", "positive_int"), ("backbone_3d.num_features_out", "positive_int"),
        ("grid_size", "list")))  # written by load_second_params; its absence gets its own hint


def check_sparse_front(hypes: Mapping, source: str) -> Sequence[int]:
    """What the kinds cannot say about the part both SECOND models share up to the BEV backbone: the parser
    ran, the grid survives the sparse backbone, the widths agree. Returns model.args.grid_size."""
    args = hypes["model"]["args"]
    grid = _grid_size(args, source)
    _check_backbone_3d(args, source)
    if args["mean_vfe"]["feature_points"] != NUM_POINT_FEATURES:
        raise ConfigError(f"{source}: model.args.mean_vfe.feature_points must be {NUM_POINT_FEATURES} (x, y, z, "
                          f"intensity: the features SpVoxelPreprocessor gives each point), got "
                          f"{args['mean_vfe']['feature_points']}; fix the hypes")
    _check_height(args, grid, source)
    check_bev_backbone(args, source)
    _check_levels(args, grid, source)
    return grid


def _check_levels(args: Mapping, grid: Sequence[int], source: str) -> None:
    """The BEV backbone's levels meet on the sparse backbone's map (was a traceback in torch.cat, or in the
    deblock's allocation for a huge stride)."""
    bev, (_, rows, cols) = args["base_bev_backbone"], output_shape(grid)
    cells = 8 * math.prod(int(s) for s in bev["layer_strides"])
    check_levels_concatenate(bev, rows, cols, source,
                             f"the sparse backbone's map is {cols} x {rows} cells (model.args.grid_size {list(grid)} "
                             f"over its stride 8)",
                             f"make each level's upsample stride undo its layer strides (upstream's: layer_strides "
                             f"[1, 2], upsample_strides [1, 2]) and the range's x and y extents whole multiples of "
                             f"{cells} voxels")


def check_second_heads(hypes: Mapping, grid: Sequence[int], source: str) -> None:
    """The heads' map on the anchors' grid, and the model's grid and anchor count the data's and the anchors'."""
    _check_head_grid(hypes, grid, source)
    check_grid_agreement(hypes, source)


def check_second_args(hypes: Mapping, source: str) -> None:
    """``second``: the shared rules; early and late fusion send no feature map, so nothing is compressed."""
    grid = check_sparse_front(hypes, source)
    refuse_compression(hypes["model"]["args"], source, BACKBONE_COMPRESSION,
                       "early and late fusion send no feature map")
    check_second_heads(hypes, grid, source)


def _grid_size(args: Mapping, source: str) -> Sequence[int]:
    grid = args.get("grid_size")
    if grid is None:
        raise ConfigError(f"{source}: model.args.grid_size is missing; add 'yaml_parser: load_second_params' to the "
                          f"hypes so that it is computed")
    if len(grid) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in grid):
        raise ConfigError(f"{source}: model.args.grid_size must be 3 positive integers [x, y, z] (the voxels of "
                          f"preprocess.cav_lidar_range), got {grid!r}; let load_second_params compute it")
    return grid


def _check_backbone_3d(args: Mapping, source: str) -> None:
    cfg = args.get("backbone_3d")
    if not (cfg == [] or isinstance(cfg, dict) and set(cfg) <= {"num_features_out"}):
        raise ConfigError(f"{source}: model.args.backbone_3d must be [] (upstream's: conv_out 128 wide) or "
                          f"{{num_features_out: N}}, got {cfg!r}; fix the hypes")


def min_grid_z() -> int:
    """The fewest z cells of grid_size that leave a height after the backbone's strided layers (24)."""
    z = 1
    while output_shape([1, 1, z])[0] < 1:
        z += 1
    return z


def _check_height(args: Mapping, grid: Sequence[int], source: str) -> None:
    depth = output_shape(grid)[0]
    if depth < 1:
        raise ConfigError(f"{source}: model.args.grid_size z = {grid[2]} cells (preprocess.cav_lidar_range height / "
                          f"preprocess.args.voxel_size z) leaves no height after the sparse backbone's 4 strided "
                          f"layers; it needs at least {min_grid_z()}: use a smaller voxel_size z")
    width, feature_num = num_features_out(args["backbone_3d"]), args["height_compression"]["feature_num"]
    if feature_num != width * depth:
        raise ConfigError(f"{source}: model.args.height_compression.feature_num ({feature_num}) must be the sparse "
                          f"backbone's width ({width}: model.args.backbone_3d.num_features_out, default 128) x the "
                          f"{depth} height cells it leaves of model.args.grid_size z = {grid[2]}; set it to "
                          f"{width * depth}")


def head_map_shape(args: Mapping, grid: Sequence[int]) -> Tuple[int, int]:
    """(H, W) of the heads' map: grid_size through the sparse backbone and the BEV backbone's level 0."""
    bev = args["base_bev_backbone"]
    _, rows, cols = output_shape(grid)
    first = int(bev["layer_strides"][0])
    rows, cols = (rows - 1) // first + 1, (cols - 1) // first + 1  # ZeroPad2d(1) + 3x3 conv at that stride
    ups = list(bev["upsample_strides"])
    for stride in ups[:1] + ups[len(bev["layer_nums"]):]:  # level 0's deblock, then one on the concatenation
        rows, cols = deblock_cells(rows, stride), deblock_cells(cols, stride)
    return rows, cols


def _check_head_grid(hypes: Mapping, grid: Sequence[int], source: str) -> None:
    anchor = get_key(hypes, "postprocess.anchor_args", {})
    if not all(isinstance(anchor.get(k), int) for k in ("H", "W", "feature_stride")):
        return  # the post-processor's own check names what is missing
    stride = anchor["feature_stride"]
    expected = (anchor["H"] // stride, anchor["W"] // stride)
    found = head_map_shape(hypes["model"]["args"], grid)
    if found != expected:
        raise ConfigError(f"{source}: the heads' map is {found[0]} x {found[1]} cells (model.args.grid_size through "
                          f"the sparse backbone's stride 8 and model.args.base_bev_backbone's layer_strides and "
                          f"upsample_strides), the anchors' {expected[0]} x {expected[1]} (postprocess.anchor_args "
                          f"H x W // feature_stride {stride}); make feature_stride the model's stride and the "
                          f"grid's x and y cells multiples of it")


@MODELS.register("second", fusion="none", required=SECOND_KEYS, optional=SECOND_OPTIONAL_KEYS,
                 check=check_second_args)
class Second(nn.Module):
    """Voxels -> sparse 3-D backbone -> BEV -> BEV backbone -> 1x1 heads, one map per point cloud."""

    fusion_factory = None  # second_intermediate: AttFuse's attention at every BEV level
    backbone_compresses = False  # second_intermediate: base_bev_backbone.compression builds auto-encoders

    def __init__(self, args: Mapping):
        super().__init__()
        # Built in upstream's order (its state-dict order, and the order a seed initialises the layers in).
        self.mean_vfe = MeanVFE(args["mean_vfe"]["feature_points"])
        self.backbone_3d = VoxelBackBone8x(args["backbone_3d"], self.mean_vfe.get_output_feature_dim(),
                                           args["grid_size"])
        self.height_compression = HeightCompression(args["height_compression"])
        bev = args["base_bev_backbone"]
        compression = int(bev.get("compression", 0) or 0) if self.backbone_compresses else 0
        self.backbone_2d = BaseBEVBackbone(bev, self.height_compression.num_bev_features,
                                           fusion_factory=self.fusion_factory, compression=compression)
        channels, anchors = self.backbone_2d.num_bev_features, int(args["anchor_number"])
        self.cls_head = nn.Conv2d(channels, anchors, kernel_size=1)
        self.reg_head = nn.Conv2d(channels, 7 * anchors, kernel_size=1)
        self.lidar_range = [float(v) for v in args["lidar_range"]]

    @classmethod
    def sent_maps(cls, args: Mapping) -> Optional[List[Map]]:
        """None: early fusion sends points and late fusion boxes, no feature map (models/communication.py)."""
        return None

    @staticmethod
    def num_images(data_dict: Mapping) -> int:
        """How many maps the sparse tensor holds: every CAV where record_len groups them, else every sample (a
        trailing one without voxels included). Without either, the last voxel's map tells (``maps_of_coords``,
        the pillar scatter's fallback too)."""
        images = PointPillar.num_images(data_dict)
        return images if images is not None else maps_of_coords(data_dict["processed_lidar"]["voxel_coords"])

    # The pillar models' seam (models/point_pillar.py; engine/capture.py's --capture): `front` is everything whose
    # shapes follow the voxels (the mean VFE and spconv's sparse backbone, which no compiler traces) up to the
    # dense BEV map; `dense` is the BEV backbone and the heads, whose shapes the grid and the CAV layout fix.
    def front(self, data_dict: Mapping) -> torch.Tensor:
        """(maps, C, H, W): the sparse backbone's output, its height folded into the channels."""
        lidar = data_dict["processed_lidar"]
        batch = {"voxel_features": lidar["voxel_features"], "voxel_coords": lidar["voxel_coords"],
                 "voxel_num_points": lidar["voxel_num_points"], "num_images": self.num_images(data_dict)}
        batch = self.mean_vfe(batch)
        batch = self.backbone_3d(batch)
        return self.height_compression(batch)["spatial_features"]

    def layout(self, data_dict: Mapping) -> dict:
        """What `dense` reads of the batch besides the map: nothing moves or is fused here."""
        return {"record_len": data_dict.get("record_len"), "ego_warp": None}

    def dense(self, features: torch.Tensor, layout: Mapping) -> dict:
        """The BEV backbone (fused level by level in second_intermediate) and the 1x1 heads."""
        batch = {"spatial_features": features, "record_len": layout["record_len"], "ego_warp": layout["ego_warp"]}
        features = self.backbone_2d(batch)["spatial_features_2d"]
        return {"psm": self.cls_head(features), "rm": self.reg_head(features)}

    def forward(self, data_dict: Mapping) -> dict:
        return self.dense(self.front(data_dict), self.layout(data_dict))


__all__ = ["Second", "SECOND_KEYS", "SECOND_OPTIONAL_KEYS", "check_sparse_front", "check_second_heads",
           "check_second_args", "head_map_shape", "min_grid_z"]
