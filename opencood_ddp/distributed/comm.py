"""Small collectives that are no-ops without a process group, so one code path serves 1 or N processes.

Every helper here is called by all ranks or by none: a rank that skips one hangs the others.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def comm_device() -> torch.device:
    """NCCL only moves CUDA tensors; gloo only CPU ones."""
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_reduce_sum(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in float64 so that sums of many per-sample losses do not drift with world size.

    Returns a CPU float64 tensor of the same length.
    """
    tensor = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1).clone()
    if is_dist():
        tensor = tensor.to(comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu()


def all_agree(flag: bool) -> bool:
    """True only when `flag` is true on every rank (a logical AND over ranks)."""
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if is_dist():
        tensor = tensor.to(comm_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


def any_rank(flag: bool) -> bool:
    """True when `flag` is true on at least one rank."""
    return not all_agree(not flag)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """The object of rank `src` on every rank (picklable objects only)."""
    if not is_dist():
        return obj
    holder = [obj if get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src, device=comm_device())
    return holder[0]


def gather_objects(obj: Any, dst: int = 0) -> Optional[list]:
    """List of every rank's object (in rank order) on `dst`; None elsewhere."""
    if not is_dist():
        return [obj]
    if dist.get_backend() == "nccl":
        # NCCL has no gather_object; all_gather_object costs the same bytes on small payloads.
        gathered: list = [None] * get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered if get_rank() == dst else None
    gathered = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
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
