"""Training loaders whose workers persist over epochs (engine/loaders.py): each epoch's samples are those a loader
forked for that epoch reads, bit for bit, augmentation included, and the workers are forked once."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.loaders import EpochBatches, EpochKeyed
from test_datasets import SEED, assert_identical, flatten, toy_hypes

EPOCH_BATCHES = {0: [[0, 1], [2, 3]], 1: [[5, 2], [7, 0]], 2: [[3, 6]]}


def _record_worker(folder: Path):
    def init(worker_id: int) -> None:
        (folder / f"worker_{os.getpid()}").touch()
    return init


def test_persistent_workers_draw_each_epochs_augmentation(toy_small, tmp_path):
    """Training-mode toy AttFuse samples (flip, rotation, scaling drawn per sample and epoch) through 2
    persistent workers, against a fresh dataset set to each epoch and read in this process."""
    dataset = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    reference = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    sampler = EpochBatches()
    loader = DataLoader(EpochKeyed(dataset), batch_sampler=sampler, num_workers=2, persistent_workers=True,
                        collate_fn=InBandSmallTensors(dataset.collate_batch_train),
                        worker_init_fn=_record_worker(tmp_path))
    for epoch, batches in EPOCH_BATCHES.items():
        sampler.use(epoch, batches)
        reference.set_epoch(epoch)
        got = list(loader)
        assert len(got) == len(batches)
        for batch, indices in zip(got, batches):
            assert_identical(batch, reference.collate_batch_train([reference[i] for i in indices]))
    assert len(list(tmp_path.glob("worker_*"))) == 2  # forked once, for the first epoch


def test_the_epochs_differ_and_an_unfinished_epoch_is_left_cleanly(toy_small):
    """The key changes the draws (a loader stuck at epoch 0 would repeat them), and an epoch left after its first
    batch (--max_steps, a stop) does not leak its prefetched batches into the next."""
    dataset = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    sampler = EpochBatches()
    loader = DataLoader(EpochKeyed(dataset), batch_sampler=sampler, num_workers=2, persistent_workers=True,
                        collate_fn=InBandSmallTensors(dataset.collate_batch_train))
    sampler.use(0, [[0, 1], [2, 3], [4, 5]])
    first = next(iter(loader))
    sampler.use(1, [[0, 1]])
    again = list(loader)
    assert len(again) == 1
    left, right = flatten(first), flatten(again[0])
    differs = [k for k in left if isinstance(left[k], torch.Tensor) and left[k].shape == right[k].shape
               and not torch.equal(left[k], right[k])]
    assert differs, "epoch 1 drew epoch 0's augmentation"
