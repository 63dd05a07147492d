"""V2X-ViT's spatial alignment of the CAVs' BEV maps (upstream ``STTF`` and ``torch_transformation_utils.py``).

A CAV's feature map is resampled into the ego's frame with a metric 4x4 transform (CAV frame -> ego frame). Only
x, y and the yaw part are used: the transform becomes an affine map of feature-map pixels (column = lidar x,
row = lidar y), its translation divided by the size of one feature cell (voxel size x downsample rate).

As upstream, the rotation turns about pixel (W / 2, H / 2), half a cell off the lidar origin (which sits at
((W - 1) / 2, (H - 1) / 2) for a range symmetric about it); kept, so that upstream checkpoints see the maps they
were trained on. The grid follows ``align_corners=True`` (pixel centres at -1 and 1), bilinear for features and
nearest for the visibility mask, zeros outside the source map.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from opencood_ddp.models.modules.cav_layout import device_constant
from opencood_ddp.models.modules.grid_sampling import grid_sample
from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.numerics.autocast import HALF_DTYPES

_EPS = 1e-14  # upstream's denominator for a map one pixel wide


def pixel_transform(matrix: torch.Tensor, cell_size: float, height: int, width: int) -> torch.Tensor:
    """(n, 4, 4) metric transforms -> (n, 3, 3) homogeneous maps of (column, row) pixel coordinates."""
    rotation = matrix[:, :2, :2]
    centre = device_constant([width / 2, height / 2], matrix)
    shift = centre - rotation @ centre + matrix[:, :2, 3] / cell_size
    top = torch.cat([rotation, shift.unsqueeze(-1)], dim=2)
    bottom = device_constant([0.0, 0.0, 1.0], matrix).expand(matrix.shape[0], 1, 3)
    return torch.cat([top, bottom], dim=1)


def _pixels_to_unit(height: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """Pixel coordinates -> [-1, 1] with pixel centres at the ends (align_corners=True)."""
    sx = 2.0 / (width - 1.0 if width > 1 else _EPS)
    sy = 2.0 / (height - 1.0 if height > 1 else _EPS)
    return device_constant([[sx, 0.0, -1.0], [0.0, sy, -1.0], [0.0, 0.0, 1.0]], like)


def sampling_grid(pixel_map: torch.Tensor, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, 3, 3) source -> destination pixel maps -> (n, H, W, 2) grid_sample grid over the destination, in
    `dtype` or float32 if that is a 16-bit type (under --half, a float16 grid is off by a fifth of a cell)."""
    def grid(pixel_map: torch.Tensor) -> torch.Tensor:
        unit = _pixels_to_unit(height, width, pixel_map)
        # grid_sample looks up, for each destination pixel, where it came from: the inverse map. inv_ex, not
        # linalg.inv: the same kernel without the singular-matrix check, which reads the factorisation's status
        # back and so waits for a GPU (issue 52). A singular map gives non-finite entries instead of an error.
        theta = unit @ torch.linalg.inv_ex(pixel_map).inverse @ torch.linalg.inv_ex(unit).inverse
        full = torch.float32 if dtype in HALF_DTYPES else dtype
        return F.affine_grid(theta[:, :2].to(full), [pixel_map.shape[0], 1, height, width], align_corners=True)

    return in_full_precision(grid, pixel_map)


def warp(maps: torch.Tensor, grid: torch.Tensor, mode: str) -> torch.Tensor:
    """(n, C, H, W) maps resampled on ``grid``; zero where the grid leaves the source map. A full-precision
    island: 16-bit maps are sampled in float32 on the full-precision grid, and the answer is float32."""
    return in_full_precision(
        lambda maps, grid: grid_sample(maps, grid.to(maps.dtype), mode=mode, align_corners=True), maps, grid)


class SpatialAligner:
    """Warps CAV feature maps into the ego frame and says which ego-frame cells each CAV's map covers."""

    def __init__(self, voxel_size: float, downsample_rate: int):
        self.cell_size = float(voxel_size) * int(downsample_rate)

    def __call__(self, x: torch.Tensor, to_ego: torch.Tensor, moved: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x (N, H, W, C) channels last; to_ego (N, 4, 4); moved (M,) rows to warp (the non-ego CAVs).

        Returns the aligned maps and the visibility (N, H, W) bool: True where a row's warped map has data.
        Rows not in ``moved`` (each sample's ego) keep their map and see everything: upstream warps only the
        non-ego CAVs, and an identity resampling would not return the map bit for bit.
        """
        n, height, width, _ = x.shape
        visible = torch.ones(n, height, width, dtype=torch.bool, device=x.device)
        if moved.numel() == 0:
            return x, visible
        grid = sampling_grid(pixel_transform(to_ego[moved], self.cell_size, height, width), height, width, x.dtype)
        warped = warp(x[moved].permute(0, 3, 1, 2), grid, "bilinear").permute(0, 2, 3, 1)
        ones = x.new_ones(moved.numel(), 1, height, width)
        covered = warp(ones, grid, "nearest")[:, 0] > 0
        # Under autocast grid_sample may answer in float32 while x is half precision.
        return x.index_put((moved,), warped.to(x.dtype)), visible.index_put((moved,), covered)
