"""The ReLU that follows a BatchNorm."""
from __future__ import annotations

from torch import nn


def relu_after_norm() -> nn.ReLU:
    """A ReLU written over the BatchNorm's output. BatchNorm keeps its input for the backward, not its output, and
    the ReLU's backward reads its own result, so in place is exact (the same bits, forward and backward) and saves
    one fresh activation per layer: on the CPU each fresh large activation page-faults in at every step
    (docs/benchmarks.md). Use it only where the norm's output goes to nothing but this ReLU."""
    return nn.ReLU(inplace=True)
