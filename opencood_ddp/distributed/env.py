"""Who am I in the job: detection of the launcher from an environ mapping, and process-group set-up.

`detect_dist_env` is a pure function of (environ, --local_rank argument, CUDA availability, visible GPU count) so
that every launcher and GPU layout can be tested from a table of environments. `init_distributed_mode` is the only
place that touches torch.distributed's initialisation, and `distributed_session` pairs it with the teardown.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.devices import DeviceChoice, choose_cuda_device, node_processes
from opencood_ddp.errors import ConfigError

LAUNCHERS = ("torchrun", "launch", "slurm", "single")


@dataclass(frozen=True)
class DistEnv:
    """The distributed state of this process, as one immutable value.

    rank: global rank in [0, world_size). local_rank: rank within this node. device: this rank's device
    (distributed/devices.py). processes_on_device: the ranks of this node that use the same device (one per GPU,
    unless GPUs are shared on purpose; on the CPU every rank of the node). launcher: one of LAUNCHERS.
    master_addr/master_port: rendezvous for SLURM (torchrun uses env://).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str = "gloo"
    launcher: str = "single"
    device: str = "cpu"
    processes_on_device: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is (to be) initialised: any launcher but a plain `python` run."""
        return self.launcher != "single"

    def describe(self) -> str:
        return (f"world_size={self.world_size} rank={self.rank} local_rank={self.local_rank} "
                f"backend={self.backend} launcher={self.launcher} device={self.device}")


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {key}={value!r} is not an integer; "
                          f"fix the launcher command or unset it") from None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, e.g. 'gpu[01-03,07],cpu5' -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Written here instead of calling `scontrol show hostnames` so that detection needs no SLURM binary.
    """
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            width = len(lo)  # keep zero padding: node[01-03] -> node01
            hosts.extend(f"{prefix}{n:0{width}d}" for n in range(int(lo), int(hi) + 1))
    return hosts


def _slurm_master_port(environ: Mapping[str, str]) -> int:
    """A port every task of one job agrees on without talking: derived from the job id."""
    if "MASTER_PORT" in environ:
        return _int(environ, "MASTER_PORT")
    job_id = environ.get("SLURM_JOB_ID", "0")
    digits = re.sub(r"\D", "", job_id) or "0"
    # The step id keeps two concurrent srun steps of one job (on the same nodes) apart.
    step = re.sub(r"\D", "", environ.get("SLURM_STEP_ID", "0")) or "0"
    return 20000 + (int(digits[-4:]) + int(step)) % 10000


def _slurm_env(environ: Mapping[str, str]) -> dict:
    master_addr = environ.get("MASTER_ADDR")
    if not master_addr:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST") or ""
        hosts = expand_slurm_nodelist(nodelist)
        if not hosts:
            raise ConfigError("SLURM launch without MASTER_ADDR and without SLURM_NODELIST; "
                              "export MASTER_ADDR=<first node> before srun")
        master_addr = hosts[0]
    return dict(rank=_int(environ, "SLURM_PROCID"), world_size=_int(environ, "SLURM_STEP_NUM_TASKS"),
                local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
                launcher="slurm", master_addr=master_addr, master_port=_slurm_master_port(environ))


def _torchrun_env(environ: Mapping[str, str], local_rank_arg: Optional[int]) -> dict:
    # torchrun exports LOCAL_RANK; the legacy torch.distributed.launch passes --local_rank instead.
    if "LOCAL_RANK" in environ:
        local_rank = _int(environ, "LOCAL_RANK")
    elif local_rank_arg is not None:
        local_rank = local_rank_arg
    else:
        local_rank = 0
    # torch.distributed.launch runs on torchelastic too (TORCHELASTIC_RUN_ID is set); what tells it apart is the
    # --local_rank argument it passes when not given --use-env.
    launcher = "launch" if local_rank_arg is not None or "TORCHELASTIC_RUN_ID" not in environ else "torchrun"
    return dict(rank=_int(environ, "RANK"), world_size=_int(environ, "WORLD_SIZE"),
                local_rank=local_rank, launcher=launcher)


def detect_dist_env(environ: Mapping[str, str], local_rank_arg: Optional[int] = None,
                    cuda_available: Optional[bool] = None, backend: Optional[str] = None,
                    cuda_count: Optional[int] = None) -> DistEnv:
    """Detect rank, local rank and world size: torchrun/launch, then SLURM, else a single process."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if "RANK" in environ and "WORLD_SIZE" in environ:
        fields = _torchrun_env(environ, local_rank_arg)
    elif "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        # Only an srun job step sets SLURM_STEP_NUM_TASKS. A batch script also has SLURM_PROCID=0 and the
        # allocation's SLURM_NTASKS, but it is one process: taking it for rank 0 of N would wait for ranks
        # that never start.
        fields = _slurm_env(environ)
    else:
        fields = dict(rank=0, world_size=1, local_rank=0, launcher="single")
    if not 0 <= fields["rank"] < fields["world_size"]:
        raise ConfigError(f"rank {fields['rank']} is outside world size {fields['world_size']}; "
                          f"check the launcher's RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_STEP_NUM_TASKS)")
    chosen_backend = backend or ("nccl" if cuda_available else "gloo")
    processes = node_processes(environ, fields["launcher"], fields["world_size"])
    if cuda_available:
        if cuda_count is None and torch.cuda.is_available():
            cuda_count = torch.cuda.device_count()
        choice = choose_cuda_device(fields["local_rank"], processes, cuda_count, environ, fields["launcher"],
                                    chosen_backend)
    else:  # the ranks of a node share its memory
        choice = DeviceChoice("cpu", processes if processes is not None else fields["world_size"])
    return DistEnv(backend=chosen_backend, device=choice.device, processes_on_device=choice.processes_on_device,
                   **fields)


def init_distributed_mode(env: DistEnv, timeout_minutes: float = 30.0) -> None:
    """Initialise the process group for `env` (nothing for a single process) and pin the CUDA device."""
    if env.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(env.device))
    if not env.distributed or dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    kwargs: dict = {}
    if env.launcher == "slurm":
        kwargs["init_method"] = f"tcp://{env.master_addr}:{env.master_port}"
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs["store"] = _agent_store_of_this_attempt(timeout)
    else:
        kwargs["init_method"] = "env://"
    if env.device.startswith("cuda"):
        # Binds NCCL to this rank's GPU eagerly, so a wrong local_rank fails here and not in a collective.
        kwargs["device_id"] = torch.device(env.device)
    dist.init_process_group(backend=env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            **kwargs)
    comm.open_control_group(timeout)


def _agent_store_of_this_attempt(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's agent store, seen through a prefix per restart attempt.

    The agent keeps one store for all attempts of a job. With env:// the restarted workers of
    `torchrun --max-restarts` find the first attempt's process-group keys still there (the dead workers'
    addresses) and wait in init_process_group forever; a prefix per TORCHELASTIC_RESTART_COUNT gives each
    attempt clean keys."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"opencood_ddp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown(synchronize: bool = True) -> None:
    """Destroy the process group. On a normal exit all ranks meet first, and unreachable DDP wrappers are
    collected before the group goes: a gloo group still referenced by a DDP reducer at interpreter shutdown
    aborts the process ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            comm.barrier()
        gc.collect()
        comm.close_control_group()
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_session(env: DistEnv, timeout_minutes: float = 30.0) -> Iterator[DistEnv]:
    """Process group alive for the body, destroyed at exit whatever happens."""
    init_distributed_mode(env, timeout_minutes)
    try:
        yield env
    except BaseException:
        teardown(synchronize=False)  # a peer may be gone: a barrier here could wait for the full timeout
        raise
    teardown()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environ_without_launcher(environ: Mapping[str, str]) -> dict:
    """`environ` minus what a launcher set (torchrun's, SLURM's), for a tool that starts its own launcher:
    run from inside an srun step or a torchrun worker, its children must not take those for their own."""
    return {key: value for key, value in environ.items()
            if key not in LAUNCHER_VARIABLES and not key.startswith(("SLURM_", "TORCHELASTIC_"))}


def detect_from_process(local_rank_arg: Optional[int] = None, backend: Optional[str] = None) -> DistEnv:
    return detect_dist_env(os.environ, local_rank_arg, backend=backend)
