"""How much of its attention AttFuse's ego row gives to the other CAVs, at the cells of objects by visibility.

AttFuse fuses per BEV cell with softmax(ego . cav / sqrt(C)) weights over the frame's CAVs. If the fusion works,
the ego should lean on the other CAVs where only they see an object. For each test frame this runs the model of a
point_pillar_intermediate run, takes the attention weights of the first backbone level (a forward hook on the
AttFusion module, recomputing its weights from its inputs with ``AttFusion.ego_weights``), and averages 1 - weight(ego) over the cells of the GT
objects in each visibility group of opencood_ddp/metrics/visibility.py:

    python tools/analysis/attention_by_visibility.py --model_dir logs/attfuse --dataset_dir data/toy_opv2v/test
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from opencood_ddp.data.ego_view import check_reads_opv2v_clouds, frame_clouds
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.hypes import naming_file
from opencood_ddp.engine.evaluator import EvalRequest
from opencood_ddp.engine.inference import load_run
from opencood_ddp.errors import ConfigError, run_tool
from opencood_ddp.metrics.visibility import GROUPS, visibility_groups
from opencood_ddp.models.modules.ego_warp import to_ego_frame
from opencood_ddp.models.modules.fusion import AttFusion
from opencood_ddp.tasks.opencood import DetectionEvalOptions, build_eval


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="a point_pillar_intermediate (AttFuse) run")
    parser.add_argument("--dataset_dir", required=True, help="the split to look at")
    parser.add_argument("--min_points", type=int, default=10, help="points that make an object seen")
    return parser.parse_args(argv)


class FirstLevelWeights:
    """Forward hook: the ego row's attention weights (H, W, CAVs) of the first sample, first AttFusion call."""

    def __init__(self) -> None:
        self.weights: List[torch.Tensor] = []

    def __call__(self, module: AttFusion, inputs, output) -> None:
        x, record_len = inputs[:2]
        warp = inputs[2] if len(inputs) > 2 else None  # proj_first: false: the maps are fused once warped
        cavs = to_ego_frame(x, warp)[: int(record_len[0])]
        n, c, h, w = cavs.shape
        weights = module.ego_weights(cavs.reshape(n, c, h * w).permute(2, 0, 1))
        self.weights.append(weights[:, 0, :].reshape(h, w, n))


def cell_of(box: np.ndarray, lidar_range: Sequence[float], shape: Sequence[int]) -> Optional[tuple]:
    """(row, column) of the BEV cell under a box's centre, None outside the grid."""
    height, width = shape
    x, y = box[:, 0].mean(), box[:, 1].mean()
    # floor, not int(): int() rounds toward zero, which put a centre up to a cell left of (or below) the grid in
    # its first column (row)
    column = math.floor((x - lidar_range[0]) / (lidar_range[3] - lidar_range[0]) * width)
    row = math.floor((y - lidar_range[1]) / (lidar_range[4] - lidar_range[1]) * height)
    return (row, column) if 0 <= row < height and 0 <= column < width else None


def attention_table(model_dir: Path, dataset_dir: str, min_points: int) -> str:
    run = load_run(model_dir)
    hypes = run.hypes
    if hypes["model"]["core_method"] != "point_pillar_intermediate":
        raise ConfigError(f"{model_dir}: model.core_method is {hypes['model']['core_method']!r}; this tool reads "
                          f"AttFuse (point_pillar_intermediate) runs")
    check_reads_opv2v_clouds(hypes, model_dir)
    request = EvalRequest(dataset_dir=dataset_dir, task_options=DetectionEvalOptions(fusion_method="intermediate"))
    with naming_file(hypes, run.config):
        spec = build_eval(hypes, request)
    ckpt.load_weights(spec.model, run.checkpoint)
    spec.model.eval()
    hook = FirstLevelWeights()
    first = next(m for m in spec.model.modules() if isinstance(m, AttFusion))
    first.register_forward_hook(hook)
    lidar_range = hypes["preprocess"]["cav_lidar_range"]
    shares: List[List[float]] = [[] for _ in GROUPS]
    for index in range(len(spec.dataset)):
        hook.weights.clear()
        batch = spec.collate([spec.dataset[index]])
        with torch.no_grad():
            spec.model(batch["model_input"]["ego"])
        weights = hook.weights[0]
        if weights.shape[2] < 2:
            continue  # a frame with the ego alone has nothing to fuse
        gt = spec.evaluator.evaluate_batch.post.generate_gt_bbx(batch["frames"][0]).numpy()
        groups = visibility_groups(frame_clouds(spec.dataset.source.index, index), gt, min_points)
        for box, group in zip(gt, groups):
            cell = cell_of(box, lidar_range, weights.shape[:2])
            if cell is not None:
                shares[group].append(1.0 - float(weights[cell][0]))
    rows = ["| objects | count | mean attention weight on the other CAVs |", "|---|---:|---:|"]
    rows += [f"| {name} | {len(v)} | {np.mean(v):.3f} |" if v else f"| {name} | 0 | - |"
             for name, v in zip(GROUPS, shares)]
    return "\n".join(rows + [f"first backbone level of {model_dir}, {len(spec.dataset)} frames of {dataset_dir}"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: attention_table(Path(args.model_dir), args.dataset_dir, args.min_points))


if __name__ == "__main__":
    sys.exit(main())
