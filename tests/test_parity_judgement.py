"""tools/parity_check.py's verdict, in process, on the gaps real runs gave: the step check (step K from the
1-process run's state) decides, and the drift of a whole run only has to stay within the reordered runs'
envelope. The runs themselves are tests/test_end_to_end.py's."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from launch import load_tool

from opencood_ddp.engine.parity import step_relative_difference

parity_check = load_tool("parity_check.py")
ARGS = argparse.Namespace(noise_factor=5.0, tolerance=1e-4, loss_tolerance=1e-4)
REFERENCE_LOSSES = [4.0, 3.0, 3.1, 3.3]


def run(name: str, loss_gaps: list[float], weight_gap: float, step_gap: float):
    """A RunResult whose loss gaps, final weight gap and step gap against `reference()` are the given ones."""
    losses = [loss * (1 + gap) for loss, gap in zip(REFERENCE_LOSSES, loss_gaps)]
    weights = {"w": torch.tensor([1.0 + weight_gap, 0.0], dtype=torch.float64)}
    return parity_check.RunResult(name, losses, 1.0, weights, step_gap)


def reference():
    return parity_check.RunResult("world1", REFERENCE_LOSSES, 1.0, {"w": torch.tensor([1.0, 0.0])})


# The AVX2 CPU's 2-process run on the demo's world (2026-11-30): it drifts one step before either reordered run
# (7.0e-4 at step 3 where theirs are 5.4e-5), but its step from world1's state is as close as theirs.
REVERSED = run("world1_reversed", [0.0, 4.5e-5, 5.4e-5, 2.2e-2], 1.5e-2, 1.8e-5)
ROTATED = run("world1_rotated", [0.0, 2.3e-7, 4.3e-5, 2.5e-3], 6.7e-3, 1.6e-5)


def test_a_run_that_drifts_earlier_but_steps_alike_is_the_same_training():
    early = run("world2", [1.1e-7, 1.1e-4, 7.0e-4, 1.4e-2], 1.5e-2, 1.3e-5)
    verdict = parity_check.judge(early, reference(), [REVERSED, ROTATED], ARGS)
    assert verdict.passed, verdict.reason
    assert (verdict.loss_gap, verdict.loss_step) == (pytest.approx(1.4e-2), 4)


def test_a_step_far_from_the_reference_step_is_different_inside_the_drift():
    """Per-rank BatchNorm on the demo's world: step 2 from world1's state landed 0.43 of the step away, against
    4.1e-5 for the reordered runs, while its loss curve sat inside their envelope."""
    per_rank_bn = run("world2", [1e-7, 1e-4, 1e-3, 1e-2], 1e-2, 0.43)
    verdict = parity_check.judge(per_rank_bn, reference(), [REVERSED, ROTATED], ARGS)
    assert not verdict.passed
    assert verdict.reason.startswith("step 4 from world1's state lands 4.30e-01 of the step away, above 5 x the "
                                     "reordered runs' 1.80e-05")


def test_a_drift_beyond_the_reordered_runs_envelope_is_different():
    wild = run("world2", [0.0, 1e-5, 1e-5, 0.2], 1e-2, 1e-5)
    verdict = parity_check.judge(wild, reference(), [REVERSED, ROTATED], ARGS)
    assert not verdict.passed and verdict.reason.startswith("loss gap 2.00e-01 at step 4 is above 5 x the "
                                                            "largest gap of the reordered runs 2.20e-02")


def test_gaps_under_the_tolerances_pass_whatever_the_noise():
    """Where reordering changes nothing (its gaps 0), N ranks still round their sums otherwise."""
    silent = run("world1_reversed", [0.0] * 4, 0.0, 0.0)
    close = run("world2", [1e-7, 1e-6, 1e-6, 1e-6], 1e-6, 5e-5)
    assert parity_check.judge(close, reference(), [silent], ARGS).passed


def test_step_relative_difference_is_the_gap_over_the_reference_step():
    """A 3-4-5 step: the reference moved 5 from the start, the run landed 0.5 from it; running statistics are
    buffers, not weights, and do not count."""
    start = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(1)}
    reference_state = {"w": torch.tensor([3.0, 4.0]), "bn.running_mean": torch.ones(1)}
    state = {"module.w": torch.tensor([3.0, 4.5]), "module.bn.running_mean": torch.full((1,), 9.0)}
    assert step_relative_difference(state, reference_state, start) == pytest.approx(0.1)
    assert step_relative_difference(reference_state, reference_state, start) == 0.0
    # a step of size 0 (lr 0): equal weights are no gap, others are infinitely far
    assert step_relative_difference(start, start, start) == 0.0
    assert math.isinf(step_relative_difference(reference_state, start, start))
