"""Upstream's plain schedulers, each one of torch's: multistep, step and exponential (``gamma`` 0.1 when absent)."""
from __future__ import annotations

from typing import Mapping

import torch
from torch.optim.lr_scheduler import ExponentialLR, MultiStepLR, StepLR

from opencood_ddp.errors import ConfigError
from opencood_ddp.registry import SCHEDULERS

_GAMMA = ("lr_scheduler.gamma", "positive_number")  # 0 stops the training, < 0 ascends


def _milestones(section: Mapping) -> list:
    """``step_size`` of multistep: a list of epochs, or one epoch (upstream accepts both)."""
    value = section.get("step_size", [])
    return value if isinstance(value, list) else [value]


def check_milestones(hypes: Mapping, source: str) -> None:
    milestones = _milestones(hypes["lr_scheduler"])
    if not all(isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in milestones):
        raise ConfigError(f"{source}: key lr_scheduler.step_size must be an epoch or a list of epochs (integers "
                          f">= 0) for multistep, got {hypes['lr_scheduler'].get('step_size')!r}; fix the hypes")


@SCHEDULERS.register("multistep", optional=(_GAMMA, ("lr_scheduler.step_size", "any")), check=check_milestones)
def multistep(section: Mapping, optimizer: torch.optim.Optimizer) -> MultiStepLR:
    return MultiStepLR(optimizer, milestones=_milestones(section), gamma=section.get("gamma", 0.1))


@SCHEDULERS.register("step", optional=(_GAMMA, ("lr_scheduler.step_size", "positive_int")))
def step(section: Mapping, optimizer: torch.optim.Optimizer) -> StepLR:
    return StepLR(optimizer, step_size=section.get("step_size", 1), gamma=section.get("gamma", 0.1))


@SCHEDULERS.register("exponential", optional=(_GAMMA,))
def exponential(section: Mapping, optimizer: torch.optim.Optimizer) -> ExponentialLR:
    return ExponentialLR(optimizer, gamma=section.get("gamma", 0.1))
