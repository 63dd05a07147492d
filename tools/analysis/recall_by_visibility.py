"""Recall of evaluated runs split by how well the ego's own LiDAR sees each object.

Cooperative perception pays off on objects the ego cannot see; an overall AP hides that. For each run
evaluated with `tools/inference_ddp.py --save_npy` (its MODEL_DIR/npy/{index}_pred.npy and _gt.npy), this
counts each ground-truth object's LiDAR points in the ego's own cloud and in all CAVs' clouds together, puts
the object in one group, and reports per group the share of objects that a detection above the score
threshold overlaps with BEV IoU >= --iou:

  ego sees it        >= --min_points points from the ego's own LiDAR
  only others see it  fewer from the ego, >= --min_points from all CAVs together
  barely seen         fewer than --min_points from all CAVs together

    python tools/analysis/recall_by_visibility.py --dataset_dir data/toy_opv2v/test --runs logs/late logs/attfuse

The runs must have been evaluated on the same --dataset_dir. Single process, no GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np

from opencood_ddp.data.ego_view import check_reads_opv2v_clouds, frame_clouds
from opencood_ddp.data.opv2v import scan_split
from opencood_ddp.errors import DataError, run_tool
from opencood_ddp.hypes import load_hypes
from opencood_ddp.metrics.visibility import GROUPS, visibility_groups
from opencood_ddp.postprocess import bev_iou_matrix
from opencood_ddp.vis.export import NPY_FOLDER, npy_paths, read_manifest, same_split


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset_dir", required=True, help="the split the runs were evaluated on")
    parser.add_argument("--runs", nargs="+", required=True, help="run folders evaluated with --save_npy")
    parser.add_argument("--iou", type=float, default=0.5, help="BEV IoU that counts as found (default 0.5)")
    parser.add_argument("--min_points", type=int, default=10, help="points that make an object seen")
    args = parser.parse_args(argv)
    if not 0 < args.iou <= 1:
        parser.error(f"argument --iou: {args.iou} is not an IoU in (0, 1]")
    if args.min_points < 0:
        parser.error(f"argument --min_points: {args.min_points} is negative")
    return args


def found(pred: np.ndarray, gt: np.ndarray, iou: float) -> np.ndarray:
    if len(gt) == 0 or len(pred) == 0:
        return np.zeros(len(gt), dtype=bool)
    return (bev_iou_matrix(gt, pred) >= iou).any(axis=1)


def load_npy(run: Path, frame_number: int) -> Dict[str, np.ndarray]:
    paths = npy_paths(run, frame_number)
    missing = [str(p) for p in (paths["pred"], paths["gt"]) if not p.is_file()]
    if missing:
        raise DataError(f"{missing[0]} does not exist; evaluate {run} with tools/inference_ddp.py --save_npy "
                        f"--dataset_dir of this split first")
    return {kind: load_corners(paths[kind]) for kind in ("pred", "gt")}


def load_corners(path: Path) -> np.ndarray:
    """One of inference's --save_npy box files: (K, 8, 3) corners, read without unpickling anything."""
    try:
        corners = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"{path} is not a readable .npy file ({exc}); evaluate the run with --save_npy "
                        f"again") from None
    if corners.ndim != 3 or corners.shape[1:] != (8, 3):
        raise DataError(f"{path} holds an array of shape {corners.shape}, not box corners (K, 8, 3); evaluate the "
                        f"run with --save_npy again")
    return corners


def check_split(runs: Sequence[Path], frames: int, dataset_dir: Path) -> None:
    """Each run's npy files are of this split: its npy/evaluation.yaml names the split the evaluation read (the
    same path, or the same scenarios and frames at another); a folder without one (an earlier version's,
    upstream's) is of another split where it holds files past this split's frames."""
    for run in runs:
        manifest = read_manifest(run / NPY_FOLDER)
        if manifest is not None and not same_split(manifest, dataset_dir, frames):
            raise DataError(f"{run / NPY_FOLDER} holds the evaluation of {manifest['split']}, not of {dataset_dir}; "
                            f"pass that split as --dataset_dir, or evaluate the run on this one with "
                            f"tools/inference_ddp.py --save_npy --dataset_dir {dataset_dir}")
        if npy_paths(run, frames)["gt"].is_file():
            raise DataError(f"{run} holds npy files of more than the {frames} frames of {dataset_dir}: it was "
                            f"evaluated on another split; pass that split as --dataset_dir")


def check_layout(runs: Sequence[Path]) -> None:
    """The split's clouds are read as OPV2V's (data/ego_view.py): a run of another layout is refused by name (its
    frames failed as 'unsupported YAML tag', V2V4Real's numpy poses, or were not found, DAIR-V2X-C's). A folder
    without config.yaml (npy files alone) is taken as it is."""
    for run in runs:
        if (run / "config.yaml").is_file():
            check_reads_opv2v_clouds(load_hypes(run / "config.yaml"), run)


def recall_table(runs: Sequence[Path], dataset_dir: Path, iou: float, min_points: int) -> str:
    check_layout(runs)
    index = scan_split(dataset_dir, key="--dataset_dir")
    check_split(runs, len(index), dataset_dir)
    totals = {run: np.zeros((len(GROUPS), 2), dtype=np.int64) for run in runs}  # [group] -> (found, objects)
    for frame_number in range(len(index)):
        clouds = frame_clouds(index, frame_number)
        for run in runs:
            arrays = load_npy(run, frame_number)
            groups = visibility_groups(clouds, arrays["gt"], min_points)
            hits = found(arrays["pred"], arrays["gt"], iou)
            for group in range(len(GROUPS)):
                totals[run][group] += (int(hits[groups == group].sum()), int((groups == group).sum()))
    header = "| run | " + " | ".join(GROUPS) + " |"
    rows = [header, "|---|" + "---:|" * len(GROUPS)]
    for run in runs:
        cells = [f"{f / n:.3f} ({f}/{n})" if n else "-" for f, n in totals[run]]
        rows.append(f"| {run.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows + [f"recall at BEV IoU {iou}; seen = at least {min_points} LiDAR points in the box; "
                             f"{len(index)} frames of {dataset_dir}"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: recall_table([Path(run) for run in args.runs], Path(args.dataset_dir), args.iou,
                                         args.min_points))


if __name__ == "__main__":
    sys.exit(main())
