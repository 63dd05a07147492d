"""Pre-processors: a CAV's point cloud -> the model's input (upstream ``opencood/data_utils/pre_processor``).

``build_preprocessor(hypes, train)`` builds the entry of ``opencood_ddp.registry.PREPROCESSORS`` named by
``preprocess.core_method``. Each module of this package registers its own; a new one is one new file here (or
a user's module listed under the hypes' ``imports:``). An entry is called as ``entry(preprocess, train)``
with the hypes' ``preprocess`` section and returns a picklable callable ``points (N, 4) -> dict of arrays``;
``train`` selects upstream's training limits (``max_voxel_train`` rather than ``max_voxel_test``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from opencood_ddp.hypes import get_key, hypes_source
from opencood_ddp.registry import PREPROCESSORS, Entry


def preprocessor_entry(hypes: Mapping, source: str) -> Entry:
    """The entry named by ``preprocess.core_method`` (not validated); an entry without keys when the name is
    missing, so that the caller's validation names the missing key together with the others."""
    name = get_key(hypes, PREPROCESSORS.key)
    return PREPROCESSORS.get(name, source) if name is not None else Entry("(none)", None)


def build_preprocessor(hypes: Mapping, train: bool) -> Callable[[Any], dict]:
    entry = PREPROCESSORS.lookup(hypes, hypes_source(hypes))
    return entry.obj(hypes["preprocess"], train)


__all__ = ["build_preprocessor", "preprocessor_entry"]
