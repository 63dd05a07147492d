"""Command lines for the tools that start training processes themselves (parity check, benchmark, demo).

The processes are started the way users start them: plain `python` for one process, torchrun for more.
"""
from __future__ import annotations

import argparse
import sys

from opencood_ddp.errors import ConfigError


def launcher_prefix(nproc: int, torchrun: bool = True) -> list[str]:
    """The interpreter, under `torchrun --standalone --nproc_per_node=nproc` unless torchrun is False."""
    if not torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def parse_world_sizes(text: str) -> list[int]:
    """'2,4' -> [1, 2, 4]: sorted, distinct, with the 1-process reference always in."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()} | {1})
    except ValueError:
        raise ConfigError(f"--world_sizes {text!r}: give comma-separated integers, e.g. 1,2,4") from None
    if sizes[0] < 1:
        raise ConfigError(f"--world_sizes {text!r}: world sizes must be positive")
    return sizes


def forwarded_training_flags(args: argparse.Namespace) -> list[str]:
    """The training flags a tool passes on to every run it starts: --set, --per_gpu_batch, --seed, --half."""
    flags = [word for override in args.overrides for word in ("--set", override)]
    for name in ("per_gpu_batch", "seed"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    return flags + (["--half"] if args.half else [])
