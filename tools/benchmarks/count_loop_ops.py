#!/usr/bin/env python
"""What the fit loop dispatches in a training step beside the step the benchmarks count and time.

    python tools/benchmarks/count_loop_ops.py --hypes_yaml hypes_yaml/toy/point_pillar_intermediate_fusion.yaml \
        --num_workers 0 [--set train_params.batch_size=1]

The benchmarks (benchmark_models.py, gpu_check.py, count_ddp_ops.py) count and time engine/census.trainer_step: the
fit loop's guard (engine/step_guard.StepGuard), forward_backward and optimizer_step, on a batch already on the
device. A run takes Trainer._train_step, which also moves each micro-batch to the device and all-reduces the
losses and the step's flags on the control plane (the host). This tool builds the Trainer as train_ddp.py does
(under torchrun on N ranks in DDP, each rank counting its own; rank 0 prints), takes the micro-batches of its
first step, and counts the aten calls of `Trainer._train_step` on them and of census.trainer_step on the same
model, optimizer and batch (`engine/census.count_calls`: the second call of each, after one that makes the
optimizer's state). It prints both and their difference by op: what the benchmarks' figures leave out. A call
there per parameter or buffer of the model is per-step work that no benchmark sees, as the undo copy's clone of
every buffer was until 2026-12-01 (docs/benchmarks.md, "The fit loop's own calls, and the buffer copies after a
captured step's graphs").

Counted on this process's device with its own kernels: on the CPU the forward's ops are the CPU path's, and the
optimizer is the one the trainer builds for the device; both sides share them, so their difference is the loop's.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from opencood_ddp.engine.options import train_options_of, training_flags

TRAINING_FLAGS = ("hypes_yaml", "overrides", "per_gpu_batch", "seed", "half", "num_workers", "capture")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[training_flags(*TRAINING_FLAGS, required=("hypes_yaml",))])
    parser.add_argument("--json", help="also write the counts here")
    return parser


def first_step_batches(trainer) -> tuple[list, list]:
    """The micro-batches and sample indices of the trainer's first step, as its loop reads them."""
    taken: list = []
    train_step = trainer._train_step

    def take(micro_batches, indices, where):
        taken.append((micro_batches, indices))
        return train_step(micro_batches, indices, where)

    trainer._train_step = take
    try:
        next(trainer.steps(0))
    finally:
        trainer._train_step = train_step
    return taken[0]


def count(trainer) -> dict:
    """The calls of one fit-loop step and of the benchmarks' step on the same batch, by op."""
    from opencood_ddp.engine.census import count_calls, trainer_step

    micro_batches, indices = first_step_batches(trainer)
    loop = count_calls(lambda: trainer._train_step(micro_batches, indices, "counted step"))
    moved = trainer.task.move_to(micro_batches[0], trainer.device)
    benchmarked = count_calls(trainer_step(trainer.train_step, trainer.model, moved, trainer.optimizer,
                                           trainer.precision, trainer.scaler))
    difference = Counter(loop)
    difference.subtract(benchmarked)
    return {"micro_batches": len(micro_batches), "loop": sum(loop.values()),
            "benchmarked": sum(benchmarked.values()),
            "loop_only_by_op": {op: n for op, n in sorted(difference.items(), key=lambda i: (-i[1], i[0])) if n}}


def report(counts: dict, hypes_yaml: str) -> str:
    by_op = ", ".join(f"{op.removeprefix('aten::')} {n:+d}" for op, n in counts["loop_only_by_op"].items())
    return "\n".join([
        f"# {hypes_yaml}: {counts['micro_batches']} micro-batch(es) a step, aten calls per training step",
        "| step | calls |", "|---|---:|",
        f"| the fit loop's (Trainer._train_step) | {counts['loop']:,} |",
        f"| the benchmarks' (census.trainer_step, the first micro-batch) | {counts['benchmarked']:,} |",
        f"| difference: the batch's move, the control plane, further micro-batches | "
        f"{counts['loop'] - counts['benchmarked']:+,} |",
        "", f"by op: {by_op or 'none'}"])


def measure(options, args: argparse.Namespace, env) -> None:
    from opencood_ddp.engine.train import prepare_trainer
    from opencood_ddp.tasks import build_task

    logging.getLogger("opencood_ddp").setLevel(logging.WARNING)
    with prepare_trainer(options, env, build_task, with_hooks=False) as trainer:  # its workers stop at the end
        counts = count(trainer)
    if not env.is_main:
        return
    print(report(counts, args.hypes_yaml), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from opencood_ddp.engine.entry import run_distributed

    args = build_parser().parse_args(argv)
    options = train_options_of(args)
    return run_distributed(options.process, lambda env: measure(options, args, env))


if __name__ == "__main__":
    raise SystemExit(main())
