"""Synchronized batch norm for CUDA ranks that never waits for the device: torch's kernels, without its mask.

torch's ``nn.SyncBatchNorm`` (torch 2.11 and 2.13) gathers every rank's (mean, invstd, count) and then drops the
rows of ranks whose input was empty with three boolean-mask indexings. Each is a ``nonzero``, which copies its size
to the host and waits for the device's queue: three host waits per batch norm per forward, 69 a step of a
full-size pillar model on N GPUs, where one GPU waits none; and under ``--capture`` a data-dependent shape that
breaks the graph at every batch norm. The mask exists because the kernel that combines the rows
(``batch_norm_gather_stats_with_counts``) merges them in order with a running count, and a row of count 0 that
comes first makes 0 x inf = NaN (torch issues 78549 and 78656).

`DeviceSyncBatchNorm` keeps torch's kernels and their arithmetic and replaces the mask with a stable partition on
the device (`empty_ranks_last`): the non-empty rows in rank order, then the empty ones with invstd 1, so that each
contributes 0 to the merge. When no rank is empty the partition is the identity and the kernel sees what torch's
sees, bit for bit. When one is, the merge runs over the same non-empty rows in the same order and then through
the empty ones, each of which multiplies the merged mean by n * (1 / n), which float32 rounds to 1 for most n but
not all (41, 47, 55, ...): the mean can move by a rounding per empty rank, the variance cannot.

Two more differences from torch's, both for ranks with an empty input under ``--half``, where torch's mixes
dtypes: the empty rank's statistics row and its backward sums are sent in the kernels' accumulation dtype (float32
for float16 and bfloat16 inputs), as the other ranks' are, and its weight and bias gradients are zeros, not None.

Under ``--capture`` on N GPUs these layers are in the dense step's compiled graphs, collectives included (dynamo
traces the function and turns its collectives into functional ones): one graph, not one per batch norm. Two
things make that safe. The combine kernel updates the running statistics in place although its schema says it
writes nothing, so under torch.compile it goes through `_gather_stats_declared`, which declares the writes (an
unseen write can be dropped with the call). And a rank whose input is empty computes what it sends and what it
returns from the graph's tensors (`_zero_sums`, `_empty_from`), so that no compiler drops or moves its collectives
and the ranks' collectives keep pairing up.

Only CUDA has these kernels (``aten::batch_norm_stats`` has no CPU kernel); the CPU's synchronized batch norm is
`sync_bn.GlooSyncBatchNorm`. tests/test_device_sync_bn.py proves the logic on real gloo ranks over CPU stand-ins
of the kernels, written from their CUDA formulas.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from opencood_ddp.numerics.batch_counts import batch_norm_counted_later, left_to_the_block

STAT_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # the kernels' accumulation dtype


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    return STAT_DTYPES.get(x.dtype, x.dtype)


def empty_ranks_last(rows: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, invstd, count) of the gathered (ranks, 2C + 1) rows, the rows of count 0 moved after the others (each
    part in rank order) and their invstd set to 1, on the device and without reading anything back: the combine
    kernel then adds 0 for each of them, where a row of count 0 merged first, or an invstd of 0, makes NaN."""
    order = torch.argsort((rows[:, -1] < 1).to(torch.int32), stable=True)
    mean, invstd, count = rows.index_select(0, order).split([channels, channels, 1], dim=1)
    return mean, invstd.masked_fill(count < 1, 1.0), count


def _gather_rows(local: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """(ranks, 2C + 1): every rank's row, in rank order."""
    if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local, group)
        return torch.stack(parts)
    gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group)
    return gathered.view(world_size, local.numel())


def _memory_dense(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels take it: channels-last layouts kept, anything else made contiguous."""
    if t.is_contiguous(memory_format=torch.channels_last) or t.is_contiguous(memory_format=torch.channels_last_3d):
        return t
    return t.contiguous()


# A rank whose input is empty takes part in both collectives with zeros. Under torch.compile (--capture on N GPUs
# compiles these layers into the dense step's graphs) what it sends and what it returns must depend on the graph's
# tensors, as a rank with values does: a collective whose result is unused is dead code, which the graph drops on
# this rank alone; one that depends on constants only may move, the backward's into the forward graph. Either way
# the ranks' collectives no longer pair up, and the others wait forever.
def _zero_sums(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per channel, the sum of `t` (which has no element): zeros of `dtype`, computed from `t`."""
    return t.sum(dim=[d for d in range(t.dim()) if d != 1], dtype=dtype)


def _empty_from(x: torch.Tensor, collected: torch.Tensor) -> torch.Tensor:
    """An empty tensor like `x` (which has no element), computed from `collected`, what a collective gave."""
    return torch.zeros_like(x) + collected.reshape(-1)[:1].to(x.dtype).reshape([1] * x.dim())


@torch.library.custom_op("opencood_ddp::batch_norm_gather_stats_with_counts",
                         mutates_args=("running_mean", "running_var"))
def _gather_stats_declared(x: torch.Tensor, mean_all: torch.Tensor, invstd_all: torch.Tensor,
                           running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float,
                           eps: float, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's combine kernel with what its schema leaves out: it updates the running statistics in place. Under
    torch.compile an undeclared write is invisible: the compiled graph may drop or move the call (on a rank whose
    input is empty inductor drops it, its outputs being unused there) and the running statistics stay behind."""
    return torch.batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum,
                                                     eps, counts)


@_gather_stats_declared.register_fake
def _(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    return torch.batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, None, None, momentum, eps, counts)


def _gather_stats(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine: torch's kernel as it is, and under torch.compile the same kernel with its writes declared."""
    if torch.compiler.is_compiling():
        return _gather_stats_declared(*args)
    return torch.batch_norm_gather_stats_with_counts(*args)


class DeviceSyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over every rank's batch, with torch's CUDA kernels and no host wait."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float, group,
                world_size: int):
        x = _memory_dense(x)
        weight = weight.contiguous() if weight is not None else None
        channels = x.shape[1]
        if x.numel():
            mean, invstd = torch.batch_norm_stats(x, eps)
            count = torch.full((1,), x.numel() // channels, dtype=mean.dtype, device=mean.device)
            local = torch.cat([mean, invstd, count])
        else:
            zeros = _zero_sums(x, stat_dtype(x))  # mean, invstd and count 0
            local = torch.cat([zeros, zeros, zeros[:1]])
        mean_all, invstd_all, count_all = empty_ranks_last(_gather_rows(local, group, world_size), channels)
        counts = count_all.reshape(-1)
        if running_mean is not None and counts.dtype != running_mean.dtype:
            counts = counts.to(running_mean.dtype)
        mean, invstd = _gather_stats(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts)
        ctx.save_for_backward(x, weight, mean, invstd, count_all.to(torch.int32))
        ctx.group = group
        if not x.numel():
            return _empty_from(x, mean)
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd, counts = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_in = grad_weight = grad_bias = None
        channels = x.shape[1]
        if x.numel():
            grad_out = _memory_dense(grad_out)
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                grad_out, x, mean, invstd, weight, need_input, need_weight, need_bias)
        else:
            sum_dy = sum_dy_xmu = _zero_sums(grad_out, mean.dtype)
            if weight is not None:  # zeros, as a rank with values would send: every parameter gets a gradient
                grad_weight, grad_bias = torch.zeros_like(weight), torch.zeros_like(weight)
        if need_input:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, dist.ReduceOp.SUM, ctx.group)  # every rank takes part, an empty one too
            sum_dy, sum_dy_xmu = sums.split(channels)
            if x.numel():
                w = weight.to(mean.dtype) if weight is not None and weight.dtype != mean.dtype else weight
                grad_in = torch.batch_norm_backward_elemt(grad_out, x, mean, invstd, w, sum_dy, sum_dy_xmu, counts)
            else:
                grad_in = _empty_from(x, sum_dy)
        if weight is None or not need_weight:
            grad_weight = None
        if weight is None or not need_bias:
            grad_bias = None
        return grad_in, grad_weight, grad_bias, None, None, None, None, None, None


class DeviceSyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` (the same parameters, buffers and state-dict keys) whose training forward over several
    ranks is `DeviceSyncBatchNormFunction`; evaluation, and a group of one rank, are torch's own forward."""

    def _sync_group(self) -> Optional[tuple]:
        """(group, world size) when this forward synchronizes, else None."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group or dist.group.WORLD
        world_size = dist.get_world_size(group)
        return (group, world_size) if world_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        synced = self._sync_group()
        if synced is None:
            return self._unsynced_forward(x)
        self._check_input_dim(x)
        self._check_non_zero_input_channels(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:  # training, here: the statistics are tracked
            if not left_to_the_block(self):  # numerics/batch_counts.py: one foreach add a forward
                self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return DeviceSyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                                 self.eps, momentum, *synced)

    def _unsynced_forward(self, x: torch.Tensor) -> torch.Tensor:
        """torch's forward (evaluation, a group of one rank); in training its batch count left to the open block
        of numerics/batch_counts.py, and then the call torch's makes without a rank to synchronize with."""
        if self.training:  # torch's forward checks these first too
            self._check_input_dim(x)
            self._check_non_zero_input_channels(x)
        out = batch_norm_counted_later(self, x)
        return out if out is not None else super().forward(x)


def convert_device_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm of ``module`` as a `DeviceSyncBatchNorm`, sharing its parameters and buffers (torch's
    ``convert_sync_batchnorm``, then the class changed: no state is added, so nothing else changes)."""
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for layer in converted.modules():
        if type(layer) is nn.SyncBatchNorm:
            layer.__class__ = DeviceSyncBatchNorm
    return converted


__all__ = ["DeviceSyncBatchNorm", "DeviceSyncBatchNormFunction", "convert_device_sync_batchnorm",
           "empty_ranks_last", "stat_dtype"]
