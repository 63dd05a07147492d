"""Every CAV's BEV map resampled in its sample's ego frame, for the fusions that combine maps cell by cell.

With ``fusion.args.proj_first: false`` (HEAL's and CoAlign's DAIR-V2X-C configs) each CAV voxelises its own
cloud in its own frame, so its map must be moved into the ego's before a cell of it can be fused with the
ego's cell. The dataset's ``pairwise_t_matrix[b, 0, j]`` takes the ego's frame to CAV j's; normalised over
``lidar_range`` it is the ``affine_grid`` matrix that samples CAV j's map at the ego's cells (bilinear, zeros
outside CAV j's map, as CoAlign's ``warp_affine_simple``). The normalisation holds at every backbone level,
since each level's map covers the whole range, so AttFuse warps each level's map with the same matrices.

With ``proj_first: true`` (OpenCOOD's setting) the clouds are already in the ego's frame and every matrix is
the identity. A map whose matrix is exactly the identity, and every ego's map, is passed through untouched
rather than resampled (an identity ``grid_sample`` is off by rounding, up to 2e-4 on a unit-variance map), so
the fusion is then OpenCOOD's, which does not warp, bit for bit.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from opencood_ddp.models.modules.cav_layout import device_constant, sample_and_slot, to_device
from opencood_ddp.models.modules.grid_sampling import grid_sample
from opencood_ddp.models.modules.precision import in_full_precision


class EgoWarp(NamedTuple):
    """What ``apply_ego_warp`` needs for one batch's CAV maps, at any backbone level. Worked out once per batch
    where the batch's ``record_len`` and ``pairwise_t_matrix`` are (the host in our batches: modules/cav_layout.py),
    with the rows that move and their matrices sent to the maps' device: each level's warp is then device work
    alone, and --capture's compiled step reads neither a host tensor nor ``nonzero``'s value-shaped answer (a graph
    break per level, and a host input that keeps inductor from CUDA graphs)."""

    theta: torch.Tensor  # (sum(record_len), 2, 3) float64 affine_grid matrices (ego_frame_affines), every row
    is_ego: torch.Tensor  # (sum(record_len),) bool (ego_rows), where theta is
    moving: torch.Tensor  # (M,) long, M >= 1, on the maps' device: the rows resampled (moving_rows)
    moving_theta: torch.Tensor  # (M, 2, 3) float64, on the maps' device: their matrices


def ego_rows(record_len: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(sum(record_len),) bool on ``device``: True at each sample's first CAV, its ego (derived where record_len
    is, then moved)."""
    return to_device(sample_and_slot(record_len)[1] == 0, torch.device(device))


def ego_frame_affines(pairwise_t_matrix: torch.Tensor, record_len: torch.Tensor,
                      lidar_range: Sequence[float]) -> torch.Tensor:
    """(B, L, L, 4, 4) pairwise transforms -> (sum(record_len), 2, 3) ``affine_grid`` matrices, float64, on the
    pairwise matrices' device.

    Row k maps the ego's normalised BEV coordinates (-1..1 over ``lidar_range``, x along the width, y along
    the height) to those of CAV k's map: ``pairwise[b, 0, j]`` takes the ego's frame (CAV 0) to CAV j's, and
    sampling CAV j's map there puts it in the ego's frame. The metric transform x' = A x + t becomes
    S^-1 A S and S^-1 (A c + t - c) with S the half extents and c the centre of the range, which holds at
    every backbone level (each covers the whole range). The egos' rows are the identity whatever the
    diagonal holds (the dataset writes the identity there; a batch from elsewhere may not).
    """
    device = pairwise_t_matrix.device
    sample, slot = (to_device(t, device) for t in sample_and_slot(record_len))
    matrix = pairwise_t_matrix.to(torch.float64)[sample, 0, slot]  # (N, 4, 4)
    rotation, translation = matrix[:, :2, :2], matrix[:, :2, 3]
    x_min, y_min, _, x_max, y_max, _ = (float(v) for v in lidar_range)
    half = device_constant([(x_max - x_min) / 2, (y_max - y_min) / 2], matrix)
    centre = device_constant([(x_max + x_min) / 2, (y_max + y_min) / 2], matrix)
    scaled = rotation * half.view(1, 1, 2) / half.view(1, 2, 1)
    shift = (rotation @ centre + translation - centre) / half
    theta = torch.cat([scaled, shift.unsqueeze(-1)], dim=-1)
    identity = torch.eye(2, 3, dtype=theta.dtype, device=device).expand_as(theta)
    return torch.where((slot == 0).view(-1, 1, 1), identity, theta)


def moving_rows(theta: torch.Tensor, is_ego: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the maps ``warp_to_ego`` resamples, every map but the egos' and those whose matrix is exactly
    the identity."""
    identity = torch.eye(2, 3, dtype=theta.dtype, device=theta.device)
    return ~is_ego & ~(theta == identity).flatten(1).all(dim=1)


def plan_ego_warp(theta: torch.Tensor, is_ego: torch.Tensor, device: torch.device) -> Optional[EgoWarp]:
    """The warp of maps on ``device`` by ``theta``: which maps move (every map but the egos' and those whose matrix
    is exactly the identity), decided where ``theta`` and ``is_ego`` are (the host: no wait for the device); only
    those rows and their matrices go to ``device``. None when no map moves."""
    others = torch.nonzero(moving_rows(theta, is_ego.to(theta.device))).squeeze(1)
    if others.numel() == 0:
        return None
    device = torch.device(device)
    return EgoWarp(theta, is_ego, to_device(others, device), to_device(theta.index_select(0, others), device))


def apply_ego_warp(x: torch.Tensor, warp: EgoWarp) -> torch.Tensor:
    """(N, C, H, W) CAV maps -> the same maps with the moving ones resampled in their sample's ego frame (bilinear,
    zeros outside); the others are passed through untouched."""
    warped = in_full_precision(_resample, x.index_select(0, warp.moving), warp.moving_theta)
    return x.index_copy(0, warp.moving, warped.to(x.dtype))


def warp_to_ego(x: torch.Tensor, theta: torch.Tensor, is_ego: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) CAV maps -> the same maps resampled in their sample's ego frame: `plan_ego_warp` and
    `apply_ego_warp` in one call (the models plan once per batch, in their layout)."""
    warp = plan_ego_warp(theta, is_ego, x.device)
    return x if warp is None else apply_ego_warp(x, warp)


def _resample(maps: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Bilinear resampling of `maps` on the grid of `theta`, in the maps' dtype (a full-precision island)."""
    grid = F.affine_grid(theta.to(maps.dtype), list(maps.shape), align_corners=False)
    return grid_sample(maps, grid, mode="bilinear", align_corners=False)


def all_identity(pairwise: torch.Tensor) -> bool:
    """Whether every (4, 4) matrix of ``pairwise`` is exactly the identity, as the dataset writes them with
    proj_first. Then every row of ``ego_frame_affines`` is exactly the identity (R = I and t = 0 give S^-1 I S = I
    and (c + 0 - c) / S = 0 without rounding, S > 0 the range's half extents), and no map moves: ``batch_ego_warp``
    returns None without that derivation, three ops (eye, expand, equal) where it dispatches some sixty per step
    (issue 52's op budget). Any other matrix takes the derivation."""
    if tuple(pairwise.shape[-2:]) != (4, 4):
        return False
    return torch.equal(pairwise, torch.eye(4, dtype=pairwise.dtype, device=pairwise.device).expand_as(pairwise))


def batch_ego_warp(data_dict: Mapping, lidar_range: Sequence[float],
                   device: Optional[torch.device] = None) -> Optional[EgoWarp]:
    """The batch's EgoWarp from its ``record_len`` and ``pairwise_t_matrix``, worked out where those are, for maps
    on ``device`` (default: there too); None when it has neither (no fusion) or when no CAV's map moves
    (proj_first: true), so that nothing is computed per level."""
    record_len, pairwise = data_dict.get("record_len"), data_dict.get("pairwise_t_matrix")
    if record_len is None or pairwise is None or all_identity(pairwise):
        return None
    theta = ego_frame_affines(pairwise, record_len, lidar_range)
    return plan_ego_warp(theta, ego_rows(record_len, theta.device), theta.device if device is None else device)


def to_ego_frame(x: torch.Tensor, warp: Optional[EgoWarp]) -> torch.Tensor:
    """The maps a fusion combines: ``x`` warped by ``warp``, or as it comes without one (proj_first: true)."""
    return x if warp is None else apply_ego_warp(x, warp)


__all__ = ["EgoWarp", "all_identity", "apply_ego_warp", "batch_ego_warp", "ego_frame_affines", "ego_rows",
           "moving_rows", "plan_ego_warp", "to_ego_frame", "warp_to_ego"]
