"""The one protocol between the engine and a perception stack.

A task is built from hypes and hands the engine datasets with their collate functions, the model and a step
function that runs the model and the loss on one collated batch. The engine never looks inside a batch or a
model; a second implementation (an installed upstream opencood, a synthetic benchmark) plugs in by providing
a builder `build(hypes, for_training) -> Task`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass
class LossOutput:
    """total: the scalar to backpropagate, a mean over the samples of the local batch.

    parts: detached scalars for logging (e.g. cls and reg losses), also means over the local batch.
    """

    total: torch.Tensor
    parts: Mapping[str, torch.Tensor] = field(default_factory=dict)


class StepFn(Protocol):
    def __call__(self, model: nn.Module, batch: Any) -> LossOutput: ...


@dataclass
class Task:
    train_set: Optional[Dataset]
    val_set: Optional[Dataset]
    collate_train: Optional[Callable]
    collate_val: Optional[Callable]
    model: nn.Module
    step: StepFn
    batch_size_of: Callable[[Any], int]
    move_to: Callable[[Any, torch.device], Any]
    # For a model whose forward may leave parameters out of the step's graph while running them on empty inputs
    # (so that DDP needs no find_unused_parameters): parameter_use(model) -> [(parameters, used since the last
    # call)], the same groups in the same order on every rank, the record cleared. The fit loop gives the groups
    # no rank used grad None, as a graph without them would. None: every parameter is used in every step.
    parameter_use: Optional[Callable[[nn.Module], Sequence[Tuple[Sequence[nn.Parameter], bool]]]] = None
    # The loader workers per GPU rank that feed this task's step where fewer than the engine's default do (its
    # data path's per-sample cost, measured); None: engine/loaders.py's rule. --num_workers still wins.
    gpu_workers: Optional[int] = None


class TaskBuilder(Protocol):
    def __call__(self, hypes: dict, for_training: bool) -> Task: ...


def move_tensors(batch: Any, device: torch.device) -> Any:
    """Recursively move every tensor of a nested dict/list batch to `device` (non-tensors kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_tensors(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_tensors(value, device) for value in batch)
    return batch
