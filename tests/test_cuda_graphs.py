"""engine/cuda_graphs.py, the backend of --capture cudagraphs, on the CPU: every parameter and buffer is a static
input of the forward graph, the batch norms' buffer updates stay in the graphs (no copy after them, where torch's
own cudagraphs backend leaves 3 a batch norm), a graph that writes an input it does not own is still refused, and
the step is the eager step bit for bit. The replay itself needs a GPU: tests/test_capture.py's CUDA cases."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from opencood_ddp.engine.capture import TIMING_WARMUPS
from opencood_ddp.engine.census import cudagraph_skips, ops_outside_graphs
from opencood_ddp.engine.cuda_graphs import StaticWeightsCudagraphs, static_inputs


def _two_batch_norms() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2)]
    return nn.Sequential(*layers).train()


def _step(model: nn.Module, backend) -> Callable[[], torch.Tensor]:
    dense = torch.compile(lambda x: model(x).square().sum(), backend=backend)
    x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(1))

    def step() -> torch.Tensor:
        loss = dense(x)
        loss.backward()
        return loss
    return step


def test_every_parameter_and_buffer_is_a_static_input_of_the_forward_graph():
    seen = []

    def recording(graph, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        def forward(aot_graph, aot_inputs):
            seen.append((static_inputs(len(example_inputs), len(aot_inputs)), len(aot_inputs)))
            return boxed_nop(aot_graph, aot_inputs)
        return aot_autograd(fw_compiler=forward, bw_compiler=boxed_nop)(graph, example_inputs)

    model = _two_batch_norms()
    torch._dynamo.reset()
    _step(model, recording)()
    (static, inputs), = seen
    weights_and_buffers = len(list(model.parameters())) + len(list(model.buffers()))
    assert len(static) == weights_and_buffers == inputs - 1  # all but the batch


def test_the_step_is_the_eager_steps_bit_for_bit_and_the_host_is_the_only_reason_to_skip():
    """Two steps: the losses, the gradients of the last and every weight and buffer equal the eager steps' bit for
    bit. On the CPU the one skip is the host's: the buffers the graph updates are no reason (they are static)."""
    eager_model, captured_model = _two_batch_norms(), _two_batch_norms()
    eager = _step(eager_model, "aot_eager")
    torch._dynamo.reset()
    captured = _step(captured_model, StaticWeightsCudagraphs())
    with cudagraph_skips() as skips:
        for _ in range(2):
            eager_model.zero_grad(set_to_none=True), captured_model.zero_grad(set_to_none=True)
            assert torch.equal(eager(), captured())
    assert skips.count == 1 and "cpu device" in skips.reasons[0], skips.reasons
    for (name, a), b in zip(eager_model.state_dict().items(), captured_model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(eager_model.parameters(), captured_model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_no_copy_of_a_buffer_runs_outside_the_graphs():
    """Under torch's cudagraphs backend the same model leaves 6 copies after its graph (tests/test_step_census.py)."""
    model = _two_batch_norms()
    torch._dynamo.reset()
    step = _step(model, StaticWeightsCudagraphs())
    outside = ops_outside_graphs(lambda: (step(), model.zero_grad(set_to_none=True)))
    assert outside and "aten::copy_" not in outside, outside


@pytest.mark.parametrize("writes_its_input", [True, False])
def test_a_graph_that_writes_an_input_it_does_not_own_is_not_replayed(writes_its_input):
    """The batch is not static: a graph that adds to it in place would replay into a copy of it, so the backend
    refuses the graph (its reason names the mutation), as torch's does, before the host's reason."""
    weight = nn.Parameter(torch.ones(3))

    def dense(x):
        if writes_its_input:
            x.add_(1)
        return (x * weight).sum()

    torch._dynamo.reset()
    compiled = torch.compile(dense, backend=StaticWeightsCudagraphs())
    with cudagraph_skips() as skips:
        compiled(torch.zeros(3)).backward()
    assert skips.count == 1, skips.reasons
    assert ("mutated inputs" in skips.reasons[0]) == writes_its_input, skips.reasons


@pytest.mark.cuda  # CUDA graphs
def test_on_cuda_the_graphs_replay_and_their_buffer_updates_reach_the_modules_buffers():
    """What the CPU cannot show: the graphs replay (no skip), a replay's writes to the static buffers are the
    module's own running statistics, and nothing is copied after the graphs. In float64, three steps: every loss,
    gradient and buffer as the eager steps' to 1e-12 (a CUDA graph may take other kernels than eager, not other
    arithmetic)."""
    cuda = torch.device("cuda")
    eager_model, captured_model = _two_batch_norms().double().to(cuda), _two_batch_norms().double().to(cuda)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(cuda)
    torch._dynamo.reset()
    compiled = torch.compile(lambda batch: captured_model(batch).square().sum(), backend=StaticWeightsCudagraphs())

    def captured_step() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        captured_model.zero_grad(set_to_none=True)
        loss = compiled(x)
        loss.backward()
        return loss.detach().clone()

    with cudagraph_skips() as skips:
        losses = [captured_step() for _ in range(3)]
        outside = ops_outside_graphs(captured_step)  # it takes 1 + TIMING_WARMUPS + 1 steps
    assert skips.count == 0, skips.reasons
    assert "aten::copy_" not in outside, outside
    for step in range(3 + 1 + TIMING_WARMUPS + 1):  # as many as the captured model took
        eager_model.zero_grad(set_to_none=True)
        loss = eager_model(x).square().sum()
        loss.backward()
        if step < 3:
            torch.testing.assert_close(losses[step], loss.detach(), rtol=1e-12, atol=0)
    for (name, a), b in zip(eager_model.state_dict().items(), captured_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=0, msg=name)
    for a, b in zip(eager_model.parameters(), captured_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-300)
