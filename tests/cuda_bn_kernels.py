"""CPU stand-ins for the five CUDA-only kernels of synchronized batch norm, registered for aten's CPU key.

torch's ``SyncBatchNorm`` function and `distributed/device_sync_bn.py` call ``batch_norm_stats``,
``batch_norm_gather_stats_with_counts``, ``batch_norm_elemt``, ``batch_norm_backward_reduce`` and
``batch_norm_backward_elemt``, which have CUDA kernels only. These follow the CUDA kernels' formulas (ATen's
cuda/Normalization.cuh), in the accumulation dtype (float32 for a float32 input): above all the combine, which
merges the ranks' rows in order with an integer running count, so that a row of count 0 merged first gives NaN as
on the GPU. Their sums are not the GPU's summation order; both sides of a test call the same stand-ins, so a test
compares the two functions' logic, not these kernels. Tests only: `register()` in a worker process, `registered()`
around a test in the pytest process.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_LIBRARY = None


def _dims(x: torch.Tensor) -> list:
    return [0] + list(range(2, x.dim()))


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def stats(x, eps):
    """Per channel: mean and 1 / sqrt(biased variance + eps), from float64 sums."""
    xd = x.double()
    mean = xd.mean(_dims(x))
    var = xd.var(_dims(x), unbiased=False)
    return mean.to(_acc(x)), torch.rsqrt(var + eps).to(_acc(x))


def gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    """The CUDA combine: rows merged in order, n an integer, then the running statistics."""
    acc = mean_all.dtype
    avg = torch.zeros(mean_all.shape[1], dtype=acc)
    var_n = torch.zeros_like(avg)
    n = 0
    for j in range(mean_all.shape[0]):
        count = counts[j].to(acc)
        m = mean_all[j]
        v = 1.0 / invstd_all[j]
        v = (v * v - eps) * count
        factor = 1.0 / (torch.tensor(float(n), dtype=acc) + count)
        var_n = var_n + (v + (avg - m) * (avg - m) * n * count * factor)
        avg = n * factor * avg + count * factor * m
        n += int(counts[j])
    mean = avg
    invstd = 1.0 / torch.sqrt(var_n / n + eps)
    if running_mean is not None:
        running_mean.copy_((momentum * avg + (1 - momentum) * running_mean.to(acc)).to(running_mean.dtype))
        unbiased = var_n / (n - 1)
        running_var.copy_((momentum * unbiased + (1 - momentum) * running_var.to(acc)).to(running_var.dtype))
    return mean, invstd


def elemt(x, weight, bias, mean, invstd, eps):
    out = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight.to(mean.dtype), x)
    if bias is not None:
        out = out + _per_channel(bias.to(mean.dtype), x)
    return out.to(x.dtype)


def backward_reduce(grad_out, x, mean, invstd, weight, input_g, weight_g, bias_g):
    dy = grad_out.to(mean.dtype)
    sum_dy = dy.sum(_dims(x))
    sum_dy_xmu = (dy * (x.to(mean.dtype) - _per_channel(mean, x))).sum(_dims(x))
    grad_weight = (sum_dy_xmu * invstd) if weight_g else torch.empty(0)
    grad_bias = sum_dy.clone() if bias_g else torch.empty(0)
    if weight is not None:
        grad_weight, grad_bias = grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def backward_elemt(grad_out, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    total = count.sum().to(mean.dtype)
    mean_dy, mean_dy_xmu = sum_dy / total, sum_dy_xmu / total
    scale = invstd if weight is None else invstd * weight.to(mean.dtype)
    xmu = x.to(mean.dtype) - _per_channel(mean, x)
    grad = (grad_out.to(mean.dtype) - _per_channel(mean_dy, x)
            - xmu * _per_channel(invstd * invstd * mean_dy_xmu, x)) * _per_channel(scale, x)
    return grad.to(x.dtype)


KERNELS = (("batch_norm_stats", stats), ("batch_norm_gather_stats_with_counts", gather_stats_with_counts),
           ("batch_norm_elemt", elemt), ("batch_norm_backward_reduce", backward_reduce),
           ("batch_norm_backward_elemt", backward_elemt))


def register() -> None:
    """Register the stand-ins for aten's CPU key for the rest of this process (a worker's; once)."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library()


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """The stand-ins registered inside the block only (a pytest process runs other tests afterwards)."""
    library = _library()
    try:
        yield
    finally:
        library._destroy()


def _library() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    for name, fn in KERNELS:
        library.impl(name, fn, "CPU")
    return library
