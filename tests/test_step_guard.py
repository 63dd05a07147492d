"""The fit loop's guard of a step (engine/step_guard.py). BufferSnapshot: the batch norms' statistics come back bit
for bit, NaNs of a poisoned batch included, and taking the copy costs one foreach call per device and dtype, not a
launch per buffer. gradient_norm: torch's total norm bit for bit, in a few calls. That the trainer restores the
statistics on N ranks is tests/test_resilience.py's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from op_calls import OpCalls
from opencood_ddp.engine.step_guard import BufferSnapshot, gradient_norm


def _batch_norms(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.BatchNorm1d(3) for _ in range(layers)]).train()


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's bytes (NaN equals itself), an integer tensor as it is."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.is_floating_point() else tensor


def _same_bits(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
                                           for a, b in zip(left, right))


def test_restore_puts_back_the_statistics_a_poisoned_step_moved():
    model = _batch_norms(4)
    model(torch.randn(8, 3))  # statistics away from their initial values, and counters at 1
    before = _buffers(model)
    snapshot = BufferSnapshot(model)
    snapshot.take()
    model(torch.full((8, 3), float("nan")))
    model(torch.randn(8, 3))
    assert not _same_bits(_buffers(model), before)
    snapshot.restore()
    assert _same_bits(_buffers(model), before)
    assert all(int(b) == 1 for name, b in model.named_buffers() if name.endswith("num_batches_tracked"))


def test_each_take_copies_the_buffers_as_they_are_then():
    """The copy's storage is made once and filled again at every step: a restore goes back to the latest take."""
    model = _batch_norms(2)
    snapshot = BufferSnapshot(model)
    snapshot.take()
    model(torch.randn(8, 3))
    second = _buffers(model)
    snapshot.take()
    model(torch.randn(8, 3))
    snapshot.restore()
    assert _same_bits(_buffers(model), second)


def test_a_take_is_one_foreach_copy_per_dtype_whatever_the_buffer_count():
    """23 batch norms (the full-size PointPillar backbones' count) hold 69 buffers: the float statistics and the
    int64 counters, two foreach copies; a fresh clone each step was 69 clones and 69 detaches."""
    model = _batch_norms(23)
    snapshot = BufferSnapshot(model)
    snapshot.take()  # the first take also makes the storage
    with OpCalls() as counted:
        snapshot.take()
    assert dict(counted.calls) == {"_foreach_copy_": 2}
    with OpCalls() as counted:
        snapshot.restore()
    assert dict(counted.calls) == {"_foreach_copy_": 2}


def test_buffers_replaced_since_the_last_take_are_copied_afresh():
    """A module moved to another dtype holds new buffer tensors; the next take copies those, not the old ones."""
    model = _batch_norms(2)
    snapshot = BufferSnapshot(model)
    snapshot.take()
    model.double()
    model(torch.randn(8, 3, dtype=torch.float64))
    moved = _buffers(model)
    snapshot.take()
    model(torch.randn(8, 3, dtype=torch.float64))
    snapshot.restore()
    assert _same_bits(_buffers(model), moved) and moved[0].dtype == torch.float64


def test_a_module_without_buffers_takes_and_restores_nothing():
    snapshot = BufferSnapshot(nn.Linear(3, 2))
    with OpCalls() as counted:
        snapshot.take()
        snapshot.restore()
    assert not counted.calls


def _with_gradients(dtypes: list[torch.dtype]) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(5, 5).to(dtype) for dtype in dtypes])
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e3
    return model


@pytest.mark.parametrize("dtypes", [[torch.float32] * 12, [torch.float32, torch.float64, torch.float32]])
def test_the_gradient_norm_is_torchs_total_norm_bit_for_bit(dtypes):
    model = _with_gradients(dtypes)
    grads = [p.grad for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    got = gradient_norm(model)
    assert got.dtype == expected.dtype and torch.equal(_bits(got), _bits(expected))


def test_the_gradient_norm_is_a_few_calls_whatever_the_parameter_count():
    """One foreach norm per device and dtype, a stack, a norm: no call per parameter (get_total_norm's .to)."""
    model = _with_gradients([torch.float32] * 12)
    with OpCalls() as counted:
        gradient_norm(model)
    assert dict(counted.calls) == {"_foreach_norm": 1, "stack": 1, "linalg_vector_norm": 1}


def test_a_nonfinite_gradient_makes_the_norm_nonfinite_and_no_gradient_gives_none():
    model = _with_gradients([torch.float32] * 3)
    assert gradient_norm(model).isfinite()
    model[1].bias.grad[2] = float("nan")
    assert not gradient_norm(model).isfinite()
    assert gradient_norm(nn.Linear(2, 2)) is None
