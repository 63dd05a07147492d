"""The point work on the rank's device: workers hand over clouds as read, the training process voxelizes them.

With ``preprocess.on_device: true`` a dataset's sample carries, in place of ``processed_lidar``'s voxels, a
``RawLidar``: each CAV's cloud as its source read it (``RawCloud``), with what the CPU path would do to it: the
projection into the ego frame, the sample's augmentation, and the key of its shuffle. The collate packs a batch's
clouds into one ``CloudBatch`` (one shared-memory segment for the points), and ``prepare_batch`` (the task's
``move_to``) moves it to the device and runs the CPU path's steps there, over all clouds at once:

0. the intensity of clouds handed over as the file stores them (OPV2V's binary records: a packed colour), decoded
   as ``read_pcd`` decodes it;
1. shuffle: each cloud's points in the order of a keyed hash of their index (``hash_order``), a permutation keyed
   by (seed, epoch, sample index, CAV slot) as the CPU path's ``sample_rng`` is: the same order on every device, at
   any worker count and world size, and after a resume;
2. the non-finite report (``tell_non_finite``: once per file and process, as the CPU path);
3. the ego car's own hits removed (in the CAV's frame), the projection (float64, as ``transform_points``), the
   augmentation (its operations' float64 arithmetic), the range crop (float32 comparisons, as
   ``points_in_range_mask``); late fusion crops before it augments, as its CPU path;
4. voxelization by ``sorted_voxels.voxelize_groups``: spconv's CPU generator's result, bit for bit, on any device.

What differs from the CPU path is the shuffle's draws: numpy's ``Generator.permutation`` costs 2.1 ms a 90,700-point
cloud in a worker and cannot run on a GPU, so the device path draws its own permutation, and the sample's
Generator no longer draws the shuffles before the augmentation. Given the same order, the two paths give the same
voxels (tests/test_device_points.py); docs/compatibility.md has the row. Nothing here knows about ranks.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from opencood_ddp.data.geometry import EGO_X_RANGE, EGO_Y_RANGE
from opencood_ddp.data.pcd import RED_TO_INTENSITY, colour_intensity
from opencood_ddp.data.sorted_voxels import VoxelGrid, voxelize_groups
from opencood_ddp.errors import ConfigError

# Mixed into the shuffle's seed sequence so that its key never equals a word of the sample's Generator's stream.
SHUFFLE_STREAM = 0x5348_5546
_MASK32 = 0xFFFF_FFFF

_REPORTED_FILES: set = set()  # per process: each file's non-finite points are told once


def tell_non_finite(path: Any, bad: int, total: int) -> None:
    """Say once per file, in this process's log, that ``bad`` of ``total`` points have a non-finite x, y or z. They
    are dropped where upstream drops them (the range crop: a NaN compares false), so the data do not change; the
    user learns that the file is damaged."""
    if bad and str(path) not in _REPORTED_FILES:
        _REPORTED_FILES.add(str(path))
        logging.getLogger("opencood_ddp").warning(
            f"{path}: {bad} of {total} points have non-finite coordinates and are dropped; the file is "
            f"damaged (regenerate or restore it if this is not expected)")


# ------------------------------------------------------------------------------------------------ the shuffle


def shuffle_key(seed: int, epoch: int, index: int, slot: int) -> Tuple[int, int]:
    """Two 32-bit words keying the shuffle of CAV ``slot``'s cloud in sample ``index`` of ``epoch``: numpy's
    SeedSequence of the same integers as ``sample_rng``'s, plus the CAV and a stream tag."""
    words = np.random.SeedSequence([int(seed), int(epoch), int(index), int(slot), SHUFFLE_STREAM]).generate_state(2)
    return int(words[0]), int(words[1])


# Odd multipliers below 2^31: a product with a value below 2^32 stays below 2^63, so int64 holds it exactly on every
# device (no overflow to rely on), and the product mod 2^32 is one mask.
_MULTIPLIERS = (0x7FEB352D, 0x1B873593)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) that scatters nearby inputs: xor-shifts and odd multipliers mod 2^32 (the form of
    Wellons' "lowbias32", with multipliers below 2^31)."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 16)


def cloud_of_points(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) each point's cloud, for clouds of ``lengths`` laid end to end (``total`` their sum, known on the
    host, so that no host sync asks for it)."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths, output_size=total)


def hash_order(lengths: torch.Tensor, keys: torch.Tensor, cloud: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The shuffled order of clouds of ``lengths`` laid end to end: each cloud's points sorted by
    ``mix32(mix32(i ^ key0) ^ key1)`` of their index ``i`` in the cloud, the clouds kept in their order. The hash
    is a bijection of ``i``, so no two points tie and the order is the same on every device. ``cloud``: each
    point's cloud, where the caller has it."""
    cloud = cloud_of_points(lengths, int(lengths.sum())) if cloud is None else cloud
    starts = torch.cumsum(lengths, 0) - lengths
    local = torch.arange(len(cloud), device=lengths.device) - starts[cloud]
    hashed = _mix32(_mix32(local ^ keys[cloud, 0]) ^ keys[cloud, 1])
    return torch.argsort((cloud << 32) | hashed)


# ------------------------------------------------------------------------------------------------ what travels


@dataclass
class RawCloud:
    """One CAV's cloud as a worker hands it over, with what the CPU path would do to it."""

    points: np.ndarray                      # (N, 4) float32 as stored (``SplitSource.stored_points``)
    key: Tuple[int, int]                    # shuffle_key of (seed, epoch, index, slot)
    path: str                               # the file, for the non-finite report
    to_ego: Optional[np.ndarray] = None     # (4, 4) float64 projection, None: stays in its own frame
    augment: Tuple[Any, ...] = ()           # the sample's augmentation operations (data/augment.py), in order
    colour_bits: bool = False               # column 3 holds a packed colour's bits, decoded on the device

    def decoded(self) -> np.ndarray:
        """The points as ``read_pcd`` gives them (pictures; tests)."""
        if not self.colour_bits:
            return self.points
        points = np.array(self.points)
        points[:, 3] = colour_intensity(self.points[:, 3].view(np.uint32))
        return points


@dataclass
class RawLidar:
    """A sample's ``processed_lidar`` under ``preprocess.on_device``: its clouds and how they are voxelized."""

    clouds: List[RawCloud]
    grid: VoxelGrid
    separate: bool      # each cloud voxelized on its own (intermediate fusion) or all together (early fusion)
    crop_first: bool    # late fusion crops in the CAV's frame before it augments


class DeviceWork:
    """An entry of a collated batch that the worker left for the device: ``prepare_batch`` replaces it with
    ``on_device(device)``."""

    def on_device(self, device: torch.device) -> Any:
        raise NotImplementedError


@dataclass
class CloudBatch(DeviceWork):
    """A batch's clouds packed by the collate: what ``prepare_batch`` voxelizes on the device."""

    points: torch.Tensor        # (T, C) float32, the clouds end to end
    lengths: np.ndarray         # (K,) int64
    keys: np.ndarray            # (K, 2) int64
    groups_of_clouds: np.ndarray  # (K,) int64: the voxel group (the collated batch index) of each cloud
    groups: int
    to_ego: Optional[np.ndarray]  # (K, 4, 4) float64, or None when no cloud is projected
    transforms: List[Tuple[int, int, Tuple[Any, ...]]]  # (first cloud, end cloud, operations) spans to augment
    paths: List[str]
    colour_bits: np.ndarray     # (K,) bool: the clouds whose column 3 is a packed colour's bits
    grid: VoxelGrid
    crop_first: bool

    def pin_memory(self) -> "CloudBatch":
        """DataLoader's pin_memory calls this: the points pinned, so that their copy to the GPU is asynchronous."""
        return replace(self, points=self.points.pin_memory())

    def on_device(self, device: torch.device) -> Dict[str, torch.Tensor]:
        """The batch's ``processed_lidar`` on ``device`` (module docstring)."""
        lengths = torch.from_numpy(self.lengths).to(device)
        cloud = cloud_of_points(lengths, len(self.points))
        points = self.decoded(self.points.to(device, non_blocking=True), cloud)
        points = points[hash_order(lengths, torch.from_numpy(self.keys).to(device), cloud)]
        self.report_non_finite(points, cloud)
        keep = ~ego_hits(points)
        if self.to_ego is not None:
            points = project(points, torch.from_numpy(self.to_ego).to(device), cloud)
        if self.crop_first:
            keep &= in_range(points, self.grid.lidar_range)
        points = self.augmented(points)
        if not self.crop_first:
            keep &= in_range(points, self.grid.lidar_range)
        groups = torch.from_numpy(self.groups_of_clouds).to(device)[cloud]
        return voxelize_groups(points, groups, self.groups, self.grid, keep)

    def decoded(self, points: torch.Tensor, cloud: torch.Tensor) -> torch.Tensor:
        """Column 3 of the clouds stored with a packed colour turned into ``read_pcd``'s intensity: the red byte
        (bits 16-23) looked up in its table. Before any other step: only a copy may touch those bits."""
        if not self.colour_bits.any():
            return points
        red = (points[:, 3].view(torch.int32) >> 16) & 0xFF
        intensity = torch.from_numpy(RED_TO_INTENSITY).to(points.device)[red.long()]
        if not self.colour_bits.all():
            packed = torch.from_numpy(self.colour_bits).to(points.device)[cloud]
            intensity = torch.where(packed, intensity, points[:, 3])
        points = points.clone()
        points[:, 3] = intensity
        return points

    def report_non_finite(self, points: torch.Tensor, cloud: torch.Tensor) -> None:
        bad = (~torch.isfinite(points[:, :3])).any(dim=1).to(torch.long)
        counts = torch.zeros(len(self.lengths), dtype=torch.long, device=points.device).scatter_add_(0, cloud, bad)
        for path, count, total in zip(self.paths, counts.cpu().tolist(), self.lengths.tolist()):  # one host sync
            tell_non_finite(path, int(count), total)

    def augmented(self, points: torch.Tensor) -> torch.Tensor:
        """Each span's operations on its clouds' rows, in the CPU path's arithmetic (data/augment.py)."""
        if not self.transforms:
            return points
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        points = points.clone()
        for first, end, operations in self.transforms:
            rows = slice(int(bounds[first]), int(bounds[end]))
            for operation in operations:
                points[rows] = apply_operation(operation, points[rows])
        return points


# ------------------------------------------------------------------------------------------------ the steps


def ego_hits(points: torch.Tensor) -> torch.Tensor:
    """(N,) True for hits on the CAV itself, in its own frame: ``geometry.ego_points_mask``'s inclusive box, compared
    in the points' dtype as numpy compares a float32 column with a Python float."""
    x, y = points[:, 0], points[:, 1]
    bounds = torch.tensor(EGO_X_RANGE + EGO_Y_RANGE, dtype=points.dtype, device=points.device)
    return (x >= bounds[0]) & (x <= bounds[1]) & (y >= bounds[2]) & (y <= bounds[3])


def in_range(points: torch.Tensor, lidar_range: Sequence[float]) -> torch.Tensor:
    """(N,) x, y, z strictly inside the range, compared in the points' dtype (``points_in_range_mask``)."""
    bounds = torch.tensor(lidar_range, dtype=points.dtype, device=points.device)
    inside = (points[:, 0] > bounds[0]) & (points[:, 0] < bounds[3])
    for axis in (1, 2):
        inside &= (points[:, axis] > bounds[axis]) & (points[:, axis] < bounds[axis + 3])
    return inside


def project(points: torch.Tensor, matrices: torch.Tensor, cloud: torch.Tensor) -> torch.Tensor:
    """Each point's xyz through its cloud's (4, 4) matrix in float64, rounded once to the points' dtype, as
    ``geometry.transform_points``; the sums in a fixed order, one operation at a time, so every device rounds
    alike."""
    rows = matrices[:, :3, :].reshape(-1, 12)[cloud]  # (N, 12): the matrix's first three rows per point
    xyz = points[:, :3].to(torch.float64)
    out = points.clone()
    for axis in range(3):
        coefficient = rows[:, 4 * axis:4 * axis + 4]
        moved = xyz[:, 0] * coefficient[:, 0] + xyz[:, 1] * coefficient[:, 1]
        moved = moved + xyz[:, 2] * coefficient[:, 2]
        out[:, axis] = (moved + coefficient[:, 3]).to(points.dtype)
    return out


def apply_operation(operation: Any, points: torch.Tensor) -> torch.Tensor:
    """One augmentation operation (``augment.Flip``, ``Rotation``, ``Scaling``) in its numpy arithmetic."""
    name = type(operation).__name__
    out = points.clone()
    if name == "Flip":
        column = 1 if operation.axis == "x" else 0
        out[:, column] = -out[:, column]
    elif name == "Rotation":
        cos, sin = math.cos(operation.angle), math.sin(operation.angle)  # augment.Rotation's
        x, y = points[:, 0].to(torch.float64), points[:, 1].to(torch.float64)
        out[:, 0] = (x * cos - y * sin).to(points.dtype)
        out[:, 1] = (x * sin + y * cos).to(points.dtype)
    elif name == "Scaling":
        out[:, :3] = (points[:, :3].to(torch.float64) * operation.factor).to(points.dtype)
    else:
        raise TypeError(f"unknown augmentation operation {operation!r}")
    return out


# ------------------------------------------------------------------------------------------------ collate and move


def _packed(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """The clouds end to end in one float32 tensor; in a DataLoader worker, in shared memory from the start, so that
    the hand-over does not copy it again (DataLoader's own collate does the same)."""
    rows = sum(len(a) for a in arrays)
    width = arrays[0].shape[1] if arrays else 4
    out = torch.empty((rows, width), dtype=torch.float32)
    if get_worker_info() is not None:
        out.share_memory_()
    if rows:
        np.concatenate([np.asarray(a, dtype=np.float32) for a in arrays], out=out.numpy())
    return out


def collate_raw(lidars: Sequence[RawLidar]) -> CloudBatch:
    """A batch's ``RawLidar`` entries -> one ``CloudBatch``; the voxel groups number the samples' clouds (separate)
    or the samples in batch order, as ``collate_voxels`` numbers them on the CPU path."""
    first = lidars[0]
    if any(lidar.grid != first.grid or lidar.crop_first != first.crop_first for lidar in lidars):
        raise ValueError("the samples of one batch come from datasets with different voxel settings")
    clouds = [cloud for lidar in lidars for cloud in lidar.clouds]
    groups, transforms, start, group = [], [], 0, 0
    for lidar in lidars:
        count = len(lidar.clouds)
        groups.extend(range(group, group + count) if lidar.separate else [group] * count)
        group += count if lidar.separate else 1
        operations = lidar.clouds[0].augment if count else ()
        if operations:  # one transform per sample: its clouds are consecutive
            transforms.append((start, start + count, operations))
        start += count
    projected = [cloud.to_ego is not None for cloud in clouds]
    if any(projected) and not all(projected):
        raise ValueError("a batch mixes projected clouds with clouds left in their own frames")
    return CloudBatch(points=_packed([cloud.points for cloud in clouds]),
                      lengths=np.array([len(cloud.points) for cloud in clouds], dtype=np.int64),
                      keys=np.array([cloud.key for cloud in clouds], dtype=np.int64).reshape(-1, 2),
                      groups_of_clouds=np.array(groups, dtype=np.int64), groups=group,
                      to_ego=np.stack([cloud.to_ego for cloud in clouds]) if clouds and all(projected) else None,
                      transforms=transforms, paths=[cloud.path for cloud in clouds],
                      colour_bits=np.array([cloud.colour_bits for cloud in clouds], dtype=bool), grid=first.grid,
                      crop_first=first.crop_first)


# The batch keys that stay on the host: the few numbers per sample that say how its CAVs are laid out and where
# they stand. The models derive indices and decisions from them (models/modules/cav_layout.py); on the host that
# is arithmetic on a few hundred bytes, on a GPU each read would stall the step until the device caught up.
HOST_KEYS = frozenset({"record_len", "pairwise_t_matrix", "prior_encoding", "spatial_correction_matrix"})


def prepare_batch(batch: Any, device: torch.device) -> Any:
    """The task's ``move_to``: every tensor of a nested batch moved to ``device``, but those under ``HOST_KEYS``,
    and every ``DeviceWork`` done there (a ``CloudBatch`` voxelized, ``postprocess/sparse_labels``' labels spread).
    A batch that holds the same entry twice (an evaluation batch of one frame is both the frame and the model's
    input) is done once."""
    done: Dict[int, Any] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, DeviceWork):
            if id(value) not in done:
                done[id(value)] = value.on_device(torch.device(device))
            return done[id(value)]
        if isinstance(value, Mapping):
            if id(value) not in done:
                done[id(value)] = {key: item if key in HOST_KEYS else walk(item) for key, item in value.items()}
            return done[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item) for item in value)
        return value

    return walk(batch)


def voxel_grid_of(preprocessor: Any, source: str) -> VoxelGrid:
    """The pre-processor's settings as a ``VoxelGrid``, or one ConfigError line when it has no device form."""
    grid = getattr(preprocessor, "voxel_grid", None)
    if not callable(grid):
        raise ConfigError(f"{source}: preprocess.on_device needs a pre-processor that voxelizes on the "
                          f"device (SpVoxelPreprocessor); {type(preprocessor).__name__} has no voxel_grid(); "
                          f"set preprocess.on_device false")
    return grid()


__all__ = ["SHUFFLE_STREAM", "DeviceWork", "RawCloud", "RawLidar", "CloudBatch", "shuffle_key", "hash_order", "collate_raw",
           "prepare_batch", "voxel_grid_of", "tell_non_finite", "ego_hits", "in_range", "project",
           "apply_operation"]
