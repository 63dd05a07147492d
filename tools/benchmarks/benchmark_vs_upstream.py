#!/usr/bin/env python
"""One training step of our model against upstream OpenCOOD's class, on the same batch and the same weights.

Usage: python tools/benchmarks/benchmark_vs_upstream.py --upstream OPENCOOD_CHECKOUT
                                        [--configs point_pillar_v2vnet ...] [--threads 1 2] [--repeats 3]
                                        [--batch-size 2] [--data data/toy_opv2v_small] [--profile] [--json PATH]

For each full-size OPV2V config (hypes_yaml/opv2v/NAME.yaml) and each thread count, a fresh subprocess builds
our task as tools/benchmarks/benchmark_models.py does (a real collated training batch read from the toy world)
and upstream's model and loss classes from the checkout DIR (its ``opencood/models/<model.core_method>.py`` and
``opencood/loss/<loss.core_method>.py``, built from the same hypes' args; its own dependencies installed:
einops, spconv for SECOND). Our weights are loaded into upstream's model with ``strict=True``, and upstream's
back into ours, so both hold the same parameters and buffers; a name that differs is reported.

Before timing, both models run the batch in eval mode and the largest absolute difference of each head they
share (psm, rm) is printed: the timings compare the same computation only where that is small. Then one
training step per side: zero_grad, forward, loss, backward, ``optimizer.step`` (the hypes' optimizer, built for
each side alike). One warm-up step each, then ``--repeats`` steps of ours and upstream's taking turns (who goes
first alternates, so a change in the machine's load falls on both); the medians are reported.
Each timed step also records the process's CPU seconds in user and in kernel mode and its minor page faults
(``resource.getrusage``). On Linux most of the kernel-mode time is the first touch of freshly mapped memory:
glibc hands blocks above its mmap threshold (32 MB at most) back to the system when they are freed, so every
large activation is faulted in, page by page, at every step. That cost is the allocator's and the kernel's, not
the arithmetic's, and it grows with what a step allocates.

SECOND: our model patches spconv's CPU ops when it loads spconv (models/modules/spconv_compat.py: the backward's
CUDA-stream query, the racy scatter-add), and the patch is process-wide, so upstream's class runs on the patched
spconv too: the comparison is of the two models, not of the two spconv paths. Its process with both full-size
models' training state stays under 4 GB resident at batch 2 (the third session's "about 20 GB" did not repeat);
its profile with shapes peaks at 21 GB at batch 1 (upstream's step records 3 million ops).

``--profile`` adds torch.profiler (CPU) on one more step of each side: the top entries by self CPU time, and the
forward time of each top-level submodule (the two models share their submodule names) and of the step's phases.
A last table puts our profiled step beside two of its parts. Our convolution and matrix-product kernels
(``ARITHMETIC_OPS``) run the same layers on the same shapes as upstream's. The work both steps do alike, the same op
on inputs of the same sizes (``shared_work_ms``), adds the normalizations, the activations' backward, the zero fills
and the optimizer's updates. Each ceiling is the timed ratio times our step over one part: the ratio we would reach
if everything else of ours took no time, by a rewrite that keeps the arithmetic, or upstream's work. The timed
ratio is the base, not the profiled totals, because the profiler's cost per op inflates a step of many small ops
(upstream's AttFuse and Where2comm run 1.7 million per step, ours 0.1 million) far more than ours. The profile is
read from the profiler's raw events by the rules of torch's ``key_averages`` (``op_times``), without the Python
object per event that ``key_averages`` builds first and that outgrew 24 GiB on SECOND.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ["point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
           "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt",
           "point_pillar_where2comm", "second_intermediate_fusion"]
HEADS = ("psm", "rm")  # the detection heads every model returns; the loss reads only these


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", metavar="DIR", help="a checkout of upstream OpenCOOD (required to run)")
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="names under hypes_yaml/opv2v/, no .yaml")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch.set_num_threads values")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per side; the median is reported")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--data", default="data/toy_opv2v_small", help="toy OPV2V root (small scale, generated "
                                                                       "when absent)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step per side: top ops by self CPU time, forward per submodule")
    parser.add_argument("--profile-rows", type=int, default=12, help="ops listed per side with --profile")
    parser.add_argument("--profile-shapes", action=argparse.BooleanOptionalAction, default=True,
                        help="record the ops' input shapes for the shared-work ceiling (--no-profile-shapes: "
                             "where memory is short; SECOND's profile with shapes peaks at 21 GB)")
    parser.add_argument("--json", metavar="PATH", help="also write every result (steps, agreement, profile) here")
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "THREADS"), help=argparse.SUPPRESS)  # internal
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------- the two sides
def load_ours(config: str, data: Path, batch_size: int):
    """Our hypes, task and one collated training batch: the reading of benchmark_models.py."""
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / "opv2v" / f"{config}.yaml", split_overrides(data))
    hypes["train_params"]["seed"] = 0
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[i] for i in range(batch_size)])
    return hypes, task, batch


def upstream_class(checkout: str, package: str, core_method: str) -> type:
    """The class upstream's train_utils would pick for ``core_method``: in module ``package.core_method``, the
    one whose lower-cased name is the method's without underscores (point_pillar_v2vnet -> PointPillarV2VNet)."""
    root = str(Path(checkout).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(f"opencood.{package}.{core_method}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "opencood":
            raise SystemExit(f"error: {checkout} has no opencood/{package}/{core_method}.py") from None
        raise SystemExit(f"error: upstream's opencood.{package}.{core_method} needs the package {exc.name!r}; "
                         f"install it into this venv (pip install {exc.name}==VERSION)") from None
    wanted = core_method.replace("_", "").lower()
    for name, obj in vars(module).items():
        if isinstance(obj, type) and name.lower() == wanted:
            return obj
    raise SystemExit(f"error: upstream's opencood/{package}/{core_method}.py has no class named like {wanted}")


def upstream_model_args(args: Any) -> Any:
    """A copy of model.args in the form upstream's yaml parsers leave them: ``grid_size`` (ours: a list) is a
    numpy int64 array there, and SECOND's sparse backbone relies on it (``grid_size[::-1] + [1, 0, 0]`` adds
    element-wise; on a list it would concatenate). The copy also keeps constructors that edit their args off
    our hypes."""
    if isinstance(args, dict):
        return {key: np.asarray(value, dtype=np.int64) if key == "grid_size" else upstream_model_args(value)
                for key, value in args.items()}
    return copy.deepcopy(args)


def build_upstream(checkout: str, hypes: Mapping) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """Upstream's model and loss, built from the hypes' model.args and loss.args."""
    model_cls = upstream_class(checkout, "models", hypes["model"]["core_method"])
    loss_cls = upstream_class(checkout, "loss", hypes["loss"]["core_method"])
    return model_cls(upstream_model_args(hypes["model"]["args"])), loss_cls(copy.deepcopy(hypes["loss"]["args"]))


def share_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> str:
    """Our state dict into upstream's model, then upstream's back into ours, both strict: "same" when every
    name and shape matches, else what differs (upstream's model then keeps the weights that did load)."""
    state = ours.state_dict()
    result = theirs.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        return (f"names differ: upstream lacks {list(result.unexpected_keys)[:6]}, "
                f"ours lacks {list(result.missing_keys)[:6]}")
    theirs.load_state_dict(state, strict=True)  # shapes too: raises on a mismatch
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return "same"


def upstream_input(ego: Mapping[str, Any]) -> Dict[str, Any]:
    """Upstream's ``batch['ego']`` from ours. Our collate writes upstream's keys, shapes and dtypes for every
    key its models read (processed_lidar, record_len, pairwise_t_matrix, spatial_correction_matrix,
    prior_encoding), so those are passed as they are; a shallow copy keeps upstream's models, some of which add
    keys to the dict they are given, from touching ours. Our labels are float32 (the dtype our loss reads);
    upstream's loss gets them widened to its float64, so that its regression runs in float64 as on its own
    labels (the 0/1 labels are exact; the box codes are rounded once to float32)."""
    upstream = dict(ego)
    upstream["label_dict"] = {key: value.double() if value.is_floating_point() else value
                              for key, value in ego["label_dict"].items()}
    return upstream


# ------------------------------------------------------------------------------------------- agreement
def forward_agreement(ours, theirs, ego, upstream_ego) -> Dict[str, float]:
    """Max |ours - upstream's| of each head, eval mode (running statistics, no dropout): the same function."""
    ours.eval(), theirs.eval()
    with torch.no_grad():
        a, b = ours(ego), theirs(upstream_ego)
    ours.train(), theirs.train()
    diffs = {}
    for head in HEADS:
        if head in a and head in b and a[head].shape == b[head].shape:
            diffs[head] = float((a[head].double() - b[head].double()).abs().max())
            diffs[f"{head}_scale"] = float(a[head].double().abs().max())
        else:
            diffs[head] = float("nan")
    return diffs


# ------------------------------------------------------------------------------------------- timing
def training_step(model, optimizer, forward_loss: Callable[[], torch.Tensor]) -> Dict[str, float]:
    """zero_grad, forward, loss, backward and optimizer step, as upstream's train.py does: its wall seconds, loss,
    this process's CPU seconds in user and in kernel mode (``resource.getrusage``), and its minor page faults."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    loss = forward_loss()
    loss.backward()
    optimizer.step()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "loss": float(loss.detach()), "user": after.ru_utime - before.ru_utime,
            "system": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt}


def make_sides(hypes, task, batch, theirs, their_loss) -> Dict[str, Tuple[torch.nn.Module, Any, Callable]]:
    """name -> (model, optimizer, forward+loss): each side's optimizer is the hypes' one over its trainable
    parameters (upstream's setup_optimizer filters on requires_grad)."""
    from opencood_ddp.engine.optim import build_optimizer

    ours, ego = task.model, batch["ego"]
    upstream_ego = upstream_input(ego)
    lr = float(hypes["optimizer"]["lr"])

    def optimizer(model):
        return build_optimizer(hypes, [p for p in model.parameters() if p.requires_grad], lr)

    return {"ours": (ours, optimizer(ours), lambda: task.step(ours, batch).total),
            "upstream": (theirs, optimizer(theirs),
                         lambda: their_loss(theirs(upstream_ego), upstream_ego["label_dict"]))}


def time_sides(sides, repeats: int) -> Dict[str, Any]:
    """One warm-up step each (allocator, spconv's first call), then the sides in turns, who goes first
    alternating from round to round. Returns the median seconds and the warm-up step's loss of each."""
    warm = {}
    for name, side in sides.items():
        # The same seeds before each side's first step: the losses of a model that draws random numbers in
        # training (dropout; Where2comm's share of cells sent, from Python's random) can then agree where the
        # two sides draw in the same order.
        random.seed(0), torch.manual_seed(0)
        warm[name] = training_step(*side)["loss"]
    steps: Dict[str, List[Dict[str, float]]] = {name: [] for name in sides}
    order = list(sides)
    for round_ in range(repeats):
        for name in (order if round_ % 2 == 0 else order[::-1]):
            steps[name].append(training_step(*sides[name]))
    times = {name: [step["seconds"] for step in side] for name, side in steps.items()}
    cpu = {name: {key: statistics.median(step[key] for step in side) for key in ("user", "system", "faults")}
           for name, side in steps.items()}
    return {"seconds": {name: statistics.median(t) for name, t in times.items()}, "all": times, "cpu": cpu,
            "first_loss": warm}


# ------------------------------------------------------------------------------------------- profile
@contextlib.contextmanager
def submodule_ranges(model: torch.nn.Module):
    """Profiler ranges named ``module::NAME`` around each top-level submodule's forward, so that the forward
    time of pillar_vfe, backbone, fusion_net, ... (names both sides share) is read off the profile."""
    from torch.autograd.profiler import record_function

    open_ranges: Dict[str, Any] = {}

    def enter(name):
        def hook(_module, _inputs):
            open_ranges[name] = record_function(f"module::{name}")
            open_ranges[name].__enter__()
        return hook

    def leave(name):
        def hook(_module, _inputs, _output):
            open_ranges.pop(name).__exit__(None, None, None)
        return hook

    handles = []
    for name, child in model.named_children():
        handles += [child.register_forward_pre_hook(enter(name)), child.register_forward_hook(leave(name))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profiled_step(model, optimizer, forward_loss, shapes: bool = True) -> Any:
    """One training step under the CPU profiler, its phases marked (``step::forward+loss``, ``step::backward``,
    ``step::optimizer``); returns the profiler (with ``shapes``, the ops' input shapes recorded)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with submodule_ranges(model), profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        with record_function("step::forward+loss"):
            loss = forward_loss()
        with record_function("step::backward"):
            loss.backward()
        with record_function("step::optimizer"):
            optimizer.step()
    return prof


# The kernels that do a model's own arithmetic, its convolutions and matrix products, forward and backward. Both
# sides run them on the same shapes (the same layers, the same batch), so their time is a floor no rewrite of the
# code around them removes: what is left to gain is the rest (copies, layouts, element-wise passes, Python).
ARITHMETIC_OPS = frozenset({
    "aten::mkldnn_convolution", "aten::convolution_backward", "aten::_slow_conv2d_forward",
    "aten::_slow_conv2d_backward", "aten::slow_conv_transpose2d", "aten::_nnpack_spatial_convolution",
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


# Our own autograd functions that do the work of a torch op upstream's class calls: matched by their first input's
# size (their other arguments differ), so that our BatchNorm counts as the same work as torch's on the same layer.
SAME_WORK = {"BatchNormFunction": "aten::native_batch_norm",
             "BatchNormFunctionBackward": "aten::native_batch_norm_backward"}


def op_times(prof) -> Dict[Tuple[str, Tuple[Tuple[int, ...], ...]], List[int]]:
    """(name, input shapes) -> [self ns, total ns, calls] for every CPU op and range of the step: what torch's
    ``key_averages(group_by_input_shape=True)`` reports, read from the profiler's raw results.

    Why not ``key_averages``: it first builds a Python ``FunctionEvent`` per event, and upstream SECOND's step
    records 3 million ops; with their shapes those objects outgrew this machine's 24 GiB (docs/benchmarks.md).
    The rules are torch's: utility events are left out, an event that starts and ends on different threads has
    no place in the tree, an event's self time is its duration less its direct children's on the same thread,
    and a child that is the only one of a parent of the same name merges into that parent."""
    keys: Dict[Tuple[str, Tuple[Tuple[int, ...], ...]], int] = {}
    rows = _event_rows(prof, keys)
    rows.sort(key=lambda row: (row[0], row[1], -row[2]))
    parent = _parents(rows)
    children = np.bincount(parent[parent >= 0], minlength=len(rows))
    self_ns = np.array([end - start for _thread, start, end, _key, _name in rows], dtype=np.int64)
    total_ns = self_ns.copy()
    nested = parent >= 0
    np.subtract.at(self_ns, parent[nested], total_ns[nested])
    counted = np.ones(len(rows), dtype=bool)
    for i in range(len(rows)):  # parents sort before their children: a chain of merges ends at its first event
        p = parent[i]
        if p >= 0 and rows[p][4] == rows[i][4] and children[p] == 1:
            counted[i] = False
            self_ns[_merged_into(parent, counted, p)] += self_ns[i]
    times = [[0, 0, 0] for _ in keys]
    for i, row in enumerate(rows):
        if counted[i]:
            times[row[3]][0] += int(self_ns[i])
            times[row[3]][1] += int(total_ns[i])
            times[row[3]][2] += 1
    return {key: times[index] for key, index in keys.items() if times[index][2]}


def _event_rows(prof, keys: Dict) -> List[Tuple[int, int, int, int, int]]:
    """(thread, start ns, end ns, key index, name index) of every event that has a place in torch's tree, its key
    (name, input shapes) numbered in ``keys``."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import _filter_name

    rows, names = [], {}
    for event in prof.profiler.kineto_results.events():  # torch's own parser reads this list too (private API)
        name = event.name()
        if (_filter_name(name) or event.is_hidden_event() or event.device_type() != DeviceType.CPU
                or event.is_async() or event.start_thread_id() != event.end_thread_id()):
            continue
        key = (name, tuple(tuple(shape) for shape in event.shapes()))
        rows.append((event.start_thread_id(), event.start_ns(), event.end_ns(), keys.setdefault(key, len(keys)),
                     names.setdefault(name, len(names))))
    return rows


def _parents(rows: Sequence[tuple]) -> np.ndarray:
    """The index of each sorted (thread, start, end, ...) row's innermost enclosing row on its thread, or -1."""
    parent = np.full(len(rows), -1, dtype=np.int64)
    stack: List[int] = []
    thread = None
    for i, (row_thread, start, end, _key, _name) in enumerate(rows):
        if row_thread != thread:
            stack, thread = [], row_thread
        # torch's rule: a row that starts after the top of the stack ends, or ends after it (a partial overlap),
        # has no place under it.
        while stack and (start >= rows[stack[-1]][2] or end > rows[stack[-1]][2]):
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _merged_into(parent: np.ndarray, counted: np.ndarray, i: int) -> int:
    """The event that a merged one's time goes to: its nearest ancestor still counted."""
    while not counted[i]:
        i = parent[i]
    return i


def shaped_ops(times: Mapping) -> List[Tuple[str, List[List[int]], float, int]]:
    """(op, input shapes, self CPU ms, calls) for every op of the step (``op_times``), the ranges left out."""
    return [(name, [list(shape) for shape in shapes], self_ns / 1e6, calls)
            for (name, shapes), (self_ns, _total, calls) in times.items()
            if not name.startswith(("module::", "step::"))]


def work_key(op: str, shapes: Sequence[Sequence[int]]) -> Tuple[str, Tuple[int, ...]]:
    """What an op group computes, whatever the layout: the op (ours in ``SAME_WORK`` as torch's) and the number of
    elements of each input (-1 for an argument that is not a tensor, or whose shape was not recorded). Our PFN
    normalizes (pillars x points, C) rows where upstream's normalizes (pillars, C, points): the same work."""
    sizes = tuple(int(np.prod(shape)) if shape else -1 for shape in shapes)
    op = SAME_WORK.get(op, op)
    return (op, sizes[:1]) if op in SAME_WORK.values() else (op, sizes)


def shared_work_ms(ours: Sequence[Sequence], theirs: Sequence[Sequence]) -> Tuple[float, Dict[str, float]]:
    """Our ms in the work upstream's step also does: every group of ours whose ``work_key`` upstream's step has
    too, counted for at most as many calls as upstream makes (our ms per call times the smaller count). Returns the
    total and, per op, the matched ms outside ``ARITHMETIC_OPS``. The timed ratio times our step over this is the
    ratio left if everything else of ours took no time and the shared work kept our speed: below 1.5, the bar is
    out of reach by any change that keeps upstream's work."""
    calls: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for op, shapes, _ms, count in theirs:
        key = work_key(op, shapes)
        calls[key] = calls.get(key, 0) + count
    total, by_op = 0.0, {}
    for op, shapes, ms, count in ours:
        share = ms * min(count, calls.get(work_key(op, shapes), 0)) / count if count else 0.0
        total += share
        if share and op not in ARITHMETIC_OPS:
            by_op[op] = by_op.get(op, 0.0) + share
    return total, by_op


def profile_report(prof, rows: int) -> Dict[str, Any]:
    """The top ``rows`` ops by self CPU time (ms, calls), the ms of each marked range (total CPU time), the self
    time of the arithmetic kernels (``ARITHMETIC_OPS``), and every op grouped by input shapes (``shaped_ops``;
    with ``--profile-shapes``)."""
    times = op_times(prof)
    by_name: Dict[str, List[int]] = {}
    for (name, _shapes), (self_ns, total_ns, calls) in times.items():
        sums = by_name.setdefault(name, [0, 0, 0])
        sums[0], sums[1], sums[2] = sums[0] + self_ns, sums[1] + total_ns, sums[2] + calls
    ops = sorted(((name, t) for name, t in by_name.items() if not name.startswith(("module::", "step::"))),
                 key=lambda item: -item[1][0])
    total = sum(t[0] for _name, t in ops) / 1e6
    arithmetic = sum(t[0] for name, t in ops if name in ARITHMETIC_OPS) / 1e6
    top = [(name, t[0] / 1e6, t[2]) for name, t in ops[:rows]]
    ranges = {name: t[1] / 1e6 for name, t in by_name.items() if name.startswith(("module::", "step::"))}
    return {"top": top, "self_total_ms": total, "arithmetic_ms": arithmetic, "ranges": ranges,
            "shaped": shaped_ops(times) if prof.record_shapes else None}


def ceiling_row(r: Mapping[str, Any]) -> str:
    """Where our profiled step's time goes, and the best ratios left to us: the timed ratio scaled by our step
    over our arithmetic kernels alone (as if everything of ours but the convolutions and matrix products took no
    time), and by our step over our time in the work upstream's step also does (``shared_work_ms``), with that
    work's largest ops besides the arithmetic. The timed ratio, not the profiled totals: the profiler's cost per
    op inflates a step of many small ops (upstream's AttFuse runs 1.7 million) far more than ours."""
    ours, theirs = r["profile"]["ours"], r["profile"]["upstream"]
    ratio = r["seconds"]["upstream"] / r["seconds"]["ours"]
    shared_ms = shared_ceiling = largest = "-"  # --no-profile-shapes: no shapes to match
    if ours["shaped"] is not None and theirs["shaped"] is not None:
        shared, by_op = shared_work_ms(ours["shaped"], theirs["shaped"])
        shared_ms, shared_ceiling = f"{shared:.0f}", f"{ratio * ours['self_total_ms'] / shared:.2f}"
        largest = ", ".join(f"{op.replace('aten::', '')} {ms:.0f}"
                            for op, ms in sorted(by_op.items(), key=lambda item: -item[1])[:4])
    return (f"| {r['config']} | {r['threads']} | {ratio:.2f} | {ours['self_total_ms']:.0f} | "
            f"{ours['arithmetic_ms']:.0f} | {shared_ms} | {theirs['self_total_ms']:.0f} | "
            f"{ratio * ours['self_total_ms'] / ours['arithmetic_ms']:.2f} | {shared_ceiling} | {largest} |")


# ------------------------------------------------------------------------------------------- one config
def run_one(config: str, threads: int, args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    hypes, task, batch = load_ours(config, Path(args.data), args.batch_size)
    theirs, their_loss = build_upstream(args.upstream, hypes)
    weights = share_weights(task.model, theirs)
    ego = batch["ego"]
    agreement = forward_agreement(task.model, theirs, ego, upstream_input(ego))
    sides = make_sides(hypes, task, batch, theirs, their_loss)
    timing = time_sides(sides, args.repeats)
    result = {"config": config, "threads": torch.get_num_threads(), "weights": weights, "agreement": agreement,
              "cavs": int(ego["record_len"].sum()) if "record_len" in ego else args.batch_size,
              "parameters": sum(p.numel() for p in task.model.parameters()), **timing}
    if args.profile:
        result["profile"] = {name: profile_report(profiled_step(*side, shapes=args.profile_shapes),
                                                     args.profile_rows)
                             for name, side in sides.items()}
    return result


# ------------------------------------------------------------------------------------------- driver
def ensure_data(data: Path) -> None:
    """The complete toy world in data, whatever its scale; the small world is written where there is none, or where
    one was interrupted half-way."""
    from opencood_ddp.toy.writer import toy_world_in

    print(f"toy world in {data}: {toy_world_in(data, scale='small')['scale']}", flush=True)


def run_subprocess(config: str, threads: int, argv: Sequence[str]) -> Optional[Dict[str, Any]]:
    """One config at one thread count in a fresh process: torch's thread pool is set once, before any op, and
    one model's allocations and caches do not carry into the next's."""
    command = [sys.executable, __file__, "--one", config, str(threads)] + list(argv)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        # A negative code is a signal: -9 is most often the kernel's out-of-memory killer (two models train here).
        print(f"{config} ({threads} threads): failed, exit code {done.returncode}\n{done.stderr[-3000:]}",
              file=sys.stderr, flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def passthrough(argv: Sequence[str], args: argparse.Namespace) -> List[str]:
    """The command line less --configs and --threads with their values (the subprocess gets one of each)."""
    kept, skip = [], False
    for arg in argv:
        if arg in ("--configs", "--threads"):
            skip = True
        elif arg.startswith("--"):
            skip = False
        if not skip:
            kept.append(arg)
    return kept


def format_row(r: Mapping[str, Any]) -> str:
    ours, theirs = r["seconds"]["ours"], r["seconds"]["upstream"]
    return f"| {r['config']} | {r['threads']} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f} |"


def steps_row(r: Mapping[str, Any]) -> str:
    cells = [", ".join(f"{t:.3f}" for t in r["all"][side]) for side in ("ours", "upstream")]
    return f"| {r['config']} | {r['threads']} | {cells[0]} | {cells[1]} |"


def cpu_row(r: Mapping[str, Any]) -> str:
    ours, theirs = r["cpu"]["ours"], r["cpu"]["upstream"]
    # A ratio over a part that rounds to 0.00 s says nothing: "-".
    cells = [f"{ours[key]:.2f} | {theirs[key]:.2f} | "
             + (f"{theirs[key] / ours[key]:.2f}" if ours[key] >= 0.005 else "-") for key in ("user", "system")]
    return (f"| {r['config']} | {r['threads']} | {cells[0]} | {cells[1]} | {ours['faults'] / 1e6:.2f} | "
            f"{theirs['faults'] / 1e6:.2f} |")


def agreement_row(r: Mapping[str, Any]) -> str:
    a, loss = r["agreement"], r["first_loss"]
    heads = " | ".join(f"{a[h]:.2e} (of {a.get(h + '_scale', float('nan')):.2e})" for h in HEADS)
    return (f"| {r['config']} | {r['weights']} | {heads} | {loss['ours']:.6f} | {loss['upstream']:.6f} |")


def print_profile(r: Mapping[str, Any]) -> None:
    print(f"\n### {r['config']}, {r['threads']} thread(s): one training step under torch.profiler (CPU)")
    for name in ("ours", "upstream"):
        p = r["profile"][name]
        print(f"\n{name}: self CPU total {p['self_total_ms']:.0f} ms; top ops by self CPU time")
        print("| op | self CPU ms | calls |\n|---|---:|---:|")
        for key, ms, count in p["top"]:
            print(f"| {key} | {ms:.1f} | {count} |")
    names = sorted(set(r["profile"]["ours"]["ranges"]) | set(r["profile"]["upstream"]["ranges"]),
                   key=lambda key: (not key.startswith("step::"), key))
    print("\nranges (total CPU ms; module:: is the forward of a top-level submodule)")
    print("| range | ours | upstream |\n|---|---:|---:|")
    for key in names:
        cells = [r["profile"][side]["ranges"].get(key) for side in ("ours", "upstream")]
        print(f"| {key} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not args.upstream:
        raise SystemExit("error: --upstream DIR (a checkout of upstream OpenCOOD) is required")
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args)))
        return 0
    ensure_data(Path(args.data))
    print(f"# {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, batch {args.batch_size}, "
          f"median of {args.repeats} training steps per side, the sides in turns")
    print("| config | threads | ours s | upstream s | upstream ÷ ours |\n|---|---:|---:|---:|---:|")
    results = []
    for config in args.configs:
        for threads in args.threads:
            result = run_subprocess(config, threads, passthrough(argv, args))
            if result is not None:
                results.append(result)
                print(format_row(result), flush=True)
    print("\nevery timed step, in the order run (s): the spread says how far the machine's load moved the medians")
    print("| config | threads | ours | upstream |\n|---|---:|---|---|")
    for result in results:
        print(steps_row(result))
    print("\nCPU seconds of a step (medians): in user mode, and in kernel mode (mostly page faults: the first "
          "touch of freshly mapped memory), and the minor page faults (millions)")
    print("| config | threads | user ours | user upstream | ÷ | kernel ours | kernel upstream | ÷ | faults ours | "
          "faults upstream |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        print(cpu_row(result))
    print("\nforward agreement, eval mode, same weights: max |ours - upstream| (of max |ours|), and the loss of "
          "the first training step")
    print("| config | weights | psm | rm | loss ours | loss upstream |\n|---|---|---:|---:|---:|---:|")
    for result in [r for r in results if r["threads"] == min(args.threads)]:
        print(agreement_row(result))
    profiled = [r for r in results if "profile" in r]
    for result in profiled:
        print_profile(result)
    if profiled:
        print("\nthe profiled step's self CPU ms: ours, ours in the convolution and matrix-product kernels "
              "(ARITHMETIC_OPS), ours in the work upstream's step also does (the same op on the same input shapes, "
              "our BatchNorm as torch's), and upstream's; each ceiling is the timed ratio times our total over one "
              "of those parts, the ratio left if all else of ours took no time; the last column lists the shared "
              "work's largest ops besides the arithmetic (ours, ms)")
        print("| config | threads | upstream ÷ ours | ours | ours arithmetic | ours shared | upstream | "
              "arithmetic ceiling | shared ceiling | shared, not arithmetic |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for result in profiled:
            print(ceiling_row(result))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
