"""``--capture``: the static-shape part of a training step compiled into graphs with ``torch.compile``.

A pillar model's step has two parts (models/point_pillar.py's seam): the front (pillar encoder and BEV scatter),
whose input has as many rows as the clouds have pillars, a number that changes every batch; and the dense part
(backbone, fusion, heads) whose shapes are fixed by the BEV grid and the batch's CAV layout. ``--capture``
compiles the dense part and the task's loss as one function (`dense_step`: forward and, through AOTAutograd,
backward); the front stays eager, so no pillar is padded. Three modes, the same traced graphs:
- ``compile``: inductor. On CUDA its mode is "reduce-overhead" (the graphs are replayed as CUDA graphs, cudagraph
  trees); on the CPU inductor's default; on both without its layout optimization (`inductor_options`). It fuses
  kernels, so it rounds anew, and compiles for minutes.
- ``cudagraphs``: the graphs run by torch's eager kernels and, on CUDA, replayed as CUDA graphs (cudagraph trees as
  inductor's, the weights and buffers static: engine/cuda_graphs.py, where the batch norms' updates stay in the
  graphs): the launches go, the eager step's kernels and rounding stay,
  and a compile takes seconds. On the CPU no CUDA graph exists: the backend says it skips them ("cpu device") and
  the graphs run as ``aot_eager``'s do.
- ``aot_eager``: the graphs run by torch's eager kernels. No fusion, so it repeats the eager step bit for bit; it
  checks the capture path itself (graph breaks, guards, fallback) where inductor's re-rounding would hide a real
  difference.

The layout the dense part reads of the batch (``record_len`` and what the models derive from it: the warp into
the ego's frame, CoBEVT's slots, V2X-ViT's agents) is worked out eagerly by the model's ``layout`` on the host,
where the batch keeps those keys (data/device_points.HOST_KEYS), and ``record_len`` goes in as `CavCounts`,
Python ints: dynamo guards on them, so a new CAV layout compiles anew instead of tracing ``.tolist()`` of a tensor.
Each new (layout, map shape) compiles once; past `MAX_SHAPES` of them (per mode), a new one runs the same function
eagerly (one log line says so): a step whose shapes change falls back to the eager step, never to a wrong graph.
How many layouts a run meets is the data set's: at per-GPU batch 1 one per CAV count (OPV2V's max_cav is 5 in
most of upstream's files and 7 where they leave it out, AttFuse's; DAIR-V2X's and V2V4Real's 2), at batch 2 one per
ordered pair of counts (up to 49 on OPV2V). Inductor's compiles take minutes, so `compile` stops at 6; the other
modes' take seconds (the trace alone) and go to 49, every batch-2 layout of a data set of at most 7 CAVs.

The optimizer step stays eager: on CUDA it is already one fused kernel per step (engine/optim.py), the per-step
lr schedule changes a Python float that a compiled step would guard on (a recompile per step, or the lr as a
tensor in the saved optimizer state, which upstream's checkpoints do not hold), and the fit loop decides between
backward and step on the host (the non-finite agreement, gradients no rank used).

Where the graphs replay as CUDA graphs, a parameter's gradient is the backward graph's output, in the graphs'
memory (autograd takes it as ``.grad`` without a copy while ``.grad`` is None, and the fit loop sets it to None
after every step). The next replay overwrites that memory: within a step of several micro-batches (the batch
plan's accumulation) the fit loop calls `CaptureModule.gradients_out_of_graphs` after each micro-batch but the last,
which copies the gradients out (one foreach op). After the last, the gradients are read (norm, optimizer) before
any replay; under DDP they are copied into its buckets as they come.

On the CPU the compiled step runs with the kernels CUDA takes (numerics/kernel_path.py): the CPU-only ones
(float64 batch-norm statistics in numba, the hashed dropout, CoBEVT's per-head attention) cannot be traced. The
fit loop enters `CaptureModule.kernels` around forward and backward, so the eager front and the fallback take the
same kernels, and a captured run is compared with an eager one under the same switch.

Under ``--half`` the fit loop enters autocast around the module's forward (engine/step.forward_backward), so
dynamo traces the dense step under it: the casts are in the graphs, and the autocast state, part of dynamo's
global-state guard, is the same every step (one compile per shape). The eager step's backward runs outside
autocast, and AOTAutograd traces the compiled backward so too (`backward_outside_autocast`; by default it traces it
under the forward's autocast, which rounds the backward products of the float32 islands,
models/modules/precision.py, to 16 bits). Under fp16 the GradScaler multiplies the loss outside the compiled
function: the scale reaches the compiled backward as its incoming gradient, a tensor, never a guarded constant,
and unscaling, the inf check and the skipped step stay in the eager optimizer step. With ``aot_eager`` a step under
bf16 or fp16 autocast, GradScaler included, is the eager step's bit for bit, on the CPU (CUDA's not run yet):
``.venv/bin/python -m pytest -q tests/test_capture.py -k under_half`` (docs/capture.md, "Under --half").

Under DDP the module DDP wraps is `CaptureModule` (the model, its parameters in their order, and the step), so
the compiled function runs inside DDP's forward and its gradients reach DDP's hooks as an eager step's do.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Literal, Mapping, Optional, get_args

import torch
from torch import nn
from torch._functorch import config as functorch_config

from opencood_ddp.engine.cuda_graphs import StaticWeightsCudagraphs
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.task import LossOutput, StepFn
from opencood_ddp.errors import ConfigError
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu

CaptureMode = Literal["compile", "cudagraphs", "aot_eager"]  # the module's docstring: inductor, CUDA graphs, traced
CAPTURE_MODES: tuple = get_args(CaptureMode)
# the torch.compile backend of each mode
BACKENDS = {"compile": "inductor", "cudagraphs": StaticWeightsCudagraphs(), "aot_eager": "aot_eager"}
# (layout, map shape) pairs compiled per run, per mode; a batch past them runs eagerly (the module's docstring).
# Dynamo's own recompile limit is raised past them (`allow_recompiles`), so the fallback is this module's, with its
# log line, never dynamo's silent one.
MAX_SHAPES = {"compile": 6, "cudagraphs": 49, "aot_eager": 49}
# Captured steps a timing takes after the compiling one and before it times any: CUDA graph trees record a graph on
# a later call than the first (benchmark_models.py --capture, gpu_check's capture checks).
TIMING_WARMUPS = 2


class CavCounts(tuple):
    """``record_len`` as Python ints, as the compiled dense step takes it. ``models/modules/cav_layout.counts``
    reads a record_len with ``.tolist()``: this one answers from the ints, which dynamo sees as constants."""

    def tolist(self) -> list:
        return list(self)


def not_capturable(model: nn.Module) -> Optional[str]:
    """Why `model` has no dense part to compile (None: it has one): its forward must be the `front` -> `layout` ->
    `dense` composition of the class that defines `dense` (models/point_pillar.py's, or a model's own, as
    SECOND's; the engine imports no model). Every model of the zoo has it; an out-of-tree model may not."""
    seam = next((cls for cls in type(model).__mro__ if "dense" in vars(cls)), None)
    if seam is None or not all(callable(getattr(model, name, None)) for name in ("front", "layout")) \
            or type(model).forward is not seam.forward:
        return f"{type(model).__name__}'s forward is not the front/layout/dense seam"
    return None


def replays_cuda_graphs(mode: Optional[str], device: torch.device) -> bool:
    """Whether --capture `mode` replays the step's graphs as CUDA graphs on `device`."""
    return mode in ("compile", "cudagraphs") and torch.device(device).type == "cuda"


def allow_recompiles(shapes: int) -> None:
    """Raise dynamo's recompile limit per function (8 by default; never lowered here) above `shapes` compiles of
    `dense_step`, with room for one recompile of another cause (a guard on a module's type: the benchmarks build
    several models in one process)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, shapes + 2)


def check_capture(mode: Optional[str], model: nn.Module) -> None:
    """One ConfigError line, naming the flag and the fix, for a run --capture cannot serve. Every --half serves
    (the module's docstring, "Under --half")."""
    if mode is None:
        return
    reason = not_capturable(model)
    if reason is not None:
        raise ConfigError(f"--capture {mode}: {reason} (models/point_pillar.py); train this model without --capture")


class DenseStage:
    """What the task's step sees as the model inside the compiled function: ``model(ego)`` gives the dense part's
    output on the front's map. The step must call it on the batch's ``ego`` dict (tasks/opencood.py's step)."""

    def __init__(self, model: nn.Module, features: torch.Tensor, layout: Mapping, data_dict: Mapping):
        self.model, self.features, self.layout, self.data_dict = model, features, layout, data_dict

    def __call__(self, data_dict: Mapping) -> dict:
        if data_dict is not self.data_dict:
            raise RuntimeError("--capture: the task's step ran the model on another input than batch['ego']")
        return self.model.dense(self.features, self.layout)


def dense_step(step: StepFn, model: nn.Module, features: torch.Tensor, layout: Mapping, batch: Any) -> LossOutput:
    """The task's step with the front already run: dense part and loss. The function --capture compiles; its
    fallback calls it as it is."""
    return step(DenseStage(model, features, layout, batch["ego"]), batch)


def captured_layout(layout: Mapping) -> dict:
    """The model's layout with ``record_len`` as `CavCounts` (the rest is tensors and Python values already)."""
    record_len = layout.get("record_len")
    counts = None if record_len is None else CavCounts(int(n) for n in record_len.tolist())
    return {**layout, "record_len": counts}


def backward_outside_autocast() -> ContextManager:
    """Around the compiled call: AOTAutograd traces the backward graph with autocast off, as the eager step's
    backward runs (engine/step.forward_backward leaves autocast before it). Its default ("same_as_forward")
    traces the backward under the forward's autocast, so a float32 product of the backward (an island's, or a
    16-bit product's float32 input gradient) would be cast to 16 bits where eager's is not."""
    return functorch_config.patch(backward_pass_autocast="off")


def inductor_options(cuda_graphs: bool) -> dict:
    """inductor's options under ``--capture compile``: mode "reduce-overhead"'s where the graphs replay as CUDA
    graphs, and no layout optimization. That optimization stores the convolutions' weights channels-last in a
    training graph, while our CUDA path hands every convolution a contiguous map
    (numerics/kernel_path.maps_for_kernels): on an H200 (torch 2.11) the mix failed inductor's own stride assertion
    on a (., 128, 4, 4) tensor of the stride-4 deblock, alone and under DDP (docs/benchmarks.md, "The first lent
    run of gpu_session"). The meta of convolution_backward predicts the weight's layout where the GPU's kernel
    answers contiguous (pytorch issues 171622 and 197517, the same assertion on ConvTranspose2d). The CPU's
    inductor would pick channels-last on every graph with a convolution; off, both devices keep the eager
    layouts. The keys pass as torch.compile(options=...), which inductor applies to the backward's later compile
    as well."""
    from torch._inductor import list_mode_options  # inductor's import is heavy: only where --capture compile runs

    options = dict(list_mode_options("reduce-overhead")) if cuda_graphs else {}
    options["layout_optimization"] = False
    return options


def step_kernels(device: torch.device) -> ContextManager:
    """The kernels a captured step takes on `device`: on the CPU those CUDA takes (the module's docstring says why),
    on CUDA its own."""
    return cuda_kernels_on_cpu() if torch.device(device).type == "cpu" else contextlib.nullcontext()


class CaptureModule(nn.Module):
    """The model and the task's step as one module, forward(batch) -> the step's LossOutput, its dense part
    compiled. DDP wraps it under --capture; checkpoints keep the model's own state dict (the trainer's
    ``model_without_ddp``)."""

    def __init__(self, model: nn.Module, step: StepFn, mode: CaptureMode, device: torch.device,
                 max_shapes: Optional[int] = None, announce: bool = True):
        """announce: log each shape's compile (False: a memory probe's module, engine/batch_fit.py, whose
        compiles are not the run's)."""
        super().__init__()
        self.model, self.step, self.mode, self.device = model, step, mode, torch.device(device)
        self.max_shapes = MAX_SHAPES[mode] if max_shapes is None else max_shapes
        self.shapes, self.eager_shapes = set(), set()
        allow_recompiles(self.max_shapes)
        self.cuda_graphs = replays_cuda_graphs(mode, self.device)
        options = inductor_options(self.cuda_graphs) if mode == "compile" else None  # other backends take none
        self.compiled = torch.compile(dense_step, backend=BACKENDS[mode], options=options, dynamic=False)
        self.log, self.announce = get_logger(), announce

    def kernels(self) -> ContextManager:
        """Around forward and backward: `step_kernels` of this module's device."""
        return step_kernels(self.device)

    def forward(self, batch: Any) -> LossOutput:
        ego = batch["ego"]
        with self.kernels():
            features = self.model.front(ego)
            layout = captured_layout(self.model.layout(ego))
            run = self.compiled if self._compiles(layout["record_len"], tuple(features.shape)) else dense_step
            if self.cuda_graphs and run is self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with backward_outside_autocast():
                out = run(self.step, self.model, features, layout, batch)
        if self.cuda_graphs:  # a CUDA graph's outputs are overwritten by its next replay; the loop keeps these
            out = LossOutput(out.total.clone(), {name: value.clone() for name, value in out.parts.items()})
        return out

    def gradients_out_of_graphs(self) -> None:
        """After a micro-batch's backward that another follows within the step (the batch plan's accumulation), when
        the graphs replay as CUDA graphs: autograd takes a gradient that the backward graph returns as the
        parameter's ``.grad`` (no copy while the parameter has none), so ``.grad`` lives in the CUDA graphs' memory,
        which the next micro-batch's replay overwrites (torch then refuses to read it: "accessing gradient tensor
        output of CUDAGraphs that has been overwritten"). `copy_gradients` moves every gradient out first."""
        if self.cuda_graphs:
            copy_gradients(self.model)

    def _compiles(self, counts: Optional[CavCounts], shape: tuple) -> bool:
        """Whether this (layout, map shape) runs compiled: one seen before, or a new one within the limit."""
        key = (counts, shape)
        if key in self.shapes:
            return True
        if len(self.shapes) < self.max_shapes:
            self.shapes.add(key)
            if self.announce:
                self.log.info(f"--capture {self.mode}: compiling the dense step for CAV layout {_describe(counts)}, "
                              f"map {list(shape)} ({len(self.shapes)} of at most {self.max_shapes} shapes)")
            return True
        if key not in self.eager_shapes:
            self.eager_shapes.add(key)
            self.log.warning(f"--capture {self.mode}: CAV layout {_describe(counts)}, map {list(shape)} is past the "
                             f"{self.max_shapes} compiled shapes: its steps run eagerly")
        return False


def copy_gradients(model: nn.Module) -> None:
    """Every parameter's ``.grad`` replaced by a copy of itself in memory of its own, bit for bit (x * 1 is x, -0.0
    and NaN included), in one foreach op rather than a launch per parameter."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:  # foreach ops refuse an empty list
        return
    for param, copied in zip(params, torch._foreach_mul([p.grad for p in params], 1.0)):
        param.grad = copied


def _describe(counts: Optional[CavCounts]) -> str:
    return "none" if counts is None else str(list(counts))


class CapturedStep:
    """The step the fit loop calls with the (DDP-wrapped) `CaptureModule`: its forward is the whole step."""

    def __call__(self, model: nn.Module, batch: Any) -> LossOutput:
        return model(batch)


__all__ = ["backward_outside_autocast", "BACKENDS", "CAPTURE_MODES", "CaptureMode", "CaptureModule", "CapturedStep",
           "CavCounts", "allow_recompiles", "check_capture", "copy_gradients", "not_capturable", "MAX_SHAPES",
           "replays_cuda_graphs", "step_kernels", "TIMING_WARMUPS"]
