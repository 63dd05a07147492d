"""The OpenCOOD perception task: fusion datasets + PointPillar model + point_pillar_loss, from one hypes file.

This is where the perception stack meets the engine's ``Task`` protocol (``opencood_ddp/engine/task.py``):

- training samples come from ``root_dir`` with training behaviour (augmentation, ``max_voxel_train``);
- the validation loss is computed on ``validate_dir`` with ``train=False``, as upstream's train.py does;
- one step runs the model on the batch's ``ego`` dict and the loss against its ``label_dict``; the loss is a
  mean over the local batch's samples, so DDP's gradient average equals the 1-process gradient;
- the post-processor given to the engine for evaluation is the test-time one (GT range, NMS).
"""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.engine.task import LossOutput, Task, move_tensors
from opencood_ddp.loss import create_loss
from opencood_ddp.models import create_model
from opencood_ddp.postprocess import create_postprocessor


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
                batch_size_of=batch_size_of, move_to=move_tensors,
                postprocessor=create_postprocessor(hypes, train=False))


__all__ = ["build_task", "DetectionStep", "batch_size_of"]
