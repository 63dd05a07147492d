"""When DDP broadcasts rank 0's buffers before each forward (distributed/ddp.buffer_sync).

Upstream's DDP broadcasts every buffer before every forward. With synchronized batch norm that is a collective and
some four ops per buffer each step for values every rank already holds: SyncBatchNorm's running statistics are the
global batch's, the same arithmetic on the same gathered numbers on every rank, and the zoo's other buffers are
index tables made at construction (``constant_buffers``). So the trainer turns the broadcast off exactly when every
buffer is one of those, or when there is one rank; that the ranks' buffers then stay equal is proven on real processes
(tests/workers/zoo_ddp_step_worker.py's ``buffers_equal``, from test_zoo_contracts.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from opencood_ddp.distributed.ddp import buffer_sync, buffer_sync_argument
from opencood_ddp.distributed.sync_bn import buffers_kept_equal, convert_sync_batchnorm
from zoo import hypes_of

# AttFuse (batch norm only), CoBEVT and V2X-ViT (their index tables), SECOND (spconv's BatchNorm1d).
CONFIGS = ["toy/point_pillar_intermediate_fusion", "toy/point_pillar_cobevt", "toy/point_pillar_v2xvit",
           "toy/second_intermediate_fusion"]


@pytest.mark.parametrize("config", CONFIGS)
def test_with_sync_bn_no_zoo_buffer_is_broadcast_and_without_it_rank_0s_are(toy_small, config):
    from opencood_ddp.tasks import build_task

    model = build_task(hypes_of(config, toy_root=toy_small), for_training=True).model
    assert any(True for _ in model.buffers())
    synced, kind = convert_sync_batchnorm(model, 2, "cpu")
    assert kind == "GlooSyncBatchNorm" and buffers_kept_equal(synced)
    assert buffer_sync(synced, 2) == {buffer_sync_argument(): False}
    plain, kind = convert_sync_batchnorm(build_task(hypes_of(config, toy_root=toy_small), for_training=True).model,
                                         2, "cpu", enabled=False)  # --no_sync_bn: each rank's own statistics
    assert kind is None and not buffers_kept_equal(plain)
    assert buffer_sync(plain, 2) == {buffer_sync_argument(): True}
    # one rank: its buffers are rank 0's, and DDP would broadcast them to itself (a run on 1 GPU keeps plain ones)
    alone, kind = convert_sync_batchnorm(build_task(hypes_of(config, toy_root=toy_small), for_training=True).model,
                                         1, "cpu")
    assert kind is None and buffer_sync(alone, 1) == {buffer_sync_argument(): False}


class _Counter(nn.Module):
    """A user's model with a buffer of its own that training changes (a count of the samples seen)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("seen", torch.zeros(()))


def test_a_buffer_nobody_declared_constant_is_broadcast():
    model, _ = convert_sync_batchnorm(_Counter(), 2, "cpu")
    assert not buffers_kept_equal(model)
    model.constant_buffers = ("seen",)  # the module's own declaration is what counts
    assert buffers_kept_equal(model)


def test_the_argument_is_one_this_torchs_ddp_takes():
    """torch 2.13 renamed broadcast_buffers to forward_sync_buffers; the GPU machines' torch 2.11 has the old name
    only. The argument must be one that DDP's constructor takes, whichever torch runs."""
    import inspect

    assert buffer_sync_argument() in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
