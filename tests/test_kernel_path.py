"""``cuda_kernels_on_cpu``: inside it the three CPU-only kernels step aside for torch's native ones, as on CUDA,
and outside nothing changes (numerics/kernel_path.py)."""
from __future__ import annotations

import torch

from opencood_ddp.models.modules.biased_attention import use_head_loop
from opencood_ddp.numerics import batch_norm, dropout
from opencood_ddp.numerics.kernel_path import cpu_kernels_enabled, cuda_kernels_on_cpu


def test_inside_the_cpu_takes_the_native_kernels_and_outside_its_own():
    rows, qkv = torch.randn(64, 8), torch.randn(4, 5, 24)
    assert batch_norm._rows_for_kernel(rows) is not None and dropout.applies(rows, 0.1) and use_head_loop(qkv)
    with cuda_kernels_on_cpu():
        with cuda_kernels_on_cpu():  # re-entrant
            assert not cpu_kernels_enabled()
        assert batch_norm._rows_for_kernel(rows) is None
        assert not dropout.applies(rows, 0.1) and not use_head_loop(qkv)
    assert cpu_kernels_enabled() and batch_norm._rows_for_kernel(rows) is not None


def test_a_batch_norm_step_inside_is_torchs_own():
    torch.manual_seed(0)
    x = torch.randn(300, 16, requires_grad=True)
    ours = batch_norm.use_accurate_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm1d(16)))
    native = batch_norm.use_native_batch_norm(torch.nn.Sequential(torch.nn.BatchNorm1d(16)))
    with cuda_kernels_on_cpu():
        out = ours(x)
        out.square().sum().backward()
    grad, x.grad = x.grad, None
    expected = native(x)
    expected.square().sum().backward()
    assert torch.equal(out, expected) and torch.equal(grad, x.grad)
    assert torch.equal(ours[0].running_var, native[0].running_var)
