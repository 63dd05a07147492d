"""Points -> voxels (pillars) with torch's sorts, on any device: spconv's CPU generator's output, bit for bit.

``data/voxelize.py`` runs spconv 2.x's CPU ``PointToVoxel`` inside the DataLoader workers. That generator walks the
points in order and fills a dense hash: a point's cell is ``floor((p - low) / size)`` in float32 on each axis, the
point is dropped when a cell index lies outside ``[0, grid)``, voxels are numbered in the order their first point
comes, a voxel keeps its first ``max_points_per_voxel`` points, and a point whose cell would be voxel number
``max_voxels`` or later is dropped (as is every later point of that cell). spconv's CUDA generator fills its hash
with atomics, so its voxel order and, in a full voxel, its choice of points depend on the threads' timing.

``voxelize_groups`` computes the same result with sorts and scatters, which torch runs deterministically on every
device: the same points in the same order give the same voxels, in the same order, with the same points in each, on
the CPU and on a GPU. It voxelizes several clouds at once, each a ``group`` of consecutive points with its own
numbering and its own ``max_voxels`` (intermediate fusion's CAVs, early fusion's samples), and returns them
concatenated in group order with the group as the coordinates' first column: upstream's collated layout
(``voxelize.collate_voxels``).

The arithmetic is spconv's: the cell in float32 ``(p - low) / size`` floored (the C++ kernel's float operands), the
grid ``round((high - low) / size)`` in float32 with halves away from zero (``std::round``), coordinates in
(z, y, x) order, zero rows past a voxel's points. tests/test_sorted_voxels.py compares it with spconv's generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.yaml_parsers import voxel_grid_cells


@dataclass(frozen=True)
class VoxelGrid:
    """The voxelizer's settings (``preprocess.args`` and ``cav_lidar_range``), as plain numbers."""

    voxel_size: Tuple[float, float, float]          # x, y, z metres
    lidar_range: Tuple[float, float, float, float, float, float]
    max_points_per_voxel: int
    max_voxels: int                                 # per group
    num_point_features: int = 4

    def __post_init__(self) -> None:
        if len(self.voxel_size) != 3 or len(self.lidar_range) != 6 or min(self.voxel_size) <= 0:
            raise ConfigError(f"a voxel grid needs 3 positive voxel sizes and a 6-number range, got "
                              f"{self.voxel_size!r} and {self.lidar_range!r}; fix preprocess in the hypes")
        if self.max_points_per_voxel < 1 or self.max_voxels < 1 or self.num_point_features < 3:
            raise ConfigError(f"max_points_per_voxel ({self.max_points_per_voxel}) and max_voxels "
                              f"({self.max_voxels}) must be >= 1 and num_point_features >= 3; fix preprocess.args")

    @property
    def grid_size(self) -> Tuple[int, int, int]:
        """(x, y, z) cells, as spconv's constructor computes them (``yaml_parsers.voxel_grid_cells``)."""
        return tuple(voxel_grid_cells(self.lidar_range, self.voxel_size))


def _cells(xyz: torch.Tensor, grid: VoxelGrid) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, 3) float32 cell indices (x, y, z) floored as spconv's kernel floors them, and whether each is inside."""
    low = torch.tensor(grid.lidar_range[:3], dtype=torch.float32, device=xyz.device)
    size = torch.tensor(grid.voxel_size, dtype=torch.float32, device=xyz.device)
    cells = torch.floor((xyz - low) / size)
    extent = torch.tensor(grid.grid_size, dtype=torch.float32, device=xyz.device)
    # NaN and infinite coordinates fail both tests, as spconv's integer conversion puts them below 0.
    inside = ((cells >= 0) & (cells < extent)).all(dim=1)
    return cells, inside


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of 0..size-1 occurs in ``index``: bincount of a known length, which needs no host sync."""
    return torch.zeros(size, dtype=torch.long, device=index.device).scatter_add_(0, index, torch.ones_like(index))


def _first_positions(inverse: torch.Tensor, voxels: int) -> torch.Tensor:
    """Each voxel's first point: the lowest position among the points mapped to it."""
    positions = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((voxels,), len(inverse), dtype=torch.long, device=inverse.device)
    return first.scatter_reduce(0, inverse, positions, reduce="amin")


def _slots(inverse: torch.Tensor, voxels: int) -> torch.Tensor:
    """Each point's place among its voxel's points, in point order (a stable sort by voxel keeps that order)."""
    sorted_voxel, order = torch.sort(inverse, stable=True)
    counts = _counts(inverse, voxels)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(len(inverse), device=inverse.device) - starts[sorted_voxel]
    return slot


def _kept_voxels(first: torch.Tensor, voxel_group: torch.Tensor, groups: int, max_voxels: int) -> torch.Tensor:
    """The voxels each group keeps, in output order: by group, then by first point; at most max_voxels a group."""
    order = torch.argsort(first)  # first positions are distinct, and groups are runs of positions
    per_group = _counts(voxel_group, groups)
    group_start = torch.cumsum(per_group, 0) - per_group
    rank_in_group = torch.arange(len(order), device=order.device) - group_start[voxel_group[order]]
    return order[rank_in_group < max_voxels]


def voxelize_groups(points: torch.Tensor, group: torch.Tensor, groups: int, grid: VoxelGrid,
                    keep: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """(N, >=F) float32 points whose ``group`` (N,) int64 never decreases -> upstream's collated voxels of the
    ``groups`` groups: ``voxel_features`` (M, P, F) float32, ``voxel_coords`` (M, 4) int32 (group, z, y, x),
    ``voxel_num_points`` (M,) int32. A group without points has no voxels. ``keep`` (N,) bool leaves the other
    points out, as if they were not there (the device path's masks, in the same pass as the grid's)."""
    device = points.device
    features = points[:, :grid.num_point_features]
    cells, inside = _cells(features[:, :3], grid)
    position = torch.nonzero(inside if keep is None else inside & keep).squeeze(1)
    cells, point_group = cells[position].long(), group[position]
    nx, ny, nz = grid.grid_size
    linear = ((point_group * nz + cells[:, 2]) * ny + cells[:, 1]) * nx + cells[:, 0]
    unique, inverse = torch.unique(linear, sorted=True, return_inverse=True)
    voxel_group = unique // (nx * ny * nz)
    kept = _kept_voxels(_first_positions(inverse, len(unique)), voxel_group, groups, grid.max_voxels)
    new_index = torch.full((len(unique),), -1, dtype=torch.long, device=device)
    new_index[kept] = torch.arange(len(kept), device=device)
    slot = _slots(inverse, len(unique))
    row = new_index[inverse]
    take = torch.nonzero((row >= 0) & (slot < grid.max_points_per_voxel)).squeeze(1)
    row, slot, source = row[take], slot[take], position[take]
    voxels = torch.zeros((len(kept), grid.max_points_per_voxel, features.shape[1]), dtype=torch.float32,
                         device=device)
    voxels[row, slot] = features[source].to(torch.float32)
    cell = unique[kept]
    coords = torch.stack([cell // (nx * ny * nz), cell // (nx * ny) % nz, cell // nx % ny, cell % nx], dim=1)
    return {"voxel_features": voxels, "voxel_coords": coords.to(torch.int32),
            "voxel_num_points": _counts(row, len(kept)).to(torch.int32)}


__all__ = ["VoxelGrid", "voxelize_groups"]
