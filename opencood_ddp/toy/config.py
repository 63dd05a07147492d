"""The knobs of a toy data set: its splits, its LiDAR and its sizes, with the two presets used here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from opencood_ddp.errors import ConfigError

SPLITS: Tuple[str, ...] = ("train", "validate", "test")
_SPLIT_KEYS = {"train": "root_dir", "validate": "validate_dir", "test": "test_dir"}  # the hypes key of each split


def split_overrides(root) -> List[str]:
    """The hypes overrides (``key=value``, as ``--set`` takes them) that point a config at the splits of the toy
    world, or of its V2V4Real-layout copy, in the folder ``root``."""
    return [f"{_SPLIT_KEYS[split]}={Path(root) / split}" for split in SPLITS]


def split_set_flags(root) -> List[str]:
    """``split_overrides(root)`` as the command-line flags a tool takes: ``--set key=value`` for each."""
    return [word for override in split_overrides(root) for word in ("--set", override)]


# The flat ground plane of the map and world frames: vehicles stand on it, rays that miss every box end on it.
GROUND_Z = 0.0


@dataclass(frozen=True)
class LidarConfig:
    """A rotating multi-beam LiDAR, mounted level on the roof (roll = pitch = 0)."""

    beams: int = 32
    fov_up_deg: float = 2.0
    fov_down_deg: float = -25.0
    azimuth_steps: int = 1024
    max_range_m: float = 80.0
    range_noise_std_m: float = 0.02
    dropout: float = 0.05
    intensity_noise_std: float = 0.02
    mount_height_m: float = 1.9


@dataclass(frozen=True)
class RsuConfig:
    """A road-side unit (V2XSet's infrastructure): a static LiDAR on a pole at a corner of the junction.

    It carries the CAVs' LiDAR model, level as theirs, at ``mount_height_m`` above the ground. V2XSet's RSUs were
    placed with OpenCDA, which mounts an RSU's LiDAR at the RSU's spawn point (3 m above the road in its V2X
    data-dump example); roadside poles are a few metres tall. 5 m is well above every toy vehicle (at most
    2.4 m tall), so a van next to the RSU hides far less of the junction than from 3 m, and the toy LiDAR's
    -25 degree lower beam still meets the ground 11 m out. The folder is named by ``rsu_id``, negative as
    V2XSet's.
    """

    mount_height_m: float = 5.0
    rsu_id: int = -1


SCALES = ("small", "demo", "dense")  # ToyWorldConfig.preset's names


@dataclass(frozen=True)
class ToyWorldConfig:
    """Sizes and knobs of one toy data set; `preset(scale)` gives those used here (SCALES)."""

    train_scenarios: int = 2
    validate_scenarios: int = 1
    test_scenarios: int = 1
    frames_per_scenario: int = 4
    # OPV2V saves at 10 Hz; 0.2 s gives more motion per saved frame, hence more varied training samples.
    frame_interval_s: float = 0.2
    min_cavs: int = 2
    max_cavs: int = 3
    min_vehicles: int = 10
    max_vehicles: int = 20
    # A CAV's yaml lists the other vehicles (CAVs included, itself excluded) within this distance.
    vehicle_list_radius_m: float = 120.0
    lidar: LidarConfig = field(default_factory=LidarConfig)
    # One road-side unit per scenario when set (make_toy_opv2v.py --rsu); None writes vehicles only.
    rsu: Optional[RsuConfig] = None

    @classmethod
    def preset(cls, scale: str) -> "ToyWorldConfig":
        """'small': a few seconds to generate, for tests. 'demo': enough to train a small PointPillar.
        Both without RSU: ``dataclasses.replace(config, rsu=RsuConfig())`` adds one."""
        if scale == "small":
            return cls(lidar=LidarConfig(beams=16, azimuth_steps=512))
        if scale == "demo":
            return cls(train_scenarios=6, validate_scenarios=2, test_scenarios=2, frames_per_scenario=12,
                       min_cavs=2, max_cavs=4, min_vehicles=18, max_vehicles=30,
                       lidar=LidarConfig(beams=32, azimuth_steps=768))
        if scale == "dense":
            # small's scenarios seen by an OPV2V-like LiDAR (64 beams, 120 m, 0.24 degrees a step): clouds of
            # OPV2V's size, for what loading costs per sample (gpu_check's loader check), not for training.
            return cls(lidar=LidarConfig(beams=64, azimuth_steps=1500, max_range_m=120.0))
        raise ConfigError(f"unknown toy scale {scale!r}: use one of {', '.join(SCALES)}")

    def scenarios_in(self, split: str) -> int:
        return {"train": self.train_scenarios, "validate": self.validate_scenarios,
                "test": self.test_scenarios}[split]

    def to_dict(self) -> dict:
        """The config as the manifest records it. ``rsu`` is left out when None, so a set without RSU keeps the
        identity it had before RSUs existed (and is reused, not regenerated)."""
        values = dataclasses.asdict(self)
        if self.rsu is None:
            del values["rsu"]
        return values
