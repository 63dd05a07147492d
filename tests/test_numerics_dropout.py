"""opencood_ddp/numerics/dropout.py: the hashed dropout drops at rate p with independent decisions, scales kept
values as torch does, applies the same decisions to the gradient, draws its seed from torch's generator (so
manual_seed and a restored generator state reproduce it) and gives the same bits on any thread count; where it
does not apply, ``Dropout`` is ``nn.Dropout``. In process."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from launch import torch_threads
from opencood_ddp.numerics.dropout import Dropout, applies, apply_mask, draw_seed, hashed_dropout

COUNT = 1 << 20


def kept(count: int, p: float) -> torch.Tensor:
    """The keep decisions of one hashed dropout of `count` ones."""
    return hashed_dropout(torch.ones(count), p) != 0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_values_are_dropped_at_rate_p(p):
    torch.manual_seed(0)
    rate = 1.0 - float(kept(COUNT, p).double().mean())
    sigma = math.sqrt(p * (1 - p) / COUNT)
    assert abs(rate - p) < 5 * sigma


def test_neighbouring_decisions_are_independent():
    """Pairs of values 1, 2 and 64 apart (the pairs of one hash, the next channel, the next row of 64) are both
    dropped at rate p^2, and two calls' masks overlap at chance."""
    torch.manual_seed(1)
    p = 0.5
    dropped = ~kept(COUNT, p)
    for offset in (1, 2, 64):
        both = float((dropped[:-offset] & dropped[offset:]).double().mean())
        assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / COUNT), offset
    again = ~kept(COUNT, p)
    assert abs(float((dropped & again).double().mean()) - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / COUNT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_values_are_scaled_as_torch_scales_them_and_the_rest_are_zero(dtype):
    torch.manual_seed(2)
    x = torch.randn(4096, dtype=dtype)
    out = hashed_dropout(x, 0.3)
    factor = torch.ones((), dtype=dtype).div_(0.7)  # torch's mask: bernoulli_(0.7).div_(0.7)
    keep = out != 0
    assert torch.equal(out[keep], x[keep] * factor) and bool((out[~keep] == 0).all())
    assert 0 < int(keep.sum()) < x.numel()


def test_dropped_nan_stays_nan_as_in_torch():
    """x * 0 for a dropped value: torch's dropout multiplies by its mask, so a NaN input stays NaN."""
    x = torch.full((1000,), float("nan"))
    assert bool(hashed_dropout(x, 0.5).isnan().all())


def test_the_gradient_takes_the_forward_decisions_and_scale():
    torch.manual_seed(3)
    x = torch.randn(64, 300, requires_grad=True)
    out = hashed_dropout(x, 0.25)
    grad = torch.randn(64, 300)
    out.backward(grad)
    factor = torch.ones(()).div_(0.75)
    assert torch.equal(x.grad, torch.where(out != 0, grad * factor, torch.zeros(())))


def test_a_non_contiguous_input_and_gradient_are_handled():
    x = torch.randn(300, 64).t().requires_grad_()  # (64, 300), not contiguous
    torch.manual_seed(4)
    out = hashed_dropout(x, 0.5)
    torch.manual_seed(4)
    assert torch.equal(out, hashed_dropout(x.detach().contiguous(), 0.5))
    out.backward(torch.ones(300, 64).t())
    assert torch.equal(x.grad != 0, out != 0)


def test_manual_seed_and_a_restored_generator_state_reproduce_the_mask():
    x = torch.randn(10_000)
    torch.manual_seed(5)
    first, second = hashed_dropout(x, 0.5), hashed_dropout(x, 0.5)
    assert not torch.equal(first, second)  # a new seed per call
    torch.manual_seed(5)
    assert torch.equal(hashed_dropout(x, 0.5), first)
    state = torch.get_rng_state()  # what a checkpoint saves and a resumed run restores
    third = hashed_dropout(x, 0.5)
    torch.set_rng_state(state)
    assert torch.equal(hashed_dropout(x, 0.5), third)


def test_the_seed_is_one_draw_of_torchs_generator():
    torch.manual_seed(6)
    draw_seed()
    after_one = torch.rand(3)
    torch.manual_seed(6)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.rand(3), after_one)


def test_the_same_bits_on_one_two_and_three_threads():
    x = torch.randn(3 * (1 << 17) + 5)  # several parts on 2 and 3 threads, and an uneven end
    outputs = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            torch.manual_seed(7)
            outputs.append(hashed_dropout(x, 0.4))
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def splitmix64_kept(seed: int, count: int, p: float) -> np.ndarray:
    """The module docstring's draws, from SplitMix64's published output function in numpy's wrapping uint64
    arithmetic: value i is kept when the top 32 bits of mix(seed + i * 0x9E3779B97F4A7C15) reach round(p * 2^32)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(32)) >= np.uint64(round(p * 2 ** 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
def test_the_decisions_are_splitmix64s_draws_on_every_part(dtype, inplace):
    """Every value's decision, whichever of 1 or 3 threads' parts computes it, in place or not: the kernel's
    counters start at each part's first index."""
    x = torch.randn(3 * (1 << 17) + 5, dtype=dtype)
    keep = torch.from_numpy(splitmix64_kept(2 ** 62 + 12345, x.numel(), 0.3))
    factor = torch.ones((), dtype=dtype).div_(0.7)
    for threads in (1, 3):
        target = x.clone() if inplace else x
        with torch_threads(threads):
            out = apply_mask(target, 0.3, 2 ** 62 + 12345, inplace=inplace)
        assert (out is target) == inplace
        assert torch.equal(out, torch.where(keep, x * factor, torch.zeros((), dtype=dtype))), threads


def test_where_the_kernel_does_not_apply_dropout_is_torchs():
    x = torch.randn(2000)
    layer = Dropout(0.5)
    assert torch.equal(layer.eval()(x), x)
    layer.train()
    for half in (torch.float16, torch.bfloat16):
        assert not applies(x.to(half), 0.5)
        torch.manual_seed(8)
        ours = layer(x.to(half))
        torch.manual_seed(8)
        assert torch.equal(ours, nn.functional.dropout(x.to(half), 0.5, True))
    for p in (0.0, 1.0):
        assert not applies(x, p)
        assert torch.equal(Dropout(p).train()(x), nn.functional.dropout(x, p, True))


def test_in_place_writes_the_same_values_over_the_input_and_gives_the_same_gradient():
    base = torch.randn(50, 80, requires_grad=True)
    grad = torch.randn(50, 80)
    torch.manual_seed(9)
    out = hashed_dropout(base * 1.0, 0.3)
    out.backward(grad)
    expected_grad, base.grad = base.grad, None
    torch.manual_seed(9)
    hidden = base * 1.0  # mul saves its inputs, not its output: its output may be overwritten
    written = Dropout(0.3, inplace=True).train()(hidden)
    assert written.data_ptr() == hidden.data_ptr() and torch.equal(written, out)
    written.backward(grad)
    assert torch.equal(base.grad, expected_grad)


def test_in_place_over_a_tensor_a_backward_needs_is_refused_by_autograd():
    hidden = torch.randn(100, requires_grad=True).exp()  # exp's backward reads its output
    out = Dropout(0.5, inplace=True).train()(hidden)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_dropout_is_an_nn_dropout_with_no_state():
    layer = Dropout(0.1)
    assert isinstance(layer, nn.Dropout) and layer.p == 0.1 and not layer.state_dict()
