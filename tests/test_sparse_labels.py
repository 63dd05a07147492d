"""Labels by index (``preprocess.on_device``), spread on the device, equal the dense labels' collate bit for bit.

Every label call of the real datasets on the small toy world is made twice, densely (``generate_label``) and by
index (``generate_sparse_label``), and batches of them are collated both ways; the sparse batch is spread by the
task's ``move_to`` (``prepare_batch``) with ``device=cpu``, the code a GPU runs.
"""
from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch

from zoo import hypes_of

from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.device_points import prepare_batch
from opencood_ddp.postprocess import create_postprocessor
from opencood_ddp.postprocess.sparse_labels import SparseLabelBatch, SparseLabels

AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-0.785, 0.785]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.95, 1.05]}]
NOISY = {"async": True, "async_mode": "sim", "async_overhead": 100, "seed": 25, "loc_err": True, "xyz_std": 0.2,
         "ryp_std": 0.2, "data_size": 1.06, "transmission_speed": 27, "backbone_delay": 10}


def label_inputs(hypes: dict, epochs=(0, 1)) -> tuple:
    """The post-processor and the inputs of every label its training dataset makes over ``epochs``."""
    post = create_postprocessor(hypes, train=True)
    inputs: List[dict] = []
    make = post.generate_label

    def record(**kwargs):
        inputs.append(kwargs)
        return make(**kwargs)

    post.generate_label = record
    dataset = build_dataset(hypes, "train", True, 3, post)
    for epoch in epochs:
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            dataset[index]
    post.generate_label = make
    return post, inputs


def assert_same_labels(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
        assert torch.equal(actual[key].view(torch.int32) if value.dtype == torch.float32 else actual[key],
                           value.view(torch.int32) if value.dtype == torch.float32 else value), key


def assert_sparse_equals_dense(post, inputs: List[dict]) -> int:
    """Batches of 1 and 3 labels both ways; returns the positives seen (a comparison that is not vacuous)."""
    dense = [post.generate_label(**call) for call in inputs]
    sparse = [post.generate_sparse_label(**call) for call in inputs]
    for size in (1, 3):
        for first in range(0, len(inputs), size):
            batch = post.collate_batch(sparse[first:first + size])
            assert isinstance(batch, SparseLabelBatch)
            assert_same_labels(prepare_batch(batch, "cpu"), post.collate_batch(dense[first:first + size]))
    return sum(len(label.positive) for label in sparse)


CASES = {
    "AttFuse": lambda w: hypes_of("toy/point_pillar_intermediate_fusion", toy_root=w),
    "early, augmented": lambda w: hypes_of("toy/point_pillar_early_fusion", toy_root=w, data_augment=AUGMENT),
    "late, augmented": lambda w: hypes_of("toy/point_pillar_late_fusion", toy_root=w, data_augment=AUGMENT),
    "full-size AttFuse": lambda w: hypes_of("opv2v/point_pillar_intermediate_fusion", toy_root=w),
    "noisy": lambda w: hypes_of("toy/point_pillar_intermediate_fusion", toy_root=w, wild_setting=NOISY),
    # 0: no anchor is a negative unless the frame has no GT, so the flipped anchors are the negatives' complement
    "neg_threshold 0": lambda w: hypes_of("toy/point_pillar_intermediate_fusion",
                                          "postprocess.target_args.neg_threshold=0", toy_root=w),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_labels_spread_to_the_dense_labels(toy_small, case):
    post, inputs = label_inputs(CASES[case](toy_small))
    empty = dict(inputs[0], mask=np.zeros_like(inputs[0]["mask"]))  # a frame without objects
    assert assert_sparse_equals_dense(post, inputs + [empty]) > len(inputs)


def test_direction_labels_spread_to_the_dense_labels(toy_dairv2x):
    hypes = hypes_of("dairv2x/point_pillar_intermediate_fusion", toy_root=toy_dairv2x, layout="dairv2x")
    post, inputs = label_inputs(hypes, epochs=(0,))
    assert post.direction is not None
    assert assert_sparse_equals_dense(post, inputs) > 0


def test_a_device_dataset_hands_over_labels_by_index(toy_small):
    hypes = hypes_of("toy/point_pillar_intermediate_fusion", "preprocess.on_device=true", toy_root=toy_small)
    post = create_postprocessor(hypes, train=True)
    dataset = build_dataset(hypes, "train", True, 3, post)
    samples = [dataset[0], dataset[1]]
    label = samples[0]["ego"]["label_dict"]
    assert isinstance(label, SparseLabels) and label.residuals.dtype == np.float32
    batch = prepare_batch(dataset.collate_batch_train(samples), "cpu")
    dense = [post.generate_label(gt_box_center=s["ego"]["object_bbx_center"], anchors=s["ego"]["anchor_box"],
                                 mask=s["ego"]["object_bbx_mask"]) for s in samples]
    assert_same_labels(batch["ego"]["label_dict"], post.collate_batch(dense))
    handed = sum(value.nbytes for value in vars(label).values() if isinstance(value, np.ndarray))
    assert handed * 100 < sum(value.nbytes for value in dense[0].values())
