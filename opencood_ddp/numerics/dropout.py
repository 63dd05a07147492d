"""Training-mode dropout on the CPU that draws its mask and applies it in one pass, and keeps no mask.

Why: torch's CPU dropout fills a float tensor with Bernoulli draws (``bernoulli_``, one generator call per
value), divides it by 1 - p, and multiplies; the backward multiplies by the stored mask again. On CoBEVT's
(1056, 80, 256) feed-forward activations that is about 215 ms forward and 45 ms backward at 1 thread, and a
float mask as large as the activation kept until the backward, 18 times a step. Here the keep/drop decision of
value i is a hash of (seed, i), so the forward is one compiled pass (7 ms in place on the same tensor at 1
thread, split over torch's threads) and the backward applies the same decisions to the gradient from the seed
alone.

The draws: SplitMix64's output function over the counter seed + i * golden gamma (the SplitMix64 sequence
started at ``seed``); the top 32 bits of value i's output are compared with round(p * 2^32), so a value is
dropped with probability p to within 2^-33. The seed is one 63-bit draw from torch's default CPU generator per
call, so ``torch.manual_seed`` reproduces a run, and a checkpoint's saved generator state resumes it bit for
bit. The decisions depend only on (seed, i), never on the thread count. The masks are not torch's: the same
seed gives other draws than ``nn.Dropout`` (docs/compatibility.md).

Kept values are scaled as torch scales them: x * (1 / (1 - p)) with the factor rounded to x's type, so NaN and
inf in dropped values propagate as in torch (x * 0).

Used where it applies (training, CPU, float32 or float64, 0 < p < 1). On CUDA, and on the CPU inside
``cuda_kernels_on_cpu``, a training-mode call with 0 < p < 1 on a non-empty tensor is ``torch.native_dropout``, the
one fused op that torch's ``F.dropout`` takes on CUDA: taken here for ``inplace=True`` as well, where torch's
in-place dropout would run four (a float mask filled by ``bernoulli_``, scaled, and multiplied in), and on the CPU
in the census, whose ``F.dropout`` decomposes into those four (issue 52: the census counts the ops CUDA
dispatches). Everywhere else (bfloat16 under the CPU's autocast, eval mode) ``Dropout`` is ``nn.Dropout``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from opencood_ddp.numerics.jit import jit
from opencood_ddp.numerics.kernel_path import cpu_kernels_enabled, takes_cpu_kernels
from opencood_ddp.numerics.parallel import even_ranges, part_count, run_parts

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_KERNEL_DTYPES = (torch.float32, torch.float64)


@jit
def _draw(z):
    """The top 32 bits of SplitMix64's output function of the counter z."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return (z ^ (z >> np.uint64(31))) >> np.uint64(32)


# Both kernels index slices from 0. numba checks an index below 0 for wrap-around, and where LLVM cannot prove an
# index non-negative (i in range(start, stop)) that check stays in the loop and the loop runs a value at a time:
# 35-41 ms on CoBEVT's (1056, 80, 256) activation, against 7 ms here (1 thread, docs/benchmarks.md). In place takes
# its own kernel: with two arguments that are one array, LLVM's overlap check sends the loop to its scalar copy.
@jit
def _keep_scaled(values, out, seed, threshold, scale, start, stop):
    """out[i] = values[i] * (scale if value i is kept else 0) for i in [start, stop) of flat arrays."""
    zero = values.dtype.type(0)
    source, target = values[start:stop], out[start:stop]
    first = seed + np.uint64(start) * _GAMMA  # value i's counter is seed + i * gamma, modulo 2^64
    for j in range(stop - start):
        target[j] = source[j] * (scale if _draw(first + np.uint64(j) * _GAMMA) >= threshold else zero)


@jit
def _keep_scaled_in_place(values, seed, threshold, scale, start, stop):
    """values[i] *= (scale if value i is kept else 0) for i in [start, stop) of a flat array."""
    zero = values.dtype.type(0)
    part = values[start:stop]
    first = seed + np.uint64(start) * _GAMMA
    for j in range(stop - start):
        part[j] = part[j] * (scale if _draw(first + np.uint64(j) * _GAMMA) >= threshold else zero)


def drop_threshold(p: float) -> np.uint64:
    """The 32-bit draw below which a value is dropped."""
    return np.uint64(int(round(p * 2.0 ** 32)))


def apply_mask(x: torch.Tensor, p: float, seed: int, inplace: bool = False) -> torch.Tensor:
    """x with the values that seed's draws drop at rate p zeroed and the others scaled by 1 / (1 - p); written
    over x when ``inplace`` (x contiguous)."""
    # A fresh tensor, not a view: the caller may add into it in place (autograd refuses that on a view made
    # inside a Function).
    out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    values, target = x.detach().contiguous().view(-1).numpy(), out.detach().view(-1).numpy()
    np_type = values.dtype.type
    scale = np_type(1) / np_type(1 - p)  # rounded as torch's mask.div_(1 - p) rounds it
    args = (np.uint64(seed), drop_threshold(p), scale)
    ranges = even_ranges(values.size, part_count(values.size))
    if inplace:
        run_parts(_keep_scaled_in_place, [(target, *args, start, stop) for start, stop in ranges])
    else:
        run_parts(_keep_scaled, [(values, target, *args, start, stop) for start, stop in ranges])
    return out


def draw_seed() -> int:
    """One 63-bit draw from torch's default CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


class _HashedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int, inplace: bool) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        if inplace:
            ctx.mark_dirty(x)
        return apply_mask(x, p, seed, inplace)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d(x * noise)/dx = noise: the same decisions and scale applied to the gradient. Never in place: the
        # gradient can be another branch's too (a residual add hands the same tensor to both).
        return apply_mask(grad, ctx.p, ctx.seed), None, None, None


def hashed_dropout(x: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    """Training-mode dropout of a CPU float32/float64 tensor with 0 < p < 1, the mask drawn from a new seed;
    ``inplace`` writes over a contiguous x (autograd refuses it where a saved tensor would change)."""
    return _HashedDropout.apply(x, p, draw_seed(), inplace and x.is_contiguous())


def applies(x: torch.Tensor, p: float) -> bool:
    """Whether the hashed kernel serves this call: a CPU float32/float64 tensor and 0 < p < 1 (autocast casts
    no dropout input, so it makes no difference here)."""
    return takes_cpu_kernels(x) and x.dtype in _KERNEL_DTYPES and 0.0 < p < 1.0


def fused_applies(x: torch.Tensor, p: float) -> bool:
    """Whether ``torch.native_dropout`` serves this training-mode call: 0 < p < 1 on a non-empty tensor on CUDA,
    or on the CPU inside ``cuda_kernels_on_cpu`` (the conditions under which torch's F.dropout fuses on CUDA)."""
    on_cuda_path = x.device.type == "cuda" or (x.device.type == "cpu" and not cpu_kernels_enabled())
    return on_cuda_path and 0.0 < p < 1.0 and x.numel() > 0


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same arguments, no state), whose training-mode CPU forward is ``hashed_dropout`` and whose
    training-mode CUDA forward is ``torch.native_dropout`` (never in place: its output is a new tensor).

    ``inplace=True`` writes over the input, as torch's does (the input must be needed by nothing else, and
    should not be a view: autograd then copies the view's base in the backward, which costs more than the
    forward saves; a Linear's output over a 3-D input is such a view)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and applies(x, self.p):
            return hashed_dropout(x, self.p, self.inplace)
        if self.training and fused_applies(x, self.p):
            return torch.native_dropout(x, self.p, True)[0]
        return super().forward(x)
