"""opencood_ddp/numerics/batch_norm.py: training statistics exact to float32's rounding on every layout, with
BatchNorm's semantics (running statistics, momentum, empty and one-value inputs, names), in process."""
from __future__ import annotations

import copy
import multiprocessing

import numpy as np
import pytest
import torch
from torch import nn

from launch import torch_threads
from opencood_ddp.numerics import batch_norm, parallel
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


def _half_ulp_at(magnitude: float, dtype: torch.dtype) -> float:
    """Half the spacing of `dtype`'s values at `magnitude`: the most a value correctly rounded to it is off."""
    return 0.5 * torch.finfo(dtype).eps * 2.0 ** np.floor(np.log2(magnitude))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_16_bit_input_has_float32_statistics_and_results_rounded_once(layout, dtype):
    """A --half activation through the batch norm of several ranks (``BatchNormFunction``; one process's
    reduction here): float32 statistics, as a 1-process run's native forward has them, and an output and input
    gradient that are the exact values rounded once to the 16-bit type. The native statistics kernel without
    parameters returned a 16-bit mean and invstd (2e-3 off in bf16), and a backward in the 16-bit type rounded
    twice: 2 ranks under --half did not follow 1 process (7x the parity floor on the synthetic task)."""
    generator = torch.Generator().manual_seed(0)
    x = _layout(layout, generator).to(dtype)
    grad = torch.randn(x.shape, generator=generator).to(dtype)
    norm = _norm_for(x)
    exact = _step(copy.deepcopy(norm).double(), x.double(), grad.double())
    ours_x = x.detach().clone().requires_grad_(True)
    out = batch_norm.BatchNormFunction.apply(ours_x, norm.weight, norm.bias, norm.running_mean, norm.running_var,
                                             norm.eps, norm.momentum, batch_norm.LOCAL)
    out.backward(grad)
    assert out.dtype == ours_x.grad.dtype == dtype
    for key, ours in (("running_mean", norm.running_mean), ("running_var", norm.running_var)):
        assert _relative(ours, exact[key]) < 1e-6, key  # the 16-bit statistics: 1e-3 in bf16, 2e-4 in fp16
    for key, ours in (("weight_grad", norm.weight.grad), ("bias_grad", norm.bias.grad)):
        assert _relative(ours, exact[key]) < 1e-5, key  # the native backward's float32 sums of 24,000 values
    for key, ours in (("output", out.detach()), ("input_grad", ours_x.grad)):
        magnitude = float(exact[key].abs().max())
        assert float((ours.double() - exact[key]).abs().max()) <= _half_ulp_at(magnitude, dtype) * (1 + 1e-3), key


def test_the_native_cpu_kernel_drifts_on_rows_which_is_why_this_module_exists():
    """PyTorch 2.13's CPU kernel sums (rows, C) inputs in float32. If this starts failing after a torch upgrade,
    the kernel became exact: docs/compatibility.md's row on training numerics says what may then be dropped."""
    exact, native = _exact_and_float32("rows", norm_factory=lambda norm: norm)
    assert _relative(native["output"], exact["output"]) > 5e-6


def _step_on_threads(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor, count: int) -> dict:
    with torch_threads(count):
        return _step(use_accurate_batch_norm(copy.deepcopy(norm)), x, grad)


@pytest.mark.parametrize("layout", ["rows", "channels_last"])
def test_statistics_and_gradients_do_not_depend_on_the_thread_count(layout):
    """The kernels split rows over torch's threads (numerics/parallel.py): every value must be the same bits on 1,
    2 and 3 threads, as a DataLoader worker's or a 1-thread rank's run is."""
    generator = torch.Generator().manual_seed(1)
    x = _layout(layout, generator)
    grad = torch.randn(x.shape, generator=generator).contiguous(memory_format=torch.channels_last if x.dim() == 4
                                                                else torch.contiguous_format)
    assert x.numel() >= 3 * parallel.MIN_ELEMENTS_PER_PART  # so that 3 threads do take 3 parts
    norm = _norm_for(x)
    runs = [_step_on_threads(norm, x, grad, count) for count in (1, 2, 3)]
    for run in runs[1:]:
        for key in runs[0]:
            assert torch.equal(runs[0][key], run[key]), key


def _kernel_results(rows: np.ndarray, grad_rows: np.ndarray) -> dict:
    """The two threaded row kernels at 2 threads, as a training step calls them, without torch's own ops."""
    with torch_threads(2):
        mean, invstd = rows.mean(0, dtype=np.float64), 1 / rows.std(0, dtype=np.float64)
        out, grad_in = np.empty_like(rows), np.empty_like(rows)
        batch_norm.row_normalise(rows, mean, invstd, np.zeros_like(mean), out)
        batch_norm.row_input_gradient(grad_rows, rows, mean, invstd, invstd, mean / 3, invstd / 5, grad_in)
        return {"output": out, "input_grad": grad_in}


def _child_results(rows, grad_rows, queue) -> None:
    queue.put(_kernel_results(rows, grad_rows))


def test_a_forked_child_runs_the_threaded_kernels_after_its_parent_did():
    """A training process forks DataLoader workers after its first steps, when the kernels' thread pool exists.
    The child has none of the pool's threads: the kernels must neither hang there nor compute other values.
    (torch's own multi-threaded ops do hang in such a child, GNU OpenMP not being fork-safe, which is why
    DataLoader workers run one torch thread; the child here calls the compiled kernels alone.)"""
    generator = torch.Generator().manual_seed(2)
    rows = _layout("rows", generator).numpy()
    grad_rows = torch.randn(rows.shape, generator=generator).numpy()
    parent = _kernel_results(rows, grad_rows)  # starts the pool in this process
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_results, args=(rows, grad_rows, queue))
    child.start()
    try:
        in_child = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    for key in parent:
        assert np.array_equal(parent[key], in_child[key]), key


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
