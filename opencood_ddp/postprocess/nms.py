"""Greedy rotated non-maximum suppression on bird's-eye-view box footprints.

Upstream counterpart: ``nms_rotated`` (``opencood/utils/box_utils.py``). As upstream: only the 1000
highest-scoring boxes are candidates (the others are dropped), each kept box suppresses the remaining lower
boxes whose BEV IoU with it is *strictly* greater than the threshold, and the IoU is compared in float32
(upstream's ``compute_iou`` returns a float32 array). The IoUs come from ``bev_iou_matrix`` (shapely polygons
of the bottom four corners, as upstream's ``convert_format``), all candidate pairs at once.

Departure: the score order is a stable descending sort, so equal scores keep their input order. Upstream
reverses numpy's default (unstable) ``argsort``, whose order among equal scores depends on the array
length and on numpy's build.
"""
from __future__ import annotations

from typing import List, Union

import numpy as np
import torch

from opencood_ddp.data.bev_iou import bev_iou_matrix

NMS_TOP_K = 1000

ArrayOrTensor = Union[np.ndarray, torch.Tensor]


def _to_numpy(values: ArrayOrTensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


def nms_rotated(corners: ArrayOrTensor, scores: ArrayOrTensor, threshold: float,
                top_k: int = NMS_TOP_K) -> torch.Tensor:
    """Indices (into the input) of the kept boxes, highest score first, as a torch long tensor.

    ``corners`` (K, 8, 3) and ``scores`` (K,) may be numpy arrays or tensors on any device; the result is on
    ``corners``' device when it is a tensor, else on the CPU.
    """
    device = corners.device if isinstance(corners, torch.Tensor) else torch.device("cpu")
    c = _to_numpy(corners).astype(np.float64)
    s = _to_numpy(scores).reshape(-1)
    if c.ndim != 3 or c.shape[1:] != (8, 3) or len(s) != len(c):
        raise ValueError(f"nms_rotated needs (K, 8, 3) corners and (K,) scores, got {c.shape} and {s.shape}")
    order = np.argsort(-s, kind="stable")[:top_k]
    suppresses = bev_iou_matrix(c[order], c[order]).astype(np.float32) > np.float32(threshold)
    alive = np.ones(len(order), dtype=bool)
    kept: List[int] = []
    for i in range(len(order)):
        if alive[i]:
            kept.append(i)
            # Rows of earlier boxes are already settled, so clearing them (and i itself) changes nothing.
            alive &= ~suppresses[i]
    return torch.as_tensor(order[kept], dtype=torch.long, device=device)


__all__ = ["NMS_TOP_K", "nms_rotated"]
