"""Training loaders whose workers persist over epochs, and still draw each epoch's augmentation.

A DataLoader worker holds its own copy of the dataset, made when it is forked. The per-epoch state of a dataset
(``set_epoch``: the augmentation's random key, DAIR-V2X-C's ego swap) set in the main process reaches a worker only
when the worker is forked after it, which is why the trainer used to fork new workers every epoch. Here the epoch
travels with every index instead: the batch sampler yields ``(epoch, index)`` keys (`EpochBatches`), and the
dataset's wrapper (`EpochKeyed`) sets its own copy's epoch from the key before it reads the sample. The samples are
those of a loader forked for the epoch, bit for bit, and the workers are forked once per run.

Every loader worker runs its BLAS libraries on one thread (`one_blas_thread`), as DataLoader already runs torch's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import threadpoolctl
from torch.utils.data import DataLoader, Dataset

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


def worker_options(workers: int) -> dict:
    """DataLoader options of every loader a run keeps: `workers` processes that persist over the epochs, each on
    one BLAS thread, leaving Ctrl-C to the main process."""
    return {"num_workers": workers, "worker_init_fn": init_training_worker if workers else None,
            "persistent_workers": workers > 0}


def training_loader(dataset: Dataset, collate: Callable[[list], Any], workers: int, pin_memory: bool) -> DataLoader:
    """The trainer's training loader over `dataset`, with no batches yet: ``loader.batch_sampler.use(epoch,
    batches)`` sets each epoch's (gpu_check's loader check measures this same loader)."""
    return DataLoader(EpochKeyed(dataset), batch_sampler=EpochBatches(), collate_fn=InBandSmallTensors(collate),
                      pin_memory=pin_memory, **worker_options(workers))


__all__ = ["EpochKeyed", "EpochBatches", "one_blas_thread", "init_training_worker", "worker_options",
           "training_loader"]
