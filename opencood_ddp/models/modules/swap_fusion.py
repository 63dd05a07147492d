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

from opencood_ddp.models.modules.biased_attention import biased_attention, use_head_loop
from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.numerics.dropout import Dropout
from opencood_ddp.numerics.kernel_path import maps_for_kernels


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

    Input (B X Y n, C) rows: each sample's X x Y windows of n = L w w tokens in turn (``window_tokens``, flat);
    output the same. The projections run on the flat rows so that their outputs are tensors of their own, not
    views: the dropout that ends the branch then writes over the output, and the residual adds into it, without
    autograd copying a base tensor in the backward (``PreNormResidual``).
    """

    constant_buffers = ("relative_position_index",)  # made here, never trained: DDP need not broadcast it

    def __init__(self, dim: int, dim_head: int, dropout: float, agents: int, window: int):
        super().__init__()
        self.heads = dim // dim_head
        self.scale = dim_head ** -0.5
        # Upstream keeps the index in the state dict (a persistent buffer); so do we, for strict loading.
        self.register_buffer("relative_position_index", relative_position_index(agents, window))
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim, bias=False), Dropout(dropout, inplace=True))
        self.relative_position_bias_table = nn.Embedding(
            (2 * agents - 1) * (2 * window - 1) * (2 * window - 1), self.heads)

    def forward(self, rows: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """rows: (B X Y n, C), the windows of each sample in turn; present: (B, L) bool, False for a padded
        slot."""
        n = self.relative_position_index.shape[0]
        qkv = self.to_qkv(rows).view(rows.shape[0] // n, n, -1)
        bias = self.relative_position_bias_table(self.relative_position_index).permute(2, 0, 1)  # (heads, n, n)
        if use_head_loop(qkv):
            key_bias = self.key_bias(present, n, qkv.dtype)
            out = biased_attention(qkv, bias.to(qkv.dtype), key_bias, self.heads, self.scale)
        else:
            out = self.plain_attention(qkv, bias, present)
        return self.to_out(out.view(rows.shape[0], -1))

    def plain_attention(self, qkv: torch.Tensor, bias: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """What ``biased_attention`` computes, in batched tensor operations (CUDA and autocast, and the tests'
        reference): (B X Y, n, 3C) projections -> (B X Y, n, C)."""
        windows, n, three_dim = qkv.shape
        q, k, v = qkv.view(windows, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        sim = in_full_precision(lambda q, k: (q * self.scale) @ k.transpose(-2, -1), q, k)  # (B X Y, heads, n, n)
        samples = present.shape[0]
        bias_and_mask = (bias.to(sim.dtype) + self.key_bias(present, n, sim.dtype)[:, None, None, :]).unsqueeze(1)
        sim = sim.view(samples, windows // samples, self.heads, n, n) + bias_and_mask
        out = sim.softmax(dim=-1).view(windows, self.heads, n, n) @ v  # (B X Y, heads, n, d)
        return out.transpose(1, 2).reshape(windows, n, three_dim // 3)

    @staticmethod
    def key_bias(present: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, n): 0 for a present agent's key, the dtype's lowest value for an absent agent's, which gives it no
        weight (every window holds the ego, so no row is all masked). Added with the relative bias, once: the
        same values as adding the bias and then filling the masked keys."""
        keys = present.repeat_interleave(n // present.shape[1], dim=1)  # tokens are (agent, row, column)
        return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)


class FeedForward(nn.Module):
    """Linear -> GELU -> Dropout -> Linear -> Dropout (upstream's ``net`` indices 0 and 3 hold weights).

    Both dropouts write over their input: GELU keeps its input for the backward, not its output, and a Linear
    keeps neither its output."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), Dropout(dropout, inplace=True),
                                 nn.Linear(hidden, dim), Dropout(dropout, inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PreNormResidual(nn.Module):
    """x + fn(LayerNorm(x)); extra arguments go to fn, whose output nothing else may keep (here each branch ends
    in a Linear and a dropout).

    The sum goes into fn's output where that is a tensor of its own of x's type (always, but under autocast):
    the same bits as a new sum, and one large activation fewer per block. On the CPU each fresh activation
    page-faults in at every step; on a view, autograd would copy its base in the backward instead."""

    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        branch = self.fn(self.norm(x), *args)
        if branch._base is None and branch.dtype == x.dtype:
            return branch.add_(x)
        return branch + x


def window_tokens(cells: torch.Tensor, window: int, dilated: bool) -> torch.Tensor:
    """(B, L, H, W, C) cells -> (B X Y, L w w, C) tokens, contiguous: X x Y windows per sample, each holding its
    tokens in (agent, row, column) order.

    Local windows (``dilated`` False) hold w x w neighbouring cells (row h = x w + i); grid windows (True) hold
    w x w cells H/w and W/w apart (h = i X + x), so one grid window spans the whole map.
    """
    b, agents, height, width, dim = cells.shape
    nx, ny = height // window, width // window
    if dilated:
        view = cells.view(b, agents, window, nx, window, ny, dim).permute(0, 3, 5, 1, 2, 4, 6)
    else:
        view = cells.view(b, agents, nx, window, ny, window, dim).permute(0, 2, 4, 1, 3, 5, 6)
    return view.reshape(b * nx * ny, agents * window * window, dim)


def cells_from_tokens(tokens: torch.Tensor, shape: torch.Size, window: int, dilated: bool) -> torch.Tensor:
    """The inverse of ``window_tokens``: (B X Y, L w w, C) -> (B, L, H, W, C) of the given shape."""
    b, agents, height, width, dim = shape
    windows = tokens.view(b, height // window, width // window, agents, window, window, dim)
    order = (0, 3, 4, 1, 5, 2, 6) if dilated else (0, 3, 1, 4, 2, 5, 6)
    return windows.permute(*order).reshape(shape)


class _PermuteRows(torch.autograd.Function):
    """rows[index], whose backward is grad[inverse]: index is a permutation, so the gradient needs no zero
    filled tensor and no scatter-add (index_select's own backward)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return inverse


class TokenOrders:
    """The row permutations between the cells' order ((B, L, H, W) flat) and the token orders of the local and
    the grid windows (``window_tokens``, flat), for one map shape.

    Why: a block's two halves read their tokens in different orders. Going from one to the other through the
    cells' order is two copies, each into a fresh activation (and two more in the backward); one row gather is
    one (rows of C contiguous channels, so each moves as a block)."""

    def __init__(self, shape: torch.Size, window: int, device: torch.device):
        cells = torch.arange(shape[0] * shape[1] * shape[2] * shape[3], device=device).view(*shape[:4], 1)
        local, grid = (window_tokens(cells, window, dilated).flatten() for dilated in (False, True))
        from_local, from_grid = _inverse(local), _inverse(grid)
        self._pairs = {("cells", "local"): (local, from_local), ("cells", "grid"): (grid, from_grid),
                       ("local", "grid"): (from_local[grid], from_grid[local])}

    def move(self, rows: torch.Tensor, source: str, target: str) -> torch.Tensor:
        """(R, C) rows in ``source`` order ("cells", "local" or "grid") -> the same rows in ``target`` order."""
        if (source, target) in self._pairs:
            index, inverse = self._pairs[(source, target)]
        else:
            inverse, index = self._pairs[(target, source)]
        return _PermuteRows.apply(rows, index, inverse)


class SwapFusionBlockMask(nn.Module):
    """Window attention + feed-forward, then grid attention + feed-forward, absent agents masked.

    Works on token rows: each half runs both of its residual blocks (per-token operations but the attention,
    which stays inside a window) on the rows in its windows' order, and one row gather goes from the local
    windows' order to the grid windows' (``TokenOrders``). ``forward`` takes and returns (B, L, H, W, C) cells;
    the encoder chains ``forward_rows`` so that its blocks pass rows from one to the next.
    """

    def __init__(self, input_dim: int, mlp_dim: int, dim_head: int, window_size: int, agent_size: int,
                 drop_out: float):
        super().__init__()
        self.window_size = window_size
        attention = lambda: WindowAttention(input_dim, dim_head, drop_out, agent_size, window_size)  # noqa: E731
        self.window_attention = PreNormResidual(input_dim, attention())
        self.window_ffd = PreNormResidual(input_dim, FeedForward(input_dim, mlp_dim, drop_out))
        self.grid_attention = PreNormResidual(input_dim, attention())
        self.grid_ffd = PreNormResidual(input_dim, FeedForward(input_dim, mlp_dim, drop_out))

    def forward(self, cells: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """cells: (B, L, H, W, C); present: (B, L) bool."""
        orders = TokenOrders(cells.shape, self.window_size, cells.device)
        rows = orders.move(cells.reshape(-1, cells.shape[-1]), "cells", "local")
        return orders.move(self.forward_rows(rows, present, orders), "grid", "cells").view(cells.shape)

    def forward_rows(self, rows: torch.Tensor, present: torch.Tensor, orders: TokenOrders) -> torch.Tensor:
        """(B L H W, C) rows in the local windows' token order -> the block's output rows in the grid windows'."""
        rows = self.window_ffd(self.window_attention(rows, present))
        rows = orders.move(rows, "local", "grid")
        return self.grid_ffd(self.grid_attention(rows, present))


class SlotMeanHead(nn.Module):
    """(B, L, H, W, C) cells -> (B, C, H, W): mean over the L slots, then LayerNorm and Linear per cell.

    Upstream's ``mlp_head`` is an ``nn.Sequential`` whose weights sit at indices 2 and 3 (0 and 1 are its
    parameter-free reshapes), so the two modules are registered under the names "2" and "3".
    """

    def __init__(self, dim: int):
        super().__init__()
        self.add_module("2", nn.LayerNorm(dim))
        self.add_module("3", nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cells = x.mean(dim=1)  # (B, H, W, C)
        norm, linear = self._modules["2"], self._modules["3"]
        return maps_for_kernels(linear(norm(cells)).permute(0, 3, 1, 2))


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
        """x: (B, L, C, H, W); present: (B, L) bool. The layers work on token rows gathered from (B, L, H, W, C)
        cells, each cell's channels contiguous (free when x is channels-last, as ``to_slots`` makes it)."""
        cells = x.permute(0, 1, 3, 4, 2).contiguous()
        orders = TokenOrders(cells.shape, self.window_size, cells.device)
        rows, order = cells.view(-1, cells.shape[-1]), "cells"
        for layer in self.layers:
            rows = layer.forward_rows(orders.move(rows, order, "local"), present, orders)
            order = "grid"
        return self.mlp_head(orders.move(rows, order, "cells").view(cells.shape))
