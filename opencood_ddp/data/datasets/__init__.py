"""OpenCOOD's three fusion datasets over OPV2V-format folders; ``build_dataset`` picks one from the hypes.

``fusion.core_method`` names the class, as upstream's ``opencood/data_utils/datasets/__init__.py``:
EarlyFusionDataset, LateFusionDataset or IntermediateFusionDataset. Each dataset has ``set_epoch``,
``collate_batch_train`` (training and validation-loss batches) and ``collate_batch_test`` (inference, one
sample per batch). See ``base`` for the reproducibility contract and the post-processor interface.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Type

from opencood_ddp.data.datasets.base import GT_RANGE, SPLIT_KEYS, OpencoodDataset, PostProcessor
from opencood_ddp.data.datasets.early_fusion import EarlyFusionDataset
from opencood_ddp.data.datasets.intermediate_fusion import IntermediateFusionDataset
from opencood_ddp.data.datasets.late_fusion import LateFusionDataset
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source, validate

DATASETS: Dict[str, Type[OpencoodDataset]] = {
    "EarlyFusionDataset": EarlyFusionDataset,
    "LateFusionDataset": LateFusionDataset,
    "IntermediateFusionDataset": IntermediateFusionDataset,
}


def build_dataset(hypes: Mapping, split: str = "train", train: bool = True, seed: int = 0,
                  post_processor: Optional[PostProcessor] = None, visualize: bool = False) -> OpencoodDataset:
    """The dataset named by ``fusion.core_method`` over the split's folder (root_dir, validate_dir, test_dir).

    ``train`` selects training behaviour (augmentation, max_voxel_train, training GT range, late fusion's
    single random CAV), independently of the split: upstream validates with ``train=False``. ``seed`` keys
    every random decision together with the epoch and the sample index.
    """
    source = hypes_source(hypes)
    validate(hypes, (("fusion.core_method", "str"),), source)
    name = hypes["fusion"]["core_method"]
    if name not in DATASETS:
        raise ConfigError(f"{source}: fusion.core_method {name!r} is not one of {', '.join(DATASETS)}; fix the "
                          f"hypes")
    return DATASETS[name](hypes, split, train, seed, post_processor, visualize)


__all__ = ["build_dataset", "DATASETS", "GT_RANGE", "SPLIT_KEYS", "OpencoodDataset", "PostProcessor",
           "EarlyFusionDataset", "LateFusionDataset", "IntermediateFusionDataset"]
