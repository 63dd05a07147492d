"""Learning-rate schedulers from the hypes' ``lr_scheduler`` section, stepped once per epoch.

``lr_scheduler.core_method`` names an entry of ``opencood_ddp.registry.SCHEDULERS``, called as
``entry(section, optimizer) -> torch LRScheduler``. Every module of this package is imported on the first
lookup, so a new scheduler is one new file here (or a user's module listed under ``imports:``). Upstream's
names: ``multistep``, ``step``, ``exponential`` (``torch_schedulers.py``) and ``cosineannealwarm``
(``cosine_warmup.py``).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source
from opencood_ddp.registry import SCHEDULERS


def build_scheduler(hypes: Mapping, optimizer: torch.optim.Optimizer) -> Optional[LRScheduler]:
    """None when the hypes have no ``lr_scheduler`` section: the lr stays constant."""
    if not hypes.get("lr_scheduler"):
        return None
    entry = SCHEDULERS.lookup(hypes, hypes_source(hypes))
    try:
        return entry.obj(hypes["lr_scheduler"], optimizer)
    except (ValueError, TypeError, KeyError) as exc:  # what torch's schedulers raise on values out of range
        raise ConfigError(f"{hypes_source(hypes)}: lr_scheduler ({entry.name}) cannot be built from "
                          f"{dict(hypes['lr_scheduler'])} ({type(exc).__name__}: {exc}); fix lr_scheduler in the "
                          f"hypes") from None


__all__ = ["build_scheduler"]
