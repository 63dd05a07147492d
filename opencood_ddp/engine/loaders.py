"""Training loaders whose workers persist over epochs, and still draw each epoch's augmentation.

A DataLoader worker holds its own copy of the dataset, made when it is forked. The per-epoch state of a dataset
(``set_epoch``: the augmentation's random key, DAIR-V2X-C's ego swap) set in the main process reaches a worker only
when the worker is forked after it, which is why the trainer used to fork new workers every epoch. Here the epoch
travels with every index instead: the batch sampler yields ``(epoch, index)`` keys (`EpochBatches`), and the
dataset's wrapper (`EpochKeyed`) sets its own copy's epoch from the key before it reads the sample. The samples are
those of a loader forked for the epoch, bit for bit, and the workers are forked once per run.

Every loader worker runs its BLAS libraries on one thread (`one_blas_thread`), as DataLoader already runs torch's.
How many workers a rank gets when --num_workers is not given is `workers_per_rank`'s rule.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Tuple

import threadpoolctl
import torch
from torch.utils.data import DataLoader, Dataset

from opencood_ddp.distributed.devices import node_processes
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.preemption import ignore_interrupts_in_worker


class EpochKeyed(Dataset):
    """`dataset` read by ``(epoch, index)``: the copy that reads (the main process's or a worker's) is set to the
    key's epoch first, where the dataset has ``set_epoch``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self._epoch: Optional[int] = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, int]) -> Any:
        epoch, index = key
        if epoch != self._epoch:
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            self._epoch = epoch
        return self.dataset[index]


class EpochBatches:
    """A batch sampler whose batches are set per epoch (`use`), yielded as ``(epoch, index)`` keys."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batches: list[list[int]] = []

    def use(self, epoch: int, batches: Sequence[Sequence[int]]) -> None:
        self.epoch, self.batches = int(epoch), [list(batch) for batch in batches]

    def __iter__(self) -> Iterator[list[Tuple[int, int]]]:
        for batch in self.batches:
            yield [(self.epoch, index) for index in batch]

    def __len__(self) -> int:
        return len(self.batches)


# The default worker count (docs/benchmarks.md, "The default worker count"). On a GPU, every core of the rank's
# share but its own process's, up to upstream OpenCOOD's 8: one worker reads about 8.5 OPV2V-size samples/s of the
# full-size AttFuse config on a core, and an H200 trains 26 (V2X-ViT) to 100 (AttFuse) samples/s. On the
# CPU the step is the slow side (0.4 against 8.5 samples/s) and a worker's core is taken from it: 2.
MAX_GPU_WORKERS = 8
CPU_WORKERS = 2


def cores_per_rank(environ: Mapping[str, str], launcher: str, world_size: int, cores: int) -> int:
    """This rank's share of the `cores` it may run on (its CPU affinity): SLURM's cores per task where the job
    asked for them (--cpus-per-task), else the cores divided among the node's ranks (one when not known)."""
    per_task = environ.get("SLURM_CPUS_PER_TASK", "").strip() if launcher == "slurm" else ""
    if per_task.isdigit() and int(per_task) > 0:
        return max(1, min(cores, int(per_task)))
    return max(1, cores // (node_processes(environ, launcher, world_size) or 1))


def default_workers(device_type: str, rank_cores: int, task_workers: Optional[int] = None) -> int:
    """Loader workers of a rank with `rank_cores` cores on `device_type`, when --num_workers is not given; on a GPU at
    most `task_workers` where the task says that many feed its step (Task.gpu_workers)."""
    if device_type != "cuda":
        return CPU_WORKERS
    return max(1, min(task_workers or MAX_GPU_WORKERS, MAX_GPU_WORKERS, rank_cores - 1))


def affinity_cores() -> int:
    """The cores this process may run on: its CPU affinity, or every core where the OS does not say."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workers_per_rank(requested: Optional[int], env: DistEnv, environ: Mapping[str, str] = os.environ,
                     task_workers: Optional[int] = None) -> int:
    """--num_workers when given, else `default_workers` for this rank's device and share of the cores (and the
    task's own need, `task_workers`)."""
    if requested is not None:
        return requested
    return default_workers(torch.device(env.device).type,
                           cores_per_rank(environ, env.launcher, env.world_size, affinity_cores()), task_workers)


def one_blas_thread(worker_id: int = 0) -> None:
    """DataLoader worker_init_fn of every loader: the BLAS libraries loaded in this process (numpy's OpenBLAS) run
    on one thread, as DataLoader runs torch's in a worker; the parallelism across samples is the workers'.

    Why: numpy's OpenBLAS otherwise keeps a pool of as many threads as the machine has cores in every worker, and
    they spin after each product (a cloud's (N, 3) @ (3, 3) pose transform). On OPV2V-size clouds one worker held
    two cores' time for one's work, and 2 workers on 2 cores read fewer samples/s than 1 (docs/benchmarks.md,
    "One BLAS thread per loader worker"). A product's bits do not depend on the thread count
    (tests/test_loaders.py)."""
    threadpoolctl.threadpool_limits(limits=1, user_api="blas")


def init_training_worker(worker_id: int) -> None:
    """worker_init_fn of the loaders a run keeps: one BLAS thread, and Ctrl-C left to the main process."""
    one_blas_thread(worker_id)
    ignore_interrupts_in_worker(worker_id)


def worker_options(workers: int, seed: int = 0) -> dict:
    """DataLoader options of every loader a run keeps: `workers` processes that persist over the epochs, each on
    one BLAS thread, leaving Ctrl-C to the main process, and a generator of the loader's own.

    Why the generator: a DataLoader draws its workers' base seed from its generator each time an iterator is made,
    from torch's global one when it has none. That draw moved the global stream the model's dropout reads, and a
    resumed run makes its iterators at other places than the uninterrupted run (mid-epoch; with persistent
    workers, at the first epoch of the resumed process), so a model with dropout did not resume bit for bit. Our
    samples' draws are keyed by sample and epoch, never by the workers' seeds; those follow the run's ``seed``
    (an out-of-tree dataset drawing from a worker's global RNG gets other draws under another --seed)."""
    return {"num_workers": workers, "worker_init_fn": init_training_worker if workers else None,
            "persistent_workers": workers > 0, "generator": torch.Generator().manual_seed(seed)}


def training_loader(dataset: Dataset, collate: Callable[[list], Any], workers: int, pin_memory: bool,
                    seed: int = 0) -> DataLoader:
    """The trainer's training loader over `dataset`, with no batches yet: ``loader.batch_sampler.use(epoch,
    batches)`` sets each epoch's (gpu_check's loader check measures this same loader)."""
    return DataLoader(EpochKeyed(dataset), batch_sampler=EpochBatches(), collate_fn=InBandSmallTensors(collate),
                      pin_memory=pin_memory, **worker_options(workers, seed))


__all__ = ["EpochKeyed", "EpochBatches", "MAX_GPU_WORKERS", "CPU_WORKERS", "cores_per_rank", "default_workers",
           "affinity_cores", "workers_per_rank", "one_blas_thread", "init_training_worker", "worker_options",
           "training_loader"]
