"""Per-frame evaluation files: upstream's --save_npy arrays and --save_vis bird's-eye-view pictures.

Each rank writes the frames it evaluated; a file is named by the frame's dataset index, so a run on any
number of ranks writes the same files. They go to a staging folder beside the final one, named by the evaluation's
result file (``npy.eval.partial``, ``npy.eval_nofusion.partial``: two evaluations of one run at once stage apart),
and rank 0 publishes it once every rank is done and the metric is computed (``FrameExporter.publish``): the staging
folder, holding exactly this evaluation's frames and an ``evaluation.yaml`` that says which split, fusion and preset
wrote them, replaces ``npy/`` (``vis/``) whole. So the folder never mixes two evaluations' frames (another split,
another fusion, a longer split before), and an evaluation that fails or is stopped leaves the published folder as
it was; a publish stopped between its two renames is undone by the next one.
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
STAGING_SUFFIX = ".partial"  # npy.<tag>.partial: where the ranks write, until rank 0 publishes the folder
REPLACED_SUFFIX = ".old"  # npy.<tag>.old: the published folder while the new one moves in
MANIFEST = "evaluation.yaml"  # in each published folder: what wrote its files
NPY_KINDS = ("pcd", "pred", "gt")


def npy_paths(run_dir: Path, index: int, folder: str = NPY_FOLDER) -> dict:
    """Upstream's names: ``{index:04d}_pcd.npy``, ``_pred.npy`` (box corners), ``_gt.npy`` (box corners)."""
    return {kind: Path(run_dir) / folder / f"{index:04d}_{kind}.npy" for kind in NPY_KINDS}


def vis_path(run_dir: Path, index: int, folder: str = VIS_FOLDER) -> Path:
    return Path(run_dir) / folder / f"bev_{index:05d}.png"


def split_scenarios(split: Path) -> Optional[list]:
    """A split folder's scenario names, sorted: what tells the same split at another path (a run evaluated on a
    cluster, read on a workstation) from another split; None for a split that is not a folder (DAIR-V2X-C's)."""
    split = Path(split)
    return sorted(path.name for path in split.iterdir() if path.is_dir()) if split.is_dir() else None


def same_split(manifest: Mapping, split: Path, frames: int) -> bool:
    """Whether a manifest's evaluation read ``split`` (of ``frames`` frames): the same resolved path, or the same
    scenarios and frame count at another path."""
    if Path(manifest["split"]).resolve() == Path(split).resolve():
        return True
    scenarios = manifest.get("scenarios")
    return scenarios is not None and scenarios == split_scenarios(split) and manifest.get("frames") == frames


def read_manifest(folder: Path) -> Optional[dict]:
    """A published folder's evaluation.yaml ({split, fusion_method, eval_preset, frames}), None where it has none
    (an earlier version's, or upstream's)."""
    path = Path(folder) / MANIFEST
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def restore_replaced(final: Path) -> None:
    """A publish stopped between its two renames left the published folder as ``<final>.<tag>.old`` and no
    ``final``: put the newest such folder back."""
    replaced = sorted(final.parent.glob(f"{final.name}.*{REPLACED_SUFFIX}"), key=lambda path: path.stat().st_mtime)
    if replaced and not final.exists():
        replaced[-1].rename(final)


def publish(staging: Path, final: Path, old: Path, expected: set, manifest: Mapping) -> None:
    """``staging`` made ``final``: first emptied of every file this evaluation did not write (an interrupted
    evaluation's frames past this split's, temporary files), given the manifest, then swapped in whole, the
    folder it replaces kept as ``old`` until the swap is done and put back if it fails."""
    restore_replaced(final)
    staging.mkdir(parents=True, exist_ok=True)
    for path in staging.iterdir():
        if path.name not in expected:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    text = yaml.safe_dump(dict(manifest), sort_keys=False)
    atomic_write(staging / MANIFEST, lambda handle: handle.write(text.encode()))
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    try:
        staging.rename(final)
    except BaseException:
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
    tag: str = "eval"  # the evaluation's result file's stem: names its staging folders

    def staging(self, folder: str) -> str:
        return f"{folder}.{self.tag}{STAGING_SUFFIX}"

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
                path = npy_paths(self.run_dir, index, self.staging(NPY_FOLDER))[kind]
                path.parent.mkdir(parents=True, exist_ok=True)
                save_npy(path, array)
        if self.save_vis:
            positions = np.zeros((0, 3)) if cav_positions is None else cav_positions
            draw_bev(vis_path(self.run_dir, index, self.staging(VIS_FOLDER)), points, gt_corners, pred_corners,
                     scores, positions, self.lidar_range,
                     title=f"frame {index}: {len(gt_corners)} objects, {len(scores)} detections")

    def publish(self, frames: int) -> None:
        """Rank 0, after every rank's frames are written: each chosen folder replaced by its staging folder."""
        manifest = dict(self.about, frames=frames)
        run = Path(self.run_dir)
        chosen = []
        if self.save_npy:
            names = {path.name for index in range(frames) for path in npy_paths(run, index).values()}
            chosen.append((NPY_FOLDER, names))
        if self.save_vis:
            chosen.append((VIS_FOLDER, {vis_path(run, index).name for index in range(frames)}))
        for folder, expected in chosen:
            publish(run / self.staging(folder), run / folder, run / f"{folder}.{self.tag}{REPLACED_SUFFIX}",
                    expected, manifest)


__all__ = ["FrameExporter", "MANIFEST", "NPY_FOLDER", "VIS_FOLDER", "npy_paths", "vis_path", "save_npy",
           "read_manifest", "publish", "restore_replaced", "same_split", "split_scenarios"]
