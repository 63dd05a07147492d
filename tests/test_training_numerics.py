"""A training step in float32 is within float32's rounding of the same step in float64, for every zoo model.

The guard against a layout or kernel that rounds badly (issue 25): PyTorch's CPU batch norm accumulates its
statistics in float32 on row and channels-last layouts, which put a step's outputs 1e-2 from float64 where
float32 allows 4e-6 (upstream's own classes on their layouts reach 4e-6 in the outputs and 1.3e-3 in the
gradients). Each row runs one training-mode forward, loss and backward of a real 2-sample toy batch, in float32
and in float64 from the same weights, with the samples in both orders, and compares the model's outputs and
the whole gradient vector by relative L2.

Each model is built from seed 0. The gradient's error depends on the initial weights, since float32 rounds the
backward chain of a badly conditioned start more: over 60 initial seeds of the toy AttFuse, 59 gave at most
2.2e-5 and one (seed 21) 5.8e-3, its outputs and activations still within 3.3e-7 (the native kernel: 1.4e-2).
"""
from __future__ import annotations

import copy

import pytest
import torch

import zoo
from launch import REPO

TOY = REPO / "hypes_yaml" / "toy"
STEMS = ["point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
         "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt",
         "point_pillar_where2comm", "second_intermediate_fusion"]
OUTPUT_TOLERANCE = 4e-6  # upstream float32 on its own layouts, full size: 4e-6 and 1.3e-3 (the issue asks 2e-5, 5e-3)
GRADIENT_TOLERANCE = 1.3e-3


@pytest.fixture(scope="module")
def toy_tasks(toy_small):
    """stem -> (task, its first 2 training samples), built once per module."""
    cache = {}

    def get(stem: str):
        if stem not in cache:
            torch.manual_seed(0)  # the initial weights: not whatever state the tests before left
            cache[stem] = zoo.toy_samples(TOY / f"{stem}.yaml", toy_small, count=2)
        return cache[stem]

    return get


def _as(value, dtype: torch.dtype):
    """The batch with every floating tensor cast to dtype (indices, masks and counts unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _as(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as(item, dtype) for item in value)
    return value


def _training_step(task, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's map outputs, every parameter's gradient), flattened, of one training-mode step."""
    model.train()
    model.zero_grad(set_to_none=True)
    outputs = {}
    handle = model.register_forward_hook(lambda module, args, out: outputs.update(out))
    try:
        task.step(model, batch).total.backward()
    finally:
        handle.remove()
    maps = [outputs[key].detach().flatten() for key in sorted(outputs)
            if isinstance(outputs[key], torch.Tensor) and outputs[key].dim() > 0]
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(maps).double(), torch.cat(grads).double()


def _relative(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return float((ours - exact).norm() / exact.norm())


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["in_order", "swapped"])
@pytest.mark.parametrize("stem", STEMS)
def test_float32_training_step_is_within_rounding_of_float64(stem, order, toy_tasks):
    task, samples = toy_tasks(stem)
    batch = task.collate_train([samples[i] for i in order])
    model32 = task.model
    model64 = copy.deepcopy(model32).double()
    outputs32, grads32 = _training_step(task, model32, batch)
    outputs64, grads64 = _training_step(task, model64, _as(batch, torch.float64))
    assert grads64.norm() > 0 and outputs64.norm() > 0
    output_error, gradient_error = _relative(outputs32, outputs64), _relative(grads32, grads64)
    assert output_error < OUTPUT_TOLERANCE and gradient_error < GRADIENT_TOLERANCE, (
        f"{stem} {order}: outputs {output_error:.1e} (bound {OUTPUT_TOLERANCE:.0e}), gradients {gradient_error:.1e} "
        f"(bound {GRADIENT_TOLERANCE:.0e}) from float64")
