"""A training step in float32 is within float32's rounding of the same step in float64, for every zoo model.

The guard against a layout or kernel that rounds badly (issue 25): PyTorch's CPU batch norm accumulates its
statistics in float32 on row and channels-last layouts, which put a step's outputs 1e-2 from float64 where
float32 allows 4e-6 (upstream's own classes on their layouts reach 4e-6 in the outputs and 1.3e-3 in the
gradients). Each row runs one training-mode forward, loss and backward of a real 2-sample toy batch, in float32
and in float64 from the same weights, with the samples in both orders, and compares the model's outputs and
the whole gradient vector by relative L2 (the helpers are tools/benchmarks/benchmark_numerics.py's, whose table
also shows the native kernel's figures).

Each model is built from seed 0. The gradient's error depends on the initial weights, since float32 rounds the
backward chain of a badly conditioned start more: over 60 initial seeds of the toy AttFuse, 59 gave at most
2.2e-5 and one (seed 21) 5.8e-3, its outputs and activations still within 3.3e-7 (the native kernel: 1.4e-2).
"""
from __future__ import annotations

import sys

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "tools" / "benchmarks"))
import benchmark_numerics as numerics  # noqa: E402

# Upstream's own float32 figures, its classes on its layouts at full size (the issue asked for 2e-5 and 5e-3).
OUTPUT_TOLERANCE = 4e-6
GRADIENT_TOLERANCE = 1.3e-3


@pytest.fixture(scope="module")
def toy_tasks(toy_small):
    """stem -> (task built from seed 0, its first 2 training samples), built once per module."""
    cache = {}

    def get(stem: str):
        if stem not in cache:
            task = numerics.toy_task(stem, toy_small)
            cache[stem] = task, [task.train_set[i] for i in range(2)]
        return cache[stem]

    return get


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["in_order", "swapped"])
@pytest.mark.parametrize("stem", numerics.STEMS)
def test_float32_training_step_is_within_rounding_of_float64(stem, order, toy_tasks):
    task, samples = toy_tasks(stem)
    batch = task.collate_train([samples[i] for i in order])
    output_error, gradient_error = numerics.step_errors(task, task.model, batch)
    assert output_error < OUTPUT_TOLERANCE and gradient_error < GRADIENT_TOLERANCE, (
        f"{stem} {order}: outputs {output_error:.1e} (bound {OUTPUT_TOLERANCE:.0e}), gradients {gradient_error:.1e} "
        f"(bound {GRADIENT_TOLERANCE:.0e}) from float64")
