"""What every entry point does around its recipe: find the launcher, open the process group, report errors.

A user error (OpencoodDdpError) becomes one line on rank 0's stderr and the error's exit code; the other ranks
stay silent (they raised the same error, or follow rank 0 through ``comm.on_main_then_broadcast``). A broken
collective (CollectiveError) is told by every rank that saw it: rank 0 may be the process that died.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Optional

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import DistEnv, detect_from_process, init_distributed_mode, teardown
from opencood_ddp.engine.logs import setup_logging
from opencood_ddp.engine.options import ProcessOptions
from opencood_ddp.errors import CollectiveError, Interrupted, OpencoodDdpError


class DistributedRun:
    """The frame of every entry point: ``with DistributedRun(options.process) as run:`` the recipe, on ``run.env``;
    then ``return run.exit_code``. The first ``run.env`` detects the launcher, sets the logging up and opens the
    process group, so that a launcher's bad variable is an error of the body like any other. A project error of
    the body is told once (rank 0's line), the ranks leave together, the group is torn down, and the exit code is
    the error's; any other exception goes on up after the teardown. A context manager rather than a function
    that calls the recipe: the recipe runs in the entry point's own frame (docs/architecture.md, reading path)."""

    def __init__(self, process: ProcessOptions):
        self.process = process
        self.exit_code = 0
        self._env: Optional[DistEnv] = None

    @property
    def env(self) -> DistEnv:
        if self._env is None:
            env = detect_from_process(self.process.local_rank, self.process.dist_backend)
            setup_logging(env.rank)
            init_distributed_mode(env, self.process.dist_timeout)
            self._env = env
        return self._env

    def __enter__(self) -> "DistributedRun":
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None:
            teardown()
            return False
        if isinstance(exc, KeyboardInterrupt):  # every rank of the foreground group got it: no one to wait for
            report_error(Interrupted("interrupted (Ctrl-C); the files saved before are as they were: each is "
                                     "replaced whole or not at all"), self._env)
            teardown(synchronize=False)
            self.exit_code = Interrupted.exit_code
            return True
        if isinstance(exc, OpencoodDdpError):
            # Told before the process group is torn down: after a peer died, torchrun's agent may end this
            # process with SIGTERM during the teardown, and the reason would be lost.
            report_error(exc, self._env)
            if self._env is not None:
                leave_together(exc)
        teardown(synchronize=False)  # a peer may be gone: a barrier here could wait for the full timeout
        if isinstance(exc, OpencoodDdpError):
            self.exit_code = exc.exit_code
            return True
        return False


def run_distributed(process: ProcessOptions, recipe: Callable[[DistEnv], object]) -> int:
    """``recipe(env)`` inside the process group that ``process`` describes; returns the exit code."""
    with DistributedRun(process) as run:
        recipe(run.env)
    return run.exit_code


def leave_together(exc: OpencoodDdpError) -> None:
    """Every rank raised this error (the errors are agreed on): meet the others, then let torchrun's SIGTERM to
    the survivors of the first rank out pass unheeded, so that every rank exits with the error's own code. A
    broken collective is left at once: its peer is gone."""
    if isinstance(exc, CollectiveError):
        return
    comm.meet_before_exit()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # we are on our way out; the agent SIGKILLs a hang


def report_error(exc: OpencoodDdpError, env: Optional[DistEnv]) -> None:
    """One line on rank 0's stderr (`error: ...`, `stopped: ...`); other ranks stay silent. Told once: a recipe
    may tell it early (before a signal handler goes), and run_distributed then stays quiet."""
    if getattr(exc, "reported", False):
        return
    exc.reported = True
    rank = env.rank if env is not None else int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) or 0)
    if rank == 0 or isinstance(exc, CollectiveError):
        print(f"{exc.label}: {exc}", file=sys.stderr, flush=True)
        write_elastic_error_file(f"{exc.label}: {exc}")


def write_elastic_error_file(line: str) -> None:
    """Under torchrun, put our line where its failure summary looks (TORCHELASTIC_ERROR_FILE, the file its
    `record` decorator writes), so that the summary shows it and the rank that said it instead of 'error_file:
    <N/A>' and a signal blamed on another rank. The JSON layout is torch.distributed.elastic's."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:  # the summary is a courtesy; the line is on stderr already
        pass


@contextlib.contextmanager
def entry_sandbox(environ: Mapping[str, str]) -> Iterator[None]:
    """For a program that runs a tool's main in its own process (gpu_check's trainings, the tests' in-process
    runs): the run sees `environ`, and what it leaves behind is put back afterwards: the environment, the SIGTERM
    and SIGINT handlers (the stop signal's), and the package logger's handlers (setup_logging's)."""
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        logger = logging.getLogger("opencood_ddp")
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()

