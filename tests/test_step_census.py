"""engine/census.py: the aten calls and FLOPs of a training step (issue 52), on steps small enough to derive by
hand, and the counted step of a toy model on the CUDA path (numerics/kernel_path.py's cuda_kernels_on_cpu, the
optimizer built for CUDA; under autocast, CUDA's cast lists). No timing is asserted."""
from __future__ import annotations

import contextlib
import random
import time

import pytest
import torch

from launch import REPO
from opencood_ddp.engine.census import (Step, activity_kind, activity_of, busy_seconds, count_flops, count_ops,
                                        cuda_path_on_cpu, cudagraph_skips, host_time_by_name, is_host_wait,
                                        ops_outside_graphs, peak_tflops, seconds_in_turns, trainer_step)
from opencood_ddp.engine.optim import build_optimizer
from opencood_ddp.engine.step import Precision
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu

ADAM = {"optimizer": {"core_method": "Adam", "lr": 1e-3}}
# The custom autograd functions of the CPU-only kernels (numerics/batch_norm.py, numerics/dropout.py,
# models/modules/biased_attention.py): none may be in a step on the CUDA path.
CPU_ONLY_FUNCTIONS = {"BatchNormFunctionBackward", "_HashedDropoutBackward", "_BiasedAttentionBackward"}


def _module_step(module: torch.nn.Module, x: torch.Tensor) -> Step:
    """sum(module(x)) back-propagated, then Adam as CUDA runs it (fused), the gradients set to None."""
    optimizer = build_optimizer(ADAM, module.parameters(), 1e-3, kernels_for="cuda")

    def forward_backward() -> torch.Tensor:
        loss = module(x).sum()
        loss.backward()
        return loss

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Step(forward_backward, update)


def test_a_linear_layers_step_dispatches_the_ops_derived_by_hand():
    """Linear(4, 3) on a (5, 4) input that takes no gradient, loss = sum of the outputs, fused Adam:
    - forward and loss (4): F.linear is addmm(bias, x, W.t()): ``t``, ``addmm``; the loss ``sum``; and the
      gradient seed ``ones_like``, which torch.autograd.backward makes before autograd's engine starts;
    - backward (9): SumBackward expands the seed (``expand``); AddmmBackward's weight gradient of the transposed
      W (column-major, so torch returns it column-major too) is grad.t().mm(x).t(): ``t``, ``mm``, ``t``, and
      TBackward transposes it back to W's shape (``t``); the bias gradient is the (5, 3) gradient summed to (3,)
      (``sum`` with keepdim, then ``view``); AccumulateGrad takes each fresh gradient as the parameter's .grad
      by ``detach`` (2 parameters);
    - optimizer (2): fused Adam adds 1 to the step counts of all parameters at once (``_foreach_add_``) and
      updates them in one ``_fused_adam_``; zero_grad(set_to_none=True) dispatches nothing.
    The first step, which creates Adam's state, is not the one counted."""
    torch.manual_seed(0)
    count = count_ops(_module_step(torch.nn.Linear(4, 3), torch.randn(5, 4)))
    assert count.by_phase == {"forward": 4, "backward": 9, "optimizer": 2} and count.total == 15
    assert count.by_op == {"aten::t": 4, "aten::sum": 2, "aten::detach": 2, "aten::addmm": 1, "aten::ones_like": 1,
                           "aten::expand": 1, "aten::mm": 1, "aten::view": 1, "aten::_foreach_add_": 1,
                           "aten::_fused_adam_": 1}
    assert count.python_functions == () and count.flops is None


def test_a_bf16_step_on_the_cuda_path_casts_as_cudas_autocast_lists_say():
    """Linear -> LayerNorm -> Linear -> softmax, loss = sum, under bf16 autocast, the casts by hand from CUDA's
    lists (numerics/cuda_autocast.py). Forward (8): x, W1, b1 down; the LayerNorm's input up (fp32 list); its
    output, W2, b2 down; the softmax's input up (softmax takes float32 as its dtype). Backward (7): each of those
    casts whose input takes a gradient casts its gradient back (all but x's). Under the CPU's own lists the
    LayerNorm and the softmax run in bfloat16: 5 and 4."""
    def casts(counted_on) -> tuple:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        optimizer = build_optimizer(ADAM, net.parameters(), 1e-3, kernels_for="cuda")
        x = torch.randn(2, 8)

        def forward_backward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.softmax(net(x), -1).sum()
            loss.backward()
            return loss

        with counted_on():
            count = count_ops(Step(forward_backward, lambda: (optimizer.step(), optimizer.zero_grad())))
        return count.calls["forward"]["aten::_to_copy"], count.calls["backward"]["aten::_to_copy"]

    assert casts(cuda_path_on_cpu) == (8, 7)
    assert casts(contextlib.nullcontext) == (5, 4)


def test_the_flops_of_a_linear_and_a_convolution_are_the_hand_formulas():
    """A multiply-add is 2 FLOPs. Linear(in, out) on N rows: 2 N in out forward; backward, the weight's gradient
    is as many again and the input's (x takes none) is not computed. Conv2d(Cin, Cout, k) to an (N, Cout, H, W)
    output: 2 N Cout H W Cin k^2 forward, and as many for each of the two gradients (weight, input). Biases and
    the loss's sum are not products: FlopCounterMode leaves them out."""
    torch.manual_seed(0)
    n, features_in, features_out = 5, 4, 3
    linear = _module_step(torch.nn.Linear(features_in, features_out), torch.randn(n, features_in))
    assert count_flops(linear) == 2 * (2 * n * features_in * features_out)
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    conv = _module_step(torch.nn.Conv2d(3, 8, kernel_size=3, padding=1), x)
    assert count_flops(conv) == 3 * (2 * 2 * 8 * 16 * 16 * 3 * 3 * 3)
    # count_ops(flops=True) counts the same FLOPs in its counted step
    assert count_ops(conv, flops=True).flops == count_flops(conv)


def test_the_published_peaks_by_device_name():
    assert peak_tflops("NVIDIA H200", "bf16") == (989.4, "BF16")
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == (494.7, "TF32")
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == (67.0, "FP32")
    assert peak_tflops("NVIDIA H100 PCIe", "fp16")[0] < peak_tflops("NVIDIA H100 80GB HBM3", "fp16")[0]
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == (312.0, "FP16")
    assert peak_tflops("NVIDIA GeForce GTX 1080", "fp32") is None


@pytest.fixture(scope="module")
def cobevt(toy_small):
    """Toy CoBEVT with upstream's dropout (0.1; the toy config's is 0): batch norm, dropout and the windowed
    attention, the three layers with CPU-only kernels, in one small model."""
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / "toy" / "point_pillar_cobevt.yaml",
                              [*split_overrides(toy_small), "model.args.fax_fusion.drop_out=0.1"])
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[0]])
    return hypes, task, batch


def _cobevt_step(cobevt) -> Step:
    hypes, task, batch = cobevt
    model = task.model.train()
    optimizer = build_optimizer(hypes, model.parameters(), 1e-3, kernels_for="cuda")
    return trainer_step(task.step, model, batch, optimizer, Precision(None, torch.device("cpu")))


def _counted(step: Step, **kwargs):
    random.seed(0), torch.manual_seed(0)
    return count_ops(step, **kwargs)


def test_a_toy_models_step_on_the_cuda_path_runs_no_cpu_only_kernel(cobevt):
    """Outside cuda_kernels_on_cpu the CPU-only kernels serve the step (the graph holds their functions: the check
    sees them); inside, torch's native batch norm, dropout and products do, and the count repeats exactly."""
    step = _cobevt_step(cobevt)
    assert CPU_ONLY_FUNCTIONS <= set(_counted(step).python_functions)
    with cuda_kernels_on_cpu():
        first, second = _counted(step, flops=True), _counted(step, flops=True)
    assert not CPU_ONLY_FUNCTIONS & set(first.python_functions), first.python_functions
    assert first.by_op == second.by_op and first.flops == second.flops > 0
    assert first.total == sum(first.by_phase.values()) > 0 and all(first.by_phase.values())
    # torch's own layers as CUDA runs them: batch norm's kernel, dropout as one native_dropout (numerics/dropout.py;
    # F.dropout on a CPU tensor would draw its mask with bernoulli_, four ops), Adam fused
    assert {"aten::native_batch_norm", "aten::native_dropout", "aten::_fused_adam_"} <= set(first.by_op)
    assert "aten::bernoulli_" not in first.by_op


PILLAR_MODELS = ["point_pillar_early_fusion", "point_pillar_intermediate_fusion", "point_pillar_fcooper",
                 "point_pillar_v2vnet", "point_pillar_cobevt", "point_pillar_where2comm", "point_pillar_v2xvit"]


def _convolution_inputs(config: str, toy_small) -> list:
    """(module name, input strides, contiguous) of every 2-D convolution in a toy model's training step."""
    from zoo import toy_batch

    batch, model, task = toy_batch(REPO / "hypes_yaml" / "toy" / f"{config}.yaml", toy_small, 1)
    seen = []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            module.register_forward_hook(lambda m, inputs, out, name=name: seen.append(
                (name, inputs[0].stride(), inputs[0].is_contiguous())))
    task.step(model.train(), batch).total.backward()
    return seen


@pytest.mark.parametrize("config", PILLAR_MODELS)
def test_on_the_cuda_path_every_convolution_reads_a_contiguous_map(config, toy_small):
    """On CUDA a convolution over a channels-last map gives its weight a channels-last gradient, which AccumulateGrad
    copies into the weight's layout and DDP's buckets warn about (V2VNet's heads on the H200, 2026-11-30): every
    map a convolution reads is NCHW-contiguous on the CUDA path."""
    with cuda_kernels_on_cpu():
        seen = _convolution_inputs(config, toy_small)
    assert seen and all(contiguous for _, _, contiguous in seen), [s for s in seen if not s[2]]


def test_on_the_cpus_own_path_the_backbone_reads_channels_last_rows(toy_small):
    """The control of the hook: on the CPU's own path AttFuse's scatter writes channels-last rows for the accurate
    batch norm, and the backbone's first convolution reads them so."""
    name, strides, contiguous = _convolution_inputs("point_pillar_intermediate_fusion", toy_small)[0]
    assert name == "backbone.blocks.0.1" and not contiguous and strides[1] == 1, (name, strides)


def test_the_gpus_busy_time_is_the_union_of_its_activities():
    """By hand, in ns: [0, 10] and [5, 20] overlap (20); [20, 25] touches them (25); [30, 31] after a gap (26);
    [2, 4] lies inside the first (26)."""
    assert busy_seconds([(30, 31), (0, 10), (5, 20), (20, 25), (2, 4)]) == 26e-9
    assert busy_seconds([]) == 0.0


def test_a_profiled_steps_activity_is_read_from_the_profilers_own_events():
    """The Kineto events device_activity reads on a GPU, here of a CPU profile (the CPU's ops stand for the kinds
    read): a Linear step's addmm is there once a forward, and the busy time is within the profiled step's."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    step = _module_step(torch.nn.Linear(4, 3), torch.randn(5, 4))
    step()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    elapsed = time.perf_counter() - started
    activity = activity_of(prof.profiler.kineto_results.events(), kinds=("cpu_op",))
    assert activity.by_name["aten::addmm"][0] == 1 and activity.kernels == 0  # no "kernel" on a CPU
    assert 0 < activity.busy_s <= elapsed
    assert list(activity.by_name) == sorted(activity.by_name, key=lambda name: -activity.by_name[name][1])
    # the host's own time by op (key_averages' self time): the backward's mm is there too; each op's own time
    # leaves out the ops it called, so all of them together are within the step's wall time
    own = host_time_by_name(prof.key_averages())
    assert own["aten::addmm"][0] == 1 and own["aten::mm"][0] == 1
    assert all(seconds > 0 for _, seconds in own.values()) and sum(s for _, s in own.values()) <= elapsed
    assert list(own) == sorted(own, key=lambda name: -own[name][1])


class _Event:
    """A profiler event as torch 2.11's Kineto events present it, no ``activity_type``: its name, device type,
    annotation flag and interval in ns. Either a real event with its kind hidden, or one made here (a GPU's, which
    no profile here can hold)."""

    def __init__(self, name: str, device_type, annotation: bool = False, start: int = 0, duration: int = 0):
        self._name, self._device_type, self._annotation = name, device_type, annotation
        self._start, self._duration = start, duration

    def start_ns(self) -> int:
        return self._start

    def duration_ns(self) -> int:
        return self._duration

    def name(self) -> str:
        return self._name

    def device_type(self):
        return self._device_type

    def is_user_annotation(self) -> bool:
        return self._annotation


def test_an_events_kind_where_torch_does_not_tell_it():
    """torch 2.11 (the GPU machines') has no ``activity_type``: the host's ops come out as torch 2.13 names them,
    annotations by their flag, and the GPU's events by CUPTI's names for copies and fills, kernels otherwise."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("a user's region"):
            torch.nn.Linear(4, 3)(torch.randn(5, 4)).sum().backward()
    events = prof.profiler.kineto_results.events()
    hidden = [_Event(e.name(), e.device_type(), e.is_user_annotation()) for e in events]
    assert {activity_kind(e) for e in hidden} == {"cpu_op", "user_annotation"}
    if hasattr(events[0], "activity_type"):  # torch 2.13 tells the kind: the same answers
        assert [activity_kind(e) for e in hidden] == [e.activity_type() for e in events]
    cuda = DeviceType.CUDA
    device = [_Event("Memcpy HtoD (Pageable -> Device)", cuda, start=0, duration=10),
              _Event("Memset (Device)", cuda, start=20, duration=5),
              _Event("void at::native::vectorized_elementwise_kernel<4>", cuda, start=30, duration=10),
              _Event("ProfilerStep#1", cuda, annotation=True, start=0, duration=100)]
    assert [activity_kind(e) for e in device] == ["gpu_memcpy", "gpu_memset", "kernel", "gpu_user_annotation"]
    activity = activity_of(device)  # the annotation spans the step and is left out of the GPU's busy time
    assert activity.kernels == 1 and set(activity.by_name) == {e.name() for e in device[:3]}
    assert activity.busy_s == 25e-9



def test_the_hosts_waits_are_its_blocking_runtime_calls_and_not_the_profiles_end():
    """A read of a device value is a copy, then cudaStreamSynchronize; torch.cuda.synchronize is
    cudaDeviceSynchronize; the driver's and versioned names count too. An asynchronous copy, a launch, a GPU event
    and cudaEventSynchronize (how device_activity ends its profile) are not waits."""
    from torch.autograd import DeviceType

    host, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [_Event("cudaMemcpyAsync", host, start=0, duration=3),
              _Event("cudaStreamSynchronize", host, start=3, duration=40),
              _Event("cudaLaunchKernel", host, start=50, duration=5),
              _Event("cuStreamSynchronize_v2", host, start=60, duration=7),
              _Event("cudaDeviceSynchronize", host, start=70, duration=100),
              _Event("cudaEventSynchronize", host, start=200, duration=500),
              _Event("cudaStreamSynchronize", cuda, start=0, duration=1000),  # not the host's: no wait of its
              _Event("void at::native::vectorized_elementwise_kernel<4>", cuda, start=0, duration=10)]
    activity = activity_of(events)
    assert (activity.host_waits, activity.host_wait_s) == (3, 147e-9)
    assert [is_host_wait(name) for name in ("cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyAsync", "cuCtxSynchronize",
                                            "cudaEventSynchronize", "aten::item")] \
        == [True, True, False, True, False, False]


def test_cudagraph_skips_hears_inductors_reasons_and_counts_them():
    """A graph inductor does not replay as a CUDA graph keeps its launches, and the captured step's reports say why:
    what torch's own skip logger gives (as inductor calls it on a GPU) is counted and its first line kept; no other
    inductor warning is, and nothing after the block."""
    import logging

    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with cudagraph_skips() as skips:
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances). Found from :\n"
                                            "  File model.py, line 1")
        logging.getLogger("torch._inductor.graph").warning("not about CUDA graphs")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a later graph")
    assert skips.count == 1
    assert skips.reasons == ["skipping cudagraphs due to mutated inputs (1 instances). Found from :"]


def test_seconds_in_turns_rotates_who_goes_first():
    """Three steps over three rounds: each goes first once, each runs once a round, each gets its median."""
    order = []
    medians = seconds_in_turns({name: (lambda name=name: order.append(name)) for name in "abc"},
                               torch.device("cpu"), rounds=3)
    assert order == list("abc") + list("bca") + list("cab")
    assert set(medians) == set("abc") and all(seconds >= 0 for seconds in medians.values())


def test_the_calls_outside_a_compiled_graph_are_the_ones_written_around_it():
    """A compiled (aot_eager) product, ReLU, scale and sum with eager work around it: outside its graphs stay the
    `abs` before it, the `add` after it, the gradient seed (`ones_like`) and AccumulateGrad's `detach` of the weight's
    gradient; the graph's own calls (forward and backward) are inside its ranges, and not counted."""
    weight = torch.randn(4, 4, requires_grad=True)
    dense = torch.compile(lambda x: torch.relu(x @ weight).mul(2).sum(), backend="aot_eager")
    x = torch.randn(3, 4)

    def step() -> None:
        (dense(x.abs()) + 1).backward()
        weight.grad = None

    assert ops_outside_graphs(step) == {"aten::abs": 1, "aten::add": 1, "aten::detach": 1, "aten::ones_like": 1}


@pytest.mark.parametrize("backend, epilogue", [("cudagraphs", 6), ("aot_eager", 0)])
def test_the_buffer_updates_a_graph_leaves_to_its_epilogue_are_counted_outside_it(backend, epilogue):
    """Two training batch norms: under the cudagraphs backend AOTAutograd returns their 6 updated buffers (running
    mean, variance, batch count) from the graph and copies each into its buffer after it, eagerly: 6 `copy_`s a
    step that a CUDA graph replay does not take away. aot_eager keeps input mutations in its graph."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.BatchNorm2d(2)).train()
    dense = torch.compile(lambda x: model(x).sum(), backend=backend)
    x = torch.randn(2, 2, 3, 3)

    def step() -> None:
        dense(x).backward()
        model.zero_grad(set_to_none=True)

    assert ops_outside_graphs(step).get("aten::copy_", 0) == epilogue
