"""opencood_ddp/numerics/batch_norm.py: training statistics exact to float32's rounding on every layout, with
BatchNorm's semantics (running statistics, momentum, empty and one-value inputs, names), in process."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opencood_ddp.numerics.batch_norm import (AccurateBatchNorm1d, AccurateBatchNorm2d, row_view,
                                              use_accurate_batch_norm)

CHANNELS = 16


def _layout(name: str, generator: torch.Generator) -> torch.Tensor:
    """A float32 input whose channels sit far from 0 with a small spread: where float32 sums drift."""
    if name == "rows":  # the PFN's (pillars x points, C) and spconv's (voxels, C)
        x = torch.randn(120_000, CHANNELS, generator=generator)
    elif name == "channels_last":  # the BEV backbone's canvas
        x = torch.randn(6, CHANNELS, 50, 80, generator=generator).contiguous(memory_format=torch.channels_last)
    elif name == "contiguous":
        x = torch.randn(6, CHANNELS, 50, 80, generator=generator)
    else:  # "transposed": upstream's PFN, (pillars, C, points) as a view of (pillars, points, C)
        x = torch.randn(4000, 30, CHANNELS, generator=generator).transpose(1, 2)
    return x + 5


def _norm_for(x: torch.Tensor) -> nn.Module:
    norm = nn.BatchNorm2d(CHANNELS, eps=1e-3, momentum=0.1) if x.dim() == 4 else nn.BatchNorm1d(CHANNELS, eps=1e-3,
                                                                                                  momentum=0.1)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    return norm


def _step(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    x = x.detach().clone().requires_grad_(True)
    out = norm(x)
    out.backward(grad)
    return {"output": out.detach(), "input_grad": x.grad, "weight_grad": norm.weight.grad,
            "bias_grad": norm.bias.grad, "running_mean": norm.running_mean, "running_var": norm.running_var}


def _relative(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return float((ours.double() - exact).norm() / exact.norm())


def _exact_and_float32(layout: str, norm_factory=use_accurate_batch_norm) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(0)
    x = _layout(layout, generator)
    grad = torch.randn(x.shape, generator=generator).to(memory_format=torch.channels_last if layout ==
                                                        "channels_last" else torch.contiguous_format)
    norm = _norm_for(x)
    exact = _step(copy.deepcopy(norm).double(), x.double(), grad.double())
    return exact, _step(norm_factory(norm), x, grad)


@pytest.mark.parametrize("layout", ["rows", "channels_last", "contiguous", "transposed"])
def test_float32_step_is_within_rounding_of_float64_on_every_layout(layout):
    exact, ours = _exact_and_float32(layout)
    errors = {key: _relative(ours[key], exact[key]) for key in exact}
    # float32 itself rounds x - mean of an input 5 std from 0 to ~3e-7 (relative).
    assert max(errors.values()) < 1e-6, errors  # the native kernel: 1.8e-5 on rows, 8.5e-6 channels-last


def test_the_native_cpu_kernel_drifts_on_rows_which_is_why_this_module_exists():
    """PyTorch 2.13's CPU kernel sums (rows, C) inputs in float32. If this starts failing after a torch upgrade,
    the kernel became exact: docs/compatibility.md's row on training numerics says what may then be dropped."""
    exact, native = _exact_and_float32("rows", norm_factory=lambda norm: norm)
    assert _relative(native["output"], exact["output"]) > 5e-6


def test_rows_statistics_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(1)
    x, grad = _layout("rows", generator), torch.randn(120_000, CHANNELS, generator=generator)
    norm = _norm_for(x)
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            runs.append(_step(use_accurate_batch_norm(copy.deepcopy(norm)), x, grad))
    finally:
        torch.set_num_threads(threads)
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_running_statistics_follow_batch_norm_semantics():
    """Biased variance normalises, the unbiased one enters running_var; momentum None is a cumulative average."""
    x = torch.randn(500, CHANNELS, generator=torch.Generator().manual_seed(2)) * 2 + 3
    for momentum in (0.3, None):
        native = nn.BatchNorm1d(CHANNELS, momentum=momentum)
        accurate = use_accurate_batch_norm(copy.deepcopy(native))
        for _ in range(3):
            native(x)
            accurate(x)
        assert accurate.num_batches_tracked.item() == native.num_batches_tracked.item() == 3
        torch.testing.assert_close(accurate.running_mean, native.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(accurate.running_var, native.running_var, rtol=1e-6, atol=1e-6)


def test_empty_input_normalises_nothing_and_leaves_the_running_statistics():
    norm = use_accurate_batch_norm(nn.BatchNorm1d(CHANNELS))
    before = {key: value.clone() for key, value in norm.state_dict().items()}
    x = torch.zeros(0, CHANNELS, requires_grad=True)
    out = norm(x)
    out.sum().backward()
    assert out.shape == (0, CHANNELS)
    assert torch.equal(norm.running_mean, before["running_mean"])
    assert torch.equal(norm.running_var, before["running_var"])
    assert norm.num_batches_tracked.item() == 1  # counted, as BatchNorm counts it
    assert torch.equal(norm.weight.grad, torch.zeros(CHANNELS)) and torch.equal(norm.bias.grad, torch.zeros(CHANNELS))


def test_one_value_per_channel_raises_as_batch_norm_does():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        use_accurate_batch_norm(nn.BatchNorm1d(CHANNELS))(torch.randn(1, CHANNELS))


def test_eval_mode_and_names_are_batch_norms():
    native = nn.BatchNorm2d(CHANNELS)
    native.train()(torch.randn(4, CHANNELS, 5, 5))
    accurate = use_accurate_batch_norm(copy.deepcopy(native)).eval()
    native.eval()
    x = torch.randn(3, CHANNELS, 5, 5).contiguous(memory_format=torch.channels_last)
    assert torch.equal(accurate(x), native(x))
    assert list(accurate.state_dict()) == list(native.state_dict())


def test_conversion_is_in_place_idempotent_and_leaves_subclasses_alone():
    class OwnNorm(nn.BatchNorm1d):
        pass

    model = nn.Sequential(nn.Linear(3, CHANNELS), nn.BatchNorm1d(CHANNELS), OwnNorm(CHANNELS),
                          nn.Sequential(nn.Conv2d(1, CHANNELS, 1), nn.BatchNorm2d(CHANNELS)))
    weights = [id(p) for p in model.parameters()]
    assert use_accurate_batch_norm(use_accurate_batch_norm(model)) is model
    assert type(model[1]) is AccurateBatchNorm1d and type(model[3][1]) is AccurateBatchNorm2d
    assert type(model[2]) is OwnNorm
    assert [id(p) for p in model.parameters()] == weights  # an optimizer built before stays valid
    assert isinstance(model[3][1], nn.BatchNorm2d)


def test_row_view_recognises_layouts_whose_channels_are_innermost():
    assert row_view(torch.zeros(5, 3)).shape == (5, 3)
    assert row_view(torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)).shape == (40, 3)
    assert row_view(torch.zeros(2, 4, 3).transpose(1, 2)).shape == (8, 3)
    assert row_view(torch.zeros(2, 3, 4, 5)) is None
    assert row_view(torch.zeros(3, 5).t()) is None
