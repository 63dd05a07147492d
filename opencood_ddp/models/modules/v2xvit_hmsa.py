"""V2X-ViT's agent attention: per BEV cell, each CAV attends over the CAVs of its sample (upstream ``hmsa.py`` and
``CavAttention`` of ``base_transformer.py``).

``HeteroCavAttention`` (HMSA, upstream ``HGTCavAttention``): query, key, value and output projections of their
own per agent kind (``{q,k,v,a}_linears.{kind}``: 0 vehicle, 1 infrastructure), and per edge kind
(query kind x 2 + key kind) a matrix per head on the key (``relation_att``) and on the value
(``relation_msg``):

    logit[i, j] = q_i W_att[e(i, j)] k_j / sqrt(dim_head),    out_i = sum_j softmax_j(logit)[i, j] v_j W_msg[e(i, j)]

Keys are masked where a CAV's warped map has no data and in padded slots; the ego always has data, so no row
is masked entirely. Upstream loops over samples, CAVs and CAV pairs in Python; here each agent kind's
projection runs once on that kind's CAVs, and the edge matrices are gathered per key CAV for each query kind
present in the batch. Every projection runs each step, on no CAV at all when the batch has none of its
kind (zero gradients), so DDP sees every parameter used without ``find_unused_parameters``. Upstream calls a
kind's projections only for CAVs of that kind, so on a batch without a road-side unit the infrastructure
projections are not in its graph and keep grad None: the module records the kinds it met, and the engine sets
the gradients of a kind that no rank met to None before the optimizer step (``models/parameter_use.py``).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.models.modules.v2xvit_agents import NUM_KINDS, Agents
from opencood_ddp.models.parameter_use import TracksParameterUse
from opencood_ddp.numerics.dropout import Dropout


def typed_linear(x: torch.Tensor, rows_of_kind: Sequence[torch.Tensor], linears: nn.ModuleList) -> torch.Tensor:
    """Row r of x (N, ...) through ``linears[k]`` for the k whose ``rows_of_kind[k]`` holds r (Agents')."""
    out = None
    for rows, linear in zip(rows_of_kind, linears):
        part = linear(x[rows])
        if out is None:
            out = part.new_zeros((x.shape[0],) + tuple(part.shape[1:]))
        out = out.index_put((rows,), part.to(out.dtype))
    return out


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., heads * dim_head) -> (..., heads, dim_head): upstream's '(m c)' channel order."""
    return x.view(x.shape[:-1] + (heads, x.shape[-1] // heads))


def key_mask(agents: Agents, visible: torch.Tensor) -> torch.Tensor:
    """(N, H, W) visibility -> (B, H, W, 1, 1, L) keys that may be attended (False in padded slots)."""
    return agents.pad(visible).permute(0, 2, 3, 1)[:, :, :, None, None, :]


def attend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k (B, L, H, W, M, d) -> attention weights (B, H, W, M, L_query, L_key)."""
    logits = in_full_precision(lambda q, k: torch.einsum("bihwmp,bjhwmp->bhwmij", q, k) * scale, q, k)
    return logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def gather_messages(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """weights (B, H, W, M, L, L), v (B, L, H, W, M, d) -> (B, L, H, W, M, d)."""
    return torch.einsum("bhwmij,bjhwmc->bihwmc", weights, v)


class HeteroCavAttention(nn.Module, TracksParameterUse):
    """HMSA: agent attention with weights per agent kind and per edge kind (see the module docstring)."""

    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float, num_kinds: int = NUM_KINDS):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.num_kinds = heads, num_kinds
        self.scale = dim_head ** -0.5
        self.drop_out = Dropout(dropout)
        self.k_linears = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_kinds))
        self.q_linears = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_kinds))
        self.v_linears = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_kinds))
        self.a_linears = nn.ModuleList(nn.Linear(inner, dim) for _ in range(num_kinds))
        # Upstream's construction order: the Linear layers draw their initial values first.
        edges = num_kinds * num_kinds
        self.relation_att = nn.Parameter(torch.empty(edges, heads, dim_head, dim_head))
        self.relation_msg = nn.Parameter(torch.empty(edges, heads, dim_head, dim_head))
        nn.init.xavier_uniform_(self.relation_att)
        nn.init.xavier_uniform_(self.relation_msg)
        self._kinds_met = [False] * num_kinds  # since the last take_use(); not state: checkpoints keep upstream's

    def parameter_groups(self) -> list:
        """Per agent kind, its query, key, value and output projections: upstream calls them for that kind's CAVs
        only. The edge matrices are one parameter each, in upstream's graph whenever any edge is."""
        return [[p for linears in (self.q_linears, self.k_linears, self.v_linears, self.a_linears)
                 for p in linears[kind].parameters()] for kind in range(self.num_kinds)]

    def take_use(self) -> list:
        met, self._kinds_met = self._kinds_met, [False] * self.num_kinds
        return met

    def edge_matrices(self, relation: torch.Tensor, agents: Agents, query_kind: int) -> torch.Tensor:
        """(B, L, M, d, d): the matrix of the edge (query_kind -> key CAV) for every key slot."""
        key_kind = agents.pad(agents.kind)  # padded slots: vehicle, masked anyway
        return relation[query_kind * self.num_kinds + key_kind]

    def forward(self, x: torch.Tensor, agents: Agents, visible: torch.Tensor) -> torch.Tensor:
        """x (N, H, W, C) packed CAV maps -> (N, H, W, C)."""
        q, k, v = (split_heads(agents.pad(typed_linear(x, agents.rows_of_kind, linears)), self.heads)
                   for linears in (self.q_linears, self.k_linears, self.v_linears))
        mask = key_mask(agents, visible)
        query_kind = agents.pad(agents.kind)[:, :, None, None, None, None]  # (B, L, 1, 1, 1, 1)
        out = torch.zeros_like(q)
        for kind in agents.kinds_present():
            self._kinds_met[kind] = True
            k_edge = torch.einsum("bjhwmq,bjmpq->bjhwmp", k, self.edge_matrices(self.relation_att, agents, kind))
            v_edge = torch.einsum("bjhwmp,bjmpc->bjhwmc", v, self.edge_matrices(self.relation_msg, agents, kind))
            messages = gather_messages(attend(q, k_edge, mask, self.scale), v_edge)
            out = torch.where(query_kind == kind, messages, out)
        out = agents.unpad(out.flatten(-2))
        return self.drop_out(typed_linear(out, agents.rows_of_kind, self.a_linears))


class CavAttention(nn.Module):
    """Agent attention with one set of weights for every CAV (upstream's ``use_hetero: false``)."""

    def __init__(self, dim: int, heads: int, dim_head: int, dropout: float):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), Dropout(dropout))

    def forward(self, x: torch.Tensor, agents: Agents, visible: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(agents.pad(t), self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        out = gather_messages(attend(q, k, key_mask(agents, visible), self.scale), v)
        return self.to_out(agents.unpad(out.flatten(-2)))
