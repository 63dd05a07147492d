"""The optimizer's update kernels: fused on CUDA where torch has them, the CPU's default elsewhere, and a resumed
state that keeps this run's choice (engine/optim.py)."""
from __future__ import annotations

import io

import pytest
import torch

from opencood_ddp.engine.optim import build_optimizer, kernel_args, load_optimizer_state
from opencood_ddp.errors import ConfigError

ADAM = {"optimizer": {"core_method": "Adam", "lr": 0.002, "args": {"eps": 1e-10, "weight_decay": 1e-4}}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.arange(8.0).view(2, 4)).square().sum().backward()
    optimizer.step()


def test_cuda_gets_the_fused_update_where_torch_has_one_and_foreach_elsewhere():
    assert kernel_args(torch.optim.Adam, "cuda") == {"fused": True}
    assert kernel_args(torch.optim.SGD, "cuda") == {"fused": True}
    assert kernel_args(torch.optim.RMSprop, "cuda") == {"foreach": True}  # no fused RMSprop in torch 2.13
    assert kernel_args(torch.optim.Adam, "cpu") == {}


def test_the_hypes_choice_wins_and_the_cpu_keeps_torchs_default():
    cpu = build_optimizer(ADAM, _model().parameters(), 0.002)
    assert not cpu.param_groups[0]["fused"] and cpu.param_groups[0]["foreach"] is None
    as_on_cuda = build_optimizer(ADAM, _model().parameters(), 0.002, kernels_for="cuda")
    assert as_on_cuda.param_groups[0]["fused"] is True  # torch runs the fused Adam on CPU tensors too
    chosen = {"optimizer": {**ADAM["optimizer"], "args": {**ADAM["optimizer"]["args"], "foreach": False}}}
    assert not build_optimizer(chosen, _model().parameters(), 0.002, kernels_for="cuda").param_groups[0]["fused"]


def test_a_resumed_state_keeps_this_runs_kernels_and_its_moments():
    model = _model()
    saved_by_gpu_run = build_optimizer(ADAM, model.parameters(), 0.002, kernels_for="cuda")
    _step(model, saved_by_gpu_run)
    buffer = io.BytesIO()
    torch.save(saved_by_gpu_run.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["param_groups"][0]["fused"] is True
    resumed = build_optimizer(ADAM, model.parameters(), 0.002)
    load_optimizer_state(resumed, state)
    assert not resumed.param_groups[0]["fused"] and resumed.param_groups[0]["foreach"] is None
    for p in model.parameters():
        assert torch.equal(resumed.state[p]["exp_avg"], saved_by_gpu_run.state[p]["exp_avg"])
    _step(model, resumed)  # the CPU's update runs on the fused run's moments
    assert all(int(resumed.state[p]["step"]) == 2 for p in model.parameters())


@pytest.mark.parametrize("section, fragment", [
    # torch raised IndexError for a one-entry betas, past the project's frames: a traceback, not a line
    ({"args": {"betas": [0.9]}}, "optimizer.args rejected by torch.optim.Adam (list index out of range)"),
    ({"core_method": "Adamw"}, "optimizer.core_method 'Adamw' is not a torch.optim optimizer (did you mean AdamW?)"),
    ({"core_method": "sgd"}, "(did you mean SGD?)"),
])
def test_an_optimizer_torch_refuses_is_one_line_naming_the_key(section, fragment):
    hypes = {"optimizer": {**ADAM["optimizer"], **section}}
    with pytest.raises(ConfigError) as info:
        build_optimizer(hypes, _model().parameters(), 0.002)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)
