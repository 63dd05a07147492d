"""Evaluation conventions as named presets (tools/inference_ddp.py --eval_preset): the three published ways to
turn the same detections into AP, each written into eval.yaml with its numbers.

- ``opencood`` (the default, today's numbers): per-frame order (each frame's detections score-sorted, frames
  concatenated in dataset order; ``--global_sort_detections``: global sort); the run's ``postprocess.gt_range``,
  else upstream's GT_RANGE; GT and detections: all 8 corners' x, y inside. OpenCOOD ``utils/eval_utils.py``.
- ``heal``: global sort by score; x +-102.4, y +-51.2 and the z of ``cav_lidar_range`` (HEAL's
  ``inference.py --range 102.4,51.2``, HEAL issue 23); GT: all 8 corners' x, y inside, z untested
  (``base_postprocessor.py: generate_gt_bbx``); detections: x, y and z (``voxel_postprocessor.py: post_process``).
  HEAL ``utils/eval_utils.py: calculate_ap``.
- ``v2v4real``: per-frame order; V2V4Real's GT_RANGE [-100, -40, -5, 100, 40, 3], all 8 corners' x, y inside;
  AP at IoU 0.5 and 0.7 per distance band 0-30, 30-50, 50-100 m (``metrics/conventions.py``). V2V4Real
  ``data_utils/datasets/__init__.py``, ``utils/eval_utils.py``, ``tools/inference.py``.

Every preset reports AP at IoU 0.3, 0.5 and 0.7 (V2V4Real publishes 0.5 and 0.7). The area reaches every stage as
``postprocess.gt_range`` of the evaluated hypes: the datasets project test-time GT with it (all 8 corners inside,
z included, as all three upstreams' ``project_world_objects``), the post-processor keeps GT and detections whose
corners' x, y lie inside; HEAL's preset then also tests the detections' z. ``opencood`` leaves the hypes as they
are, so its numbers are today's, bit for bit.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

import numpy as np
import torch

from opencood_ddp.data.ground_truth import GT_RANGE, evaluation_gt_range
from opencood_ddp.data.sources.v2v4real import V2V4REAL_GT_RANGE
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import range6
from opencood_ddp.metrics import FrameStats
from opencood_ddp.metrics.communication import CommunicationSummary
from opencood_ddp.metrics.conventions import (AP_CONVENTIONS, BAND_IOU_THRESHOLDS, V2V4REAL_BANDS, DistanceBand,
                                              band_ap_key, band_stats, corners_inside_range)
from opencood_ddp.metrics.summary import DetectionMetric

DEFAULT_PRESET = "opencood"
PRESETS = ("opencood", "heal", "v2v4real")
# HEAL's `inference.py --range X,Y` sets gt_range to x +-X, y +-Y and keeps cav_lidar_range's z; its maintainer
# evaluated the DAIR-V2X LiDAR checkpoints with --range 102.4,51.2 (github.com/yifanlu0227/HEAL/issues/23).
HEAL_XY = (102.4, 51.2)


@dataclass(frozen=True)
class EvalConvention:
    """One preset made concrete for a run: its ranking, its area (6 numbers), whether detections are tested on
    z too, and its distance bands. Picklable; the per-frame half runs on every rank, the summary on rank 0."""

    preset: str = DEFAULT_PRESET
    global_sort: bool = False
    eval_range: Tuple[float, ...] = GT_RANGE
    pred_range_z: bool = False
    bands: Tuple[DistanceBand, ...] = ()

    @property
    def ap_convention(self) -> str:
        return AP_CONVENTIONS[self.global_sort]

    def eval_hypes(self, hypes: dict) -> dict:
        """The hypes the dataset and post-processor are built from: the preset's area as ``postprocess.gt_range``
        (a copy); opencood's hypes untouched."""
        if self.preset == DEFAULT_PRESET:
            return hypes
        hypes = copy.deepcopy(hypes)
        hypes.setdefault("postprocess", {})["gt_range"] = [float(v) for v in self.eval_range]
        return hypes

    def predictions(self, boxes: torch.Tensor, scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The detections the convention evaluates: HEAL's also have every corner's z inside the area."""
        if not self.pred_range_z or len(boxes) == 0:
            return boxes, scores
        keep = corners_inside_range(boxes.detach().cpu().numpy(), self.eval_range, with_z=True)
        keep_tensor = torch.as_tensor(keep, device=boxes.device)
        return boxes[keep_tensor], scores[keep_tensor]

    def with_bands(self, stats: FrameStats, boxes: Any, scores: Any, gt: Any) -> FrameStats:
        """The frame's record with its per-band statistics (tensors or arrays in), where the convention has
        bands; ``replace`` keeps the record's class and fields (MeteredFrameStats' communication)."""
        if not self.bands:
            return stats
        arrays = [_numpy(value) for value in (boxes, scores, gt)]
        return dataclasses.replace(stats, bands=band_stats(*arrays, self.bands))

    def record(self) -> dict:
        """eval.yaml's description of the convention, written before the numbers it produced."""
        record = {"eval_preset": self.preset, "ap_convention": self.ap_convention,
                  "eval_range": [float(v) for v in self.eval_range],
                  "pred_range_test": "xyz" if self.pred_range_z else "xy"}
        if self.bands:
            record["distance_bands"] = [[float(low), float(high)] for low, high in self.bands]
        return record

    def metric(self, communication: Optional[CommunicationSummary] = None,
               evaluated: Optional[Mapping[str, Any]] = None) -> DetectionMetric:
        """The metric the engine's evaluator calls on rank 0: eval.yaml's content in this convention, after
        ``evaluated`` (what was evaluated: the split and the fusion method)."""
        return DetectionMetric(self.record(), self.global_sort, self.bands, communication, dict(evaluated or {}))

    def describe(self) -> str:
        area = ", ".join(f"{v:g}" for v in self.eval_range)
        return f"eval preset {self.preset}: {self.ap_convention}, range [{area}] ({self.record()['pred_range_test']})"


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def preset_global_sort(preset: str, global_sort: bool) -> bool:
    """Whether the preset ranks detections globally; ``global_sort`` is --global_sort_detections. It chooses for
    opencood, is what heal does anyway, and contradicts v2v4real (one error line)."""
    if preset not in PRESETS:
        raise ConfigError(f"--eval_preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if preset == "v2v4real" and global_sort:
        raise ConfigError("--global_sort_detections contradicts --eval_preset v2v4real, whose AP keeps the "
                          "per-frame order (as V2V4Real's eval_utils); drop one of the two flags")
    return global_sort or preset == "heal"


def eval_convention(preset: str, global_sort: bool, hypes: Mapping, source: str) -> EvalConvention:
    """The preset made concrete for the run's hypes (opencood's area is the run's; heal's z is its
    ``postprocess.anchor_args.cav_lidar_range``'s, as HEAL's --range keeps it)."""
    ranked = preset_global_sort(preset, global_sort)
    if preset == "heal":
        lidar = range6(hypes, "postprocess.anchor_args.cav_lidar_range", source)
        x, y = HEAL_XY
        return EvalConvention("heal", ranked, (-x, -y, lidar[2], x, y, lidar[5]), pred_range_z=True)
    if preset == "v2v4real":
        return EvalConvention("v2v4real", ranked, V2V4REAL_GT_RANGE, bands=V2V4REAL_BANDS)
    return EvalConvention(DEFAULT_PRESET, ranked, tuple(evaluation_gt_range(hypes, source)))


def result_suffix(preset: str, global_sort: bool) -> str:
    """'' (eval.yaml), '_global_sort' (opencood with --global_sort_detections), '_heal', '_v2v4real': one file
    per convention, so that evaluating a run in another convention never overwrites a number."""
    if preset != DEFAULT_PRESET:
        return f"_{preset}"
    return "_global_sort" if global_sort else ""


def band_rows(summary: Mapping) -> List[str]:
    """The report's table of the band APs in ``summary`` (v2v4real's), for rank 0's log; [] without bands."""
    bands = [tuple(band) for band in summary.get("distance_bands") or ()]
    if not bands:
        return []
    header = "| distance | " + " | ".join(f"AP@{t:g}" for t in BAND_IOU_THRESHOLDS) + " |"
    rows = [f"| {low:g}-{high:g} m | " + " | ".join(f"{summary[band_ap_key(t, (low, high))]:.4f}"
                                                    for t in BAND_IOU_THRESHOLDS) + " |" for low, high in bands]
    return [header, "|---|" + "---:|" * len(BAND_IOU_THRESHOLDS)] + rows


__all__ = ["DEFAULT_PRESET", "PRESETS", "HEAL_XY", "EvalConvention", "eval_convention",
           "preset_global_sort", "result_suffix", "band_rows"]
