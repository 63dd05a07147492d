"""Optimizer and lr scheduler from the hypes' `optimizer` and `lr_scheduler` sections (upstream's schema)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.optim.lr_scheduler import ExponentialLR, LRScheduler, MultiStepLR, StepLR

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key


def build_optimizer(hypes: dict, parameters: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """`optimizer.core_method` names a torch.optim class (Adam, SGD, AdamW...); `lr` is the plan's effective lr."""
    method = hypes["optimizer"]["core_method"]
    cls = getattr(torch.optim, method, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.core_method {method!r} is not a torch.optim optimizer; use e.g. Adam or SGD")
    args = dict(get_key(hypes, "optimizer.args", {}) or {})
    try:
        return cls(parameters, lr=lr, **args)
    except TypeError as exc:
        raise ConfigError(f"optimizer.args {args} do not fit {method} ({exc}); fix the hypes") from None


def build_scheduler(hypes: dict, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """Stepped once per epoch: multistep (step_size = milestones), step (step_size = period), exponential."""
    section = hypes.get("lr_scheduler")
    if not section:
        return None
    method = section.get("core_method")
    gamma = section.get("gamma", 0.1)
    if method == "multistep":
        milestones = section.get("step_size", [])
        milestones = milestones if isinstance(milestones, list) else [milestones]
        return MultiStepLR(optimizer, milestones=milestones, gamma=gamma)
    if method == "step":
        return StepLR(optimizer, step_size=section.get("step_size", 1), gamma=gamma)
    if method == "exponential":
        return ExponentialLR(optimizer, gamma=gamma)
    raise ConfigError(f"lr_scheduler.core_method {method!r} is not supported; use multistep, step or exponential")
