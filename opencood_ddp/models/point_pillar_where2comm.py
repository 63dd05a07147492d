"""Where2comm (upstream ``opencood/models/point_pillar_where2comm.py``): PointPillar features sent where they
are needed, by a spatial confidence map.

Per CAV: pillars -> BEV -> backbone -> shrink header -> the class head gives a confidence map, which the
communication module turns into a binary mask of the cells the CAV sends (the ego keeps its whole map;
``modules/where2comm.py``). With ``multi_scale: true`` (upstream's OPV2V setting) the backbone's levels run
again inside the model: level 0's output is masked, each level's maps are warped into the ego's frame and
fused per sample (attention of the ego over its CAVs), upsampled by the level's deblock and concatenated,
then shrunk and sent to the heads. With ``multi_scale: false`` the shrunk maps themselves are masked and fused.

Output per sample: ``psm``, ``rm`` and two detached 0-d tensors describing the batch: ``comm_rate``, the share
of the non-ego CAVs' BEV cells that were sent (a cell of the masked map with a non-zero mask; 0 for a batch
without a non-ego CAV), and ``com``, OpenCOOD's rate (upstream's output key): per sample, the cells above the
threshold over all its CAVs, the ego's own map included, on the heads' grid, averaged over the samples (1 when
everything is sent). Threshold semantics, the same in training and evaluation: a cell is sent when its confidence is
strictly above the threshold, and a threshold <= 0 sends everything (rate 1). A threshold above the
smoothing kernel's sum (about 0.98 for upstream's 5 x 5, sigma 1; 1 without smoothing) sends nothing (rate
0): the detections then come from the ego's data alone.

Departures from upstream (docs/compatibility.md):
- OpenCOOD trains with a random proxy (each sample sends its top K cells, K drawn from Python's ``random``)
  and thresholds only in evaluation. That draw depends on how the batch is split over ranks and is not part
  of the checkpointed RNG state, so N ranks could not follow 1 rank nor a resumed run the straight one. Here
  training thresholds as evaluation does, as the Where2comm repository's own code does.
- Upstream's single-scale path in ``where2comm_attn.py`` multiplies sample b's CAVs by
  ``communication_masks[b]``, row b of the masks of the whole batch (CAV b of sample 0, say), so with
  batch > 1 a sample is masked by another sample's CAV. Its communication module also keeps every other CAV
  whole (``mask[::2] = 1``) rather than the ego alone, and reports the ego's own rate. Here each CAV is
  masked by its own map, only egos are kept whole, and the rate counts the non-ego CAVs.
- OpenCOOD does not warp (it needs proj_first); the Where2comm repository normalises the translation with
  ``downsample_rate`` times the input width, which is wrong for its multi-scale input. Here the warp is
  normalised by ``lidar_range``, right at every level.
- The confidence pass of the multi-scale path runs without autograd: its only use is a threshold, which
  has no gradient, so the parameter gradients are upstream's.

``model.args.compression`` puts upstream's ``naive_compressor`` on every CAV's shrunk map after the
confidence map is taken from it (the ego's map is compressed too, as upstream's). With ``multi_scale: true``
upstream runs the compressor and then discards its output (the multi-scale path re-runs the backbone on the
uncompressed pillar maps), so its parameters never get a gradient; here it is built (its weights load and
save) but neither run nor trained: frozen, with the same outputs and the same weights as upstream's.

Two spellings of the fusion block build the same model: OpenCOOD's ``where2comm_fusion`` (``fully``,
``communication.threshold``) and the Where2comm repository's ``fusion_args`` (``communication.thre``,
``agg_operator``; no ``communication`` block sends everything).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key, validate
from opencood_ddp.models.checks import (SHRINK_HEADER_KEYS, check_anchor_stride, check_max_cav, check_shrink_neck,
                                        head_stride, level_map_sizes, refuse)
from opencood_ddp.models.modules.ego_warp import batch_ego_warp
from opencood_ddp.models.modules.shrink_neck import ShrinkNeck
from opencood_ddp.models.modules.where2comm import AGGREGATORS, Communication, Rates, Where2commFusion, cav_rows
from opencood_ddp.models.point_pillar import PILLAR_KEYS, PILLAR_OPTIONAL_KEYS, Map, PointPillar, check_pillar_args
from opencood_ddp.registry import MODELS

_ARGS = "model.args."
OPENCOOD_BLOCK, WHERE2COMM_BLOCK = "where2comm_fusion", "fusion_args"


def _keys(prefix: str, pairs: Sequence[Tuple[str, str]]) -> Tuple[Tuple[str, str], ...]:
    return tuple((_ARGS + prefix + key, kind) for key, kind in pairs)


# Keys both spellings share; whichever block is present must hold the required ones (checked in the check).
_BLOCK_REQUIRED = (("voxel_size", "list"), ("downsample_rate", "positive_int"), ("multi_scale", "bool"))
_BLOCK_OPTIONAL = (("in_channels", "positive_int"), ("layer_nums", "list"), ("num_filters", "list"),
                   ("communication", "dict"), ("communication.round", "positive_int"),
                   ("communication.gaussian_smooth", "dict"),
                   ("communication.gaussian_smooth.k_size", "positive_int"),
                   ("communication.gaussian_smooth.c_sigma", "number"))
OPENCOOD_REQUIRED = _BLOCK_REQUIRED + (("fully", "bool"), ("in_channels", "positive_int"),
                                       ("communication.threshold", "number"))
WHERE2COMM_REQUIRED = _BLOCK_REQUIRED + (("agg_operator.mode", "str"),)
WHERE2COMM_OPTIONAL = (("n_head", "positive_int"), ("dropout_rate", "number"), ("only_attention", "bool"),
                       ("agg_operator", "dict"), ("agg_operator.feature_dim", "positive_int"),
                       ("communication.thre", "number"))

WHERE2COMM_KEYS = PILLAR_KEYS + ((_ARGS + "max_cav", "positive_int"),)
WHERE2COMM_OPTIONAL_KEYS = (
    PILLAR_OPTIONAL_KEYS
    + ((_ARGS + "head_dim", "positive_int"),) + SHRINK_HEADER_KEYS
    + ((_ARGS + OPENCOOD_BLOCK, "dict"), (_ARGS + WHERE2COMM_BLOCK, "dict"))
    + _keys(OPENCOOD_BLOCK + ".", OPENCOOD_REQUIRED + _BLOCK_OPTIONAL)
    + _keys(WHERE2COMM_BLOCK + ".", WHERE2COMM_REQUIRED + _BLOCK_OPTIONAL + WHERE2COMM_OPTIONAL))


# ------------------------------------------------------------------------------------------ the fusion block
def fusion_block(args: Mapping, source: str) -> Tuple[str, Mapping]:
    """(name, block) of the one fusion block the args hold, or a ConfigError."""
    present = [name for name in (OPENCOOD_BLOCK, WHERE2COMM_BLOCK) if name in args]
    if len(present) != 1:
        found = "both" if present else "neither"
        raise ConfigError(f"{source}: model.args needs exactly one of {OPENCOOD_BLOCK} (OpenCOOD's spelling) and "
                          f"{WHERE2COMM_BLOCK} (the Where2comm repository's), found {found}; keep one")
    return present[0], args[present[0]]


@dataclass(frozen=True)
class Where2commSpec:
    """What the fusion block says, whichever spelling: enough to build ``Where2commFusion``."""

    multi_scale: bool
    aggregator: str  # a key of AGGREGATORS
    fully: bool  # send every cell (OpenCOOD's fully, or a Where2comm block without communication)
    threshold: Optional[float]  # None: no communication module (and no gaussian_filter in the state dict)
    smoothing: Optional[Tuple[int, float]]  # (k_size, c_sigma)

    @classmethod
    def from_args(cls, args: Mapping, source: str = "hypes") -> "Where2commSpec":
        name, block = fusion_block(args, source)
        communication = block.get("communication")
        if name == OPENCOOD_BLOCK:
            threshold, fully, aggregator = communication["threshold"], bool(block["fully"]), "ATTEN"
        else:
            threshold = communication["thre"] if communication is not None else None
            fully, aggregator = communication is None, block["agg_operator"]["mode"]
        smooth = (communication or {}).get("gaussian_smooth")
        smoothing = (int(smooth["k_size"]), float(smooth["c_sigma"])) if smooth is not None else None
        return cls(bool(block["multi_scale"]), aggregator, fully,
                   float(threshold) if threshold is not None else None, smoothing)


# ------------------------------------------------------------------------------------------ hypes checks
def _check_block_keys(hypes: Mapping, source: str, name: str, block: Mapping) -> None:
    required = OPENCOOD_REQUIRED if name == OPENCOOD_BLOCK else WHERE2COMM_REQUIRED
    if block.get("multi_scale") is True:
        required += (("layer_nums", "list"), ("num_filters", "list"))
    elif name == WHERE2COMM_BLOCK and get_key(block, "agg_operator.mode") == "ATTEN":
        required += (("agg_operator.feature_dim", "positive_int"),)
    if name == WHERE2COMM_BLOCK and "communication" in block:
        required += (("communication.thre", "number"),)
    if get_key(block, "communication.gaussian_smooth") is not None:
        required += (("communication.gaussian_smooth.k_size", "positive_int"),
                     ("communication.gaussian_smooth.c_sigma", "number"))
    validate(hypes, _keys(name + ".", required), source)


def _check_communication(source: str, key: str, block: Mapping) -> None:
    communication = block.get("communication") or {}
    if communication.get("round", 1) != 1:
        refuse(source, f"{key}.communication.round must be 1 (multi-round communication is not built, and "
                       f"upstream's single-round code ignores the key); set it to 1")
    smooth = communication.get("gaussian_smooth")
    if smooth is not None:
        if smooth["k_size"] % 2 != 1:
            refuse(source, f"{key}.communication.gaussian_smooth.k_size must be odd (the smoothed map keeps the "
                           f"confidence map's size), got {smooth['k_size']}")
        if not smooth["c_sigma"] > 0:
            refuse(source, f"{key}.communication.gaussian_smooth.c_sigma must be > 0, got {smooth['c_sigma']}")
    mode = get_key(block, "agg_operator.mode")
    if mode is not None and mode not in AGGREGATORS:
        refuse(source, f"{key}.agg_operator.mode {mode!r} is not one of {', '.join(AGGREGATORS)} (Transformer "
                       f"aggregation is not built)")


def _check_widths(hypes: Mapping, source: str, key: str, block: Mapping) -> None:
    args = hypes["model"]["args"]
    bev, heads = args["base_bev_backbone"], check_shrink_neck(args, source)
    if list(block["voxel_size"]) != list(args["voxel_size"]):
        refuse(source, f"{key}.voxel_size {block['voxel_size']} must equal model.args.voxel_size {args['voxel_size']}")
    if block["multi_scale"]:
        for name in ("layer_nums", "num_filters"):
            if list(block[name]) != list(bev[name]):
                refuse(source, f"{key}.{name} {block[name]} must equal model.args.base_bev_backbone.{name} "
                               f"{bev[name]} (the fusion runs the backbone's levels)")
    widths = [(f"{key}.in_channels", block.get("in_channels")), (_ARGS + "head_dim", args.get("head_dim"))]
    if get_key(block, "agg_operator.mode") == "ATTEN" and not block["multi_scale"]:
        widths.append((f"{key}.agg_operator.feature_dim", get_key(block, "agg_operator.feature_dim")))
    for name, value in widths:
        if value is not None and value != heads:
            refuse(source, f"{name} ({value}) must equal the channels the heads see ({heads}: "
                           f"model.args.shrink_header.dim[-1], else the backbone's output)")


def _check_strides(hypes: Mapping, source: str, key: str, block: Mapping) -> None:
    stride = head_stride(hypes["model"]["args"])
    check_anchor_stride(hypes, source, stride)
    if not block["multi_scale"] and stride is not None and block["downsample_rate"] != stride:
        refuse(source, f"{key}.downsample_rate ({block['downsample_rate']}) must equal the stride of the fused "
                       f"map ({stride:g}) when multi_scale is false")


def _check_unbuilt_options(source: str, args: Mapping) -> None:
    if get_key(args, "base_bev_backbone.resnet"):
        refuse(source, "model.args.base_bev_backbone.resnet is not built (the ResNet backbone of the Where2comm "
                       "repository); remove it")
    if "dcn" in args:
        refuse(source, "model.args.dcn (deformable convolution) is not built; remove it")


def check_where2comm_args(hypes: Mapping, source: str) -> None:
    """The pillar rules, then one fusion block with its keys, and widths, strides and max_cav that agree."""
    check_pillar_args(hypes, source)
    args = hypes["model"]["args"]
    name, block = fusion_block(args, source)
    key = _ARGS + name
    _check_block_keys(hypes, source, name, block)
    _check_communication(source, key, block)
    _check_unbuilt_options(source, args)
    _check_widths(hypes, source, key, block)
    _check_strides(hypes, source, key, block)
    check_max_cav(hypes, source)


# ------------------------------------------------------------------------------------------ the model
@MODELS.register("point_pillar_where2comm", fusion="intermediate (where2comm)", required=WHERE2COMM_KEYS,
                 optional=WHERE2COMM_OPTIONAL_KEYS, check=check_where2comm_args)
class PointPillarWhere2comm(ShrinkNeck, PointPillar):
    """PointPillar with Where2comm's confidence-masked communication and attention fusion."""

    def build_neck(self, args: Mapping) -> None:
        spec = Where2commSpec.from_args(args)
        self.build_shrink_neck(args)
        if spec.multi_scale and self.naive_compressor is not None:
            # Upstream discards the compressor's output on this path: no gradient ever reaches it (module doc).
            self.naive_compressor.requires_grad_(False)
        block = args[OPENCOOD_BLOCK if OPENCOOD_BLOCK in args else WHERE2COMM_BLOCK]
        levels = block["num_filters"] if spec.multi_scale else [self.shrunk_channels()]
        communication = (Communication(spec.threshold, spec.smoothing) if spec.threshold is not None else None)
        self.fusion_net = Where2commFusion(levels, spec.aggregator, args["lidar_range"], communication, spec.fully)
        self.multi_scale = spec.multi_scale
        self.max_cav = int(args["max_cav"])

    @classmethod
    def sent_maps(cls, args: Mapping) -> Optional[List[Map]]:
        """Every cell of the map a CAV may send: level 0 of the backbone, uncompressed, with multi_scale (as
        upstream, which bypasses shrink header and compressor there), else the (compressed) shrunk map. The
        share actually sent is the batch's ``comm_rate``."""
        _, block = fusion_block(args, "hypes")
        if not block["multi_scale"]:
            return super().sent_maps(args)
        grid = args["point_pillar_scatter"]["grid_size"]
        rows, cols = level_map_sizes(args["base_bev_backbone"], int(grid[1]), int(grid[0]))[0]
        return [(int(args["base_bev_backbone"]["num_filters"][0]), rows, cols)]

    def single_maps(self, spatial: torch.Tensor) -> torch.Tensor:
        """Every CAV's own shrunk backbone output (no fusion)."""
        return self.shrink(self.backbone({"spatial_features": spatial})["spatial_features_2d"])

    def fuse_levels(self, spatial: torch.Tensor, psm_single: torch.Tensor,
                    layout: Mapping) -> Tuple[torch.Tensor, Rates]:
        """Upstream's multi-scale path: the backbone's levels again, level 0 masked, every level fused."""
        backbone, x, ups = self.backbone, spatial, []
        rates = None
        for level, block in enumerate(backbone.blocks):
            x = block(x)
            if level == 0:  # the masked maps also feed the deeper levels, as upstream
                mask, rates = self.fusion_net.communicate(psm_single, layout["cav_rows"], tuple(x.shape[-2:]))
                x = x if mask is None else x * mask
            fused = self.fusion_net.fuse(level, x, layout["record_len"], layout["ego_warp"])
            ups.append(backbone.deblocks[level](fused) if len(backbone.deblocks) > 0 else fused)
        x = torch.cat(ups, dim=1) if len(ups) > 1 else ups[0]
        if len(backbone.deblocks) > len(backbone.blocks):
            x = backbone.deblocks[-1](x)
        return self.shrink(x), rates

    def layout(self, data_dict: Mapping) -> dict:
        """``record_len``, the warp into the ego's frame (normalised by the fusion's lidar_range; None where no map
        moves, proj_first: true, and the fusions then take the maps as they are, as a warp would) and the CAV rows
        the communication reads, made where ``record_len`` is."""
        record_len = data_dict["record_len"]
        device = self.maps_device(data_dict)
        warp = batch_ego_warp({"record_len": record_len, "pairwise_t_matrix": data_dict["pairwise_t_matrix"]},
                              self.fusion_net.lidar_range, device)
        rows = cav_rows(record_len, device)
        return {"record_len": record_len, "ego_warp": warp, "cav_rows": rows}

    def dense(self, features: torch.Tensor, layout: Mapping) -> dict:
        """Confidence, communication mask, fusion and heads on the scattered maps."""
        if self.multi_scale:
            with torch.no_grad():  # feeds a threshold only: no gradient would flow back through it
                psm_single = self.cls_head(self.single_maps(features))
            fused, rates = self.fuse_levels(features, psm_single, layout)
        else:
            shrunk = self.single_maps(features)
            with torch.no_grad():
                psm_single = self.cls_head(shrunk)  # the confidence comes from the uncompressed map, as upstream
            shrunk = self.compress(shrunk)
            mask, rates = self.fusion_net.communicate(psm_single, layout["cav_rows"])
            fused = self.fusion_net.fuse(0, shrunk if mask is None else shrunk * mask, layout["record_len"],
                                         layout["ego_warp"])
        return {**self.heads(fused), "comm_rate": rates.comm_rate, "com": rates.com}
