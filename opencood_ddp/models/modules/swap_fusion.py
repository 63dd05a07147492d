"""CoBEVT's SwapFusion encoder (fused axial attention), upstream ``fuse_modules/swap_fusion_modules.py``.

Input: (B, L, C, H, W), one slot per agent (L = agent_size = max_cav, absent agents zero-padded) and a
(B, L) mask of the present agents. Each layer attends first inside local windows (w x w neighbouring cells
of all L agents), then inside a dilated grid (w x w cells spread H/w and W/w apart, all L agents); each
attention and each feed-forward block is pre-norm residual. Absent agents are masked out as keys. The head
averages the L slots (absent ones included, as upstream) and applies LayerNorm + Linear per cell.

Parameter names and registration order are upstream's, so its checkpoints load strictly.
"""
from __future__ import annotations

import torch
from torch import nn

from opencood_ddp.models.modules.precision import in_full_precision


def relative_position_index(agents: int, window: int) -> torch.Tensor:
    """(n, n) index into the bias table of every token pair, n = agents * window * window.

    Tokens are ordered (agent, row, column); a pair's index enumerates its offsets (da, dr, dc), each
    shifted to start at 0, in row-major order over (2A-1, 2w-1, 2w-1).
    """
    grids = torch.meshgrid(torch.arange(agents), torch.arange(window), torch.arange(window), indexing="ij")
    coords = torch.stack([g.flatten() for g in grids])  # (3, n)
    offsets = coords[:, :, None] - coords[:, None, :]  # (3, n, n)
    sizes = (agents, window, window)
    shifted = [offsets[i] + sizes[i] - 1 for i in range(3)]
    spans = [2 * size - 1 for size in sizes]
    return shifted[0] * spans[1] * spans[2] + shifted[1] * spans[2] + shifted[2]


class WindowAttention(nn.Module):
    """Multi-head attention over the agents x w x w tokens of each window, with a learned relative bias.

    Input (B, L, X, Y, w, w, C): X x Y windows per map; output the same shape.
    """

    def __init__(self, dim: int, dim_head: int, dropout: float, agents: int, window: int):
        super().__init__()
        self.heads = dim // dim_head
        self.scale = dim_head ** -0.5
        # Upstream keeps the index in the state dict (a persistent buffer); so do we, for strict loading.
        self.register_buffer("relative_position_index", relative_position_index(agents, window))
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Dropout(dropout))
        self.relative_position_bias_table = nn.Embedding(
            (2 * agents - 1) * (2 * window - 1) * (2 * window - 1), self.heads)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """x: (B, L, X, Y, w, w, C); present: (B, L) bool, False for a padded slot."""
        b, agents, nx, ny, w1, w2, dim = x.shape
        tokens = x.permute(0, 2, 3, 1, 4, 5, 6).reshape(b * nx * ny, agents * w1 * w2, dim)
        q, k, v = self.to_qkv(tokens).chunk(3, dim=-1)
        q, k, v = (t.reshape(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2) for t in (q, k, v))
        sim = in_full_precision(lambda q, k: (q * self.scale) @ k.transpose(-2, -1), q, k)  # (B X Y, heads, n, n)
        bias = self.relative_position_bias_table(self.relative_position_index)  # (n, n, heads)
        sim = sim + bias.permute(2, 0, 1)
        # A key of an absent agent gets no weight; every window holds the ego, so no row is all masked.
        keys = present.repeat_interleave(w1 * w2, dim=1)  # (B, n)
        keys = keys[:, None, :].expand(b, nx * ny, -1).reshape(b * nx * ny, 1, 1, -1)
        sim = sim.masked_fill(~keys, torch.finfo(sim.dtype).min)
        out = sim.softmax(dim=-1) @ v  # (B X Y, heads, n, d)
        out = out.transpose(1, 2).reshape(b * nx * ny, agents * w1 * w2, dim)
        out = self.to_out(out)
        return out.reshape(b, nx, ny, agents, w1, w2, dim).permute(0, 3, 1, 2, 4, 5, 6)


class FeedForward(nn.Module):
    """Linear -> GELU -> Dropout -> Linear -> Dropout (upstream's ``net`` indices 0 and 3 hold weights)."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PreNormResidual(nn.Module):
    """x + fn(LayerNorm(x)); extra arguments go to fn."""

    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return self.fn(self.norm(x), *args) + x


def to_windows(x: torch.Tensor, window: int, dilated: bool) -> torch.Tensor:
    """(B, L, C, H, W) -> (B, L, X, Y, w, w, C).

    Local windows (``dilated`` False) hold w x w neighbouring cells; grid windows (True) hold w x w cells
    H/w and W/w apart, so one grid window spans the whole map.
    """
    b, agents, dim, height, width = x.shape
    if dilated:
        x = x.reshape(b, agents, dim, window, height // window, window, width // window)
        return x.permute(0, 1, 4, 6, 3, 5, 2)
    x = x.reshape(b, agents, dim, height // window, window, width // window, window)
    return x.permute(0, 1, 3, 5, 4, 6, 2)


def from_windows(x: torch.Tensor, dilated: bool) -> torch.Tensor:
    """The inverse of ``to_windows``."""
    b, agents, nx, ny, w1, w2, dim = x.shape
    if dilated:
        return x.permute(0, 1, 6, 4, 2, 5, 3).reshape(b, agents, dim, w1 * nx, w2 * ny)
    return x.permute(0, 1, 6, 2, 4, 3, 5).reshape(b, agents, dim, nx * w1, ny * w2)


class SwapFusionBlockMask(nn.Module):
    """Window attention + feed-forward, then grid attention + feed-forward, absent agents masked."""

    def __init__(self, input_dim: int, mlp_dim: int, dim_head: int, window_size: int, agent_size: int,
                 drop_out: float):
        super().__init__()
        self.window_size = window_size
        attention = lambda: WindowAttention(input_dim, dim_head, drop_out, agent_size, window_size)  # noqa: E731
        self.window_attention = PreNormResidual(input_dim, attention())
        self.window_ffd = PreNormResidual(input_dim, FeedForward(input_dim, mlp_dim, drop_out))
        self.grid_attention = PreNormResidual(input_dim, attention())
        self.grid_ffd = PreNormResidual(input_dim, FeedForward(input_dim, mlp_dim, drop_out))

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        for dilated, attention, ffd in ((False, self.window_attention, self.window_ffd),
                                        (True, self.grid_attention, self.grid_ffd)):
            windows = to_windows(x, self.window_size, dilated)
            x = from_windows(ffd(attention(windows, present)), dilated)
        return x


class SlotMeanHead(nn.Module):
    """(B, L, C, H, W) -> (B, C, H, W): mean over the L slots, then LayerNorm and Linear per cell.

    Upstream's ``mlp_head`` is an ``nn.Sequential`` whose weights sit at indices 2 and 3 (0 and 1 are its
    parameter-free reshapes), so the two modules are registered under the names "2" and "3".
    """

    def __init__(self, dim: int):
        super().__init__()
        self.add_module("2", nn.LayerNorm(dim))
        self.add_module("3", nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cells = x.mean(dim=1).permute(0, 2, 3, 1)  # (B, H, W, C)
        norm, linear = self._modules["2"], self._modules["3"]
        return linear(norm(cells)).permute(0, 3, 1, 2)


class SwapFusionEncoder(nn.Module):
    """``depth`` masked swap-fusion blocks, then the slot-mean head."""

    def __init__(self, input_dim: int, mlp_dim: int, agent_size: int, window_size: int, dim_head: int,
                 drop_out: float, depth: int):
        super().__init__()
        self.window_size = window_size
        self.layers = nn.ModuleList(
            SwapFusionBlockMask(input_dim, mlp_dim, dim_head, window_size, agent_size, drop_out)
            for _ in range(depth))
        self.mlp_head = SlotMeanHead(input_dim)

    def forward(self, x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """x: (B, L, C, H, W); present: (B, L) bool."""
        for layer in self.layers:
            x = layer(x, present)
        return self.mlp_head(x)
