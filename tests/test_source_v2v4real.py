"""The V2V4Real reader (``fusion.dataset: v2v4real``, opencood_ddp/data/sources/v2v4real.py) against the facts.

Every expected value is derived by hand from /work/shared/reference/DATASET_FACTS.md section 2 and from the raw
frame yamls of the toy copy (``toy_v2v4real``), read here with PyYAML's unsafe loader, as the fork reads them (tests
only): the (4, 4) poses, objects in each car's own frame mapped by T_ego^-1 T_car pose_to_matrix(location + center,
angle), ids from ass_id (else object_id + 100 cav_id), Pedestrians dropped, the 2-corner range rule, the 70 m range
of intermediate fusion only, the per-scene training order, localisation error and delay on the matrices.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import pytest
import yaml

from launch import one_line_error as named_line
from zoo import hypes_of
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.geometry import pose_to_matrix
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.toy.v2v4real_layout import dump_v2v4real_yaml

SEED = 3
COMM_RANGE = 70.0  # facts 2.4
MIN_CORNERS = 2  # facts 2.6
ID_STRIDE = 100  # facts 2.2: object_id + 100 * cav_id
SIGNS = np.array([[1, -1, -1], [1, 1, -1], [-1, 1, -1], [-1, -1, -1],
                  [1, -1, 1], [1, 1, 1], [-1, 1, 1], [-1, -1, 1]], dtype=np.float64)
LOC_ERR = "wild_setting={loc_err: true, loc_err_mode: per_sample, xyz_std: 0.5, ryp_std: 1.0, seed: 1}"
ASYNC = "wild_setting={async: true, async_overhead: 100, async_mode: sim, seed: 1}"


def one_line_error(exc_info, *fragments: str) -> str:
    """One line naming every fragment, then a fix after a semicolon."""
    message = named_line(exc_info, *fragments)
    assert "; " in message and message.rsplit("; ", 1)[1].strip(), message
    return message


# ------------------------------------------------------------------------------------------------ by hand


def v4r_hypes(kind: str, root: Path, *extra: str) -> dict:
    return hypes_of(f"toy/point_pillar_{kind}_fusion", *extra, toy_root=root, layout="v2v4real")


def dataset(kind: str, root: Path, *extra: str, split: str = "test", train: bool = False, seed: int = SEED):
    return build_dataset(v4r_hypes(kind, root, *extra), split, train=train, seed=seed)


def read_yaml(path: Path) -> dict:
    """A frame yaml as the fork reads it (PyYAML's unsafe loader: the pose is a numpy array). Tests only."""
    return yaml.unsafe_load(Path(path).read_text())


def scenes(split_dir: Path) -> List[Path]:
    return sorted(p for p in split_dir.iterdir() if p.is_dir())


def stamps(scene: Path) -> List[str]:
    """Facts 2.1: the sorted yaml names of the first CAV, without those holding 'additional' or 'camera_gt'."""
    return sorted(p.stem for p in (scene / "0").glob("*.yaml") if "additional" not in p.name
                  and "camera_gt" not in p.name)


def samples(split_dir: Path):
    """(sample index, scene, position, timestamp) in the reader's order: scenes sorted, then timestamps."""
    index = 0
    for scene in scenes(split_dir):
        for position, stamp in enumerate(stamps(scene)):
            yield index, scene, position, stamp
            index += 1


def pose(scene: Path, cav: str, stamp: str) -> np.ndarray:
    matrix = np.asarray(read_yaml(scene / cav / f"{stamp}.yaml")["lidar_pose"], dtype=np.float64)
    assert matrix.shape == (4, 4)
    return matrix


def object_box(to_ego: np.ndarray, obj: dict) -> np.ndarray:
    """Facts 2.2: the object's pose [location + center, angle (degrees)] in its car's frame, carried into the ego
    frame; extent holds half sizes. [x, y, z, h, w, l, yaw] (boxes are level here)."""
    matrix = to_ego @ pose_to_matrix([*np.add(obj["location"], obj["center"]), *obj["angle"]])
    ex, ey, ez = (2.0 * float(v) for v in obj["extent"])
    return np.array([*matrix[:3, 3], ez, ey, ex, math.atan2(matrix[1, 0], matrix[0, 0])])


def box_corners(box: np.ndarray) -> np.ndarray:
    x, y, z, h, w, l, yaw = (float(v) for v in box)
    cos, sin = math.cos(yaw), math.sin(yaw)
    rotation = np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]])
    return (SIGNS * np.array([l / 2, w / 2, h / 2])) @ rotation.T + np.array([x, y, z])


def corners_in(box: np.ndarray, rng) -> int:
    """How many corners lie in the range, faces included; asserts no corner sits on a face."""
    corners, rng = box_corners(box), np.asarray(rng, dtype=np.float64)
    margin = np.minimum(corners - rng[:3], rng[3:] - corners)
    assert np.abs(margin).min() > 1e-6, "a corner lies on a face of the range"
    return int((margin >= 0).all(axis=1).sum())


def object_id(oid, obj: dict, cav: str):
    """Facts 2.2: ass_id unless -1 (default: the object id), then object_id + 100 * cav_id."""
    association = obj.get("ass_id", oid)
    return association if association != -1 else int(oid) + ID_STRIDE * int(cav)


def expected_gt(scene: Path, stamp: str, cavs: List[str], rng, to_ego_of: Optional[Dict] = None) -> SimpleNamespace:
    """The sample's ground truth in the frame of cavs[0] (facts 2.2, 2.6): every car's non-Pedestrian objects with
    >= 2 corners in the range, the first car's box kept for a repeated id. Also what the rule dropped. A car's
    labels travel by ``to_ego_of[cav]`` where given (the fork's delayed transform), else by its current pose."""
    ego_pose = pose(scene, cavs[0], stamp)
    boxes: Dict = {}
    origin: Dict = {}
    pedestrians, types = [], set()
    for cav in cavs:
        frame = read_yaml(scene / cav / f"{stamp}.yaml")
        to_ego = (to_ego_of or {}).get(cav, np.linalg.inv(ego_pose) @ np.asarray(frame["lidar_pose"], np.float64))
        for oid, obj in frame["vehicles"].items():
            box = object_box(to_ego, obj)
            if corners_in(box, rng) < MIN_CORNERS:
                continue
            if obj.get("obj_type", "Car") == "Pedestrian":
                pedestrians.append(object_id(oid, obj, cav))
                continue
            key = object_id(oid, obj, cav)
            if key not in boxes:
                boxes[key], origin[key] = box, (cav, obj.get("ass_id", oid))
                types.add(obj.get("obj_type", "Car"))
    return SimpleNamespace(boxes=boxes, origin=origin, pedestrians=pedestrians, types=types)


def gt_of(sample: dict):
    ego = sample["ego"]
    return ego["object_bbx_center"][ego["object_bbx_mask"] == 1], list(ego["object_ids"])


def assert_same_box(actual: np.ndarray, expected: np.ndarray, tol: float) -> None:
    np.testing.assert_allclose(actual[:6], expected[:6], atol=tol, rtol=0)
    assert abs(math.remainder(actual[6] - expected[6], 2 * math.pi)) < tol, (actual, expected)


def assert_gt(sample: dict, expected: SimpleNamespace, tol: float = 1e-6) -> None:
    boxes, ids = gt_of(sample)
    assert sorted(ids) == sorted(expected.boxes), (ids, sorted(expected.boxes))
    for box, key in zip(boxes, ids):
        assert_same_box(box, expected.boxes[key], tol)


def rewrite(path: Path, edit) -> None:
    """Load a frame yaml, let ``edit`` change the dict, write it back in the fork's form (numpy-tagged pose)."""
    frame = read_yaml(path)
    edit(frame)
    path.write_text(dump_v2v4real_yaml(frame), encoding="utf-8")


@pytest.fixture(scope="module")
def v4r(toy_v2v4real) -> SimpleNamespace:
    root = toy_v2v4real
    hypes = v4r_hypes("intermediate", root)
    return SimpleNamespace(root=root, test=root / "test", rng=hypes["postprocess"]["anchor_args"]["cav_lidar_range"],
                           inter=build_dataset(hypes, "test", train=False, seed=SEED))


@pytest.fixture()
def split_copy(v4r, tmp_path) -> Path:
    """A private copy of the test split (a few MB) that a test may edit; read it with test_dir=<copy>."""
    out = tmp_path / "test"
    shutil.copytree(v4r.test, out)
    return out


# ------------------------------------------------------------------------------------------------- poses


def test_the_pose_is_the_yaml_matrix_numpy_tagged_or_a_plain_list(v4r, split_copy):
    source = v4r.inter.source
    for index, scene, _, stamp in samples(v4r.test):
        frames = source.sample_frames(index)
        for slot, cav in enumerate(("0", "1")):  # at test the ego is car 0 (facts 2.1)
            frame = frames.frame(slot)
            assert frame.cav_id == cav
            np.testing.assert_array_equal(frame.lidar_pose, pose(scene, cav, stamp))
    # the same matrix as a plain nested list, and as PyYAML writes an ndarray under numpy 2 (numpy._core)
    for scene in scenes(split_copy):
        for path in (scene / "1").glob("*.yaml"):
            frame = read_yaml(path)
            frame["lidar_pose"] = np.asarray(frame["lidar_pose"]).tolist()
            path.write_text(yaml.safe_dump(frame))
            assert "!!" not in path.read_text()
        for path in (scene / "0").glob("*.yaml"):
            path.write_text(yaml.dump(read_yaml(path)))
    source = dataset("intermediate", v4r.root, f"test_dir={split_copy}").source
    for index, scene, _, stamp in samples(v4r.test):
        frames = source.sample_frames(index)
        np.testing.assert_array_equal(frames.frame(1).lidar_pose, pose(scene, "1", stamp))
        np.testing.assert_array_equal(frames.frame(0).lidar_pose, pose(scene, "0", stamp))


# ------------------------------------------------------------------------------------------ ground truth


def test_car_1_objects_land_in_the_ego_frame_with_their_ids(v4r):
    only_car_1 = shared = pedestrians = 0
    types = set()
    for index, scene, _, stamp in samples(v4r.test):
        expected = expected_gt(scene, stamp, ["0", "1"], v4r.rng)
        sample = v4r.inter[index]
        assert_gt(sample, expected)
        boxes, ids = gt_of(sample)
        gt = dict(zip(ids, boxes))
        # Each car-1 object directly: T_ego^-1 T_car1 pose_to_matrix(location + center, angle). An object car 0
        # also lists keeps car 0's box: the same box through the yaml's six-decimal rounding.
        to_ego = np.linalg.inv(pose(scene, "0", stamp)) @ pose(scene, "1", stamp)
        for oid, obj in read_yaml(scene / "1" / f"{stamp}.yaml")["vehicles"].items():
            box = object_box(to_ego, obj)
            key = object_id(oid, obj, "1")
            if obj["obj_type"] == "Pedestrian" or corners_in(box, v4r.rng) < MIN_CORNERS:
                assert key not in gt or obj["ass_id"] != -1
                continue
            assert key == (obj["ass_id"] if obj["ass_id"] != -1 else oid + 100)
            assert_same_box(gt[key], box, 1e-6 if obj["ass_id"] == -1 else 1e-4)
            only_car_1 += obj["ass_id"] == -1
            shared += obj["ass_id"] != -1
        pedestrians += len(expected.pedestrians)
        assert not set(expected.pedestrians) & set(ids)
        types |= expected.types
    assert only_car_1 and shared and pedestrians, "the test split must hold car-1-only and shared objects and " \
                                                  "Pedestrians in range"
    assert {"Car", "Van", "Truck"} <= types


def test_a_box_with_two_corners_in_range_is_kept(v4r, split_copy):
    scene = scenes(split_copy)[0]
    stamp = stamps(scene)[0]
    x_max, y_max, z_max = (float(v4r.rng[k]) for k in (3, 4, 5))
    # In car 0's (the ego's) frame, 4 x 2 x 1.6 m boxes, yaw 0: rear half inside x_max; the second also pokes out
    # of z_max (2 corners in), the third also out of y_max (1 corner in).
    centres = {90: (x_max + 1.0, 0.0, -1.0), 91: (x_max + 1.0, 0.0, z_max - 0.2), 92: (x_max + 1.0, y_max + 0.5,
                                                                                       z_max - 0.2)}

    def add(frame):
        for oid, centre in centres.items():
            frame["vehicles"][oid] = {"angle": [0.0, 0.0, 0.0], "ass_id": -1, "center": [0.05, 0.0, 0.0],
                                      "extent": [2.0, 1.0, 0.8], "location": [centre[0] - 0.05, *centre[1:]],
                                      "obj_type": "Car"}

    rewrite(scene / "0" / f"{stamp}.yaml", add)
    expected = expected_gt(scene, stamp, ["0", "1"], v4r.rng)
    counts = {oid: corners_in(object_box(np.identity(4), read_yaml(scene / "0" / f"{stamp}.yaml")["vehicles"][oid]),
                              v4r.rng) for oid in centres}
    assert counts == {90: 4, 91: 2, 92: 1}
    assert {90, 91} <= set(expected.boxes) and 92 not in expected.boxes  # ass_id -1 on car 0: id = object id
    for kind in ("early", "intermediate"):
        ds = dataset(kind, v4r.root, f"test_dir={split_copy}")
        assert_gt(ds[0], expected)


def test_an_object_without_obj_type_or_ass_id_takes_the_defaults(v4r, split_copy):
    """Facts 2.2: obj_type defaults to Car (kept) and ass_id to the object id (not object_id + 100 * cav_id)."""
    scene = scenes(split_copy)[0]
    stamp = stamps(scene)[1]
    ego, car_1 = pose(scene, "0", stamp), pose(scene, "1", stamp)
    # 10 m ahead of the ego, in car 1's frame
    local = np.linalg.inv(car_1) @ ego @ pose_to_matrix([10.0, 3.0, -1.0, 0.0, 30.0, 0.0])
    yaw = math.degrees(math.atan2(local[1, 0], local[0, 0]))

    def add(frame):
        frame["vehicles"][93] = {"angle": [0.0, yaw, 0.0], "center": [0.0, 0.0, 0.0], "extent": [2.0, 1.0, 0.8],
                                 "location": [float(v) for v in local[:3, 3]]}
    rewrite(scene / "1" / f"{stamp}.yaml", add)
    expected = expected_gt(scene, stamp, ["0", "1"], v4r.rng)
    assert 93 in expected.boxes and 193 not in expected.boxes
    np.testing.assert_allclose(expected.boxes[93], [10.0, 3.0, -1.0, 1.6, 2.0, 4.0, math.radians(30.0)], atol=1e-9)
    assert_gt(dataset("intermediate", v4r.root, f"test_dir={split_copy}")[1], expected)


def test_camera_gt_yamls_are_not_timestamps(v4r, split_copy):
    """facts 2.1: timestamps exclude yaml names containing 'camera_gt' (as 'additional')."""
    for scene in scenes(split_copy):
        names = stamps(scene)
        for cav in ("0", "1"):
            for stamp in names:
                (scene / cav / f"{stamp}_camera_gt.yaml").write_text("vehicles: {}\n")
    ds = dataset("intermediate", v4r.root, f"test_dir={split_copy}")
    assert len(ds) == len(v4r.inter)
    for index, scene, _, stamp in samples(split_copy):
        assert_gt(ds[index], expected_gt(scene, stamp, ["0", "1"], v4r.rng))


FORK_GT_RANGE = (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0)  # facts 2.6: V4R's GT_RANGE


def test_without_gt_range_the_test_ground_truth_uses_the_forks_gt_range(v4r, split_copy):
    """facts 2.6: without postprocess.gt_range the test-time GT range is the fork's [-100, -40, -5, 100, 40, 3], not
    OpenCOOD's. Late fusion keeps each car's test GT in the GT range with no cav_lidar_range re-filter: a box 120 m
    ahead is outside the fork's range (inside OpenCOOD's), a box 2 m above the LiDAR inside it (outside OpenCOOD's)."""
    scene = scenes(split_copy)[0]
    stamp = stamps(scene)[0]

    def add(frame):
        for oid, centre in {94: (120.0, 0.0, -1.0), 95: (20.0, 0.0, 2.0)}.items():
            frame["vehicles"][oid] = {"angle": [0.0, 0.0, 0.0], "ass_id": -1, "center": [0.0, 0.0, 0.0],
                                      "extent": [2.0, 1.0, 0.8], "location": list(centre), "obj_type": "Car"}
    rewrite(scene / "0" / f"{stamp}.yaml", add)
    hypes = v4r_hypes("late", v4r.root, f"test_dir={split_copy}")
    del hypes["postprocess"]["gt_range"]
    ds = build_dataset(hypes, "test", train=False, seed=SEED)
    expected = expected_gt(scene, stamp, ["0"], FORK_GT_RANGE)
    assert 95 in expected.boxes and 94 not in expected.boxes
    ego = ds[0]["ego"]
    assert sorted(ego["object_ids"]) == sorted(expected.boxes)


# ----------------------------------------------------------------------------------------- communication


def test_only_intermediate_fusion_drops_a_car_beyond_70_m(v4r, split_copy):
    for index, scene, _, stamp in samples(v4r.test):
        assert math.dist(pose(scene, "0", stamp)[:2, 3], pose(scene, "1", stamp)[:2, 3]) < COMM_RANGE
        assert v4r.inter[index]["ego"]["cav_num"] == 2
    for scene in scenes(split_copy):
        for stamp in stamps(scene):
            ego = pose(scene, "0", stamp)

            def far(frame):
                frame["lidar_pose"][:2, 3] = ego[:2, 3] + np.array([80.0, 0.0])
            rewrite(scene / "1" / f"{stamp}.yaml", far)
    early, inter, late = (dataset(kind, v4r.root, f"test_dir={split_copy}") for kind in ("early", "intermediate",
                                                                                        "late"))
    for index, scene, _, stamp in samples(split_copy):
        assert math.dist(pose(scene, "0", stamp)[:2, 3], pose(scene, "1", stamp)[:2, 3]) == pytest.approx(80.0)
        assert inter[index]["ego"]["cav_num"] == 1
        assert [cav.cav_id for cav in inter.received_cavs(index)] == ["0"]
        assert [cav.cav_id for cav in early.received_cavs(index)] == ["0", "1"]
        sample = late[index]
        assert list(sample) == ["ego", "1"]
        np.testing.assert_allclose(sample["1"]["transformation_matrix"],
                                   np.linalg.inv(pose(scene, "0", stamp)) @ pose(scene, "1", stamp),
                                   atol=1e-9, rtol=0)


# ------------------------------------------------------------------------------------------- training ego


def test_training_ego_is_drawn_per_scene_from_the_seed(v4r):
    train = v4r.root / "train"
    seen: Dict[str, set] = {scene.name: set() for scene in scenes(train)}

    def egos(seed: int) -> List[str]:
        source = dataset("intermediate", v4r.root, split="train", train=True, seed=seed).source
        return [source.sample_frames(index).frame(0).cav_id for index, *_ in samples(train)]

    for seed in range(8):
        first, second = egos(seed), egos(seed)
        assert first == second
        for (_, scene, _, _), ego in zip(samples(train), first):
            seen[scene.name].add(ego)
            assert ego == first[[s.name for _, s, *_ in samples(train)].index(scene.name)]  # one order per scene
    assert all(cavs == {"0", "1"} for cavs in seen.values()), seen
    for seed in (0, 5):
        test = dataset("intermediate", v4r.root, seed=seed).source
        assert {test.sample_frames(index).frame(0).cav_id for index, *_ in samples(v4r.test)} == {"0"}


def test_a_training_sample_is_in_the_frame_of_its_drawn_ego(v4r):
    train = v4r.root / "train"
    swapped = 0
    for seed in range(4):
        ds = dataset("intermediate", v4r.root, split="train", train=True, seed=seed)
        for index, scene, _, stamp in samples(train):
            ego = ds.source.sample_frames(index).frame(0)
            np.testing.assert_array_equal(ego.lidar_pose, pose(scene, ego.cav_id, stamp))
            order = [ego.cav_id, "1" if ego.cav_id == "0" else "0"]
            swapped += order[0] == "1"
            assert_gt(ds[index], expected_gt(scene, stamp, order, v4r.rng))
    assert swapped


# ------------------------------------------------------------------------------------- wild settings


def test_localisation_error_moves_the_projection_not_the_ground_truth(v4r):
    clean = dataset("intermediate", v4r.root, "fusion.args.proj_first=false")
    noisy = dataset("intermediate", v4r.root, "fusion.args.proj_first=false", LOC_ERR)
    for index, scene, _, stamp in samples(v4r.test):
        truth = np.linalg.inv(pose(scene, "0", stamp)) @ pose(scene, "1", stamp)
        a, b = clean[index]["ego"], noisy[index]["ego"]
        np.testing.assert_allclose(a["pairwise_t_matrix"][1, 0], truth, atol=1e-9, rtol=0)
        moved = b["pairwise_t_matrix"][1, 0]
        assert np.abs(moved - truth).max() > 1e-3
        rotation = moved[:3, :3]
        np.testing.assert_allclose(rotation @ rotation.T, np.identity(3), atol=1e-9)
        # the error turns car 1 about the world's z axis only (x, y, z and yaw are perturbed)
        turn = pose(scene, "0", stamp)[:3, :3] @ rotation @ pose(scene, "1", stamp)[:3, :3].T
        np.testing.assert_allclose(turn[2], [0.0, 0.0, 1.0], atol=1e-9)
        np.testing.assert_array_equal(a["object_bbx_center"], b["object_bbx_center"])
        assert a["object_ids"] == b["object_ids"]


def test_delay_reads_car_1_one_timestamp_earlier(v4r):
    delayed = dataset("intermediate", v4r.root, "fusion.args.proj_first=false", ASYNC)
    for index, scene, position, stamp in samples(v4r.test):
        earlier = stamps(scene)[max(position - 1, 0)]
        sent = delayed.received_cavs(index)[1].sent
        assert sent.meta_path == scene / "1" / f"{earlier}.yaml"
        ego = delayed[index]["ego"]
        np.testing.assert_allclose(ego["pairwise_t_matrix"][1, 0],
                                   np.linalg.inv(pose(scene, "0", stamp)) @ pose(scene, "1", earlier),
                                   atol=1e-9, rtol=0)
        assert ego["prior_encoding"][1, 1] == min(position, 1) and ego["prior_encoding"][0, 1] == 0
        assert ego["prior_encoding"][1, 0] == np.float32(read_yaml(scene / "1" / f"{earlier}.yaml")["ego_speed"] / 30)


def test_as_received_places_car_1s_current_labels_with_its_delayed_pose_as_the_fork_does(v4r):
    """Facts 2.4 (the fork's reform_param): under delay, the current timestamp's labels travel with the transform of
    the delayed pose. ``fusion.args.gt_transform: as_received`` reproduces it; the default keeps the true poses."""
    received = dataset("intermediate", v4r.root, ASYNC, "fusion.args.gt_transform=as_received")
    true_poses = dataset("intermediate", v4r.root, ASYNC)
    moved = 0
    for index, scene, position, stamp in samples(v4r.test):
        earlier = stamps(scene)[max(position - 1, 0)]
        delayed = {"1": np.linalg.inv(pose(scene, "0", stamp)) @ pose(scene, "1", earlier)}
        expected = expected_gt(scene, stamp, ["0", "1"], v4r.rng, delayed)
        assert_gt(received[index], expected)
        assert_gt(true_poses[index], expected_gt(scene, stamp, ["0", "1"], v4r.rng))
        moved += position > 0 and any(origin == "1" for origin, _ in expected.origin.values())
    assert moved, "the test split must hold delayed samples with car-1-only objects"


def test_as_received_with_localisation_error_uses_the_noisy_transform_of_the_points(v4r):
    noisy = dataset("intermediate", v4r.root, LOC_ERR, "fusion.args.gt_transform=as_received")
    for index, scene, _, stamp in samples(v4r.test):
        cars = noisy.received_cavs(index)
        assert np.abs(cars[1].to_ego - cars[1].to_ego_clean).max() > 1e-3  # the points' transform is the noisy one
        assert_gt(noisy[index], expected_gt(scene, stamp, ["0", "1"], v4r.rng, {"1": cars[1].to_ego}), tol=1e-5)


def test_an_unknown_gt_transform_is_one_line_naming_the_key(v4r):
    with pytest.raises(ConfigError) as error:
        dataset("intermediate", v4r.root, "fusion.args.gt_transform=delayed")
    one_line_error(error, "fusion.args.gt_transform", "true_poses", "as_received")


# --------------------------------------------------------------------------------------------- bad inputs


def test_a_six_vector_pose_is_one_line_naming_the_yaml(v4r, split_copy):
    scene = scenes(split_copy)[0]
    path = scene / "1" / f"{stamps(scene)[1]}.yaml"

    def six(frame):
        matrix = np.asarray(frame["lidar_pose"])
        frame["lidar_pose"] = [*map(float, matrix[:3, 3]), 0.0, math.degrees(math.atan2(matrix[1, 0], matrix[0, 0])),
                               0.0]
    rewrite(path, six)
    ds = dataset("intermediate", v4r.root, f"test_dir={split_copy}")
    ds[0]
    with pytest.raises(DataError) as info:
        ds[1]
    one_line_error(info, str(path), "lidar_pose", "4x4")


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system ['touch {marker}']",
                                 "!!python/object/apply:numpy.ones [[4, 4]]"])
def test_another_python_tag_is_one_line_and_never_runs(v4r, split_copy, tmp_path, tag):
    scene = scenes(split_copy)[0]
    path = scene / "1" / f"{stamps(scene)[2]}.yaml"
    marker = tmp_path / "ran"
    frame = read_yaml(path)
    del frame["lidar_pose"]
    path.write_text(yaml.safe_dump(frame) + f"lidar_pose: {tag.format(marker=marker)}\n")
    ds = dataset("intermediate", v4r.root, f"test_dir={split_copy}")
    with pytest.raises(DataError) as info:
        ds[2]
    one_line_error(info, str(path))
    assert not marker.exists()
