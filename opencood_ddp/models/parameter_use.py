"""Parameters that a forward pass may leave out, and whether it did: upstream's "grad None" without DDP's
``find_unused_parameters``.

Upstream's graph leaves some parameters out of a step: V2X-ViT's infrastructure projections on a batch without a
road-side unit are never called. Their gradient stays None and torch's optimizers skip them: no momentum, no weight
decay, the values stay where they are. Here such layers run on an empty input instead, so that DDP finds every
parameter in every step's graph and needs no ``find_unused_parameters`` (docs/benchmarks.md measured both ways); that
gives them zero gradients, which Adam would turn into a move (weight decay, momentum).

So a module whose forward may leave parameters out subclasses ``TracksParameterUse``: it names its groups of such
parameters and records which groups its forward passes used. ``take_parameter_use(model)`` collects and clears the
record of every such module, in module order (the same on every rank); the engine gets it through the task
(``Task.parameter_use``), adds it over the ranks and sets the gradients of the groups that no rank used to None
before the optimizer step. A group used on some ranks keeps DDP's average, in which the others count as zero, as
under ``find_unused_parameters``.

Only parameters that upstream's graph does not contain belong here. A layer that upstream also runs on an empty
input (a BatchNorm or a linear layer on zero pillars) is in upstream's graph, with a zero gradient: it is used.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from torch import nn

ParameterGroupUse = Tuple[List[nn.Parameter], bool]


class TracksParameterUse:
    """Mixin of an ``nn.Module`` whose forward pass may leave groups of its parameters out of upstream's graph."""

    def parameter_groups(self) -> Sequence[Sequence[nn.Parameter]]:
        """The groups, always the same ones in the same order."""
        raise NotImplementedError

    def take_use(self) -> Sequence[bool]:
        """Per group, whether a forward pass used it since the last call; clears the record."""
        raise NotImplementedError


def take_parameter_use(model: nn.Module) -> List[ParameterGroupUse]:
    """(parameters, used since the last call) of every group of every tracking module of `model`, in module order;
    the records are cleared. Empty for a model that uses every parameter in every step."""
    found: List[ParameterGroupUse] = []
    for module in model.modules():
        if isinstance(module, TracksParameterUse):
            found.extend((list(group), bool(used)) for group, used in zip(module.parameter_groups(),
                                                                          module.take_use()))
    return found


__all__ = ["TracksParameterUse", "ParameterGroupUse", "take_parameter_use"]
