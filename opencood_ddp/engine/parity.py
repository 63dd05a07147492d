"""How far two state dicts are apart: the measures tools/parity_check.py and the parity tests judge an N-rank
run by, against the 1-rank run and against the noise floor of a rounding-only change (docs/ddp_semantics.md).

Both read state dicts from any source (a net_epoch{N}.pth, a model's state_dict) and accept a `module.` prefix.
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


def global_relative_difference(state: Mapping[str, Any], reference: Mapping[str, Any]) -> float:
    """||a - b|| / ||b|| over all learnable floating tensors at once (BN running statistics excluded).

    Unlike the per-tensor worst case, small tensors that barely train (a BN bias near zero) cannot dominate it.
    """
    state = strip_module_prefix(state)
    gap = norm = 0.0
    for key, ref in strip_module_prefix(reference).items():
        other = state.get(key)
        if other is None or not ref.is_floating_point() or "running_" in key:
            continue
        gap += (other.double() - ref.double()).pow(2).sum().item()
        norm += ref.double().pow(2).sum().item()
    return (gap / norm) ** 0.5 if norm else 0.0
