"""Upstream's ``cosineannealwarm`` (V2X-ViT, CoBEVT and Where2comm configs), moved after every optimizer step.

Upstream builds timm's ``CosineLRScheduler`` over optimizer steps (``t_in_epochs=False``, one cycle, no warm-up
prefix) with ``n`` optimizer steps per epoch, ``t_initial = epoches * n``, ``warmup_t = warmup_epoches * n``,
``warmup_lr_init = warmup_lr`` and ``lr_min``. Over timm's update count ``t`` (``base`` the optimizer's lr):

- ``warmup_lr + t * (base - warmup_lr) / warmup_t`` while ``t < warmup_t``;
- ``lr_min + (base - lr_min) * (1 + cos(pi * t / t_initial)) / 2`` while ``t < t_initial``: the cosine runs over
  the whole schedule, warm-up included, so it starts below ``base``;
- ``lr_min`` from ``t_initial`` on.

Upstream's train.py sets ``t`` by ``step_update(epoch * n)`` at each epoch's start and by
``step_update(epoch * n + i)`` after optimizer step ``i`` (0-based) of the epoch. So steps 0 and 1 of an epoch
both run with ``t = epoch * n``, step ``i >= 1`` runs with ``t = epoch * n + i - 1``, and the value set after the
epoch's last step is never used. ``UpstreamCosineLR`` computes that ``t`` from its own count of optimizer steps,
so one ``step()`` after each optimizer step gives upstream's lr at every step, on any world size and with any
accumulation (the count is of optimizer steps, not micro-batches), and its state_dict is that count.
No timm is needed.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch.optim.lr_scheduler import LRScheduler

from opencood_ddp.engine.schedulers import PER_STEP
from opencood_ddp.errors import ConfigError
from opencood_ddp.registry import SCHEDULERS


def cosine_warmup_lr(t: int, base_lr: float, warmup_lr: float, warmup_t: int, t_initial: int, lr_min: float) -> float:
    """The lr at update count `t` (see the module docstring)."""
    if t < warmup_t:
        return warmup_lr + t * (base_lr - warmup_lr) / warmup_t
    if t < t_initial:
        return lr_min + 0.5 * (base_lr - lr_min) * (1 + math.cos(math.pi * t / t_initial))
    return lr_min


class UpstreamCosineLR(LRScheduler):
    """``cosineannealwarm`` stepped after every optimizer step; ``last_epoch`` (torch's name for a scheduler's
    count) is the number of optimizer steps taken. Only numbers are kept, so the state_dict restores the curve and
    the step exactly."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps_per_epoch: int, epoches: int, warmup_epoches: int,
                 warmup_lr: float, lr_min: float):
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, got {steps_per_epoch}")
        self.steps_per_epoch = int(steps_per_epoch)
        self.t_initial = int(epoches) * self.steps_per_epoch
        self.warmup_t = int(warmup_epoches) * self.steps_per_epoch
        self.warmup_lr, self.lr_min = float(warmup_lr), float(lr_min)
        super().__init__(optimizer)

    def update_count(self, step: int) -> int:
        """timm's ``t`` in force during optimizer step `step` (0-based over the run)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        return epoch * self.steps_per_epoch + max(i - 1, 0)

    def get_lr(self) -> list[float]:
        t = self.update_count(self.last_epoch)
        return [cosine_warmup_lr(t, base, self.warmup_lr, self.warmup_t, self.t_initial, self.lr_min)
                for base in self.base_lrs]


def check_cosine(hypes: Mapping, source: str) -> None:
    section = hypes["lr_scheduler"]
    if section["warmup_epoches"] < 0 or section["warmup_epoches"] > section["epoches"]:
        raise ConfigError(f"{source}: key lr_scheduler.warmup_epoches must be in [0, lr_scheduler.epoches "
                          f"({section['epoches']})], got {section['warmup_epoches']!r}; fix the hypes")
    for key in ("warmup_lr", "lr_min"):
        if not (math.isfinite(section[key]) and section[key] >= 0):
            raise ConfigError(f"{source}: key lr_scheduler.{key} must be a finite lr >= 0, got {section[key]!r}; "
                              f"fix the hypes")


@SCHEDULERS.register("cosineannealwarm", interval=PER_STEP, required=(
        ("lr_scheduler.epoches", "positive_int"), ("lr_scheduler.warmup_lr", "number"),
        ("lr_scheduler.warmup_epoches", "int"), ("lr_scheduler.lr_min", "number")), check=check_cosine)
def cosine_anneal_warm(section: Mapping, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> UpstreamCosineLR:
    return UpstreamCosineLR(optimizer, steps_per_epoch, section["epoches"], section["warmup_epoches"],
                            section["warmup_lr"], section["lr_min"])
