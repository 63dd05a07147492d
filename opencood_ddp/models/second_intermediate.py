"""SECOND with intermediate (attention) fusion (upstream ``opencood/models/second_intermediate.py``).

Per CAV: MeanVFE (the mean point of each voxel) -> VoxelBackBone8x (sparse 3-D convolutions on spconv, stride 8)
-> HeightCompression (height folded into channels) -> the BEV backbone, whose every level is fused across the
sample's CAVs by AttFuse's per-cell attention before its deblock (upstream's ``AttBEVBackbone``: the next level
keeps working on every CAV's unfused map) -> 1x1 heads on the one fused map per sample. It is ``second.py``'s
detector with that fusion (the attention has no parameters, so the state dicts' names are the same for one
backbone configuration); the hypes rules both share are there.

With ``fusion.args.proj_first`` true (upstream's default) the clouds come projected into the ego's frame and the
maps are fused as they come, as upstream's. With false, where upstream would fuse cells of unaligned maps, every
level's maps are warped into the ego's frame first (``modules/ego_warp.py``), as AttFuse's.

Upstream's ``model.args.batch_size`` is accepted and not read: the number of CAV maps is ``record_len``'s sum, so
any batch works. The widths follow the hypes as in ``second.py``. ``model.args.base_bev_backbone.compression``
adds AttFuse's per-level auto-encoders (``modules/compressor.py``), as upstream's AttBEVBackbone does.
"""
from __future__ import annotations

from typing import List, Mapping

from opencood_ddp.models.checks import check_backbone_compression
from opencood_ddp.models.modules.ego_warp import batch_ego_warp
from opencood_ddp.models.modules.fusion import AttFusion
from opencood_ddp.models.modules.sparse_backbone import output_shape
from opencood_ddp.models.point_pillar import Map, PointPillar, attfuse_sent_maps
from opencood_ddp.models.second import (SECOND_KEYS, SECOND_OPTIONAL_KEYS, Second, check_second_heads,
                                        check_sparse_front)
from opencood_ddp.registry import MODELS


def check_second_intermediate_args(hypes: Mapping, source: str) -> None:
    """SECOND's rules (second.py), and a backbone compression whose auto-encoders give back every level's map."""
    grid = check_sparse_front(hypes, source)
    _, rows, cols = output_shape(grid)  # the BEV backbone's input: the sparse backbone's output, height folded
    check_backbone_compression(hypes["model"]["args"], source, rows, cols)
    check_second_heads(hypes, grid, source)


@MODELS.register("second_intermediate", fusion="intermediate (attention)", required=SECOND_KEYS,
                 optional=SECOND_OPTIONAL_KEYS, check=check_second_intermediate_args)
class SecondIntermediate(Second):
    """Voxels -> sparse 3-D backbone -> BEV -> attention-fused BEV backbone -> 1x1 heads, one map per sample."""

    fusion_factory = AttFusion
    backbone_compresses = True

    @classmethod
    def sent_maps(cls, args: Mapping) -> List[Map]:
        """Every level's map of the BEV backbone (fused level by level, as AttFuse), the auto-encoders'
        bottlenecks under base_bev_backbone.compression."""
        _, rows, cols = output_shape(args["grid_size"])
        return attfuse_sent_maps(args["base_bev_backbone"], rows, cols)

    def layout(self, data_dict: Mapping) -> dict:
        """``record_len`` and the maps' warp into their ego's frame (None where no map moves)."""
        warp = batch_ego_warp(data_dict, self.lidar_range, PointPillar.maps_device(data_dict))
        return {"record_len": data_dict["record_len"], "ego_warp": warp}


__all__ = ["SecondIntermediate", "check_second_intermediate_args"]
