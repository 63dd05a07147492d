"""Autocast switched off for a region, on any device type.

``torch.autocast(device_type, enabled=False)`` raises for a device type autocast does not know: ``meta``, on which
tests run the models to stand for a GPU (nothing on it can be read back to the host, as nothing on a GPU should be
within a step). Such a device has no autocast to leave.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a device type it does not know)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> ContextManager:
    """``torch.autocast(device_type, enabled=False)``, or nothing for a device type autocast does not know."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


__all__ = ["autocast_enabled", "autocast_off"]
