#!/usr/bin/env python
"""Each config's training step on real toy-world batches: time per sample, peak memory, and (--count) ops and FLOPs.

With --count, the aten operators a step dispatches on the CUDA path and its FLOPs (issue 52), upstream's count
beside ours.

Usage: python tools/benchmarks/benchmark_models.py [--configs toy/point_pillar_intermediate_fusion ...]
                                        [--batch-sizes 1 2 4 8] [--precisions fp32 bf16 fp16] [--half]
                                        [--repeats 3] [--data data/toy_opv2v] [--device cpu|cuda]
                                        [--count [--upstream OPENCOOD_CHECKOUT]] [--profile]

Each config, per-GPU batch size and precision (a row) runs in a fresh subprocess: peak memory is a per-process
high-water mark. Batches are real training batches (labels included) read from the toy world; baseline configs
(hypes_yaml/opv2v) read the same frames with their own range and voxel settings, so the BEV grid has the
baseline's size (704 x 200). What is timed is the training step as the fit loop takes it, on a batch already on
the device: engine/step.py's forward_backward (forward and loss under the precision's autocast, backward) and
engine/trainer.py's optimizer_step (the hypes' optimizer with the device's kernels, engine/optim.py; through the
GradScaler in fp16). No data loading. One warm-up step (it also creates the optimizer's state), then the median
of ``--repeats`` steps. Memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the process's
peak resident set (Linux VmHWM, reset before the timed steps) over the resident set before them. On the CPU the
time columns are CPU times: the header says which device they come from.

``--precisions``: fp32, bf16 and fp16 autocast (fp16 with a GradScaler); ``--half`` alone is the trainer's bare
``--half``: fp16 on CUDA, bf16 on the CPU.

``--count`` (engine/census.py) adds, per row: the aten operators one step dispatches on the CUDA path (forward and
loss, backward, optimizer; the second step, after the one that creates the optimizer's state), counted inside
``engine.census.cuda_path_on_cpu`` (CUDA's kernels and, under bf16/fp16, CUDA's autocast lists) with the optimizer
built for CUDA (fused Adam), so that on a machine without a GPU the count is the CUDA step's; the step's FLOPs by
torch's FlopCounterMode (forward and backward: products and convolutions; the optimizer's elementwise update and
spconv's sparse convolutions are not in it); the rate those FLOPs over the timed step make; and the device's
published peak (engine/census.py's table; "-" for the CPU or an unlisted GPU). ``--upstream DIR`` adds upstream
OpenCOOD's count for the same config, batch and precision: its model and loss classes from the checkout
(tools/benchmarks/benchmark_vs_upstream.py's ``build_upstream``, our weights loaded into them), its train.py's step
(zero_grad, forward, loss, backward, ``optimizer.step``, or the GradScaler's ``step``/``update`` in fp16) with the
hypes' optimizer built as ours is for CUDA. An upstream class that fails to build or run is reported in its cell.

``--upstream DIR`` (with or without ``--count``) also times upstream's step on the row's device and batch, as its
train.py takes it: the same classes and weights, the hypes' optimizer as upstream's ``setup_optimizer`` builds it
(torch's default kernels: on CUDA the foreach update, where ours is fused). After one warm-up step of its own it
runs in turns with our eager step (and, with ``--capture``, the captured one), who goes first rotating from round to
round, each step waited for: the medians of ``--repeats`` rounds give upstream's step over ours, side by side in one
process (issue 52 asks 1.5 or more at batch 2, in fp32 and in bf16). With ``--capture`` the three share one set of
rounds, which gives the capture's figures too. The rows' own step columns are the timings above, taken before
upstream's model was built.

``--capture MODE`` (compile: inductor, with CUDA graphs on CUDA; cudagraphs: the eager kernels replayed as CUDA
graphs, a compile of seconds; aot_eager: traced, eager kernels) adds, per row, the same step with the model's dense
part compiled as ``train_ddp.py --capture`` compiles it (engine/capture.py's CaptureModule) from the same initial
weights on the same batch, in the same process: the first step's seconds (the compile), then engine/capture.py's
TIMING_WARMUPS more (CUDA graph trees record a graph on a later call than the first), then ``--repeats`` rounds in
turns with the row's eager step (engine/census.py's ``seconds_in_turns``): the captured step's median, and the
speed-up, eager's median over it, side by side; the first loss's relative gap to eager's, and the graphs not
replayed as CUDA graphs. Both sides then run under the kernels a captured step takes (engine/capture.step_kernels:
CUDA's own on CUDA, CUDA's kernels on the CPU). With batches 1 and 2 a last table gives each config's step at
batch 1 over its step at batch 2, eager and captured: issue 52 asks 0.6 or less, so that 2 GPUs at batch 1 beat 1
GPU at batch 2 by 1.6x. With ``--count`` too, the captured step's aten calls outside its compiled graphs on the
CUDA path (engine/census.py's ``ops_outside_graphs``, one more compile of the same step with the optimizer built
for CUDA): what the host still launches one by one when the graphs replay. With ``--profile`` too, one more
captured step under the profiler: the GPU's busy time over the captured median step, near 1 where the replayed
graphs keep the GPU busy.

``--profile`` (CUDA) adds, per row, one more step under torch's profiler (engine/census.py's device_activity): the
kernels it launched, the time the GPU was busy (the union of its kernels, copies and fills) and that time over the
row's unprofiled median step: near 1 the step is bound by the GPU's work, far below by the host's launches (issue
52), and the host's waits for the device (count, and their ms). A table of each row's longest kernels follows
(where a half-precision step spends what fp32 does not), then one of the host's longest ops and runtime calls by
their own time (where a step bound by the host spends it).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = ["toy/point_pillar_early_fusion", "toy/point_pillar_late_fusion",
                   "toy/point_pillar_intermediate_fusion", "toy/point_pillar_fcooper",
                   "opv2v/point_pillar_early_fusion", "opv2v/point_pillar_late_fusion",
                   "opv2v/point_pillar_intermediate_fusion", "opv2v/point_pillar_fcooper"]
HALF = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}  # --precisions -> engine.step.Precision's half
# Flags whose values name the rows: the driver hands each subprocess one row instead.
ROW_FLAGS = ("--configs", "--batch-sizes", "--batch-size", "--precisions", "--half")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    from opencood_ddp.engine.options import training_flags

    # --capture is training's own flag (its meaning, its modes): the step it times beside the eager one
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[training_flags("capture")])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="paths under hypes_yaml/, no .yaml")
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (generated when absent)")
    parser.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=int, nargs="+", default=[2],
                        help="per-GPU batch sizes, one row each (e.g. 1 2 4 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precisions", nargs="+", choices=list(HALF), help="autocast types, one row each "
                                                                            "(default fp32)")
    parser.add_argument("--half", action="store_true", help="autocast as the trainer's bare --half: fp16 on CUDA, "
                                                            "bf16 on CPU (when --precisions is not given)")
    parser.add_argument("--count", action="store_true", help="also the aten ops per step on the CUDA path, the "
                                                             "FLOPs per step, the rate and the device's peak")
    parser.add_argument("--upstream", metavar="DIR", help="upstream OpenCOOD's step beside ours, from this "
                                                          "checkout: timed in turns with ours (with --count, "
                                                          "counted too)")
    parser.add_argument("--profile", action="store_true", help="CUDA: also one profiled step per row: the GPU's "
                                                               "kernels, launches and busy time beside the step's")
    parser.add_argument("--json", metavar="PATH", help="also write every row's figures (all op counts) here")
    parser.add_argument("--one", nargs=3, metavar=("CONFIG", "BATCH", "PRECISION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile and torch.device(args.device).type != "cuda":
        parser.error("--profile reads what ran on the GPU: it needs --device cuda")
    if not args.precisions:
        on_cuda = torch.device(args.device).type == "cuda"
        args.precisions = [("fp16" if on_cuda else "bf16") if args.half else "fp32"]
    return args


# ------------------------------------------------------------------------------------------- one row
def _load_batch(config: str, data: Path, batch_size: int):
    from opencood_ddp.yaml_parsers import load_parsed_hypes
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / f"{config}.yaml", split_overrides(data))
    hypes["train_params"]["seed"] = 0
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[i] for i in range(batch_size)])
    return hypes, task, batch


def _trainer_step(hypes: dict, task, model, batch, precision, kernels_for, capture: Optional[str] = None):
    """engine/census.py's Step of the fit loop, with the hypes' optimizer built for `kernels_for`; with `capture`
    (a --capture mode) the trainer's step under --capture: the model and the task's step in a CaptureModule."""
    from opencood_ddp.engine.capture import CapturedStep, CaptureModule
    from opencood_ddp.engine.census import trainer_step
    from opencood_ddp.engine.optim import build_optimizer

    optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for=kernels_for)
    if capture is None:
        return trainer_step(task.step, model, batch, optimizer, precision, precision.new_scaler())
    module = CaptureModule(model, task.step, capture, torch.device(kernels_for))
    return trainer_step(CapturedStep(), module, batch, optimizer, precision, precision.new_scaler())


def run_one(config: str, batch_size: int, precision_name: str, args: argparse.Namespace) -> Dict[str, object]:
    from opencood_ddp.engine.capture import step_kernels
    from opencood_ddp.engine.census import seconds_in_turns, step_seconds
    from opencood_ddp.engine.memory import PeakMemory
    from opencood_ddp.engine.step import Precision

    torch.manual_seed(0)
    device = torch.device(args.device)
    hypes, task, batch = _load_batch(config, Path(args.data), batch_size)
    model = task.model.to(device).train()
    batch = task.move_to(batch, device)  # the task's own move (preprocess.on_device: the point work there)
    initial = copy.deepcopy(model) if args.capture else None  # the captured step starts where the eager one does
    kernels = (lambda: step_kernels(device)) if args.capture else contextlib.nullcontext  # entered twice
    precision = Precision(HALF[precision_name], device)
    step = _trainer_step(hypes, task, model, batch, precision, device)
    with kernels():
        first_loss = step()  # warm-up: allocator, kernels, lazy inits, the optimizer's state
        memory = PeakMemory(device)
        memory.start()
        times = step_seconds(step, device, args.repeats)
    # CUDA: the high-water mark of tensors (weights, optimizer state, batch, activations, gradients); the growth of
    # the reserved bytes is 0 once the warm-up step has filled the caching allocator. CPU: the resident set's growth.
    peak = memory.peak_allocated() if device.type == "cuda" else memory.growth()
    scatter = getattr(task.model, "scatter", None)  # the pillar models' BEV grid; SECOND has none
    ego = batch["ego"]
    result = {"config": config, "device": str(device), "precision": precision_name, "batch_size": batch_size,
              "cavs": int(ego["record_len"].sum()) if "record_len" in ego else batch_size,
              "grid": f"{scatter.nx} x {scatter.ny}" if scatter is not None else "-",
              "parameters": sum(p.numel() for p in model.parameters()),
              "step_s": statistics.median(times), "per_sample_s": statistics.median(times) / batch_size,
              "peak_mib": peak / 2 ** 20, "threads": torch.get_num_threads()}
    if args.profile:
        result["gpu"] = gpu_activity(step, device, result["step_s"])
    if args.count:
        result.update(census(hypes, task, model, batch, precision))
        result.update(rate(result["flops"], result["step_s"], device, precision_name))
    timed = {"ours": step}  # the steps timed in turns: ours, the captured step (--capture), upstream's (--upstream)
    with kernels(), _skips_counted(args.capture) as skips:
        if args.capture:
            timed["captured"] = _trainer_step(hypes, task, initial, batch, precision, device, args.capture)
            result["capture"] = compiled(timed["captured"], device, args.capture, first_loss.item())
        if args.upstream:
            result["upstream"] = upstream_side(args, hypes, model, batch, batch_size, precision)
            if "error" not in result["upstream"]:
                timed["upstream"] = result["upstream"].pop("step")
        # one set of rounds for all of them: each ratio below is of medians taken side by side
        seconds = seconds_in_turns(timed, device, args.repeats) if len(timed) > 1 else {}
    if args.capture:
        result["capture"].update(in_turns_with_eager(seconds, skips.count))
    if args.capture and args.profile:
        with kernels():
            result["capture"]["gpu"] = captured_activity(timed["captured"], device, result["capture"]["step_s"])
    if args.capture and args.count:
        result["capture"].update(captured_census(hypes, task, copy.deepcopy(initial), batch, precision, args.capture,
                                                 device))
    if "upstream" in timed:
        result["upstream"].update(upstream_in_turns(seconds))
    return result


@contextlib.contextmanager
def _skips_counted(capture: Optional[str]):
    """engine/census.py's cudagraph_skips around the captured step's compile, warm-ups and timed steps; nothing
    without --capture (its import brings in dynamo)."""
    if capture is None:
        yield None
        return
    from opencood_ddp.engine.census import cudagraph_skips

    with cudagraph_skips() as skips:
        yield skips


# ------------------------------------------------------------------------------------------- --capture
def compiled(step, device: torch.device, mode: str, eager_loss: float) -> Dict[str, Any]:
    """The captured step's first call (the compile) and its warm-ups: CUDA graph trees record on a later call than
    the first. Its time is taken after, in turns with the eager step (in_turns_with_eager)."""
    from opencood_ddp.engine.capture import TIMING_WARMUPS

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    loss = step().item()  # waits for the whole step: the optimizer's kernels were queued before it
    compile_s = time.perf_counter() - started
    for _ in range(TIMING_WARMUPS):
        step()
    return {"mode": mode, "compile_s": compile_s,
            "first_loss_gap": abs(loss - eager_loss) / max(abs(eager_loss), 1e-30)}


def in_turns_with_eager(seconds: Dict[str, float], skips: int) -> Dict[str, Any]:
    """The captured step's median beside the eager step's from the same rounds (engine/census.seconds_in_turns),
    and the graphs that did not replay as CUDA graphs over the compile, warm-ups and timed steps."""
    return {"step_s": seconds["captured"], "eager_in_turns_s": seconds["ours"],
            "speedup": seconds["ours"] / seconds["captured"], "cudagraph_skips": skips}


def error_cell(exc: BaseException) -> Dict[str, str]:
    """{"error": ...} for a cell whose part failed (upstream's class, the profiler over the graphs): the exception's
    type and first line; the row's other figures stand."""
    return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}


def captured_activity(step, device: torch.device, step_s: float) -> Dict[str, Any]:
    """`gpu_activity` of one more captured step (--capture --profile): its GPU busy share says whether the replayed
    graphs keep the GPU busy, or the host's residue (the calls outside the graphs, CUDA graph trees' replay work)
    bounds the step. A profiler that cannot follow the graphs is reported in its cell; the row stands."""
    try:
        return gpu_activity(step, device, step_s)
    except Exception as exc:  # noqa: BLE001  the cell says what broke; the row's other figures stand
        return error_cell(exc)


def captured_census(hypes: dict, task, model, batch, precision, mode: str, device: torch.device) -> Dict[str, Any]:
    """The captured step's aten calls outside its compiled graphs on the CUDA path: the trainer's step under
    --capture `mode` over `model`, with the optimizer built for CUDA (fused Adam, as the eager count's) and, on the
    CPU, CUDA's kernels and autocast lists."""
    from opencood_ddp.engine.capture import CapturedStep, CaptureModule
    from opencood_ddp.engine.census import cuda_path_on_cpu, ops_outside_graphs, trainer_step
    from opencood_ddp.engine.optim import build_optimizer

    optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for="cuda")
    step = trainer_step(CapturedStep(), CaptureModule(model, task.step, mode, device), batch, optimizer, precision,
                        precision.new_scaler())
    _seeded()
    with cuda_path_on_cpu():
        calls = ops_outside_graphs(step)
    return {"ops_outside_graphs": sum(calls.values()), "ops_outside_graphs_by_name": calls}


# ------------------------------------------------------------------------------------------- --profile
def gpu_activity(step, device: torch.device, step_s: float) -> Dict[str, Any]:
    """engine/census.py's device_activity of one more step: kernel launches, the GPU's busy time and its share of
    the unprofiled median step (near 1: bound by the GPU's work; far below: by the host's launches), the kernels,
    copies and fills that took the most time; the host's waits for the device (how many, how long), and the ops
    and runtime calls that took the host the most time of its own (the first HOST_OPS)."""
    from opencood_ddp.engine.census import device_activity

    activity = device_activity(step, device)
    return {"kernels": activity.kernels, "busy_s": activity.busy_s, "busy_share": activity.busy_s / step_s,
            "by_name": [[name, calls, seconds] for name, (calls, seconds) in activity.by_name.items()],
            "host_waits": activity.host_waits, "host_wait_s": activity.host_wait_s,
            "host_by_name": [[name, calls, seconds]
                             for name, (calls, seconds) in list(activity.host_by_name.items())[:HOST_OPS]]}


HOST_OPS = 25  # the host's longest ops kept per profiled row: the JSON stays small, the table shows 10


def _waits_cell(gpu: Dict[str, Any]) -> str:
    return f"{gpu['host_waits']} ({gpu['host_wait_s'] * 1e3:.2f})"


def print_top_kernels(results: Sequence[Dict[str, Any]], rows: int = 10) -> None:
    """The kernels (copies, fills) that took the most GPU time in each profiled row."""
    _print_longest(results, "by_name", "the GPU's longest kernels per step (calls, ms), one profiled step",
                   "kernels", rows)


def print_top_host_ops(results: Sequence[Dict[str, Any]], rows: int = 10) -> None:
    """The ops and runtime calls that took the host the most time of its own in each profiled row: on a step
    bound by the host (a low GPU busy share), where its time goes."""
    _print_longest(results, "host_by_name", "the host's longest ops and runtime calls per step (calls, ms of their "
                   "own time), one profiled step", "ops", rows)


def _print_longest(results: Sequence[Dict[str, Any]], key: str, title: str, column: str, rows: int) -> None:
    """A table of each profiled row's first `rows` [name, calls, seconds] of r["gpu"][key]."""
    print(f"\n{title}")
    print(f"| config | batch | precision | {column} |\n|---|---:|---|---|")
    for r in results:
        top = r["gpu"][key][:rows]
        cells = "; ".join(f"{name[:70]} ({calls}, {seconds * 1e3:.2f})" for name, calls, seconds in top)
        print(f"| {r['config']} | {r['batch_size']} | {r['precision']} | {cells.replace('|', '/')} |")


# ------------------------------------------------------------------------------------------- --count
def _seeded() -> None:
    """The same seeds before each side's count: a model that draws in training (dropout, Where2comm's share of
    cells sent, from Python's random) then draws alike, so its data-dependent ops do."""
    random.seed(0)
    torch.manual_seed(0)


def _counted(step) -> Dict[str, Any]:
    """engine/census.py's counts of `step` on the CUDA path: ops (by phase, the top ones) and FLOPs."""
    from opencood_ddp.engine.census import count_ops, cuda_path_on_cpu

    _seeded()
    with cuda_path_on_cpu():
        ops = count_ops(step, flops=True)
    return {"ops": ops.total, "ops_by_phase": ops.by_phase, "ops_by_name": ops.by_op,
            "ops_by_phase_and_name": ops.calls, "python_functions": list(ops.python_functions), "flops": ops.flops}


def census(hypes: dict, task, model, batch, precision) -> Dict[str, Any]:
    """Our step's counts, with a fresh optimizer built for CUDA (the timed one has the device's kernels)."""
    return _counted(_trainer_step(hypes, task, model, batch, precision, "cuda"))


def rate(flops: int, seconds: float, device: torch.device, precision_name: str) -> Dict[str, Any]:
    from opencood_ddp.engine.census import device_peak

    peak = device_peak(device, precision_name)
    return {"tflops_per_s": flops / seconds / 1e12, "peak": None if peak is None else f"{peak[0]:g} ({peak[1]})"}


def _upstream_step(model, loss_fn, ego, optimizer, precision, scaler):
    """Upstream train.py's step as a census Step: model.zero_grad and optimizer.zero_grad, forward and loss
    (under autocast with --half), backward (scaled), ``optimizer.step`` or the scaler's step and update."""
    from opencood_ddp.engine.census import Step

    def forward_backward() -> torch.Tensor:
        model.zero_grad()
        optimizer.zero_grad()
        with precision.autocast():
            loss = loss_fn(model(ego), ego["label_dict"])
        (loss if scaler is None else scaler.scale(loss)).backward()
        return loss

    def update() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    return Step(forward_backward, update)


def upstream_side(args: argparse.Namespace, hypes: dict, ours, batch, batch_size: int, precision) -> Dict[str, Any]:
    """Upstream's step on the same batch and device, built and warmed up under "step" (run_one times it in turns
    with ours), with its count under --count; or {"error": ...} where its class fails to build or run."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import benchmark_vs_upstream as vs

    try:
        theirs, loss_fn = vs.build_upstream(args.upstream, upstream_hypes(hypes, batch_size))
        weights = vs.share_weights(ours, theirs)
        theirs = theirs.to(next(ours.parameters()).device).train()
        ego = vs.upstream_input(batch["ego"])
        result = {"weights": weights}
        if args.count:  # with fused Adam, as ours is counted: the counts compare the models, not the updates
            result.update(_counted(_upstream_step(theirs, loss_fn, ego, _upstream_optimizer(hypes, theirs, "cuda"),
                                                  precision, precision.new_scaler())))
        step = _upstream_step(theirs, loss_fn, ego, _upstream_optimizer(hypes, theirs, "cpu"), precision,
                              precision.new_scaler())
        step()  # its warm-up: allocator, kernels, the optimizer's state
        return {**result, "step": step}
    except (Exception, SystemExit) as exc:  # noqa: BLE001  the cell says what broke; our figures stand
        return error_cell(exc)


def upstream_in_turns(seconds: Dict[str, float]) -> Dict[str, Any]:
    """Upstream's median from the rounds it ran in with ours (and the captured step), and its ratio to each."""
    others = {name: value for name, value in seconds.items() if name != "upstream"}
    return {"seconds_in_turns": seconds, "step_s": seconds["upstream"],
            **{f"over_{name}": seconds["upstream"] / value for name, value in others.items()}}


def upstream_hypes(hypes: dict, batch_size: int) -> dict:
    """The hypes as upstream's user writes them for this batch: upstream's SECOND makes ``model.args.batch_size``
    maps whatever the batch holds (ours reads the batch), so the key is the row's batch where the config has it."""
    args = hypes["model"].get("args", {})
    if "batch_size" not in args:
        return hypes
    return {**hypes, "model": {**hypes["model"], "args": {**args, "batch_size": batch_size}}}


def _upstream_optimizer(hypes: dict, model, kernels_for: str):
    """The hypes' optimizer over upstream's trainable parameters (its setup_optimizer filters on requires_grad).
    kernels_for "cpu" leaves torch's default kernels, as upstream's own code does (on CUDA the foreach update);
    "cuda" takes ours (fused Adam)."""
    from opencood_ddp.engine.optim import build_optimizer

    return build_optimizer(hypes, [p for p in model.parameters() if p.requires_grad],
                           float(hypes["optimizer"]["lr"]), kernels_for=kernels_for)


# ------------------------------------------------------------------------------------------- driver
def ensure_data(data: Path) -> None:
    """The complete toy world in data, whatever its scale; the demo world is written where there is none, or where
    one was interrupted half-way (a half world would time fewer samples)."""
    from opencood_ddp.toy.writer import toy_world_in

    print(f"toy world in {data}: {toy_world_in(data, scale='demo')['scale']}", flush=True)


def passthrough(argv: Sequence[str]) -> List[str]:
    """The command line less the flags that name rows (ROW_FLAGS) and their values."""
    kept, skip = [], False
    for arg in argv:
        if arg.startswith("--"):
            skip = arg in ROW_FLAGS
        if not skip:
            kept.append(arg)
    return kept


def run_all(args: argparse.Namespace, argv: Sequence[str]) -> List[Dict[str, object]]:
    results = []
    for config in args.configs:
        for batch_size in args.batch_sizes:
            for precision in args.precisions:
                command = [sys.executable, __file__, "--one", config, str(batch_size), precision] + passthrough(argv)
                done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
                if done.returncode != 0:
                    print(f"{config} batch {batch_size} {precision}: failed, exit code {done.returncode}\n"
                          f"{done.stderr[-2000:]}", file=sys.stderr, flush=True)
                    continue
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(format_row(results[-1], args), flush=True)
                if args.json:  # after every row: a run cut at its time limit keeps the rows it measured
                    Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def header(args: argparse.Namespace) -> str:
    on = torch.device(args.device).type
    # The first seven columns keep their places: benchmark_zoo.py reads the grid, parameters, step and memory.
    cells = ["config", "BEV grid", "parameters", "batch", f"step on {on} (s)", f"per sample on {on} (s)",
             "peak memory (MiB)", "precision"]
    if args.count:
        cells += ["CAVs", "ops per step (fwd / bwd / opt)", "GFLOP per step", f"TFLOP/s on {on}", "device peak TFLOP/s"]
    if args.upstream and args.count:
        cells += ["upstream ops per step (fwd / bwd / opt)"]
    if args.profile:
        cells += ["GPU kernels per step", "GPU busy (ms)", "GPU busy / step", "host waits (ms)"]
    if args.capture:
        cells += [f"captured step ({args.capture}, s)", "capture speed-up", "first step, compile (s)",
                  "first loss gap to eager", "CUDA-graph skips"]
        cells += ["captured: ops outside the graphs"] if args.count else []
        cells += ["captured: GPU busy (ms)", "captured: GPU busy / step", "captured: host waits (ms)"] \
            if args.profile else []
    if args.upstream:
        cells += ["upstream step, in turns (s)", "upstream ÷ ours"]
        cells += ["upstream ÷ captured"] if args.capture else []
    align = "|---|---|---:|---:|---:|---:|---:|---|" + "---:|" * (len(cells) - 8)
    return "| " + " | ".join(cells) + " |\n" + align


def _ops_cell(counts: Dict[str, Any]) -> str:
    if "error" in counts:
        return counts["error"].replace("|", "/")
    phases = counts["ops_by_phase"]
    # upstream's model with weights other than ours (a name that differs) may branch otherwise: say so
    weights = "" if counts.get("weights", "same") == "same" else f" ({counts['weights']})"
    return f"{counts['ops']:,} ({phases['forward']:,} / {phases['backward']:,} / {phases['optimizer']:,}){weights}"


def _seconds(value: float) -> str:
    """Four significant digits: a GPU step of 16.3 ms printed to the millisecond (0.016) hid a tenth of batch 1
    over batch 2 on the H200 (2026-11-30)."""
    return f"{value:.4g}"


def format_row(r: Dict[str, Any], args: argparse.Namespace) -> str:
    cells = [r["config"], r["grid"], f"{r['parameters'] / 1e6:.2f} M", r["batch_size"], _seconds(r["step_s"]),
             _seconds(r["per_sample_s"]), f"{r['peak_mib']:.0f}", r["precision"]]
    if args.count:
        cells += [r["cavs"], _ops_cell(r), f"{r['flops'] / 1e9:,.1f}", f"{r['tflops_per_s']:.3f}", r["peak"] or "-"]
    if args.upstream and args.count:
        cells += [_ops_cell(r["upstream"])]
    if args.profile:
        gpu = r["gpu"]
        cells += [f"{gpu['kernels']:,}", f"{gpu['busy_s'] * 1e3:.2f}", f"{gpu['busy_share']:.2f}", _waits_cell(gpu)]
    if args.capture:
        c = r["capture"]
        cells += [_seconds(c["step_s"]), f"{c['speedup']:.2f}", f"{c['compile_s']:.1f}", f"{c['first_loss_gap']:.2g}",
                  c["cudagraph_skips"]]
        cells += [f"{c['ops_outside_graphs']:,}"] if args.count else []
        cells += _captured_gpu_cells(c["gpu"]) if args.profile else []
    if args.upstream:
        cells += _upstream_time_cells(r["upstream"], args)
    return "| " + " | ".join(map(str, cells)) + " |"


def _captured_gpu_cells(gpu: Dict[str, Any]) -> List[str]:
    if "error" in gpu:
        return [gpu["error"].replace("|", "/"), "-", "-"]
    return [f"{gpu['busy_s'] * 1e3:.2f}", f"{gpu['busy_share']:.2f}", _waits_cell(gpu)]


def _upstream_time_cells(upstream: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    names = ["ours"] + (["captured"] if args.capture else [])
    if "error" in upstream:
        return [upstream["error"].replace("|", "/")] + ["-"] * len(names)
    weights = "" if upstream["weights"] == "same" else f" ({upstream['weights']})"
    return [_seconds(upstream["step_s"]) + weights] + [f"{upstream[f'over_{name}']:.2f}" for name in names]


def _ops_list(pairs) -> str:
    return ", ".join(f"{op.replace('aten::', '')} {calls}" for op, calls in pairs)


def print_top_ops(results: Sequence[Dict[str, Any]], rows: int = 12) -> None:
    """The most called aten ops of each counted row, ours and upstream's; then, where upstream was counted, the
    ops we call more often than upstream, and those it calls more often than we do (calls, the largest first)."""
    print("\nthe most called aten ops per step (calls), CUDA path; the custom autograd functions in the step's graph")
    print("| config | batch | precision | side | ops | autograd functions |\n|---|---:|---|---|---|---|")
    for r in results:
        sides = [("ours", r)] + ([("upstream", r["upstream"])] if "ops_by_name" in r.get("upstream", {}) else [])
        for side, counts in sides:
            print(f"| {r['config']} | {r['batch_size']} | {r['precision']} | {side} | "
                  f"{_ops_list(list(counts['ops_by_name'].items())[:rows])} | "
                  f"{', '.join(counts['python_functions']) or '-'} |")
    compared = [r for r in results if "ops_by_name" in r.get("upstream", {})]
    if compared:
        print("\nops per step, ours against upstream's: where we call an op more often, and where upstream does")
        print("| config | batch | precision | ours more (ours - upstream) | upstream more (upstream - ours) |\n"
              "|---|---:|---|---|---|")
    for r in compared:
        ours, theirs = r["ops_by_name"], r["upstream"]["ops_by_name"]
        gaps = {op: ours.get(op, 0) - theirs.get(op, 0) for op in set(ours) | set(theirs)}
        more = sorted(((op, g) for op, g in gaps.items() if g > 0), key=lambda item: (-item[1], item[0]))
        less = sorted(((op, -g) for op, g in gaps.items() if g < 0), key=lambda item: (-item[1], item[0]))
        print(f"| {r['config']} | {r['batch_size']} | {r['precision']} | {_ops_list(more[:rows])} | "
              f"{_ops_list(less[:rows])} |")


def print_outside_graphs(results: Sequence[Dict[str, Any]], rows: int = 16) -> None:
    """The aten ops each counted captured step calls outside its graphs, the most called first (--count --capture)."""
    counted = [r for r in results if "ops_outside_graphs_by_name" in r.get("capture", {})]
    if not counted:
        return
    print("\nthe captured step's calls outside its graphs (calls), CUDA path")
    print("| config | batch | precision | calls | ops |\n|---|---:|---|---:|---|")
    for r in counted:
        c = r["capture"]
        print(f"| {r['config']} | {r['batch_size']} | {r['precision']} | {c['ops_outside_graphs']:,} | "
              f"{_ops_list(list(c['ops_outside_graphs_by_name'].items())[:rows])} |")


def batch_ratios(results: Sequence[Dict[str, Any]]) -> List[str]:
    """Each config and precision with rows at batch 1 and 2: the step at batch 1 over the step at batch 2, eager and
    (with --capture) captured. Issue 52 asks 0.6 or less: then 2 GPUs at batch 1 beat 1 GPU at batch 2 by 1.6x
    before DDP's all-reduce."""
    rows = {(r["config"], r["precision"], r["batch_size"]): r for r in results}
    lines = []
    for (config, precision, batch_size), one in rows.items():
        two = rows.get((config, precision, 2))
        if batch_size != 1 or two is None:
            continue
        capture = (f"{one['capture']['step_s'] / two['capture']['step_s']:.2f}" if "capture" in one and
                   "capture" in two else "-")
        lines.append(f"| {config} | {precision} | {one['step_s'] / two['step_s']:.2f} | {capture} |")
    if not lines:
        return []
    return ["", "step at batch 1 over step at batch 2 (issue 52: 0.6 or less)",
            "| config | precision | eager | captured |", "|---|---|---:|---:|", *lines]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        config, batch_size, precision = args.one
        print(json.dumps(run_one(config, int(batch_size), precision, args)))
        return 0
    ensure_data(Path(args.data))
    device = (f"cuda ({torch.cuda.get_device_name(args.device)})" if torch.device(args.device).type == "cuda"
              else "cpu")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"device {device}, median of {args.repeats} training steps (optimizer step included)")
    print(header(args))
    results = run_all(args, argv)
    if args.count:
        print_top_ops(results)
        print_outside_graphs(results)
    if args.profile:
        print_top_kernels(results)
        print_top_host_ops(results)
    for line in batch_ratios(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
