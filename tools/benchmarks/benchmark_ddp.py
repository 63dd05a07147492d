#!/usr/bin/env python
"""How training scales with the number of processes, and where the time and memory go.

    python tools/benchmarks/benchmark_ddp.py --hypes_yaml hypes_yaml/toy/point_pillar_intermediate_fusion.yaml \
        --world_sizes 1,2 --steps 20 [--set train_params.batch_size=4] [--json results.json]

The global batch is the hypes' batch_size at every world size (strong scaling: B/N per rank), trained by the
engine's own Trainer (SyncBN, DDP, accumulation) on real batches. Runs: world size 1 without a launcher (plain
`python`: the baseline), world size 1 under torchrun (a process group; one rank trains without DDP, so the
difference is what torchrun's set-up costs a step), then torchrun at each larger world size, in
DDP. Per run, over --steps timed steps after --warmup:
- step time (median) and samples/s of the global batch, speed-up and scaling efficiency against the baseline;
- data wait: the share of the step spent waiting for the DataLoader, and the loader alone (no model) in
  samples/s per rank against what the model consumes, to tell a loader bottleneck;
- peak memory per rank (CUDA: allocated by tensors; CPU: growth of the resident set) at B/N per rank.
On CPU each process gets --threads threads (default 1, as torchrun sets): one core per rank, like one GPU
per rank. The training flags (--set, --per_gpu_batch, --seed, --half, --num_workers) are tools/train_ddp.py's,
defaults included: without --num_workers each rank gets training's default loader workers; docs/benchmarks.md's
figures load inline (--num_workers 0).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from opencood_ddp.distributed.env import environ_without_launcher
from opencood_ddp.distributed.launch import launcher_prefix, parse_world_sizes
from opencood_ddp.engine.options import train_argv, train_options_of, training_flags
from opencood_ddp.errors import OpencoodDdpError

REPO = Path(__file__).resolve().parents[2]


# The training flags of the timed runs, as tools/train_ddp.py reads them.
TRAINING_FLAGS = ("hypes_yaml", "overrides", "per_gpu_batch", "seed", "half", "num_workers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[training_flags(*TRAINING_FLAGS, required=("hypes_yaml",))])
    parser.add_argument("--world_sizes", default="1,2", help="comma-separated; 1 is always measured")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, lazy inits)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)  # set by the driver: run as a worker
    return parser


# --------------------------------------------------------------------------------------------- worker side
def worker(args: argparse.Namespace) -> int:
    """One process of one run, started by the driver (plain or under torchrun)."""
    from opencood_ddp.engine.entry import run_distributed

    options = train_options_of(args)
    return run_distributed(options.process, lambda env: measure(options, args, env))


def measure(options, args: argparse.Namespace, env) -> None:
    """Train warmup + steps with the engine's Trainer, set up as train_ddp.py's (its run folder decided, never
    made); rank 0 writes every rank's figures to --worker_out."""
    from opencood_ddp.distributed import comm
    from opencood_ddp.engine.train import prepare_trainer
    from opencood_ddp.tasks import build_task

    logging.getLogger("opencood_ddp").setLevel(logging.WARNING)
    with prepare_trainer(options, env, build_task, with_hooks=False) as trainer:  # its workers stop at the end
        plan = trainer.plan
        loader_rate = loader_samples_per_second(trainer, args.steps * plan.accumulation)
        measured = timed_steps(trainer, args.warmup, args.steps)
    result = dict(measured, rank=env.rank, loader_samples_per_s=loader_rate, device=device_name(env.device),
                  per_rank=plan.per_rank, accumulation=plan.accumulation, global_batch=plan.global_batch,
                  launcher=env.launcher, ddp=trainer.ddp, world_size=env.world_size, workers=trainer.workers)
    gathered = comm.gather_objects(result)
    if env.is_main:
        Path(args.worker_out).write_text(json.dumps(gathered))


def loader_samples_per_second(trainer, batches: int) -> float:
    """The DataLoader alone, as the trainer builds it (same sampler, collate, workers): samples/s per rank."""
    iterator = iter(trainer.train_loader(0))
    available = len(trainer.batch_sampler) - 1
    if available < 1:
        return float("nan")
    next(iterator)  # worker start-up and first-touch costs are not throughput
    count = min(batches, available)
    started = time.perf_counter()
    samples = sum(trainer.task.batch_size_of(next(iterator)) for _ in range(count))
    return samples / (time.perf_counter() - started)


def timed_steps(trainer, warmup: int, steps: int) -> dict:
    from opencood_ddp.engine.memory import PeakMemory

    memory = PeakMemory(trainer.device)
    records, epoch = [], 0
    if warmup == 0:
        memory.start()
    while len(records) < warmup + steps:
        for record in trainer.steps(epoch):  # every rank breaks at the same count: collectives stay matched
            records.append(record)
            if len(records) == warmup:
                memory.start()
            if len(records) == warmup + steps:
                break
        epoch += 1
    timed = records[warmup:]
    return {"step_seconds": [r.seconds for r in timed], "data_seconds": [r.data_seconds for r in timed],
            "peak_bytes": memory.peak(), "growth_bytes": memory.growth()}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


# --------------------------------------------------------------------------------------------- driver side
def worker_command(world: int, torchrun: bool, args: argparse.Namespace, out: Path) -> list[str]:
    return launcher_prefix(world, torchrun=torchrun) + [
        str(Path(__file__).resolve()), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--worker_out", str(out), *train_argv(train_options_of(args))]


def run(world: int, torchrun: bool, args: argparse.Namespace, scratch: Path) -> list[dict]:
    out = scratch / f"world{world}_{'torchrun' if torchrun else 'plain'}.json"
    environ = dict(environ_without_launcher(os.environ), OMP_NUM_THREADS=str(args.threads))
    label = f"world size {world}" + (" (torchrun)" if torchrun else " (plain python)")
    print(f"{label}: running {args.warmup} + {args.steps} steps ...", flush=True)
    result = subprocess.run(worker_command(world, torchrun, args, out), env=environ, cwd=REPO, capture_output=True,
                            text=True)
    if result.returncode != 0 or not out.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-15:]
        raise SystemExit(f"error: the {label} run failed (exit {result.returncode}):\n" + "\n".join(tail))
    return json.loads(out.read_text())


def summarise(ranks: list[dict], baseline_step: Optional[float]) -> dict:
    first = ranks[0]
    step = max(statistics.median(r["step_seconds"]) for r in ranks)
    data_share = max(sum(r["data_seconds"]) / sum(r["step_seconds"]) for r in ranks)
    consumed = first["per_rank"] * first["accumulation"] / step  # samples/s each rank's model takes in
    speedup = baseline_step / step if baseline_step else 1.0
    return {"world_size": first["world_size"], "launcher": first["launcher"], "ddp": first["ddp"],
            "per_rank": first["per_rank"],
            "accumulation": first["accumulation"], "global_batch": first["global_batch"], "step_s": step,
            "samples_per_s": first["global_batch"] / step, "speedup": speedup,
            "efficiency": speedup / first["world_size"], "data_wait": data_share,
            "loader_samples_per_s": min(r["loader_samples_per_s"] for r in ranks),
            "model_samples_per_s": consumed,
            "peak_mib": max(r["peak_bytes"] for r in ranks) / 2 ** 20,
            "growth_mib": max(r["growth_bytes"] for r in ranks) / 2 ** 20, "device": first["device"],
            "workers": first["workers"]}


def table(rows: list[dict]) -> str:
    lines = ["| world | launcher | DDP | per-rank batch | step (s) | samples/s | speed-up | efficiency | data wait | "
             "loader alone / model, per rank (samples/s) | peak mem per rank (MiB) | growth (MiB) |",
             "|---:|---|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        batch = f"{r['per_rank']}" + (f" x {r['accumulation']} acc" if r["accumulation"] > 1 else "")
        lines.append(f"| {r['world_size']} | {r['launcher']} | {'yes' if r['ddp'] else 'no'} | {batch} | "
                     f"{r['step_s']:.3f} | {r['samples_per_s']:.1f} | {r['speedup']:.2f} | "
                     f"{100 * r['efficiency']:.0f}% | {100 * r['data_wait']:.0f}% | {r['loader_samples_per_s']:.1f} / "
                     f"{r['model_samples_per_s']:.1f} | {r['peak_mib']:.0f} | {r['growth_mib']:.0f} |")
    return "\n".join(lines)


def bottleneck(row: dict) -> str:
    """Is the loader the bottleneck? The loader alone against what the model consumes, and the wait."""
    headroom = row["loader_samples_per_s"] / row["model_samples_per_s"]
    wait = f"{100 * row['data_wait']:.0f}% of the step waits for data"
    if headroom < 1:
        return f"loader-bound: {wait}; the loader alone is {headroom:.1f}x the model's pace, add --num_workers"
    if row["data_wait"] > 0.1 and row["workers"] == 0:
        return (f"model-bound, but {wait}: with 0 workers loading runs inline; the loader alone is "
                f"{headroom:.1f}x the model's pace, so workers would hide it")
    if row["data_wait"] > 0.1:
        return f"partly loader-bound: {wait} although the loader alone is {headroom:.1f}x the model's pace"
    return f"model-bound: {wait}"


def verdicts(rows: list[dict]) -> list[str]:
    plain, launched = rows[0], rows[1]
    out = [f"torchrun at world size 1: {100 * (launched['step_s'] / plain['step_s'] - 1):+.1f}% step time "
           f"({plain['step_s']:.3f} s plain python, {launched['step_s']:.3f} s under torchrun; one rank runs no "
           "DDP)",
           f"world size 1: {bottleneck(plain)}"]
    for r in rows[2:]:
        out.append(f"world size {r['world_size']}: {r['speedup']:.2f}x the baseline ({100 * r['efficiency']:.0f}% "
                   f"efficiency); {bottleneck(r)}; peak memory per rank {r['peak_mib']:.0f} MiB at "
                   f"batch {r['per_rank']} vs {plain['peak_mib']:.0f} MiB at 1 x {plain['per_rank']}")
    return out


def worker_counts(rows: list[dict]) -> str:
    """The runs' loader workers per process: --num_workers, or the engine's default, which on a GPU depends on
    the world size ('2' or '7/3')."""
    return "/".join(str(count) for count in dict.fromkeys(row["workers"] for row in rows))


def driver(args: argparse.Namespace) -> int:
    try:
        worlds = parse_world_sizes(args.world_sizes)[1:]  # world size 1 is measured twice, below
    except OpencoodDdpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    with tempfile.TemporaryDirectory(prefix="benchmark_ddp_") as scratch:
        plain = summarise(run(1, False, args, Path(scratch)), None)
        rows = [plain] + [summarise(run(world, True, args, Path(scratch)), plain["step_s"])
                          for world in [1] + worlds]
    print(f"\n{args.hypes_yaml}: global batch {plain['global_batch']}, {args.steps} timed steps after "
          f"{args.warmup}, {worker_counts(rows)} loader worker(s) and {args.threads} thread(s) per process; "
          f"device {plain['device']}, {os.cpu_count()} CPU cores")
    print(table(rows))
    print("\n".join(verdicts(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return worker(args) if args.worker_out else driver(args)


if __name__ == "__main__":
    sys.exit(main())
