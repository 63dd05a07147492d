"""Where each CAV of a batch sits, from ``record_len``, computed where ``record_len`` lives.

A batch packs the CAVs of all its samples one after the other; ``record_len[b]`` counts sample b's, its ego
first. Our batches keep ``record_len`` and the other small per-sample keys on the host
(``data/device_points.HOST_KEYS``), so that what a model derives from them (the counts as Python ints, which row
is which sample's, which maps move) is host arithmetic: nothing in a GPU step's forward or backward waits for the
device. A batch whose ``record_len`` is on the device (upstream's way, or a test's) gives the same results; each
derivation then waits for the device once.

What the device needs goes there with ``to_device``: asynchronously, as the batch itself went (a blocking
host-to-device copy waits for the device's queue to drain).
"""
from __future__ import annotations

from typing import Tuple

import torch


def counts(record_len: torch.Tensor) -> Tuple[int, ...]:
    """record_len as Python ints."""
    return tuple(int(n) for n in record_len.tolist())


def maps_of_coords(coords: torch.Tensor) -> int:
    """How many maps a batch's voxel coordinates ([map, ...] rows) fill when neither ``record_len`` nor the labels
    say: the last map's index + 1, 1 without a voxel. One device read: the fallback of a batch that keeps neither."""
    return int(coords[:, 0].max().item()) + 1 if len(coords) else 1


def sample_and_slot(record_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum(record_len),) long each, on record_len's device: row r is CAV ``slot[r]`` of sample ``sample[r]``
    (slot 0 is the sample's ego)."""
    per_sample = record_len.to(dtype=torch.long)
    sample = torch.repeat_interleave(torch.arange(len(per_sample), device=per_sample.device), per_sample)
    slot = torch.arange(len(sample), device=per_sample.device) - (torch.cumsum(per_sample, 0) - per_sample)[sample]
    return sample, slot


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without waiting for it (``non_blocking``; a no-op where ``t`` already is)."""
    return t.to(device, non_blocking=True)


def device_constant(values, like: torch.Tensor) -> torch.Tensor:
    """``values`` (numbers, or nested lists of them) as a tensor of ``like``'s dtype on ``like``'s device, without
    waiting for the device: ``like.new_tensor(values)`` on a GPU is a blocking host-to-device copy, which drains the
    device's queue first. Built on the host and sent with ``to_device``. Where torch.compile traces it, it is
    ``new_tensor``: a constant of the captured graph, made once, with no host tensor in the graph."""
    if torch.compiler.is_compiling():
        return like.new_tensor(values)
    return to_device(torch.tensor(values, dtype=like.dtype), like.device)


__all__ = ["counts", "device_constant", "maps_of_coords", "sample_and_slot", "to_device"]
