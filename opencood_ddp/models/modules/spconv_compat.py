"""spconv, imported only when a sparse model is built, with the two fixes its CPU path needs.

The rest of the package works without spconv's compiled sparse convolutions, so nothing imports them at module
level: ``load_spconv()`` does, and a missing or broken spconv is one ConfigError line. It also patches spconv's
``ops`` module (the functions the convolutions call), once per process, for two bugs of spconv 2.3's CPU path:

1. The backward asks torch for the current CUDA stream before it looks at where its tensors live, and uses the
   answer only on its CUDA path. A torch without CUDA (the CPU build, or a machine without a GPU) raises on that
   question ("Torch not compiled with CUDA enabled"), so no sparse convolution could be trained on CPU. The
   question now answers 0 (no stream) when CUDA is not available; where it is, nothing is patched.
2. ``SpconvOps.scatter_add_cpu``, which adds each kernel offset's products into the output (forward) and into
   the input gradient (backward), splits its rows over OpenMP threads but keeps the two row pointers in
   variables shared by all threads: with more than one thread, one thread adds its row into another's, so
   outputs are wrong at random voxels and differ from run to run. The same sums are now made by torch's
   accumulating ``index_put_``, which is exact and deterministic on CPU.

Both fixes touch the CPU path only: CUDA tensors never reach either.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from opencood_ddp.errors import ConfigError

NO_STREAM = 0  # what spconv's CPU path is handed instead of a CUDA stream handle (it never reads it)


def load_spconv(source: str = "model") -> ModuleType:
    """``spconv.pytorch`` with the CPU fixes applied, or one ConfigError saying how to get it."""
    try:
        import spconv.pytorch as spconv_torch
        from spconv.pytorch import ops
    except ImportError as exc:
        raise ConfigError(f"{source} needs spconv 2.x for its sparse 3-D convolutions, and it cannot be imported "
                          f"({exc}); install spconv (CPU) or the spconv-cuXXX wheel of your CUDA") from None
    patch_cpu_stream(ops)
    patch_cpu_scatter_add(ops)
    return spconv_torch


def patch_cpu_stream(ops: ModuleType) -> None:
    """Give spconv's ``ops`` a stream query that does not raise without CUDA (idempotent; nothing to do with CUDA)."""
    if torch.cuda.is_available() or getattr(ops.get_current_stream, "cpu_safe", False):
        return
    ops.get_current_stream = cpu_safe_stream(ops.get_current_stream)


def cpu_safe_stream(cuda_stream: Callable[[], int]) -> Callable[[], int]:
    """``cuda_stream`` where CUDA is available, ``NO_STREAM`` elsewhere."""

    def current_stream() -> int:
        return cuda_stream() if torch.cuda.is_available() else NO_STREAM

    current_stream.cpu_safe = True  # type: ignore[attr-defined]
    current_stream.original = cuda_stream  # type: ignore[attr-defined]
    return current_stream


def patch_cpu_scatter_add(ops: ModuleType) -> None:
    """Give spconv's ``ops`` a ``SpconvOps`` whose ``scatter_add_cpu`` has no data race (idempotent)."""
    if not isinstance(ops.SpconvOps, RaceFreeSpconvOps):
        ops.SpconvOps = RaceFreeSpconvOps(ops.SpconvOps)


class RaceFreeSpconvOps:
    """spconv's ``SpconvOps`` (a class of static functions) with ``scatter_add_cpu`` made by torch."""

    def __init__(self, spconv_ops: Any):
        self.original = spconv_ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    @staticmethod
    def scatter_add_cpu(out: Any, inp: Any, inds: Any) -> None:
        """out[inds[i]] += inp[i] for the first len(inds) rows of inp (tensorview CPU tensors, shared memory)."""
        rows = torch.from_numpy(inds.numpy_view()).long()
        source = torch.from_numpy(inp.numpy_view())[:rows.shape[0]]
        # index_put_ with accumulate runs serially on CPU (deterministic); it is 3-10x faster here than index_add_.
        torch.from_numpy(out.numpy_view()).index_put_((rows,), source, accumulate=True)


__all__ = ["load_spconv", "patch_cpu_stream", "cpu_safe_stream", "patch_cpu_scatter_add", "RaceFreeSpconvOps",
           "NO_STREAM"]
