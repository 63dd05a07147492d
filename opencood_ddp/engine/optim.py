"""Optimizer and lr scheduler from the hypes' `optimizer` and `lr_scheduler` sections (upstream's schema).

The schedulers are entries of the SCHEDULERS registry (`engine/schedulers/`); `build_scheduler` is theirs.
"""
from __future__ import annotations

from typing import Iterable

import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.engine.schedulers import build_scheduler
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
    except ValueError as exc:  # torch's own range checks: "Invalid learning rate: -0.1", "Invalid beta ..."
        key = "optimizer.lr" if "learning rate" in str(exc) else "optimizer.args"
        raise ConfigError(f"{key} rejected by torch.optim.{method} ({exc}); fix the hypes or --set {key}") from None


__all__ = ["build_optimizer", "build_scheduler"]
