"""Upstream's ``cosineannealwarm`` (V2X-ViT, CoBEVT and Where2comm configs), built on torch's ``LambdaLR``.

Upstream builds timm's ``CosineLRScheduler`` over optimizer steps (``t_initial = epoches * n``,
``warmup_t = warmup_epoches * n``, ``warmup_lr_init = warmup_lr``, ``lr_min``, one cycle, no warm-up prefix)
and moves it once per epoch, at step ``epoch * n`` (``step_update(epoch * num_steps)``). The steps per epoch
``n`` cancel out, so the lr of epoch ``e`` (0-based; ``base`` the optimizer's lr) is:

- ``warmup_lr + (base - warmup_lr) * e / warmup_epoches`` while ``e < warmup_epoches``;
- ``lr_min + (base - lr_min) * (1 + cos(pi * e / epoches)) / 2`` while ``e < epoches``: the cosine runs
  over the whole schedule, warm-up included, so it starts below ``base`` (timm's shape without a prefix);
- ``lr_min`` from epoch ``epoches`` on.

Stepping once per epoch, as every scheduler here, gives exactly these values; no timm is needed.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch.optim.lr_scheduler import LambdaLR

from opencood_ddp.errors import ConfigError
from opencood_ddp.registry import SCHEDULERS


class CosineWarmupFactor:
    """``factor(epoch)``: the lr of that epoch over the base lr. A class, not a closure, so that LambdaLR's
    state_dict keeps its settings and a resumed run rebuilds the same curve."""

    def __init__(self, base_lr: float, epoches: int, warmup_lr: float, warmup_epoches: int, lr_min: float):
        self.base_lr, self.epoches, self.warmup_lr = float(base_lr), int(epoches), float(warmup_lr)
        self.warmup_epoches, self.lr_min = int(warmup_epoches), float(lr_min)

    def lr(self, epoch: int) -> float:
        if epoch < self.warmup_epoches:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * epoch / self.warmup_epoches
        if epoch < self.epoches:
            return self.lr_min + 0.5 * (self.base_lr - self.lr_min) * (1 + math.cos(math.pi * epoch / self.epoches))
        return self.lr_min

    def __call__(self, epoch: int) -> float:
        return self.lr(epoch) / self.base_lr


def check_cosine(hypes: Mapping, source: str) -> None:
    section = hypes["lr_scheduler"]
    if section["warmup_epoches"] < 0 or section["warmup_epoches"] > section["epoches"]:
        raise ConfigError(f"{source}: key lr_scheduler.warmup_epoches must be in [0, lr_scheduler.epoches "
                          f"({section['epoches']})], got {section['warmup_epoches']!r}; fix the hypes")
    for key in ("warmup_lr", "lr_min"):
        if not (math.isfinite(section[key]) and section[key] >= 0):
            raise ConfigError(f"{source}: key lr_scheduler.{key} must be a finite lr >= 0, got {section[key]!r}; "
                              f"fix the hypes")


@SCHEDULERS.register("cosineannealwarm", required=(
        ("lr_scheduler.epoches", "positive_int"), ("lr_scheduler.warmup_lr", "number"),
        ("lr_scheduler.warmup_epoches", "int"), ("lr_scheduler.lr_min", "number")), check=check_cosine)
def cosine_anneal_warm(section: Mapping, optimizer: torch.optim.Optimizer) -> LambdaLR:
    group = optimizer.param_groups[0]
    base_lr = group.get("initial_lr", group["lr"])  # the lr before any scheduler moved it
    if base_lr <= 0:
        raise ConfigError(f"lr_scheduler cosineannealwarm needs a positive optimizer.lr, got {base_lr!r}; fix the "
                          f"hypes")
    factor = CosineWarmupFactor(base_lr, section["epoches"], section["warmup_lr"], section["warmup_epoches"],
                                section["lr_min"])
    return LambdaLR(optimizer, lr_lambda=factor)
