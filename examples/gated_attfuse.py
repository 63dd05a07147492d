"""A subclass of a built-in model from outside the package: AttFuse with a learned gate before its heads.

The shortest way to change one model (docs/adding_a_model.md): subclass it, register the subclass under a new
name with only the keys it adds, and list the module under the hypes' ``imports:``. The entry takes its parent's
keys, cross-key check and facts from the parent's registration, so every ``model.args`` key of AttFuse is still
known and still checked. This one multiplies the fused map by a per-channel gate, ``sigmoid(g)``, where every
``g`` starts at ``model.args.gate_init``: the heads see ``sigmoid(gate_init)`` of the map at the first step, and
training moves each channel's gate.

    PYTHONPATH=examples torchrun --nproc_per_node=2 tools/train_ddp.py --hypes_yaml examples/gated_attfuse.yaml
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from opencood_ddp.models.point_pillar import PointPillarIntermediate
from opencood_ddp.registry import MODELS


@MODELS.register("gated_attfuse", add_optional=(("model.args.gate_init", "number"),))
class GatedAttFuse(PointPillarIntermediate):
    def __init__(self, args: Mapping):
        super().__init__(args)
        self.gate = nn.Parameter(torch.full((self.head_channels(),), float(args.get("gate_init", 0.0))))

    def neck(self, features: torch.Tensor, layout: Mapping) -> torch.Tensor:
        return features * torch.sigmoid(self.gate)[None, :, None, None]
