"""Early fusion: every CAV's raw cloud is projected into the ego frame, stacked and voxelized once.

Upstream counterpart: ``opencood/data_utils/datasets/early_fusion_dataset.py``. Per sample, as upstream:

1. the frame's CAVs within 70 m of the ego (ego first), as the ego receives them (``base``: a delayed CAV's
   cloud and pose from its delayed frame, its GT from the current one); per CAV: GT boxes in the ego's current
   true frame (GT range, see ``base``), its cloud shuffled, the car's own hits removed, then projected with
   ``x1_to_x2(sent pose, ego's current pose)``. As upstream's early dataset, ``loc_err_mode: upstream`` leaves
   the poses true; ``per_sample``, ``noise_setting`` and ``v2xvit`` (the V2X-ViT repository's early dataset,
   with upstream's one offset) perturb them;
2. boxes de-duplicated by object id and padded to ``max_num``; clouds stacked;
3. in training, the ``data_augment`` transform applied to the stacked cloud and the valid boxes;
4. points cropped to ``preprocess.cav_lidar_range``; boxes re-filtered to that range (all 8 corners inside),
   in training *and* at test time, so test GT is GT_RANGE intersected with cav_lidar_range;
5. one voxelization of the stacked cloud; anchors and labels from the post-processor when there is one.

Sample: ``{'ego': {object_bbx_center (max_num, 7) f64, object_bbx_mask (max_num,) f64, object_ids,
processed_lidar {voxel_features, voxel_coords, voxel_num_points}, [anchor_box, label_dict],
[origin_lidar, cav_positions]}}`` (the last two when visualizing).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Sequence

import numpy as np

from opencood_ddp.data.datasets.base import OpencoodDataset, cav_positions, collate_lidar, identity_matrix
from opencood_ddp.data.geometry import transform_points
from opencood_ddp.registry import DATASETS


@DATASETS.register("EarlyFusionDataset", fusion_method="early")
class EarlyFusionDataset(OpencoodDataset):
    """Raw-point fusion at the ego (PointPillar early fusion)."""

    fusion = "early"

    def get_sample(self, index: int, rng: np.random.Generator) -> "OrderedDict[str, Any]":
        cavs = self.received_cavs(index)
        to_ego = [cav.to_ego for cav in cavs]
        boxes, ids = self.sample_objects(cavs)
        # The CPU path shuffles each cloud with the sample's Generator before the augmentation draws from it.
        points = None if self.on_device else np.concatenate(
            [transform_points(self.load_cav_points(cav.sent, rng), cav.to_ego) for cav in cavs])

        transform = self.sample_transform(rng)
        if transform is not None:
            boxes = transform.boxes(boxes)
            if points is not None:
                points = transform.points(points)
        boxes, ids = self.in_range_boxes(boxes, ids)
        center, mask = self.pad_objects(boxes, f"sample {index} of {self.source.root}")
        if points is None:
            raw = [self.raw_cloud(cav.sent, cav.slot, index, cav.to_ego, transform) for cav in cavs]
            lidar: Any = self.raw_lidar(raw, separate=False)
            points = np.concatenate([self.picture_points(cloud) for cloud in raw]) if self.visualize else None
        else:
            points = self.crop(points)
            lidar = self.voxelizer(points)

        ego: Dict[str, Any] = {"object_bbx_center": center, "object_bbx_mask": mask, "object_ids": ids,
                               "processed_lidar": lidar}
        ego.update(self.label_entries(center, mask))
        if self.visualize:
            ego["origin_lidar"] = points
            ego["cav_positions"] = cav_positions(to_ego)
        return OrderedDict(ego=ego)

    def collate_batch_test(self, batch: Sequence[dict]) -> Dict[str, Dict[str, Any]]:
        """Upstream's early-fusion test batch: one sample, tensors with a batch dimension of 1."""
        self.require_single(batch, "early fusion")
        ego_in = batch[0]["ego"]
        ego: Dict[str, Any] = dict(self.stack_objects([ego_in]))
        ego["object_ids"] = ego_in["object_ids"]
        ego["processed_lidar"] = collate_lidar([ego_in["processed_lidar"]])
        ego["transformation_matrix"] = identity_matrix()
        ego.update(self.test_extras(ego_in))
        ego.update(self.collate_labels([ego_in]))
        return {"ego": ego}
