#!/usr/bin/env python
"""What giving never-used parameters upstream's grad None costs per training step: DDP's find_unused_parameters
against the engine's used-group flags.

    python tools/benchmarks/benchmark_unused_params.py --hypes_yaml hypes_yaml/toy/point_pillar_v2xvit.yaml --nproc 2 \
        --steps 30 --set root_dir=DATA/train --set validate_dir=DATA/validate --set test_dir=DATA/test

Each rank builds the task once per way and trains the three Trainers side by side, one step of each in turn
(the order rotating every round), so that the load of a shared machine falls on the three alike:
- `none`: nothing dropped (the engine before issue 27): parameters that ran on empty inputs get zero gradients;
- `find_unused`: DDP's find_unused_parameters=True, which walks the autograd graph after every forward and
  all-reduces a bitmap of the parameters used: what a model that skips its unused layers would need;
- `flags`: the engine's way (Task.parameter_use): the model records the groups it used, the record travels in
  the step's loss all-reduce, and the groups no rank used get grad None before the optimizer step.
Per way: the median step time (the slowest rank's, step by step), its quartiles, and the step-by-step ratio to
`none` (the three ways see the same batches in the same order, so the ratio pairs like with like).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from opencood_ddp.distributed.env import environ_without_launcher
from opencood_ddp.distributed.launch import launcher_prefix
from opencood_ddp.engine.options import train_argv, train_options_of, training_flags

WAYS = ("none", "find_unused", "flags")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[training_flags("hypes_yaml", "overrides", required=("hypes_yaml",))])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each way")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each way first")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--json", help="also write the step times here")
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)  # set by the driver: run as a worker
    return parser


# --------------------------------------------------------------------------------------------- worker side
def worker(args: argparse.Namespace) -> int:
    from opencood_ddp.engine.entry import run_distributed
    from opencood_ddp.engine.options import ProcessOptions

    # The training flags given; no loader workers: the step is timed.
    options = dataclasses.replace(train_options_of(args), process=ProcessOptions(num_workers=0))
    return run_distributed(options.process, lambda env: measure(options, args, env))


def build_trainer(way: str, options, env):
    """The engine's Trainer of one way, set up as train_ddp.py's (the same seed, so the same initial weights for
    every way): find_unused_parameters through the hypes, as a user sets it, and the task's parameter-use record
    only for `flags`."""
    from opencood_ddp.engine.train import prepare_trainer
    from opencood_ddp.tasks import build_task

    def build_task_of_way(hypes: dict, for_training: bool):
        task = build_task(hypes, for_training=for_training)
        return task if way == "flags" else dataclasses.replace(task, parameter_use=None)

    find_unused = f"train_params.find_unused_parameters={way == 'find_unused'}"
    options = dataclasses.replace(options, run=dataclasses.replace(
        options.run, overrides=(*options.run.overrides, find_unused)))
    return prepare_trainer(options, env, build_task_of_way, with_hooks=False)


def endless_steps(trainer):
    """The trainer's step records, epoch after epoch."""
    epoch = 0
    while True:
        yield from trainer.steps(epoch)
        epoch += 1


def measure(options, args: argparse.Namespace, env) -> None:
    from opencood_ddp.distributed import comm

    logging.getLogger("opencood_ddp").setLevel(logging.WARNING)
    seconds = {way: [] for way in WAYS}
    steps = {way: endless_steps(build_trainer(way, options, env)) for way in WAYS}
    for round_ in range(args.warmup + args.steps):
        order = WAYS[round_ % len(WAYS):] + WAYS[:round_ % len(WAYS)]  # every way in every place alike
        for way in order:  # every rank in the same order: the collectives of the three stay matched
            record = next(steps[way])
            if round_ >= args.warmup:
                seconds[way].append(record.seconds)
    gathered = comm.gather_objects(seconds)
    if env.is_main:
        slowest = {way: [max(rank[way][k] for rank in gathered) for k in range(args.steps)] for way in WAYS}
        Path(args.worker_out).write_text(json.dumps(slowest))


# --------------------------------------------------------------------------------------------- driver side
def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def table(seconds: dict) -> str:
    """Per way: the step times, and the step-by-step ratio to `none`. Every way trains from the same seed, so
    round k gives the three the same batch: the paired ratio takes out how much batches differ in cost."""
    lines = ["| way | median step (s) | quartiles (s) | paired ratio to none: median (quartiles) |",
             "|---|---:|---:|---:|"]
    for way in WAYS:
        q1, median, q3 = quartiles(seconds[way])
        r1, ratio, r3 = quartiles([t / base for t, base in zip(seconds[way], seconds["none"])])
        lines.append(f"| {way} | {median:.4f} | {q1:.4f} - {q3:.4f} | {ratio:.3f} ({r1:.3f} - {r3:.3f}) |")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="benchmark_unused_") as scratch:
        out = Path(scratch) / "seconds.json"
        cmd = launcher_prefix(args.nproc) + [
            str(Path(__file__).resolve()), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--worker_out", str(out), *train_argv(train_options_of(args))]
        environ = dict(environ_without_launcher(os.environ), OMP_NUM_THREADS=str(args.threads))
        result = subprocess.run(cmd, env=environ, capture_output=True, text=True)
        if result.returncode != 0 or not out.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-15:]
            print(f"error: the {args.nproc}-rank run failed (exit {result.returncode}):\n" + "\n".join(tail),
                  file=sys.stderr)
            return result.returncode or 1
        seconds = json.loads(out.read_text())
    print(f"{args.hypes_yaml}: {args.nproc} ranks, {args.steps} timed steps of each way after {args.warmup}, "
          f"round-robin; {args.threads} thread(s) per process, {os.cpu_count()} CPU cores")
    print(table(seconds))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "seconds": seconds}, indent=1))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return worker(args) if args.worker_out else driver(args)


if __name__ == "__main__":
    sys.exit(main())
