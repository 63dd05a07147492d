"""Where2comm's spatial-confidence communication and its fusion of the CAVs' masked, warped features.

Upstream ``fuse_modules/where2comm_fuse.py`` (OpenCOOD) and ``fuse_modules/where2comm_attn.py`` with
``comm_modules/where2comm.py`` (the Where2comm repository). Per CAV, the detection head's class logits give a
confidence map (sigmoid, max over anchors, optionally Gaussian-smoothed); the cells above a threshold are the
ones the CAV sends. The ego keeps its whole map. Each sample's CAVs are then warped into the ego's frame and
fused (attention of the ego's feature over the CAVs, or an element-wise max) into one map per sample.

Only ``naive_communication.gaussian_filter`` carries state (upstream's names); it is a fixed kernel, never
trained. Every step below works on one sample's CAVs, found through ``record_len``, so the fused map of a
sample depends on its own CAVs only, whatever else the batch holds.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood_ddp.models.modules.cav_layout import sample_and_slot, to_device
from opencood_ddp.models.modules.ego_warp import EgoWarp, to_ego_frame
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion

AGGREGATORS = {"ATTEN": AttFusion, "MAX": MaxFusion}


def gaussian_kernel(size: int, sigma: float) -> torch.Tensor:
    """(size, size) weights exp(-r^2 / 2 sigma^2) / (2 pi sigma), centred.

    Upstream's normalisation is 1 / (2 pi sigma), not 1 / (2 pi sigma^2): the weights sum to about sigma
    (0.98 for the 5 x 5 kernel of sigma 1), so for sigma > 1 a smoothed confidence can exceed 1.
    """
    offsets = torch.arange(size, dtype=torch.float64) - size // 2
    squared = offsets.view(-1, 1) ** 2 + offsets.view(1, -1) ** 2
    return (torch.exp(-squared / (2 * sigma ** 2)) / (2 * math.pi * sigma)).float()


class Communication(nn.Module):
    """Class logits of every CAV -> a binary mask of the cells it sends; the egos' masks are all ones.

    A cell is sent when its confidence is strictly above ``threshold``. A threshold <= 0 sends every cell
    (a confidence is never negative; upstream's OpenCOOD code takes the same branch for a threshold of 0).
    Training and evaluation use the same rule: see ``point_pillar_where2comm.py`` for why OpenCOOD's random
    top-K training proxy is not built.
    """

    def __init__(self, threshold: float, smoothing: Optional[Tuple[int, float]] = None):
        super().__init__()
        self.threshold = float(threshold)
        self.gaussian_filter: Optional[nn.Conv2d] = None
        if smoothing is not None:
            size, sigma = smoothing
            self.gaussian_filter = nn.Conv2d(1, 1, size, stride=1, padding=(size - 1) // 2)
            with torch.no_grad():
                self.gaussian_filter.weight.copy_(gaussian_kernel(size, sigma).view(1, 1, size, size))
                self.gaussian_filter.bias.zero_()
            # Upstream writes `gaussian_filter.requires_grad = False`, an attribute of the module that leaves its
            # parameters trainable; they never get a gradient (the mask is a threshold), which DDP would report
            # as unused parameters. Freezing the parameters themselves is what upstream meant.
            self.gaussian_filter.requires_grad_(False)

    def confidence(self, psm: torch.Tensor) -> torch.Tensor:
        """(N, A, H, W) class logits -> (N, 1, H, W): the best anchor's probability per cell, smoothed."""
        best = psm.sigmoid().amax(dim=1, keepdim=True)
        return self.gaussian_filter(best) if self.gaussian_filter is not None else best

    def selected(self, psm: torch.Tensor) -> torch.Tensor:
        """(N, A, H, W) logits -> (N, 1, H, W) 0.0 / 1.0: the cells above the threshold, for every CAV (the
        egos' too: OpenCOOD's ``com`` counts them), no gradient."""
        psm = psm.detach()
        if self.threshold <= 0:
            return psm.new_ones(psm.shape[0], 1, *psm.shape[2:])
        return (self.confidence(psm) > self.threshold).to(psm.dtype)

    def forward(self, psm: torch.Tensor, is_ego: torch.Tensor) -> torch.Tensor:
        """(N, A, H, W) logits, (N,) ego flags -> (N, 1, H, W) mask of 0.0 / 1.0, no gradient."""
        return keep_egos_whole(self.selected(psm), is_ego)


def keep_egos_whole(mask: torch.Tensor, is_ego: torch.Tensor) -> torch.Tensor:
    """The mask with every ego's map all ones: the ego's own map is never sent, so it is never pruned."""
    return torch.where(is_ego.view(-1, 1, 1, 1), torch.ones_like(mask), mask)


def communication_rate(mask: Optional[torch.Tensor], is_ego: torch.Tensor) -> torch.Tensor:
    """0-d float32, detached: the share of the non-ego CAVs' cells sent (mask > 0), over the whole batch.

    ``mask`` None means everything is sent. A batch without a non-ego CAV sends nothing: rate 0. Counted without
    reading anything back to the host: the sum of 0/1 cells is exact in float32 below 2^24 cells, so the rate is
    the mean's to the bit.
    """
    others = ~is_ego
    senders = others.sum()
    if mask is None:
        return (senders > 0).float()
    sent = ((mask.detach() > 0) & others.view(-1, 1, 1, 1)).sum().float()
    cells = senders * mask[0].numel()
    return torch.where(senders > 0, sent / cells.clamp(min=1).float(), sent.new_zeros(()))


def opencood_com(selected: torch.Tensor, rows: "CavRows") -> torch.Tensor:
    """0-d float32, detached: OpenCOOD's ``com`` (``where2comm_fuse.py``'s ``communication_rates``).

    Per sample: the cells above the threshold over all its L CAVs, the ego's own map included (counted before
    the ego is kept whole), divided by L x H x W, on the heads' grid; then the mean over the batch's samples.
    Everything sent (``fully``, no communication block) is 1, as upstream's ``fully`` (``Where2commFusion``).
    """
    per_cav = (selected.detach() > 0).flatten(1).float().mean(dim=1)  # every CAV's map has H x W cells
    per_sample = torch.zeros(rows.cavs.shape[0], device=selected.device).index_add_(0, rows.sample, per_cav)
    return (per_sample / rows.cavs).mean()


class CavRows(NamedTuple):
    """The batch's CAV rows as the communication reads them, on the maps' device: made once per batch from
    ``record_len`` where it is (the host), so that the dense part of the step (engine/capture.py) is given them
    rather than deriving them from ``record_len`` itself."""

    is_ego: torch.Tensor  # (sum(record_len),) bool: the row is its sample's first CAV
    sample: torch.Tensor  # (sum(record_len),) long: the row's sample
    cavs: torch.Tensor  # (B,) record_len itself


def cav_rows(record_len: torch.Tensor, device: torch.device) -> CavRows:
    sample, slot = sample_and_slot(record_len)
    return CavRows(to_device(slot == 0, torch.device(device)), to_device(sample, device), to_device(record_len, device))


class Rates(NamedTuple):
    """The two communication rates of a batch, both 0-d and detached."""

    comm_rate: torch.Tensor  # ours: the share of the non-ego CAVs' cells sent (communication_rate)
    com: torch.Tensor  # OpenCOOD's: thresholded cells of every CAV, the ego's included (opencood_com)


class Where2commFusion(nn.Module):
    """Communication masks and per-level fusion; the model runs the backbone around it (multi-scale).

    ``level_channels``: the channels of each fused map (one per backbone level, or one entry: the shrunk
    map). ``communication`` None sends every cell (OpenCOOD's ``fully``, or no ``communication`` block).
    """

    def __init__(self, level_channels: Sequence[int], aggregator: str, lidar_range: Sequence[float],
                 communication: Optional[Communication], fully: bool = False):
        super().__init__()
        make = AGGREGATORS[aggregator]
        self.fuse_modules = nn.ModuleList(make(int(c)) if make is AttFusion else make() for c in level_channels)
        if communication is not None:
            self.naive_communication = communication  # upstream's name; its gaussian_filter is in the state dict
        self.communicates = communication is not None and not fully
        self.lidar_range = [float(v) for v in lidar_range]

    def communicate(self, psm_single: torch.Tensor, rows: CavRows,
                    size: Optional[Tuple[int, int]] = None) -> Tuple[Optional[torch.Tensor], Rates]:
        """(mask (N, 1, *size) or None when everything is sent, the two communication rates).

        A mask made on the heads' grid is resized to the masked level's grid bilinearly, as upstream does; a
        cell there counts as sent when its mask is non-zero. OpenCOOD's ``com`` is counted on the heads' grid.
        """
        if not self.communicates:
            return None, Rates(communication_rate(None, rows.is_ego), torch.ones((), device=rows.is_ego.device))
        selected = self.naive_communication.selected(psm_single)
        mask = keep_egos_whole(selected, rows.is_ego)
        com = opencood_com(selected, rows)
        if size is not None and tuple(mask.shape[-2:]) != tuple(size):
            mask = F.interpolate(mask, size=tuple(size), mode="bilinear", align_corners=False)
        return mask, Rates(communication_rate(mask, rows.is_ego), com)

    def fuse(self, level: int, x: torch.Tensor, record_len: torch.Tensor, warp: Optional[EgoWarp]) -> torch.Tensor:
        """(sum(record_len), C, H, W) masked CAV maps -> (B, C, H, W): warped to the ego, fused per sample."""
        return self.fuse_modules[level](to_ego_frame(x, warp), record_len)
