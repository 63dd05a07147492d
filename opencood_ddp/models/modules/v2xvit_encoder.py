"""V2X-ViT's fusion transformer (upstream ``fuse_modules/v2xvit_basic.py``), ``fusion_net`` of the model.

Per batch of packed CAV maps (N, H, W, C), channels last (see ``v2xvit_agents``):

1. RTE: each CAV's map gets a vector of its time delay added (a sinusoid table row, then a linear layer);
2. STTF: every non-ego map is warped into the ego frame; where it lands decides which cells it may be attended at
   (``use_roi_mask``; else every real CAV everywhere);
3. ``depth`` layers of [``num_blocks`` x (agent attention + residual, MSwin + residual), feed-forward +
   residual], each sub-layer after a LayerNorm (pre-norm);
4. the egos' maps, one per sample.

Parameter names and order are upstream's: ``encoder.prior_feed``, ``encoder.layers.{d}.0.layers.{b}.{0: agent
attention, 1: MSwin}``, ``encoder.layers.{d}.1`` (feed-forward), ``encoder.rte.emb.{emb, lin}``.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
from torch import nn

from opencood_ddp.errors import DataError
from opencood_ddp.models.modules.v2xvit_agents import Agents
from opencood_ddp.models.modules.v2xvit_hmsa import CavAttention, HeteroCavAttention
from opencood_ddp.models.modules.v2xvit_mswin import PyramidWindowAttention
from opencood_ddp.models.modules.v2xvit_sttf import SpatialAligner
from opencood_ddp.numerics.dropout import Dropout

DELAY_TABLE_SIZE = 100  # upstream's max_len: rows of the sinusoid table (delay x RTE_ratio must stay below)
PRIOR_CHANNELS = 3  # speed, delay, infrastructure flag


def shorter_delay(ratio: int, rows: int = DELAY_TABLE_SIZE) -> str:
    """The fix for a delay past the table: the first delay, in 100 ms frames, whose row is past it."""
    return (f"shorten the delay (wild_setting.async_overhead, or noise_sweep's --delays_ms) to under "
            f"{-(-rows // ratio) * 100} ms")


class PreNorm(nn.Module):
    """LayerNorm, then ``fn`` (extra arguments passed through)."""

    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        return self.fn(self.norm(x), *args)


class FeedForward(nn.Module):
    """Linear, GELU, dropout, linear, dropout (``net.0`` and ``net.3`` hold the weights)."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), Dropout(dropout), nn.Linear(hidden, dim),
                                 Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DelayEmbedding(nn.Module):
    """Delay index -> (C,) vector: a sinusoid table row (``emb``), then ``lin`` (upstream ``RelTemporalEncoding``).

    Upstream means the table to stay fixed but sets ``requires_grad`` on the Embedding module, not on its weight,
    which freezes nothing: the table trains. Kept so, as upstream trains it; its checkpoints hold trained rows.
    """

    def __init__(self, dim: int, ratio: int, rows: int = DELAY_TABLE_SIZE):
        super().__init__()
        self.ratio = int(ratio)
        self.emb = nn.Embedding(rows, dim)
        position = torch.arange(rows, dtype=torch.float32).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim))
        with torch.no_grad():
            self.emb.weight[:, 0::2] = torch.sin(position * frequency) / math.sqrt(dim)
            self.emb.weight[:, 1::2] = torch.cos(position * frequency) / math.sqrt(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, delay: torch.Tensor, delays: Sequence[int]) -> torch.Tensor:
        """(N,) delays in frames, and the same as Python ints (Agents.delays: checked without reading the device)
        -> (N, C). RTE_ratio converts frames to table rows (2: 100 ms frames, 50 ms rows)."""
        rows = self.emb.num_embeddings
        if any(not 0 <= d * self.ratio < rows for d in delays):  # a DataError: one line, on every rank
            raise DataError(f"time delay x RTE_ratio must be in 0..{rows - 1} (V2X-ViT's delay table), got delays "
                            f"{list(delays)} (frames) with RTE_ratio {self.ratio}; {shorter_delay(self.ratio, rows)}")
        return self.lin(self.emb(delay * self.ratio))


class RelativeTemporalEncoding(nn.Module):
    """RTE: each CAV's map plus its delay's vector, at every cell (upstream ``RTE``)."""

    def __init__(self, dim: int, ratio: int):
        super().__init__()
        self.emb = DelayEmbedding(dim, ratio)

    def forward(self, x: torch.Tensor, agents: Agents) -> torch.Tensor:
        return x + self.emb(agents.delay, agents.delays)[:, None, None, :].to(x.dtype)


class V2XFusionBlock(nn.Module):
    """``num_blocks`` x [agent attention, MSwin], each pre-normed with a residual."""

    def __init__(self, num_blocks: int, cav: Mapping, window: Mapping):
        super().__init__()
        self.layers = nn.ModuleList()
        dim = int(cav["dim"])
        for _ in range(num_blocks):
            kind = HeteroCavAttention if cav["use_hetero"] else CavAttention
            agent_attention = kind(dim, int(cav["heads"]), int(cav["dim_head"]), float(cav["dropout"]))
            mswin = PyramidWindowAttention(int(window["dim"]), window["heads"], window["dim_head"],
                                           float(window["dropout"]), window["window_size"],
                                           bool(window["relative_pos_embedding"]), window["fusion_method"])
            self.layers.append(nn.ModuleList([PreNorm(dim, agent_attention), PreNorm(dim, mswin)]))

    def forward(self, x: torch.Tensor, agents: Agents, visible: torch.Tensor) -> torch.Tensor:
        for agent_attention, mswin in self.layers:
            x = agent_attention(x, agents, visible) + x
            x = mswin(x) + x
        return x


class V2XEncoder(nn.Module):
    """RTE, STTF, then the fusion layers (upstream ``V2XTEncoder``); returns every CAV's map."""

    def __init__(self, args: Mapping):
        super().__init__()
        cav, feed = args["cav_att_config"], args["feed_forward"]
        dim = int(cav["dim"])
        self.use_roi_mask = bool(args["use_roi_mask"])
        self.sttf = SpatialAligner(args["sttf"]["voxel_size"][0], args["sttf"]["downsample_rate"])
        # Upstream builds this projection of [features, prior] but never calls it: the prior is split off the
        # features again. It stays for checkpoint compatibility, frozen, so that no optimizer or DDP step waits
        # for a gradient it never gets.
        self.prior_feed = nn.Linear(dim + PRIOR_CHANNELS, dim)
        self.prior_feed.requires_grad_(False)
        self.layers = nn.ModuleList()
        # Upstream reads use_RTE and RTE_ratio from cav_att_config (the model's check makes the encoder's agree).
        self.rte = RelativeTemporalEncoding(dim, int(cav["RTE_ratio"])) if cav["use_RTE"] else None
        for _ in range(int(args["depth"])):
            self.layers.append(nn.ModuleList([
                V2XFusionBlock(int(args["num_blocks"]), cav, args["pwindow_att_config"]),
                PreNorm(dim, FeedForward(dim, int(feed["mlp_dim"]), float(feed["dropout"])))]))

    def forward(self, x: torch.Tensor, agents: Agents) -> torch.Tensor:
        if self.rte is not None:
            x = self.rte(x, agents)
        x, visible = self.sttf(x, agents.to_ego, agents.other_rows)
        if not self.use_roi_mask:
            visible = torch.ones_like(visible)
        for fusion, feed_forward in self.layers:
            x = fusion(x, agents, visible)
            x = feed_forward(x) + x
        return x


class V2XTransformer(nn.Module):
    """(N, C, H, W) CAV maps -> (B, C, H, W) fused ego maps (upstream ``V2XTransformer``)."""

    def __init__(self, args: Mapping):
        super().__init__()
        self.encoder = V2XEncoder(args["encoder"])
        self.dim = int(args["encoder"]["cav_att_config"]["dim"])

    def forward(self, features: torch.Tensor, agents: Agents) -> torch.Tensor:
        x = self.encoder(features.permute(0, 2, 3, 1), agents)
        return x[agents.ego_rows].permute(0, 3, 1, 2).contiguous()
