"""How a DataLoader worker hands a collated batch to the process that trains or evaluates.

PyTorch's workers put every tensor of a batch in its own shared-memory segment, and the receiving process
fetches each segment's file descriptor over a fresh, authenticated socket connection to the worker: a fixed
cost per tensor, on both sides, whatever the tensor's size. A cooperative-perception batch holds about ten
tensors, and all but the voxel or point arrays are a few hundred bytes (``record_len``, the pairwise
transforms, the box masks and targets of a small batch). Those are cheaper inside the pickled batch itself, so
a worker sends every CPU tensor of at most ``IN_BAND_BYTES`` as its bytes, and the receiver rebuilds a tensor of
the same dtype, shape and values. The large arrays still go through shared memory. docs/benchmarks.md has the
figures (``tools/benchmarks/benchmark_dataset.py`` uses this hand-over, as the engine does).

Only the hand-over changes: in the main process (``num_workers=0``) the collate's output is returned as it is.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import get_worker_info

IN_BAND_BYTES = 64 * 1024  # larger tensors (voxels, points, BEV labels of a big batch) keep shared memory


def _tensor_from_bytes(data: bytes, dtype: np.dtype, shape: tuple) -> torch.Tensor:
    # A bytearray is writable: on the read-only bytes themselves from_numpy would warn, and a write would fail.
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=dtype).reshape(shape))


class _InBand:
    """A small tensor on its way out of a worker: pickles as its bytes and unpickles as a plain tensor."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self):
        return _tensor_from_bytes, (self.array.tobytes(), self.array.dtype, self.array.shape)


def _in_band(tensor: torch.Tensor) -> Any:
    """The tensor marked for the pickled batch where it is small, plain and numpy can hold its dtype."""
    if (tensor.layout is not torch.strided or tensor.device.type != "cpu" or tensor.requires_grad
            or tensor.numel() * tensor.element_size() > IN_BAND_BYTES):
        return tensor
    try:
        # A view, copied once by tobytes() when pickled. A conjugate or negative view is made plain first
        # (numpy() refuses it, and PyTorch's shared-memory hand-over drops the conjugate bit).
        return _InBand(tensor.resolve_conj().resolve_neg().numpy())
    except TypeError:  # bfloat16 and other dtypes numpy lacks: shared memory as before
        return tensor


def _mark(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _in_band(value)
    if type(value) is dict:
        return {key: _mark(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_mark(item) for item in value)
    return value  # anything else travels as PyTorch sends it


class InBandSmallTensors:
    """A DataLoader ``collate_fn`` that wraps ``collate`` and, inside a worker, marks its small tensors to travel
    in the pickled batch (module doc). Picklable where ``collate`` is, for loaders that spawn their workers."""

    def __init__(self, collate: Callable[[list], Any]):
        self.collate = collate

    def __call__(self, samples: list) -> Any:
        batch = self.collate(samples)
        return _mark(batch) if get_worker_info() is not None else batch


__all__ = ["IN_BAND_BYTES", "InBandSmallTensors"]
