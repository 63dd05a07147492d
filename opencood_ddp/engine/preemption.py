"""SIGTERM / SIGINT as a request to stop at the next step boundary, not as an immediate death.

SLURM preemption and `scancel` send SIGTERM to every task (and wait KillWait, 30 s by default, before
SIGKILL); torchrun's agent forwards SIGTERM/SIGINT to its workers and waits --shutdown_timeout; Ctrl-C sends
SIGINT to the whole foreground process group. The handler only records the signal: the trainer asks all
ranks at the start of every step whether any of them got one, so they stop together, after the same step,
and rank 0 writes a resumable checkpoint. A second SIGINT on the same process means "now": it raises
KeyboardInterrupt as Python would by default.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Installed for the duration of training (`with StopSignal() as stop:`); `stop.received` is the signal's
    name once one arrived, else None."""

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received == name:
            raise KeyboardInterrupt
        self.received = self.received or name


def ignore_interrupts_in_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: Ctrl-C reaches every process of the foreground group, and a loader worker
    that died of it would break the main process's next fetch before the step boundary. SIGTERM keeps its
    default: the main process ends its workers with it when it leaves the loop (a worker ignoring it would
    hang the exit). When SLURM's SIGTERM kills the workers too, the trainer's fetch sees the stop request and
    stops at that step boundary all the same."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
