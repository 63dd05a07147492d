"""Training loaders whose workers persist over epochs, and still draw each epoch's augmentation.

A DataLoader worker holds its own copy of the dataset, made when it is forked. The per-epoch state of a dataset
(``set_epoch``: the augmentation's random key, DAIR-V2X-C's ego swap) set in the main process reaches a worker only
when the worker is forked after it, which is why the trainer used to fork new workers every epoch. Here the epoch
travels with every index instead: the batch sampler yields ``(epoch, index)`` keys (`EpochBatches`), and the
dataset's wrapper (`EpochKeyed`) sets its own copy's epoch from the key before it reads the sample. The samples are
those of a loader forked for the epoch, bit for bit, and the workers are forked once per run.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

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


def worker_options(workers: int) -> dict:
    """DataLoader options of every loader a run keeps: `workers` processes that persist over the epochs and
    leave Ctrl-C to the main process."""
    return {"num_workers": workers, "worker_init_fn": ignore_interrupts_in_worker if workers else None,
            "persistent_workers": workers > 0}


def training_loader(dataset: Dataset, collate: Callable[[list], Any], workers: int, pin_memory: bool) -> DataLoader:
    """The trainer's training loader over `dataset`, with no batches yet: ``loader.batch_sampler.use(epoch,
    batches)`` sets each epoch's (gpu_check's loader check measures this same loader)."""
    return DataLoader(EpochKeyed(dataset), batch_sampler=EpochBatches(), collate_fn=InBandSmallTensors(collate),
                      pin_memory=pin_memory, **worker_options(workers))


__all__ = ["EpochKeyed", "EpochBatches", "worker_options", "training_loader"]
