"""The toy world's rotating LiDAR: a ray caster against yaw-rotated boxes and a ground plane, and one sweep of it.

Occlusion is real: every ray keeps its nearest hit among all boxes. Nothing here knows scenes or files: a sweep
is a pose, boxes with their reflectivity, and a function giving the ground's reflectivity under a hit.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

# The pose convention of the reader (upstream's x_to_world), so writer and reader cannot disagree.
from opencood_ddp.data.geometry import pose_to_matrix, wrap_angle
from opencood_ddp.toy.config import GROUND_Z, LidarConfig

# Ray targets that are not boxes.
NO_HIT = -1
GROUND = -2


class RayHits(NamedTuple):
    """Nearest hit of each ray: distance (inf when none), target (box index, GROUND or NO_HIT), and the
    cosine of the incidence angle between the ray and the surface normal (0 when none)."""

    distance: np.ndarray
    target: np.ndarray
    cos_incidence: np.ndarray


def cast_rays(origins: np.ndarray, directions: np.ndarray, boxes: np.ndarray, max_range: float,
              ground_z: Optional[float] = GROUND_Z, chunk_elements: int = 1 << 18) -> RayHits:
    """Nearest intersection of every ray with a set of yaw-rotated boxes and the ground plane.

    origins: (3,) or (R, 3); directions: (R, 3) unit vectors; boxes: (M, 7) rows [cx, cy, cz, half_l,
    half_w, half_h, yaw_rad] (yaw about +z, so box sides stay vertical). ground_z None means no ground.
    Rays x boxes are tested at once with the slab method in each box's own frame, in chunks of rays so
    that no temporary exceeds `chunk_elements` entries. Hits beyond max_range do not count.
    """
    directions = np.asarray(directions, dtype=np.float64).reshape(-1, 3)
    origins = np.asarray(origins, dtype=np.float64).reshape(-1, 3)
    n_rays = len(directions)
    distance = np.full(n_rays, np.inf)
    target = np.full(n_rays, NO_HIT, dtype=np.int64)
    cos_incidence = np.zeros(n_rays)
    if ground_z is not None:
        _ground_hits(origins, directions, ground_z, max_range, distance, target, cos_incidence)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
    if len(boxes) == 0 or n_rays == 0:
        return RayHits(distance, target, cos_incidence)
    step = max(1, chunk_elements // len(boxes))
    for start in range(0, n_rays, step):
        rays = slice(start, start + step)
        chunk_origins = origins if len(origins) == 1 else origins[rays]
        t, index, cos_i = _nearest_box_hits(chunk_origins, directions[rays], boxes)
        closer = (t <= max_range) & (t < distance[rays])
        distance[rays] = np.where(closer, t, distance[rays])
        target[rays] = np.where(closer, index, target[rays])
        cos_incidence[rays] = np.where(closer, cos_i, cos_incidence[rays])
    return RayHits(distance, target, cos_incidence)


def _ground_hits(origins: np.ndarray, directions: np.ndarray, ground_z: float, max_range: float,
                 distance: np.ndarray, target: np.ndarray, cos_incidence: np.ndarray) -> None:
    """Fill in hits of downward rays with the plane z = ground_z (in place)."""
    dz = directions[:, 2]
    down = dz < -1e-9
    t = np.full(len(directions), np.inf)
    t[down] = (ground_z - np.broadcast_to(origins[:, 2], dz.shape)[down]) / dz[down]
    hit = down & (t > 0) & (t <= max_range)
    distance[hit] = t[hit]
    target[hit] = GROUND
    cos_incidence[hit] = -dz[hit]


def _nearest_box_hits(origins: np.ndarray, directions: np.ndarray,
                      boxes: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slab test of rays (r) against boxes (M): entry distance, box index and entry cosine per ray."""
    cos_yaw, sin_yaw = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    rel_x = origins[:, None, 0] - boxes[None, :, 0]
    rel_y = origins[:, None, 1] - boxes[None, :, 1]
    # Rotate by -yaw into each box's frame; z needs no rotation because boxes only yaw.
    local_o = (rel_x * cos_yaw + rel_y * sin_yaw,
               -rel_x * sin_yaw + rel_y * cos_yaw,
               origins[:, None, 2] - boxes[None, :, 2])
    dx, dy = directions[:, None, 0], directions[:, None, 1]
    local_d = (dx * cos_yaw + dy * sin_yaw, -dx * sin_yaw + dy * cos_yaw,
               np.broadcast_to(directions[:, None, 2], (len(directions), len(boxes))))
    t_enter, t_exit = [], []
    for axis in range(3):
        d = local_d[axis]
        # A ray parallel to a slab gets a tiny slope instead: +-huge limits keep the test exact.
        inv = 1.0 / np.where(np.abs(d) < 1e-12, 1e-12, d)
        t1 = (-boxes[:, 3 + axis] - local_o[axis]) * inv
        t2 = (boxes[:, 3 + axis] - local_o[axis]) * inv
        t_enter.append(np.minimum(t1, t2))
        t_exit.append(np.maximum(t1, t2))
    near = np.maximum(np.maximum(t_enter[0], t_enter[1]), t_enter[2])
    far = np.minimum(np.minimum(t_exit[0], t_exit[1]), t_exit[2])
    # Rays starting inside a box do not see it (a sensor inside its own car sees out).
    t = np.where((near <= far) & (near > 1e-6), near, np.inf)
    index = np.argmin(t, axis=1)
    rows = np.arange(len(index))
    best = t[rows, index]
    # The face entered is the slab whose entry distance is the largest; its normal is that local axis.
    entry_axis = np.argmax(np.stack([t_enter[a][rows, index] for a in range(3)]), axis=0)
    cos_i = np.abs(np.stack([local_d[a][rows, index] for a in range(3)]))[entry_axis, rows]
    return best, index, cos_i


def lidar_directions(lidar: LidarConfig) -> np.ndarray:
    """Unit ray directions in the sensor frame, shape (beams, azimuth_steps, 3), x forward, z up."""
    elevation = np.radians(np.linspace(lidar.fov_down_deg, lidar.fov_up_deg, lidar.beams))
    azimuth = _column_azimuths(lidar)
    cos_e = np.cos(elevation)[:, None]
    return np.stack([cos_e * np.cos(azimuth)[None, :],
                     cos_e * np.sin(azimuth)[None, :],
                     np.broadcast_to(np.sin(elevation)[:, None], (lidar.beams, lidar.azimuth_steps))],
                    axis=-1)


def _column_azimuths(lidar: LidarConfig) -> np.ndarray:
    # Half a step off zero so no column points exactly along a box face of an axis-aligned scene.
    return (np.arange(lidar.azimuth_steps) + 0.5) * (2.0 * np.pi / lidar.azimuth_steps) - np.pi


def simulate_scan(pose: Sequence[float], boxes: np.ndarray, reflectivity: np.ndarray,
                  ground_reflectivity: Callable[[np.ndarray], np.ndarray], lidar: LidarConfig,
                  rng: np.random.Generator) -> np.ndarray:
    """One LiDAR sweep: (N, 4) float32 [x, y, z, intensity] in the sensor frame of `pose`.

    Rays are cast in the world frame. Boxes are first culled per azimuth sector (a box only meets the
    rays whose azimuth lies within the angle it subtends), which keeps rays x boxes small without
    changing the result. Range noise, dropout and intensity noise come from `rng`.
    """
    sensor_to_world = pose_to_matrix(np.asarray(pose, dtype=np.float64))
    dirs_sensor = lidar_directions(lidar)
    dirs_world = dirs_sensor @ sensor_to_world[:3, :3].T
    origin = sensor_to_world[:3, 3]
    hits = _cast_by_sector(origin, dirs_world, boxes, lidar)
    distance, target, cos_i = (a.reshape(-1) for a in hits)
    dirs_sensor = dirs_sensor.reshape(-1, 3)
    keep = (target != NO_HIT) & (rng.random(len(target)) >= lidar.dropout)
    distance, target, cos_i, dirs_sensor = distance[keep], target[keep], cos_i[keep], dirs_sensor[keep]
    noisy = distance + rng.normal(0.0, lidar.range_noise_std_m, len(distance))
    points = dirs_sensor * noisy[:, None]
    refl = np.empty(len(target))
    on_ground = target == GROUND
    hit_world = origin + (dirs_sensor[on_ground] * distance[on_ground, None]) @ sensor_to_world[:3, :3].T
    refl[on_ground] = ground_reflectivity(hit_world[:, :2])
    refl[~on_ground] = reflectivity[target[~on_ground]]
    intensity = _intensity(refl, cos_i, distance, lidar, rng)
    return np.concatenate([points, intensity[:, None]], axis=1).astype(np.float32)


def _intensity(refl: np.ndarray, cos_i: np.ndarray, distance: np.ndarray, lidar: LidarConfig,
               rng: np.random.Generator) -> np.ndarray:
    """Lambert-like return: reflectivity x incidence, attenuated with range, plus noise, in [0, 1]."""
    value = refl * (0.3 + 0.7 * cos_i) * np.exp(-distance / 200.0)
    value = value + rng.normal(0.0, lidar.intensity_noise_std, len(value))
    return np.clip(value, 0.0, 1.0)


def _cast_by_sector(origin: np.ndarray, dirs_world: np.ndarray, boxes: np.ndarray, lidar: LidarConfig,
                    columns_per_sector: int = 32) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cast_rays over azimuth sectors, each against the boxes that can meet it.

    Assumes a level sensor (all beams of a column share one world azimuth), which is what the toy mounts.
    """
    beams, steps, _ = dirs_world.shape
    distance = np.full((beams, steps), np.inf)
    target = np.full((beams, steps), NO_HIT, dtype=np.int64)
    cos_i = np.zeros((beams, steps))
    box_centre, box_half, reachable = _box_azimuth_spans(origin, boxes, lidar.max_range_m)
    col_azimuth = np.arctan2(dirs_world[0, :, 1], dirs_world[0, :, 0])
    half_column = math.pi / steps
    for start in range(0, steps, columns_per_sector):
        cols = slice(start, min(start + columns_per_sector, steps))
        first, last = col_azimuth[cols][0], col_azimuth[cols][-1]
        sector_half = abs(wrap_angle(last - first)) / 2 + half_column
        sector_centre = first + wrap_angle(last - first) / 2
        near = reachable & (np.abs(wrap_angle(box_centre - sector_centre)) <= box_half + sector_half)
        index = np.flatnonzero(near)
        hits = cast_rays(origin, dirs_world[:, cols].reshape(-1, 3), boxes[index], lidar.max_range_m)
        shape = (beams, cols.stop - cols.start)
        distance[:, cols] = hits.distance.reshape(shape)
        box_hit = hits.target >= 0
        mapped = hits.target.copy()
        mapped[box_hit] = index[hits.target[box_hit]]
        target[:, cols] = mapped.reshape(shape)
        cos_i[:, cols] = hits.cos_incidence.reshape(shape)
    return distance, target, cos_i


def _box_azimuth_spans(origin: np.ndarray, boxes: np.ndarray,
                       max_range: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Azimuth centre and half-span each box subtends from the origin, and whether it is in range."""
    corners = _bev_corners(boxes) - origin[None, None, :2]            # (M, 4, 2)
    centre_rel = boxes[:, :2] - origin[:2]
    centre = np.arctan2(centre_rel[:, 1], centre_rel[:, 0])
    offsets = wrap_angle(np.arctan2(corners[..., 1], corners[..., 0]) - centre[:, None])
    lo, hi = offsets.min(axis=1), offsets.max(axis=1)
    span_centre = wrap_angle(centre + (lo + hi) / 2)
    half = (hi - lo) / 2
    radius = np.hypot(boxes[:, 3], boxes[:, 4])
    distance = np.hypot(centre_rel[:, 0], centre_rel[:, 1])
    # Seen from inside its footprint a box can be anywhere around: give it the full circle.
    inside = distance <= radius
    half = np.where(inside, 2 * np.pi, half)
    return span_centre, half, distance - radius <= max_range


def _bev_corners(boxes: np.ndarray) -> np.ndarray:
    signs = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], dtype=np.float64)
    local = signs[None] * boxes[:, None, 3:5]
    c, s = np.cos(boxes[:, 6])[:, None], np.sin(boxes[:, 6])[:, None]
    return np.stack([boxes[:, None, 0] + local[..., 0] * c - local[..., 1] * s,
                     boxes[:, None, 1] + local[..., 0] * s + local[..., 1] * c], axis=-1)
