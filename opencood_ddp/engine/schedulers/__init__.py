"""Learning-rate schedulers from the hypes' ``lr_scheduler`` section, and when the fit loop moves them.

``lr_scheduler.core_method`` names an entry of ``opencood_ddp.registry.SCHEDULERS``. An entry declares when it
moves with ``interval``:

- ``interval="epoch"`` (the default): called as ``entry(section, optimizer) -> torch LRScheduler`` and stepped
  once after every epoch, so the lr of epoch ``e`` (0-based) is the scheduler's value after ``e`` steps;
- ``interval="step"``: called as ``entry(section, optimizer, steps_per_epoch)``, where ``steps_per_epoch`` is the
  number of optimizer steps of an epoch (the same at every world size for a fixed global batch; accumulated
  micro-batches are one step), and stepped after every optimizer step, so the lr of step ``k`` (0-based over the
  run) is its value after ``k`` steps.

Every module of this package is imported on the first lookup, so a new scheduler is one new file here (or a
user's module listed under ``imports:``). Upstream's names: ``multistep``, ``step``, ``exponential``
(``torch_schedulers.py``, per epoch) and ``cosineannealwarm`` (``cosine_warmup.py``, per optimizer step).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source
from opencood_ddp.registry import SCHEDULERS

PER_EPOCH, PER_STEP = "epoch", "step"
INTERVALS = (PER_EPOCH, PER_STEP)


@dataclass
class LrSchedule:
    """A torch scheduler and the interval it moves at; the fit loop calls both `after_` methods and the one
    that matches the interval steps the scheduler. Its state_dict is the scheduler's own."""

    scheduler: LRScheduler
    interval: str
    steps_per_epoch: int

    @property
    def per_step(self) -> bool:
        return self.interval == PER_STEP

    def after_optimizer_step(self) -> None:
        if self.per_step:
            self.scheduler.step()

    def after_epoch(self) -> None:
        if not self.per_step:
            self.scheduler.step()

    def steps_taken(self) -> int:
        """How often the scheduler has been stepped (torch keeps the count in ``last_epoch``)."""
        return int(self.scheduler.last_epoch)

    def steps_at(self, epoch: int, step_in_epoch: int = 0) -> int:
        """How often an uninterrupted run has stepped the scheduler when it reaches step `step_in_epoch` of epoch
        `epoch` (both 0-based)."""
        return epoch * self.steps_per_epoch + step_in_epoch if self.per_step else epoch

    def advance(self, steps: int) -> None:
        """Step the scheduler `steps` times without training (a resume that must find its place on the curve)."""
        with warnings.catch_warnings():
            # torch warns when a scheduler moves before any optimizer.step(); here that is the point.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(steps):
                self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


def build_scheduler(hypes: Mapping, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> Optional[LrSchedule]:
    """None when the hypes have no ``lr_scheduler`` section: the lr stays constant."""
    if not hypes.get("lr_scheduler"):
        return None
    entry = SCHEDULERS.lookup(hypes, hypes_source(hypes))
    interval = entry.meta.get("interval", PER_EPOCH)
    if interval not in INTERVALS:
        raise ConfigError(f"{hypes_source(hypes)}: lr scheduler {entry.name!r} is registered with interval="
                          f"{interval!r}; register it with interval='epoch' or interval='step'")
    extra = {"steps_per_epoch": steps_per_epoch} if interval == PER_STEP else {}
    try:
        scheduler = entry.obj(hypes["lr_scheduler"], optimizer, **extra)
    except (ValueError, TypeError, KeyError) as exc:  # what torch's schedulers raise on values out of range
        raise ConfigError(f"{hypes_source(hypes)}: lr_scheduler ({entry.name}) cannot be built from "
                          f"{dict(hypes['lr_scheduler'])} ({type(exc).__name__}: {exc}); fix lr_scheduler in the "
                          f"hypes") from None
    return LrSchedule(scheduler, interval, steps_per_epoch)


__all__ = ["LrSchedule", "build_scheduler", "PER_EPOCH", "PER_STEP"]
