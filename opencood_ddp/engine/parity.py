"""How far two state dicts are apart: the measures tools/parity_check.py and the parity tests judge an N-rank
run by, against the 1-rank run and against the noise floor of a rounding-only change (docs/ddp_semantics.md).

All three read state dicts from any source (a net_epoch{N}.pth, a model's state_dict) and accept a `module.` prefix.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from opencood_ddp.checkpoint_files import strip_module_prefix


def relative_differences(state: Mapping[str, Any], reference: Mapping[str, Any]) -> dict:
    """How far two state dicts are apart, for parity checks between world sizes.

    Per floating tensor: max|a - b| / max|b|. Returns {'parameters': (worst, key), 'buffers': (worst, key)},
    BatchNorm running statistics counted as buffers, over the keys both hold.
    """
    worst: dict = {"parameters": (0.0, None), "buffers": (0.0, None)}
    state = strip_module_prefix(state)
    for key, ref in strip_module_prefix(reference).items():
        other = state.get(key)
        if other is None or not ref.is_floating_point():
            continue
        if ref.numel() == 0:  # no value to differ (its .max() would raise)
            continue
        kind = "buffers" if "running_" in key else "parameters"
        diff = ((other.double() - ref.double()).abs().max() / (ref.double().abs().max() + 1e-12)).item()
        diff = diff if math.isfinite(diff) else math.inf  # a NaN is a difference: 'nan > worst' is never true
        if diff > worst[kind][0]:
            worst[kind] = (diff, key)
    return worst


def _learnable_pairs(state: Mapping[str, Any], reference: Mapping[str, Any]):
    """(tensor, reference tensor) in float64 for each learnable floating key both hold (BN running statistics
    are not learnt)."""
    state = strip_module_prefix(state)
    for key, ref in strip_module_prefix(reference).items():
        other = state.get(key)
        if other is None or not ref.is_floating_point() or "running_" in key:
            continue
        yield other.double(), ref.double()


def _distance(state: Mapping[str, Any], reference: Mapping[str, Any]) -> float:
    """||a - b|| over the learnable tensors both hold."""
    return sum((a - b).pow(2).sum().item() for a, b in _learnable_pairs(state, reference)) ** 0.5


def global_relative_difference(state: Mapping[str, Any], reference: Mapping[str, Any]) -> float:
    """||a - b|| / ||b|| over all learnable floating tensors at once (BN running statistics excluded).

    Unlike the per-tensor worst case, small tensors that barely train (a BN bias near zero) cannot dominate it.
    """
    gap = norm = 0.0
    for a, b in _learnable_pairs(state, reference):  # one pass: each tensor is cast to float64 once
        gap += (a - b).pow(2).sum().item()
        norm += b.pow(2).sum().item()
    return (gap / norm) ** 0.5 if norm else 0.0


def step_relative_difference(state: Mapping[str, Any], reference: Mapping[str, Any],
                             start: Mapping[str, Any]) -> float:
    """||a - b|| / ||b - start||: how far one optimizer step taken from `start` lands from the reference's step
    from the same `start`, over the size of the reference's step.

    Unlike the gap of whole runs, it does not grow with chaos: every run starts the step from the same weights
    and optimizer state, so only the step's own arithmetic differs (tools/parity_check.py's step check).
    """
    gap, size = _distance(state, reference), _distance(reference, start)
    if size == 0.0:
        return 0.0 if gap == 0.0 else math.inf
    return gap / size
