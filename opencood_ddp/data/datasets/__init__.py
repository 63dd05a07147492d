"""OpenCOOD's fusion datasets over OPV2V-format folders; ``build_dataset`` picks one from the hypes.

``fusion.core_method`` names a class registered in ``opencood_ddp.registry.DATASETS`` (upstream's names:
EarlyFusionDataset, LateFusionDataset, IntermediateFusionDataset; every module of this package is imported
on the first lookup, so a new dataset is one new file here). Each entry's ``fusion_method`` is the
``--fusion_method`` of inference that evaluates it. Each dataset has ``set_epoch``, ``collate_batch_train``
(training and validation-loss batches) and ``collate_batch_test`` (inference, one sample per batch). See
``base`` for the reproducibility contract and the post-processor interface.
"""
from __future__ import annotations

from typing import Mapping, Optional

from opencood_ddp.data.datasets.base import SPLIT_KEYS, OpencoodDataset, PostProcessor
from opencood_ddp.data.ground_truth import GT_RANGE
from opencood_ddp.hypes import hypes_source
from opencood_ddp.registry import DATASETS


def build_dataset(hypes: Mapping, split: str = "train", train: bool = True, seed: int = 0,
                  post_processor: Optional[PostProcessor] = None, visualize: bool = False) -> OpencoodDataset:
    """The dataset named by ``fusion.core_method`` over the split's folder (root_dir, validate_dir, test_dir).

    ``train`` selects training behaviour (augmentation, max_voxel_train, training GT range, late fusion's
    single random CAV), independently of the split: upstream validates with ``train=False``. ``seed`` keys
    every random decision together with the epoch and the sample index.
    """
    entry = DATASETS.lookup(hypes, hypes_source(hypes))
    return entry.obj(hypes, split, train, seed, post_processor, visualize)


# --fusion_method nofusion (upstream's and V2V4Real's): a late-fusion run evaluated on the ego's detections alone.
NO_FUSION = "nofusion"


def fusion_methods() -> dict:
    """--fusion_method -> the dataset name that method evaluates, from the registered datasets (an entry's
    ``fusion_method``, and ``ego_only_method`` where the same run may be evaluated without its other CAVs)."""
    methods = {}
    for entry in DATASETS.entries():
        for key in ("fusion_method", "ego_only_method"):
            if key in entry.meta:
                methods[entry.meta[key]] = entry.name
    return methods


__all__ = ["NO_FUSION", "build_dataset", "fusion_methods", "GT_RANGE", "SPLIT_KEYS", "OpencoodDataset", "PostProcessor"]
