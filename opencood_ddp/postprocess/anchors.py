"""Anchor boxes on the detection head's BEV grid, from ``postprocess.anchor_args``.

Upstream counterpart: ``VoxelPostprocessor.generate_anchor_box``
(``opencood/data_utils/post_processor/voxel_postprocessor.py``). One anchor per output cell and per entry of
``r`` (degrees): centres on ``linspace(x_min + vw, x_max - vw, W // feature_stride)`` (y likewise with vh and H),
z = -1, sizes l, w, h. ``W``, ``H``, ``vw``, ``vh`` are written into ``anchor_args`` by the hypes' yaml_parser
(``load_point_pillar_params``). The result is (H // stride, W // stride, num, 7) float64 in 'hwl' order
``[x, y, z, h, w, l, yaw]``; 'lwh' would give ``[x, y, z, l, w, h, yaw]``. (Upstream's second order is 'lhw',
which its label generation then refuses; the post-processor only accepts 'hwl', see ``voxel_postprocessor``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Tuple

import numpy as np

DEFAULT_FEATURE_STRIDE = 2


@dataclass(frozen=True)
class AnchorSpec:
    """The numbers ``generate_anchors`` needs, read from ``postprocess.anchor_args`` (already validated)."""

    lidar_range: Tuple[float, ...]
    length: float
    width: float
    height: float
    yaws_deg: Tuple[float, ...]
    grid_w: int
    grid_h: int
    voxel_w: float
    voxel_h: float
    feature_stride: int = DEFAULT_FEATURE_STRIDE

    @classmethod
    def from_anchor_args(cls, anchor_args: Mapping) -> "AnchorSpec":
        return cls(lidar_range=tuple(float(v) for v in anchor_args["cav_lidar_range"]),
                   length=float(anchor_args["l"]), width=float(anchor_args["w"]), height=float(anchor_args["h"]),
                   yaws_deg=tuple(float(r) for r in anchor_args["r"]),
                   grid_w=int(anchor_args["W"]), grid_h=int(anchor_args["H"]),
                   voxel_w=float(anchor_args["vw"]), voxel_h=float(anchor_args["vh"]),
                   feature_stride=int(anchor_args.get("feature_stride", DEFAULT_FEATURE_STRIDE)))

    @property
    def feature_shape(self) -> Tuple[int, int]:
        """(H, W) of the head's output map: the BEV grid divided (floor) by the feature stride."""
        return self.grid_h // self.feature_stride, self.grid_w // self.feature_stride


def generate_anchors(spec: AnchorSpec, order: str = "hwl") -> np.ndarray:
    """(H // stride, W // stride, len(yaws), 7) float64 anchors, upstream's values and layout."""
    if order not in ("hwl", "lwh"):
        raise ValueError(f"anchor order must be 'hwl' or 'lwh', got {order!r}")
    x_min, y_min, _, x_max, y_max, _ = spec.lidar_range
    rows, cols = spec.feature_shape
    x = np.linspace(x_min + spec.voxel_w, x_max - spec.voxel_w, cols)
    y = np.linspace(y_min + spec.voxel_h, y_max - spec.voxel_h, rows)
    cx, cy = np.meshgrid(x, y)  # (rows, cols): row index walks y, column index walks x
    num = len(spec.yaws_deg)
    shape = (rows, cols, num)
    yaw = np.broadcast_to(np.array([math.radians(r) for r in spec.yaws_deg]), shape)
    sizes = (spec.height, spec.width, spec.length) if order == "hwl" else (spec.length, spec.width, spec.height)
    columns = [np.broadcast_to(cx[..., None], shape), np.broadcast_to(cy[..., None], shape), np.full(shape, -1.0)]
    columns += [np.full(shape, s) for s in sizes]
    columns.append(yaw)
    return np.stack(columns, axis=-1)


__all__ = ["DEFAULT_FEATURE_STRIDE", "AnchorSpec", "generate_anchors"]
