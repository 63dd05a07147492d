"""Write a toy world in the exact OPV2V on-disk format, one scenario of ``toy.world`` at a time.

Output layout, as OPV2V: ``<out>/<split>/<scenario>/<cav_id>/<timestamp>.pcd`` and ``.yaml``, splits
``train``, ``validate``, ``test``; scenario names like ``2021_08_16_22_26_54``; timestamps zero-padded to 6
digits and stepping by 2 (OPV2V saves every second simulator tick). Points are in the LiDAR sensor frame;
the yaml holds ``lidar_pose``, ``true_ego_pos``, ``predicted_ego_pos``, ``ego_speed`` and ``vehicles``. With
``config.rsu`` each scenario also has a road-side unit, written like a CAV under a negative id (V2XSet's ``-1``):
the same files, its pose exact (surveyed), ``ego_speed`` 0 and every vehicle within the list radius.

Everything random comes from numpy Generators seeded by (seed, split, scenario[, cav, frame]), so the
same seed gives byte-identical files and a frame does not depend on the order frames are written in. The RSU
draws from Generators of its own keys, so a set without RSU is byte for byte what it was before RSUs existed
(with one, a CAV frame whose rays the pole turns into returns draws its later noise differently).
A ``toy_manifest.yaml`` at the top of the output folder records what was generated (``toy.manifest``); a
complete set with the same identity is not generated twice.
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import List, Optional

import numpy as np
import yaml

from opencood_ddp.data.pcd import write_pcd
from opencood_ddp.errors import ConfigError
from opencood_ddp.toy.config import SPLITS, RsuConfig, ToyWorldConfig
from opencood_ddp.toy.lidar import simulate_scan
from opencood_ddp.toy.manifest import OPV2V_SET, identity_of, read_toy_manifest, write_toy_set
from opencood_ddp.toy.world import (TIMESTAMP_STEP, RoadSideUnit, ToyScene, build_scene, lidar_pose, place_rsu,
                                    scene_boxes, with_rsu_pole)

# libyaml's emitter is ~10x faster than the pure-Python one, which would otherwise cost as much as the LiDAR.
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# The region the toy hypes detect in (ego frame), used only to report how many points fall in it.
ROI_XY = (-48.0, -24.0, 48.0, 24.0)
# Scenario names count up from this moment (the example name of the OPV2V documentation).
SCENARIO_EPOCH = datetime.datetime(2021, 8, 16, 22, 26, 54)
# Extra seed words of the RSU's Generators (placement; per frame), apart from every key the CAVs use
# (scenario name 99; CAV frames (cav_index < max_cavs, frame)).
_RSU_PLACEMENT_KEY = 98
_RSU_FRAME_KEY = 1000


def generate_toy_opv2v(out_dir, seed: int, scale: str = "small", binary: bool = False,
                       config: Optional[ToyWorldConfig] = None, rsu: bool = False) -> dict:
    """Write a toy OPV2V set into out_dir, or reuse the complete one already there; return a summary.

    config overrides the preset of `scale` (then the manifest records scale 'custom'). rsu adds a road-side
    unit to every scenario (the default ``RsuConfig`` unless config has one). A complete set with
    the same seed, scale, config, format and generator version is kept (summary['skipped'] is True). A
    toy set with another identity, or an interrupted one, is replaced. Any other non-empty folder is
    refused with a DataError.
    """
    if int(seed) != seed or seed < 0:
        raise ConfigError(f"toy world seed {seed!r} must be a non-negative integer")
    if config is None:
        config = ToyWorldConfig.preset(scale)
    else:
        scale = "custom"
    if rsu and config.rsu is None:
        config = dataclasses.replace(config, rsu=RsuConfig())
    out = Path(out_dir)
    identity = identity_of(seed, scale, binary, config)
    return write_toy_set(out, identity, OPV2V_SET, lambda: lambda: dict(
        _write_all_splits(out, seed, binary, config), seed=seed, scale=scale, binary=binary))


def toy_world_in(out_dir, scale: str = "demo", seed: int = 0) -> dict:
    """The summary of the complete toy OPV2V world in out_dir, whatever its scale or format, or of a new one of
    `scale` written there when it holds none. For the tools whose --data names a world to read: the user's world
    (a dense or binary one, say) is read as it is, where generate_toy_opv2v would replace it with `scale`'s."""
    manifest = read_toy_manifest(out_dir)
    if manifest is not None and manifest.get("complete"):
        return dict(manifest.get("summary") or {}, out_dir=str(out_dir), skipped=True)
    return generate_toy_opv2v(out_dir, seed=seed, scale=scale)


def format_summary(summary: dict) -> str:
    """One paragraph for people: what was written (or reused), how big, how long it took."""
    frames = summary["frames"]
    cavs = (f"{summary['cavs_min']}" if summary["cavs_min"] == summary["cavs_max"]
            else f"{summary['cavs_min']}-{summary['cavs_max']}")
    ppc = summary["points_per_cloud"]
    if summary.get("skipped"):
        verb, timing = "Reused the complete toy OPV2V set in", f"generated earlier in {summary['seconds']:.1f} s"
    else:
        verb, timing = "Wrote a toy OPV2V set to", f"generated in {summary['seconds']:.1f} s"
    return (f"{verb} {summary['out_dir']} (seed {summary['seed']}, scale {summary['scale']}): "
            f"{frames['train']} train / {frames['validate']} validate / {frames['test']} test ego frames in "
            f"{summary['scenarios']['train']}/{summary['scenarios']['validate']}/{summary['scenarios']['test']} "
            f"scenarios, {cavs} CAVs per scenario{_rsu_words(summary)} "
            f"({summary['clouds']} point clouds), {ppc['mean']:.0f} points per cloud on average "
            f"(min {ppc['min']}, max {ppc['max']}; {summary['points_in_roi_mean']:.0f} within "
            f"x +-48 m, y +-24 m), {timing}.")


def _rsu_words(summary: dict) -> str:
    """' plus 1 road-side unit' for a set with RSUs, nothing otherwise (the summary of older sets is unchanged)."""
    count = summary.get("rsus_per_scenario", 0)
    return f" plus {count} road-side unit" if count else ""


def _write_all_splits(out: Path, seed: int, binary: bool, config: ToyWorldConfig) -> dict:
    counts: List[int] = []
    in_roi: List[int] = []
    cavs: List[int] = []
    vehicles: List[int] = []
    for split_index, split in enumerate(SPLITS):
        for scenario_index in range(config.scenarios_in(split)):
            key = (int(seed), split_index, scenario_index)
            scene = build_scene(np.random.default_rng(key), config)
            name = _scenario_name(np.random.default_rng(key + (99,)), split_index, scenario_index)
            cavs.append(len(scene.cav_ids))
            vehicles.append(len(scene.tracks))
            unit = None
            if config.rsu is not None:
                unit = place_rsu(np.random.default_rng(key + (_RSU_PLACEMENT_KEY,)), scene, config.rsu)
                scene = with_rsu_pole(scene, unit)
            for cav_index, cav_id in enumerate(scene.cav_ids):
                folder = out / split / name / str(cav_id)
                folder.mkdir(parents=True)
                for frame in range(config.frames_per_scenario):
                    rng = np.random.default_rng(key + (cav_index, frame))
                    points = _render_frame(folder, scene, cav_id, frame, config, rng, binary)
                    counts.append(len(points))
                    in_roi.append(int(np.count_nonzero(_in_roi(points))))
            if unit is not None:
                for points in _write_rsu(out / split / name / str(unit.rsu_id), key, scene, unit, config, binary):
                    counts.append(len(points))
                    in_roi.append(int(np.count_nonzero(_in_roi(points))))
    scenarios = {split: config.scenarios_in(split) for split in SPLITS}
    rsu_stats = {"rsus_per_scenario": 1} if config.rsu is not None else {}
    return {"scenarios": scenarios,
            "frames": {split: n * config.frames_per_scenario for split, n in scenarios.items()},
            "clouds": len(counts), "cavs_min": min(cavs), "cavs_max": max(cavs),
            "vehicles_per_scenario_mean": round(float(np.mean(vehicles)), 1),
            "points_per_cloud": {"mean": round(float(np.mean(counts)), 1), "min": int(min(counts)),
                                 "max": int(max(counts))},
            "points_in_roi_mean": round(float(np.mean(in_roi)), 1), **rsu_stats}


def _render_frame(folder: Path, scene: ToyScene, cav_id: int, frame: int, config: ToyWorldConfig,
                  rng: np.random.Generator, binary: bool) -> np.ndarray:
    t = frame * config.frame_interval_s
    stamp = f"{scene.first_timestamp + TIMESTAMP_STEP * frame:06d}"
    boxes, refl = scene_boxes(scene, t, exclude_id=cav_id)
    pose = lidar_pose(scene, cav_id, t, config.lidar)
    points = simulate_scan(pose, boxes, refl, scene.ground_reflectivity, config.lidar, rng)
    write_pcd(folder / f"{stamp}.pcd", points, binary=binary)
    metadata = frame_metadata(scene, cav_id, t, config, rng)
    (folder / f"{stamp}.yaml").write_text(yaml.dump(metadata, Dumper=_YAML_DUMPER, sort_keys=True))
    return points


def _write_rsu(folder: Path, key: tuple, scene: ToyScene, unit: RoadSideUnit, config: ToyWorldConfig,
               binary: bool) -> List[np.ndarray]:
    """Every frame of a scenario's RSU, each from its own Generator; returns the clouds for the summary."""
    folder.mkdir(parents=True)
    return [_render_rsu_frame(folder, scene, unit, frame, config,
                              np.random.default_rng(key + (_RSU_FRAME_KEY, frame)), binary)
            for frame in range(config.frames_per_scenario)]


def _render_rsu_frame(folder: Path, scene: ToyScene, unit: RoadSideUnit, frame: int, config: ToyWorldConfig,
                      rng: np.random.Generator, binary: bool) -> np.ndarray:
    """One RSU sweep and yaml: every vehicle is a target (the RSU is no vehicle), the pose never changes."""
    t = frame * config.frame_interval_s
    stamp = f"{scene.first_timestamp + TIMESTAMP_STEP * frame:06d}"
    boxes, refl = scene_boxes(scene, t)
    points = simulate_scan(unit.lidar_pose(), boxes, refl, scene.ground_reflectivity, config.lidar, rng)
    write_pcd(folder / f"{stamp}.pcd", points, binary=binary)
    metadata = rsu_metadata(scene, unit, t, config)
    (folder / f"{stamp}.yaml").write_text(yaml.dump(metadata, Dumper=_YAML_DUMPER, sort_keys=True))
    return points


def rsu_metadata(scene: ToyScene, unit: RoadSideUnit, t: float, config: ToyWorldConfig) -> dict:
    """A road-side unit's yaml: a CAV's fields, with speed 0 and its surveyed pose as the predicted one."""
    ground = [_round(v) for v in unit.ground_pose()]
    # Two lists, not one: the yaml would otherwise hold an anchor and an alias where OPV2V has plain lists.
    return {"ego_speed": 0.0, "lidar_pose": [_round(v) for v in unit.lidar_pose()],
            "predicted_ego_pos": list(ground), "true_ego_pos": list(ground),
            "vehicles": _vehicles_near(scene, np.asarray(unit.xy), t, config, None)}


def frame_metadata(scene: ToyScene, cav_id: int, t: float, config: ToyWorldConfig,
                   rng: np.random.Generator) -> dict:
    """The per-timestamp yaml of one CAV, with the fields OpenCOOD's LiDAR pipeline reads."""
    track = scene.track(cav_id)
    pose = lidar_pose(scene, cav_id, t, config.lidar)
    loc = track.location(t)
    true_ego = [float(loc[0]), float(loc[1]), float(loc[2]), 0.0, float(np.degrees(track.yaw_rad)), 0.0]
    # Localisation is good but not perfect, as CARLA's GNSS-based estimate in OPV2V.
    predicted = list(true_ego)
    predicted[0] += float(rng.normal(0.0, 0.05))
    predicted[1] += float(rng.normal(0.0, 0.05))
    vehicles = _vehicles_near(scene, loc[:2], t, config, cav_id)
    return {"ego_speed": _round(track.speed_mps * 3.6), "lidar_pose": [_round(v) for v in pose],
            "predicted_ego_pos": [_round(v) for v in predicted], "true_ego_pos": [_round(v) for v in true_ego],
            "vehicles": vehicles}


def _vehicles_near(scene: ToyScene, xy: np.ndarray, t: float, config: ToyWorldConfig,
                   exclude_id: Optional[int]) -> dict:
    """The ``vehicles`` mapping of a sensor at ``xy``: every vehicle but ``exclude_id`` within the list radius."""
    vehicles = {}
    for other in scene.tracks:
        other_loc = other.location(t)
        if other.vehicle_id == exclude_id or np.hypot(*(other_loc[:2] - xy[:2])) > config.vehicle_list_radius_m:
            continue
        vehicles[other.vehicle_id] = {
            "angle": [0.0, _round(np.degrees(other.yaw_rad)), 0.0],
            "center": [_round(v) for v in other.center_offset],
            "extent": [_round(v) for v in other.extent],
            "location": [_round(v) for v in other_loc],
            "speed": _round(other.speed_mps * 3.6),
        }
    return vehicles


def _round(value: float) -> float:
    """Six decimals: micrometre precision keeps yaml short and its text stable."""
    return round(float(value), 6)


def _in_roi(points: np.ndarray) -> np.ndarray:
    x0, y0, x1, y1 = ROI_XY
    return (points[:, 0] >= x0) & (points[:, 0] <= x1) & (points[:, 1] >= y0) & (points[:, 1] <= y1)


def _scenario_name(rng: np.random.Generator, split_index: int, scenario_index: int) -> str:
    """Date-time names like OPV2V's, increasing with the scenario index (so sorted = generation order)."""
    moment = SCENARIO_EPOCH + datetime.timedelta(days=10 * split_index, hours=2 * scenario_index,
                                                 seconds=int(rng.integers(0, 3600)))
    return moment.strftime("%Y_%m_%d_%H_%M_%S")
