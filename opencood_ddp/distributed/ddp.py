"""The one place a model is wrapped in DistributedDataParallel: the trainer's (engine/trainer.py) and the zoo's
2-rank check (tests/workers/zoo_ddp_step_worker.py) wrap as this does.

What differs from DDP's defaults, and why (each is a cost per step in a GPU step bound by launches, issue 52):
- No ``device_ids``: DDP would move the batch again, and put the keys the task keeps on the host
  (data/device_points.HOST_KEYS) on the device, where every read of them stalls the step. The task's ``move_to``
  has put the rest where the module is.
- Rank 0's buffers are broadcast before each forward only where they can drift apart (`buffer_sync`).
- ``gradient_as_bucket_view``: each gradient is a view into DDP's all-reduce bucket, so the reduced bucket is
  not copied back into the gradients one parameter at a time (34 copies fewer in a toy AttFuse step). The
  gradients are set to None after each optimizer step (engine/trainer.optimizer_step); DDP then copies each fresh
  gradient into its bucket once and makes it the view again, as before.
"""
from __future__ import annotations

import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from opencood_ddp.distributed.sync_bn import buffers_kept_equal


def buffer_sync(model: nn.Module) -> dict:
    """DDP's keyword argument for the broadcast of rank 0's buffers before each forward: off where
    `sync_bn.buffers_kept_equal`, since it is a collective and some four ops per buffer every step for values that
    are already equal (a toy AttFuse step on 2 ranks: 1,627 ops with it, 1,505 without). torch 2.13 names it
    forward_sync_buffers (buffers are still broadcast once when DDP is built); earlier torch broadcast_buffers
    (which skips that once too: every rank builds the same model and loads the same checkpoint)."""
    keep = not buffers_kept_equal(model)
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": keep}
    return {"broadcast_buffers": keep}


def wrap_ddp(model: nn.Module, find_unused_parameters: bool = False) -> DistributedDataParallel:
    """``model`` (its batch norms already converted: distributed/sync_bn.py) in DDP as the trainer runs it."""
    return DistributedDataParallel(model, device_ids=None, find_unused_parameters=find_unused_parameters,
                                   gradient_as_bucket_view=True, **buffer_sync(model))


__all__ = ["buffer_sync", "wrap_ddp"]
