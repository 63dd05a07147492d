#!/usr/bin/env python
"""--capture compile's accuracy against float64, beside eager float32's, and its step time (issue 52, item 3).

    python tools/benchmarks/benchmark_capture.py [--hypes_yaml hypes_yaml/toy/point_pillar_intermediate_fusion.yaml]
        [--set KEY=VALUE ...] [--data data/toy_opv2v] [--batch_size 2] [--steps 3] [--optimizer hypes|sgd]
        [--aot_eager] [--warmup 3] [--timed 10] [--factor 4] [--warm_cache] [--device cpu|cuda] [--json PATH]

From the same initial weights and the same batches, each run takes --steps training steps (forward, loss,
backward, the optimizer's step):
- float64: the eager step with model and batch in double: the reference;
- eager float32: the eager step as training takes it;
- inductor: the step through engine/capture.py's CaptureModule, ``--capture compile`` (mode reduce-overhead on
  CUDA, as the module picks);
- aot_eager (--aot_eager): the same graphs run by torch's eager kernels; it must equal eager float32 bit for bit.
Inductor's gaps to eager float32 itself are reported too: how far the capture moves the step. On the CPU one more
run, outside the verdict: eager float32 with the CPU's own kernels (float64 batch-norm statistics, the hashed
dropout), the step the CPU trains with by default: how much of float32's gap those kernels remove (with dropout
in the model its masks are other draws, so there it compares more than arithmetic).
On the CPU every run is under numerics/kernel_path.cuda_kernels_on_cpu, as the captured step is (torch's native
kernels, which take double too); on CUDA the runs take the kernels they take (TF32 where torch allows it).

The batches are the first --steps batches of --batch_size consecutive training samples whose CAV layout
(record_len) is the first batch's: one compile serves them all, and every step sees other data.

Reported: per step, each float32 run's loss gap to float64 (relative); after the steps, the gap of the weights
(parameters and batch-norm statistics) to float64, largest absolute and relative norm. The verdict: the capture is
float32 arithmetic of eager's quality when every gap of inductor is at most --factor times eager float32's (its
noise floor, measured here). A loss gap is floored at float32's rounding of the loss itself (2**-24 relative): a
lucky near-zero gap of eager is no floor to judge by.

Timing: the first step of each run (a capture's compile included: inductor's on-disk caches in a new empty folder,
so the compile is a cold one, unless --warm_cache keeps torch's own folder, as training does), then the median of
--timed steps after --warmup more, eager float32 and captured, on the first batch (no new compile), the device
synchronised before each clock reading. On a loaded CPU the times are indicative only.

Inductor draws random numbers (dropout) with eager's generator here (``fallback_random``), so that a model with
dropout compares arithmetic, not draws.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_numerics import floats_as  # noqa: E402  (this folder: the script's own)
from opencood_ddp.engine.capture import step_kernels  # noqa: E402
from opencood_ddp.engine.options import training_flags  # noqa: E402

DEFAULT_HYPES = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
LOSS_FLOOR = 2.0 ** -24  # float32's relative rounding of the loss value itself


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[training_flags("hypes_yaml", "overrides")])
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (the demo world written if absent)")
    parser.add_argument("--batch_size", type=int, default=2, help="samples per batch")
    parser.add_argument("--steps", type=int, default=3, help="training steps compared with float64")
    parser.add_argument("--optimizer", choices=("hypes", "sgd"), default="hypes",
                        help="the hypes' optimizer (built for the device, as training does), or SGD lr 0.01 "
                             "momentum 0.9 (tests/test_capture.py's)")
    parser.add_argument("--aot_eager", action="store_true", help="also the aot_eager capture (bit for bit)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    parser.add_argument("--timed", type=int, default=10, help="timed steps, eager and captured")
    parser.add_argument("--factor", type=float, default=4.0, help="inductor's gap may be this times eager's")
    parser.add_argument("--warm_cache", action="store_true", help="keep inductor's cache folder (a compile may reuse "
                                                                  "an earlier run's) instead of a new empty one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    args.hypes_yaml = args.hypes_yaml or str(DEFAULT_HYPES)
    return args


# ------------------------------------------------------------------------------------------------ set-up
def build_task(args: argparse.Namespace):
    """The hypes' training task on the toy world in --data, seeded as training seeds it."""
    from opencood_ddp.tasks import build_task as build
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.toy.writer import toy_world_in
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    toy_world_in(Path(args.data), scale="demo")
    hypes = load_parsed_hypes(Path(args.hypes_yaml), [*split_overrides(args.data), *args.overrides])
    torch.manual_seed(0)
    return hypes, build(hypes, for_training=True)


def layout_of(batch: Any) -> Optional[tuple]:
    record_len = batch["ego"].get("record_len")
    return None if record_len is None else tuple(int(n) for n in record_len.tolist())


def pick_batches(task, count: int, batch_size: int, device: torch.device) -> list:
    """`count` batches of consecutive training samples with the first batch's CAV layout, on the device."""
    batches, wanted = [], None
    for start in range(0, len(task.train_set) - batch_size + 1, batch_size):
        batch = task.collate_train([task.train_set[i] for i in range(start, start + batch_size)])
        wanted = layout_of(batch) if wanted is None else wanted
        if layout_of(batch) == wanted:
            batches.append(task.move_to(batch, device))
        if len(batches) == count:
            return batches
    raise SystemExit(f"only {len(batches)} batches of CAV layout {wanted} in the training split; fewer --steps")


def make_optimizer(args: argparse.Namespace, hypes: dict, model: nn.Module, device: torch.device):
    from opencood_ddp.engine.optim import build_optimizer

    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for=device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ one run
class Run:
    """One way of taking the step: a model of its own (a copy of the initial one), its optimizer, and
    forward-and-loss as eager training or the CaptureModule takes it."""

    def __init__(self, name: str, args, hypes, task, initial: nn.Module, device: torch.device,
                 dtype: torch.dtype = torch.float32, capture: Optional[str] = None, cpu_kernels: bool = False):
        from opencood_ddp.engine.capture import CaptureModule

        self.name, self.task, self.device = name, task, device
        self.model = copy.deepcopy(initial).to(device=device, dtype=dtype).train()
        self.optimizer = make_optimizer(args, hypes, self.model, device)
        self.module = None if capture is None else CaptureModule(self.model, task.step, capture, device)
        self.dtype, self.cpu_kernels = dtype, cpu_kernels

    def step(self, batch: Any) -> float:
        """One training step on `batch` (already in this run's dtype); its loss."""
        with contextlib.nullcontext() if self.cpu_kernels else step_kernels(self.device):
            out = self.module(batch) if self.module is not None else self.task.step(self.model, batch)
            out.total.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(out.total.detach())

    def steps(self, batches: List[Any]) -> List[float]:
        """The losses of one step per batch; ``first_s`` keeps the first step's seconds (a capture's compile)."""
        torch.manual_seed(0)  # every run draws alike (dropout)
        losses = []
        for batch in batches:
            batch = floats_as(batch, self.dtype)
            synchronize(self.device)
            started = time.perf_counter()
            losses.append(self.step(batch))
            synchronize(self.device)
            if len(losses) == 1:
                self.first_s = time.perf_counter() - started
        return losses


def weights(model: nn.Module) -> List[torch.Tensor]:
    return [value.detach().double().flatten() for value in model.state_dict().values() if value.is_floating_point()]


def weight_gaps(model: nn.Module, reference: nn.Module) -> dict:
    """Largest absolute difference of any weight or statistic, and the relative norm of all of them together."""
    ours, theirs = torch.cat(weights(model)), torch.cat(weights(reference))
    return {"max_abs": float((ours - theirs).abs().max()), "rel_norm": float((ours - theirs).norm() / theirs.norm())}


def loss_gaps(losses: List[float], reference: List[float]) -> List[float]:
    return [abs(loss - exact) / abs(exact) for loss, exact in zip(losses, reference)]


def seconds(step: Callable[[], Any], device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - started


def median_step(run: Run, batch: Any, args: argparse.Namespace) -> float:
    """Median seconds of --timed steps on `batch` after --warmup ones."""
    batch = floats_as(batch, run.dtype)
    for _ in range(args.warmup):
        run.step(batch)
    return statistics.median(seconds(lambda: run.step(batch), run.device) for _ in range(args.timed))


# ------------------------------------------------------------------------------------------------ driver
def measure(args: argparse.Namespace) -> dict:
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True  # dropout draws as eager's (the module docstring says why)
    device = torch.device(args.device)
    hypes, task = build_task(args)
    initial = copy.deepcopy(task.model).cpu()
    batches = pick_batches(task, args.steps, args.batch_size, device)
    runs = {"float64": Run("float64", args, hypes, task, initial, device, torch.float64),
            "eager": Run("eager", args, hypes, task, initial, device),
            "compile": Run("compile", args, hypes, task, initial, device, capture="compile")}
    if args.aot_eager:
        runs["aot_eager"] = Run("aot_eager", args, hypes, task, initial, device, capture="aot_eager")
    if device.type == "cpu":
        runs["eager_cpu_kernels"] = Run("eager_cpu_kernels", args, hypes, task, initial, device, cpu_kernels=True)
    losses = {name: run.steps(batches) for name, run in runs.items()}
    result = dict(config=args.hypes_yaml, overrides=list(args.overrides), device=str(device), steps=args.steps,
                  batch_size=args.batch_size, layout=layout_of(batches[0]), optimizer=args.optimizer,
                  torch=torch.__version__, machine=machine(device), threads=torch.get_num_threads(),
                  factor=args.factor)
    result.update(accuracy(losses, runs, args.factor))
    result["timing"] = timing(runs, batches[0], args)
    return result


def accuracy(losses: dict, runs: dict, factor: float) -> dict:
    """Each float32 run's gaps to float64; inductor's ratios to eager's (loss gaps floored, see the docstring)
    and the verdict; aot_eager's difference to eager (0 when bit for bit)."""
    reference = runs["float64"].model
    gaps = {name: {"loss": loss_gaps(losses[name], losses["float64"]), **weight_gaps(runs[name].model, reference)}
            for name in runs if name != "float64"}
    eager, inductor = gaps["eager"], gaps["compile"]
    ratios = {"loss": [c / max(e, LOSS_FLOOR) for c, e in zip(inductor["loss"], eager["loss"])],
              "max_abs": inductor["max_abs"] / eager["max_abs"], "rel_norm": inductor["rel_norm"] / eager["rel_norm"]}
    worst = max(*ratios["loss"], ratios["max_abs"], ratios["rel_norm"])
    out = {"losses": losses, "gaps": gaps, "ratios": ratios, "worst_ratio": worst, "acceptable": worst <= factor,
           # inductor against eager float32 directly: how far the capture moves the step, beside float32's own gap
           "inductor_vs_eager": {"loss": loss_gaps(losses["compile"], losses["eager"]),
                                 **weight_gaps(runs["compile"].model, runs["eager"].model)}}
    if "aot_eager" in runs:
        out["aot_eager_vs_eager"] = {"losses_equal": losses["aot_eager"] == losses["eager"],
                                     "max_abs": weight_gaps(runs["aot_eager"].model, runs["eager"].model)["max_abs"]}
    return out


def timing(runs: dict, batch: Any, args: argparse.Namespace) -> dict:
    """The first step of each float32 run (a capture's compiles), then the median step, eager and captured."""
    timed = [name for name in ("eager", "compile") if name in runs]
    return {"first_step_s": {name: runs[name].first_s for name in ("eager", "compile", "aot_eager") if name in runs},
            "median_step_s": {name: median_step(runs[name], batch, args) for name in timed},
            "warmup": args.warmup, "timed": args.timed}


def machine(device: torch.device) -> str:
    if device.type == "cuda":  # TF32 changes float32's arithmetic on CUDA: say whether torch allows it
        return (f"{torch.cuda.get_device_name(device)}, TF32 convolutions {torch.backends.cudnn.allow_tf32}, "
                f"matmuls {torch.backends.cuda.matmul.allow_tf32}")
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def report(result: dict) -> str:
    """The tables people read."""
    losses, gaps, ratios = result["losses"], result["gaps"], result["ratios"]
    lines = [f"{result['config']} {' '.join(result['overrides'])}",
             f"device {result['device']} ({result['machine']}), torch {result['torch']}, batch "
             f"{result['batch_size']} (CAV layout {result['layout']}), {result['steps']} steps, optimizer "
             f"{result['optimizer']}", "",
             "| step | float64 loss | eager fp32: gap | inductor: gap | ratio | inductor to eager fp32 | eager fp32, "
             "CPU kernels: gap |", "|---:|---:|---:|---:|---:|---:|---:|"]
    direct, cpu = result["inductor_vs_eager"], gaps.get("eager_cpu_kernels")
    for k, exact in enumerate(losses["float64"]):
        lines.append(f"| {k + 1} | {exact:.9g} | {gaps['eager']['loss'][k]:.2e} | {gaps['compile']['loss'][k]:.2e} "
                     f"| {ratios['loss'][k]:.2f} | {direct['loss'][k]:.2e} | "
                     f"{'-' if cpu is None else format(cpu['loss'][k], '.2e')} |")
    lines += ["", f"weights after {result['steps']} steps, gap to float64:", "",
              "| run | max abs | relative norm |", "|---|---:|---:|"]
    lines += [f"| {name} | {gap['max_abs']:.2e} | {gap['rel_norm']:.2e} |" for name, gap in gaps.items()]
    lines.append(f"| ratio inductor / eager | {ratios['max_abs']:.2f} | {ratios['rel_norm']:.2f} |")
    lines.append(f"| inductor to eager fp32 | {direct['max_abs']:.2e} | {direct['rel_norm']:.2e} |")
    if "aot_eager_vs_eager" in result:
        same = result["aot_eager_vs_eager"]
        lines.append(f"\naot_eager against eager fp32: losses equal {same['losses_equal']}, largest weight "
                     f"difference {same['max_abs']:.1e}")
    verdict = "acceptable" if result["acceptable"] else "NOT acceptable"
    lines.append(f"\nverdict: {verdict}: inductor's worst gap is {result['worst_ratio']:.2f}x eager float32's "
                 f"(at most {result['factor']:g}x allowed)")
    time_ = result["timing"]
    cache = "cold compile: empty inductor cache" if result["cold_compile"] else "inductor's cache kept"
    lines += ["", f"| run | first step s ({cache}) | median step ms ({time_['timed']} after {time_['warmup']} "
                  f"warm-up) |",
              "|---|---:|---:|"]
    for name, first in time_["first_step_s"].items():
        median = time_["median_step_s"].get(name)
        lines.append(f"| {name} | {first:.1f} | {'-' if median is None else f'{1e3 * median:.1f}'} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if not args.warm_cache:  # read by inductor at each compile (torch/_inductor/runtime/cache_dir_utils.py)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory())
        result = measure(args)
    result["cold_compile"] = not args.warm_cache
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
