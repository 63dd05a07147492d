#!/usr/bin/env python
"""How to train a baseline's batch on your GPUs: measure, fit, and print the plan that reproduces batch_size exactly.

    python tools/plan_batch.py --hypes_yaml hypes_yaml/opv2v/point_pillar_intermediate_fusion.yaml \
        --gpus 4 --gpu_mem_gib 11 [--half] [--capture MODE] [--set root_dir=...]

It measures one training step's peak memory at per-GPU batch 1, 2, 4 (up to what one GPU can get) on this
machine's device (CUDA: `torch.cuda.max_memory_allocated`; CPU: the growth of the resident set's peak), fits
peak = fixed + per_sample x batch, and lists every split world x per-GPU batch x accumulation = batch_size with
the memory each needs. The chosen plan is the one that fits with the fewest accumulation steps; pass its
per-GPU batch to `tools/train_ddp.py --per_gpu_batch`, or let `--per_gpu_batch auto` measure and choose the
same way. `--headroom` keeps a share of each GPU free: the measure counts tensors only, not the CUDA context nor
the allocator's cache. Exit 0 with a plan, 1 when none fits (and what would), 2 on bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
from typing import Optional, Sequence

import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp.engine import batch_fit
from opencood_ddp.engine.options import train_argv, train_options_of, training_flags
from opencood_ddp.errors import ConfigError, OpencoodDdpError
from opencood_ddp.tasks import build_task
from opencood_ddp.yaml_parsers import load_parsed_hypes


def build_parser() -> argparse.ArgumentParser:
    # The training flags the measured step depends on, as tools/train_ddp.py reads them; the plan's command
    # passes them on.
    parents = [training_flags("hypes_yaml", "overrides", "half", "capture", required=("hypes_yaml",))]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=parents)
    parser.add_argument("--gpus", type=int, required=True, help="how many GPUs (processes) will train")
    parser.add_argument("--gpu_mem_gib", type=float, required=True, help="memory of one GPU, GiB")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of each GPU kept free (default 0.1)")
    parser.add_argument("--largest_probe", type=int, default=4, help="largest per-GPU batch to measure")
    parser.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the step is measured: cpu, cuda or cuda:N (default: cuda when torch sees a GPU)")
    return parser


def device_name(text: str) -> str:
    """--device: a CPU or CUDA device as torch names it (cuda:1 on a node of several GPUs)."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text


def check_args(args: argparse.Namespace) -> None:
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give at least 1")
    if not 0 < args.gpu_mem_gib < math.inf:  # nan too: it passed a '<= 0' test and planned against nan GiB
        raise ConfigError(f"--gpu_mem_gib {args.gpu_mem_gib}: give the memory of one GPU in GiB")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom}: give a share in [0, 1)")
    if args.largest_probe < 1:
        raise ConfigError(f"--largest_probe {args.largest_probe}: give the largest per-GPU batch to measure, 1 or "
                          f"more")
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ConfigError(f"--device {args.device}: torch sees no such GPU here ({torch.cuda.device_count()} "
                          f"visible); measure on the machine that will train, or pass --device cpu")


def print_probe(probe: batch_fit.Probe) -> None:
    print(f"  per-GPU batch {probe.per_rank}: peak {batch_fit.gib(probe.peak_bytes)}, step {probe.step_seconds:.2f} s",
          flush=True)


def plan_flags(args: argparse.Namespace, chosen: batch_fit.PlanOption) -> list[str]:
    """tools/train_ddp.py's flags for the chosen plan: this tool's training flags and the per-GPU batch."""
    options = train_options_of(args)
    return train_argv(dataclasses.replace(options, batch=dataclasses.replace(options.batch,
                                                                             per_gpu_batch=chosen.per_rank)))


def plan(args: argparse.Namespace) -> int:
    check_args(args)
    hypes = load_parsed_hypes(args.hypes_yaml, args.overrides)
    batch_size = int(hypes["train_params"]["batch_size"])
    capacity = args.gpu_mem_gib * batch_fit.GIB * (1 - args.headroom)
    device = torch.device(args.device)
    sizes = batch_fit.probe_sizes(batch_size, args.gpus, args.largest_probe)
    flags = ", ".join(f"--{name} {getattr(args, name)}" for name in ("half", "capture") if getattr(args, name))
    print(f"measuring {args.hypes_yaml} on {device}{f' ({flags})' if flags else ''}: per-GPU batch "
          f"{', '.join(map(str, sizes))}", flush=True)
    with hypes_lib.naming_file(hypes, hypes_lib.hypes_origin(args.hypes_yaml, args.overrides)):
        probes = batch_fit.measure(hypes, build_task, sizes, device, args.half, report=print_probe,
                                   capture=args.capture)
    model = batch_fit.fit(probes)
    found = batch_fit.options(batch_size, args.gpus, model, capacity)
    for line in batch_fit.describe(batch_size, args.gpus, model, capacity, found):
        print(line)
    chosen = batch_fit.choose(found)
    if chosen is None:
        # the answer is "none": one error line, as train_ddp's --per_gpu_batch auto says it (the table above stays
        # on stdout)
        print(f"error: no plan fits: {batch_fit.no_plan_message(batch_size, args.gpus, model, capacity)}",
              file=sys.stderr)
        return 1
    print(f"plan: {chosen.world} GPU(s) x per-GPU batch {chosen.per_rank} x {chosen.accumulation} accumulation "
          f"step(s) = batch_size {batch_size}, peak about {batch_fit.gib(chosen.predicted_bytes)} per GPU: "
          f"torchrun --nproc_per_node={chosen.world} tools/train_ddp.py {shlex.join(plan_flags(args, chosen))}")
    note = batch_fit.accumulation_note(chosen, batch_size)
    if note:
        print(note)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return plan(args)
    except OpencoodDdpError as error:  # one line, as every tool of ours
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
