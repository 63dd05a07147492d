"""What one training step asks of a device: the eager operators it dispatches, by phase, its floating-point
operations, and the device's published peak rate beside them (issue 52; tools/benchmarks/benchmark_models.py
``--count`` and tools/gpu_check.py's model table).

Why count operators: a GPU step of the baselines' models at a small batch is bound by kernel launches, each of
which costs the host microseconds whatever its size, not by arithmetic. The count does not depend on the device, so
it is taken on a machine without a GPU as well: inside ``cuda_path_on_cpu`` the CPU-only kernels (float64
batch-norm statistics, the hashed dropout, CoBEVT's head loop) step aside for torch's native ones, which CUDA runs
(``numerics.kernel_path``), a 16-bit autocast casts by CUDA's lists, not the CPU's (``numerics.cuda_autocast``),
and an optimizer built with ``build_optimizer(..., kernels_for="cuda")`` takes the fused or foreach kernels CUDA
takes. Call the counters inside that context with such an optimizer to count the CUDA step.

- `count_ops`: every aten operator call that reaches the dispatcher below autograd, as a ``TorchDispatchMode``
  sees it: views and in-place ops included, an op with a kernel of its own (a convolution) once, a composite op
  as the ops it decomposes into. Counted in one step after a first one that creates the optimizer's state, split
  into forward and loss (with the gradient seed, which ``backward`` makes before autograd's engine starts, and the
  fit loop's guard: the buffers' undo copy before the step, the gradient norm and the losses' read after it),
  backward (the calls the engine makes), and the optimizer's update. A kernel outside aten (spconv's sparse
  convolutions, a numba loop) is not an aten call and is not counted; the tensors it allocates through torch are.
  Where torch decomposes by device the CPU count is the CPU's: F.dropout in training dispatches empty_like,
  bernoulli_, div_ and mul on a CPU tensor, native_dropout on a CUDA one.
- `count_calls`: the same count by op alone, of any callable (the fit loop's own step).
- `ops_outside_graphs`: of a captured step (--capture), the aten calls made outside its compiled graphs, which
  the host still launches one at a time when the graphs replay (torch's profiler, not a dispatch mode).
- `count_flops`: torch's ``FlopCounterMode`` over forward, loss and backward: the matrix products, convolutions
  (forward and backward) and attention kernels it has formulas for. Elementwise work (activations, normalisation,
  the loss's arithmetic, the optimizer's update, which runs outside the counted part) is not in it, nor are kernels
  outside aten (spconv's), so it is a lower bound of the arithmetic.
- `device_activity`: on a GPU, what one profiled step ran there (kernels, copies, fills by name; launches) and how
  long the GPU was busy: beside the unprofiled step time, whether the step is bound by the GPU's work or by the
  host's launches; and the host's side of the same step: its waits for the device, and its own time by op.
- `peak_tflops`: the published dense peak of a known device for a precision.
- `cudagraph_skips`: around compiles, the graphs not replayed as CUDA graphs (inductor's, or the cudagraphs
  backend's of --capture cudagraphs), and torch's reasons.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from opencood_ddp.engine.loss_sums import LossSums
from opencood_ddp.engine.step import Precision, forward_backward
from opencood_ddp.engine.step_guard import StepGuard
from opencood_ddp.engine.trainer import optimizer_step
from opencood_ddp.numerics.cuda_autocast import cuda_autocast_on_cpu
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu

PHASES = ("forward", "backward", "optimizer")
# The profiler's ranges of a compiled graph's run: AOTAutograd's autograd function, forward and backward
GRAPH_RANGES = ("CompiledFunction", "CompiledFunctionBackward")


@dataclass(frozen=True)
class Step:
    """One training step as two calls: ``forward_backward`` runs the forward and the loss under the precision's
    autocast and back-propagates, returning the (unscaled) loss; ``update`` steps the optimizer and drops the
    gradients. The counters need the two apart: the optimizer's calls are told from the others by when they run."""

    forward_backward: Callable[[], torch.Tensor]
    update: Callable[[], object]

    def __call__(self) -> torch.Tensor:
        loss = self.forward_backward()
        self.update()
        return loss


def trainer_step(task_step: Callable, model: torch.nn.Module, batch, optimizer: torch.optim.Optimizer,
                 precision: Precision, scaler: Optional[torch.amp.GradScaler] = None) -> Step:
    """The fit loop's step on one batch already on the device, so that what is counted and timed is the step a run
    takes: engine/step_guard.py's StepGuard around engine/step.py's forward_backward (the buffers' undo copy
    before it; after it the gradient norm, read to the host with the losses in the step's one device wait), then
    engine/trainer.py's optimizer_step. Left out: the loss all-reduce on N ranks, a host collective of the
    control plane (tools/benchmarks/benchmark_ddp.py times the whole loop)."""
    guard = StepGuard(model)

    def guarded() -> torch.Tensor:
        guard.before_step()
        out = forward_backward(task_step, model, batch, precision, scaler)
        sums = LossSums()
        sums.add(out.total, dict(out.parts), 1)
        guard.settle(sums, scaler)
        return out.total

    return Step(guarded, lambda: optimizer_step(optimizer, scaler))


@contextlib.contextmanager
def cuda_path_on_cpu() -> Iterator[None]:
    """CPU tensors on the path a CUDA step takes: CUDA's kernels for the layers with CPU-only ones
    (numerics/kernel_path.py) and, under a 16-bit autocast, CUDA's autocast lists (numerics/cuda_autocast.py)."""
    with cuda_kernels_on_cpu(), cuda_autocast_on_cpu():
        yield


# ------------------------------------------------------------------------------------------- operators
class _OpCounter(TorchDispatchMode):
    """Counts each aten call by (phase, op). The phase of a call made while autograd's engine runs a graph task is
    "backward" (on CPU tensors the engine runs on the calling thread; on CUDA the mode travels to its device
    threads with the rest of the thread-local state); ``updating`` marks the optimizer's calls."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.updating = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.updating:
            phase = "optimizer"
        else:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        # aten only: the optimizer's profiler ranges (profiler::_record_function_*) dispatch no kernel.
        if func.namespace == "aten":
            self.calls[phase, func._schema.name] += 1  # "aten::addmm": the overload (.out, .Tensor) left out
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class OpCount:
    """One step's aten calls: ``calls`` maps each phase (forward and loss, backward, optimizer) to its ops and
    their calls, the most called first; ``python_functions``: the classes of the custom autograd functions (Python
    ``torch.autograd.Function``) in the step's graph, where a CPU-only kernel would show up; ``flops``: the same
    step's FLOPs (``count_flops``'s), where asked for, else None."""

    calls: Dict[str, Dict[str, int]]
    python_functions: Tuple[str, ...] = ()
    flops: Optional[int] = None

    @property
    def by_phase(self) -> Dict[str, int]:
        return {phase: sum(self.calls[phase].values()) for phase in PHASES}

    @property
    def total(self) -> int:
        return sum(self.by_phase.values())

    @property
    def by_op(self) -> Dict[str, int]:
        """Every op with its calls over the phases, the most called first (ties by name)."""
        summed: Counter = Counter()
        for ops in self.calls.values():
            summed.update(ops)
        return dict(sorted(summed.items(), key=lambda item: (-item[1], item[0])))


def python_functions(loss: torch.Tensor) -> Tuple[str, ...]:
    """The node classes of the custom autograd functions in the graph that produced ``loss`` (e.g.
    "BatchNormFunctionBackward"), sorted. The graph's structure outlives its backward; only saved tensors go."""
    names, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names.add(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return tuple(sorted(names))


def count_ops(step: Step, flops: bool = False) -> OpCount:
    """The aten calls of ``step``'s second run: the first creates the optimizer's state (Adam's moments), which
    the steps of a run after it do not, and makes a model's lazy initialisations. ``flops``: also count that
    run's FLOPs, saving ``count_flops``'s extra step. Its FlopCounterMode sits below the counter on torch's mode
    stack, so the counter sees each call first, and only the model's (the counts with and without it agree)."""
    step()
    counter = _OpCounter()
    with (FlopCounterMode(display=False) if flops else contextlib.nullcontext()) as flop_mode, counter:
        loss = step.forward_backward()
        counter.updating = True  # the optimizer's ops have no FLOP formula: they add nothing to flop_mode
        step.update()
    calls = {phase: dict(sorted(((op, n) for (p, op), n in counter.calls.items() if p == phase),
                                key=lambda item: (-item[1], item[0]))) for phase in PHASES}
    return OpCount(calls, python_functions(loss), int(flop_mode.get_total_flops()) if flops else None)


def count_calls(run: Callable[[], object]) -> Counter:
    """The aten calls of ``run``'s second call by op, every phase together, the first made as `count_ops` makes it
    (the optimizer's state, lazy initialisations): for a step that is not a `Step`, such as the fit loop's own
    (tools/benchmarks/count_loop_ops.py)."""
    run()
    counter = _OpCounter()
    with counter:
        run()
    summed: Counter = Counter()
    for (_, op), calls in counter.calls.items():
        summed[op] += calls
    return summed


def ops_outside_graphs(step: Callable[[], object]) -> Dict[str, int]:
    """The aten calls one run of a captured step (--capture) makes outside its compiled graphs, the most called
    first: what the host still launches one at a time when the graphs replay (the front before the BEV scatter,
    AccumulateGrad's detaches, DDP's bucket work, the optimizer, and AOTAutograd's epilogue: a ``copy_`` into each
    buffer the graph updates, three a training batch norm, under dynamo's own cudagraphs backend, which keeps no
    input mutation in its graphs; --capture cudagraphs' backend, engine/cuda_graphs.py, keeps them). torch's
    profiler (host activity only) sees them where a dispatch mode cannot: the graphs' own calls run inside the
    ranges of AOTAutograd's function, "CompiledFunction" and "CompiledFunctionBackward", and are left out, as is
    every aten call made inside another (a composite's parts).
    The epilogue runs inside dynamo's "Torch-Compiled Region" but outside those, and is counted. On CUDA the
    copies of non-static inputs into a CUDA graph's own buffers run inside "CompiledFunction" and are not. Like
    `count_ops` it runs the step first: once to compile, then engine/capture.py's TIMING_WARMUPS more (CUDA graph
    trees record a graph on a later call than the first); then profiles one."""
    from torch.profiler import ProfilerActivity, profile

    from opencood_ddp.engine.capture import TIMING_WARMUPS

    for _ in range(1 + TIMING_WARMUPS):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    graphs = [(e.time_range.start, e.time_range.end) for e in events if e.name in GRAPH_RANGES]
    calls: Counter = Counter()
    for event in events:
        parent = event.cpu_parent
        if not event.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        if not any(start <= event.time_range.start and event.time_range.end <= end for start, end in graphs):
            calls[event.name] += 1
    return dict(sorted(calls.items(), key=lambda item: (-item[1], item[0])))


# ------------------------------------------------------------------------------------------- arithmetic
def count_flops(step: Step) -> int:
    """FLOPs of ``step``'s forward, loss and backward by torch's FlopCounterMode (a multiply-add is 2); the
    update runs after, uncounted. Run it after ``count_ops`` or a warm-up step, so that the model is past its
    first call."""
    with FlopCounterMode(display=False) as flops:
        step.forward_backward()
    step.update()
    return int(flops.get_total_flops())


def step_seconds(step: Step, device: torch.device, repeats: int) -> List[float]:
    """Wall seconds of ``repeats`` steps, each waited for on a GPU (no warm-up: take one before)."""
    times = []
    for _ in range(repeats):
        _synchronize(device)
        started = time.perf_counter()
        step()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def median_step_seconds(step: Step, device: torch.device, repeats: int = 3) -> float:
    """One warm-up step (allocator, kernel choice, optimizer state), then the median of ``repeats``."""
    step()
    return statistics.median(step_seconds(step, device, repeats))


def seconds_in_turns(steps: Dict[str, Callable[[], object]], device: torch.device, rounds: int) -> Dict[str, float]:
    """The median wall seconds of each of `steps` over `rounds` rounds of one step each, the order rotating by one
    from round to round (who goes first changes), each step waited for on a GPU: a change in a shared machine's
    load falls on all of them alike, so their ratios are measured side by side. No warm-up: take them before."""
    names, times = list(steps), {name: [] for name in steps}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += step_seconds(steps[name], device, 1)
    return {name: statistics.median(values) for name, values in times.items()}


def _synchronize(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------- the GPU's side
# Kineto's names of the activities that occupy the GPU itself (not the host's launch calls, "cuda_runtime").
GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
# The CUDA runtime's and driver's calls in which the host waits until the device has done its queued work: a read
# of a device value (`.item()`, `.tolist()`, `.cpu()`: a copy, then cudaStreamSynchronize) or an explicit wait.
# Kineto names them as the API does, with a version suffix at most ("_v2"). cudaEventSynchronize is not among
# them: it is how device_activity ends its profile, so that what is counted is the step's own.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpy2D", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuMemcpyDtoH")


@dataclass(frozen=True)
class DeviceActivity:
    """What one profiled step ran on the GPU: ``by_name`` maps each kernel, copy or fill to (calls, seconds), the
    longest first; ``kernels`` counts the kernel launches; ``busy_s`` is the time at least one of them ran (their
    intervals' union: kernels on several streams overlap). Over the step's unprofiled wall time, ``busy_s`` says
    how much of the step the GPU worked: near 1 the step is bound by the GPU's work, far below by the host's
    launches."""

    by_name: Dict[str, Tuple[int, float]]
    kernels: int
    busy_s: float
    # The host's side (`HOST_WAITS`): how often the step waited for the device, and for how long in all
    host_waits: int = 0
    host_wait_s: float = 0.0
    # The host's own (self) time per op or runtime call, the longest first; under the profiler, which adds to it
    host_by_name: Dict[str, Tuple[int, float]] = field(default_factory=dict)


def busy_seconds(intervals: Iterable[Tuple[int, int]]) -> float:
    """The length of the union of (start_ns, end_ns) intervals, in seconds."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e9


def activity_kind(event) -> str:
    """Kineto's name of a profiler event's activity ("kernel", "gpu_memcpy", "cpu_op", ...). torch 2.13's events
    tell it (``activity_type``); torch 2.11's, the GPU machines', do not, and there it is derived: a user
    annotation from its flag, every other host event as "cpu_op" (the runtime's launch calls too), and on the
    device a copy or a fill by the names CUPTI gives them through Kineto ("Memcpy HtoD (Pageable -> Device)",
    "Memset (Device)"), a kernel otherwise."""
    if hasattr(event, "activity_type"):
        return event.activity_type()
    on_host = event.device_type() == torch.autograd.DeviceType.CPU
    if event.is_user_annotation():
        return "user_annotation" if on_host else "gpu_user_annotation"
    if on_host:
        return "cpu_op"
    name = event.name()
    return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"


def activity_of(events, kinds: Sequence[str] = GPU_ACTIVITIES) -> DeviceActivity:
    """``DeviceActivity`` of a profile's Kineto events (``profiler.kineto_results.events()``) of the given
    activity kinds (`activity_kind`); "kernel" ones count as launches."""
    classified = [(e, activity_kind(e)) for e in events]  # each event's kind asked once
    chosen = [e for e, kind in classified if kind in kinds]
    launches = sum(1 for _, kind in classified if kind == "kernel") if "kernel" in kinds else 0
    by_name: Dict[str, List[float]] = {}
    for e in chosen:
        calls_and_ns = by_name.setdefault(e.name(), [0, 0])
        calls_and_ns[0] += 1
        calls_and_ns[1] += e.duration_ns()
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][1], item[0]))
    waits = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU and is_host_wait(e.name())]
    return DeviceActivity({name: (int(calls), ns / 1e9) for name, (calls, ns) in ranked},
                          launches,
                          busy_seconds((e.start_ns(), e.start_ns() + e.duration_ns()) for e in chosen),
                          len(waits), sum(e.duration_ns() for e in waits) / 1e9)


def is_host_wait(name: str) -> bool:
    """Whether a host event of this name is one of `HOST_WAITS`."""
    return re.sub(r"_v[0-9]+$", "", name) in HOST_WAITS


def host_time_by_name(averages) -> Dict[str, Tuple[int, float]]:
    """(calls, seconds) of the host's own time per op or runtime call, the longest first, from a profile's
    ``key_averages()``: an op's time without that of the ops and runtime calls it made (self time), so a launch
    is the runtime's (cudaLaunchKernel) and a wait the waiting call's."""
    timed = [(a.key, int(a.count), a.self_cpu_time_total / 1e6) for a in averages if a.self_cpu_time_total > 0]
    return {key: (calls, seconds) for key, calls, seconds in sorted(timed, key=lambda row: (-row[2], row[0]))}


def device_activity(step: Step, device: torch.device) -> DeviceActivity:
    """One run of ``step`` under torch's profiler with CUDA's activities (CUPTI): what it ran on the GPU, and the
    host's waits and own time. Take it after a warm-up step; the profiler slows the host's side, so time the step
    without it."""
    from torch.profiler import ProfilerActivity, profile

    _synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        _wait_by_event(device)
    activity = activity_of(prof.profiler.kineto_results.events())
    return dataclasses.replace(activity, host_by_name=host_time_by_name(prof.key_averages()))


def _wait_by_event(device: torch.device) -> None:
    """Wait for the device's current stream through an event (cudaEventSynchronize), not torch.cuda.synchronize's
    cudaDeviceSynchronize, one of the step's own `HOST_WAITS`."""
    if torch.device(device).type == "cuda":
        with torch.cuda.device(device):
            end = torch.cuda.Event()
            end.record()
            end.synchronize()


# ------------------------------------------------------------------------------------------- peaks
# Dense (no structured sparsity) peak TFLOP/s from NVIDIA's datasheet of each product; where a sheet gives only the
# figure with sparsity, half of it. "tf32" is the tensor cores' rate on float32 inputs, which cuDNN's convolutions
# take by default (torch.backends.cudnn.allow_tf32). Keys are substrings of torch.cuda.get_device_name(), the more
# specific first (an H100 SXM reports "NVIDIA H100 80GB HBM3", a PCIe card "NVIDIA H100 PCIe").
PEAK_TFLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    ("H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
)


def peak_tflops(device_name: str, precision: str, tf32: bool = True) -> Optional[Tuple[float, str]]:
    """(TFLOP/s, the rate's name) of ``precision`` ("fp32", "bf16", "fp16") on the device named so, or None for
    a device not in the table (a CPU, an unlisted GPU). fp32 takes the TF32 rate where ``tf32`` says float32
    convolutions may use it, else the plain FP32 rate."""
    for key, rates in PEAK_TFLOPS:
        if key in device_name:
            rate = ("tf32" if tf32 else "fp32") if precision == "fp32" else precision
            return rates[rate], rate.upper()
    return None


def device_peak(device: torch.device, precision: str) -> Optional[Tuple[float, str]]:
    """``peak_tflops`` of this device with torch's current TF32 setting for convolutions; None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision, torch.backends.cudnn.allow_tf32)


@dataclass
class CudagraphSkips:
    """What `cudagraph_skips` heard: ``count`` (torch's counter over the block, set when it ends) and ``reasons``
    (inductor's log lines, the first line of each)."""

    count: int = 0
    reasons: List[str] = field(default_factory=list)


class _SkipReasons(logging.Handler):
    def __init__(self, reasons: List[str]):
        super().__init__()
        self.reasons = reasons

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("skipping cudagraphs"):
            self.reasons.append(message.splitlines()[0][:200])


@contextlib.contextmanager
def cudagraph_skips() -> Iterator[CudagraphSkips]:
    """Around compiles (tools/gpu_check.py's capture check, benchmark_models.py --capture): the graphs inductor did
    not replay as CUDA graphs ("skipping cudagraphs due to ...": a host tensor among the inputs, an input it cannot
    treat as static, ...), which it counts in ``counters["inductor"]["cudagraph_skips"]`` and gives a reason for
    only in a log line under torch._inductor. A skipped graph runs its kernels one launch at a time, so a captured
    step that is not faster says why here. On the CPU inductor never tries, and --capture cudagraphs' backend
    (engine/cuda_graphs.py, as dynamo's own) skips each forward graph for the host ("cpu device"), after its check
    of the graph's input mutations."""
    from torch._dynamo.utils import counters  # dynamo only where something compiles

    skips = CudagraphSkips()
    handler, logger = _SkipReasons(skips.reasons), logging.getLogger("torch._inductor")
    before = counters["inductor"]["cudagraph_skips"]
    logger.addHandler(handler)
    try:
        yield skips
    finally:
        logger.removeHandler(handler)
        skips.count = counters["inductor"]["cudagraph_skips"] - before


__all__ = ["CudagraphSkips", "DeviceActivity", "GPU_ACTIVITIES", "HOST_WAITS", "OpCount", "PEAK_TFLOPS", "PHASES",
           "Step", "activity_kind", "activity_of", "busy_seconds", "count_calls", "count_flops", "count_ops",
           "cuda_path_on_cpu", "cudagraph_skips", "device_activity", "device_peak", "host_time_by_name",
           "is_host_wait", "median_step_seconds", "ops_outside_graphs", "peak_tflops", "python_functions",
           "seconds_in_turns", "step_seconds", "trainer_step"]
