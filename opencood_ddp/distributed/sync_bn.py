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
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opencood_ddp.distributed import comm


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a (C,) tensor to broadcast against x of shape (N, C, ...)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _all_reduce_(t: torch.Tensor) -> torch.Tensor:
    if comm.is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm with statistics and input-gradient terms all-reduced over ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float):
        dims = _reduce_dims(x)
        channels = x.shape[1]
        local_count = x.numel() // channels if channels else 0
        # float64 sums: sum-of-squares variance stays exact enough to match BatchNorm to 1e-5.
        stats = torch.cat([x.sum(dims, dtype=torch.float64), (x * x).sum(dims, dtype=torch.float64),
                           torch.tensor([float(local_count)], dtype=torch.float64, device=x.device)])
        stats = _all_reduce_(stats)
        count = stats[-1]
        if count.item() < 2:
            raise ValueError("synchronized batch norm needs more than one value per channel over all ranks")
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean32, invstd32 = mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - _per_channel(mean32, x)) * _per_channel(invstd32, x)
        ctx.save_for_backward(xhat, weight, invstd32)
        ctx.count = count
        out = xhat
        if weight is not None:
            out = out * _per_channel(weight, x) + _per_channel(bias, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight, invstd = ctx.saved_tensors
        dims = _reduce_dims(grad_out)
        channels = grad_out.shape[1]
        sum_dy = grad_out.sum(dims, dtype=torch.float64)
        sum_dy_xhat = (grad_out * xhat).sum(dims, dtype=torch.float64)
        # Parameter gradients stay local: DDP averages them over ranks like every other parameter.
        grad_weight = sum_dy_xhat.to(grad_out.dtype) if weight is not None else None
        grad_bias = sum_dy.to(grad_out.dtype) if weight is not None else None
        global_sums = _all_reduce_(torch.cat([sum_dy, sum_dy_xhat]))
        mean_dy = (global_sums[:channels] / ctx.count).to(grad_out.dtype)
        mean_dy_xhat = (global_sums[channels:] / ctx.count).to(grad_out.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_in = (grad_out - _per_channel(mean_dy, grad_out) - xhat * _per_channel(mean_dy_xhat, grad_out))
        grad_in = grad_in * _per_channel(scale, grad_out)
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


def count_batchnorms(model: nn.Module) -> int:
    return sum(isinstance(m, _BatchNorm) for m in model.modules())
