"""Batch norm whose training statistics span the global batch.

With the batch split over N ranks, plain BatchNorm normalises each rank's shard with that shard's statistics:
a different model from the 1-GPU baseline. Converting to a synchronized batch norm before DDP wrapping
restores the baseline: outputs, gradients and running statistics equal those of one BatchNorm over the
global batch. On CUDA that is `device_sync_bn.DeviceSyncBatchNorm`: torch.nn.SyncBatchNorm's kernels and
numbers without its three host waits per layer. torch's kernels are CUDA's only, so CPU/gloo runs use
`GlooSyncBatchNorm` below. Both keep the parameter and buffer names of BatchNorm, hence the state-dict keys of
OpenCOOD checkpoints.

`GlooSyncBatchNorm` is the accurate batch norm of `numerics/batch_norm.py` (float64 per-channel sums, exact on
every layout) with a reduction over ranks: each rank's (count, mean, variance) is all-gathered and combined
exactly, and the backward's two per-channel sums are all-reduced.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.device_sync_bn import convert_device_sync_batchnorm
from opencood_ddp.numerics.batch_norm import AccurateStatistics, Reduction, use_accurate_batch_norm


class _OverRanks(Reduction):
    def gather_moments(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(comm.get_world_size())]
        dist.all_gather(parts, local)
        return torch.stack(parts)

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        return sums


_OVER_RANKS = _OverRanks()


class GlooSyncBatchNorm(AccurateStatistics, _BatchNorm):
    """Synchronized batch norm for any backend (gloo/CPU included), for inputs (N, C, ...) of any rank."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}")

    def reduction(self, x: torch.Tensor) -> Optional[Reduction]:
        if comm.is_dist() and comm.get_world_size() > 1:
            return _OVER_RANKS
        return super().reduction(x)


def _convert_to_gloo_sync(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, GlooSyncBatchNorm):
        converted = GlooSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                      module.track_running_stats)
        converted.load_state_dict(module.state_dict())
        for name, parameter in converted.named_parameters(recurse=False):
            # load_state_dict copies values only: a frozen layer (backbone_fix) must stay frozen, as torch's own
            # convert_sync_batchnorm keeps it by reusing the parameters.
            parameter.requires_grad_(getattr(module, name).requires_grad)
        converted.train(module.training)
        converted.to(next(module.buffers(), torch.empty(0)).device)
        return converted
    for name, child in module.named_children():
        module.add_module(name, _convert_to_gloo_sync(child))
    return module


SYNCHRONIZED = (nn.SyncBatchNorm, GlooSyncBatchNorm)


def buffers_kept_equal(model: nn.Module) -> bool:
    """Whether every buffer of ``model`` stays the same on every rank without DDP's broadcast of rank 0's buffers
    before each forward: a synchronized batch norm's (its running statistics are the micro-batch's over all
    ranks, the same arithmetic on the same gathered numbers on every rank), or one its module lists in
    ``constant_buffers`` (an index table made at construction). Any other buffer (a plain batch norm's under
    --no_sync_bn, a user model's own) may drift apart, and rank 0's is broadcast, as upstream's DDP does."""
    for module in model.modules():
        constant = set(getattr(module, "constant_buffers", ()))
        for name, _ in module.named_buffers(recurse=False):
            if not isinstance(module, SYNCHRONIZED) and name not in constant:
                return False
    return True


def convert_sync_batchnorm(model: nn.Module, world_size: int, device: str,
                           enabled: bool = True) -> tuple[nn.Module, Optional[str]]:
    """Prepare every BatchNorm for training; returns (model, kind) where kind names the synchronized one used.

    Must run before DDP wrapping. At world size 1 (or with --no_sync_bn) the model's BatchNorm layers get
    accurate statistics (numerics/batch_norm.py) and kind is None, so that any task's model, not only the
    ones create_model builds, trains with float32-exact statistics on CPU.
    """
    if not enabled or world_size == 1:
        return use_accurate_batch_norm(model), None
    if device.startswith("cuda"):
        return convert_device_sync_batchnorm(model), "DeviceSyncBatchNorm"
    return _convert_to_gloo_sync(model), "GlooSyncBatchNorm"
