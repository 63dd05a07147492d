"""The PointPillar box encoding: GT box vs anchor <-> 7 regression residuals ('hwl' boxes).

Upstream counterparts: the target formulas inside ``VoxelPostprocessor.generate_label`` (encode) and
``VoxelPostprocessor.delta_to_boxes3d`` (decode). With ``d = sqrt(w_a^2 + l_a^2)`` (anchor columns 4 and 5):

    dx = (x - x_a) / d       dy = (y - y_a) / d       dz = (z - z_a) / h_a
    dh = log(h / h_a)        dw = log(w / w_a)        dl = log(l / l_a)       dyaw = yaw - yaw_a

The head's regression map (N, 7A, H, W) holds anchor ``a``'s residual ``k`` in channel ``7a + k``, so
``permute(0, 2, 3, 1).view(N, -1, 7)`` lines the residuals up with the anchors flattened as (H, W, A).
"""
from __future__ import annotations

import numpy as np
import torch


def anchor_diagonal(anchors: np.ndarray) -> np.ndarray:
    """BEV diagonal sqrt(w^2 + l^2) of 'hwl' anchors (..., 7)."""
    return np.sqrt(anchors[..., 4] ** 2 + anchors[..., 5] ** 2)


def encode(boxes: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """(K, 7) 'hwl' boxes against their (K, 7) anchors -> (K, 7) float64 residuals (upstream's arithmetic)."""
    boxes = np.asarray(boxes, dtype=np.float64)
    anchors = np.asarray(anchors, dtype=np.float64)
    if boxes.shape != anchors.shape or boxes.ndim != 2 or boxes.shape[1] != 7:
        raise ValueError(f"boxes and anchors must both be (K, 7), got {boxes.shape} and {anchors.shape}")
    diagonal = anchor_diagonal(anchors)
    deltas = np.empty_like(boxes)
    deltas[:, 0] = (boxes[:, 0] - anchors[:, 0]) / diagonal
    deltas[:, 1] = (boxes[:, 1] - anchors[:, 1]) / diagonal
    deltas[:, 2] = (boxes[:, 2] - anchors[:, 2]) / anchors[:, 3]
    deltas[:, 3:6] = np.log(boxes[:, 3:6] / anchors[:, 3:6])
    deltas[:, 6] = boxes[:, 6] - anchors[:, 6]
    return deltas


def delta_to_boxes3d(deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Regression maps (N, 7A, H, W) and anchors (H, W, A, 7) -> (N, H*W*A, 7) float32 boxes.

    Upstream ``delta_to_boxes3d`` (``channel_swap=True``). The output lives on ``deltas``' device and is
    computed in float32 whatever the input dtype (upstream keeps ``deltas``' dtype and casts the anchors to
    float32).
    """
    if deltas.dim() != 4 or deltas.shape[1] % 7 != 0:
        raise ValueError(f"deltas must be (N, 7 * anchor_num, H, W), got {tuple(deltas.shape)}")
    batch = deltas.shape[0]
    flat = deltas.permute(0, 2, 3, 1).reshape(batch, -1, 7).float()
    anchors_flat = torch.as_tensor(anchors).to(device=deltas.device, dtype=torch.float32).reshape(-1, 7)
    if anchors_flat.shape[0] != flat.shape[1]:
        raise ValueError(f"{flat.shape[1]} regression rows (deltas {tuple(deltas.shape)}) do not match "
                         f"{anchors_flat.shape[0]} anchors (anchors {tuple(anchors.shape)}); the head's output "
                         f"map and postprocess.anchor_args (range, voxel size, feature_stride, num) disagree")
    anchors_flat = anchors_flat.unsqueeze(0)
    diagonal = torch.sqrt(anchors_flat[..., 4] ** 2 + anchors_flat[..., 5] ** 2).unsqueeze(-1)
    xy = flat[..., 0:2] * diagonal + anchors_flat[..., 0:2]
    z = flat[..., 2:3] * anchors_flat[..., 3:4] + anchors_flat[..., 2:3]
    sizes = torch.exp(flat[..., 3:6]) * anchors_flat[..., 3:6]
    yaw = flat[..., 6:7] + anchors_flat[..., 6:7]
    return torch.cat([xy, z, sizes, yaw], dim=-1)


__all__ = ["anchor_diagonal", "encode", "delta_to_boxes3d"]
