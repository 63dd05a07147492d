#!/usr/bin/env python
"""Forward+backward time per sample and peak memory of each PointPillar config, on real toy-world batches.

Usage: python tools/benchmarks/benchmark_models.py [--configs toy/point_pillar_intermediate_fusion ...] [--batch-size 2]
                                        [--repeats 3] [--data data/toy_opv2v] [--device cpu|cuda] [--half]

Each config runs in a fresh subprocess (peak memory is a per-process high-water mark). Batches are real
training batches (labels included) read from the toy world; baseline configs (hypes_yaml/opv2v) read the same
frames with their own range and voxel settings, so the BEV grid has the baseline's size (704 x 200). One
warm-up step, then the median of ``--repeats`` timed steps of model forward + loss + backward (no optimizer
step, no data loading). Memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the growth of the
process's peak resident set (Linux VmHWM, reset before the timed steps) over the resident set before them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = ["toy/point_pillar_early_fusion", "toy/point_pillar_late_fusion",
                   "toy/point_pillar_intermediate_fusion", "toy/point_pillar_fcooper",
                   "opv2v/point_pillar_early_fusion", "opv2v/point_pillar_late_fusion",
                   "opv2v/point_pillar_intermediate_fusion", "opv2v/point_pillar_fcooper"]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="paths under hypes_yaml/, no .yaml")
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (generated when absent)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--half", action="store_true", help="autocast: fp16 on CUDA, bf16 on CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config in this process
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------- one config
def _load_batch(config: str, data: Path, batch_size: int):
    from opencood_ddp.yaml_parsers import load_parsed_hypes
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / f"{config}.yaml", split_overrides(data))
    hypes["train_params"]["seed"] = 0
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[i] for i in range(batch_size)])
    return task, batch


def run_one(config: str, args: argparse.Namespace) -> Dict[str, object]:
    from opencood_ddp.engine.memory import PeakMemory
    from opencood_ddp.engine.step import Precision

    torch.manual_seed(0)
    device = torch.device(args.device)
    task, batch = _load_batch(config, Path(args.data), args.batch_size)
    model = task.model.to(device).train()
    batch = task.move_to(batch, device)  # the task's own move (preprocess.on_device: the point work there)
    precision = Precision(args.half, device)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with precision.autocast():
            out = task.step(model, batch)
        out.total.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    step()  # warm-up: allocator, kernels, lazy inits
    model.zero_grad(set_to_none=True)
    memory = PeakMemory(device)
    memory.start()
    times = [step() for _ in range(args.repeats)]
    # CUDA: the high-water mark of tensors (weights, batch, activations, gradients); the growth of the reserved
    # bytes is 0 once the warm-up step has filled the caching allocator. CPU: the resident set's growth.
    peak = memory.peak_allocated() if device.type == "cuda" else memory.growth()
    scatter = getattr(task.model, "scatter", None)  # the pillar models' BEV grid; SECOND has none
    return {"config": config, "device": str(device), "half": args.half, "batch_size": args.batch_size,
            "grid": f"{scatter.nx} x {scatter.ny}" if scatter is not None else "-",
            "parameters": sum(p.numel() for p in model.parameters()),
            "step_s": statistics.median(times), "per_sample_s": statistics.median(times) / args.batch_size,
            "peak_mib": peak / 2 ** 20, "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------- driver
def ensure_data(data: Path) -> None:
    """The complete toy world in data, whatever its scale; the demo world is written where there is none, or where
    one was interrupted half-way (a half world would time fewer samples)."""
    from opencood_ddp.toy.writer import toy_world_in

    print(f"toy world in {data}: {toy_world_in(data, scale='demo')['scale']}", flush=True)


def run_all(args: argparse.Namespace, argv: Sequence[str]) -> List[Dict[str, object]]:
    results = []
    passthrough = [a for a in argv if a != "--configs" and a not in args.configs]
    for config in args.configs:
        command = [sys.executable, __file__, "--one", config] + passthrough
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            print(f"{config}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(format_row(results[-1]), flush=True)
    return results


def format_row(r: Dict[str, object]) -> str:
    return (f"| {r['config']} | {r['grid']} | {r['parameters'] / 1e6:.2f} M | {r['batch_size']} | "
            f"{r['step_s']:.3f} | {r['per_sample_s']:.3f} | {r['peak_mib']:.0f} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    ensure_data(Path(args.data))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"device {args.device}{', autocast' if args.half else ''}, median of {args.repeats} steps")
    print("| config | BEV grid | parameters | batch | fwd+bwd per step (s) | per sample (s) | peak memory (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    run_all(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
