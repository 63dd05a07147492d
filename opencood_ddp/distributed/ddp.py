"""The one place a model is wrapped in DistributedDataParallel: the trainer's (engine/trainer.py) and the zoo's
2-rank check (tests/workers/zoo_ddp_step_worker.py) wrap as this does.

What differs from DDP's defaults, and why (each is a cost per step in a GPU step bound by launches, issue 52):
- No ``device_ids``: DDP would move the batch again, and put the keys the task keeps on the host
  (data/device_points.HOST_KEYS) on the device, where every read of them stalls the step. The task's ``move_to``
  has put the rest where the module is.
- Rank 0's buffers are broadcast before each forward only where they can drift apart (`buffer_sync`): never
  at world size 1.
- ``gradient_as_bucket_view``: each gradient is a view into DDP's all-reduce bucket, so the reduced bucket is
  not copied back into the gradients one parameter at a time (34 copies fewer in a toy AttFuse step). The
  gradients are set to None after each optimizer step (engine/trainer.optimizer_step); DDP then copies each fresh
  gradient into its bucket once and makes it the view again, as before.
"""
from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from opencood_ddp.distributed.sync_bn import buffers_kept_equal


def _ddp_parameters() -> frozenset:
    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


def buffer_sync_argument() -> str:
    """The name of DDP's argument for the broadcast before each forward: torch 2.13's forward_sync_buffers (buffers
    are still broadcast once when DDP is built), earlier torch's broadcast_buffers (the GPU machines' 2.11; it skips
    that once too: every rank builds the same model and loads the same checkpoint)."""
    return "forward_sync_buffers" if "forward_sync_buffers" in _ddp_parameters() else "broadcast_buffers"


def buffer_sync(model: nn.Module, world_size: int) -> dict:
    """DDP's keyword argument for the broadcast of rank 0's buffers before each forward: off where
    `sync_bn.buffers_kept_equal`, since it is a collective and some four ops per buffer every step for values that
    are already equal (a toy AttFuse step on 2 ranks: 1,627 ops with it, 1,505 without); off at world size 1, where
    rank 0's buffers are the only ones (`torchrun --nproc_per_node=1` keeps plain batch norms, and DDP broadcast
    them to itself: 73 more calls in a captured full-size AttFuse step, tools/benchmarks/count_ddp_ops.py)."""
    return {buffer_sync_argument(): world_size > 1 and not buffers_kept_equal(model)}


def batched_copy() -> dict:
    """DDP's keyword argument that copies fresh gradients into a bucket together, where torch has it.

    Without it, each gradient that arrives while its bucket view is not its ``.grad`` (every step: the trainer
    sets gradients to None) is multiplied into the bucket by 1 / world size, one op per parameter; with it, one
    ``_foreach_copy_`` and one ``div_`` per bucket (a toy AttFuse step on 2 ranks: 30 ops fewer, V2X-ViT 169;
    tools/benchmarks/count_ddp_ops.py). The reduced values are the same at a world size that is a power of two,
    where x * (1 / n) and x / n round alike; at another they differ by at most one unit in the last place. A torch
    without the argument (the GPU machines' 2.11) keeps the copy per parameter."""
    return {"batched_grad_copy": True} if "batched_grad_copy" in _ddp_parameters() else {}


def wrap_ddp(model: nn.Module, find_unused_parameters: bool = False) -> DistributedDataParallel:
    """``model`` (its batch norms already converted: distributed/sync_bn.py) in DDP as the trainer runs it."""
    return DistributedDataParallel(model, device_ids=None, find_unused_parameters=find_unused_parameters,
                                   gradient_as_bucket_view=True, **buffer_sync(model, dist.get_world_size()),
                                   **batched_copy())


__all__ = ["batched_copy", "buffer_sync", "buffer_sync_argument", "wrap_ddp"]
