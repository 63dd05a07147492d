"""A small conv net with BatchNorm on a synthetic regression set: the engine's own test bench.

It exercises everything the DDP machinery must get right (BatchNorm statistics, gradient averaging,
accumulation, validation reduction, checkpoints) in seconds on CPU, without the perception stack. Each
sample is a pure function of (seed, split, index), so any rank or worker reads the same sample.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from opencood_ddp.engine.task import LossOutput, Task, move_tensors
from opencood_ddp.hypes import hypes_source, validate
from opencood_ddp.schema import check_known_keys

REQUIRED_KEYS = (("synthetic.num_train", "positive_int"), ("synthetic.num_validate", "positive_int"))
OPTIONAL_KEYS = (("synthetic.channels", "positive_int"), ("synthetic.image_size", "positive_int"),
                 ("synthetic.outputs", "positive_int"), ("synthetic.width", "positive_int"),
                 ("synthetic.data_seed", "int"), ("synthetic.nonfinite_samples", "list"),
                 ("synthetic.norm", "str"))
_SPLIT_OFFSET = {"train": 0, "validate": 1_000_000}


class SyntheticRegression(Dataset):
    """x: (channels, size, size) gaussian images; y: a fixed nonlinear function of x's channel statistics."""

    def __init__(self, num_samples: int, split: str, seed: int, channels: int = 3, size: int = 8,
                 outputs: int = 2, noise: float = 0.05, nonfinite: Sequence[int] = ()):
        self.num_samples, self.split, self.seed = num_samples, split, seed
        self.nonfinite = frozenset(int(i) for i in nonfinite)  # corrupt samples: an input of NaNs
        self.channels, self.size, self.noise = channels, size, noise
        teacher = torch.Generator().manual_seed(seed)
        self.weights = torch.randn(outputs, 2 * channels, generator=teacher)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(self.seed * 7919 + _SPLIT_OFFSET[self.split] + index)
        x = torch.randn(self.channels, self.size, self.size, generator=gen) * 2.0 + 0.5
        features = torch.cat([x.mean(dim=(1, 2)), (x * x).mean(dim=(1, 2)).sqrt()])
        y = torch.tanh(self.weights @ features / 4) + self.noise * torch.randn(self.weights.shape[0], generator=gen)
        if index in self.nonfinite:
            x = torch.full_like(x, math.nan)
        return {"x": x, "y": y, "index": torch.tensor(index)}


class SmallBNNet(nn.Module):
    """norm='batch' (default) or 'none': without BatchNorm, accumulation must match the full batch exactly."""

    def __init__(self, channels: int = 3, width: int = 16, outputs: int = 2, norm: str = "batch"):
        super().__init__()
        if norm not in ("batch", "none"):
            raise ValueError(f"synthetic.norm must be 'batch' or 'none', got {norm!r}")
        bn2d = nn.BatchNorm2d if norm == "batch" else (lambda width: nn.Identity())
        bn1d = nn.BatchNorm1d if norm == "batch" else (lambda width: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), bn2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False), bn2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(width, width), bn1d(width), nn.ReLU(), nn.Linear(width, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def regression_step(model: nn.Module, batch: dict) -> LossOutput:
    """Mean over the local batch of per-sample squared error: DDP's average gives the global mean."""
    pred = model(batch["x"])
    per_sample = ((pred - batch["y"]) ** 2).sum(dim=1)
    l1 = (pred - batch["y"]).abs().sum(dim=1).mean()
    return LossOutput(total=per_sample.mean(), parts={"l1": l1.detach()})


def build_task(hypes: dict, for_training: bool) -> Task:
    validate(hypes, REQUIRED_KEYS, hypes_source(hypes), OPTIONAL_KEYS)
    check_known_keys(hypes, hypes_source(hypes), extra=REQUIRED_KEYS + OPTIONAL_KEYS)
    cfg = hypes["synthetic"]
    seed = int(cfg.get("data_seed", 0))
    shape = dict(channels=cfg.get("channels", 3), size=cfg.get("image_size", 8), outputs=cfg.get("outputs", 2))
    # synthetic.nonfinite_samples: training samples made of NaNs, the bench's corrupt data (--on_nonfinite)
    train_set = (SyntheticRegression(cfg["num_train"], "train", seed, nonfinite=cfg.get("nonfinite_samples", ()),
                                     **shape) if for_training else None)
    val_set = SyntheticRegression(cfg["num_validate"], "validate", seed, **shape)
    model = SmallBNNet(shape["channels"], cfg.get("width", 16), shape["outputs"], cfg.get("norm", "batch"))
    return Task(train_set=train_set, val_set=val_set, collate_train=default_collate, collate_val=default_collate,
                model=model, step=regression_step, batch_size_of=lambda batch: int(batch["x"].shape[0]),
                move_to=move_tensors)
