"""BatchPlan: how a baseline's batch is split over processes and micro-steps.

With the default `global` semantics the hypes' `train_params.batch_size` is the baseline's effective batch
whatever the world size: global = world_size x per_rank x accumulation, and the lr is the hypes' lr. The
`per_gpu` semantics reproduce upstream OpenCOOD-family scripts (the batch is per GPU, so the effective batch
grows with the GPU count) and may scale the lr with `scale_lr`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, Optional, get_args

from opencood_ddp.errors import ConfigError

Semantics = Literal["global", "per_gpu"]
LrScaling = Literal["none", "linear", "sqrt"]
SEMANTICS: tuple = get_args(Semantics)
LR_SCALINGS: tuple = get_args(LrScaling)


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    per_rank: int
    accumulation: int
    global_batch: int
    semantics: str
    base_lr: float
    lr_scaling: str
    effective_lr: float

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"batch plan: {self.world_size} process(es) x {self.per_rank} per rank x "
                f"{self.accumulation} accumulation step(s) = effective batch {self.global_batch} "
                f"({self.semantics} semantics); lr {self.effective_lr:g} "
                f"(base {self.base_lr:g}, scaling {self.lr_scaling})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _impossible_split(batch_size: int, world_size: int, per_gpu_batch: Optional[int]) -> ConfigError:
    worlds = _divisors(batch_size)
    if per_gpu_batch is None:
        what = f"train_params.batch_size {batch_size} cannot be split evenly over {world_size} processes"
        fix = (f"use a world size in {worlds}, or --batch_semantics per_gpu to keep {batch_size} per process "
               f"(upstream behaviour, effective batch {batch_size * world_size})")
    else:
        per_gpu_ok = [b for b in _divisors(batch_size) if batch_size % (b * world_size) == 0]
        what = (f"train_params.batch_size {batch_size} cannot be split into {world_size} processes x "
                f"--per_gpu_batch {per_gpu_batch} x whole accumulation steps")
        fix = (f"use --per_gpu_batch in {per_gpu_ok or 'none (change the world size)'} at world size {world_size}, "
               f"or a world size in {worlds}")
    return ConfigError(f"{what}; {fix}")


def _lr_factor(scaling: str, world_size: int) -> float:
    return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[scaling]


def make_batch_plan(batch_size: int, world_size: int, base_lr: float, per_gpu_batch: Optional[int] = None,
                    semantics: str = "global", lr_scaling: str = "none") -> BatchPlan:
    """Split `batch_size` over `world_size` processes, raising ConfigError with workable choices if impossible."""
    if semantics not in SEMANTICS:
        raise ConfigError(f"--batch_semantics {semantics!r} is unknown; use one of {list(SEMANTICS)}")
    if lr_scaling not in LR_SCALINGS:
        raise ConfigError(f"--scale_lr {lr_scaling!r} is unknown; use one of {list(LR_SCALINGS)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"train_params.batch_size must be a positive integer, got {batch_size!r}; fix the hypes")
    if per_gpu_batch is not None and per_gpu_batch < 1:
        raise ConfigError(f"--per_gpu_batch must be a positive integer, got {per_gpu_batch}")
    if semantics == "global":
        if lr_scaling != "none":
            raise ConfigError("--scale_lr applies only with --batch_semantics per_gpu: with global semantics "
                              "the effective batch, and so the baseline's lr, does not change with the GPU count")
        return _global_plan(batch_size, world_size, base_lr, per_gpu_batch)
    return _per_gpu_plan(batch_size, world_size, base_lr, per_gpu_batch, lr_scaling)


def _global_plan(batch_size: int, world_size: int, base_lr: float, per_gpu_batch: Optional[int]) -> BatchPlan:
    per_rank = per_gpu_batch if per_gpu_batch is not None else batch_size // world_size
    if per_rank < 1 or batch_size % (per_rank * world_size) != 0:
        raise _impossible_split(batch_size, world_size, per_gpu_batch)
    accumulation = batch_size // (per_rank * world_size)
    return BatchPlan(world_size=world_size, per_rank=per_rank, accumulation=accumulation, global_batch=batch_size,
                     semantics="global", base_lr=base_lr, lr_scaling="none", effective_lr=base_lr)


def _per_gpu_plan(batch_size: int, world_size: int, base_lr: float, per_gpu_batch: Optional[int],
                  lr_scaling: str) -> BatchPlan:
    # Upstream semantics: batch_size per process. --per_gpu_batch then only trades memory for accumulation.
    per_rank = per_gpu_batch if per_gpu_batch is not None else batch_size
    if batch_size % per_rank != 0:
        raise ConfigError(f"--per_gpu_batch {per_gpu_batch} does not divide the per-GPU train_params.batch_size "
                          f"{batch_size}; use one of {_divisors(batch_size)}")
    return BatchPlan(world_size=world_size, per_rank=per_rank, accumulation=batch_size // per_rank,
                     global_batch=batch_size * world_size, semantics="per_gpu", base_lr=base_lr,
                     lr_scaling=lr_scaling, effective_lr=base_lr * _lr_factor(lr_scaling, world_size))
