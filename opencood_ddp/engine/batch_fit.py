"""Fit the baseline's batch on the user's GPUs: measure a training step's peak memory at per-rank batch 1, 2, ...,
fit its growth with the batch, and choose world x per-GPU batch x accumulation = batch_size exactly.

Used by tools/plan_batch.py (prints every option) and by `tools/train_ddp.py --per_gpu_batch auto` (rank 0
measures, every rank takes the chosen per-GPU batch; nothing else of the run changes). The measurement is one
training step as the trainer takes it (forward, loss, backward, optimizer step; the second step, once the
optimizer's state exists; under --capture the captured step, whose graphs are dropped afterwards) on the split's
heaviest samples (the dataset's `sample_cost`, its CAV count), on this
process's device: what CUDA's caching allocator reserved at its peak (`max_memory_reserved`), or on the CPU the
growth of the resident set's high-water mark (engine/memory.py), both over the memory held before the model was
built. The plan adds DDP's gradient buckets on several ranks and fits into what the GPU has free, shared by the
ranks that use it (`device_capacity`). Batches are probed in increasing size, so on the CPU memory a
smaller probe freed and the allocator kept counts toward the next, never against it.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from opencood_ddp.engine.capture import CapturedStep, CaptureModule, check_capture
from opencood_ddp.engine.memory import PeakMemory
from opencood_ddp.engine.optim import build_optimizer
from opencood_ddp.engine.step import Precision, forward_backward
from opencood_ddp.engine.task import Task
from opencood_ddp.engine.trainer import optimizer_step
from opencood_ddp.errors import ConfigError
from opencood_ddp.memory_fit import GIB


@dataclass(frozen=True)
class Probe:
    """One measured step. peak_bytes: what the plan fits (CUDA: reserved by the caching allocator; CPU: resident
    set growth); allocated_bytes: CUDA's bytes held by tensors (the CPU's one figure again); parameter_bytes: the
    model's trainable parameters, which DDP's gradient buckets copy once more on several ranks."""

    per_rank: int
    peak_bytes: int
    step_seconds: float
    allocated_bytes: int = 0
    parameter_bytes: int = 0


@dataclass(frozen=True)
class MemoryModel:
    """peak(b) = fixed + per_sample x b, least squares over the probes (exact with two)."""

    fixed: float
    per_sample: float
    probes: tuple

    def predict(self, per_rank: int) -> float:
        """The line's value; at a measured batch never less than what was measured there."""
        measured = [p.peak_bytes for p in self.probes if p.per_rank == per_rank]
        return max([self.fixed + self.per_sample * per_rank, *measured])

    def worst_residual(self) -> float:
        return max((abs(p.peak_bytes - self.predict(p.per_rank)) for p in self.probes), default=0.0)


@dataclass(frozen=True)
class PlanOption:
    world: int
    per_rank: int
    accumulation: int
    predicted_bytes: float
    fits: bool


def probe_sizes(batch_size: int, world: int, largest: int = 4) -> list[int]:
    """Per-rank batches worth measuring: 1, 2, 4, ... up to what one rank can get (batch_size / world)."""
    most = max(1, min(largest, batch_size // max(world, 1)))
    sizes, size = [], 1
    while size <= most:
        sizes.append(size)
        size *= 2
    return sizes


def _stepped(model: torch.nn.Module, task: Task, capture: Optional[str], device: torch.device) -> tuple:
    """What the trainer steps, as it builds it (engine/trainer.py): the model and the task's step, or under
    --capture the `CaptureModule` whose forward is the whole step, with the kernels it takes."""
    if capture is None:
        return model, task.step, contextlib.nullcontext
    check_capture(capture, model)
    module = CaptureModule(model, task.step, capture, device, announce=False)
    return module, CapturedStep(), module.kernels


def _one_probe(hypes: dict, build_task: Callable[..., Task], per_rank: int, device: torch.device,
               half: bool, capture: Optional[str] = None) -> Probe:
    task = build_task(hypes, for_training=True)
    if len(task.train_set) < per_rank:
        raise ConfigError(f"the training split has {len(task.train_set)} samples, fewer than the per-rank batch "
                          f"{per_rank} to measure; point root_dir at more data")
    batch = task.collate_train([task.train_set[i] for i in heaviest_samples(task.train_set, per_rank)])
    meter = PeakMemory(device)
    meter.start()
    model = task.model.to(device).train()
    optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for=device)
    precision = Precision(half, device)
    scaler = precision.new_scaler()
    moved = task.move_to(batch, device)
    stepped, step, kernels = _stepped(model, task, capture, device)
    started = time.perf_counter()
    for _ in range(2):  # the second step holds the optimizer's state as every later one does
        started = time.perf_counter()
        with kernels():
            out = forward_backward(step, stepped, moved, precision, scaler)
        optimizer_step(optimizer, scaler)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    peak, allocated = meter.growth(), meter.growth_allocated()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    del model, stepped, optimizer, moved, batch, task, out
    release_freed_memory(device)
    return Probe(per_rank, int(peak), seconds, int(allocated), int(parameters))


# Samples whose cost is read to find the heaviest: all of a split this size, an evenly spaced subset beyond it
COST_SCAN_LIMIT = 5000


def heaviest_samples(dataset: Any, count: int) -> list[int]:
    """The `count` samples a step's memory should be measured on: those the dataset says cost the most
    (`sample_cost(index)`, such as a sample's number of CAVs), else the first ones. A split's first frames may
    hold 2 CAVs where others hold 7: a plan measured there would not fit them."""
    cost = getattr(dataset, "sample_cost", None)
    total = len(dataset)
    if not callable(cost) or total <= count:
        return list(range(min(count, total)))
    stride = max(1, total // COST_SCAN_LIMIT)
    scanned = range(0, total, stride)
    return sorted(sorted(scanned, key=lambda index: (-cost(index), index))[:count])


def release_freed_memory(device: torch.device) -> None:
    """Give what the last probe freed back to the system, so that the next probe's growth is its own: CUDA's
    cached blocks, and on the CPU glibc's free lists (malloc_trim), which would otherwise keep the resident set
    at the last probe's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the probes still run in increasing size
        pass


def measure(hypes: dict, build_task: Callable[..., Task], sizes: Sequence[int], device: torch.device,
            half: bool = False, report: Optional[Callable[[Probe], None]] = None,
            capture: Optional[str] = None) -> list[Probe]:
    """One probe per size, of the step the run takes (``capture``: --capture's mode, whose graphs hold memory of
    their own: CUDA graphs' pools, static inputs)."""
    # A discarded first probe: the first step of a process also allocates what stays for every later one
    # (the math libraries' buffers, lazily built kernels), which would count against batch 1 alone.
    _captured_probe(hypes, build_task, min(sizes), device, half, capture)
    probes = []
    for size in sorted(sizes):
        probes.append(_captured_probe(hypes, build_task, size, device, half, capture))
        if report is not None:
            report(probes[-1])
    return probes


def _captured_probe(hypes: dict, build_task: Callable[..., Task], per_rank: int, device: torch.device,
                    half: bool, capture: Optional[str]) -> Probe:
    """`_one_probe`, then, under --capture, its graphs dropped: a CUDA graph pool the cached graphs keep would
    hold the next probe's graph memory before that probe starts measuring, and the run's own shapes start from
    dynamo's whole recompile limit (engine/capture.py's MAX_SHAPES), as without the measurement."""
    try:
        return _one_probe(hypes, build_task, per_rank, device, half, capture)
    finally:
        if capture is not None:
            torch._dynamo.reset()
            release_freed_memory(device)


def fit(probes: Sequence[Probe]) -> MemoryModel:
    """Least-squares line through (per_rank, peak); one probe: all of it per sample (a safe upper bound)."""
    if len(probes) == 1:
        return MemoryModel(0.0, float(probes[0].peak_bytes) / probes[0].per_rank, tuple(probes))
    n = len(probes)
    mean_b = sum(p.per_rank for p in probes) / n
    mean_m = sum(p.peak_bytes for p in probes) / n
    var = sum((p.per_rank - mean_b) ** 2 for p in probes)
    slope = sum((p.per_rank - mean_b) * (p.peak_bytes - mean_m) for p in probes) / var
    slope = max(slope, 0.0)  # noise may tilt a flat line below zero; memory never shrinks with the batch
    return MemoryModel(mean_m - slope * mean_b, slope, tuple(probes))


def options(batch_size: int, world: int, model: MemoryModel, capacity_bytes: float) -> list[PlanOption]:
    """Every exact split of batch_size over `world` ranks (per-rank x accumulation), largest per-rank first; the
    predicted peak includes DDP's buckets on several ranks."""
    found = []
    for per_rank in range(batch_size // world, 0, -1):
        if batch_size % (per_rank * world):
            continue
        predicted = model.predict(per_rank) + ddp_bytes(model, world)
        found.append(PlanOption(world, per_rank, batch_size // (per_rank * world), predicted,
                                predicted <= capacity_bytes))
    return found


def choose(found: Sequence[PlanOption]) -> Optional[PlanOption]:
    """The option that fits with the fewest accumulation steps (the largest per-GPU batch: fastest)."""
    fitting = [o for o in found if o.fits]
    return min(fitting, key=lambda o: o.accumulation) if fitting else None


def gib(value: float) -> str:
    # two decimals for the planner's tables (memory_fit.gib: one, with thousands, for sizes beyond memory)
    return f"{value / GIB:.2f} GiB"


def describe(batch_size: int, world: int, model: MemoryModel, capacity_bytes: float,
             found: Sequence[PlanOption]) -> list[str]:
    lines = [f"peak memory of one training step: {gib(model.fixed)} + {gib(model.per_sample)} per sample "
             f"(fit over per-rank batch {', '.join(str(p.per_rank) for p in model.probes)}; worst residual "
             f"{gib(model.worst_residual())})",
             *([f"plus {gib(ddp_bytes(model, world))} per GPU for DDP's gradient buckets on {world} GPUs"]
               if world > 1 else []),
             f"batch_size {batch_size} on {world} GPU(s) of {gib(capacity_bytes)} usable each:",
             "  per-GPU batch | accumulation | predicted peak | fits"]
    lines += [f"  {o.per_rank:13d} | {o.accumulation:12d} | {gib(o.predicted_bytes):>14s} | "
              f"{'yes' if o.fits else 'no'}" for o in found]
    return lines


def accumulation_note(chosen: PlanOption, batch_size: int) -> Optional[str]:
    """What a plan with accumulation changes: BatchNorm statistics of a micro-step cover world x per-GPU samples,
    not the batch (docs/ddp_semantics.md). Measured on the toy AttFuse: 1 x 4 against 2 x 1 x 2 is a different
    training (step-1 loss gap 6.8e-2) where 4 x 1 against 2 x 2 x 1 is the same one (docs/benchmarks.md)."""
    if chosen.accumulation == 1:
        return None
    seen = chosen.world * chosen.per_rank
    return (f"note: with {chosen.accumulation} accumulation steps a BatchNorm layer normalises over {seen} "
            f"sample(s) per micro-step, not batch_size {batch_size}: the baseline's training up to float rounding "
            f"only for models without BatchNorm (docs/ddp_semantics.md); more GPUs, or --half, avoid it")


def no_plan_message(batch_size: int, world: int, model: Optional[MemoryModel], capacity_bytes: float) -> str:
    """Why nothing fits, and what would (`model` may be None when the batch does not split over `world`)."""
    if batch_size % world or model is None:
        worlds = [w for w in range(1, batch_size + 1) if batch_size % w == 0]
        return (f"train_params.batch_size {batch_size} cannot be split evenly over {world} GPUs; use a GPU count "
                f"in {worlds}")
    need = model.predict(1) + ddp_bytes(model, world)
    return (f"even per-GPU batch 1 needs {gib(need)}, more than the {gib(capacity_bytes)} usable per GPU; "
            f"try --half, GPUs with at least {math.ceil(need / GIB * 10) / 10:.1f} GiB, or a smaller model")


def device_capacity(device: torch.device, processes_on_device: int, headroom: float = 0.1) -> float:
    """Bytes one process may use on `device`, shared by the `processes_on_device` ranks that use it: on a GPU
    what is free now (`mem_get_info`: without the CUDA contexts and whatever other jobs hold) and at most an equal
    share of the whole; on the CPU the memory Linux reports available. Less the headroom the measure does not see
    (NCCL's buffers, fragmentation over a long run)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        free = total = _mem_available()
    return usable_share(free, total, processes_on_device, headroom)


def usable_share(free: float, total: float, processes: int, headroom: float) -> float:
    """One of `processes` ranks' share of a device with `free` of `total` bytes free: an equal share of the whole,
    and no more than is free, less the headroom."""
    return min(free, total / max(processes, 1)) * (1 - headroom)


def ddp_bytes(model: MemoryModel, world: int) -> float:
    """What DDP adds on several ranks that a 1-process probe does not hold: its gradient buckets, one copy of the
    trainable parameters, alive through the forward, where the probe's gradients are None (the trainer sets them
    so after each step). The gradients are views into the buckets (distributed/ddp.py), not a second copy."""
    if world <= 1:
        return 0.0
    return float(max((p.parameter_bytes for p in model.probes), default=0))


def _mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; pass --per_gpu_mem_gib")


def auto_plan(hypes: dict, build_task: Callable[..., Task], world: int, device: torch.device, half: bool,
              capacity_bytes: float, capture: Optional[str] = None) -> tuple[PlanOption, list[str]]:
    """Measure, fit and choose as tools/plan_batch.py does: (the chosen option, lines that tell it). No plan
    that fits: one ConfigError saying why and what would fit."""
    batch_size = int(hypes["train_params"]["batch_size"])
    if batch_size % world:
        raise ConfigError(f"--per_gpu_batch auto: {no_plan_message(batch_size, world, None, capacity_bytes)}")
    model = fit(measure(hypes, build_task, probe_sizes(batch_size, world), device, half, capture=capture))
    found = options(batch_size, world, model, capacity_bytes)
    chosen = choose(found)
    if chosen is None:
        raise ConfigError(f"--per_gpu_batch auto: no plan fits: "
                          f"{no_plan_message(batch_size, world, model, capacity_bytes)}")
    lines = describe(batch_size, world, model, capacity_bytes, found)
    lines.append(f"--per_gpu_batch auto chose per-GPU batch {chosen.per_rank} x {chosen.accumulation} accumulation "
                 f"step(s), peak about {gib(chosen.predicted_bytes)} of {gib(capacity_bytes)} usable per process")
    note = accumulation_note(chosen, batch_size)
    return chosen, lines + ([note] if note else [])
