"""Autocast switched off for a region, on any device type.

``torch.autocast(device_type, enabled=False)`` raises for a device type autocast does not know: ``meta``, on which
tests run the models to stand for a GPU (nothing on it can be read back to the host, as nothing on a GPU should be
within a step). Such a device has no autocast to leave.

Whether autocast knows a device type is asked of torch once per type, not per call: the answer,
``torch._C._is_autocast_available``, is a C builtin that the dynamo of torch 2.11 (the GPU machines' torch) cannot
trace. Inside a captured step (engine/capture.py) each call broke the graph, and the pieces' backward did not
repeat the eager step's bit for bit (toy AttFuse under aot_eager: 23 of 34 gradients apart, by up to 1.2e-4). A
lookup in a dict is traced, so the captured step stays one graph there too.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

# The types a 16-bit autocast computes in: the float32 islands (models/modules/precision.py) and the synchronized
# batch norm's statistics (numerics/batch_norm.py) widen them.
HALF_DTYPES = (torch.float16, torch.bfloat16)

# The device types the project runs on, answered at import; another one is asked of torch on first use.
_AVAILABLE = {device_type: torch.amp.is_autocast_available(device_type) for device_type in ("cpu", "cuda", "meta")}


def autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available(device_type)``, asked of torch once per device type (the module's
    docstring: a captured step traces a dict lookup, not torch's builtin)."""
    if device_type not in _AVAILABLE:
        _AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return _AVAILABLE[device_type]


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a device type it does not know)."""
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> ContextManager:
    """``torch.autocast(device_type, enabled=False)``, or nothing for a device type autocast does not know."""
    if not autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


__all__ = ["HALF_DTYPES", "autocast_available", "autocast_enabled", "autocast_off"]
