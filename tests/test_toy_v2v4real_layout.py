"""The V2V4Real-layout copy of a toy OPV2V set: folder names, two CAVs, the numpy 1.x lidar_pose matrix,
objects in each CAV's own LiDAR frame, association ids, classes, byte-identical clouds, determinism, reuse
and refusal. Expected values come from DATASET_FACTS.md section 2 and the source toy files, never from a
V2V4Real reader.

The frame yamls carry numpy object tags, which only PyYAML's unsafe loader builds; upstream reads them that
way, so these tests do too (``_unsafe``), to prove the bytes mean what upstream would read. Nothing outside
this test file loads them unsafely.
"""
import re
import shutil
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import yaml

from opencood_ddp.data.geometry import matrix_to_pose, pose_to_matrix
from opencood_ddp.data.opv2v import load_opv2v_yaml
from opencood_ddp.errors import DataError
from opencood_ddp.toy.config import SPLITS
from opencood_ddp.toy.manifest import MANIFEST_NAME, read_toy_manifest, write_manifest
from opencood_ddp.toy.v2v4real_layout import (ASS_ID_OFFSET, CENTER_OFFSET_M, LIST_RADIUS_M, V2V4REAL_SET,
                                              dump_v2v4real_yaml, format_v2v4real_summary, write_v2v4real_copy)
from opencood_ddp.toy.writer import generate_toy_opv2v

SEED = 0
SCENARIO = re.compile(r"testoutput_CAV_data_(\d{4})-(\d{2})-(\d{2})-(\d{2})-(\d{2})-(\d{2})_(\d+)")


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> Tuple[Path, Path, dict]:
    """(toy OPV2V root, its V2V4Real copy, the copy's summary), made once for the module."""
    root = tmp_path_factory.mktemp("v2v4real")
    generate_toy_opv2v(root / "opv2v", seed=SEED, scale="small")
    summary = write_v2v4real_copy(root / "opv2v", root / "v2v4real", seed=SEED)
    return root / "opv2v", root / "v2v4real", summary


def _unsafe(path: Path) -> dict:
    """Load a V2V4Real frame yaml as upstream does (PyYAML's unsafe loader): tests only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2 may warn about the numpy.core path
        return yaml.unsafe_load(path.read_text())


def _data_files(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def _source_cavs(scenario: Path) -> List[str]:
    """The first two toy CAV folders in the OPV2V reader's order (string sort, negative ids last)."""
    names = sorted(p.name for p in scenario.iterdir() if p.is_dir())
    return [n for n in names if not n.startswith("-")][:2]


def _pairs(source: Path, copy: Path):
    """(source scenario, copied scenario) for every scenario, in split and index order."""
    for split in SPLITS:
        toy = sorted(p for p in (source / split).iterdir() if p.is_dir())
        out = sorted((copy / split).iterdir(), key=lambda p: int(SCENARIO.fullmatch(p.name).group(7)))
        assert len(toy) == len(out)
        yield from zip(toy, out)


def _frames(source: Path, copy: Path):
    """(source yaml of the CAV, its copy, CAV index, frame index) for every CAV frame of the copy."""
    for toy, out in _pairs(source, copy):
        cavs = _source_cavs(toy)
        stamps = sorted(p.stem for p in (toy / cavs[0]).glob("*.yaml"))
        for cav_index, cav in enumerate(cavs):
            for frame, stamp in enumerate(stamps):
                yield toy / cav / f"{stamp}.yaml", out / str(cav_index) / f"{frame:06d}.yaml", cav_index, frame


def _listed(toy_yaml: dict) -> Dict[int, dict]:
    """The toy vehicles a CAV lists in the copy: box centre within 100 m (x-y) of its LiDAR, sorted by id."""
    lidar = np.asarray(toy_yaml["lidar_pose"][:2])
    return {vid: box for vid, box in sorted(toy_yaml["vehicles"].items())
            if np.hypot(*(np.add(box["location"], box["center"])[:2] - lidar)) <= LIST_RADIUS_M}


# -------------------------------------------------------------------------------------------------- layout
def test_folders_follow_the_v2v4real_layout(sets):
    source, copy, summary = sets
    assert sorted(p.name for p in copy.iterdir()) == sorted(SPLITS + (MANIFEST_NAME,))
    for split in SPLITS:
        toy_names = sorted(p.name for p in (source / split).iterdir())
        names = sorted(p.name for p in (copy / split).iterdir())
        assert len(names) == len(toy_names) == summary["scenarios"][split]
        for name in names:
            match = SCENARIO.fullmatch(name)
            assert match, name
            k = int(match.group(7))
            # The date-time is the toy scenario's name, k its index within the split.
            assert "_".join(match.groups()[:6]) == toy_names[k]
            assert sorted(p.name for p in (copy / split / name).iterdir()) == ["0", "1"]
        assert sorted(int(SCENARIO.fullmatch(n).group(7)) for n in names) == list(range(len(names)))


def test_both_cavs_have_the_same_renumbered_timestamps(sets):
    source, copy, summary = sets
    total = {split: 0 for split in SPLITS}
    for toy, out in _pairs(source, copy):
        n = len(list((toy / _source_cavs(toy)[0]).glob("*.yaml")))
        expected = [f"{i:06d}" for i in range(n)]
        for cav in ("0", "1"):
            assert sorted(p.stem for p in (out / cav).glob("*.yaml")) == expected
            assert sorted(p.stem for p in (out / cav).glob("*.pcd")) == expected
        total[out.parent.name] += n
    assert summary["frames"] == total
    assert summary["clouds"] == 2 * sum(total.values())


def test_pcds_are_byte_identical_to_the_source(sets):
    source, copy, _ = sets
    for toy_yaml, out_yaml, _, _ in _frames(source, copy):
        assert out_yaml.with_suffix(".pcd").read_bytes() == toy_yaml.with_suffix(".pcd").read_bytes()


# ---------------------------------------------------------------------------------------------- lidar_pose
def test_lidar_pose_is_the_numpy1_ndarray_of_the_source_pose(sets):
    source, copy, _ = sets
    for toy_yaml, out_yaml, _, _ in _frames(source, copy):
        text = out_yaml.read_text()
        assert "lidar_pose: !!python/object/apply:numpy.core.multiarray._reconstruct\n" in text
        assert "numpy._core" not in text
        pose = _unsafe(out_yaml)["lidar_pose"]
        expected = pose_to_matrix(load_opv2v_yaml(toy_yaml)["lidar_pose"])
        assert isinstance(pose, np.ndarray) and pose.dtype == np.float64 and pose.shape == (4, 4)
        assert np.array_equal(pose, expected)


def test_lidar_pose_text_is_what_pyyaml_writes_for_an_ndarray_with_the_numpy1_module_path():
    matrix = pose_to_matrix([238.114608, 64.79594, 1.9, 0.0, 22.839625, 0.0])
    ours = dump_v2v4real_yaml({"lidar_pose": matrix})
    # PyYAML's default Dumper under the installed numpy 2 names numpy._core; numpy 1.x wrote numpy.core.
    pyyaml = yaml.dump({"lidar_pose": matrix}).replace("numpy._core.multiarray", "numpy.core.multiarray")
    assert ours == pyyaml
    assert "!!binary |\n    Yg==\n" in ours


def test_frame_yaml_is_refused_by_the_safe_loader(sets):
    """The tags need the unsafe loader, as upstream's; the project's safe OPV2V reader must refuse them."""
    _, copy, _ = sets
    path = next(copy.glob("train/*/0/000000.yaml"))
    with pytest.raises(DataError, match="unsupported YAML tag"):
        load_opv2v_yaml(path)


# ------------------------------------------------------------------------------------------------ objects
def test_matrix_to_pose_inverts_pose_to_matrix():
    rng = np.random.default_rng(3)
    for _ in range(200):
        pose = np.concatenate([rng.uniform(-300, 300, 3), rng.uniform(-179, 179, 1),
                               rng.uniform(-179, 179, 1), rng.uniform(-89, 89, 1)])
        back = matrix_to_pose(pose_to_matrix(pose))
        assert np.allclose(back, pose, rtol=0, atol=1e-9)
        assert np.allclose(pose_to_matrix(back), pose_to_matrix(pose), rtol=0, atol=1e-12)


def test_objects_in_the_cav_frame_map_back_to_the_source_world_boxes(sets):
    source, copy, _ = sets
    for toy_yaml, out_yaml, _, _ in _frames(source, copy):
        toy, ours = load_opv2v_yaml(toy_yaml), _unsafe(out_yaml)
        lidar_to_world = ours["lidar_pose"]
        listed = _listed(toy)
        vehicles = [obj for obj in ours["vehicles"].values() if obj["obj_type"] != "Pedestrian"]
        assert list(ours["vehicles"])[:len(vehicles)] == list(range(len(listed)))
        assert len(vehicles) == len(listed)
        for obj, (vid, box) in zip(vehicles, listed.items()):
            assert obj["center"] == [CENTER_OFFSET_M, 0.0, 0.0]
            assert obj["extent"] == box["extent"]
            # Upstream: x_to_world([location + center, angle]) in the CAV frame, then into the world.
            local = np.add(obj["location"], obj["center"]).tolist() + obj["angle"]
            world = lidar_to_world @ pose_to_matrix(local)
            # The copy writes six decimals, as the toy OPV2V writer: micrometres and micro-degrees.
            assert np.allclose(world[:3, 3], np.add(box["location"], box["center"]), rtol=0, atol=2e-6)
            yaw = np.degrees(np.arctan2(world[1, 0], world[0, 0]))
            assert abs((yaw - box["angle"][1] + 180.0) % 360.0 - 180.0) < 1e-6
            assert np.allclose(world[2, :3], [0.0, 0.0, 1.0], rtol=0, atol=1e-12)  # level, as the toy's


def test_objects_listed_by_both_cavs_share_ass_id_and_others_have_minus_one(sets):
    source, copy, _ = sets
    by_frame: Dict[Tuple[Path, int], Dict[int, Tuple[dict, dict]]] = {}
    for toy_yaml, out_yaml, cav_index, frame in _frames(source, copy):
        by_frame.setdefault((out_yaml.parent.parent, frame), {})[cav_index] = (load_opv2v_yaml(toy_yaml),
                                                                               _unsafe(out_yaml))
    associated = 0
    for cavs in by_frame.values():
        listed = [_listed(cavs[i][0]) for i in (0, 1)]
        shared = set(listed[0]) & set(listed[1])
        for i in (0, 1):
            objects = [o for o in cavs[i][1]["vehicles"].values() if o["obj_type"] != "Pedestrian"]
            expected = [ASS_ID_OFFSET + vid if vid in shared else -1 for vid in listed[i]]
            assert [o["ass_id"] for o in objects] == expected
        assert ({o["ass_id"] for o in cavs[0][1]["vehicles"].values()} - {-1}
                == {o["ass_id"] for o in cavs[1][1]["vehicles"].values()} - {-1})
        associated += len(shared)
        # Each CAV lists the other one (the toy lists every other vehicle, CAVs included).
        assert all(set(listed[i]) - shared for i in (0, 1))
    assert associated > 0


def test_classes_pedestrians_and_trucks(sets):
    source, copy, _ = sets
    trucks = 0
    truck_frames: Dict[Tuple[Path, int], set] = {}
    for toy_yaml, out_yaml, cav_index, frame in _frames(source, copy):
        toy, ours = load_opv2v_yaml(toy_yaml), _unsafe(out_yaml)
        objects = list(ours["vehicles"].values())
        people = [o for o in objects if o["obj_type"] == "Pedestrian"]
        assert 1 <= len(people) <= 2
        assert all(o["obj_type"] != "Pedestrian" for o in objects[:-len(people)])  # pedestrians come last
        height = toy["lidar_pose"][2]  # the LiDAR is level, so the ground is at z = -height in its frame
        for person in people:
            assert person["ass_id"] == -1 and person["extent"] == [0.3, 0.3, 0.9]
            centre = np.add(person["location"], person["center"])
            assert centre[2] - person["extent"][2] == pytest.approx(-height, abs=1e-9)
            assert np.hypot(centre[0], centre[1]) <= 30.0
        for obj in objects:
            if obj["obj_type"] in ("Car", "Van"):
                assert obj["obj_type"] == ("Car" if 2 * obj["extent"][0] < 5.0 else "Van")
            elif obj["obj_type"] == "Truck":
                assert 2 * obj["extent"][0] >= 5.0
                trucks += 1
                truck_frames.setdefault((out_yaml.parent.parent, frame), set()).add(obj["ass_id"])
            else:
                assert obj["obj_type"] == "Pedestrian"
    assert trucks > 0
    # At most one truck per frame; when both CAVs see it, it is the same (associated) vehicle.
    assert all(len(ids - {-1}) <= 1 for ids in truck_frames.values())


# ------------------------------------------------------------------------------- determinism, reuse, refusal
def test_the_copy_is_byte_identical_when_made_twice_and_reused_when_complete(sets, tmp_path):
    source, copy, first = sets
    assert not first["skipped"]
    again = write_v2v4real_copy(source, tmp_path / "again", seed=SEED)
    assert not again["skipped"]
    assert _data_files(tmp_path / "again") == _data_files(copy)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*.yaml") if p.name != MANIFEST_NAME}
    reused = write_v2v4real_copy(source, copy, seed=SEED)
    assert reused["skipped"] and reused["frames"] == first["frames"]
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert read_toy_manifest(copy) is None  # a copy's manifest is its own kind, never taken for a toy OPV2V set
    manifest = read_toy_manifest(copy, V2V4REAL_SET)
    assert manifest["complete"] and manifest["layout"] == "v2v4real" and manifest["seed"] == SEED
    assert manifest["source"] == {k: v for k, v in read_toy_manifest(source).items()
                                  if k not in ("summary", "complete")}
    assert "Reused" in format_v2v4real_summary(reused) and "Wrote" in format_v2v4real_summary(first)


def test_another_seed_changes_only_the_random_labels(sets, tmp_path):
    source, copy, _ = sets
    other = write_v2v4real_copy(source, tmp_path / "seed1", seed=1)
    a, b = _data_files(copy), _data_files(tmp_path / "seed1")
    assert a.keys() == b.keys() and a != b
    assert all(a[name] == b[name] for name in a if name.endswith(".pcd"))
    assert other["seed"] == 1


def test_a_source_that_is_not_a_complete_toy_set_is_refused(sets, tmp_path):
    source, copy, _ = sets
    plain = tmp_path / "plain"
    (plain / "train").mkdir(parents=True)
    for bad in (plain, tmp_path / "missing", copy):
        with pytest.raises(DataError) as error:
            write_v2v4real_copy(bad, tmp_path / "out", seed=SEED)
        assert str(bad) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DataError, match="must not be written into"):
        write_v2v4real_copy(source, source / "copy", seed=SEED)
    assert not (source / "copy").exists()


def test_an_interrupted_or_damaged_source_is_refused(sets, tmp_path):
    source, _, _ = sets
    partial = tmp_path / "partial"
    shutil.copytree(source, partial)
    write_manifest(partial, dict(read_toy_manifest(source), complete=False))
    with pytest.raises(DataError, match="incomplete"):
        write_v2v4real_copy(partial, tmp_path / "out", seed=SEED)
    write_manifest(partial, read_toy_manifest(source))
    next(partial.glob("test/*/*/*.pcd")).unlink()
    with pytest.raises(DataError, match="incomplete"):
        write_v2v4real_copy(partial, tmp_path / "out", seed=SEED)
