"""The training labels as indices in the hand-over, spread into upstream's arrays on the rank's device.

Under ``preprocess.on_device`` a worker hands over, per sample, only what is not zero or one: the positive anchors,
their box codes and direction sectors, and the anchors whose ``neg_equal_one`` differs from the frame's usual value
(``SparseLabels``). On an OPV2V grid that is a few kB, where the label arrays are 2.5 MB of float32 (70,400 anchors:
``pos_equal_one``, ``neg_equal_one`` and 7 codes each), which a worker had to fill, stack and copy into shared
memory. ``SparseLabelBatch.on_device`` (called by the task's ``move_to``, ``data/device_points.prepare_batch``)
writes the batch's arrays on the device: the same values and dtypes as ``VoxelPostprocessor.collate_batch`` of the
dense labels, bit for bit (tests/test_sparse_labels.py), since every entry is either a constant or a value the worker
computed and rounded exactly as the dense path does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from opencood_ddp.data.device_points import DeviceWork
from opencood_ddp.postprocess.direction import DirectionArgs, heading_sectors
from opencood_ddp.postprocess.targets import LABEL_DTYPE, Assignment


@dataclass
class SparseLabels:
    """One sample's labels by index (module docstring)."""

    shape: Tuple[int, int, int]             # (H, W, A)
    positive: np.ndarray                    # (P,) int64 anchor indices in (H, W, A) order
    residuals: np.ndarray                   # (P, 7) float32: the positives' targets
    negative_default: bool                  # neg_equal_one of most anchors
    negative_flipped: np.ndarray            # (Q,) int64: the anchors whose neg_equal_one is the other value
    sectors: Optional[np.ndarray] = None    # (P,) int64: the positives' dir_targets, with dir_args
    default_sectors: Optional[np.ndarray] = None  # (A,) int64: dir_targets of an anchor without a target

    @classmethod
    def of(cls, assignment: Assignment, direction: Optional[DirectionArgs]) -> "SparseLabels":
        rows, cols, num = assignment.shape
        negatives = int(np.count_nonzero(assignment.negative))
        default = negatives * 2 >= len(assignment.negative)  # the commoner value: the fewer exceptions
        flipped = np.flatnonzero(assignment.negative != default).astype(np.int64)
        sectors = defaults = None
        if direction is not None:  # direction_targets' arithmetic on the float64 residuals, as the dense path
            yaws = np.asarray(direction.anchor_yaw)
            sectors = heading_sectors(assignment.residuals[:, 6], yaws[assignment.positive % num], direction)
            defaults = heading_sectors(np.zeros(num), yaws, direction)
        return cls((rows, cols, num), assignment.positive, assignment.residuals.astype(LABEL_DTYPE), bool(default),
                   flipped, sectors, defaults)


def _concatenated(arrays: Sequence[np.ndarray], dtype: type, width: Tuple[int, ...] = ()) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros((0,) + width, dtype=dtype)


@dataclass
class SparseLabelBatch(DeviceWork):
    """A batch's ``SparseLabels``, concatenated; ``on_device`` gives ``collate_batch``'s dict of label tensors."""

    shape: Tuple[int, int, int]
    positive_counts: np.ndarray     # (B,) int64
    positive: np.ndarray            # (sum P,) int64
    residuals: np.ndarray           # (sum P, 7) float32
    negative_default: np.ndarray    # (B,) bool
    flipped_counts: np.ndarray      # (B,) int64
    negative_flipped: np.ndarray    # (sum Q,) int64
    sectors: Optional[np.ndarray]   # (sum P,) int64
    default_sectors: Optional[np.ndarray]  # (A,) int64

    @classmethod
    def collate(cls, labels: Sequence[SparseLabels]) -> "SparseLabelBatch":
        first = labels[0]
        if any(label.shape != first.shape for label in labels):
            raise ValueError("the samples of one batch have labels of different anchor grids")
        directed = first.sectors is not None
        return cls(first.shape, np.array([len(label.positive) for label in labels], dtype=np.int64),
                   _concatenated([label.positive for label in labels], np.int64),
                   _concatenated([label.residuals for label in labels], LABEL_DTYPE, (7,)),
                   np.array([label.negative_default for label in labels], dtype=bool),
                   np.array([len(label.negative_flipped) for label in labels], dtype=np.int64),
                   _concatenated([label.negative_flipped for label in labels], np.int64),
                   _concatenated([label.sectors for label in labels], np.int64) if directed else None,
                   first.default_sectors)

    def on_device(self, device: torch.device) -> Dict[str, torch.Tensor]:
        rows, cols, num = self.shape
        count, batch = rows * cols * num, len(self.positive_counts)

        def flat_index(counts: np.ndarray, index: np.ndarray) -> torch.Tensor:
            sample = np.repeat(np.arange(batch, dtype=np.int64), counts)
            return torch.from_numpy(sample * count + index).to(device)

        positive = flat_index(self.positive_counts, self.positive)
        pos_equal_one = torch.zeros(batch * count, dtype=torch.float32, device=device)
        pos_equal_one[positive] = 1
        targets = torch.zeros((batch * count, 7), dtype=torch.float32, device=device)
        targets[positive] = torch.from_numpy(self.residuals).to(device)
        default = torch.from_numpy(self.negative_default).to(device)
        neg_equal_one = default.to(torch.float32).repeat_interleave(count)
        flipped_sample = np.repeat(np.arange(batch, dtype=np.int64), self.flipped_counts)
        neg_equal_one[flat_index(self.flipped_counts, self.negative_flipped)] = \
            (~default[torch.from_numpy(flipped_sample).to(device)]).to(torch.float32)
        labels = {"targets": targets.reshape(batch, rows, cols, num * 7),
                  "pos_equal_one": pos_equal_one.reshape(batch, rows, cols, num),
                  "neg_equal_one": neg_equal_one.reshape(batch, rows, cols, num)}
        if self.sectors is not None:
            sectors = torch.from_numpy(self.default_sectors).to(device).repeat(batch * rows * cols)
            sectors[positive] = torch.from_numpy(self.sectors).to(device)
            labels["dir_targets"] = sectors.reshape(batch, rows, cols, num)
        return labels


__all__ = ["SparseLabels", "SparseLabelBatch"]
