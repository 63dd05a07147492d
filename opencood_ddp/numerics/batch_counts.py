"""The batch norms' batch counts of a training forward, added for all layers at once.

torch's batch-norm modules add 1 to their ``num_batches_tracked`` in every training forward: a kernel launch per
layer (23 in the full-size AttFuse), which a GPU step bound by the host's launches pays at the baselines' small
per-GPU batches (issue 52). With a momentum (every zoo model's) nothing in the step reads the count; it is state,
saved in checkpoints under upstream's names. Inside `counts_added_together` (engine/step.py's forward_backward:
the fit loop's forward and loss) the project's batch norms (numerics/batch_norm.py, distributed/device_sync_bn.py)
leave their count to the block's end, where one foreach add per device, dtype and number of calls adds them all.
When the block ends every count is what torch's per-layer adds give, the same integers.

Left to the layer, as torch does it: a count the layer reads (momentum None, a cumulative average), a forward
being traced (torch.compile: inside a graph the add costs no launch of its own), and any forward outside the
block (the trainer's validation is in eval mode and counts nothing).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


class _Pending(threading.local):
    """The counts of the block open on this thread: None outside one."""

    def __init__(self):
        self.counters: list | None = None


_PENDING = _Pending()


def left_to_the_block(layer: nn.Module) -> bool:
    """Whether `layer`'s count of this training forward is added at the end of the open block (then the layer adds
    nothing). Ask it only where the layer would add its count now."""
    counters = _PENDING.counters
    if counters is None or layer.momentum is None or torch.compiler.is_compiling():
        return False
    counters.append(layer.num_batches_tracked)
    return True


def batch_norm_counted_later(layer: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """torch's training forward of `layer` (running statistics, batch statistics, the momentum) where its count is
    left to the open block; None where the layer adds its own count (then it runs its own forward)."""
    if not (layer.training and layer.track_running_stats and layer.num_batches_tracked is not None
            and left_to_the_block(layer)):
        return None
    return F.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias, True, layer.momentum,
                        layer.eps)


@contextlib.contextmanager
def counts_added_together() -> Iterator[None]:
    """The training forwards inside it leave their batch counts to its end (`left_to_the_block`); a block inside
    another leaves them to the outer one's end. They are added on an exception too: each layer that ran counted
    its batch, as it would have by itself."""
    if _PENDING.counters is not None:
        yield
        return
    _PENDING.counters = []
    try:
        yield
    finally:
        counters, _PENDING.counters = _PENDING.counters, None
        add_counts(counters)


def add_counts(counters: list[torch.Tensor]) -> None:
    """Each counter plus the number of times it is listed: one foreach add per (device, dtype, times). A layer called
    twice in a forward is listed twice, and one foreach kernel given a tensor twice would read it twice before
    writing it, so it gets one add of 2."""
    times: dict[int, list] = {}  # by id: a tensor's == compares values
    for counter in counters:
        times.setdefault(id(counter), [counter, 0])[1] += 1
    groups: dict[tuple, list[torch.Tensor]] = {}
    for counter, calls in times.values():
        groups.setdefault((counter.device, counter.dtype, calls), []).append(counter)
    with torch.no_grad():
        for (_, _, calls), group in groups.items():
            torch._foreach_add_(group, calls)


__all__ = ["add_counts", "batch_norm_counted_later", "counts_added_together", "left_to_the_block"]
