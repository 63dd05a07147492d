"""Robustness settings: communication delay and localisation error, as small functions over poses.

Two hypes blocks describe them (docs/robustness.md; upstream's semantics in docs/compatibility.md):

- upstream OpenCOOD's ``wild_setting`` (V2X-ViT): ``async`` with ``async_mode`` ``sim`` (a constant
  ``|async_overhead|`` ms) or ``real`` (``int(uniform(0, async_overhead) + data_size / transmission_speed * 1000
  + backbone_delay)`` ms), floor-divided by the 100 ms between OPV2V/V2XSet frames; and ``loc_err`` with
  ``xyz_std`` (m) on x, y, z and ``ryp_std`` (degrees) on the yaw of every non-ego CAV. ``loc_err_mode`` (ours)
  says how the error is drawn: ``upstream`` replays upstream's ``np.random.seed(seed)`` before each draw, so
  every non-ego CAV of every frame gets the same offset; ``per_sample`` draws independently per CAV and frame;
  ``v2xvit`` is ``upstream``'s offset applied as the V2X-ViT repository's early and late datasets apply it too.
- HEAL/CoAlign's ``noise_setting``: ``add_noise`` with ``args.pos_std``/``pos_mean`` (m, x and y) and
  ``rot_std``/``rot_mean`` (degrees, yaw), Gaussian or (``args.laplace``) Laplace, the ego included. It is the
  ``per_sample`` mode with those parameters.

Poses are upstream's 6-vectors ``[x, y, z, roll, yaw, pitch]`` (metres, degrees); a noise draw is the 6-vector
offset added to one. ``perturb_matrix`` applies the same offset to a 4x4 sensor-to-world pose, for datasets that
store poses as matrices (V2V4Real). Nothing here reads or writes numpy's global RNG: upstream's global draws
are replayed on a private ``RandomState``; our own draws come from generators keyed by the sample, so that a
sample is the same on any world size, worker count and rank order (``data/augment.py``'s contract).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, List, Mapping, Optional

import numpy as np

from opencood_ddp.data.geometry import is_pose_matrix
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import RANDOM_STATE_SEEDS, get_key

FRAME_INTERVAL_MS = 100  # OPV2V and V2XSet are recorded at 10 Hz (upstream's "// 100")
ASYNC_MODES = ("sim", "real")
LOC_ERR_MODES = ("upstream", "per_sample", "v2xvit")
# The modes that replay upstream's reseeded draw: OpenCOOD's (only its intermediate dataset applies the offset) and
# the V2X-ViT repository's (every dataset does; its late fusion also moves the ground truth with the noisy pose).
REPLAYED_MODES = ("upstream", "v2xvit")
DEFAULT_LOC_ERR_MODE = "upstream"  # so that upstream's hypes files give upstream's inputs
# Upstream's values for keys its wild_setting block may leave out (basedataset.py).
DEFAULT_TRANSMISSION_SPEED_MBPS = 27.0

# The last word of a per-CAV generator's key: what it draws. Non-zero, because numpy's SeedSequence gives
# [a, b] and [a, b, 0] the same state; so no key here can collide with sample_rng's [seed, epoch, index].
DELAY_DRAWS = 1
NOISE_DRAWS = 2

YAW = 4  # index of the yaw in a pose 6-vector


# ------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class DelaySetting:
    """wild_setting's delay keys, with upstream's defaults for absent ones (milliseconds, megabits, Mbps)."""

    enabled: bool = False
    mode: str = "sim"
    overhead_ms: float = 0.0
    data_size_mb: float = 0.0
    transmission_speed_mbps: float = DEFAULT_TRANSMISSION_SPEED_MBPS
    backbone_delay_ms: float = 0.0

    @property
    def draws(self) -> bool:
        """Whether each non-ego CAV's delay needs a uniform draw (``real`` mode)."""
        return self.enabled and self.mode == "real"


@dataclass(frozen=True)
class NoiseSetting:
    """A localisation error: per-axis spreads (m for x, y, z; degrees for yaw) and who receives it.

    ``mode`` ``upstream`` (and ``v2xvit``) means the one offset ``upstream_loc_noise(seed, ...)`` for every
    perturbed pose; ``per_sample`` an independent draw per CAV and frame. ``laplace`` reads the spreads as Laplace
    scales b."""

    mode: str
    xy_std: float
    z_std: float
    yaw_std: float
    xy_mean: float = 0.0
    yaw_mean: float = 0.0
    laplace: bool = False
    include_ego: bool = False


@dataclass(frozen=True)
class WildSetting:
    """Delay and localisation error of one dataset; ``seed`` is wild_setting.seed (0 when absent)."""

    delay: DelaySetting = DelaySetting()
    noise: Optional[NoiseSetting] = None
    seed: int = 0

    @property
    def replays_upstream(self) -> bool:
        """Whether upstream's reseed of numpy's global RNG is replayed (loc_err in ``upstream`` or ``v2xvit`` mode)."""
        return self.noise is not None and self.noise.mode in REPLAYED_MODES

    @property
    def noisy_ground_truth(self) -> bool:
        """Whether late fusion's ground truth is moved by the noisy current pose (``v2xvit``: the V2X-ViT
        repository's gt_transformation_matrix); elsewhere it is placed with the true poses."""
        return self.noise is not None and self.noise.mode == "v2xvit"

    @cached_property
    def upstream_offset(self) -> np.ndarray:
        """The one offset upstream gives every non-ego pose (``upstream`` mode), computed once per dataset."""
        assert self.noise is not None
        return upstream_loc_noise(self.seed, self.noise.xy_std, self.noise.yaw_std)


@dataclass(frozen=True)
class SampleKey:
    """What a sample's own random draws are keyed by: the dataset seed, the epoch and the sample index."""

    seed: int
    epoch: int
    index: int


# ---------------------------------------------------------------------------------------------- delay


def delay_ms(delay: DelaySetting, overhead_draw: float = 0.0) -> float:
    """Upstream's delay of a non-ego CAV in ms: ``sim`` |overhead|; ``real`` the truncated sum of the drawn
    overhead (``overhead_draw``, uniform in [0, overhead)), the transmission time and the backbone delay."""
    if delay.mode == "sim":
        return abs(delay.overhead_ms)
    transmission_ms = delay.data_size_mb / delay.transmission_speed_mbps * 1000
    return int(overhead_draw + transmission_ms + delay.backbone_delay_ms)


def delay_frames(delay: DelaySetting, ego: bool, overhead_draw: float = 0.0) -> int:
    """Whole frames of delay (upstream's ``time_delay_calculation``): 0 for the ego and without ``async``."""
    if ego or not delay.enabled:
        return 0
    return int(delay_ms(delay, overhead_draw) // FRAME_INTERVAL_MS)


def clamp_delay(position: int, frames: int) -> int:
    """The delay actually applied at timestamp ``position`` of a scenario: a delayed frame at or before the
    scenario's first frame is the first frame (upstream then also reports the shorter delay)."""
    return min(frames, position)


class UpstreamGlobalRng:
    """numpy's global RNG as upstream's ``retrieve_base_data`` uses it within one sample, replayed privately.

    Upstream draws the ``real`` delays from the global state and, with ``loc_err``, calls
    ``np.random.seed(seed)`` before each noise draw. After the first reseed of a sample the global stream is
    known, so later draws are replayed exactly on a private ``RandomState``. Before it, the state is whatever
    the worker's previous work left (not reproducible upstream); such draws come from ``unknown(slot)``, a
    generator of the sample's own."""

    def __init__(self, seed: int, unknown: Callable[[int], np.random.Generator]):
        self.seed, self.unknown = seed, unknown
        self.state: Optional[np.random.RandomState] = None

    def uniform(self, slot: int, low: float, high: float) -> float:
        source = self.unknown(slot) if self.state is None else self.state
        return float(source.uniform(low, high))

    def add_loc_noise(self, xyz_std: float, ryp_std: float) -> np.ndarray:
        """One call of upstream's ``add_loc_noise``: reseed, then three xyz and three angle draws."""
        self.state = np.random.RandomState(self.seed)
        xyz = self.state.normal(0, xyz_std, 3)
        angles = self.state.normal(0, ryp_std, 3)  # roll, yaw, pitch are drawn; only the yaw is used
        return np.array([xyz[0], xyz[1], xyz[2], 0.0, angles[1], 0.0])


def upstream_loc_noise(seed: int, xyz_std: float, ryp_std: float) -> np.ndarray:
    """The offset upstream adds to every non-ego pose (seed 25, std 0.2: x +0.0457, y +0.2054, z -0.1679 m,
    yaw -0.1914 degrees)."""
    return UpstreamGlobalRng(seed, _no_unknown_draws).add_loc_noise(xyz_std, ryp_std)


def _no_unknown_draws(slot: int) -> np.random.Generator:
    raise AssertionError("a reseeded replay never needs the unknown state")


def wild_rng(key: SampleKey, wild_seed: int, slot: int, purpose: int, lag: int = 0) -> np.random.Generator:
    """The generator of one CAV's draws in one sample: delay (``DELAY_DRAWS``) or the pose noise of the frame
    ``lag`` frames back (``NOISE_DRAWS``). A function of its arguments only, like ``sample_rng``."""
    return np.random.default_rng([key.seed, key.epoch, key.index, wild_seed, slot, lag, purpose])


def sample_delays(wild: WildSetting, count: int, position: int, key: SampleKey) -> List[int]:
    """The applied delay in frames of each of a scenario's ``count`` kept CAVs (slot 0 is the ego) for the sample
    at timestamp ``position``, drawing in upstream's order: per CAV, its delay, then (``upstream`` loc_err) two
    reseeded noise draws. Out-of-range CAVs draw too, as upstream reads every kept CAV before the range test."""
    if not wild.delay.enabled:
        return [0] * count
    rng = UpstreamGlobalRng(wild.seed, lambda slot: wild_rng(key, wild.seed, slot, DELAY_DRAWS))
    delays = []
    for slot in range(count):
        ego = slot == 0
        draw = rng.uniform(slot, 0.0, wild.delay.overhead_ms) if wild.delay.draws and not ego else 0.0
        delays.append(clamp_delay(position, delay_frames(wild.delay, ego, draw)))
        if wild.replays_upstream and not ego:
            assert wild.noise is not None
            for _pose in ("delayed", "current"):  # upstream perturbs both, reseeding each time
                rng.add_loc_noise(wild.noise.xy_std, wild.noise.yaw_std)
    return delays


# ---------------------------------------------------------------------------------------------- noise


def draw_pose_noise(rng: np.random.Generator, noise: NoiseSetting) -> np.ndarray:
    """One ``per_sample`` offset: x and y, then z, then yaw, from ``rng`` (Gaussian N(mean, std) or Laplace)."""
    draw = rng.laplace if noise.laplace else rng.normal
    xy = draw(noise.xy_mean, noise.xy_std, 2)
    z = draw(0.0, noise.z_std) if noise.z_std else 0.0  # HEAL/CoAlign leave z alone
    yaw = draw(noise.yaw_mean, noise.yaw_std)
    return np.array([xy[0], xy[1], z, 0.0, yaw, 0.0])


def pose_offset(wild: WildSetting, slot: int, lag: int, key: SampleKey) -> Optional[np.ndarray]:
    """The offset of CAV ``slot``'s pose ``lag`` frames back in this sample, or None when it is not perturbed."""
    noise = wild.noise
    if noise is None or (slot == 0 and not noise.include_ego):
        return None
    if noise.mode in REPLAYED_MODES:
        return wild.upstream_offset
    return draw_pose_noise(wild_rng(key, wild.seed, slot, NOISE_DRAWS, lag), noise)


def perturb_pose(pose: Any, offset: np.ndarray) -> np.ndarray:
    """A 6-vector pose plus a 6-vector offset (upstream adds the noise to the pose's entries)."""
    return np.asarray(pose, dtype=np.float64) + offset


def perturb_matrix(pose_matrix: Any, offset: np.ndarray) -> np.ndarray:
    """A 4x4 sensor-to-world pose with the same error as ``perturb_pose``: the rotation turned by the yaw offset
    about the world's z axis, the position moved by the x, y, z offset. Equal to ``pose_to_matrix(perturb_pose
    (pose, offset))`` for offsets without roll or pitch (the only ones drawn here)."""
    if offset[3] or offset[5]:
        raise ValueError("perturb_matrix applies x, y, z and yaw offsets only")
    out = np.array(pose_matrix, dtype=np.float64)
    turn = math.radians(offset[YAW])
    cos, sin = math.cos(turn), math.sin(turn)
    out[:3, :3] = np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]]) @ out[:3, :3]
    out[:3, 3] += offset[:3]
    return out


def perturb(pose: Any, offset: np.ndarray) -> np.ndarray:
    """A pose with a localisation error: ``perturb_pose`` for a 6-vector, ``perturb_matrix`` for a (4, 4)
    sensor-to-world matrix (V2V4Real's poses, where upstream's ``add_loc_noise`` fails: its issue 39)."""
    if is_pose_matrix(pose):
        return perturb_matrix(pose, offset)
    return perturb_pose(pose, offset)


# --------------------------------------------------------------------------------------------- hypes


def wild_setting_from_hypes(hypes: Mapping, source: str) -> WildSetting:
    """The dataset's delay and localisation error from ``wild_setting`` and ``noise_setting`` (types are checked
    by the dataset's key declarations first). A bad value is one ConfigError naming the key and the fix."""
    delay = _delay_setting(hypes, source)
    wild_noise, heal_noise = _wild_noise(hypes, source), _heal_noise(hypes, source)
    if wild_noise is not None and heal_noise is not None:
        raise ConfigError(f"{source}: keys wild_setting.loc_err and noise_setting.add_noise are both true; keep "
                          f"one localisation error (set the other false)")
    seed = get_key(hypes, "wild_setting.seed", 0)
    if not 0 <= seed < RANDOM_STATE_SEEDS:
        raise ConfigError(f"{source}: key wild_setting.seed must be in [0, 2**32) (numpy's RandomState), got "
                          f"{seed}; fix the hypes")
    return WildSetting(delay, wild_noise or heal_noise, int(seed))


def _non_negative(hypes: Mapping, key: str, unit: str, default: float, source: str) -> float:
    value = get_key(hypes, key, default)
    if not value >= 0 or math.isinf(value):  # NaN fails the comparison
        raise ConfigError(f"{source}: key {key} must be a finite number >= 0 ({unit}), got {value!r}; write a "
                          f"non-negative value")
    return float(value)


def _finite(hypes: Mapping, key: str, unit: str, default: float, source: str) -> float:
    """A mean of the noise: any finite number (a NaN or infinite mean moves every pose, the ego's too, out of
    reach, and every cloud out of range)."""
    value = get_key(hypes, key, default)
    if not math.isfinite(value):
        raise ConfigError(f"{source}: key {key} must be a finite number ({unit}), got {value!r}; write a finite "
                          f"value (0 for noise around the true pose)")
    return float(value)


def _required_when(hypes: Mapping, key: str, flag: str, example: str, source: str) -> None:
    if get_key(hypes, key) is None:
        raise ConfigError(f"{source}: key {key} is needed by {flag}: true; add it (e.g. {example}) or set "
                          f"{flag}: false")


def _choice(hypes: Mapping, key: str, choices: tuple, default: str, source: str) -> str:
    value = get_key(hypes, key, default)
    if value not in choices:
        raise ConfigError(f"{source}: key {key} must be {' or '.join(repr(c) for c in choices)}, got {value!r}; "
                          f"fix the hypes")
    return value


def _delay_setting(hypes: Mapping, source: str) -> DelaySetting:
    enabled = bool(get_key(hypes, "wild_setting.async", False))
    if enabled:
        _required_when(hypes, "wild_setting.async_overhead", "wild_setting.async", "100 (ms)", source)
    speed = get_key(hypes, "wild_setting.transmission_speed", DEFAULT_TRANSMISSION_SPEED_MBPS)
    if not speed > 0 or math.isinf(speed):
        raise ConfigError(f"{source}: key wild_setting.transmission_speed must be a finite number > 0 (Mbps), got "
                          f"{speed!r}; write a positive value (upstream's default is 27)")
    return DelaySetting(
        enabled=enabled,
        mode=_choice(hypes, "wild_setting.async_mode", ASYNC_MODES, "sim", source),
        # Upstream takes |async_overhead| in sim mode and draws uniform(0, async_overhead) in real mode; a
        # negative value means nothing in the second, so it is refused in both.
        overhead_ms=_non_negative(hypes, "wild_setting.async_overhead", "ms", 0.0, source),
        data_size_mb=_non_negative(hypes, "wild_setting.data_size", "Mb", 0.0, source),
        transmission_speed_mbps=float(speed),
        backbone_delay_ms=_non_negative(hypes, "wild_setting.backbone_delay", "ms", 0.0, source),
    )


def _wild_noise(hypes: Mapping, source: str) -> Optional[NoiseSetting]:
    mode = _choice(hypes, "wild_setting.loc_err_mode", LOC_ERR_MODES, DEFAULT_LOC_ERR_MODE, source)
    xyz = _non_negative(hypes, "wild_setting.xyz_std", "m", 0.0, source)
    ryp = _non_negative(hypes, "wild_setting.ryp_std", "degrees", 0.0, source)
    if not get_key(hypes, "wild_setting.loc_err", False):
        return None
    for key, example in (("xyz_std", "0.2 (m)"), ("ryp_std", "0.2 (degrees)")):
        _required_when(hypes, f"wild_setting.{key}", "wild_setting.loc_err", example, source)
    if mode in REPLAYED_MODES:  # upstream reseeds numpy with it; it has no default there
        _required_when(hypes, "wild_setting.seed", "wild_setting.loc_err", "25, V2X-ViT's", source)
    return NoiseSetting(mode, xy_std=xyz, z_std=xyz, yaw_std=ryp)


def _heal_noise(hypes: Mapping, source: str) -> Optional[NoiseSetting]:
    pos = _non_negative(hypes, "noise_setting.args.pos_std", "m", 0.0, source)
    rot = _non_negative(hypes, "noise_setting.args.rot_std", "degrees", 0.0, source)
    if not get_key(hypes, "noise_setting.add_noise", False):
        return None
    for key, example in (("pos_std", "0.2 (m)"), ("rot_std", "0.2 (degrees)")):
        _required_when(hypes, f"noise_setting.args.{key}", "noise_setting.add_noise", example, source)
    return NoiseSetting("per_sample", xy_std=pos, z_std=0.0, yaw_std=rot,
                        xy_mean=_finite(hypes, "noise_setting.args.pos_mean", "m", 0.0, source),
                        yaw_mean=_finite(hypes, "noise_setting.args.rot_mean", "degrees", 0.0, source),
                        laplace=bool(get_key(hypes, "noise_setting.args.laplace", False)), include_ego=True)


__all__ = ["FRAME_INTERVAL_MS", "ASYNC_MODES", "LOC_ERR_MODES", "REPLAYED_MODES", "DelaySetting", "NoiseSetting",
           "WildSetting", "SampleKey", "delay_ms", "delay_frames", "clamp_delay", "UpstreamGlobalRng",
           "upstream_loc_noise", "wild_rng", "sample_delays", "draw_pose_noise", "pose_offset", "perturb",
           "perturb_pose", "perturb_matrix", "wild_setting_from_hypes"]
