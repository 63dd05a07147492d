"""Which GPU a rank uses: a pure function of the launcher's environment and the number of GPUs the process sees.

Three layouts reach a rank, and the environment tells them apart:

- **every GPU of the node visible** (torchrun, or srun without a GPU binding): rank ``local_rank`` takes
  ``cuda:<local_rank>``, so there must be at least as many GPUs as processes on the node;
- **one GPU (or a few) bound per task** (``srun --gpus-per-task=1``, ``--gpu-bind=single:1``, ``map_gpu``...):
  each process sees only its own, so it takes ``cuda:0`` whatever its local rank. SLURM says so with
  ``SLURM_GPUS_PER_TASK`` or ``SLURM_GPU_BIND``, or by listing more GPUs for the step (``SLURM_STEP_GPUS``,
  ``SLURM_JOB_GPUS``) than the process sees;
- **several ranks on one GPU on purpose** (``OPENCOOD_DDP_SHARE_GPUS=1``, over gloo: NCCL refuses two ranks on
  one device), as tools/gpu_check.py runs 2 ranks on its one GPU.

More processes on a node than GPUs, with none of these, is a mistake: every rank of the node refuses with the same
line (none is left waiting in the rendezvous for a peer that failed).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from opencood_ddp.errors import ConfigError

SHARE_GPUS_VARIABLE = "OPENCOOD_DDP_SHARE_GPUS"


@dataclass(frozen=True)
class DeviceChoice:
    """device: ``cuda:<i>`` or ``cpu``. processes_on_device: the ranks of this node that use that device (what a
    memory plan divides the device by)."""

    device: str
    processes_on_device: int


def node_processes(environ: Mapping[str, str], launcher: str, world_size: int) -> Optional[int]:
    """How many processes of this job run on this node, or None when the launcher does not say."""
    if launcher == "single":
        return 1
    if launcher in ("torchrun", "launch"):
        return _digits(environ.get("LOCAL_WORLD_SIZE"))
    if launcher == "slurm":
        counts = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
        node = _digits(environ.get("SLURM_NODEID"))
        if counts and node is not None and node < len(counts):
            return counts[node]
        return _digits(environ.get("SLURM_NTASKS_PER_NODE"))
    return None


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM's compressed task counts per node: '4(x2),3' -> [4, 4, 3]; anything else -> []."""
    counts: list[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _digits(value: Optional[str]) -> Optional[int]:
    return int(value) if value is not None and value.strip().isdigit() else None


def slurm_step_gpus(environ: Mapping[str, str]) -> Optional[int]:
    """How many GPUs SLURM gave the step (or the job) on this node, from its id lists; None when it does not say."""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = [part for part in environ.get(key, "").split(",") if part.strip()]
        if ids:
            return len(ids)
    return None


def slurm_binds_gpus(environ: Mapping[str, str], visible: int) -> bool:
    """True when SLURM gave each task its own GPUs: asked for (--gpus-per-task, --gpu-bind other than none), or
    seen (the step holds more GPUs on this node than this process sees)."""
    if environ.get("SLURM_GPUS_PER_TASK", "").strip():
        return True
    bind = environ.get("SLURM_GPU_BIND", "").strip().lower()
    if bind and not bind.startswith("none"):
        return True
    step_gpus = slurm_step_gpus(environ)
    return step_gpus is not None and step_gpus > visible


def choose_cuda_device(local_rank: int, processes: Optional[int], visible: Optional[int],
                       environ: Mapping[str, str], launcher: str, backend: str) -> DeviceChoice:
    """The GPU of the rank with `local_rank` among `processes` on its node (None: unknown), where the process sees
    `visible` GPUs (None: unknown, as in a test's pretended GPU machine; nothing is checked)."""
    if visible is None:
        return DeviceChoice(f"cuda:{local_rank}", 1)
    if visible < 1:
        raise ConfigError("CUDA is available but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                          f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); fix CUDA_VISIBLE_DEVICES or the "
                          f"launcher's GPU request")
    if launcher == "slurm" and slurm_binds_gpus(environ, visible) and (processes is None or processes > visible):
        return _bound_per_task(processes, environ, backend)
    ranks_here = processes if processes is not None else local_rank + 1  # unknown: at least this many
    if ranks_here <= visible:
        return DeviceChoice(f"cuda:{local_rank}", 1)
    _check_sharing_asked(environ, backend, _too_many(ranks_here, processes is not None, visible, environ))
    index = local_rank % visible
    return DeviceChoice(f"cuda:{index}", len(range(index, ranks_here, visible)))


def _bound_per_task(processes: Optional[int], environ: Mapping[str, str], backend: str) -> DeviceChoice:
    """SLURM bound GPUs per task: this task's first visible GPU is its own, unless the step holds fewer GPUs on the
    node than tasks (--gpu-bind=single:2 puts two tasks on each), which is sharing."""
    step_gpus = slurm_step_gpus(environ)
    if processes is None or step_gpus is None or processes <= step_gpus:
        return DeviceChoice("cuda:0", 1)
    _check_sharing_asked(environ, backend, f"SLURM binds the {processes} tasks of this node to {step_gpus} GPU(s), "
                                           f"so several tasks share one")
    return DeviceChoice("cuda:0", math.ceil(processes / step_gpus))


def _too_many(processes: int, known: bool, visible: int, environ: Mapping[str, str]) -> str:
    shown = environ.get("CUDA_VISIBLE_DEVICES")
    return (f"this node runs {'' if known else 'at least '}{processes} processes of the job but each sees the same "
            f"{visible} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""))


def _check_sharing_asked(environ: Mapping[str, str], backend: str, why: str) -> None:
    """Several ranks on one GPU: only when asked for, and over gloo."""
    if environ.get(SHARE_GPUS_VARIABLE) != "1":
        raise ConfigError(f"{why}: start at most one process per GPU (torchrun --nproc_per_node, srun "
                          f"--ntasks-per-node), or under SLURM give each task its own GPU (srun --gpus-per-task=1); "
                          f"to share GPUs on purpose set {SHARE_GPUS_VARIABLE}=1 with --dist_backend gloo")
    if backend != "gloo":
        raise ConfigError(f"{SHARE_GPUS_VARIABLE}=1 puts several ranks on one GPU, which NCCL refuses; add "
                          f"--dist_backend gloo")
