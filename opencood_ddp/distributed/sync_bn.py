"""Batch norm whose training statistics span the global batch.

With the batch split over N ranks, plain BatchNorm normalises each rank's shard with that shard's statistics:
a different model from the 1-GPU baseline. Converting to a synchronized batch norm before DDP wrapping
restores the baseline: outputs, gradients and running statistics equal those of one BatchNorm over the
global batch. torch.nn.SyncBatchNorm does this on CUDA only (it raises on CPU tensors), so CPU/gloo runs
use `GlooSyncBatchNorm` below, which keeps the parameter and buffer names of BatchNorm, hence the
state-dict keys of OpenCOOD checkpoints.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opencood_ddp.distributed import comm


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a (C,) tensor to broadcast against x of shape (N, C, ...)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """Per-channel tensors stay float32 for a bf16/fp16 input: the mixed-type CPU kernels want that."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _affine(x: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor) -> torch.Tensor:
    """slope * x + intercept per channel in one fused pass: eval-mode batch_norm with mean 0, var 1, eps 0."""
    if x.numel() == 0:  # a rank without data; the native kernels divide by the element count
        return torch.empty_like(x)
    zeros, ones = torch.zeros_like(slope), torch.ones_like(slope)
    return torch.batch_norm(x, slope, intercept, zeros, ones, False, 0.0, 0.0, False)


def _local_moments(x: torch.Tensor) -> torch.Tensor:
    """(3, C) float64 rows: this rank's value count, mean and biased variance per channel."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count:
        # The native training kernel is the fastest per-channel reduction on CPU (var_mean is ~3x slower).
        # With eps 0 its invstd is 1 / std, and 0 for a constant channel (variance 0).
        _, mean, invstd = torch.native_batch_norm(x, None, None, None, None, True, 0.0, 0.0)
        invstd = invstd.double()
        mean, var = mean.double(), torch.where(invstd > 0, invstd.pow(-2), torch.zeros_like(invstd))
    else:
        mean = var = torch.zeros(channels, dtype=torch.float64, device=x.device)
    return torch.stack([torch.full_like(mean, float(count)), mean, var])


def _global_moments(local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and biased variance over all ranks, combined exactly from each rank's (count, mean, var)
    (Chan's parallel formula: no sum-of-squares cancellation)."""
    if comm.is_dist():
        parts = [torch.empty_like(local) for _ in range(comm.get_world_size())]
        dist.all_gather(parts, local)
        stacked = torch.stack(parts)
    else:
        stacked = local[None]
    counts, means, variances = stacked[:, 0], stacked[:, 1], stacked[:, 2]
    count = counts[:, 0].sum()
    if count.item() == 0:
        # No rank has a value (a global batch of frames without a point in range): BatchNorm on a (0, C)
        # input, what the 1-process run does, normalises nothing and leaves the running statistics alone.
        return count, torch.zeros_like(means[0]), torch.ones_like(variances[0])
    if count.item() == 1:  # BatchNorm raises on one value per channel in training, and so do we
        raise ValueError("synchronized batch norm needs more than one value per channel over all ranks")
    mean = (counts * means).sum(0) / count
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / count
    return count, mean, var


def _local_gradient_sums(grad_out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                         mean: torch.Tensor, invstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sum(dy * xhat) and sum(dy) per channel, xhat under the global mean and invstd."""
    if x.numel() == 0:
        return torch.zeros_like(mean), torch.zeros_like(mean)
    # The backward kernel's weight-gradient reduction is exactly these two sums, fused.
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_out, x, None if weight is None else weight.to(mean.dtype), None, None, mean, invstd, True, 0.0,
        [False, True, True])
    return sum_dy_xhat, sum_dy


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm with statistics and input-gradient terms combined over ranks.

    Built from fused native kernels (per-channel moments, eval-mode affine, the backward's reductions):
    as fast as BatchNorm on CPU, where composing it from elementwise ops and sums took twice as long.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float):
        count, mean, var = _global_moments(_local_moments(x))
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None and count.item() > 0:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        dtype = _stat_dtype(x)
        mean, invstd = mean.to(dtype), invstd.to(dtype)
        scale = invstd if weight is None else invstd * weight.to(dtype)
        shift = -mean * scale if bias is None else bias.to(dtype) - mean * scale
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count = count
        return _affine(x, scale, shift)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        grad_out = grad_out.contiguous()
        sum_dy_xhat, sum_dy = _local_gradient_sums(grad_out, x, weight, mean, invstd)
        # Parameter gradients stay local: DDP averages them over ranks like every other parameter.
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        sums = torch.cat([sum_dy, sum_dy_xhat]).double()
        if comm.is_dist():
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        count = ctx.count.clamp(min=1)  # 0 when no rank had a value: the sums are 0 too
        mean_dy = (sums[:channels] / count).to(mean.dtype)
        mean_dy_xhat = (sums[channels:] / count).to(mean.dtype)
        # dx = (dy - mean(dy) - xhat * mean(dy xhat)) * invstd * w, regrouped as k1 * dy + k2 * x + k3.
        k1 = invstd if weight is None else invstd * weight.to(mean.dtype)
        k2 = -k1 * mean_dy_xhat * invstd
        k3 = -k1 * mean_dy - k2 * mean
        grad_in = _affine(grad_out, k1, k3)
        grad_in.addcmul_(x, _per_channel(k2, x).to(grad_in.dtype))
        return grad_in, grad_weight, grad_bias, None, None, None, None


class GlooSyncBatchNorm(_BatchNorm):
    """Synchronized batch norm for any backend (gloo/CPU included), for inputs (N, C, ...) of any rank."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}")

    def _momentum(self) -> float:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as BatchNorm does
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or not comm.is_dist() or comm.get_world_size() == 1:
            return super().forward(x)
        momentum = self._momentum() if self.track_running_stats else 0.0
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias,
                                            self.running_mean if self.track_running_stats else None,
                                            self.running_var if self.track_running_stats else None,
                                            self.eps, momentum)


def _convert_to_gloo_sync(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, GlooSyncBatchNorm):
        converted = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                      module.track_running_stats)
        converted.load_state_dict(module.state_dict())
        converted.train(module.training)
        converted.to(next(module.buffers(), torch.empty(0)).device)
        return converted
    for name, child in module.named_children():
        module.add_module(name, _convert_to_gloo_sync(child))
    return module


def convert_sync_batchnorm(model: nn.Module, world_size: int, device: str,
                           enabled: bool = True) -> tuple[nn.Module, Optional[str]]:
    """Convert every BatchNorm for a multi-rank run; returns (model, kind) where kind names what was used.

    Must run before DDP wrapping. At world size 1 (or with --no_sync_bn) the model is returned unchanged.
    """
    if not enabled or world_size == 1:
        return model, None
    if device.startswith("cuda"):
        return nn.SyncBatchNorm.convert_sync_batchnorm(model), "torch.nn.SyncBatchNorm"
    return _convert_to_gloo_sync(model), "GlooSyncBatchNorm"

