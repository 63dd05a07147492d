"""``grid_sample`` that still trains under ``--deterministic`` on a GPU.

``--deterministic`` turns on ``torch.use_deterministic_algorithms(True)``, and torch has no deterministic CUDA kernel
for ``F.grid_sample``'s backward: ``grid_sampler_2d_backward_cuda`` raises a RuntimeError at the first backward of
any model that warps feature maps (the ego warp, V2VNet's pairwise warp, V2X-ViT's STTF).

``grid_sample`` here calls ``F.grid_sample`` except in exactly that case (the flag on, the maps on a CUDA device and
autograd recording a graph through the maps or the grid), where it calls ``gathered_grid_sample``: the same
sampling written with floor, round, elementwise products and ``gather``, whose backward torch does have
deterministically on CUDA. The CPU path, and CUDA without the flag or without a gradient, are ``F.grid_sample``
itself, so existing runs keep their bits.

Only what the call sites use is covered: 4-D maps (N, C, H, W), a grid (N, Ho, Wo, 2) of (x, y) in [-1, 1],
``padding_mode="zeros"``, modes "bilinear" and "nearest", either ``align_corners``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MODES = ("bilinear", "nearest")


def grid_sample(maps: torch.Tensor, grid: torch.Tensor, mode: str, align_corners: bool) -> torch.Tensor:
    """``F.grid_sample(maps, grid, mode, padding_mode="zeros", align_corners)``, or ``gathered_grid_sample``
    where the former's backward would raise (``needs_gathered_sampling``)."""
    if needs_gathered_sampling(maps, grid):
        return gathered_grid_sample(maps, grid, mode, align_corners)
    return F.grid_sample(maps, grid, mode=mode, padding_mode="zeros", align_corners=align_corners)


def needs_gathered_sampling(maps: torch.Tensor, grid: torch.Tensor) -> bool:
    """Whether torch would refuse ``F.grid_sample``'s backward: deterministic algorithms on, the maps on CUDA, and
    a backward to come through the maps or the grid."""
    return (torch.are_deterministic_algorithms_enabled() and maps.is_cuda and torch.is_grad_enabled()
            and (maps.requires_grad or grid.requires_grad))


def gathered_grid_sample(maps: torch.Tensor, grid: torch.Tensor, mode: str, align_corners: bool) -> torch.Tensor:
    """``F.grid_sample`` with zeros padding, built from differentiable gathers and elementwise arithmetic.

    This exists for its backward. Autograd differentiates ``gather`` with ``scatter_add_``, and both have a
    deterministic CUDA path under ``torch.use_deterministic_algorithms(True)`` (listed in its docstring), where
    ``F.grid_sample``'s own backward has none and raises. Every other op here is elementwise or a sum over the
    channels. The grid's gradient comes from the interpolation weights, as torch's does. Nearest sampling
    reaches the grid only through ``round`` and integer indices, so autograd finds no path to it (``grid.grad``
    stays None) where torch's backward writes zeros.

    The arithmetic follows torch's CPU kernel (unnormalisation, weights, the order of the four corner sums), so
    the forward agrees with ``F.grid_sample`` to float rounding.
    """
    if mode not in MODES:
        raise ValueError(f"gathered_grid_sample: mode {mode!r} is not one of {MODES}")
    n, c, h, w = maps.shape
    flat = maps.reshape(n, c, h * w)
    x = _unnormalise(grid[..., 0], w, align_corners).reshape(n, 1, -1)
    y = _unnormalise(grid[..., 1], h, align_corners).reshape(n, 1, -1)
    if mode == "nearest":
        # torch.round rounds half to even, as the CPU kernel's round and the CUDA kernel's nearbyint do.
        sampled = _corner(flat, torch.round(x), torch.round(y), h, w)
    else:
        sampled = _bilinear(flat, x, y, h, w)
    return sampled.view(n, c, grid.shape[1], grid.shape[2])


def _unnormalise(coord: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """[-1, 1] -> pixel coordinates, in the form of torch's CPU kernel (the scale is exact in any float type).

    align_corners=True puts -1 and 1 on the centres of the first and last pixels, False on their outer edges.
    """
    if align_corners:
        return (coord + 1) * ((size - 1) / 2)
    return (coord + 1) * (size / 2) - 0.5


def _bilinear(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(N, C, H*W) maps at (N, 1, P) pixel coordinates -> (N, C, P), the four neighbours' weighted sum."""
    x_west, y_north = torch.floor(x), torch.floor(y)
    to_west, to_north = x - x_west, y - y_north
    to_east, to_south = 1 - to_west, 1 - to_north
    x_east, y_south = x_west + 1, y_north + 1
    return (_corner(flat, x_west, y_north, h, w) * (to_south * to_east)
            + _corner(flat, x_east, y_north, h, w) * (to_south * to_west)
            + _corner(flat, x_west, y_south, h, w) * (to_north * to_east)
            + _corner(flat, x_east, y_south, h, w) * (to_north * to_west))


def _corner(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(N, C, H*W) maps at integral (N, 1, P) pixel coordinates -> (N, C, P); zero where a pixel is off the map.

    One index per output point, expanded over the channels (a view), so the gather allocates only its result.
    Off-map coordinates (and NaN) are replaced before the conversion to integers, which would otherwise be
    undefined for them.
    """
    inside = (x >= 0) & (x <= w - 1) & (y >= 0) & (y <= h - 1)
    column = torch.where(inside, x, 0).long()
    row = torch.where(inside, y, 0).long()
    index = (row * w + column).expand(-1, flat.shape[1], -1)
    return torch.where(inside, flat.gather(2, index), 0)


__all__ = ["gathered_grid_sample", "grid_sample", "needs_gathered_sampling"]
