"""Optimizer and lr scheduler from the hypes' `optimizer` and `lr_scheduler` sections (upstream's schema).

The update's kernels (`kernel_args`): on CUDA one fused kernel per step where torch has one for the class (Adam,
AdamW, SGD, Adagrad), else torch's foreach kernels; a step of the baselines' models otherwise launches a dozen
kernels per parameter tensor. On the CPU torch's default (one tensor at a time) keeps the CPU's figures as they
were. `optimizer.args` naming `fused` or `foreach` wins. A resumed optimizer state carries the saving run's
choice, so `load_optimizer_state` keeps this run's.

The schedulers are entries of the SCHEDULERS registry (`engine/schedulers/`); `build_scheduler` is theirs.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Iterable, Union

import torch

from opencood_ddp.errors import ConfigError
from opencood_ddp.engine.schedulers import build_scheduler
from opencood_ddp.hypes import get_key


KERNEL_KEYS = ("fused", "foreach")


def kernel_args(cls: type, device_type: str) -> dict:
    """The update's kernels for `cls` on `device_type`: {"fused": True} on CUDA where the class has a fused
    kernel, else {"foreach": True} there; {} on the CPU (torch's default)."""
    if device_type != "cuda":
        return {}
    parameters = inspect.signature(cls.__init__).parameters
    if "fused" in parameters:
        return {"fused": True}
    return {"foreach": True} if "foreach" in parameters else {}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, keeping this run's kernels: the saved groups carry the saving run's
    `fused`/`foreach` (a GPU's, the CPU's, or none from an older torch or upstream's checkpoints), and torch's load
    takes them over."""
    chosen = [{key: group[key] for key in KERNEL_KEYS if key in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kernels in zip(optimizer.param_groups, chosen):
        group.update(kernels)


def optimizer_class(hypes: dict) -> type:
    """The torch.optim class `optimizer.core_method` names (Adam, SGD, AdamW...)."""
    method = hypes["optimizer"]["core_method"]
    cls = getattr(torch.optim, method, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = {name.lower(): name for name, value in vars(torch.optim).items()
                 if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
                 and value is not torch.optim.Optimizer}
        close = difflib.get_close_matches(str(method).lower(), list(names), n=1)  # case-blind: 'Adamw' is AdamW
        hint = f" (did you mean {names[close[0]]}?)" if close else ""
        raise ConfigError(f"optimizer.core_method {method!r} is not a torch.optim optimizer{hint}; use e.g. Adam "
                          f"or SGD")
    return cls


def build_optimizer(hypes: dict, parameters: Iterable[torch.nn.Parameter], lr: float,
                    kernels_for: Union[str, torch.device] = "cpu") -> torch.optim.Optimizer:
    """`optimizer.core_method`'s optimizer over `parameters`; `lr` is the plan's effective lr. The update runs the
    kernels `kernel_args` picks for the device type `kernels_for` (the parameters' device; "cuda" on CPU
    parameters counts what a GPU step dispatches), unless `optimizer.args` picks them."""
    cls, method = optimizer_class(hypes), hypes["optimizer"]["core_method"]
    args = dict(get_key(hypes, "optimizer.args", {}) or {})
    if not any(key in args for key in KERNEL_KEYS):
        args.update(kernel_args(cls, torch.device(kernels_for).type))
    try:
        return cls(parameters, lr=lr, **args)
    except TypeError as exc:
        raise ConfigError(f"optimizer.args {args} do not fit {method} ({exc}); fix the hypes") from None
    except (ValueError, IndexError) as exc:  # torch's checks ("Invalid learning rate: -0.1"); betas: [0.9]
        key = "optimizer.lr" if "learning rate" in str(exc) else "optimizer.args"
        raise ConfigError(f"{key} rejected by torch.optim.{method} ({exc}); fix the hypes or --set {key}") from None


__all__ = ["build_optimizer", "build_scheduler", "kernel_args", "load_optimizer_state",
           "optimizer_class"]
