"""Which kernels serve a CPU tensor: the CPU-only ones of this package, or the ones CUDA runs.

On the CPU three layers take kernels of their own, for accuracy or speed there: batch norm's float64 statistics
(``batch_norm.py``), the hashed dropout (``dropout.py``) and CoBEVT's attention one head at a time
(``models/modules/biased_attention.py``). On CUDA the same layers run torch's native kernels. Counting what a
CUDA step dispatches (``engine/census.py``) needs that path on a machine without a GPU, so ``cuda_kernels_on_cpu``
makes the three choose as they do on CUDA, for the calls made inside it. Nothing else changes: the results are
torch's native ones, as on a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_state = threading.local()


def cpu_kernels_enabled() -> bool:
    """Whether the CPU-only kernels may serve a CPU tensor now (False inside ``cuda_kernels_on_cpu``)."""
    return not getattr(_state, "cuda_path", False)


def takes_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether `x` is served by the CPU-only kernels now: a CPU tensor outside ``cuda_kernels_on_cpu``."""
    return x.device.type == "cpu" and cpu_kernels_enabled()


def maps_for_kernels(x: torch.Tensor) -> torch.Tensor:
    """A (N, C, H, W) map in the layout its path's kernels take: as it is for the CPU-only kernels (the accurate
    batch norm reads each cell's channels as one row: channels-last), contiguous NCHW on the CUDA path, where a
    convolution over a channels-last map gives its weight a channels-last gradient that AccumulateGrad copies into
    the weight's layout, and DDP's buckets warn of the mismatch (the H200's gpu_check, 2026-11-30: V2VNet's heads)."""
    return x if takes_cpu_kernels(x) else x.contiguous()


@contextlib.contextmanager
def cuda_kernels_on_cpu() -> Iterator[None]:
    """CPU tensors take the kernels CUDA takes (torch's native ones) for the calls made inside; re-entrant.
    Autograd runs a backward on the thread that called it for CPU tensors, so the backward of a step inside
    sees the same choice."""
    before = getattr(_state, "cuda_path", False)
    _state.cuda_path = True
    try:
        yield
    finally:
        _state.cuda_path = before
