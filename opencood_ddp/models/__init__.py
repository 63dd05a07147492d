"""``create_model(hypes)``: the model registered under ``model.core_method``, built from ``model.args``.

As upstream's ``opencood/tools/train_utils.create_model``, a model class takes ``model.args``. The classes
register themselves in ``opencood_ddp.registry.MODELS`` with the hypes keys they read (``point_pillar.py``:
point_pillar for early and late fusion, point_pillar_intermediate (AttFuse), point_pillar_fcooper,
point_pillar_opv2v); every
module of this package is imported on the first lookup, so a new model is one new file here, or a module of
the user's listed under the hypes' ``imports:``. The hypes must have been through their ``yaml_parser``.

Two extensions of ours apply to every model: ``model.args.bn_momentum`` and ``model.args.cls_head_prior``.
Every plain BatchNorm of the model gets accurate training statistics (``numerics/batch_norm.py``): PyTorch's
CPU kernel accumulates them in float32 on our row and channels-last layouts, 1e-2 off in a step's outputs.
"""
from __future__ import annotations

import math
from typing import Mapping, Tuple

import torch
from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source, validate
from opencood_ddp.memory_fit import asked_for, gib, is_allocation_failure, largest_size, physical_memory
from opencood_ddp.models.checks import refuse
from opencood_ddp.numerics.batch_norm import use_accurate_batch_norm
from opencood_ddp.registry import MODELS

COMMON_OPTIONAL_KEYS: Tuple[Tuple[str, str], ...] = (
    ("model.args", "dict"), ("model.args.bn_momentum", "number"), ("model.args.cls_head_prior", "number"))


def create_model(hypes: Mapping) -> nn.Module:
    source = hypes_source(hypes)
    entry = MODELS.lookup(hypes, source)
    validate(hypes, (), source, COMMON_OPTIONAL_KEYS)
    args = hypes["model"].get("args", {})
    try:
        model = entry.obj(args)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{source}: model.args do not build a {entry.name} ({type(exc).__name__}: {exc}); "
                          f"fix the hypes") from None
    except (MemoryError, RuntimeError) as exc:  # memory_fit's docstring: why the parameters are not counted first
        if not is_allocation_failure(exc):
            raise
        raise ConfigError(f"{source}: model.args do not build a {entry.name}: its parameters do not fit in this "
                          f"machine's {gib(physical_memory())} of memory (an allocation{asked_for(exc)} was refused); "
                          f"lower {largest_size(args, 'model.args')}, the largest size under model.args; "
                          f"fix the hypes") from None
    if args.get("backbone_fix", False):
        require_trainable(model, entry.name, source)
    if "bn_momentum" in args:
        set_bn_momentum(model, args["bn_momentum"], source)
    if "cls_head_prior" in args:
        init_cls_prior(model, args["cls_head_prior"], source)
    return use_accurate_batch_norm(model)


def require_trainable(model: nn.Module, name: str, source: str) -> None:
    """``model.args.backbone_fix`` freezes everything but the fusion: a model whose fusion has no parameter of
    its own (F-Cooper's max, Where2comm's attention, AttFuse) would train nothing. Upstream fails there with
    torch's "optimizer got an empty parameter list", or, for models without the method, ignores the key."""
    if not any(parameter.requires_grad for parameter in model.parameters()):
        refuse(source, f"model.args.backbone_fix true leaves no parameter of {name} to train (it freezes "
                       f"everything but the fusion, and this fusion has no parameters); set it to false")


def init_cls_prior(model: nn.Module, prior: float, source: str) -> None:
    """Our extension ``model.args.cls_head_prior``: start every anchor at this foreground probability.

    Upstream leaves the class head's bias at PyTorch's default (scores start near 0.5), so the first few
    thousand steps of the focal loss go into pushing the ~10^4 background anchors of each frame down. The
    focal-loss paper (and OpenPCDet's PointPillars) initialise the bias to logit(0.01) instead; learning then
    starts on the objects at once. Only the initial value changes: checkpoints and parameter names do not.
    """
    if not 0 < prior < 1:
        raise ConfigError(f"{source}: model.args.cls_head_prior must be in (0, 1), got {prior!r}; fix the hypes")
    head = getattr(model, "cls_head", None)
    if not isinstance(getattr(head, "bias", None), torch.Tensor):
        raise ConfigError(f"{source}: model.args.cls_head_prior needs a model with a cls_head that has a bias; "
                          f"{type(model).__name__} has none: remove the key")
    with torch.no_grad():
        head.bias.fill_(-math.log((1 - prior) / prior))


def set_bn_momentum(model: nn.Module, momentum: float, source: str) -> None:
    """Our extension ``model.args.bn_momentum``: the BatchNorm running-statistics momentum of every layer.

    Upstream hard-codes 0.01, which suits ~10^5 steps: the running statistics used at evaluation reach
    1 - 0.99^n of the batch statistics after n steps. A toy run of a few hundred steps evaluates with
    half-converged statistics, so the toy configs set 0.1 (PyTorch's default). Absent, upstream's values.
    """
    if not 0 < momentum <= 1:
        raise ConfigError(f"{source}: model.args.bn_momentum must be in (0, 1], got {momentum!r}; fix the hypes")
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = float(momentum)


__all__ = ["create_model", "COMMON_OPTIONAL_KEYS"]
