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

_state = threading.local()


def cpu_kernels_enabled() -> bool:
    """Whether the CPU-only kernels may serve a CPU tensor now (False inside ``cuda_kernels_on_cpu``)."""
    return not getattr(_state, "cuda_path", False)


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
