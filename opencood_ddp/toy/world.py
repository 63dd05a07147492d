"""One toy scenario: a small town around one junction (a crossing or a T) and the traffic through it.

A flat ground plane, buildings along the roads, street furniture, 10-30 vehicles driving straight along their lanes
at constant speeds, and 2-4 of them connected (CAVs). The CAVs sit on different arms of the junction, so the corner
buildings hide from one CAV what another one sees: cooperation measurably helps. Optionally a road-side unit (a
LiDAR on a pole at a junction corner, V2XSet's infrastructure). A scene is drawn from one numpy Generator (the RSU
from another); everything after that (boxes and poses at a time t) is deterministic.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from opencood_ddp.data.geometry import wrap_angle
from opencood_ddp.toy.config import GROUND_Z, LidarConfig, RsuConfig, ToyWorldConfig

# OPV2V saves every second simulator tick, so its timestamps step by 2.
TIMESTAMP_STEP = 2


@dataclass(frozen=True)
class RoadLayout:
    """One junction in the map frame: a road along x (always) and a road along y, both centred on 0.

    The y road has a south arm (a crossing) or not (a T junction). The map frame is then rotated and
    shifted into the CARLA-like world frame, so world coordinates and yaws are not trivially aligned.
    """

    x_lanes: int
    y_lanes: int
    lane_width: float
    sidewalk: float
    south_arm: bool
    extent: float

    @property
    def x_half_width(self) -> float:
        return self.x_lanes * self.lane_width

    @property
    def y_half_width(self) -> float:
        return self.y_lanes * self.lane_width


@dataclass(frozen=True)
class Lane:
    """A straight lane: vehicles move along `axis` (0: map x, 1: map y) in direction `sign`."""

    axis: int
    sign: int
    offset: float
    s_min: float
    s_max: float

    @property
    def yaw(self) -> float:
        return (0.0 if self.sign > 0 else math.pi) if self.axis == 0 else math.copysign(math.pi / 2, self.sign)

    def point(self, s: float) -> np.ndarray:
        return np.array([s, self.offset]) if self.axis == 0 else np.array([self.offset, s])


@dataclass(frozen=True)
class VehicleTrack:
    """A vehicle moving in a straight line at constant speed; positions in the world frame."""

    vehicle_id: int
    start_xy: Tuple[float, float]
    yaw_rad: float
    speed_mps: float
    extent: Tuple[float, float, float]          # half length, half width, half height
    center_offset: Tuple[float, float, float]   # world-frame offset from location to the box centre
    reflectivity: float

    def location(self, t: float) -> np.ndarray:
        """[x, y, z] of the vehicle's reference point at time t (z on the ground)."""
        step = self.speed_mps * t
        return np.array([self.start_xy[0] + step * math.cos(self.yaw_rad),
                         self.start_xy[1] + step * math.sin(self.yaw_rad), GROUND_Z])

    def box(self, t: float) -> np.ndarray:
        """[cx, cy, cz, half_l, half_w, half_h, yaw] at time t, as OpenCOOD builds it (location + center)."""
        return np.concatenate([self.location(t) + np.asarray(self.center_offset), self.extent, [self.yaw_rad]])


@dataclass(frozen=True)
class ToyScene:
    """Everything needed to render the frames of one scenario."""

    layout: RoadLayout
    map_yaw: float                  # world = rotate(map_yaw) @ map + map_offset
    map_offset: Tuple[float, float]
    static_boxes: np.ndarray        # (S, 7) buildings and street furniture, world frame
    static_reflectivity: np.ndarray  # (S,)
    tracks: Tuple[VehicleTrack, ...]
    cav_ids: Tuple[int, ...]
    first_timestamp: int

    def track(self, vehicle_id: int) -> VehicleTrack:
        return next(t for t in self.tracks if t.vehicle_id == vehicle_id)

    def world_to_map(self, xy: np.ndarray) -> np.ndarray:
        c, s = math.cos(self.map_yaw), math.sin(self.map_yaw)
        rel = xy - np.asarray(self.map_offset)
        return np.stack([rel[..., 0] * c + rel[..., 1] * s, -rel[..., 0] * s + rel[..., 1] * c], axis=-1)

    def ground_reflectivity(self, xy_world: np.ndarray) -> np.ndarray:
        """Asphalt is dark, lane markings bright, sidewalks in between: intensity tells surfaces apart."""
        m = self.world_to_map(xy_world)
        lay = self.layout
        x_abs, y_abs = np.abs(m[:, 0]), np.abs(m[:, 1])
        y_low = -lay.extent if lay.south_arm else -lay.x_half_width - lay.sidewalk
        along_x = x_abs <= lay.extent
        along_y = (m[:, 1] <= lay.extent) & (m[:, 1] >= y_low)
        on_x = along_x & (y_abs <= lay.x_half_width)
        on_y = along_y & (x_abs <= lay.y_half_width)
        junction = (x_abs <= lay.y_half_width) & (y_abs <= lay.x_half_width)
        walk = ((along_x & (y_abs <= lay.x_half_width + lay.sidewalk))
                | (along_y & (x_abs <= lay.y_half_width + lay.sidewalk)))
        marking = ((on_x & ~junction & _on_lane_line(y_abs, m[:, 0], lay.x_half_width, lay.lane_width))
                   | (on_y & ~junction & _on_lane_line(x_abs, m[:, 1], lay.y_half_width, lay.lane_width)))
        refl = np.full(len(m), 0.20)          # lots and verges
        refl[walk] = 0.30
        refl[on_x | on_y] = 0.12
        refl[marking] = 0.70
        return refl


def _on_lane_line(lateral: np.ndarray, along: np.ndarray, half_width: float, lane_width: float) -> np.ndarray:
    """Solid centre line, dashed (3 m on, 3 m off) dividers between lanes of one direction."""
    to_line = np.abs(np.mod(lateral + lane_width / 2, lane_width) - lane_width / 2)
    dashed_on = np.mod(along, 6.0) < 3.0
    return (to_line < 0.08) & (lateral < half_width - 1.0) & ((lateral < 0.5) | dashed_on)


# Vehicle kinds: (weight, length range, width range, height range, reflectivity range). All under 6 m,
# the size above which OpenCOOD's post-processing discards boxes; vans are the tall occluders.
_VEHICLE_KINDS = (
    (0.35, (4.2, 4.9), (1.80, 2.00), (1.40, 1.60), (0.55, 0.90)),
    (0.25, (3.7, 4.2), (1.65, 1.80), (1.40, 1.55), (0.50, 0.85)),
    (0.25, (4.6, 5.1), (1.90, 2.10), (1.65, 1.90), (0.55, 0.90)),
    (0.15, (4.9, 5.8), (1.95, 2.15), (1.90, 2.40), (0.60, 0.95)),
)
_MOVING_SPEED_KMH = (15.0, 50.0)
_CAV_SPEED_KMH = (10.0, 40.0)
_SPAWN_RANGE_M = 60.0        # most vehicles start within this distance of the junction
_CAV_DISTANCE_M = (15.0, 40.0)  # CAVs start this far from the junction centre
_MAX_CAV_SEPARATION_M = 60.0   # OpenCOOD drops CAVs farther than 70 m from the ego
_COLLISION_MARGIN_M = 0.5


def build_scene(rng: np.random.Generator, config: ToyWorldConfig) -> ToyScene:
    """Draw one scenario: junction, buildings, furniture, CAVs and other vehicles."""
    layout = RoadLayout(x_lanes=int(rng.integers(1, 3)), y_lanes=int(rng.integers(1, 3)),
                        lane_width=float(rng.uniform(3.3, 3.7)), sidewalk=float(rng.uniform(2.5, 4.0)),
                        south_arm=bool(rng.random() < 0.7), extent=110.0)
    map_yaw = float(rng.uniform(-math.pi, math.pi))
    map_offset = (float(rng.uniform(-250, 250)), float(rng.uniform(-250, 250)))
    static_map, static_refl = _static_objects(rng, layout)
    tracks_map, n_cavs = _vehicle_tracks(rng, layout, config)
    ids = [int(i) for i in rng.choice(np.arange(100, 3000), size=len(tracks_map), replace=False)]
    tracks = tuple(_track_to_world(rng, t, vid, map_yaw, map_offset) for t, vid in zip(tracks_map, ids))
    static_world = _boxes_to_world(static_map, map_yaw, map_offset)
    return ToyScene(layout=layout, map_yaw=map_yaw, map_offset=map_offset, static_boxes=static_world,
                    static_reflectivity=static_refl, tracks=tracks, cav_ids=tuple(ids[:n_cavs]),
                    first_timestamp=TIMESTAMP_STEP * int(rng.integers(30, 200)))


def _static_objects(rng: np.random.Generator, layout: RoadLayout) -> Tuple[np.ndarray, np.ndarray]:
    """Buildings along every road frontage, plus poles, trees, bins and shelters on the sidewalks."""
    boxes: List[List[float]] = []
    refl: List[float] = []
    for frontage in _frontages(layout):
        _fill_frontage_with_buildings(rng, frontage, boxes, refl)
        _fill_frontage_with_furniture(rng, frontage, layout.sidewalk, boxes, refl)
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 7), np.asarray(refl, dtype=np.float64)


class _Frontage(NamedTuple):
    """A building line: points origin + s * along for s in [0, length]; blocks lie on the `outward` side."""

    origin: np.ndarray
    along: np.ndarray
    outward: np.ndarray
    length: float


def _frontages(layout: RoadLayout) -> List[_Frontage]:
    """Building lines start at the junction corners and run outward, so corner buildings always exist."""
    xe = layout.y_half_width + layout.sidewalk    # x of the building line along the y road
    ye = layout.x_half_width + layout.sidewalk    # y of the building line along the x road
    ext = layout.extent
    fronts = []
    for sy in (1.0, -1.0):
        has_cross_arm = sy > 0 or layout.south_arm
        for sx in (1.0, -1.0):
            start = xe if has_cross_arm else 0.0
            fronts.append(_Frontage(np.array([sx * start, sy * ye]), np.array([sx, 0.0]),
                                    np.array([0.0, sy]), ext - start))
            if has_cross_arm:
                fronts.append(_Frontage(np.array([sx * xe, sy * ye]), np.array([0.0, sy]),
                                        np.array([sx, 0.0]), ext - ye))
    return fronts


def _fill_frontage_with_buildings(rng: np.random.Generator, front: _Frontage, boxes: List[List[float]],
                                  refl: List[float]) -> None:
    s = 0.0
    first = True
    while s < front.length - 4.0:
        length = min(float(rng.uniform(8.0, 25.0)), front.length - s)
        depth = float(rng.uniform(8.0, 16.0))
        height = float(rng.uniform(4.0, 25.0))
        # The corner building sits right on the line: it is what hides the cross road from a CAV.
        setback = 0.0 if first else float(rng.uniform(0.0, 1.5))
        centre = front.origin + front.along * (s + length / 2) + front.outward * (setback + depth / 2)
        half_l, half_w = (length / 2, depth / 2) if abs(front.along[0]) > 0 else (depth / 2, length / 2)
        boxes.append([centre[0], centre[1], height / 2, half_l, half_w, height / 2, 0.0])
        refl.append(float(rng.uniform(0.25, 0.55)))
        gap = float(rng.uniform(8.0, 15.0)) if rng.random() < 0.15 else float(rng.uniform(0.5, 4.0))
        s += length + gap
        first = False


# Street furniture: (weight, [(half_l, half_w, half_h, z_bottom)] parts, reflectivity).
_FURNITURE = (
    (0.35, [(0.12, 0.12, 2.5, 0.0)], 0.55),                          # lamp post
    (0.30, [(0.2, 0.2, 1.5, 0.0), (1.6, 1.6, 1.4, 2.8)], 0.20),       # tree: trunk and crown
    (0.20, [(0.6, 0.4, 0.6, 0.0)], 0.35),                             # bin or electrical box
    (0.15, [(1.5, 0.7, 1.3, 0.0)], 0.40),                             # bus shelter
)


def _fill_frontage_with_furniture(rng: np.random.Generator, front: _Frontage, sidewalk: float,
                                  boxes: List[List[float]], refl: List[float]) -> None:
    """Items near the kerb: they clutter the scene with car-sized and smaller non-car returns."""
    weights = np.array([f[0] for f in _FURNITURE])
    s = float(rng.uniform(3.0, 15.0))
    while s < front.length:
        _, parts, reflectivity = _FURNITURE[int(rng.choice(len(_FURNITURE), p=weights / weights.sum()))]
        # Building lines sit one sidewalk away from the kerb; items stand 0.8 m in from the kerb.
        base = front.origin + front.along * s - front.outward * (sidewalk - 0.8 - parts[0][1])
        along_x = abs(front.along[0]) > 0
        for half_l, half_w, half_h, z_bottom in parts:
            hx, hy = (half_l, half_w) if along_x else (half_w, half_l)
            boxes.append([base[0], base[1], z_bottom + half_h, hx, hy, half_h, 0.0])
            refl.append(reflectivity)
        s += float(rng.uniform(10.0, 25.0))


def _lanes(layout: RoadLayout) -> List[Lane]:
    """Right-hand traffic: +x lanes on the -y side, +y lanes on the +x side."""
    lanes = []
    y_min = -layout.extent if layout.south_arm else -layout.x_half_width
    for k in range(layout.x_lanes):
        offset = (k + 0.5) * layout.lane_width
        lanes.append(Lane(0, 1, -offset, -layout.extent, layout.extent))
        lanes.append(Lane(0, -1, offset, -layout.extent, layout.extent))
    for k in range(layout.y_lanes):
        offset = (k + 0.5) * layout.lane_width
        lanes.append(Lane(1, 1, offset, y_min, layout.extent))
        lanes.append(Lane(1, -1, -offset, y_min, layout.extent))
    return lanes


class _MapTrack(NamedTuple):
    """A candidate vehicle in the map frame, with its positions at every frame."""

    positions: np.ndarray   # (frames, 2)
    yaw: float
    speed_mps: float
    extent: Tuple[float, float, float]
    reflectivity: float


def _vehicle_tracks(rng: np.random.Generator, layout: RoadLayout,
                    config: ToyWorldConfig) -> Tuple[List[_MapTrack], int]:
    """CAVs first (on different junction arms, close enough to cooperate), then the other vehicles.

    Candidates are drawn and rejected when they would leave their road or touch an accepted vehicle
    at any frame: a cheap way to get collision-free, constant-speed traffic through a junction.
    """
    lanes = _lanes(layout)
    times = np.arange(config.frames_per_scenario) * config.frame_interval_s
    accepted: List[_MapTrack] = []
    n_cavs = int(rng.integers(config.min_cavs, config.max_cavs + 1))
    arms = ["W", "E", "N"] + (["S"] if layout.south_arm else [])
    arm_order = [arms[i] for i in rng.permutation(len(arms))]
    for _ in range(400 * n_cavs):
        if len(accepted) == n_cavs:
            break
        arm = arm_order[len(accepted) % len(arm_order)]
        candidate = _cav_candidate(rng, lanes, arm, times)
        if _fits(candidate, accepted, layout) and _near_cavs(candidate, accepted):
            accepted.append(candidate)
    if len(accepted) < config.min_cavs:
        raise RuntimeError("toy world: could not place the CAVs; the placement ranges are inconsistent")
    n_cavs = len(accepted)
    n_total = int(rng.integers(config.min_vehicles, config.max_vehicles + 1))
    for _ in range(60 * n_total):
        if len(accepted) >= n_total:
            break
        candidate = _vehicle_candidate(rng, lanes[int(rng.integers(len(lanes)))], times,
                                       parked=bool(rng.random() < 0.25))
        if _fits(candidate, accepted, layout):
            accepted.append(candidate)
    return accepted, n_cavs


def _draw_kind(rng: np.random.Generator) -> Tuple[Tuple[float, float, float], float]:
    weights = np.array([k[0] for k in _VEHICLE_KINDS])
    _, lengths, widths, heights, refls = _VEHICLE_KINDS[int(rng.choice(len(_VEHICLE_KINDS),
                                                                       p=weights / weights.sum()))]
    extent = (float(rng.uniform(*lengths)) / 2, float(rng.uniform(*widths)) / 2, float(rng.uniform(*heights)) / 2)
    return extent, float(rng.uniform(*refls))


def _make_track(rng: np.random.Generator, lane: Lane, s0: float, speed_mps: float,
                times: np.ndarray) -> _MapTrack:
    extent, reflectivity = _draw_kind(rng)
    # Drivers do not hold the lane heading exactly; the vehicle moves along its own heading.
    yaw = lane.yaw + float(np.radians(rng.normal(0.0, 0.7)))
    start = lane.point(s0)
    step = speed_mps * times
    positions = np.stack([start[0] + step * math.cos(yaw), start[1] + step * math.sin(yaw)], axis=1)
    return _MapTrack(positions, yaw, speed_mps, extent, reflectivity)


def _cav_candidate(rng: np.random.Generator, lanes: Sequence[Lane], arm: str,
                   times: np.ndarray) -> _MapTrack:
    axis = 0 if arm in ("W", "E") else 1
    side = -1.0 if arm in ("W", "S") else 1.0
    road_lanes = [lane for lane in lanes if lane.axis == axis]
    lane = road_lanes[int(rng.integers(len(road_lanes)))]
    s0 = side * float(rng.uniform(*_CAV_DISTANCE_M))
    speed = 0.0 if rng.random() < 0.3 else float(rng.uniform(*_CAV_SPEED_KMH)) / 3.6
    return _make_track(rng, lane, s0, speed, times)


def _vehicle_candidate(rng: np.random.Generator, lane: Lane, times: np.ndarray, parked: bool) -> _MapTrack:
    lo, hi = max(lane.s_min, -_SPAWN_RANGE_M), min(lane.s_max, _SPAWN_RANGE_M)
    speed = 0.0 if parked else float(rng.uniform(*_MOVING_SPEED_KMH)) / 3.6
    return _make_track(rng, lane, float(rng.uniform(lo, hi)), speed, times)


def _fits(candidate: _MapTrack, accepted: Sequence[_MapTrack], layout: RoadLayout) -> bool:
    """On a road at every frame, and never within the collision margin of an accepted vehicle."""
    if not _on_road(candidate, layout):
        return False
    half = _bev_half_sizes(candidate)
    for other in accepted:
        gap = np.abs(candidate.positions - other.positions)
        limit = half + _bev_half_sizes(other) + _COLLISION_MARGIN_M
        if np.any((gap[:, 0] < limit[0]) & (gap[:, 1] < limit[1])):
            return False
    return True


def _bev_half_sizes(track: _MapTrack) -> np.ndarray:
    """Half sizes of the axis-aligned rectangle around the (slightly rotated) footprint."""
    c, s = abs(math.cos(track.yaw)), abs(math.sin(track.yaw))
    return np.array([c * track.extent[0] + s * track.extent[1], s * track.extent[0] + c * track.extent[1]])


def _on_road(track: _MapTrack, layout: RoadLayout) -> bool:
    half = _bev_half_sizes(track)
    x, y = track.positions[:, 0], track.positions[:, 1]
    y_min = -layout.extent if layout.south_arm else -layout.x_half_width
    in_x_road = (np.abs(y) + half[1] <= layout.x_half_width) & (np.abs(x) + half[0] <= layout.extent)
    in_y_road = ((np.abs(x) + half[0] <= layout.y_half_width) & (y - half[1] >= y_min)
                 & (y + half[1] <= layout.extent))
    return bool(np.all(in_x_road | in_y_road))


def _near_cavs(candidate: _MapTrack, cavs: Sequence[_MapTrack]) -> bool:
    return all(np.all(np.linalg.norm(candidate.positions - other.positions, axis=1) < _MAX_CAV_SEPARATION_M)
               for other in cavs)


def _track_to_world(rng: np.random.Generator, track: _MapTrack, vehicle_id: int, map_yaw: float,
                    map_offset: Tuple[float, float]) -> VehicleTrack:
    start = _map_xy_to_world(track.positions[0], map_yaw, map_offset)
    # A small world-frame offset of the box centre, as CARLA's bounding boxes have.
    centre = (float(rng.normal(0.0, 0.05)), float(rng.normal(0.0, 0.05)), track.extent[2])
    return VehicleTrack(vehicle_id=vehicle_id, start_xy=(float(start[0]), float(start[1])),
                        yaw_rad=wrap_angle(track.yaw + map_yaw), speed_mps=track.speed_mps,
                        extent=track.extent, center_offset=centre, reflectivity=track.reflectivity)


def _map_xy_to_world(xy: np.ndarray, map_yaw: float, map_offset: Tuple[float, float]) -> np.ndarray:
    c, s = math.cos(map_yaw), math.sin(map_yaw)
    xy = np.asarray(xy, dtype=np.float64)
    return np.stack([xy[..., 0] * c - xy[..., 1] * s + map_offset[0],
                     xy[..., 0] * s + xy[..., 1] * c + map_offset[1]], axis=-1)


def _boxes_to_world(boxes: np.ndarray, map_yaw: float, map_offset: Tuple[float, float]) -> np.ndarray:
    world = boxes.copy()
    world[:, :2] = _map_xy_to_world(boxes[:, :2], map_yaw, map_offset)
    world[:, 6] = wrap_angle(boxes[:, 6] + map_yaw)
    return world


def lidar_pose(scene: ToyScene, cav_id: int, t: float, lidar: LidarConfig) -> List[float]:
    """[x, y, z, roll, yaw, pitch] (degrees) of a CAV's LiDAR: above the vehicle's reference point."""
    track = scene.track(cav_id)
    loc = track.location(t)
    return [float(loc[0]), float(loc[1]), float(loc[2] + lidar.mount_height_m),
            0.0, float(np.degrees(track.yaw_rad)), 0.0]


@dataclass(frozen=True)
class RoadSideUnit:
    """A static LiDAR on a pole at a junction corner; world frame, the sensor level like the CAVs'."""

    rsu_id: int
    xy: Tuple[float, float]
    yaw_rad: float           # facing the junction centre (a level rotating LiDAR sees all round anyway)
    mount_height_m: float

    def lidar_pose(self) -> List[float]:
        """[x, y, z, roll, yaw, pitch] (degrees), the format of a CAV's ``lidar_pose``."""
        return [self.xy[0], self.xy[1], GROUND_Z + self.mount_height_m, 0.0, float(np.degrees(self.yaw_rad)), 0.0]

    def ground_pose(self) -> List[float]:
        """The pole's foot, the RSU's ``true_ego_pos``."""
        return [self.xy[0], self.xy[1], GROUND_Z, 0.0, float(np.degrees(self.yaw_rad)), 0.0]


# The pole stops this far below the sensor, so the LiDAR sits on top of it and never sees its own pole.
_RSU_POLE_GAP_M = 0.3
_RSU_POLE_HALF_WIDTH_M = 0.15
_RSU_POLE_REFLECTIVITY = 0.5
# The pole stands this far in from both kerbs at the corner: on the sidewalk, clear of the corner building
# (one sidewalk, at least 2.5 m, in from the kerb) and of the furniture (at least 3 m past the corner).
_RSU_KERB_INSET_M = 1.0


def place_rsu(rng: np.random.Generator, scene: ToyScene, rsu: RsuConfig) -> RoadSideUnit:
    """An RSU at one of the two north corners of the junction (a crossing and a T both have them), drawn from
    its own Generator so that adding an RSU changes nothing else of the scenario."""
    lay = scene.layout
    side = 1.0 if rng.random() < 0.5 else -1.0
    corner = np.array([side * (lay.y_half_width + _RSU_KERB_INSET_M), lay.x_half_width + _RSU_KERB_INSET_M])
    xy = _map_xy_to_world(corner, scene.map_yaw, scene.map_offset)
    yaw = wrap_angle(math.atan2(-corner[1], -corner[0]) + scene.map_yaw)
    return RoadSideUnit(rsu_id=rsu.rsu_id, xy=(float(xy[0]), float(xy[1])), yaw_rad=yaw,
                        mount_height_m=rsu.mount_height_m)


def with_rsu_pole(scene: ToyScene, unit: RoadSideUnit) -> ToyScene:
    """The scene with the RSU's pole as one more static box: the CAVs' LiDARs see it (and are hidden by it)."""
    half_h = (unit.mount_height_m - _RSU_POLE_GAP_M) / 2
    pole = [unit.xy[0], unit.xy[1], GROUND_Z + half_h, _RSU_POLE_HALF_WIDTH_M, _RSU_POLE_HALF_WIDTH_M, half_h, 0.0]
    return dataclasses.replace(scene, static_boxes=np.concatenate([scene.static_boxes, [pole]]),
                               static_reflectivity=np.append(scene.static_reflectivity, _RSU_POLE_REFLECTIVITY))


def scene_boxes(scene: ToyScene, t: float, exclude_id: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """All boxes at time t (static first, then vehicles) and their reflectivity; one vehicle can be left
    out (the LiDAR's own car: its body is not modelled, the data pipeline removes such points anyway)."""
    vehicles = [tr for tr in scene.tracks if tr.vehicle_id != exclude_id]
    moving = np.array([tr.box(t) for tr in vehicles]).reshape(-1, 7)
    boxes = np.concatenate([scene.static_boxes, moving])
    refl = np.concatenate([scene.static_reflectivity, [tr.reflectivity for tr in vehicles]])
    return boxes, refl

