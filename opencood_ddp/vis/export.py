"""Per-frame evaluation files: upstream's --save_npy arrays and --save_vis bird's-eye-view pictures.

Each rank writes the frames it evaluated; a file is named by the frame's dataset index, so a run on any
number of ranks writes the same files. Writes are atomic (temporary file, then rename): an interrupted
evaluation leaves whole files or none.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from opencood_ddp.atomic import atomic_write
from opencood_ddp.vis.bev import draw_bev

NPY_FOLDER = "npy"
VIS_FOLDER = "vis"


def npy_paths(run_dir: Path, index: int) -> dict:
    """Upstream's names: ``{index:04d}_pcd.npy``, ``_pred.npy`` (box corners), ``_gt.npy`` (box corners)."""
    folder = Path(run_dir) / NPY_FOLDER
    return {kind: folder / f"{index:04d}_{kind}.npy" for kind in ("pcd", "pred", "gt")}


def vis_path(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / VIS_FOLDER / f"bev_{index:05d}.png"


def save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))


@dataclass(frozen=True)
class FrameExporter:
    """``exporter(index, points, pred_corners, scores, gt_corners, cav_positions)`` writes the chosen files."""

    run_dir: Path
    save_npy: bool
    save_vis: bool
    lidar_range: Sequence[float]

    def __call__(self, index: int, points: np.ndarray, pred_corners: np.ndarray, scores: np.ndarray,
                 gt_corners: np.ndarray, cav_positions: Optional[np.ndarray]) -> None:
        if self.save_npy:
            for kind, array in zip(("pcd", "pred", "gt"), (points, pred_corners, gt_corners)):
                path = npy_paths(self.run_dir, index)[kind]
                path.parent.mkdir(parents=True, exist_ok=True)
                save_npy(path, array)
        if self.save_vis:
            positions = np.zeros((0, 3)) if cav_positions is None else cav_positions
            draw_bev(vis_path(self.run_dir, index), points, gt_corners, pred_corners, scores, positions,
                     self.lidar_range, title=f"frame {index}: {len(gt_corners)} objects, {len(scores)} detections")


__all__ = ["FrameExporter", "NPY_FOLDER", "VIS_FOLDER", "npy_paths", "vis_path", "save_npy"]
