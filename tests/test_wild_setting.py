"""Robustness settings: communication delay and localisation error (data/wild.py and the three datasets).

Every expected value is derived here by hand from the facts (docs/compatibility.md, "Robustness settings"), not
from upstream's code: a pose [x, y, z, roll, yaw, pitch] with roll = pitch = 0 is the turn about z by the yaw
plus the translation; ``x1_to_x2(a, b) = inv(T_b) @ T_a``; upstream's noise is numpy's legacy stream after
``np.random.seed(seed)``, which ``RandomState(seed)`` also starts; our per-sample noise is numpy's Generator
seeded by the documented key ``[seed, epoch, index, wild seed, CAV slot, frame lag, purpose]``.

The frames are a hand-made OPV2V scenario: an ego (100), a CAV (200) and a road-side unit (-1) over three
timestamps; each cloud's intensity marks its CAV and frame, so that a projected point tells where it came from.
"""
from __future__ import annotations

import copy
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from launch import one_line_error
from zoo import hypes_of
from opencood_ddp.data import opv2v, wild
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.geometry import pose_to_matrix
from opencood_ddp.data.pcd import write_pcd
from opencood_ddp.errors import ConfigError
from opencood_ddp.postprocess.voxel_postprocessor import VoxelPostprocessor
from opencood_ddp.schema import unknown_keys
from opencood_ddp.tasks.opencood import TASK_KEYS

SEED = 3

STAMPS = ("000068", "000070", "000072")
EGO, CAV, RSU = "100", "200", "-1"
SLOTS = {EGO: 0, CAV: 1, RSU: 2}
# (x, y, z, yaw in degrees) per frame; roll = pitch = 0. The ego turns, so that its delayed pose differs.
POSES = {
    EGO: [(0.0, 0.0, 1.9, 20.0), (2.0, 0.0, 1.9, 10.0), (4.0, 0.0, 1.9, 0.0)],
    CAV: [(10.0, 5.0, 1.9, 90.0), (13.0, 6.0, 1.9, 80.0), (16.0, 7.0, 1.9, 70.0)],
    RSU: [(-20.0, -10.0, 5.0, 45.0)] * 3,
}
SPEEDS = {EGO: (36.0, 54.0, 72.0), CAV: (18.0, 36.0, 54.0), RSU: (0.0, 0.0, 0.0)}

# The ground truth of the last frame in the ego's frame there (4, 0, 1.9, yaw 0), by hand: [x, y, z, h, w, l, yaw].
GT_NOW = {7: [20.0, 3.0, -1.0, 1.56, 1.6, 4.0, 0.0],
          9: [21.0, -10.0, -1.0, 1.6, 1.8, 4.4, math.radians(30.0)],
          11: [-19.0, -13.0, -1.0, 1.56, 1.6, 4.0, 0.0]}

# V2X-ViT's "Noisy" setting with a one-frame delay.
NOISY = {"async": True, "async_mode": "sim", "async_overhead": 100, "seed": 25, "loc_err": True, "xyz_std": 0.2,
         "ryp_std": 0.2, "data_size": 1.06, "transmission_speed": 27, "backbone_delay": 10}


# ------------------------------------------------------------------------------------------- hand geometry


def matrix(pose) -> np.ndarray:
    x, y, z, yaw = pose
    c, s = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
    return np.array([[c, -s, 0, x], [s, c, 0, y], [0, 0, 1, z], [0, 0, 0, 1]], dtype=np.float64)


def inverse(m: np.ndarray) -> np.ndarray:
    """A rigid transform's inverse: [R^T, -R^T t]."""
    out = np.identity(4)
    out[:3, :3] = m[:3, :3].T
    out[:3, 3] = -m[:3, :3].T @ m[:3, 3]
    return out


def x1_to_x2(pose1, pose2) -> np.ndarray:
    return inverse(matrix(pose2)) @ matrix(pose1)


def moved(pose, dx=0.0, dy=0.0, dz=0.0, dyaw=0.0):
    return (pose[0] + dx, pose[1] + dy, pose[2] + dz, pose[3] + dyaw)


def upstream_offset(seed: int = 25, std: float = 0.2):
    """(dx, dy, dz, dyaw) that np.random.seed(seed) then normal(0, std, 3) twice gives, the yaw being the
    second angle."""
    state = np.random.RandomState(seed)
    xyz = state.normal(0, std, 3)
    angles = state.normal(0, std, 3)
    return xyz[0], xyz[1], xyz[2], angles[1]


def apply(m: np.ndarray, points: np.ndarray) -> np.ndarray:
    return points[:, :3] @ m[:3, :3].T + m[:3, 3]


# ------------------------------------------------------------------------------------------- the frames


def marker(cav: str, frame: int) -> float:
    return (10 * SLOTS[cav] + frame + 1) / 255  # a whole byte: the pcd stores intensity as round(i * 255)


def points_of(cav: str, frame: int) -> np.ndarray:
    z = -3.5 if cav == RSU else -1.0  # the RSU's LiDAR is 5 m up
    i = marker(cav, frame)
    return np.array([[5, 3, z, i], [8, -4, z + 0.5, i], [-6, 5, z + 0.3, i]], dtype=np.float32)


def car(x: float, y: float, yaw: float, extent) -> dict:
    return {"location": [x, y, 0.9], "center": [0.0, 0.0, 0.0], "angle": [0.0, yaw, 0.0], "extent": extent,
            "speed": 0.0}


def vehicles_of(cav: str, frame: int) -> dict:
    seven = car(20.0 + 2 * frame, 3.0, 0.0, [2.0, 0.8, 0.78])
    if cav == EGO:
        return {7: seven}
    if cav == CAV:  # 9 moves 5 m a frame: its box tells which frame the ground truth came from
        return {7: seven, 9: car(15.0 + 5 * frame, -10.0, 30.0, [2.2, 0.9, 0.8])}
    return {11: car(-15.0, -15.0 + frame, 0.0, [2.0, 0.8, 0.78])}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The split folder of the hand-made scenario, in OPV2V's layout."""
    split = tmp_path_factory.mktemp("wild") / "train"
    scenario = split / "2021_08_20_21_10_24"
    for cav in (EGO, CAV, RSU):
        (scenario / cav).mkdir(parents=True)
        for frame, stamp in enumerate(STAMPS):
            x, y, z, yaw = POSES[cav][frame]
            params = {"lidar_pose": [x, y, z, 0.0, yaw, 0.0], "ego_speed": SPEEDS[cav][frame],
                      "vehicles": vehicles_of(cav, frame)}
            (scenario / cav / f"{stamp}.yaml").write_text(yaml.safe_dump(params))
            write_pcd(scenario / cav / f"{stamp}.pcd", points_of(cav, frame))
    return split


def hypes_for(split: Path, kind: str, *overrides: str, wild_setting=None, noise_setting=None) -> dict:
    """The toy config of `kind` reading `split` as each of its splits, with the blocks given."""
    blocks = {key: value for key, value in (("wild_setting", wild_setting), ("noise_setting", noise_setting))
              if value is not None}
    return hypes_of(f"toy/point_pillar_{kind}_fusion", f"root_dir={split}", f"validate_dir={split}",
                    f"test_dir={split}", *overrides, **blocks)


def dataset(split: Path, kind: str, *overrides: str, **blocks):
    return build_dataset(hypes_for(split, kind, *overrides, **blocks), "train", False, SEED, visualize=True)


def cloud_of(lidar: np.ndarray, cav: str, frame: int) -> np.ndarray:
    """The xyz rows of a projected cloud that came from ``cav`` at ``frame``, sorted."""
    rows = lidar[np.isclose(lidar[:, 3], marker(cav, frame), atol=1e-6)][:, :3]
    return rows[np.lexsort(rows.T[::-1])]


def expected_cloud(cav: str, frame: int, to_ego: np.ndarray) -> np.ndarray:
    rows = apply(to_ego, points_of(cav, frame).astype(np.float64))
    return rows[np.lexsort(rows.T[::-1])]


def boxes_by_id(ego: dict) -> dict:
    center, mask = np.asarray(ego["object_bbx_center"]), np.asarray(ego["object_bbx_mask"])
    return dict(zip(ego["object_ids"], center[mask == 1]))


def assert_gt_is_now(ego: dict) -> None:
    boxes = boxes_by_id(ego)
    assert sorted(boxes) == sorted(GT_NOW)
    for object_id, box in GT_NOW.items():
        np.testing.assert_allclose(boxes[object_id], box, atol=1e-6, err_msg=str(object_id))


# ------------------------------------------------------------------------------------------- pure functions


def test_delay_in_frames_for_sim_and_real():
    sim = wild.DelaySetting(enabled=True, mode="sim", overhead_ms=100)
    assert wild.delay_frames(sim, ego=False) == 1 and wild.delay_frames(sim, ego=True) == 0
    assert wild.delay_frames(wild.DelaySetting(True, "sim", 250), ego=False) == 2
    assert wild.delay_frames(wild.DelaySetting(True, "sim", 99.9), ego=False) == 0
    assert wild.delay_frames(wild.DelaySetting(False, "sim", 300), ego=False) == 0  # async false: no delay
    real = wild.DelaySetting(True, "real", 300, data_size_mb=1.06, transmission_speed_mbps=27, backbone_delay_ms=10)
    # int(205.4906 + 1.06 / 27 * 1000 + 10) = int(254.75) = 254 ms -> 2 frames
    assert wild.delay_ms(real, 205.4906) == 254 and wild.delay_frames(real, False, 205.4906) == 2
    # int(40.0 + 39.259 + 10) = 89 ms -> 0 frames; int() truncates before the floor division
    assert wild.delay_ms(real, 40.0) == 89 and wild.delay_frames(real, False, 40.0) == 0
    assert wild.delay_frames(real, False, 50.75) == 1  # int(100.009) = 100 ms


def test_a_delay_is_clamped_at_the_scenarios_first_frame():
    assert [wild.clamp_delay(position, 2) for position in range(4)] == [0, 1, 2, 2]
    assert wild.clamp_delay(5, 0) == 0


def test_upstream_offset_is_the_reseeded_draw_and_leaves_numpys_global_rng_alone():
    before = np.random.get_state()
    offset = wild.upstream_loc_noise(25, 0.2, 0.2)
    after = np.random.get_state()
    assert np.array_equal(before[1], after[1]) and before[2:] == after[2:]
    np.testing.assert_allclose(offset[[0, 1, 2, 4]], [0.0457, 0.2054, -0.1679, -0.1914], atol=5e-5)
    assert offset[3] == 0 and offset[5] == 0  # roll and pitch are drawn but never applied
    np.testing.assert_array_equal(offset[[0, 1, 2, 4]], upstream_offset())


def test_upstream_real_delays_replay_the_stream_after_the_reseed():
    """Upstream's order per CAV: its delay draw, then two reseeded noise draws. The first non-ego CAV draws from
    numpy's state as earlier work left it (ours: the sample's generator); later ones from the reseeded stream."""
    delay = wild.DelaySetting(True, "real", 300, 1.06, 27, 10)
    noise = wild.NoiseSetting("upstream", 0.2, 0.2, 0.2)
    setting = wild.WildSetting(delay, noise, seed=25)
    key = wild.SampleKey(SEED, 0, 2)
    state = np.random.RandomState(25)
    state.normal(0, 0.2, 3), state.normal(0, 0.2, 3)
    replayed = state.uniform(0, 300)  # 205.49: the same for every CAV after the first
    first = np.random.default_rng([SEED, 0, 2, 25, 1, 0, wild.DELAY_DRAWS]).uniform(0, 300)
    frames = [int(draw + 1.06 / 27 * 1000 + 10) // 100 for draw in (first, replayed, replayed)]
    assert wild.sample_delays(setting, 4, 9, key) == [0] + frames
    assert frames[1:] == [2, 2]
    assert wild.sample_delays(setting, 4, 1, key) == [0, min(frames[0], 1), 1, 1]  # clamped at position 1
    # Without loc_err nothing reseeds: every CAV's draw is its own.
    own = wild.sample_delays(wild.WildSetting(delay, None, 25), 3, 9, key)
    assert own == [0] + [int(np.random.default_rng([SEED, 0, 2, 25, slot, 0, wild.DELAY_DRAWS]).uniform(0, 300)
                             + 1.06 / 27 * 1000 + 10) // 100 for slot in (1, 2)]


def test_per_sample_noise_is_numpys_generator_under_the_documented_key():
    noise = wild.NoiseSetting("per_sample", xy_std=0.2, z_std=0.2, yaw_std=0.3)
    setting = wild.WildSetting(noise=noise, seed=25)
    key = wild.SampleKey(SEED, 4, 17)
    rng = np.random.default_rng([SEED, 4, 17, 25, 2, 1, wild.NOISE_DRAWS])
    xy, z, yaw = rng.normal(0, 0.2, 2), rng.normal(0, 0.2), rng.normal(0, 0.3)
    np.testing.assert_array_equal(wild.pose_offset(setting, 2, 1, key), [xy[0], xy[1], z, 0, yaw, 0])
    assert wild.pose_offset(setting, 0, 0, key) is None  # wild_setting never perturbs the ego
    offsets = {(slot, lag, index): tuple(wild.pose_offset(setting, slot, lag, wild.SampleKey(SEED, 4, index)))
               for slot in (1, 2) for lag in (0, 1) for index in (16, 17)}
    assert len(set(offsets.values())) == len(offsets), "independent per CAV, frame and sample"
    heal = wild.NoiseSetting("per_sample", 0.5, 0.0, 2.0, xy_mean=0.1, yaw_mean=0.5, laplace=True, include_ego=True)
    rng = np.random.default_rng([SEED, 4, 17, 0, 0, 0, wild.NOISE_DRAWS])
    xy, yaw = rng.laplace(0.1, 0.5, 2), rng.laplace(0.5, 2.0)
    np.testing.assert_array_equal(wild.pose_offset(wild.WildSetting(noise=heal), 0, 0, key),
                                  [xy[0], xy[1], 0, 0, yaw, 0])


def test_a_4x4_pose_is_perturbed_like_its_6_vector():
    pose = np.array([12.0, -3.0, 1.7, 2.0, 33.0, -4.0])
    offset = np.array([0.3, -0.2, 0.1, 0.0, 1.5, 0.0])
    np.testing.assert_allclose(wild.perturb_matrix(pose_to_matrix(pose), offset),
                               pose_to_matrix(wild.perturb_pose(pose, offset)), atol=1e-12)
    with pytest.raises(ValueError):
        wild.perturb_matrix(np.identity(4), np.array([0, 0, 0, 1.0, 0, 0]))


def test_the_index_reads_a_cav_at_an_earlier_timestamp_once(world, monkeypatch):
    index = opv2v.scan_split(world)
    scenario, position = index.locate_position(2)
    assert (scenario.name, position) == ("2021_08_20_21_10_24", 2) and index.locate(2)[1] == STAMPS[2]
    calls = []
    real_load = opv2v.load_opv2v_yaml
    monkeypatch.setattr(opv2v, "load_opv2v_yaml", lambda path: calls.append(path) or real_load(path))
    frames = opv2v.ScenarioFrames(scenario, position)
    then = frames.frame(SLOTS[CAV], 2)
    assert frames.frame(SLOTS[CAV], 2) is then and len(calls) == 1
    assert then.meta_path.name == f"{STAMPS[0]}.yaml" and then.lidar_pose[0] == POSES[CAV][0][0]
    assert frames.frame(0).ego and not then.ego
    with pytest.raises(ValueError):
        frames.frame(SLOTS[CAV], 3)  # before the scenario's first frame


# ------------------------------------------------------------------------------------------- upstream mode


def test_intermediate_upstream_mode_to_the_delayed_ego_pose(world):
    """V2X-ViT's setting: one frame of delay, upstream's offset on the non-ego poses, cur_ego_pose_flag false."""
    state = np.random.get_state()
    ego = dataset(world, "intermediate", "fusion.args.cur_ego_pose_flag=false", wild_setting=NOISY)[2]["ego"]
    assert np.array_equal(np.random.get_state()[1], state[1]), "numpy's global RNG is not touched"
    dx, dy, dz, dyaw = upstream_offset()
    ego_then, ego_now = POSES[EGO][1], POSES[EGO][2]
    to_ego = {EGO: x1_to_x2(ego_now, ego_now),
              CAV: x1_to_x2(moved(POSES[CAV][1], dx, dy, dz, dyaw), ego_then),
              RSU: x1_to_x2(moved(POSES[RSU][1], dx, dy, dz, dyaw), ego_then)}
    sent = {EGO: 2, CAV: 1, RSU: 1}
    for cav in (EGO, CAV, RSU):  # the delayed CAVs' clouds come from frame 1, projected with the noisy poses
        np.testing.assert_allclose(cloud_of(ego["origin_lidar"], cav, sent[cav]),
                                   expected_cloud(cav, sent[cav], to_ego[cav]), atol=2e-5, err_msg=cav)
    correction = x1_to_x2(ego_then, ego_now)
    np.testing.assert_allclose(ego["spatial_correction_matrix"],
                               [np.identity(4), correction, correction, np.identity(4), np.identity(4)], atol=1e-12)
    np.testing.assert_allclose(ego["prior_encoding"], np.array(
        [[72 / 30, 0, 0], [36 / 30, 1, 0], [0, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=np.float32))
    assert ego["prior_encoding"].dtype == np.float32
    assert_gt_is_now(ego)
    np.testing.assert_allclose(ego["cav_positions"], [m[:3, 3] for m in to_ego.values()], atol=1e-5)


def test_intermediate_transformation_matrices_without_proj_first(world):
    dx, dy, dz, dyaw = upstream_offset()
    for flag, reference in (("false", POSES[EGO][1]), ("true", POSES[EGO][2])):
        ego = dataset(world, "intermediate", "fusion.args.proj_first=false",
                      f"fusion.args.cur_ego_pose_flag={flag}", wild_setting=NOISY)[2]["ego"]
        t = [x1_to_x2(POSES[EGO][2], POSES[EGO][2]),
             x1_to_x2(moved(POSES[CAV][1], dx, dy, dz, dyaw), reference),
             x1_to_x2(moved(POSES[RSU][1], dx, dy, dz, dyaw), reference)]
        pairwise = ego["pairwise_t_matrix"]
        for i in range(3):
            for j in range(3):
                expected = np.identity(4) if i == j else inverse(t[j]) @ t[i]  # HEAL's identity diagonal
                np.testing.assert_allclose(pairwise[i, j], expected, atol=1e-9, err_msg=f"{flag} {i}->{j}")
        correction = x1_to_x2(POSES[EGO][1], POSES[EGO][2]) if flag == "false" else np.identity(4)
        np.testing.assert_allclose(ego["spatial_correction_matrix"][1], correction, atol=1e-12)
        assert_gt_is_now(ego)


def test_the_first_frame_is_never_delayed_and_the_second_reads_the_first(world):
    data = dataset(world, "intermediate", wild_setting=NOISY)
    assert [c.time_delay for c in data.received_cavs(0)] == [0, 0, 0]
    assert [c.sent.meta_path.name for c in data.received_cavs(0)] == [f"{STAMPS[0]}.yaml"] * 3
    one = data.received_cavs(1)
    assert [c.time_delay for c in one] == [0, 1, 1]
    assert [c.sent.meta_path.name for c in one] == [f"{STAMPS[1]}.yaml", f"{STAMPS[0]}.yaml", f"{STAMPS[0]}.yaml"]
    assert all(c.current.meta_path.name == f"{STAMPS[1]}.yaml" for c in one)
    np.testing.assert_allclose(data[1]["ego"]["prior_encoding"][:3, 1], [0, 1, 1])


def test_upstreams_real_delay_on_the_dataset(world):
    setting = dict(NOISY, async_mode="real", async_overhead=300)
    data = dataset(world, "intermediate", wild_setting=setting)
    cavs = data.received_cavs(2)
    # The RSU follows the reseeded stream: 2 frames (see the pure test), so it sends frame 0.
    assert cavs[2].time_delay == 2 and cavs[2].sent.meta_path.name == f"{STAMPS[0]}.yaml"
    first = np.random.default_rng([SEED, 0, 2, 25, 1, 0, wild.DELAY_DRAWS]).uniform(0, 300)
    assert cavs[1].time_delay == min(2, int(first + 1.06 / 27 * 1000 + 10) // 100)


def test_early_fusion_in_upstream_mode_delays_but_projects_with_true_poses(world):
    """Upstream's early dataset reads the true (delayed) pose, not the noisy transformation_matrix."""
    ego = dataset(world, "early", wild_setting=NOISY)[2]["ego"]
    ego_now = POSES[EGO][2]
    for cav, frame in ((EGO, 2), (CAV, 1), (RSU, 1)):
        np.testing.assert_allclose(cloud_of(ego["origin_lidar"], cav, frame),
                                   expected_cloud(cav, frame, x1_to_x2(POSES[cav][frame], ego_now)), atol=2e-5)
    assert_gt_is_now(ego)


def test_late_fusion_in_upstream_mode_places_the_current_gt_in_the_sent_frame(world):
    sample = dataset(world, "late", wild_setting=NOISY)[2]
    entry = sample[CAV]
    to_ego = x1_to_x2(POSES[CAV][1], POSES[EGO][2])  # true poses, as upstream's late dataset
    np.testing.assert_allclose(entry["transformation_matrix"], to_ego, atol=1e-9)
    assert "transformation_matrix_clean" not in entry
    box = boxes_by_id(entry)[9]  # the current frame's box, in the CAV's frame of the delayed frame
    np.testing.assert_allclose(apply(to_ego, box[None, :3].astype(np.float64))[0], GT_NOW[9][:3], atol=1e-6)
    np.testing.assert_allclose(cloud_of(entry["origin_lidar"], CAV, 1),
                               expected_cloud(CAV, 1, np.identity(4)), atol=1e-6)


def test_late_fusion_training_reads_the_chosen_cavs_delayed_frame(world):
    data = build_dataset(hypes_for(world, "late", wild_setting=NOISY), "train", True, SEED)
    seed = next(s for s in range(100) if np.random.default_rng(s).integers(3) == SLOTS[CAV])
    sent, current, slot = data.random_cav(2, np.random.default_rng(seed))
    assert (sent.cav_id, sent.meta_path.name, current.meta_path.name) == (CAV, f"{STAMPS[1]}.yaml",
                                                                          f"{STAMPS[2]}.yaml")
    entry = data.process_cav(sent, current, slot, np.random.default_rng(0), 2)
    # object 9 now: (25, -10, 0.9), yaw 30, seen from the CAV's sent pose (frame 1, yaw 80)
    centre = inverse(matrix(POSES[CAV][1])) @ np.array([25.0, -10.0, 0.9, 1.0])
    np.testing.assert_allclose(boxes_by_id(entry)[9], [*centre[:3], 1.6, 1.8, 4.4, math.radians(30 - 80)],
                               atol=1e-6)


# ------------------------------------------------------------------------------------------- per_sample mode


def test_per_sample_noise_is_the_same_in_any_reading_order_and_copy(world):
    setting = dict(NOISY, loc_err_mode="per_sample")
    data = dataset(world, "intermediate", "fusion.args.proj_first=false", wild_setting=setting)
    forward = [data[i]["ego"] for i in range(3)]
    worker = pickle.loads(pickle.dumps(data))  # a DataLoader worker's copy, read backwards
    backward = [worker[i]["ego"] for i in reversed(range(3))][::-1]
    for a, b in zip(forward, backward):
        for key in ("pairwise_t_matrix", "spatial_correction_matrix", "prior_encoding", "object_bbx_center"):
            assert np.array_equal(a[key], b[key]), key
        for key in a["processed_lidar"]:
            assert all(np.array_equal(x, y) for x, y in zip(a["processed_lidar"][key], b["processed_lidar"][key]))
    # By hand: the CAV's sent pose (frame 1) plus its own draw; the ego keeps its true pose.
    rng = np.random.default_rng([SEED, 0, 2, 25, SLOTS[CAV], 1, wild.NOISE_DRAWS])
    xy, z, yaw = rng.normal(0, 0.2, 2), rng.normal(0, 0.2), rng.normal(0, 0.2)
    expected = x1_to_x2(moved(POSES[CAV][1], xy[0], xy[1], z, yaw), POSES[EGO][2])
    np.testing.assert_allclose(forward[2]["pairwise_t_matrix"][1, 0], expected, atol=1e-9)
    # CAVs and frames get different errors; so does another epoch.
    offsets = [wild.pose_offset(data.wild, slot, 1, wild.SampleKey(SEED, 0, 2)) for slot in (1, 2)]
    assert not np.array_equal(*offsets)
    assert not np.array_equal(forward[1]["pairwise_t_matrix"][1, 0], forward[2]["pairwise_t_matrix"][1, 0])
    other = copy.deepcopy(data)
    other.set_epoch(1)
    assert not np.array_equal(other[2]["ego"]["pairwise_t_matrix"][1, 0], forward[2]["pairwise_t_matrix"][1, 0])
    assert_gt_is_now(forward[2])


def test_per_sample_noise_reaches_early_fusion(world):
    setting = dict(NOISY, loc_err_mode="per_sample")
    ego = dataset(world, "early", wild_setting=setting)[2]["ego"]
    rng = np.random.default_rng([SEED, 0, 2, 25, SLOTS[CAV], 1, wild.NOISE_DRAWS])
    xy, z, yaw = rng.normal(0, 0.2, 2), rng.normal(0, 0.2), rng.normal(0, 0.2)
    to_ego = x1_to_x2(moved(POSES[CAV][1], xy[0], xy[1], z, yaw), POSES[EGO][2])
    np.testing.assert_allclose(cloud_of(ego["origin_lidar"], CAV, 1), expected_cloud(CAV, 1, to_ego), atol=2e-5)
    assert_gt_is_now(ego)


# --------------------------------------------------------------- loc_err_mode v2xvit: the V2X-ViT repository's


def test_early_fusion_in_v2xvit_mode_projects_every_non_ego_cloud_with_upstreams_offset(world):
    """The V2X-ViT repository's early dataset reads reform_param's transformation_matrix: the CAV's delayed pose
    with upstream's one reseeded offset (its Noisy column); the ego's cloud and the ground truth stay true."""
    ego = dataset(world, "early", wild_setting=dict(NOISY, loc_err_mode="v2xvit"))[2]["ego"]
    ego_now = POSES[EGO][2]
    np.testing.assert_allclose(cloud_of(ego["origin_lidar"], EGO, 2),
                               expected_cloud(EGO, 2, x1_to_x2(ego_now, ego_now)), atol=2e-5)
    for cav in (CAV, RSU):
        noisy = x1_to_x2(moved(POSES[cav][1], *upstream_offset()), ego_now)
        np.testing.assert_allclose(cloud_of(ego["origin_lidar"], cav, 1), expected_cloud(cav, 1, noisy), atol=2e-5)
    assert_gt_is_now(ego)


def test_late_fusion_in_v2xvit_mode_moves_the_gt_with_the_noisy_current_pose(world):
    """The V2X-ViT repository's late dataset: detections go to the ego by the noisy delayed pose, and each CAV's
    ground truth, placed in its delayed true frame, by gt_transformation_matrix, x1_to_x2(its noisy *current*
    pose, the ego's), which the post-processor reads (as transformation_matrix_clean, HEAL's name)."""
    data = dataset(world, "late", wild_setting=dict(NOISY, loc_err_mode="v2xvit"))
    entry, offset = data[2][CAV], upstream_offset()
    np.testing.assert_allclose(entry["transformation_matrix"],
                               x1_to_x2(moved(POSES[CAV][1], *offset), POSES[EGO][2]), atol=1e-9)
    gt_matrix = x1_to_x2(moved(POSES[CAV][2], *offset), POSES[EGO][2])
    np.testing.assert_allclose(entry["transformation_matrix_clean"], gt_matrix, atol=1e-9)
    box = boxes_by_id(entry)[9]  # the current frame's box in the CAV's delayed true frame, as in upstream mode
    upstream_mode = dataset(world, "late", wild_setting=NOISY)[2][CAV]
    np.testing.assert_array_equal(box, boxes_by_id(upstream_mode)[9])
    post = VoxelPostprocessor(hypes_for(world, "late")["postprocess"], train=False)
    gt = post.generate_gt_bbx(data.collate_batch_test([data[2]]))
    moved_centre = apply(gt_matrix, box[None, :3].astype(np.float64))[0]
    assert np.abs(moved_centre - GT_NOW[9][:3]).max() > 0.1  # the repository's ground truth is not where the car is
    centres = gt.mean(dim=1).numpy()  # each box's corner mean: its centre
    assert np.abs(centres - moved_centre).sum(axis=1).min() < 1e-4, (centres, moved_centre)


# ------------------------------------------------------------------------------------------- noise_setting


HEAL = {"add_noise": True, "args": {"pos_std": 0.5, "rot_std": 2.0, "pos_mean": 0.1, "rot_mean": 0.5}}


def heal_offset(slot: int, index: int = 2):
    rng = np.random.default_rng([SEED, 0, index, 0, slot, 0, wild.NOISE_DRAWS])
    xy, yaw = rng.normal(0.1, 0.5, 2), rng.normal(0.5, 2.0)
    return xy[0], xy[1], 0.0, yaw


def test_noise_setting_perturbs_every_pose_the_ego_included_and_keeps_the_gt_clean(world):
    ego = dataset(world, "intermediate", "fusion.args.proj_first=false", noise_setting=HEAL)[2]["ego"]
    ego_pose = moved(POSES[EGO][2], *heal_offset(0))
    t = [x1_to_x2(ego_pose, ego_pose), x1_to_x2(moved(POSES[CAV][2], *heal_offset(1)), ego_pose),
         x1_to_x2(moved(POSES[RSU][2], *heal_offset(2)), ego_pose)]
    np.testing.assert_allclose(ego["pairwise_t_matrix"][1, 0], inverse(t[0]) @ t[1], atol=1e-9)
    np.testing.assert_allclose(ego["pairwise_t_matrix"][2, 1], inverse(t[1]) @ t[2], atol=1e-9)
    # The ego's own points stay where they are: its error moves every other CAV relative to it.
    np.testing.assert_allclose(t[0], np.identity(4), atol=1e-12)
    assert_gt_is_now(ego)
    clean = dataset(world, "intermediate", "fusion.args.proj_first=false")[2]["ego"]
    assert np.array_equal(ego["object_bbx_center"], clean["object_bbx_center"])
    assert ego["object_ids"] == clean["object_ids"]


def test_late_fusion_under_noise_setting_evaluates_against_the_clean_gt(world):
    noisy, clean = dataset(world, "late", noise_setting=HEAL), dataset(world, "late")
    sample = noisy[2]
    assert all("transformation_matrix_clean" in entry for entry in sample.values())
    np.testing.assert_allclose(sample[CAV]["transformation_matrix_clean"],
                               clean[2][CAV]["transformation_matrix"], atol=1e-12)
    ego_pose = moved(POSES[EGO][2], *heal_offset(0))
    np.testing.assert_allclose(sample[CAV]["transformation_matrix"],
                               x1_to_x2(moved(POSES[CAV][2], *heal_offset(1)), ego_pose), atol=1e-9)
    post = VoxelPostprocessor(hypes_for(world, "late")["postprocess"], train=False)
    gt_noisy = post.generate_gt_bbx(noisy.collate_batch_test([sample]))
    gt_clean = post.generate_gt_bbx(clean.collate_batch_test([clean[2]]))
    assert gt_noisy.shape == gt_clean.shape and len(gt_clean) >= 2
    torch.testing.assert_close(gt_noisy, gt_clean)


# ------------------------------------------------------------------------------------------- hypes


def test_the_new_keys_are_declared(world):
    hypes = hypes_for(world, "intermediate", wild_setting=dict(NOISY, loc_err_mode="per_sample"),
                      noise_setting=dict(HEAL, add_noise=False, args=dict(HEAL["args"], laplace=True)))
    assert unknown_keys(hypes, TASK_KEYS) == []
    hypes["noise_setting"]["args"]["pos_sdt"] = 0.1
    assert unknown_keys(hypes, TASK_KEYS) == ["noise_setting.args.pos_sdt"]


@pytest.mark.parametrize("block,key,value,fragments", [
    ("wild_setting", "xyz_std", -0.2, ("key wild_setting.xyz_std must be a finite number >= 0 (m)",)),
    ("wild_setting", "ryp_std", float("nan"), ("key wild_setting.ryp_std must be a finite number >= 0 (degrees)",)),
    ("wild_setting", "async_mode", "fast", ("key wild_setting.async_mode must be 'sim' or 'real'",)),
    ("wild_setting", "loc_err_mode", "global", ("key wild_setting.loc_err_mode must be 'upstream' or 'per_sample'",)),
    ("wild_setting", "async_overhead", -100, ("key wild_setting.async_overhead must be a finite number >= 0 (ms)",)),
    ("wild_setting", "data_size", -1.06, ("key wild_setting.data_size must be a finite number >= 0 (Mb)",)),
    ("wild_setting", "backbone_delay", -10, ("key wild_setting.backbone_delay must be a finite number >= 0 (ms)",)),
    ("wild_setting", "transmission_speed", 0, ("key wild_setting.transmission_speed must be a finite number > 0",)),
    ("wild_setting", "seed", -1, ("key wild_setting.seed must be in [0, 2**32)",)),
    ("wild_setting", "seed", None, ("key wild_setting.seed is needed by wild_setting.loc_err: true",)),
    ("wild_setting", "async_overhead", None, ("key wild_setting.async_overhead is needed by wild_setting.async",)),
    ("noise_setting", "pos_std", -0.5, ("key noise_setting.args.pos_std must be a finite number >= 0 (m)",)),
    ("noise_setting", "pos_mean", float("nan"), ("key noise_setting.args.pos_mean must be a finite number (m)",)),
    ("noise_setting", "rot_mean", float("inf"), ("key noise_setting.args.rot_mean must be a finite number (deg",)),
    ("noise_setting", "add_noise", "yes", ("key noise_setting.add_noise must be true or false",)),
    ("both", None, None, ("wild_setting.loc_err and noise_setting.add_noise are both true",)),
])
def test_bad_values_are_one_clear_config_error(world, block, key, value, fragments):
    setting, noise = dict(NOISY), copy.deepcopy(HEAL) if block != "wild_setting" else None
    if block == "wild_setting":
        setting.pop(key) if value is None else setting.update({key: value})
    elif block == "noise_setting":
        setting["loc_err"] = False
        (noise if key == "add_noise" else noise["args"])[key] = value
    with pytest.raises(ConfigError) as info:
        dataset(world, "intermediate", wild_setting=setting, noise_setting=noise)
    one_line_error(info, *fragments)
