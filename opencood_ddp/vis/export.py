"""Per-frame evaluation files: upstream's --save_npy arrays and --save_vis bird's-eye-view pictures.

Each rank writes the frames it evaluated; a file is named by the frame's dataset index, so a run on any
number of ranks writes the same files. They go to a staging folder beside the final one (``npy.partial``), and
rank 0 publishes it once every rank is done (``FrameExporter.publish``): the staging folder, holding exactly this
evaluation's frames and an ``evaluation.yaml`` that says which split, fusion and preset wrote them, replaces
``npy/`` (``vis/``) whole. So the folder never mixes two evaluations' frames (another split, another fusion, a
longer split before), and an evaluation that fails or is stopped leaves the published folder as it was.
"""
from __future__ import annotations

import io
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import yaml

from opencood_ddp.atomic import atomic_write
from opencood_ddp.errors import OutputError
from opencood_ddp.vis.bev import draw_bev

NPY_FOLDER = "npy"
VIS_FOLDER = "vis"
STAGING_SUFFIX = ".partial"  # where the ranks write, until rank 0 publishes the folder
MANIFEST = "evaluation.yaml"  # in each published folder: what wrote its files
NPY_KINDS = ("pcd", "pred", "gt")


def npy_paths(run_dir: Path, index: int, folder: str = NPY_FOLDER) -> dict:
    """Upstream's names: ``{index:04d}_pcd.npy``, ``_pred.npy`` (box corners), ``_gt.npy`` (box corners)."""
    return {kind: Path(run_dir) / folder / f"{index:04d}_{kind}.npy" for kind in NPY_KINDS}


def vis_path(run_dir: Path, index: int, folder: str = VIS_FOLDER) -> Path:
    return Path(run_dir) / folder / f"bev_{index:05d}.png"


def read_manifest(folder: Path) -> Optional[dict]:
    """A published folder's evaluation.yaml ({split, fusion_method, eval_preset, frames}), None where it has none
    (an earlier version's, or upstream's)."""
    path = Path(folder) / MANIFEST
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def publish(staging: Path, final: Path, expected: set, manifest: Mapping) -> None:
    """``staging`` made ``final``: first emptied of every file this evaluation did not write (an interrupted
    evaluation's frames past this split's, temporary files), given the manifest, then swapped in whole."""
    staging.mkdir(parents=True, exist_ok=True)
    for path in staging.iterdir():
        if path.name not in expected:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    text = yaml.safe_dump(dict(manifest), sort_keys=False)
    atomic_write(staging / MANIFEST, lambda handle: handle.write(text.encode()))
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    staging.rename(final)
    if old.exists():
        shutil.rmtree(old)


def save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))


@dataclass(frozen=True)
class FrameExporter:
    """``exporter(index, points, pred_corners, scores, gt_corners, cav_positions)`` writes the chosen files into the
    staging folders; ``publish(frames)`` on rank 0, once every rank has written, makes them the run's."""

    run_dir: Path
    save_npy: bool
    save_vis: bool
    lidar_range: Sequence[float]
    about: Mapping = field(default_factory=dict)  # the manifest's split, fusion_method, eval_preset

    def __call__(self, index: int, points: np.ndarray, pred_corners: np.ndarray, scores: np.ndarray,
                 gt_corners: np.ndarray, cav_positions: Optional[np.ndarray]) -> None:
        try:
            self._write(index, points, pred_corners, scores, gt_corners, cav_positions)
        except OSError as exc:  # a full disk, a folder in a file's place: this rank's error, which every rank meets
            raise OutputError.of(exc, f"frame {index}'s --save_npy / --save_vis file") from None

    def _write(self, index: int, points: np.ndarray, pred_corners: np.ndarray, scores: np.ndarray,
               gt_corners: np.ndarray, cav_positions: Optional[np.ndarray]) -> None:
        if self.save_npy:
            for kind, array in zip(NPY_KINDS, (points, pred_corners, gt_corners)):
                path = npy_paths(self.run_dir, index, NPY_FOLDER + STAGING_SUFFIX)[kind]
                path.parent.mkdir(parents=True, exist_ok=True)
                save_npy(path, array)
        if self.save_vis:
            positions = np.zeros((0, 3)) if cav_positions is None else cav_positions
            draw_bev(vis_path(self.run_dir, index, VIS_FOLDER + STAGING_SUFFIX), points, gt_corners, pred_corners,
                     scores, positions, self.lidar_range,
                     title=f"frame {index}: {len(gt_corners)} objects, {len(scores)} detections")

    def publish(self, frames: int) -> None:
        """Rank 0, after every rank's frames are written: each chosen folder replaced by its staging folder."""
        manifest = dict(self.about, frames=frames)
        run = Path(self.run_dir)
        if self.save_npy:
            expected = {path.name for index in range(frames) for path in npy_paths(run, index).values()}
            publish(run / (NPY_FOLDER + STAGING_SUFFIX), run / NPY_FOLDER, expected, manifest)
        if self.save_vis:
            expected = {vis_path(run, index).name for index in range(frames)}
            publish(run / (VIS_FOLDER + STAGING_SUFFIX), run / VIS_FOLDER, expected, manifest)


__all__ = ["FrameExporter", "MANIFEST", "NPY_FOLDER", "VIS_FOLDER", "npy_paths", "vis_path", "save_npy",
           "read_manifest", "publish"]
