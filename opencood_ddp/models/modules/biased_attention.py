"""Multi-head attention over windows of tokens with a learned per-head bias and a per-sample key bias, one head
at a time on the CPU, reading q, k and v where the qkv projection wrote them.

Why: the plain reading (split qkv into (windows, heads, n, d), ``(q * scale) @ k^T + bias``, softmax, ``@ v``,
heads back to channels) copies q, v, k^T and the output into the layouts the batched products want, adds the
bias into a new (windows, heads, n, n) tensor, and in the backward stacks the three gradients and permutes them
back: on CoBEVT's 1056 windows of 80 tokens, 8 heads, these copies, the scale's multiply and the add took more
of its step than the products themselves. A head's q, k and v are (windows, n, d) slices of the projection's
(windows, n, 3C) output, which the batched products read in place (row stride 3C); the logits start as the
bias, broadcast, and the product is accumulated into them with the scale as its factor (``baddbmm_``), in one
(windows, n, n) buffer that every head reuses. The probabilities kept for the backward are one (windows, n, n)
tensor per head, 27 MB on CoBEVT, not one 216 MB block: glibc serves blocks under its mmap threshold (at most
32 MB) from its heap, which keeps freed pages mapped, so the heads' tensors reuse the previous step's pages, where
a larger block is mapped afresh and page-faults in at every step (docs/benchmarks.md).

The sums are the plain reading's, in another order: outputs and gradients agree with it to float64's rounding
(tests/test_zoo_cobevt.py). CUDA and autocast keep the plain reading (``use_head_loop``).
"""
from __future__ import annotations

from typing import Callable

import torch

from opencood_ddp.numerics.kernel_path import takes_cpu_kernels

_DTYPES = (torch.float32, torch.float64)


def use_head_loop(qkv: torch.Tensor) -> bool:
    """Whether ``biased_attention`` serves this input: a CPU float32/float64 tensor with autocast off."""
    return takes_cpu_kernels(qkv) and qkv.dtype in _DTYPES and not torch.is_autocast_enabled("cpu")


def _head(qkv: torch.Tensor, part: int, head: int, heads: int, parts: int = 3) -> torch.Tensor:
    """Head ``head``'s q (part 0), k (1) or v (2): a (windows, n, d) view of the (windows, n, 3C) projection (or,
    ``parts=1``, of a (windows, n, C) tensor of heads side by side). The batched products read such views in
    place, with their row stride: the same sums as on a contiguous copy, and no copy. Their results reach such
    views through ``_into``."""
    dim = qkv.shape[-1] // parts
    width = dim // heads
    start = part * dim + head * width
    return qkv[:, :, start:start + width]


def _into(target: torch.Tensor, buffer: torch.Tensor, product: Callable[[torch.Tensor], object]) -> None:
    """``product(out=...)`` written into ``target``, a head's strided (windows, n, d) slice, through the contiguous
    (windows, n, d) ``buffer`` and a copy.

    Why not into the slice directly: torch's CPU bmm and baddbmm run one batched gemm, split over torch's threads,
    only into a contiguous result; into a strided one they loop over the windows one gemm at a time on a single
    thread. On CoBEVT's 8 heads at 2 threads that loop takes 122 ms for the forward product, against 56 ms with
    the buffer; at 1 thread the two are 105 and 110 ms, and a full step cannot tell them apart. Each window is the
    same gemm either way: the same bits."""
    product(buffer)
    target.copy_(buffer)


class _BiasedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, bias, key_bias, heads: int, scale: float, keep: bool):
        windows, n, _ = qkv.shape
        samples = key_bias.shape[0]
        out = qkv.new_empty(windows, n, qkv.shape[-1] // 3)
        # keep: the probabilities of every head are kept for a backward; without one (evaluation), one head's.
        # One tensor per head, not one (heads, windows, n, n) block: see the module's docstring.
        attention = [qkv.new_empty(windows, n, n) for _ in range(heads if keep else 1)]
        logits, buffer = qkv.new_empty(windows, n, n), qkv.new_empty(windows, n, out.shape[-1] // heads)
        for h in range(heads):
            start = (bias[h] + key_bias[:, None, :])[:, None]  # (samples, 1, n, n)
            logits.view(samples, windows // samples, n, n).copy_(start.expand(-1, windows // samples, -1, -1))
            logits.baddbmm_(_head(qkv, 0, h, heads), _head(qkv, 1, h, heads).transpose(1, 2), alpha=scale)
            probabilities = attention[h if keep else 0]
            torch.ops.aten._softmax.out(logits, -1, False, out=probabilities)
            v = _head(qkv, 2, h, heads)
            _into(_head(out, 0, h, heads, parts=1), buffer, lambda o: torch.bmm(probabilities, v, out=o))
        if keep:
            ctx.save_for_backward(qkv, *attention)
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, *attention = ctx.saved_tensors
        heads, scale = ctx.heads, ctx.scale
        windows, n, _ = qkv.shape
        grad_out = grad_out.contiguous()
        grad_qkv = torch.empty_like(qkv)
        grad_bias = qkv.new_empty(heads, n, n) if ctx.needs_input_grad[1] else None
        grad_attention, grad_logits = qkv.new_empty(windows, n, n), qkv.new_empty(windows, n, n)
        buffer = qkv.new_empty(windows, n, grad_out.shape[-1] // heads)
        for h in range(heads):
            q, k, v = (_head(qkv, part, h, heads) for part in range(3))
            head_grad = _head(grad_out, 0, h, heads, parts=1)
            probabilities_t = attention[h].transpose(1, 2)
            _into(_head(grad_qkv, 2, h, heads), buffer, lambda o: torch.bmm(probabilities_t, head_grad, out=o))
            torch.bmm(head_grad, v.transpose(1, 2), out=grad_attention)
            torch.ops.aten._softmax_backward_data.out(grad_attention, attention[h], -1, qkv.dtype,
                                                        grad_input=grad_logits)
            if grad_bias is not None:
                torch.sum(grad_logits, dim=0, out=grad_bias[h])
            # beta=0: baddbmm ignores the target's uninitialised contents (a NaN there included) and writes the
            # scaled product alone.
            _into(_head(grad_qkv, 0, h, heads), buffer,
                  lambda o: torch.baddbmm(o, grad_logits, k, beta=0, alpha=scale, out=o))
            _into(_head(grad_qkv, 1, h, heads), buffer,
                  lambda o: torch.baddbmm(o, grad_logits.transpose(1, 2), q, beta=0, alpha=scale, out=o))
        return grad_qkv, grad_bias, None, None, None, None


def biased_attention(qkv: torch.Tensor, bias: torch.Tensor, key_bias: torch.Tensor, heads: int,
                     scale: float) -> torch.Tensor:
    """softmax(scale q k^T + bias[h] + key_bias[sample]) v for every window and head.

    qkv: (windows, n, 3C), the projection's output, channels (q | k | v) each (heads, d); the windows are the
    samples' in turn, ``windows / samples`` each. bias: (heads, n, n), learned. key_bias: (samples, n), added to
    every query's logit of key j (0, or the dtype's lowest value for a key that must get no weight); it takes no
    gradient. Returns (windows, n, C), each token's heads side by side (h d order).
    """
    if key_bias.requires_grad:
        raise ValueError("biased_attention: key_bias takes no gradient; pass it detached")
    keep = torch.is_grad_enabled() and (qkv.requires_grad or bias.requires_grad)
    return _BiasedAttention.apply(qkv.contiguous(), bias.contiguous(), key_bias, heads, scale, keep)
