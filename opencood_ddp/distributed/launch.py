"""Command lines for whatever starts training processes itself: the tools (parity check, benchmarks, demo,
gpu check) and the tests, all through `launcher_prefix`.

The processes are started the way users start them: plain `python` for one process, torchrun for more. The
training flags a tool passes on are engine/options.py's (`train_argv`): this layer knows no flag of training.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from opencood_ddp.errors import ConfigError


def launcher_prefix(nproc: int, torchrun: bool = True, *, nodes: int = 1, endpoint: Optional[str] = None,
                    run_id: str = "opencood_ddp", launcher_args: Sequence[str] = ()) -> list[str]:
    """The interpreter, under torchrun with `nproc` processes per node unless `torchrun` is False or `nproc` is 0
    (plain `python`, no launcher). One node is `--standalone`; more meet through c10d rendezvous at `endpoint`
    (host:port) under `run_id`, one such command per node. `launcher_args` go to torchrun itself."""
    if not torchrun or nproc == 0:
        return [sys.executable]
    if nodes == 1:
        where = ["--standalone"]
    elif endpoint is None:
        raise ValueError("a multi-node launch needs the rendezvous endpoint (host:port)")
    else:
        where = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}", *launcher_args]


def parse_world_sizes(text: str) -> list[int]:
    """'2,4' -> [1, 2, 4]: sorted, distinct, with the 1-process reference always in."""
    parts = [part for part in text.split(",") if part.strip()]
    wanted = f"--world_sizes {text!r}: give comma-separated integers, e.g. 1,2,4"
    if not parts:  # '' gave the reference alone, and a parity check that compared nothing passed
        raise ConfigError(wanted)
    try:
        sizes = sorted({int(part) for part in parts} | {1})
    except ValueError:
        raise ConfigError(wanted) from None
    if sizes[0] < 1:
        raise ConfigError(f"--world_sizes {text!r}: world sizes must be positive")
    return sizes

