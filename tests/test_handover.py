"""The engine's worker hand-over (engine/handover.py): a batch that crosses from DataLoader workers is the batch
the collate made (values, dtypes, shapes, containers), its small tensors arrive inside the pickled batch as plain
writable tensors, and the large ones, and dtypes numpy lacks, still arrive through shared memory."""
from __future__ import annotations

import pickle
import warnings

import torch
from torch.utils.data import DataLoader

from opencood_ddp.engine.handover import IN_BAND_BYTES, InBandSmallTensors

LARGE_ELEMENTS = IN_BAND_BYTES // 4 + 1  # float32: one element over the limit


def make_sample(index: int) -> dict:
    base = torch.arange(35, dtype=torch.float64).reshape(5, 7) + index
    return {
        "boxes": base,                                               # small float64
        "transposed": base.t(),                                      # a non-contiguous view
        "row": base[2],                                              # a view into a bigger storage
        "mask": base > 10,                                           # bool
        "half": base.to(torch.float16),
        "brain": base.to(torch.bfloat16),                            # numpy has no bfloat16
        "conjugate": torch.complex(base[0], base[1]).conj(),         # a conjugate view, made plain
        "voxels": torch.full((LARGE_ELEMENTS,), float(index)),       # over the limit
        "at_limit": torch.zeros(IN_BAND_BYTES // 8, dtype=torch.float64),
        "no_voxels": torch.zeros((0, 32, 4)),                        # an empty frame's voxels
        "scalar": torch.tensor(2.5 + index),                         # 0-d
        "codes": torch.arange(4, dtype=torch.uint8) + index,
        "nested": [{"ids": torch.tensor([index, 7])}, (torch.tensor(index * 1.5), "cav")],
        "count": index,
    }


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> dict:
        return make_sample(index)


def collate(samples: list) -> dict:
    """Keeps each sample's structure and stacks nothing: every tensor of every sample crosses as it is."""
    return {"samples": samples, "record_len": torch.tensor([len(samples)])}


def flat(value, path=""):
    if isinstance(value, dict):
        return [item for key, inner in value.items() for item in flat(inner, f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [(f"{path}:{type(value).__name__}", len(value))] + [
            item for number, inner in enumerate(value) for item in flat(inner, f"{path}[{number}]")]
    return [(path, value)]


def batches(workers: int) -> list:
    loader = DataLoader(Samples(), batch_size=3, num_workers=workers, collate_fn=InBandSmallTensors(collate))
    return list(loader)


def test_a_batch_from_workers_is_the_collates_batch():
    expected = [collate([make_sample(i) for i in range(start, start + 3)]) for start in (0, 3)]
    received = batches(workers=2)
    assert len(received) == len(expected) == 2
    for got, want in zip(received, expected):
        got_items, want_items = flat(got), flat(want)
        assert [path for path, _ in got_items] == [path for path, _ in want_items]
        for (path, value), (_, reference) in zip(got_items, want_items):
            if isinstance(reference, torch.Tensor):
                assert type(value) is torch.Tensor, path
                assert value.dtype == reference.dtype and value.shape == reference.shape, path
                assert torch.equal(value, reference), path
            else:
                assert value == reference and type(value) is type(reference), path


def test_small_tensors_arrive_in_band_and_writable_large_ones_through_shared_memory():
    batch = batches(workers=2)[0]
    sample = batch["samples"][0]
    for key in ("boxes", "transposed", "row", "mask", "half", "at_limit", "no_voxels", "scalar", "codes", "conjugate"):
        assert not sample[key].is_shared(), key
    assert not batch["record_len"].is_shared() and not sample["nested"][0]["ids"].is_shared()
    assert sample["voxels"].is_shared() and sample["brain"].is_shared()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a tensor is built on a read-only buffer
        sample["boxes"].add_(1.0)
        sample["mask"].logical_not_()


def test_without_workers_the_collates_objects_are_returned_untouched():
    samples = [make_sample(0), make_sample(1)]
    batch = InBandSmallTensors(collate)(samples)
    assert batch["samples"][0]["boxes"] is samples[0]["boxes"]
    assert type(batches(workers=0)[0]["samples"][0]["boxes"]) is torch.Tensor


def test_the_wrapper_pickles_for_loaders_that_spawn_workers():
    wrapper = pickle.loads(pickle.dumps(InBandSmallTensors(collate)))
    assert wrapper.collate is collate
