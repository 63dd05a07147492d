"""The OpenCOOD perception task: fusion datasets + PointPillar model + point_pillar_loss, from one hypes file.

This is where the perception stack meets the engine's ``Task`` protocol (``opencood_ddp/engine/task.py``):

- training samples come from ``root_dir`` with training behaviour (augmentation, ``max_voxel_train``);
- the validation loss is computed on ``validate_dir`` with ``train=False``, as upstream's train.py does;
- one step runs the model on the batch's ``ego`` dict and the loss against its ``label_dict``; the loss is a
  mean over the local batch's samples, so DDP's gradient average equals the 1-process gradient;
- evaluation (``build_eval``) uses the test-time post-processor (GT range, NMS) on one-frame test batches.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping

from torch import nn

from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.task import LossOutput, Task, move_tensors
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import hypes_source
from opencood_ddp.loss import create_loss
from opencood_ddp.metrics import FrameStats, eval_summary, frame_stats
from opencood_ddp.models import create_model
from opencood_ddp.postprocess import create_postprocessor
from opencood_ddp.postprocess.voxel_postprocessor import VoxelPostprocessor

# --fusion_method of upstream's inference.py -> the dataset class it needs.
FUSION_DATASETS: Dict[str, str] = {"early": "EarlyFusionDataset", "late": "LateFusionDataset",
                                   "intermediate": "IntermediateFusionDataset"}


class DetectionStep:
    """``step(model, batch)``: forward on ``batch['ego']``, loss against its labels (picklable, no state)."""

    def __init__(self, loss: nn.Module):
        self.loss = loss

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> LossOutput:
        ego = batch["ego"]
        return self.loss(model(ego), ego["label_dict"])


def batch_size_of(batch: Mapping[str, Any]) -> int:
    """Samples in a training or validation batch (not CAVs: record_len groups those)."""
    return int(batch["ego"]["object_bbx_center"].shape[0])


def build_task(hypes: dict, for_training: bool) -> Task:
    seed = int(hypes.get("train_params", {}).get("seed", 0))
    train_post = create_postprocessor(hypes, train=True)
    train_set = build_dataset(hypes, "train", train=True, seed=seed, post_processor=train_post) \
        if for_training else None
    val_set = build_dataset(hypes, "validate", train=False, seed=seed, post_processor=train_post)
    model = create_model(hypes)
    return Task(train_set=train_set, val_set=val_set,
                collate_train=train_set.collate_batch_train if train_set is not None else None,
                collate_val=val_set.collate_batch_train, model=model, step=DetectionStep(create_loss(hypes)),
                batch_size_of=batch_size_of, move_to=move_tensors)


# ------------------------------------------------------------------------------------------------ evaluation
class FrameEvaluator:
    """One test batch (one frame) -> its FrameStats: model per CAV entry, post-processing, TP/FP per IoU."""

    def __init__(self, post: VoxelPostprocessor, fusion_method: str):
        self.post, self.fusion_method = post, fusion_method

    def outputs(self, model: nn.Module, batch: Mapping[str, Any]) -> Dict[str, Any]:
        if self.fusion_method == "late":  # every CAV detects in its own frame
            return {cav: model(entry) for cav, entry in batch.items()}
        return {"ego": model(batch["ego"])}

    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> List[FrameStats]:
        boxes, scores = self.post.post_process(batch, self.outputs(model, batch))
        return [frame_stats(boxes, scores, self.post.generate_gt_bbx(batch))]


class Summary:
    def __init__(self, global_sort: bool):
        self.global_sort = global_sort

    def __call__(self, frames: List[FrameStats]) -> dict:
        return eval_summary(frames, global_sort=self.global_sort)


def eval_dataset_hypes(hypes: dict, options: EvalRequest) -> dict:
    """The hypes of the split to evaluate, checked against --fusion_method."""
    source = hypes_source(hypes)
    if options.fusion_method not in FUSION_DATASETS:
        raise ConfigError(f"--fusion_method must be one of {', '.join(FUSION_DATASETS)}, got "
                          f"{options.fusion_method!r}")
    wanted, found = FUSION_DATASETS[options.fusion_method], hypes.get("fusion", {}).get("core_method")
    if found != wanted:
        raise ConfigError(f"{source}: --fusion_method {options.fusion_method} needs fusion.core_method {wanted}, "
                          f"the model was trained with {found}; pass the matching --fusion_method")
    hypes = copy.deepcopy(hypes)
    if options.dataset_dir is not None:
        hypes["validate_dir"] = str(options.dataset_dir)
    return hypes


def build_eval(hypes: dict, options: EvalRequest) -> EvalSpec:
    hypes = eval_dataset_hypes(hypes, options)
    seed = int(hypes.get("train_params", {}).get("seed", 0))
    post = create_postprocessor(hypes, train=False)
    dataset = build_dataset(hypes, "validate", train=False, seed=seed, post_processor=post)
    return EvalSpec(dataset=dataset, collate=dataset.collate_batch_test, model=create_model(hypes),
                    evaluate_batch=FrameEvaluator(post, options.fusion_method),
                    summarize=Summary(options.global_sort), move_to=move_tensors)


__all__ = ["build_task", "build_eval", "DetectionStep", "batch_size_of", "FUSION_DATASETS"]
