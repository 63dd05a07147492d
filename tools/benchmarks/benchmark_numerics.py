#!/usr/bin/env python
"""How far float32 training is from float64: batch-norm statistics per layout, and one training step per model.

    python tools/benchmarks/benchmark_numerics.py [--toy DIR] [--models] [--layers]

--layers: per-channel mean and variance of a (807,264 x 64) input (AttFuse's first PFN layer; mean 20, std 0.5)
from torch's native kernel, its contiguous (N, C, L) path, a float32 two-pass sum and numerics/batch_norm.py,
against float64, with the time of each (median of 5).
--timing: one BatchNorm layer's forward and backward, the accurate module against torch's, on the inputs of
full-size AttFuse's batch norms (LAYER_INPUTS), at torch's thread count (set OMP_NUM_THREADS), median of 5.
--models: for each of the nine toy configs, one training step (forward, loss, backward) on its first 2 training
samples of the small toy world, initial weights from seed 0, in float32 with torch's native batch norm and with
ours, each against the same step in float64: relative L2 of the output maps and of the gradient vector, samples
in order and swapped. tests/test_training_numerics.py asserts the "accurate" half of this table.
--layers and --models when no flag is given. Figures in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
STEMS = ["point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
         "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt",
         "point_pillar_where2comm", "second_intermediate_fusion"]


# ------------------------------------------------------------------------------------------------- layers
def _timed(function: Callable[[], object], repeats: int = 5) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def layer_table() -> None:
    from opencood_ddp.numerics.batch_norm import local_moments

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(807_264, 64, generator=generator) * 0.5 + 20
    exact_var, exact_mean = torch.var_mean(x.double(), 0, correction=0)

    def native(t: torch.Tensor):
        _, mean, invstd = torch.native_batch_norm(t, None, None, None, None, True, 0.0, 0.0)
        return mean, invstd.double().pow(-2)

    def two_pass():
        mean = x.sum(0) / len(x)
        return mean, (x - mean).square().sum(0) / len(x)

    planes = x.reshape(-1, 32, 64).permute(0, 2, 1).contiguous()
    ways = {"torch's native kernel on the 2-D input": lambda: native(x),
            "torch's native kernel, the (N, C, L) contiguous copy": lambda: native(planes),
            "float32 two-pass sum": two_pass,
            "numerics/batch_norm.py": lambda: tuple(local_moments(x)[1:])}
    print(f"# {torch.get_num_threads()} thread(s)")
    print("| statistics from | mean (std units) | variance (relative) | time (ms) |\n|---|---:|---:|---:|")
    for name, way in ways.items():
        mean, var = way()
        mean_error = float(((mean.double() - exact_mean).abs() / exact_var.sqrt()).max())
        var_error = float(((var.double() - exact_var).abs() / exact_var).max())
        print(f"| {name} | {mean_error:.1e} | {var_error:.1e} | {_timed(way):.0f} |", flush=True)


# The input of every batch norm in one full-size AttFuse training step on the toy world's first 2 samples (4
# CAVs): (shape, channels-last, how many layers take it). The (2, 128, 100, 352) deblock outputs are contiguous
# (N, C, H, W), where the accurate module hands over to torch's kernel.
LAYER_INPUTS = [((160_416, 64), False, 1), ((4, 64, 100, 352), True, 4), ((2, 128, 100, 352), False, 3),
                ((4, 128, 50, 176), True, 6), ((4, 256, 25, 88), True, 9)]


def timing_table() -> None:
    from opencood_ddp.numerics.batch_norm import use_accurate_batch_norm

    print(f"# {torch.get_num_threads()} thread(s); forward + backward of one layer, ms")
    print("| input | layers | accurate | torch's |\n|---|---:|---:|---:|")
    totals = [0.0, 0.0]
    for shape, channels_last, layers in LAYER_INPUTS:
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.randn(shape).mul_(0.5).add_(20).contiguous(memory_format=memory_format).requires_grad_()
        grad = torch.randn(shape).contiguous(memory_format=memory_format)
        times = []
        for convert in (use_accurate_batch_norm, lambda norm: norm):
            norm = convert((torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(shape[1]).train())

            def step():
                x.grad = None
                norm(x).backward(grad)

            times.append(_timed(step))
        totals = [total + layers * t for total, t in zip(totals, times)]
        layout = "channels-last" if channels_last else ("rows" if len(shape) == 2 else "contiguous")
        print(f"| {tuple(shape)} {layout} | {layers} | {times[0]:.1f} | {times[1]:.1f} |", flush=True)
    print(f"| all layers of the step | {sum(n for _, _, n in LAYER_INPUTS)} | {totals[0]:.0f} | {totals[1]:.0f} |")


# ------------------------------------------------------------------------------------------------- models
def floats_as(value, dtype: torch.dtype):
    """`value` with every floating tensor of its nested dicts, lists and tuples in `dtype`; integer tensors
    (record_len, voxel coordinates, indices) and everything else as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: floats_as(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(floats_as(item, dtype) for item in value)
    return value


def training_step(task, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's map outputs, every parameter's gradient), flattened, of one training-mode step."""
    model.train()
    model.zero_grad(set_to_none=True)
    outputs = {}
    handle = model.register_forward_hook(lambda module, args, out: outputs.update(out))
    try:
        task.step(model, batch).total.backward()
    finally:
        handle.remove()
    maps = [outputs[key].detach().flatten() for key in sorted(outputs)
            if isinstance(outputs[key], torch.Tensor) and outputs[key].dim() > 0]
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(maps).double(), torch.cat(grads).double()


def relative(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return float((ours - exact).norm() / exact.norm())


def step_errors(task, model32: torch.nn.Module, batch: dict) -> tuple[float, float]:
    """(output error, gradient error) of a float32 step against the same step in float64."""
    model64 = copy.deepcopy(model32).double()
    outputs32, grads32 = training_step(task, model32, batch)
    outputs64, grads64 = training_step(task, model64, floats_as(batch, torch.float64))
    return relative(outputs32, outputs64), relative(grads32, grads64)


def toy_task(stem: str, toy: Path):
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    path = REPO / "hypes_yaml" / "toy" / f"{stem}.yaml"
    torch.manual_seed(0)
    return build_task(load_parsed_hypes(path, split_overrides(toy)), for_training=True)


def model_table(toy: Path) -> None:
    from opencood_ddp.numerics.batch_norm import use_accurate_batch_norm, use_native_batch_norm

    print("| model | native: outputs | gradients | swapped: outputs | gradients | accurate: outputs | gradients | "
          "swapped: outputs | gradients |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for stem in STEMS:
        task = toy_task(stem, toy)
        samples = [task.train_set[i] for i in range(2)]
        cells = []
        for convert in (use_native_batch_norm, use_accurate_batch_norm):
            convert(task.model)
            for order in ((0, 1), (1, 0)):
                cells += step_errors(task, task.model, task.collate_train([samples[i] for i in order]))
        print(f"| {stem} | " + " | ".join(f"{value:.1e}" for value in cells) + " |", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toy", default="data/toy_small", help="small toy world (generated when absent)")
    parser.add_argument("--models", action="store_true")
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--timing", action="store_true")
    args = parser.parse_args(argv)
    if args.timing:
        timing_table()
    both = not (args.models or args.layers or args.timing)
    if args.layers or both:
        layer_table()
    if args.models or both:
        toy = Path(args.toy)
        from opencood_ddp.toy.writer import toy_world_in

        toy_world_in(toy, scale="small")
        model_table(toy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
