"""V2VNet's graph fusion (upstream ``fuse_modules/v2v_fuse.py`` with ``sub_modules/convgru.py``).

Each sample's CAVs are the nodes of a complete graph. A round of message passing, repeated
``num_iteration`` times: every receiver i warps each CAV j's map into its own frame, a 3x3 convolution of
[warped j, i's own map] is the message j -> i (zeroed outside j's warped field of view), the messages are
averaged (or max-ed) over j (i itself included, as upstream), and a ConvGRU of [i's map, aggregate] with a
zero hidden state gives i's new map (with ``gru_flag: false``, upstream's residual update: i's map plus the
aggregate). After the last round the ego's map (node 0) of each sample goes through a per-cell linear layer.

State-dict names as upstream: ``msg_cnn``, ``conv_gru.cell_list.{k}.conv_gates|conv_can``, ``mlp``; with the
V2V4Real fork's temporal encoding, ``cnn`` before them (a 3x3 convolution of [map, delay] back to the map's width).

Departures from upstream (docs/compatibility.md):
- The ConvGRU's zero hidden state takes the input's height and width; upstream sizes it from
  ``conv_gru.H``/``W`` and fails on any other map size (another range or stride).
- The warp is normalised by ``lidar_range`` (the map covers the whole range), so it is right for any
  stride; with proj_first (upstream's setting) every transform is the identity and so is the warp.
- The arithmetic is rearranged, not changed (tests/test_zoo_v2vnet.py checks it against the plain form in
  float64). ``msg_cnn`` is linear in [warped j, own i], so the receiver's half is convolved once per receiver
  and the sender's half once per pair, where upstream convolves the 2C-wide pair n^2 times. When every
  transform of a sample is the identity (proj_first, upstream's setting), the warp and the coverage mask are
  the identity and the sender's half is convolved once per CAV. The ConvGRU starts from a zero hidden state, so
  the hidden half of each convolution's input and the reset gate multiply zeros and are left out; their
  weights still get their (zero) gradient, as upstream's do.
- With ``gru_flag: false`` upstream still builds the ConvGRU and never calls it, so its parameters never get a
  gradient; here it is built (the same state dict: upstream's checkpoints load) and frozen, so that DDP needs no
  ``find_unused_parameters``.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from opencood_ddp.models.modules.cav_layout import device_constant, to_device
from opencood_ddp.models.modules.fusion import regroup
from opencood_ddp.models.modules.grid_sampling import grid_sample
from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.numerics.kernel_path import maps_for_kernels

AGGREGATORS = ("avg", "max")


class ConvGRUCell(nn.Module):
    """One convolutional GRU step: reset and update gates from [input, h], candidate from [input, r * h]."""

    def __init__(self, input_dim: int, hidden_dim: int, kernel_size: Sequence[int]):
        super().__init__()
        padding = (int(kernel_size[0]) // 2, int(kernel_size[1]) // 2)
        kernel = (int(kernel_size[0]), int(kernel_size[1]))
        self.hidden_dim = hidden_dim
        self.conv_gates = nn.Conv2d(input_dim + hidden_dim, 2 * hidden_dim, kernel, padding=padding)
        self.conv_can = nn.Conv2d(input_dim + hidden_dim, hidden_dim, kernel, padding=padding)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        gates = self.conv_gates(torch.cat([x, hidden], dim=1))
        reset, update = torch.sigmoid(gates).split(self.hidden_dim, dim=1)
        candidate = torch.tanh(self.conv_can(torch.cat([x, reset * hidden], dim=1)))
        return (1 - update) * hidden + update * candidate

    def from_zero(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x, 0)`` without the terms that multiply the zero state: update * candidate, each from the
        input's columns of its weight only (the gates' reset rows, [0, hidden_dim), are not needed)."""
        inputs, hidden = x.shape[1], self.hidden_dim
        update = torch.sigmoid(conv_part(self.conv_gates, x, self.conv_gates.weight[hidden:, :inputs],
                                         self.conv_gates.bias[hidden:]))
        candidate = torch.tanh(conv_part(self.conv_can, x, self.conv_can.weight[:, :inputs], self.conv_can.bias))
        return update * candidate


class ConvGRU(nn.Module):
    """Stacked ConvGRU cells run for one time step from a zero hidden state (all V2VNet asks of it)."""

    def __init__(self, input_dim: int, hidden_dim: int, kernel_sizes: Sequence[Sequence[int]]):
        super().__init__()
        dims = [input_dim] + [hidden_dim] * len(kernel_sizes)
        self.cell_list = nn.ModuleList(ConvGRUCell(dims[k], hidden_dim, kernel)
                                       for k, kernel in enumerate(kernel_sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C_in, H, W) -> (N, hidden, H, W): the last layer's state."""
        for cell in self.cell_list:
            x = cell.from_zero(x)
        return x


def conv_part(conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``conv`` with a slice of its weight (some input columns, some output rows): its stride and padding."""
    return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def pairwise_affines(pairwise_t_matrix: torch.Tensor, lidar_range: Sequence[float]) -> torch.Tensor:
    """(B, L, L, 4, 4) metric transforms -> (B, L, L, 2, 3) ``affine_grid`` matrices, float64.

    Entry [b, i, j] maps receiver i's normalised BEV coordinates (-1..1 over ``lidar_range``) to those of
    CAV j's map, so sampling j's map there puts it in i's frame (``pairwise[b, i, j]`` takes i's frame to
    j's). x' = A x + t becomes S^-1 A S and S^-1 (A c + t - c), S the half extents, c the range's centre.
    The diagonal is the identity whatever it holds (the dataset writes the identity there; a batch from
    elsewhere may not).
    """
    matrix = pairwise_t_matrix.to(torch.float64)
    rotation, translation = matrix[..., :2, :2], matrix[..., :2, 3]
    x_min, y_min, _, x_max, y_max, _ = (float(v) for v in lidar_range)
    half = device_constant([(x_max - x_min) / 2, (y_max - y_min) / 2], matrix)
    centre = device_constant([(x_max + x_min) / 2, (y_max + y_min) / 2], matrix)
    scaled = rotation * half.view(2, 1).T / half.view(2, 1)
    shift = ((rotation @ centre.view(2, 1)).squeeze(-1) + translation - centre) / half
    theta = torch.cat([scaled, shift.unsqueeze(-1)], dim=-1)
    size = theta.shape[1]
    diagonal = torch.eye(size, dtype=torch.bool, device=theta.device).view(1, size, size, 1, 1)
    identity = torch.eye(2, 3, dtype=theta.dtype, device=theta.device).expand_as(theta)
    return torch.where(diagonal, identity, theta)


def warp_all_pairs(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) maps, (N, N, 2, 3) affines -> (N, N, C, H, W): [i, j] is map j in receiver i's frame."""
    return in_full_precision(_warp_all_pairs, x, theta).to(x.dtype)


def _warp_all_pairs(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    grid = F.affine_grid(theta.reshape(n * n, 2, 3).to(x.dtype), [n * n, c, h, w], align_corners=False)
    senders = x.unsqueeze(0).expand(n, n, c, h, w).reshape(n * n, c, h, w)
    warped = grid_sample(senders, grid, mode="bilinear", align_corners=False)
    return warped.view(n, n, c, h, w)


def field_of_view(theta: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(N, N, 2, 3) affines -> (N, N, 1, H, W) masks: 1 where sender j's map covers receiver i's cell."""
    def cover(theta: torch.Tensor) -> torch.Tensor:
        n = theta.shape[0]
        grid = F.affine_grid(theta.reshape(n * n, 2, 3), [n * n, 1, h, w], align_corners=False)
        ones = theta.new_ones(n * n, 1, h, w)
        covered = grid_sample(ones, grid, mode="nearest", align_corners=False)
        return covered.view(n, n, 1, h, w)

    return in_full_precision(cover, theta)


def identity_samples(thetas: torch.Tensor, counts: Sequence[int]) -> List[bool]:
    """(B, L, L, 2, 3) affines, each sample's CAV count -> whether all of sample b's n x n are the identity
    (one read for the batch, free where the affines are on the host)."""
    identity = torch.eye(2, 3, dtype=thetas.dtype, device=thetas.device)
    flags = [(thetas[b, :n, :n] == identity).all() for b, n in enumerate(counts)]
    return torch.stack(flags).tolist() if flags else []


class Geometry(NamedTuple):
    """How each sample's CAVs see each other, worked out where the pairwise matrices are (the host:
    cav_layout.py), once per batch: the model's `layout` makes it, so that --capture's compiled dense step is given
    the identity flags as Python bools rather than reading them back from a tensor (a graph break per step)."""

    thetas: torch.Tensor  # (B, L, L, 2, 3) float64 `pairwise_affines`
    identities: List[bool]  # per sample: every transform among its CAVs the identity (no warp, every cell covered)


def geometry(pairwise_t_matrix: torch.Tensor, cav_counts: Sequence[int], lidar_range: Sequence[float],
             device: Optional[torch.device] = None) -> Geometry:
    """Worked out where the pairwise matrices are; the matrices then go to ``device`` (the maps'; default: where
    they are), so that the fusion, and --capture's graph, reads no host tensor."""
    thetas = pairwise_affines(pairwise_t_matrix, lidar_range)
    identities = identity_samples(thetas, cav_counts)
    return Geometry(thetas if device is None else to_device(thetas, torch.device(device)), identities)


class V2VNetFusion(nn.Module):
    """Message passing among each sample's CAVs; returns the ego's updated map per sample."""

    def __init__(self, channels: int, num_iteration: int, aggregation: str,
                 kernel_sizes: Sequence[Sequence[int]], lidar_range: Sequence[float], temporal: bool = False,
                 gru: bool = True):
        super().__init__()
        if aggregation not in AGGREGATORS:
            raise ValueError(f"agg_operator {aggregation!r} is not one of {AGGREGATORS}")
        self.num_iteration = num_iteration
        self.aggregation = aggregation
        self.lidar_range = [float(v) for v in lidar_range]
        # The V2V4Real fork's temporal encoding, registered first as the fork does (its state-dict order).
        self.cnn = nn.Conv2d(channels + 1, channels, kernel_size=3, padding=1) if temporal else None
        self.msg_cnn = nn.Conv2d(2 * channels, channels, kernel_size=3, padding=1)
        self.conv_gru = ConvGRU(2 * channels, channels, kernel_sizes)
        self.gru = gru
        if not gru:  # upstream's gru_flag false: built, never called (see the module docstring)
            self.conv_gru.requires_grad_(False)
        self.mlp = nn.Linear(channels, channels)

    def update(self, nodes: torch.Tensor, theta: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """One round for one sample: (N, C, H, W) nodes -> their new states. ``mask`` None: every transform is
        the identity (so is the warp, and every cell is covered).

        The message j -> i is msg_cnn([warped j, own i]) = sender half of warped j + (receiver half of i +
        bias), masked by j's coverage of i's cells, then averaged (or max-ed) over j.
        """
        n, c, h, w = nodes.shape
        sender_weight, receiver_weight = self.msg_cnn.weight.split(c, dim=1)
        own = conv_part(self.msg_cnn, nodes, receiver_weight, self.msg_cnn.bias)
        if mask is None:
            sent = conv_part(self.msg_cnn, nodes, sender_weight)
            spread = sent.mean(dim=0) if self.aggregation == "avg" else sent.max(dim=0).values
            aggregate = own + spread
        else:
            warped = warp_all_pairs(nodes, theta).reshape(n * n, c, h, w)
            sent = conv_part(self.msg_cnn, warped, sender_weight).view(n, n, c, h, w)
            messages = (sent + own.unsqueeze(1)) * mask.to(nodes.dtype)
            aggregate = messages.mean(dim=1) if self.aggregation == "avg" else messages.max(dim=1).values
        if not self.gru:  # upstream's gru_flag false: the residual update
            return nodes + aggregate
        return self.conv_gru(torch.cat([nodes, aggregate], dim=1))

    def encode_delays(self, x: torch.Tensor, delays: torch.Tensor) -> torch.Tensor:
        """The fork's temporal encoding: ``cnn`` of each map with its delay (frames) as one more channel."""
        n, _, h, w = x.shape
        delay_map = to_device(delays, x.device).to(x.dtype).view(n, 1, 1, 1).expand(n, 1, h, w)
        return self.cnn(torch.cat([x, delay_map], dim=1))

    def forward(self, x: torch.Tensor, record_len: torch.Tensor, seen: Geometry,
                delays: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(sum(record_len), C, H, W) CAV maps -> (B, C, H, W) fused ego maps; ``seen`` is the batch's `geometry`
        (the model's layout makes it); ``delays`` (sum(record_len),), each CAV's delay, is read with the temporal
        encoding only."""
        if self.cnn is not None:
            x = self.encode_delays(x, delays)
        h, w = x.shape[-2:]
        groups = regroup(x, record_len)
        thetas, identities = to_device(seen.thetas, x.device), seen.identities
        egos: List[torch.Tensor] = []
        for b, nodes in enumerate(groups):
            n = nodes.shape[0]
            theta = thetas[b, :n, :n]
            mask = None if identities[b] else field_of_view(theta, h, w)
            for _ in range(self.num_iteration):
                nodes = self.update(nodes, theta, mask)
            egos.append(nodes[0])
        fused = torch.stack(egos, dim=0)
        return maps_for_kernels(self.mlp(fused.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))
