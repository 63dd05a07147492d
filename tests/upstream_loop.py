"""Upstream's training loop (opencood/tools/train.py at 31ba160), replayed by hand from the fact sheet's section
"Upstream's training loop": the lr that each optimizer step runs with, for each of upstream's schedulers. The
tests compare our schedulers and the trainer's logged lr with it; nothing here calls our code.

- multistep, step, exponential: ``scheduler.step(epoch)`` at each epoch's start, torch's closed form.
- cosineannealwarm: timm's ``CosineLRScheduler(t_in_epochs=False)`` over update counts, set by
  ``step_update(epoch * n)`` at each epoch's start and ``step_update(epoch * n + i)`` after optimizer step ``i``.
"""
from __future__ import annotations

import math
from typing import Mapping


def closed_form_lr(section: Mapping, base_lr: float, epoch: int) -> float:
    """torch's MultiStepLR / StepLR / ExponentialLR at `epoch` (upstream's `scheduler.step(epoch)`)."""
    method, gamma = section["core_method"], section.get("gamma", 0.1)
    if method == "multistep":
        steps = section.get("step_size", [])
        milestones = steps if isinstance(steps, list) else [steps]
        return base_lr * gamma ** sum(1 for m in milestones if m <= epoch)
    if method == "step":
        return base_lr * gamma ** (epoch // section.get("step_size", 1))
    if method == "exponential":
        return base_lr * gamma ** epoch
    raise ValueError(f"no closed form for {method}")


def timm_cosine_lr(section: Mapping, base_lr: float, steps_per_epoch: int, t: int) -> float:
    """timm's CosineLRScheduler as upstream builds it: t_initial = epoches x n, warmup_t = warmup_epoches x n,
    warmup_lr_init = warmup_lr, one cycle, no warm-up prefix."""
    t_initial = section["epoches"] * steps_per_epoch
    warmup_t = section["warmup_epoches"] * steps_per_epoch
    if t < warmup_t:
        return section["warmup_lr"] + t * (base_lr - section["warmup_lr"]) / warmup_t
    if t < t_initial:
        return section["lr_min"] + 0.5 * (base_lr - section["lr_min"]) * (1 + math.cos(math.pi * t / t_initial))
    return section["lr_min"]


def upstream_step_lrs(section: Mapping, base_lr: float, steps_per_epoch: int, epochs: int) -> list[float]:
    """The lr of every optimizer step of `epochs` epochs of `steps_per_epoch` steps, as upstream's loop sets it.
    A run resumed at epoch E (from weights alone) goes through the same loop from E on: the same values."""
    cosine = section["core_method"] == "cosineannealwarm"
    lrs, lr = [], base_lr
    for epoch in range(epochs):
        # the epoch's start: scheduler.step(epoch), or step_update(epoch * num_steps + 0)
        lr = timm_cosine_lr(section, base_lr, steps_per_epoch, epoch * steps_per_epoch) if cosine else \
            closed_form_lr(section, base_lr, epoch)
        for i in range(steps_per_epoch):
            lrs.append(lr)  # forward, backward and optimizer.step() run with this lr
            if cosine:  # scheduler.step_update(epoch * num_steps + i), after optimizer step i
                lr = timm_cosine_lr(section, base_lr, steps_per_epoch, epoch * steps_per_epoch + i)
    return lrs
