"""Hypes sizes no run on this machine can hold, refused in one line that names the key.

A few keys size memory that is taken whole: the voxelizer's buffers (``preprocess.args.max_voxel_train`` or
``max_voxel_test`` times ``max_points_per_voxel``), each sample's padded ground truth (``postprocess.max_num``),
intermediate fusion's CAV-by-CAV transforms (``train_params.max_cav`` squared), and the model's parameters (the
widths under ``model.args``). A value whose buffer is larger than the machine's physical memory can only fail: as
an allocation error deep inside spconv, numpy or torch, in a loader worker or the model's constructor, or, where
the kernel overcommits, by the OOM killer. Upstream fails those ways. The data side is counted before anything is
allocated (`refuse_beyond_memory`). The model's parameters are not counted in advance: that would mean building
the model twice (on the meta device, where some modules' index buffers pull in torch's reference kernels, seconds
per process); an allocation torch refuses while building it becomes the same one line instead
(`models.create_model`, naming the largest size under ``model.args``). Where the kernel overcommits, a model
that fits the address space but not the memory is still the OOM killer's.

What does fit is not judged here: how much of the memory a run may spend, with its batch and workers, is the batch
planner's question (``distributed/batch_plan.py``). Counts that repeat a block are bounded by the hypes kind
"count" (``hypes.MAX_REPEATS``): 10**9 of them run out of time, not memory.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Iterator, Mapping, NamedTuple

from opencood_ddp.errors import ConfigError

GIB = 1 << 30


class Buffer(NamedTuple):
    """Memory a setting takes whole: what it is, its bytes, the keys (with their values) that size it, and what
    to do about them."""

    what: str
    nbytes: int
    keys: str
    fix: str = "lower it"


def physical_memory() -> int:
    """This machine's physical memory in bytes (what a process can ever hold without swap)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def refuse_beyond_memory(source: str, buffers: Iterable[Buffer]) -> None:
    """A ConfigError naming the first buffer larger than this machine's physical memory, and its keys."""
    memory = physical_memory()
    for buffer in buffers:
        if buffer.nbytes > memory:
            raise ConfigError(f"{source}: {buffer.keys}: {buffer.what} would take {gib(buffer.nbytes)}, more than "
                              f"this machine's {gib(memory)} of memory; {buffer.fix}; fix the hypes")


def int_leaves(node: object, prefix: str) -> Iterator[tuple[str, int]]:
    """(dotted key, value) of every integer under ``node``, list entries as ``key[i]``."""
    if isinstance(node, Mapping):
        for name, value in node.items():
            yield from int_leaves(value, f"{prefix}.{name}" if prefix else str(name))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from int_leaves(value, f"{prefix}[{index}]")
    elif isinstance(node, int) and not isinstance(node, bool):
        yield prefix, node


def largest_size(node: Mapping, prefix: str) -> str:
    """``key (value)`` of the largest integer under ``node``, the likeliest cause of a model that does not fit."""
    leaves = list(int_leaves(node, prefix))
    if not leaves:
        return f"the sizes under {prefix}"
    key, value = max(leaves, key=lambda leaf: leaf[1])
    return f"{key} ({value})"


# torch's CPU allocator and numpy say how much they were asked for; a CUDA OOM has its own type
_ASKED = re.compile(r"allocate (?:memory: you tried to allocate )?([\d.]+) ?(bytes|GiB|TiB|MiB)?")
_UNITS = {"bytes": 1, None: 1, "MiB": 1 << 20, "GiB": GIB, "TiB": 1 << 40}


# torch's words for a CPU allocation it refused, and for a size whose bytes overflow 64 bits
_TOO_LARGE = ("can't allocate memory", "Storage size calculation overflowed")


def is_allocation_failure(exc: BaseException) -> bool:
    """numpy's MemoryError, torch's CPU allocator's refusal or overflow, or a CUDA out-of-memory error."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and any(words in str(exc) for words in _TOO_LARGE))


def asked_for(exc: BaseException) -> str:
    """How much the refused allocation asked for, as the allocator said it ("" when it did not say)."""
    found = _ASKED.search(str(exc))
    return f" of {gib(float(found.group(1)) * _UNITS[found.group(2)])}" if found else ""


__all__ = ["Buffer", "asked_for", "gib", "int_leaves", "is_allocation_failure", "largest_size",
           "physical_memory", "refuse_beyond_memory"]
