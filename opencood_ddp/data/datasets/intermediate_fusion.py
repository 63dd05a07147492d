"""Intermediate fusion: each CAV's cloud is voxelized on its own; the model fuses features (AttFuse, F-Cooper).

Upstream counterpart: ``opencood/data_utils/datasets/intermediate_fusion_dataset.py``. Per sample:

1. the frame's CAVs within 70 m of the ego (ego first), as the ego receives them (``base``: delay and
   localisation error); per CAV: GT boxes of the current frame in the ego's current true frame (GT range, see
   ``base``), its sent cloud shuffled, the car's own hits removed, projected into the ego frame when
   ``fusion.args.proj_first`` (default true, as upstream) with the believed poses;
2. per CAV: points cropped to ``preprocess.cav_lidar_range`` and voxelized; boxes de-duplicated by id and
   padded (no re-filtering by cav_lidar_range: at test time the GT is upstream's GT_RANGE);
3. ``cav_num`` (-> ``record_len`` in batches) and ``pairwise_t_matrix`` (max_cav, max_cav, 4, 4): identity
   everywhere with proj_first; otherwise ``inv(T_j) @ T_i`` off the diagonal, where ``T_i`` is CAV i's
   projection (delay and localisation error included, as upstream's ``transformation_matrix``), and the
   identity on the diagonal and in the rows and columns past ``cav_num`` (HEAL's ``get_pairwise_transformation``
   tiles the identity first; upstream OpenCOOD at 31ba160 writes it on the diagonal, but without proj_first
   pads with zeros). The batch stacks the samples' matrices as they are, as both do. No model here reads the
   diagonal or the padding.
   PointPillar AttFuse (upstream ``point_pillar_intermediate``) reads only the voxels and ``record_len``;
4. V2X-ViT's inputs, from the yaml already parsed (no extra file read), one row per CAV in sample order and
   padded to ``max_cav`` as upstream:
   - ``prior_encoding`` (max_cav, 3) float32: ``[ego_speed / 30, time_delay, infra]``. Upstream divides the
     yaml's ``ego_speed`` (km/h in OPV2V and V2XSet) of the *sent* (delayed) frame by 30 km/h, its "average
     speed", rather than converting to m/s; we do the same, so a model trained upstream sees the same numbers.
     ``time_delay`` is the CAV's applied delay in upstream's units of 100 ms (0 without ``wild_setting.async``).
     ``infra`` is 1 for a road-side unit (negative folder id), else 0. Rows past ``cav_num`` are zeros;
   - ``spatial_correction_matrix`` (max_cav, 4, 4) float64: per CAV, upstream's correction from the ego pose
     the CAV was projected onto to the ego's current pose: ``x1_to_x2(ego at the CAV's delayed frame, ego now)``
     with ``fusion.args.cur_ego_pose_flag: false`` and a delay; the identity otherwise (exactly; upstream's
     ``x1_to_x2(pose, pose)`` for an undelayed CAV may differ in the last bit), as is the padding.

Augmentation: upstream's intermediate dataset never augments. ``fusion.args.augment: true`` (our extension,
default false) applies one ``data_augment`` transform, in training, to every CAV's ego-frame cloud and to the
GT boxes between steps 1 and 2, then re-filters the boxes to cav_lidar_range as early fusion does. It needs
``proj_first`` (the transform lives in the ego frame).

Sample: ``{'ego': {object_bbx_center, object_bbx_mask, object_ids, processed_lidar {voxel_features: [per
CAV], voxel_coords: [...], voxel_num_points: [...]}, cav_num, pairwise_t_matrix, prior_encoding,
spatial_correction_matrix, [anchor_box, label_dict], [origin_lidar, cav_positions]}}`` (the last two when
visualizing). Upstream's samples carry the three prior lists (velocity, time_delay, infra) and stack them at
collate time; ours carry the stacked array, so the batch is the same: ``prior_encoding`` (B, max_cav, 3)
float32 and ``spatial_correction_matrix`` (B, max_cav, 4, 4) float64, stacked in sample order.

``fusion.args.cur_ego_pose_flag`` (default true, as upstream; V2X-ViT's configs set false) chooses which ego
pose a delayed CAV is projected onto: the current one, or the ego's pose at the CAV's delayed frame (then
``spatial_correction_matrix`` carries the rest). Without delay both choices give the same sample. This is the
one dataset where ``wild_setting.loc_err_mode: upstream`` perturbs the projections, as upstream's.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np
import torch

from opencood_ddp.data.datasets.base import (COMMON_OPTIONAL_KEYS, OpencoodDataset, ReceivedCav, cav_positions,
                                             identity_matrix)
from opencood_ddp.data.device_points import RawLidar, collate_raw
from opencood_ddp.data.geometry import transform_points
from opencood_ddp.data.voxelize import VOXEL_KEYS, collate_voxels
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import get_key, hypes_source
from opencood_ddp.memory_fit import Buffer
from opencood_ddp.registry import DATASETS


# Upstream divides the yaml's ego_speed (km/h) by this "average speed" for V2X-ViT's prior encoding.
UPSTREAM_SPEED_SCALE_KMH = 30.0


@DATASETS.register("IntermediateFusionDataset", fusion_method="intermediate")
class IntermediateFusionDataset(OpencoodDataset):
    """Per-CAV voxels grouped by ``record_len`` (PointPillar AttFuse, F-Cooper)."""

    optional_keys = COMMON_OPTIONAL_KEYS + (("fusion.args.proj_first", "bool"), ("fusion.args.augment", "bool"),
                                            ("fusion.args.cur_ego_pose_flag", "bool"))

    reads_upstream_loc_err = True  # upstream's intermediate dataset projects with the noisy poses
    fusion = "intermediate"

    def __init__(self, hypes: Mapping, *args: Any, **kwargs: Any):
        self.proj_first = bool(get_key(hypes, "fusion.args.proj_first", True))
        self.projects_to_delayed_ego = not get_key(hypes, "fusion.args.cur_ego_pose_flag", True)
        super().__init__(hypes, *args, **kwargs)

    def augments(self, hypes: Mapping) -> bool:
        wanted = bool(get_key(hypes, "fusion.args.augment", False))
        if wanted and not self.proj_first:
            raise ConfigError(f"{hypes_source(hypes)}: fusion.args.augment needs fusion.args.proj_first true (the "
                              f"augmentation transforms the clouds in the ego frame); set one of them differently")
        return wanted

    def whole_buffers(self) -> List[Buffer]:
        # pairwise_t_matrix (max_cav, max_cav, 4, 4) float64, upstream's padding
        return super().whole_buffers() + [Buffer("each sample's CAV-by-CAV transforms (16 float64 per pair)",
                                                 128 * self.max_cav ** 2, f"train_params.max_cav ({self.max_cav})")]

    def get_sample(self, index: int, rng: np.random.Generator) -> "OrderedDict[str, Any]":
        cavs = self.received_cavs(index)
        to_ego = [cav.to_ego for cav in cavs]
        boxes, ids = self.sample_objects(cavs)
        # The CPU path shuffles each cloud with the sample's Generator before the augmentation draws from it.
        clouds = None if self.on_device else [self.cav_cloud(cav, rng) for cav in cavs]
        transform = self.sample_transform(rng)
        if transform is not None:
            boxes = transform.boxes(boxes)
            if clouds is not None:
                clouds = [transform.points(points) for points in clouds]
        if transform is not None or self.source.refilters_each_cav:
            boxes, ids = self.in_range_boxes(boxes, ids)
        center, mask = self.pad_objects(boxes, f"sample {index} of {self.source.root}")
        if clouds is None:
            raw = [self.raw_cloud(cav.sent, cav.slot, index, cav.to_ego if self.proj_first else None, transform)
                   for cav in cavs]
            lidar: Any = self.raw_lidar(raw, separate=True)
            clouds = [self.picture_points(cloud) for cloud in raw] if self.visualize else None
        else:
            clouds = [self.crop(points) for points in clouds]
            lidar = merge_voxel_dicts([self.voxelizer(points) for points in clouds])

        ego: Dict[str, Any] = {
            "object_bbx_center": center, "object_bbx_mask": mask, "object_ids": ids,
            "processed_lidar": lidar, "cav_num": len(cavs), "pairwise_t_matrix": self.pairwise_matrices(to_ego),
            "prior_encoding": self.prior_encoding(cavs),
            "spatial_correction_matrix": self.spatial_correction_matrices(cavs),
        }
        ego.update(self.label_entries(center, mask))
        if self.visualize:
            # The picture is drawn in the ego frame: without proj_first the clouds are still in their CAVs' frames.
            ego["origin_lidar"] = np.concatenate(clouds if self.proj_first else
                                                 [transform_points(c, m) for c, m in zip(clouds, to_ego)])
            ego["cav_positions"] = cav_positions(to_ego)
        return OrderedDict(ego=ego)

    def cav_cloud(self, cav: ReceivedCav, rng: np.random.Generator) -> np.ndarray:
        """The CPU path's cloud of one CAV: shuffled, without the car's hits, projected with proj_first."""
        points = self.load_cav_points(cav.sent, rng)
        return transform_points(points, cav.to_ego) if self.proj_first else points

    def pairwise_matrices(self, to_ego: Sequence[np.ndarray]) -> np.ndarray:
        """(max_cav, max_cav, 4, 4): entry [i, j] maps CAV i's frame into CAV j's (upstream's layout)."""
        # HEAL's layout: the identity everywhere first, so the diagonal (a CAV to itself) and the padding past the
        # last CAV hold it; with proj_first the clouds are already in the ego frame and nothing else is written.
        pairwise = np.tile(np.identity(4), (self.max_cav, self.max_cav, 1, 1))
        if self.proj_first:
            return pairwise
        for i, t_i in enumerate(to_ego):
            for j, t_j in enumerate(to_ego):
                if i != j:
                    pairwise[i, j] = np.linalg.inv(t_j) @ t_i
        return pairwise

    def prior_encoding(self, cavs: Sequence[ReceivedCav]) -> np.ndarray:
        """(max_cav, 3) float32 rows [ego_speed / 30, time delay, infra] per CAV, zeros past the last CAV.

        The speed is the sent frame's (upstream reads the delayed yaml). The division happens in float64 before
        the float32 cast, as upstream's list -> tensor -> .float()."""
        prior = np.zeros((self.max_cav, 3), dtype=np.float32)
        for row, cav in enumerate(cavs):
            speed = self.source.ego_speed_kmh(cav.sent) / UPSTREAM_SPEED_SCALE_KMH
            prior[row] = (speed, float(cav.time_delay), 1.0 if cav.infra else 0.0)
        return prior

    def spatial_correction_matrices(self, cavs: Sequence[ReceivedCav]) -> np.ndarray:
        """(max_cav, 4, 4) float64: each CAV's correction (``ReceivedCav``), identities past the last CAV."""
        matrices = np.tile(np.identity(4), (self.max_cav, 1, 1))
        for row, cav in enumerate(cavs):
            matrices[row] = cav.spatial_correction
        return matrices

    def collate_batch_train(self, batch: Sequence[Mapping]) -> Dict[str, Dict[str, Any]]:
        """All CAVs of all samples in one voxel batch; coords' first column is the running CAV index."""
        egos = [sample["ego"] for sample in batch]
        ego: Dict[str, Any] = dict(self.stack_objects(egos))
        lidars = [e["processed_lidar"] for e in egos]
        if isinstance(lidars[0], RawLidar):  # preprocess.on_device: each CAV its own voxel group, as below
            ego["processed_lidar"] = collate_raw(lidars)
        else:
            ego["processed_lidar"] = collate_voxels([dict(zip(VOXEL_KEYS, arrays)) for lidar in lidars
                                                     for arrays in zip(*(lidar[key] for key in VOXEL_KEYS))])
        ego["record_len"] = torch.from_numpy(np.array([e["cav_num"] for e in egos], dtype=np.int64))
        ego.update(self.collate_labels(egos))
        # Upstream keeps the first sample's ids only (they are read at inference, where the batch is one sample).
        ego["object_ids"] = egos[0]["object_ids"]
        # Each sample's matrix is already padded to max_cav with identities: stacked as it is (HEAL's collate).
        ego["pairwise_t_matrix"] = torch.from_numpy(np.array([e["pairwise_t_matrix"] for e in egos]))
        ego["prior_encoding"] = torch.from_numpy(np.stack([e["prior_encoding"] for e in egos]))
        ego["spatial_correction_matrix"] = torch.from_numpy(np.stack([e["spatial_correction_matrix"] for e in egos]))
        return {"ego": ego}

    def collate_batch_test(self, batch: Sequence[Mapping]) -> Dict[str, Dict[str, Any]]:
        """The training batch of one sample plus anchor_box and the ego's identity transformation_matrix."""
        self.require_single(batch, "intermediate fusion")
        output = self.collate_batch_train(batch)
        output["ego"].update(self.test_extras(batch[0]["ego"]))
        output["ego"]["transformation_matrix"] = identity_matrix()
        return output


def merge_voxel_dicts(per_cav: Sequence[Mapping[str, np.ndarray]]) -> Dict[str, List[np.ndarray]]:
    """[{voxel_features: a, ...}, {voxel_features: b, ...}] -> {voxel_features: [a, b], ...} (upstream's merge)."""
    return {key: [d[key] for d in per_cav] for key in VOXEL_KEYS}
