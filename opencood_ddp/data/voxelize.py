"""Point cloud -> pillars/voxels with spconv, in upstream OpenCOOD's ``SpVoxelPreprocessor`` layout.

Upstream (``opencood/data_utils/pre_processor/sp_voxel_preprocessor.py``) wraps spconv 1.x's
``VoxelGenerator(voxel_size, point_cloud_range=cav_lidar_range, max_num_points=max_points_per_voxel,
max_voxels=max_voxel_train if train else max_voxel_test)`` and returns, as numpy:

- ``voxel_features``   (M, P, C) float32: the points of each voxel, zero-padded to P = max_points_per_voxel;
- ``voxel_coords``     (M, 3) int32: the voxel's grid index in **(z, y, x)** order;
- ``voxel_num_points`` (M,) int32: how many of the P rows are real points.

spconv 2.x's ``PointToVoxel`` gives the same layout and rules: a point is kept when
``floor((p - min) / voxel_size)`` lies in ``[0, grid)`` on every axis, with grid = round(range / voxel
size); voxels appear in the order their first point appears; a voxel keeps its first P points; voxels past
``max_voxels`` are dropped. On CPU it runs sequentially, so the same points (in the same order) always give
the same voxels. The CUDA kernel (``device='cuda'``) fills a hash table with atomics, so its voxel order is
not guaranteed to be reproducible; the datasets voxelize on CPU inside DataLoader workers.

spconv's compiled module is loaded where a ``Voxelizer`` is made: the main process, which builds the datasets
before the loaders fork their workers. So a worker never loads a CUDA build of spconv for the first time in a
child forked from a process that holds a CUDA context (CUDA does not support being set up again after a fork),
each worker is spared the import, and a missing spconv is one ConfigError line there, not a worker's traceback.
Importing this module alone still loads nothing of spconv.

``collate_voxels`` is upstream's ``collate_batch``: concatenate and prepend the sample (or CAV) index.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Sequence, Union

import numpy as np
import torch

from opencood_ddp.data.sorted_voxels import VoxelGrid
from opencood_ddp.errors import ConfigError
from opencood_ddp.yaml_parsers import voxel_grid_cells

VOXEL_KEYS = ("voxel_features", "voxel_coords", "voxel_num_points")


def _check_triplet(values: Sequence[float], name: str, length: int) -> List[float]:
    if len(values) != length or not all(isinstance(v, (int, float)) for v in values):
        raise ConfigError(f"{name} must be {length} numbers, got {values!r}; fix preprocess in the hypes")
    return [float(v) for v in values]


def point_to_voxel_class() -> type:
    """spconv 2.x's ``PointToVoxel``, imported on the first call so that importing the datasets loads none of
    spconv's compiled ops; one ConfigError line when spconv cannot be imported."""
    try:
        from spconv.pytorch.utils import PointToVoxel
    except ImportError as exc:
        raise ConfigError(f"voxelization (preprocess.core_method SpVoxelPreprocessor) needs spconv 2.x, and it "
                          f"cannot be imported ({exc}); install spconv (CPU) or the spconv-cuXXX wheel of your "
                          f"CUDA") from None
    return PointToVoxel


class Voxelizer:
    """Callable ``points (N, >=C) -> {'voxel_features', 'voxel_coords', 'voxel_num_points'}`` (numpy).

    The spconv generator holds (max_voxels, P, C) buffers; it is built lazily in the process that first uses
    it and is left out when the object is pickled (DataLoader workers build their own).
    """

    def __init__(self, voxel_size: Sequence[float], lidar_range: Sequence[float], max_points_per_voxel: int,
                 max_voxels: int, num_point_features: int = 4, device: Union[str, torch.device] = "cpu"):
        self.voxel_size = _check_triplet(voxel_size, "preprocess.args.voxel_size", 3)
        self.lidar_range = _check_triplet(lidar_range, "preprocess.cav_lidar_range", 6)
        if min(self.voxel_size) <= 0:
            raise ConfigError(f"preprocess.args.voxel_size must be positive, got {voxel_size!r}; fix the hypes")
        if any(self.lidar_range[k + 3] <= self.lidar_range[k] for k in range(3)):
            raise ConfigError(f"preprocess.cav_lidar_range must be [x_min, y_min, z_min, x_max, y_max, z_max] with "
                              f"min < max, got {lidar_range!r}; fix the hypes")
        if max_points_per_voxel < 1 or max_voxels < 1 or num_point_features < 3:
            raise ConfigError(f"max_points_per_voxel ({max_points_per_voxel}) and max_voxels ({max_voxels}) must "
                              f"be >= 1 and num_point_features ({num_point_features}) >= 3; fix preprocess.args")
        self.max_points_per_voxel = int(max_points_per_voxel)
        self.max_voxels = int(max_voxels)
        self.num_point_features = int(num_point_features)
        self.device = torch.device(device)
        self._generator = None
        point_to_voxel_class()  # loaded before any fork (module docstring)

    @classmethod
    def from_hypes(cls, preprocess: Mapping, train: bool, device: Union[str, torch.device] = "cpu") -> "Voxelizer":
        """Upstream's choice: ``max_voxel_train`` for a training dataset, ``max_voxel_test`` otherwise."""
        args = preprocess["args"]
        max_voxels = args["max_voxel_train"] if train else args["max_voxel_test"]
        return cls(args["voxel_size"], preprocess["cav_lidar_range"], args["max_points_per_voxel"], max_voxels,
                   device=device)

    @property
    def grid_size(self) -> np.ndarray:
        """(x, y, z) number of voxels, as spconv's generator counts them (``yaml_parsers.voxel_grid_cells``)."""
        return np.array(voxel_grid_cells(self.lidar_range, self.voxel_size), dtype=np.int64)

    def voxel_buffer_bytes(self) -> int:
        """What spconv's generator allocates whole for its voxels: (max_voxels, P, C) float32 points, and int32
        coordinates and counts."""
        return 4 * self.max_voxels * (self.max_points_per_voxel * self.num_point_features + 4)

    def grid_hash_bytes(self) -> int:
        """The generator's other whole allocation on the CPU: an int32 hash entry for every cell of the grid."""
        return 4 * math.prod(int(n) for n in self.grid_size)

    def voxel_grid(self) -> VoxelGrid:
        """These settings as ``sorted_voxels.VoxelGrid``: the device path's voxelizer (``preprocess.on_device``)."""
        return VoxelGrid(tuple(self.voxel_size), tuple(self.lidar_range), self.max_points_per_voxel,
                         self.max_voxels, self.num_point_features)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_generator"] = None  # torch buffers of tens of MB: rebuilt where they are used
        return state

    def _point_to_voxel(self):
        if self._generator is None:
            self._generator = point_to_voxel_class()(
                vsize_xyz=self.voxel_size, coors_range_xyz=self.lidar_range,
                num_point_features=self.num_point_features, max_num_voxels=self.max_voxels,
                max_num_points_per_voxel=self.max_points_per_voxel, device=self.device)
        return self._generator

    def __call__(self, points: np.ndarray) -> Dict[str, np.ndarray]:
        points = np.asarray(points)
        if points.ndim != 2 or points.shape[1] < self.num_point_features:
            raise ValueError(f"points must have shape (N, >={self.num_point_features}), got {points.shape}")
        cloud = torch.from_numpy(np.ascontiguousarray(points[:, :self.num_point_features], dtype=np.float32))
        voxels, coords, num_points = self._point_to_voxel()(cloud.to(self.device))
        return {"voxel_features": voxels.cpu().numpy(),
                "voxel_coords": coords.cpu().numpy(),
                "voxel_num_points": num_points.cpu().numpy()}


def collate_voxels(voxel_dicts: Sequence[Mapping[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
    """Upstream ``collate_batch``: concatenate, coords become (batch_index, z, y, x) with the list position."""
    features = [d["voxel_features"] for d in voxel_dicts]
    num_points = [d["voxel_num_points"] for d in voxel_dicts]
    coords = [np.pad(d["voxel_coords"], ((0, 0), (1, 0)), mode="constant", constant_values=i)
              for i, d in enumerate(voxel_dicts)]
    return {"voxel_features": torch.from_numpy(np.concatenate(features)),
            "voxel_coords": torch.from_numpy(np.concatenate(coords)),
            "voxel_num_points": torch.from_numpy(np.concatenate(num_points))}


__all__ = ["Voxelizer", "collate_voxels", "VOXEL_KEYS"]
