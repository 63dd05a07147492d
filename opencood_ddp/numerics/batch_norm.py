"""Training-mode batch norm whose statistics are exact to float32's rounding on every memory layout.

Why this exists: PyTorch's CPU batch-norm kernels accumulate the per-channel sums in float32, row after row,
whenever the channels are the innermost dimension in memory: a 2-D (rows, C) input, or a channels-last
4-D/5-D one. On AttFuse's first PFN layer (807,264 rows x 64 channels) the batch variance comes out up to
0.72 % wrong (1 thread; 0.40 % with 2), and a training step's outputs sit 1e-2 from the same step in float64
where float32 allows 4e-6. The contiguous (N, C, L) layout goes through a kernel that accumulates in float64
and is exact, but our fast layouts (the PFN's (pillars x points, C) rows, the channels-last BEV canvas,
spconv's (voxels, C) features) are all rows. docs/compatibility.md has the row; do not bring a row layout
back to the native kernel.

What we do instead, on CPU in training mode: the per-channel moments of the forward pass and the two
per-channel sums of the backward pass are accumulated in float64 by compiled loops over the rows (one pass,
shifted by the first row so that no cancellation is left; 12x faster than the native float32 kernel on the
PFN layer above, single-threaded, and deterministic at any thread count). On those row layouts the
normalisation and the input gradient are compiled float64 loops too, rounded once to the input's type, with
the rows split over torch's threads.
Contiguous (N, C, L) inputs keep the native kernels, which are exact on them (statistics), with the native
eval-mode kernel and one addcmul for the elementwise parts.

BatchNorm's semantics are kept: the biased variance normalises, the unbiased one enters the running
variance, momentum (None: cumulative average) and eps as configured, num_batches_tracked counts, an empty
input normalises nothing and leaves the running statistics alone, and one value per channel raises.
Eval mode and CUDA use the module's native forward (elementwise, or CUDA's accurate kernels).

The same function serves synchronized batch norm: ``Reduction`` combines the ranks' moments and sums; the
local one (this module) is the identity, ``distributed/sync_bn.py`` supplies the collective one.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from opencood_ddp.numerics.autocast import HALF_DTYPES
from opencood_ddp.numerics.batch_counts import batch_norm_counted_later, left_to_the_block
from opencood_ddp.numerics.jit import jit
from opencood_ddp.numerics.kernel_path import takes_cpu_kernels
from opencood_ddp.numerics.parallel import even_ranges, part_count, run_parts


# ------------------------------------------------------------------------------------------- compiled loops
@jit
def _row_moments(rows, mean, var):
    """mean and biased var (float64, per column) of a C-contiguous (R, C) float array, R >= 1."""
    count, channels = rows.shape
    shift = np.empty(channels)
    for c in range(channels):
        shift[c] = rows[0, c]
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for r in range(count):  # the inner loop runs along memory, one accumulator per column: it vectorises
        for c in range(channels):
            d = rows[r, c] - shift[c]
            total[c] += d
            squares[c] += d * d
    for c in range(channels):
        m = total[c] / count
        mean[c] = shift[c] + m
        var[c] = max(squares[c] / count - m * m, 0.0)


@jit
def _row_gradient_sums(grad_rows, rows, mean, sum_dy, sum_dy_centred):
    """Per column: sum(dy) and sum(dy * (x - mean)), float64, over C-contiguous (R, C) arrays."""
    count, channels = rows.shape
    for c in range(channels):
        sum_dy[c] = 0.0
        sum_dy_centred[c] = 0.0
    for r in range(count):
        for c in range(channels):
            g = grad_rows[r, c]
            sum_dy[c] += g
            sum_dy_centred[c] += g * (rows[r, c] - mean[c])


@jit
def _row_normalise(rows, mean, scale, shift, out):
    """out = (x - mean) * scale + shift per column, in float64 and rounded once to out's type."""
    count, channels = rows.shape
    for r in range(count):
        for c in range(channels):
            out[r, c] = (rows[r, c] - mean[c]) * scale[c] + shift[c]


@jit
def _row_input_gradient(grad_rows, rows, mean, invstd, scale, mean_dy, mean_dy_xhat, out):
    """dx = scale * (dy - mean(dy) - xhat * mean(dy xhat)), xhat = (x - mean) * invstd, in float64."""
    count, channels = rows.shape
    for r in range(count):
        for c in range(channels):
            xhat = (rows[r, c] - mean[c]) * invstd[c]
            out[r, c] = scale[c] * (grad_rows[r, c] - mean_dy[c] - xhat * mean_dy_xhat[c])


# The elementwise kernels split their rows over torch's threads (numerics/parallel.py): each element's value does
# not depend on which thread computes it. The per-column sums stay in one thread, one pass over the rows in order:
# summing row blocks in parallel and adding the blocks' sums changed the last bit of about 2e-5 of a layer's
# outputs (196 of 10.3 million on AttFuse's PFN layer), and splitting the columns between two threads (each still
# summing its columns in row order) ran 2x slower than one thread here. docs/benchmarks.md has the figures.
def _row_parts(inputs: tuple, per_column: tuple, out: np.ndarray) -> list:
    """Row slices of the (R, C) ``inputs`` and of ``out`` (C-contiguous views still), the (C,) arrays whole: the
    elementwise kernels give every element the same value whichever thread computes it."""
    return [tuple(a[start:stop] for a in inputs) + per_column + (out[start:stop],)
            for start, stop in even_ranges(out.shape[0], part_count(out.size))]


def row_normalise(rows, mean, scale, shift, out) -> None:
    run_parts(_row_normalise, _row_parts((rows,), (mean, scale, shift), out))


def row_input_gradient(grad_rows, rows, mean, invstd, scale, mean_dy, mean_dy_xhat, out) -> None:
    run_parts(_row_input_gradient, _row_parts((grad_rows, rows), (mean, invstd, scale, mean_dy, mean_dy_xhat), out))


# ---------------------------------------------------------------------------------------- layout helpers
_COMPILED_DTYPES = (torch.float32, torch.float64)


def _channels_innermost(t: torch.Tensor) -> torch.Tensor:
    """t (N, C, ...) permuted to (N, ..., C): a view, contiguous when C is innermost in memory."""
    return t if t.dim() == 2 else t.permute([0] + list(range(2, t.dim())) + [1])


def row_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x (N, C, ...) as a C-contiguous (rows, C) view when the channels are innermost in memory (2-D,
    channels-last, or a transposed (N, L, C) buffer); None for any other layout."""
    permuted = _channels_innermost(x)
    return permuted.reshape(-1, x.shape[1]) if permuted.is_contiguous() else None


def _rows_for_kernel(x: torch.Tensor) -> Optional[np.ndarray]:
    """x's rows for the compiled kernels, or None where they do not serve it. The cheap tests come first: on CUDA
    and inside kernel_path.cuda_kernels_on_cpu the row view's permute and reshape would be dispatched for nothing,
    two operators per batch norm that the CUDA step does not run (docs/benchmarks.md, issue 52)."""
    if x.dtype not in _COMPILED_DTYPES or not takes_cpu_kernels(x):
        return None
    rows = row_view(x)
    return None if rows is None else rows.detach().numpy()


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """Per-channel tensors stay float32 for a bf16/fp16 input: the mixed-type CPU kernels want that."""
    return x.dtype if x.dtype in _COMPILED_DTYPES else torch.float32


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reshape a (C,) tensor to broadcast against x of shape (N, C, ...)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _affine(x: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor) -> torch.Tensor:
    """slope * x + intercept per channel in one fused pass: eval-mode batch_norm with mean 0, var 1, eps 0."""
    if x.numel() == 0:  # the native kernels divide by the element count
        return torch.empty_like(x)
    zeros, ones = torch.zeros_like(slope), torch.ones_like(slope)
    return torch.batch_norm(x, slope, intercept, zeros, ones, False, 0.0, 0.0, False)


# ------------------------------------------------------------------------------------- the accurate sums
def _identity_parameters(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weight 1 and bias 0 for x's channels: an affine step that changes no statistic."""
    channels = x.shape[1]
    return (torch.ones(channels, dtype=torch.float32, device=x.device),
            torch.zeros(channels, dtype=torch.float32, device=x.device))


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """(3, C) float64 rows: the value count, mean and biased variance of each channel of x (N, C, ...)."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    mean = torch.zeros(channels, dtype=torch.float64)
    var = torch.zeros(channels, dtype=torch.float64)
    rows = _rows_for_kernel(x) if count else None
    if rows is not None:
        _row_moments(rows, mean.numpy(), var.numpy())
    elif count:
        # Contiguous (N, C, L) goes through the native kernel's float64 accumulation; with eps 0 its invstd is
        # 1 / std, and 0 for a constant channel. bf16/fp16 and CUDA inputs land here too. A 16-bit input without
        # parameters gets its mean and invstd back in its own type, rounded to 8 or 11 bits; float32 parameters
        # select the mixed-type kernel, which accumulates in float32 and returns float32 statistics, as a 1-process
        # run's native forward has them.
        weight, bias = _identity_parameters(x) if x.dtype in HALF_DTYPES else (None, None)
        _, native_mean, invstd = torch.native_batch_norm(x.contiguous(), weight, bias, None, None, True, 0.0, 0.0)
        invstd = invstd.double().cpu()
        mean = native_mean.double().cpu()
        var = torch.where(invstd > 0, invstd.pow(-2), torch.zeros_like(invstd))
    return torch.stack([torch.full_like(mean, float(count)), mean, var]).to(x.device)


def _native_gradient_sums(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                          invstd: torch.Tensor) -> torch.Tensor:
    """(2, C) float64 rows: sum(dy) and sum(dy * xhat) of each channel of a layout that is not rows (the
    native backward's weight-gradient reduction is exactly these two sums, and exact on (N, C, L))."""
    if x.numel() == 0:
        return torch.zeros(2, x.shape[1], dtype=torch.float64, device=x.device)
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_out.contiguous(), x.contiguous(), None, None, None, mean, invstd, True, 0.0, [False, True, True])
    return torch.stack([sum_dy.double(), sum_dy_xhat.double()])


def _row_gradient_totals(grad_rows: np.ndarray, rows: np.ndarray, mean: torch.Tensor,
                         invstd: torch.Tensor) -> torch.Tensor:
    """(2, C) float64 rows: sum(dy) and sum(dy * xhat) of each column of (rows, C) arrays; mean and invstd
    float64."""
    sums = torch.zeros(2, rows.shape[1], dtype=torch.float64)
    _row_gradient_sums(grad_rows, rows, mean.numpy(), sums[0].numpy(), sums[1].numpy())
    sums[1] *= invstd
    return sums


# ------------------------------------------------------------------------------------------- combination
class Reduction:
    """How per-rank statistics become global ones. This one is a single process: the identity."""

    def gather_moments(self, local: torch.Tensor) -> torch.Tensor:
        """(ranks, 3, C) from this rank's (3, C) count, mean and variance."""
        return local[None]

    def sum_over_ranks(self, sums: torch.Tensor) -> torch.Tensor:
        return sums


LOCAL = Reduction()


def combine_moments(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count, mean and biased variance over the rows of (ranks, 3, C), combined exactly (Chan's parallel
    formula: no sum-of-squares cancellation)."""
    counts, means, variances = stacked[:, 0], stacked[:, 1], stacked[:, 2]
    count = counts[:, 0].sum()
    if count.item() == 0:
        # No value anywhere (a global batch of frames without a point in range): BatchNorm on a (0, C) input
        # normalises nothing and leaves the running statistics alone.
        return count, torch.zeros_like(means[0]), torch.ones_like(variances[0])
    if count.item() == 1:  # BatchNorm raises on one value per channel in training, and so do we
        raise ValueError("Expected more than 1 value per channel when training (batch norm over all ranks)")
    if len(stacked) == 1:
        return count, means[0], variances[0]
    mean = (counts * means).sum(0) / count
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / count
    return count, mean, var


class BatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the batch that ``reduction`` spans, from float64 per-channel sums.

    On a row layout the output and the input gradient come from compiled float64 loops as well (3x faster
    than torch's broadcast ops on (rows, C), which take a slow path there); other layouts use the native
    eval-mode kernel and one addcmul.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps: float, momentum: float,
                reduction: Reduction):
        count, mean, var = combine_moments(reduction.gather_moments(local_moments(x)))
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None and count.item() > 0:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        scale = invstd if weight is None else invstd * weight.detach().double().to(invstd.device)
        shift = torch.zeros_like(mean) if bias is None else bias.detach().double().to(mean.device)
        ctx.save_for_backward(x, weight, mean, invstd, scale)
        ctx.count, ctx.reduction = count, reduction
        rows = _rows_for_kernel(x)
        if rows is None:
            dtype = _stat_dtype(x)
            return _affine(x, scale.to(dtype), (shift - mean * scale).to(dtype))
        out = torch.empty_like(x)
        row_normalise(rows, mean.numpy(), scale.numpy(), shift.numpy(), row_view(out).numpy())
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd, scale = ctx.saved_tensors
        rows = _rows_for_kernel(x)
        dtype = _stat_dtype(x)
        if rows is None:
            local = _native_gradient_sums(grad_out, x, mean.to(dtype), invstd.to(dtype))
        else:
            grad_rows = _grad_rows(grad_out)
            local = _row_gradient_totals(grad_rows, rows, mean, invstd)
        # Parameter gradients stay local: DDP averages them over ranks like every other parameter.
        grad_weight = local[1].to(weight.dtype) if weight is not None else None
        grad_bias = local[0].to(weight.dtype) if weight is not None else None
        sums = ctx.reduction.sum_over_ranks(local)
        count = ctx.count.clamp(min=1)  # 0 when no rank had a value: the sums are 0 too
        mean_dy, mean_dy_xhat = sums[0] / count, sums[1] / count
        if rows is not None:
            grad_in = torch.empty_like(x)
            row_input_gradient(grad_rows, rows, mean.numpy(), invstd.numpy(), scale.numpy(), mean_dy.numpy(),
                               mean_dy_xhat.numpy(), row_view(grad_in).numpy())
            return grad_in, grad_weight, grad_bias, None, None, None, None, None
        # dx = (dy - mean(dy) - xhat * mean(dy xhat)) * invstd * w, regrouped as k1 * dy + k2 * x + k3.
        k2 = -scale * mean_dy_xhat * invstd
        k3 = -scale * mean_dy - k2 * mean
        # A 16-bit gradient is formed in float32 and rounded once, as a 1-process run's native backward rounds
        # it; in the 16-bit type the two steps round twice and lose x's offset (a whole unit in the last place).
        work = torch.float32 if x.dtype in HALF_DTYPES else x.dtype
        grad_in = _affine(grad_out.to(work), scale.to(dtype), k3.to(dtype))
        grad_in.addcmul_(x.to(work), _per_channel(k2, x).to(grad_in.dtype))
        return grad_in.to(x.dtype), grad_weight, grad_bias, None, None, None, None, None


def _grad_rows(grad_out: torch.Tensor) -> np.ndarray:
    """The incoming gradient as a (rows, C) array in the input's row order: autograd may hand it over in
    another layout than the input's, which then costs one copy."""
    rows = row_view(grad_out)
    if rows is None:
        rows = _channels_innermost(grad_out).contiguous().reshape(-1, grad_out.shape[1])
    return rows.detach().numpy()


# ------------------------------------------------------------------------------------------------ modules
class AccurateStatistics:
    """Mixin for a ``_BatchNorm`` subclass: training-mode statistics through ``BatchNormFunction``."""

    def reduction(self, x: torch.Tensor) -> Optional[Reduction]:
        """LOCAL where the native CPU kernel would accumulate in float32 (a float row layout); None leaves the
        step to the native forward, which is exact elsewhere: on contiguous (N, C, L), on CUDA (where torch's
        SyncBatchNorm replaces these modules for several ranks), and as precise as its input for bf16/fp16."""
        return LOCAL if _rows_for_kernel(x) is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        batch_statistics = self.training or self.running_mean is None
        reduction = self.reduction(x) if batch_statistics else None
        if reduction is None:
            return self._native_forward(x)
        momentum = 0.0
        if self.training and self.track_running_stats:
            if not left_to_the_block(self):
                self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        updates = self.training and self.running_mean is not None
        return BatchNormFunction.apply(x, self.weight, self.bias, self.running_mean if updates else None,
                                       self.running_var if updates else None, self.eps, momentum, reduction)

    def _native_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module's native forward; in training, its batch count left to numerics/batch_counts.py's block where
        one is open (then the call is the one torch's forward makes: running statistics, batch statistics, the
        momentum)."""
        out = batch_norm_counted_later(self, x)
        return out if out is not None else super().forward(x)


class AccurateBatchNorm1d(AccurateStatistics, nn.BatchNorm1d):
    pass


class AccurateBatchNorm2d(AccurateStatistics, nn.BatchNorm2d):
    pass


class AccurateBatchNorm3d(AccurateStatistics, nn.BatchNorm3d):
    pass


_ACCURATE = {nn.BatchNorm1d: AccurateBatchNorm1d, nn.BatchNorm2d: AccurateBatchNorm2d,
             nn.BatchNorm3d: AccurateBatchNorm3d}


def use_accurate_batch_norm(model: nn.Module) -> nn.Module:
    """Give every plain BatchNorm{1,2,3}d of ``model`` accurate training statistics, in place.

    Only the class changes (no state is added), so parameters keep their identity and state-dict names, and
    an optimizer built before stays valid. Subclasses of BatchNorm are left alone: they may have their own
    forward. Idempotent.
    """
    for module in model.modules():
        accurate = _ACCURATE.get(type(module))
        if accurate is not None:
            module.__class__ = accurate
    return model


def use_native_batch_norm(model: nn.Module) -> nn.Module:
    """The inverse of ``use_accurate_batch_norm``, in place: torch's own kernels again (benchmarks that measure
    what the accurate statistics change)."""
    native = {accurate: plain for plain, accurate in _ACCURATE.items()}
    for module in model.modules():
        plain = native.get(type(module))
        if plain is not None:
            module.__class__ = plain
    return model

