"""Losses built from the hypes' ``loss`` section (upstream ``opencood/tools/train_utils.py: create_loss``).

Upstream imports ``opencood.loss.<core_method>`` and instantiates its CamelCase class with ``loss.args``.
Here each loss registers a builder ``builder(loss.args) -> nn.Module`` in ``opencood_ddp.registry.LOSSES``
with the keys it reads; every module of this package is imported on the first lookup, so a new loss is one
new file here. A loss returns ``LossTerms(total, parts)``.
"""
from __future__ import annotations

from typing import Mapping

from torch import nn

from opencood_ddp.hypes import hypes_source, validate
from opencood_ddp.loss.point_pillar_loss import PointPillarLoss
from opencood_ddp.loss.terms import LossTerms
from opencood_ddp.registry import LOSSES


def create_loss(hypes: Mapping) -> nn.Module:
    """The loss named by ``loss.core_method``, configured by ``loss.args``."""
    source = hypes_source(hypes)
    validate(hypes, (("loss.args", "dict"),), source)
    entry = LOSSES.lookup(hypes, source)
    return entry.obj(hypes["loss"]["args"])


__all__ = ["create_loss", "LossTerms", "PointPillarLoss"]
