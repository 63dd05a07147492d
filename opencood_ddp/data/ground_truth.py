"""Ground-truth conventions shared by the datasets and the post-processor: the evaluation range and the
de-duplication order of objects seen by several CAVs (see ``data/datasets/base.py`` for the whole GT rules).

It sits below both: the post-processor must not import a dataset to filter its detections the same way.
"""
from __future__ import annotations

from typing import Hashable, List, Mapping, Sequence, Tuple

from opencood_ddp.hypes import get_key, range6
from opencood_ddp.registry import SOURCES

# Upstream's evaluation range (opencood/data_utils/datasets/__init__.py).
GT_RANGE: Tuple[float, ...] = (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0)


def evaluation_gt_range(hypes: Mapping, source: str) -> Tuple[float, ...]:
    """The GT range outside training: our ``postprocess.gt_range`` when set, else the data set's own (its
    ``fusion.dataset`` entry's ``gt_range``: V2V4Real's fork has its own), else upstream's GT_RANGE.

    The datasets filter test-time GT with it and the post-processor filters detections with it, so both sides
    of the evaluation see the same area.
    """
    if get_key(hypes, "postprocess.gt_range") is not None:
        return range6(hypes, "postprocess.gt_range", source)
    return tuple(SOURCES.get(SOURCES.name_in(hypes), source).meta.get("gt_range", GT_RANGE))


def upstream_unique_indices(ids: Sequence[Hashable]) -> List[int]:
    """Index of the first occurrence of each distinct id, in upstream's order ``[ids.index(x) for x in set(ids)]``.

    For integer ids CPython's set order depends only on the values, so it is the same in every process; other
    ids are taken in sorted order, since string hashes are salted per process.
    """
    distinct = set(ids)
    if not all(isinstance(i, int) for i in distinct):
        distinct = sorted(distinct, key=str)  # type: ignore[assignment]
    return [ids.index(x) for x in distinct]
