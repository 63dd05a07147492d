"""Small collectives that are no-ops without a process group, so one code path serves 1 or N processes.

Every helper here is called by all ranks or by none: a rank that skips one hangs the others.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from opencood_ddp.errors import CollectiveError, first_line


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


# The control plane (step agreement, error agreement, loss sums, object gathers) runs on gloo whatever the default
# backend: gloo's collectives time out with an error this package turns into one CollectiveError line, where NCCL's
# block in the GPU stream until its watchdog aborts the process. Under NCCL it is a gloo group of every rank, made
# once when the default group is (`open_control_group`); under gloo it is the default group itself.
_control_group: Optional[Any] = None


def open_control_group(timeout: datetime.timedelta, separate: Optional[bool] = None) -> None:
    """Collective, right after init_process_group: the gloo group of the control plane, separate from the default
    group when the default backend is not gloo (`separate` forces the choice: the tests take NCCL's path on gloo)."""
    global _control_group
    if separate is None:
        separate = dist.get_backend() != "gloo"
    _control_group = dist.new_group(backend="gloo", timeout=timeout) if separate else None


def close_control_group() -> None:
    """Forget the control group (destroy_process_group destroys it with every other group)."""
    global _control_group
    _control_group = None


def control_group() -> Optional[Any]:
    """The group control collectives run on; None is the default group (gloo)."""
    return _control_group


def barrier() -> None:
    if is_dist():
        dist.barrier(group=control_group())


def all_reduce_sum(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in float64 so that sums of many per-sample losses do not drift with world size.

    Returns a CPU float64 tensor of the same length (the control plane is gloo, on the CPU).
    """
    tensor = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1).cpu().clone()
    if is_dist():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=control_group())
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """The object of rank `src` on every rank (picklable objects only)."""
    if not is_dist():
        return obj
    holder = [obj if get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src, group=control_group())
    return holder[0]


def gather_objects(obj: Any, dst: int = 0) -> Optional[list]:
    """List of every rank's object (in rank order) on `dst`; None elsewhere."""
    if not is_dist():
        return [obj]
    gathered = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=control_group())
    return gathered


def on_main_then_broadcast(fn: Callable[[], Any]) -> Any:
    """Run `fn` on rank 0 only and hand its result (or the exception it raised) to every rank.

    For fallible rank-0 work (choosing and creating a run folder): if rank 0 fails, every rank raises
    the same exception instead of waiting forever for a broadcast that never comes.
    """
    outcome: tuple[bool, Any]
    if get_rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as exc:  # re-raised below on every rank, rank 0 included
            outcome = (False, exc)
    else:
        outcome = (True, None)
    ok, value = broadcast_object(outcome)
    if not ok:
        raise value
    return value


def all_gather_objects(obj: Any) -> list:
    """Every rank's object, in rank order, on every rank."""
    if not is_dist():
        return [obj]
    gathered: list = [None] * get_world_size()
    dist.all_gather_object(gathered, obj, group=control_group())
    return gathered


def agree(local: Optional[BaseException], flags: Sequence[float] = ()) -> tuple[Optional[BaseException], list]:
    """Collective: (the error of the lowest rank that has one, or None; `flags` summed over ranks), the same on
    every rank, in one all-reduce unless some rank has an error.

    For work that can fail on one rank alone (reading a corrupt frame): each rank catches its own error, then
    all meet here, so every rank raises the same error instead of leaving the others in a collective.
    """
    totals = all_reduce_sum([0.0 if local is None else 1.0, *flags]).tolist()
    if not totals[0]:
        return None, totals[1:]
    return next(error for error in all_gather_objects(local) if error is not None), totals[1:]


def first_error(local: Optional[BaseException]) -> Optional[BaseException]:
    """Collective: `agree` without flags."""
    return agree(local)[0]


# ------------------------------------------------------------------------------------------------ failures
# Each rank publishes where it is in the rendezvous store (it outlives a dead peer's connections: torchrun's
# agent hosts it). When a collective fails, the rank that sees the failure reads the others' entries and can
# name the rank that is behind instead of printing a bare gloo/NCCL timeout.
_PHASE_KEY = "opencood_ddp/phase/{rank}"


def _store() -> Optional[Any]:
    if not is_dist():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def mark_phase(text: str) -> None:
    """Publish this rank's position ('epoch 2 step 7: data') with its host and pid, so that a peer on the same
    host can tell a dead process from a stalled one; a no-op without a process group."""
    store = _store()
    if store is not None:
        store.set(_PHASE_KEY.format(rank=get_rank()),
                  f"{time.time():.3f} {socket.gethostname()} {os.getpid()} {text}")


_PF_EXITING = 0x4  # Linux's task flag, set as the process starts to exit, before it closes its sockets


def _has_exited(pid: int) -> bool:
    """Whether the process is gone, a zombie, or exiting (Linux's /proc/<pid>/stat: the state letter after the
    command, and the task flags 6 fields later). A killed rank's peer sees its sockets close while the killed
    process is still being torn down, before it is a zombie: its state letter still reads running, so the
    exiting flag is what tells it from a stalled one."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def _process_state(host: str, pid: int) -> str:
    if host != socket.gethostname():
        return f"on {host}"
    if _has_exited(pid):
        return f"its process {pid} has exited"
    return f"its process {pid} is alive but silent (stalled)"


def peer_phases(timeout_seconds: float = 5.0) -> dict[int, str]:
    """Where every other rank said it was, with the age of that entry; best effort on a failing group."""
    store = _store()
    if store is None:
        return {}
    seen: dict[int, str] = {}
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_seconds))
        for rank in range(get_world_size()):
            key = _PHASE_KEY.format(rank=rank)
            if rank == get_rank():
                continue
            if not store.check([key]):
                seen[rank] = "never reported a position"
                continue
            stamp, host, pid, text = store.get(key).decode().split(" ", 3)
            seen[rank] = (f"last at '{text}' {time.time() - float(stamp):.1f} s ago, "
                          f"{_process_state(host, int(pid))}")
    except (RuntimeError, ValueError) as exc:  # the store's host (rank 0 or the agent) is gone too
        seen[-1] = f"the rendezvous store is unreachable ({first_line(exc)[:300]})"
    return seen


def meet_before_exit(timeout_seconds: float = 10.0) -> bool:
    """Wait, up to `timeout_seconds`, until every rank has come here (a counter in the rendezvous store, so no
    collective that a dead peer could hang). Ranks that end on the same error leave together: torchrun's agent
    ends the survivors of the first rank that exits, which would turn their exit code into a signal. Returns
    whether all came; a no-op without a process group."""
    store = _store()
    if store is None:
        return True
    try:
        store.set_timeout(datetime.timedelta(seconds=timeout_seconds))
        arrived = store.add("opencood_ddp/leaving", 1)
        deadline = time.monotonic() + timeout_seconds
        while arrived < get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add("opencood_ddp/leaving", 0)
        return arrived >= get_world_size()
    except (RuntimeError, ValueError):  # the store's host is gone
        return False


def is_collective_failure(exc: BaseException) -> bool:
    """A peer died or stalled: gloo's and NCCL's errors are RuntimeErrors that name the transport."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in (
        "gloo/", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting"))


def describe_failure(where: str, exc: BaseException) -> str:
    """One line: which rank failed where, why, and which peers are behind."""
    behind = peer_phases()
    peers = "; ".join(f"rank {rank}: {text}" if rank >= 0 else text for rank, text in sorted(behind.items()))
    return (f"rank {get_rank()}: a collective failed during '{where}' ({first_line(exc)[:300]}); {peers or 'no peer info'}"
            f". A peer process died or stalled longer than --dist_timeout: its own log and exit code say why")


@contextlib.contextmanager
def collective_guard(where: Callable[[], str]) -> Iterator[None]:
    """Turn a collective broken by a dead or stalled peer into one CollectiveError that names the ranks behind.

    `where` is called only on failure (this rank's last published phase makes a good one)."""
    try:
        yield
    except RuntimeError as exc:
        if not is_dist() or not is_collective_failure(exc):
            raise
        raise CollectiveError(describe_failure(where(), exc)) from None
