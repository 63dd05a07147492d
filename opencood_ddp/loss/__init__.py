"""Losses built from the hypes' ``loss`` section (upstream ``opencood/tools/train_utils.py: create_loss``).

Upstream imports ``opencood.loss.<core_method>`` and instantiates the class of the CamelCase name with
``loss.args``; here a table names the supported methods, so an unknown one is a one-line ConfigError.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from torch import nn

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key, hypes_source, validate
from opencood_ddp.loss.point_pillar_loss import PointPillarLoss


def _build_point_pillar_loss(hypes: Mapping, source: str) -> nn.Module:
    validate(hypes, (("loss.args.cls_weight", "number"), ("loss.args.reg", "number")), source)
    args = hypes["loss"]["args"]
    for key in ("cls_weight", "reg"):
        value = args[key]
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{source}: key loss.args.{key} must be a finite number >= 0, got {value!r}; "
                              f"fix the hypes or pass --set loss.args.{key}=VALUE")
    return PointPillarLoss(cls_weight=args["cls_weight"], reg=args["reg"])


LOSSES: dict[str, Callable[[Mapping, str], nn.Module]] = {"point_pillar_loss": _build_point_pillar_loss}


def create_loss(hypes: Mapping) -> nn.Module:
    """The loss named by ``loss.core_method``, configured by ``loss.args``."""
    source = hypes_source(hypes)
    validate(hypes, (("loss.core_method", "str"), ("loss.args", "dict")), source)
    name = get_key(hypes, "loss.core_method")
    if name not in LOSSES:
        raise ConfigError(f"{source}: loss.core_method {name!r} is not one of {', '.join(LOSSES)}; fix the hypes")
    return LOSSES[name](hypes, source)


__all__ = ["create_loss", "PointPillarLoss", "LOSSES"]
