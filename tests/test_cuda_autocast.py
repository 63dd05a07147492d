"""numerics/cuda_autocast.py: inside ``cuda_autocast_on_cpu`` a CPU autocast casts as CUDA's does (torch's
autocast_mode.h lists), op by op, and leaving it gives the CPU's own lists back. Expected dtypes and casts are
derived by hand from each op's CUDA policy."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from op_calls import OpCalls
from opencood_ddp.numerics import cuda_autocast
from opencood_ddp.numerics.cuda_autocast import CUDA_POLICY, cuda_autocast_on_cpu


def dispatched(fn, *args):
    with OpCalls() as ops:
        out = fn(*args)
    return out, ops.calls


@pytest.fixture
def half():
    """A bfloat16 and a float32 activation (no grad), made outside the counted region."""
    torch.manual_seed(0)
    return torch.randn(4, 8).bfloat16(), torch.randn(4, 8)


@pytest.mark.parametrize("fn, name", [(torch.exp, "exp"), (torch.log1p, "log1p"), (lambda t: t.pow(2), "pow"),
                                      (lambda t: F.layer_norm(t, (8,)), "native_layer_norm")])
def test_the_fp32_list_casts_16_bit_inputs_up_first(half, fn, name):
    x, _ = half
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        out, calls = dispatched(fn, x)
    assert out.dtype == torch.float32 and calls["_to_copy"] == 1 and calls[name] == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's lists: no cast, the op in bfloat16
        cpu_out, cpu_calls = dispatched(fn, x)
    assert cpu_out.dtype == torch.bfloat16 and cpu_calls["_to_copy"] == 0
    # the same arithmetic as the explicit cast, bit for bit (log1p of x < -1 is NaN on both sides)
    torch.testing.assert_close(out, fn(x.float()), rtol=0, atol=0, equal_nan=True)


def test_softmax_and_sum_take_float32_as_their_missing_dtype(half):
    x, _ = half
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        probabilities, softmax_calls = dispatched(lambda t: torch.softmax(t, -1), x)
        total, sum_calls = dispatched(torch.sum, x)
        kept, kept_calls = dispatched(lambda t: torch.softmax(t, -1, dtype=torch.bfloat16), x)
    assert probabilities.dtype == torch.float32 and softmax_calls == Counter({"_to_copy": 1, "_softmax": 1})
    assert total.dtype == torch.float32 and sum_calls == Counter({"sum": 1})  # sum accumulates in its dtype itself
    assert kept.dtype == torch.bfloat16 and kept_calls["_to_copy"] == 0  # a dtype given is kept


def test_cat_and_stack_are_not_autocast_on_cuda(half):
    x, y = half
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        out, calls = dispatched(lambda a, b: torch.cat([a, b]), x, y)
    assert out.dtype == torch.float32 and calls == Counter({"cat": 1})  # cat promotes in its own kernel
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cpu_calls = dispatched(lambda a, b: torch.cat([a, b]), x, y)
    assert cpu_calls == Counter({"_to_copy": 1, "cat": 1})  # the CPU's "promote" casts the bfloat16 one first


def test_promote_casts_every_input_to_the_widest(half):
    x, y = half
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        mixed, mixed_calls = dispatched(lambda a, b: torch.addcmul(b, a, a), x, y)
        narrow, narrow_calls = dispatched(lambda a: torch.addcmul(a, a, a), x)
    assert mixed.dtype == torch.float32 and mixed_calls == Counter({"_to_copy": 2, "addcmul": 1})
    assert narrow.dtype == torch.bfloat16 and narrow_calls == Counter({"addcmul": 1})


def test_norm_calls_its_float32_overload():
    x = torch.randn(4, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        out = torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1], True)
    assert out.dtype == torch.float32 and out.shape == (4, 1)
    assert torch.equal(out, torch.ops.aten.norm.ScalarOpt_dim_dtype(x, 2, [1], True, dtype=torch.float32))


def test_binary_cross_entropy_is_refused_as_on_cuda():
    p, target = torch.rand(4), torch.rand(4)
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_autocast_on_cpu():
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(p, target)


def test_a_weight_is_cast_once_per_forward():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    with cuda_autocast_on_cpu():
        with torch.autocast("cpu", dtype=torch.float16):
            _, first = dispatched(lambda t: layer(layer(t)), x)
        with torch.no_grad():
            layer.weight.add_(1.0)  # an optimizer's in-place update
        with torch.autocast("cpu", dtype=torch.float16):
            out, second = dispatched(layer, x)
    # x, the weight and the bias once each; the second call reuses the weight's and the bias's casts
    assert first["_to_copy"] == 3 and first["addmm"] == 2
    assert second["_to_copy"] == 3, "a new forward casts every weight again (autocast's cache is per forward)"
    assert out.dtype == torch.float16
    expected = F.linear(x.half(), layer.weight.detach().half(), layer.bias.detach().half())
    assert torch.equal(out, expected)


def test_a_small_networks_forward_casts_as_cudas_lists_say():
    """Linear -> LayerNorm -> Linear -> softmax -> sum, by hand. CUDA: x, w1, b1 down (3); the LayerNorm's
    bfloat16 input up (1); its float32 output, w2, b2 down (3); the softmax's bfloat16 input up (1): 8 casts.
    The CPU's lists: x, w1, b1, w2, b2 (5); the LayerNorm and the softmax run in bfloat16."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.softmax(net(x), -1).sum()

    with cuda_autocast_on_cpu():
        loss, cuda_calls = dispatched(forward)
    _, cpu_calls = dispatched(forward)
    assert (cuda_calls["_to_copy"], cpu_calls["_to_copy"]) == (8, 5)
    assert loss.dtype == torch.float32


def test_every_op_torch_autocasts_on_cuda_has_a_policy_here():
    """A torch that adds an op to CUDA's lists makes the count refuse (UnknownCudaAutocastOp) until it is listed."""
    on_cuda = {name for name in cuda_autocast._registered("AutocastCUDA") if not name.startswith("cudnn_")}
    assert on_cuda, "this torch registers CUDA's autocast kernels"
    assert on_cuda <= set(CUDA_POLICY), sorted(on_cuda - set(CUDA_POLICY))


def test_leaving_restores_the_cpus_lists_and_nesting_keeps_them_until_the_outer_exit(half):
    x, _ = half
    with cuda_autocast_on_cpu():
        with cuda_autocast_on_cpu():
            pass
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.exp(x).dtype == torch.float32, "still CUDA's lists after the inner exit"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.exp(x).dtype == torch.bfloat16


def test_without_autocast_nothing_is_cast(half):
    x, y = half
    with cuda_autocast_on_cpu():
        out, calls = dispatched(torch.exp, x)
        mixed, mixed_calls = dispatched(lambda a, b: torch.cat([a, b]), x, y)
    assert out.dtype == torch.bfloat16 and calls == Counter({"exp": 1})
    assert mixed.dtype == torch.float32 and mixed_calls == Counter({"cat": 1})


def test_the_ops_cast_here_cache_a_weight_per_forward_as_autocast_does():
    """einsum: cast down on CUDA, not autocast on the CPU, so cast by this module; its weight's cast is reused
    within a forward and made again in the next one, as autocast's own cache (cleared at its exit) would."""
    weight, x = torch.nn.Parameter(torch.randn(8, 8)), torch.randn(2, 8)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.einsum("ij,jk->ik", torch.einsum("ij,jk->ik", x, weight), weight)

    with cuda_autocast_on_cpu():
        out, first = dispatched(forward)
        _, second = dispatched(forward)
    assert out.dtype == torch.bfloat16
    # x and the weight; the second einsum takes the first one's bfloat16 output and the cached weight
    assert first["_to_copy"] == second["_to_copy"] == 2
    assert torch.clear_autocast_cache is torch._C.clear_autocast_cache, "torch's own again after the context"
