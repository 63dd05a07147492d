"""Pillar features -> a dense bird's-eye-view image (upstream ``sub_modules/point_pillar_scatter.py``).

One index_put over the whole batch instead of upstream's loop over samples; the result is the same, since
every (sample, z, y, x) cell holds at most one pillar. The number of BEV images is passed in (the number of
samples, or of CAVs in intermediate fusion) rather than read from the largest batch index: a trailing sample
whose cloud is empty has no pillar, and would otherwise be missing from the batch.

The layout of the image depends on the kernels that will take it (issue 52). The CPU's (``cpu_kernels_enabled``)
get it channels-last, a view of the (N, H*W, C) canvas written one pillar's C values at a time: the
accurate batch norm's row kernels (numerics/batch_norm.py) take only maps whose channels are innermost, and the
scatter writes contiguous rows. CUDA's (and the CPU inside ``cuda_kernels_on_cpu``) get it contiguous NCHW, as
upstream's: cuDNN gives a convolution over a channels-last input its weight gradient in channels-last strides too,
and AccumulateGrad then copies every such gradient into its contiguous weight's layout (an allocation and a copy
per convolution of the backbone, 19 to 24 per step).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from opencood_ddp.models.modules.cav_layout import maps_of_coords
from opencood_ddp.numerics.kernel_path import takes_cpu_kernels


class PointPillarScatter(nn.Module):
    def __init__(self, cfg: Mapping):
        super().__init__()
        self.num_bev_features = int(cfg["num_features"])
        self.nx, self.ny, self.nz = (int(v) for v in cfg["grid_size"])
        if self.nz != 1:
            raise ValueError(f"point_pillar_scatter.grid_size z must be 1 (one pillar per column), got {self.nz}")

    def forward(self, batch_dict: dict, num_images: Optional[int] = None) -> dict:
        pillars, coords = batch_dict["pillar_features"], batch_dict["voxel_coords"].long()
        if num_images is None:
            num_images = maps_of_coords(coords)
        cell = coords[:, 1] * self.ny * self.nx + coords[:, 2] * self.nx + coords[:, 3]
        if takes_cpu_kernels(pillars):
            image = self._channels_last(pillars, coords[:, 0], cell, num_images)
        else:
            image = self._channels_first(pillars, coords[:, 0], cell, num_images)
        batch_dict["spatial_features"] = image
        return batch_dict

    def _channels_last(self, pillars: torch.Tensor, image: torch.Tensor, cell: torch.Tensor,
                       num_images: int) -> torch.Tensor:
        """(N, C, H, W) in channels-last strides: each pillar's C values written as one contiguous row."""
        canvas = pillars.new_zeros(num_images, self.ny * self.nx, self.num_bev_features)
        # In place on the fresh zeros: the out-of-place index_put copied the whole canvas first (67 ms of a
        # full-size AttFuse step). The canvas needs no gradient, so autograd routes the cells' gradients to the
        # pillars alone, as before.
        canvas.index_put_((image, cell), pillars)
        return canvas.permute(0, 2, 1).reshape(num_images, self.num_bev_features, self.ny, self.nx)

    def _channels_first(self, pillars: torch.Tensor, image: torch.Tensor, cell: torch.Tensor,
                        num_images: int) -> torch.Tensor:
        """(N, C, H, W) contiguous: each pillar's C values written H*W apart, in one index_put_ (the channel axis
        between the two index tensors takes the (pillars, C) values as they are)."""
        canvas = pillars.new_zeros(num_images, self.num_bev_features, self.ny * self.nx)
        canvas[image, :, cell] = pillars
        return canvas.view(num_images, self.num_bev_features, self.ny, self.nx)
