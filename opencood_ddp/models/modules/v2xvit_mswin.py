"""V2X-ViT's multi-scale window attention, MSwin (upstream ``mswin.py`` and ``split_attn.py``).

Each branch (``pwmsa.{i}``) splits every CAV's map into non-overlapping windows of its own size and runs
multi-head self-attention inside each window, with a learnt bias per relative offset of two cells
(``pos_embedding`` (2s - 1, 2s - 1), or per cell pair (s^2, s^2) without ``relative_pos_embedding``). The
branches are fused by split attention (``split_attn``: a softmax over the branches of per-channel weights
computed from the map's global average) or by their mean (``naive``). Everything is per CAV map.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.numerics.dropout import Dropout


def relative_offsets(window: int) -> torch.Tensor:
    """(s^2, s^2, 2) offset (row, column) of cell j from cell i of a window, shifted to start at 0."""
    cells = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij"), dim=-1)
    cells = cells.reshape(-1, 2)
    return cells[None, :, :] - cells[:, None, :] + window - 1


def to_windows(x: torch.Tensor, window: int, heads: int) -> torch.Tensor:
    """(N, H, W, heads * d) -> (N, heads, windows, s^2, d), windows in row-major order."""
    n, height, width, channels = x.shape
    x = x.view(n, height // window, window, width // window, window, heads, channels // heads)
    return x.permute(0, 5, 1, 3, 2, 4, 6).reshape(n, heads, -1, window * window, channels // heads)


def from_windows(x: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """Inverse of ``to_windows``: (N, heads, windows, s^2, d) -> (N, H, W, heads * d)."""
    n, heads, _, _, dim_head = x.shape
    x = x.view(n, heads, height // window, width // window, window, window, dim_head)
    return x.permute(0, 2, 4, 3, 5, 1, 6).reshape(n, height, width, heads * dim_head)


class WindowAttention(nn.Module):
    """One MSwin branch (upstream ``BaseWindowAttention``): self-attention inside s x s windows."""

    constant_buffers = ("offsets",)  # made here, never trained: DDP need not broadcast it

    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float, window: int, relative: bool):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.window, self.relative = heads, window, relative
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        if relative:
            self.register_buffer("offsets", relative_offsets(window), persistent=False)  # not in upstream's keys
            self.pos_embedding = nn.Parameter(torch.randn(2 * window - 1, 2 * window - 1))
        else:
            self.pos_embedding = nn.Parameter(torch.randn(window ** 2, window ** 2))
        self.to_out = nn.Sequential(nn.Linear(inner, dim), Dropout(dropout))

    def position_bias(self) -> torch.Tensor:
        """(s^2, s^2) bias added to the logits of every window and head."""
        if self.relative:
            return self.pos_embedding[self.offsets[..., 0], self.offsets[..., 1]]
        return self.pos_embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, H, W, C) -> (N, H, W, C); H and W are multiples of the window (checked with the hypes)."""
        _, height, width, _ = x.shape
        q, k, v = (to_windows(t, self.window, self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        logits = in_full_precision(lambda q, k: q @ k.transpose(-1, -2) * self.scale, q, k) + self.position_bias()
        out = from_windows(logits.softmax(dim=-1) @ v, self.window, height, width)
        return self.to_out(out)


class SplitAttention(nn.Module):
    """Fusion of three branch outputs by per-channel softmax weights over the branches (ResNeSt's split attention).

    The weights come from the global average of the branches' sum, per CAV map: fc1, LayerNorm (``bn1``, as
    upstream names it), ReLU, fc2 to 3 x C logits, softmax over the 3 branches per channel.
    """

    branches = 3

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.fc1 = nn.Linear(dim, dim, bias=False)
        self.bn1 = nn.LayerNorm(dim)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(dim, dim * self.branches, bias=False)

    def forward(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """``branches`` tensors (N, H, W, C) -> (N, H, W, C)."""
        pooled = sum(outputs).mean(dim=(1, 2), keepdim=True)  # (N, 1, 1, C)
        logits = self.fc2(self.act1(self.bn1(self.fc1(pooled))))
        weights = logits.view(logits.shape[:-1] + (self.branches, self.dim)).softmax(dim=-2)
        return sum(out * weights[..., i, :] for i, out in enumerate(outputs))


class PyramidWindowAttention(nn.Module):
    """MSwin: the branches of ``window_size`` (with their ``heads`` and ``dim_head``), fused."""

    def __init__(self, dim: int, heads: Sequence[int], dim_heads: Sequence[int], dropout: float,
                 windows: Sequence[int], relative: bool, fusion_method: str):
        super().__init__()
        self.pwmsa = nn.ModuleList(WindowAttention(dim, int(h), int(d), dropout, int(s), relative)
                                   for h, d, s in zip(heads, dim_heads, windows))
        self.fusion_method = fusion_method
        if fusion_method == "split_attn":
            self.split_attn = SplitAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs: List[torch.Tensor] = [branch(x) for branch in self.pwmsa]
        if self.fusion_method == "split_attn":
            return self.split_attn(outputs)
        return sum(outputs) / len(outputs)
