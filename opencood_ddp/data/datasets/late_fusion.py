"""Late fusion: every CAV detects in its own frame; the post-processor fuses the boxes at the ego.

Upstream counterpart: ``opencood/data_utils/datasets/late_fusion_dataset.py``. One CAV's processing (in its
own LiDAR frame, no projection), as upstream: cloud shuffled, the car's own hits removed, cropped to
``preprocess.cav_lidar_range``; GT boxes from that CAV's ``vehicles`` in its own frame (GT range, see ``base``); in
training the ``data_augment`` transform (points and boxes are *not* re-cropped afterwards, as upstream);
voxelization; anchors and labels.

- Training (``train=True``): one CAV of the frame drawn at random (from the sample's RNG) among *all* the
  scenario's kept CAVs, without the 70 m communication filter (upstream's ``get_item_train``); only that CAV's
  yaml and pcd are read. The sample is ``{'ego': <that CAV>}``.
- Otherwise: every CAV within 70 m, keyed ``'ego'`` for the ego and by CAV id for the others, each with its
  ``transformation_matrix`` (float64 (4, 4), ``x1_to_x2(cav, ego)``) into the ego frame.

Robustness settings (``base``), as upstream: a delayed CAV's cloud comes from its delayed frame and its GT boxes
are the current frame's objects placed in its delayed (true) LiDAR frame, so that its ``transformation_matrix``
(delayed pose -> the ego's current pose) puts them where they are now. ``loc_err_mode: upstream`` leaves the
poses true, as upstream's late dataset does. With ``per_sample`` or ``noise_setting`` the test-time
``transformation_matrix`` uses the believed poses and each entry also carries ``transformation_matrix_clean``
(the true poses), which the post-processor uses for the ground truth, as HEAL/CoAlign do. ``v2xvit`` is the V2X-ViT
repository's late dataset: ``upstream``'s one offset in ``transformation_matrix``, and the ground truth moved by its
``gt_transformation_matrix`` (the CAV's noisy current pose onto the ego's; carried as ``transformation_matrix_clean``).
Training is unaffected by pose errors: a CAV detects in its own frame.

``collate_batch_train`` (also used for the validation loss) takes each sample's ``'ego'`` entry;
``collate_batch_test`` takes one sample and keeps one entry per CAV, as upstream.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import torch

from opencood_ddp.data.datasets.base import OpencoodDataset, ReceivedCav, collate_lidar
from opencood_ddp.data.geometry import transform_points
from opencood_ddp.data.opv2v import CavFrame
from opencood_ddp.registry import DATASETS


@DATASETS.register("LateFusionDataset", fusion_method="late", ego_only_method="nofusion")
class LateFusionDataset(OpencoodDataset):
    """Single-CAV samples in training, all CAVs with their transforms at test (PointPillar late fusion)."""

    fusion = "late"

    def get_sample(self, index: int, rng: np.random.Generator) -> "OrderedDict[str, Any]":
        if self.train:
            return OrderedDict(ego=self.process_cav(*self.random_cav(index, rng), rng, index))
        sample: "OrderedDict[str, Any]" = OrderedDict()
        cavs = self.received_cavs(index)
        for cav in cavs:
            processed = self.process_cav(cav.sent, cav.current, cav.slot, rng, index)
            processed["transformation_matrix"] = cav.to_ego
            if cav.noisy:
                processed["transformation_matrix_clean"] = cav.to_ego_gt  # HEAL's name for the GT's matrix
            sample["ego" if cav.ego else cav.cav_id] = processed
        if self.source.gt_by_sample:
            sample["ego"].update(self.sample_ground_truth(index, cavs))
        return sample

    def sample_ground_truth(self, index: int, cavs: Sequence[ReceivedCav]) -> Dict[str, Any]:
        """The sample's ground truth in the ego frame, as early and intermediate fusion build it, for a source whose
        CAVs' own labels do not merge by id (``gt_by_sample``): the post-processor evaluates against it. Where the
        source builds late fusion's own (``late_ground_truth``: DAIR-V2X-C's ``by_iou``), that one, as corners."""
        where = f"sample {index} of {self.source.root}"
        corners = self.source.late_ground_truth([cav.current for cav in cavs], [cav.to_ego_clean for cav in cavs])
        if corners is not None:
            padded, mask = self.pad_corners(corners, where)
            return {"gt_object_bbx_corners": padded, "gt_object_bbx_mask": mask,
                    "gt_object_ids": list(range(len(corners)))}
        boxes, ids = self.sample_objects(cavs)
        center, mask = self.pad_objects(boxes, where)
        return {"gt_object_bbx_center": center, "gt_object_bbx_mask": mask, "gt_object_ids": ids}

    def pad_corners(self, corners: np.ndarray, where: str) -> Tuple[np.ndarray, np.ndarray]:
        """(max_num, 8, 3) float64 corners and (max_num,) float64 mask, padded as ``pad_objects`` pads boxes."""
        _, mask = self.pad_objects(np.zeros((len(corners), 7)), where)  # its max_num check, and the mask
        padded = np.zeros((self.max_num, 8, 3), dtype=np.float64)
        padded[:len(corners)] = corners
        return padded, mask

    def random_cav(self, index: int, rng: np.random.Generator) -> Tuple[CavFrame, CavFrame, int]:
        """Upstream's ``random.choice`` over the frame's CAVs (the ego when visualizing): its sent and current
        frames, one yaml read without delay, and its slot."""
        frames, delays, _ = self.sample_frames(index)
        slot = 0 if self.visualize else int(rng.integers(len(delays)))
        return frames.frame(slot, delays[slot]), frames.frame(slot), slot

    def process_cav(self, sent: CavFrame, current: CavFrame, slot: int, rng: np.random.Generator,
                    index: int) -> Dict[str, Any]:
        """One CAV in its own sent frame: its sent cloud, the current frame's objects placed with its sent pose."""
        # Upstream crops before removing the car's own hits; both are point masks, so the order is immaterial.
        # The CPU path shuffles the cloud with the sample's Generator before the augmentation draws from it.
        points = None if self.on_device else self.crop(self.load_cav_points(sent, rng))
        boxes, ids = self.source.own_objects(current, sent.lidar_pose, self.gt_range)
        center, mask = self.pad_objects(boxes, current.meta_path)
        transform = self.sample_transform(rng)
        if transform is not None:
            valid = transform.boxes(boxes)
            center[:len(valid)] = valid
            if points is not None:
                points = transform.points(points)
        if points is None:
            raw = self.raw_cloud(sent, slot, index, transform=transform)
            lidar: Any = self.raw_lidar([raw], separate=True, crop_first=True)
            points = self.picture_points(raw, crop_first=True) if self.visualize else None
        else:
            lidar = self.voxelizer(points)
        processed: Dict[str, Any] = {"object_bbx_center": center, "object_bbx_mask": mask, "object_ids": ids,
                                     "processed_lidar": lidar}
        processed.update(self.label_entries(center, mask))
        if self.visualize:
            processed["origin_lidar"] = points
        return processed

    def collate_batch_test(self, batch: Sequence[Mapping]) -> Dict[str, Dict[str, Any]]:
        """One sample -> {cav key: tensors with a batch dimension of 1, object_ids, transformation_matrix}."""
        self.require_single(batch, "late fusion")
        output: Dict[str, Dict[str, Any]] = {}
        for key, cav in batch[0].items():
            entry: Dict[str, Any] = dict(self.stack_objects([cav]))
            entry["object_ids"] = cav["object_ids"]
            if "gt_object_bbx_mask" in cav:
                entry.update(sample_ground_truth_batch(cav))
            entry["processed_lidar"] = collate_lidar([cav["processed_lidar"]])
            for matrix in ("transformation_matrix", "transformation_matrix_clean"):
                if matrix in cav:
                    entry[matrix] = torch.from_numpy(np.array(cav[matrix])).float()
            entry.update(self.test_extras(cav))
            entry.update(self.collate_labels([cav]))
            output[key] = entry
        if self.visualize:
            # As upstream: the ego also carries every CAV's cloud projected into the ego frame.
            projected = [transform_points(cav["origin_lidar"], cav["transformation_matrix"])
                         for cav in batch[0].values()]
            output["ego"]["origin_lidar"] = [torch.from_numpy(np.concatenate(projected))]
        return output


def sample_ground_truth_batch(cav: Mapping[str, Any]) -> Dict[str, Any]:
    """A test batch's copy of ``sample_ground_truth`` (boxes or corners): tensors with a batch dimension of 1, and
    the ids."""
    key = "gt_object_bbx_corners" if "gt_object_bbx_corners" in cav else "gt_object_bbx_center"
    return {key: torch.from_numpy(cav[key][None]),
            "gt_object_bbx_mask": torch.from_numpy(cav["gt_object_bbx_mask"][None]),
            "gt_object_ids": cav["gt_object_ids"]}
