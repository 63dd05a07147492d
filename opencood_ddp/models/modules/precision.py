"""Full-precision islands under ``--half`` (autocast to float16 on CUDA, bfloat16 on the CPU).

Autocast runs matrix products in 16 bits. These places must not:
- **sampling grids** (the ego warp, V2VNet's pairwise warp, V2X-ViT's STTF): ``affine_grid`` is a matrix product,
  and float16 grid coordinates in [-1, 1] are 2^-11 apart, a shift of 0.1 to 0.2 cell on a 700-cell map;
- **attention logits** (AttFuse, CoBEVT, V2X-ViT): a dot product of C-vectors overflows float16's 65504 long before
  the softmax (which autocast already runs in float32) sees it;
- **the pillar VFE's BatchNorm**, whose input can be empty (a rank whose batch has no pillar): torch's
  SyncBatchNorm built that rank's statistics in the input's dtype, float16, while the other ranks send float32,
  and the gather mismatched (``distributed/device_sync_bn.py``, which replaced it on CUDA, sends float32 itself;
  the island stays for a model run with torch's). SECOND's sparse BatchNorms, the others an empty batch reaches,
  take the island only when empty (``sparse_backbone._batch_norm``);
- **the pillar VFE's Linear** before it: its inputs are point coordinates in metres, which bfloat16 holds 0.5 m
  apart at 100 m, more than a pillar's width. In float32 it also spares the step the casts of its input and weight
  and of its output back to float32 for the BatchNorm.

`in_full_precision(fn, *tensors)` runs ``fn`` with autocast off and 16-bit float inputs upcast to float32 (float32
and float64 inputs kept, so the float64 model tests run in float64). Without autocast and with full-precision
inputs it calls ``fn`` as it is: a float32 run is bit for bit the one without islands.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from opencood_ddp.numerics.autocast import HALF_DTYPES, autocast_enabled, autocast_off

T = TypeVar("T")


def in_full_precision(fn: Callable[..., T], *tensors: torch.Tensor) -> T:
    device_type = tensors[0].device.type
    autocast = autocast_enabled(device_type)
    if not autocast and not any(t.dtype in HALF_DTYPES for t in tensors):
        return fn(*tensors)
    with autocast_off(device_type):
        return fn(*(t.float() if t.dtype in HALF_DTYPES else t for t in tensors))
