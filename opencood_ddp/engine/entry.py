"""What every entry point does around its recipe: find the launcher, open the process group, report errors.

A user error (OpencoodDdpError) becomes one line on rank 0's stderr and the error's exit code; the other ranks
stay silent (they raised the same error, or follow rank 0 through ``comm.on_main_then_broadcast``). A broken
collective (CollectiveError) is told by every rank that saw it: rank 0 may be the process that died.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

from opencood_ddp.distributed.env import DistEnv, detect_from_process, distributed_session
from opencood_ddp.engine.logging import setup_logging
from opencood_ddp.errors import CollectiveError, OpencoodDdpError


def run_distributed(args: argparse.Namespace, recipe: Callable[[argparse.Namespace, DistEnv], object]) -> int:
    """``recipe(args, env)`` inside a process group; ``args`` has local_rank, dist_backend and dist_timeout."""
    env: Optional[DistEnv] = None
    try:
        env = detect_from_process(args.local_rank, args.dist_backend)
        setup_logging(env.rank)
        with distributed_session(env, args.dist_timeout):
            try:
                recipe(args, env)
            except OpencoodDdpError as exc:
                # Told before the process group is torn down: after a peer died, torchrun's agent may end
                # this process with SIGTERM during the teardown, and the reason would be lost.
                report_error(exc, env)
                exc.reported = True
                raise
    except OpencoodDdpError as exc:
        if not getattr(exc, "reported", False):
            report_error(exc, env)
        return exc.exit_code
    return 0


def report_error(exc: OpencoodDdpError, env: Optional[DistEnv]) -> None:
    """One line on rank 0's stderr (`error: ...`, `stopped: ...`); other ranks stay silent."""
    rank = env.rank if env is not None else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)
    if rank == 0 or isinstance(exc, CollectiveError):
        print(f"{exc.label}: {exc}", file=sys.stderr, flush=True)
