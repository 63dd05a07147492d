"""OPV2V scanner and frame reader on small hand-built folder trees (no point cloud is read)."""
import pickle
from pathlib import Path

import numpy as np
import pytest

from launch import one_line_error
import yaml

from opencood_ddp.data import geometry as geo
from opencood_ddp.data import opv2v
from opencood_ddp.errors import ConfigError, DataError

TIMESTAMPS = ("000068", "000070", "000072")


def write_frame(cav_dir: Path, timestamp: str, lidar_pose=(0, 0, 1.9, 0, 0, 0), vehicles=None, **extra):
    cav_dir.mkdir(parents=True, exist_ok=True)
    params = {"lidar_pose": list(lidar_pose), "ego_speed": 18.5, "vehicles": vehicles or {}, **extra}
    (cav_dir / f"{timestamp}.yaml").write_text(yaml.safe_dump(params))
    (cav_dir / f"{timestamp}.pcd").write_bytes(b"")  # scanning never opens point clouds


def make_cav(scenario: Path, cav_id: str, timestamps=TIMESTAMPS, pose=(0, 0, 1.9, 0, 0, 0)):
    for ts in timestamps:
        write_frame(scenario / cav_id, ts, pose)
    return scenario / cav_id


# ------------------------------------------------------------------------------------- scanning


def test_order_strings_negative_last_and_files_ignored(tmp_path):
    scenario = tmp_path / "2021_08_18_19_48_05"
    for cav in ("650", "1045", "-1", "88"):
        make_cav(scenario, cav)
    (scenario / "data_protocol.yaml").write_text("world: {}\n")
    (tmp_path / "readme.txt").write_text("not a scenario")
    index = opv2v.scan_split(tmp_path)
    assert [s.name for s in index.scenarios] == ["2021_08_18_19_48_05"]
    assert index.scenarios[0].cav_ids == ("1045", "650", "88", "-1")
    assert index.scenarios[0].ego.cav_id == "1045"


def test_every_negative_id_goes_last():
    assert opv2v.order_cav_ids(["-2", "7", "-1", "12"], 7) == ["12", "7", "-1", "-2"]
    assert opv2v.order_cav_ids(["-1"], 7) == ["-1"]


def test_scenarios_sorted_as_strings(tmp_path):
    for name in ("2021_08_20_21_10_24", "2021_08_18_19_48_05", "2021_08_18_9"):
        make_cav(tmp_path / name, "1")
    names = [s.name for s in opv2v.scan_split(tmp_path).scenarios]
    assert names == ["2021_08_18_19_48_05", "2021_08_18_9", "2021_08_20_21_10_24"]


def test_max_cav_keeps_first_in_order(tmp_path):
    scenario = tmp_path / "s"
    for cav in ("30", "10", "20", "-1"):
        make_cav(scenario, cav)
    assert opv2v.scan_split(tmp_path, max_cav=2).scenarios[0].cav_ids == ("10", "20")
    assert opv2v.scan_split(tmp_path, max_cav=3).scenarios[0].cav_ids == ("10", "20", "30")
    assert opv2v.scan_split(tmp_path).scenarios[0].cav_ids == ("10", "20", "30", "-1")
    with pytest.raises(ConfigError, match="max_cav"):
        opv2v.scan_split(tmp_path, max_cav=0)


def test_timestamps_sorted_additional_and_other_files_skipped(tmp_path):
    cav = make_cav(tmp_path / "s", "5", ("000072", "000068", "000070"))
    (cav / "000068_additional.yaml").write_text("lidar_pose: [0, 0, 0, 0, 0, 0]\n")
    (cav / "additional_000069.yaml").write_text("lidar_pose: [0, 0, 0, 0, 0, 0]\n")
    (cav / "000068_camera0.png").write_bytes(b"")
    record = opv2v.scan_split(tmp_path).scenarios[0].ego
    assert record.timestamps == ("000068", "000070", "000072")
    assert record.yaml_path("000070") == cav / "000070.yaml"
    assert record.pcd_path("000070") == cav / "000070.pcd"


def test_length_and_locate(tmp_path):
    make_cav(tmp_path / "a", "1", ("000001", "000003", "000005"))
    make_cav(tmp_path / "a", "2", ("000001", "000003", "000005", "000007"))  # extra timestamps are fine
    (tmp_path / "b" / "9").mkdir(parents=True)  # ego with no timestamp: contributes no sample
    make_cav(tmp_path / "c", "4", ("000010", "000012"))
    index = opv2v.scan_split(tmp_path)
    assert len(index) == 5
    located = [(s.name, ts) for s, ts in (index.locate(i) for i in range(len(index)))]
    assert located == [("a", "000001"), ("a", "000003"), ("a", "000005"), ("c", "000010"), ("c", "000012")]
    assert index.locate(np.int64(4))[1] == "000012"
    for bad in (-1, 5):
        with pytest.raises(IndexError):
            index.locate(bad)
    assert pickle.loads(pickle.dumps(index)) == index


# ---------------------------------------------------------------------------------------- frames


def test_read_frame_comm_range_rule(tmp_path):
    scenario = tmp_path / "s"
    make_cav(scenario, "100", pose=(10, 20, 1.9, 0, 30, 0))  # ego
    make_cav(scenario, "200", pose=(10 + 42, 20 + 56, 1.9, 0, 0, 0))  # exactly 70 m in x-y: kept
    make_cav(scenario, "300", pose=(10 + 70.01, 20, 1.9, 0, 0, 0))  # just beyond: dropped
    make_cav(scenario, "400", pose=(10, 20 - 69, 500, 0, 0, 0))  # 69 m in x-y, far in z: kept
    index = opv2v.scan_split(tmp_path)
    frame = opv2v.read_frame(index, 1)
    assert list(frame) == ["100", "200", "400"]
    assert [c.ego for c in frame.values()] == [True, False, False]
    assert frame["200"].distance_to_ego == pytest.approx(70.0)
    assert frame["400"].distance_to_ego == pytest.approx(69.0)
    assert list(opv2v.read_frame(index, 1, apply_comm_range=False)) == ["100", "200", "300", "400"]
    tight = opv2v.scan_split(tmp_path, comm_range=50.0)
    assert list(opv2v.read_frame(tight, 0)) == ["100"]


def test_read_frame_contents_and_single_parse(tmp_path, monkeypatch):
    scenario = tmp_path / "s"
    make_cav(scenario, "1", pose=(1, 2, 3, 4, 5, 6))
    make_cav(scenario, "2", pose=(7, 8, 9, 0, 0, 0))
    index = opv2v.scan_split(tmp_path)
    calls = []
    real_load = opv2v.load_opv2v_yaml
    monkeypatch.setattr(opv2v, "load_opv2v_yaml", lambda p: calls.append(Path(p)) or real_load(p))
    frame = opv2v.read_frame(index, 2)
    assert sorted(calls) == [scenario / "1" / "000072.yaml", scenario / "2" / "000072.yaml"]
    ego = frame["1"]
    np.testing.assert_array_equal(ego.lidar_pose, [1, 2, 3, 4, 5, 6])
    assert ego.lidar_pose.dtype == np.float64
    assert ego.params["ego_speed"] == 18.5 and ego.params["lidar_pose"] == [1, 2, 3, 4, 5, 6]
    assert ego.pcd_path == scenario / "1" / "000072.pcd"
    assert ego.meta_path == scenario / "1" / "000072.yaml"
    assert ego.distance_to_ego == 0.0


def test_two_cav_frame_ground_truth_in_ego_frame(tmp_path):
    scenario = tmp_path / "s"
    car = {"location": [100, 60, 0], "center": [0, 0, 0.75], "extent": [2.2, 1, 0.75], "angle": [0, 90, 0]}
    write_frame(scenario / "11", "000000", (100, 50, 1.9, 0, 90, 0), vehicles={7: car})
    write_frame(scenario / "22", "000000", (110, 50, 1.9, 0, 0, 0), vehicles={7: car})
    frame = opv2v.read_frame(opv2v.scan_split(tmp_path), 0)
    ego_pose = frame["11"].lidar_pose
    boxes = geo.project_world_objects(frame["22"].params["vehicles"], ego_pose, [-140.8, -40, -3, 140.8, 40, 1])
    corners = geo.boxes_to_corners(boxes[7], "hwl")
    expected = [[12.2, -1, -1.9], [12.2, 1, -1.9], [7.8, 1, -1.9], [7.8, -1, -1.9],
                [12.2, -1, -0.4], [12.2, 1, -0.4], [7.8, 1, -0.4], [7.8, -1, -0.4]]
    np.testing.assert_allclose(corners, expected, atol=1e-4)


# ------------------------------------------------------------------------------------------- YAML


def test_yaml_loader_matches_upstream_values(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text(
        "lidar_pose: [1e-3, 2E5, -1.5e+2, 1.5, .5, 3]\n"
        "ratio: 1.0e-3\n"
        "count: 7\n"
        "flag: true\n"
        "pair: !!python/tuple [1, 2.5]\n"
        "name: '000068'\n"
        "vehicles: {1005: {angle: [0, 90, 0]}}\n"
    )
    params = opv2v.load_opv2v_yaml(path)
    assert params["lidar_pose"] == [0.001, 200000.0, -150.0, 1.5, 0.5, 3]
    assert all(isinstance(v, float) for v in params["lidar_pose"][:5])
    assert params["ratio"] == 0.001 and params["count"] == 7 and params["flag"] is True
    assert params["pair"] == (1, 2.5)
    assert params["name"] == "000068"
    assert list(params["vehicles"]) == [1005]
    # The global loaders stay untouched.
    assert yaml.safe_load("x: 1e-3")["x"] == "1e-3"


def test_yaml_python_object_tag_refused(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("x: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.load_opv2v_yaml(path)
    one_line_error(exc_info, str(path), "unsupported YAML tag", "python/object")


# ------------------------------------------------------------------------------------------ errors


def test_error_root_missing(tmp_path):
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path / "nope")
    one_line_error(exc_info, str(tmp_path / "nope"), "not found", "root_dir")


def test_error_no_scenario(tmp_path):
    (tmp_path / "data_protocol.yaml").write_text("a: 1\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path)
    one_line_error(exc_info, str(tmp_path), "no scenario", "empty split")


def test_error_the_data_sets_root_for_a_split(tmp_path):
    """The data set's root passed for a split (say --dataset_dir /data/opv2v): its splits were scanned as scenarios
    and the run failed later as an 'empty split' under the key inference replaces (validate_dir)."""
    make_cav(tmp_path / "test" / "2021_08_18_19_48_05", "1")
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path, key="--dataset_dir")
    one_line_error(exc_info, f"--dataset_dir {tmp_path}: holds the splits test, train, not scenarios",
                   f"pass --dataset_dir an OPV2V split folder such as {tmp_path / 'test'}")


def test_error_scenario_without_cav(tmp_path):
    make_cav(tmp_path / "a", "1")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "data_protocol.yaml").write_text("a: 1\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path)
    one_line_error(exc_info, str(tmp_path / "b"), "no CAV folder")


def test_a_scenario_given_for_a_split_is_named_so_and_no_folder_is_to_be_removed(tmp_path):
    """A scenario passed where a split goes: its CAV folders look like scenarios without CAVs, and the line told
    the user to remove them, real data. It now says the path is a scenario and names the split above it."""
    scenario = tmp_path / "test" / "2021_08_18_19_48_05"
    make_cav(scenario, "1")
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(scenario, key="--dataset_dir")
    one_line_error(exc_info, f"{scenario / '1'}: holds frames", f"{scenario} is a scenario, not a split",
                   f"such as {tmp_path / 'test'}")
    assert "remove" not in str(exc_info.value)


def test_another_data_sets_root_given_for_an_opv2v_split_is_said_under_the_flag(tmp_path):
    """--dataset_dir pointing at a folder whose sub-folders hold no frames (DAIR-V2X-C's root) was reported under
    validate_dir, the hypes key it stood in for: the source checks the whole split where it checks the path."""
    from opencood_ddp.data.sources.opv2v import Opv2vSource

    for name in ("cooperative", "vehicle-side"):
        (tmp_path / "dair" / name / "label").mkdir(parents=True)
    with pytest.raises(DataError) as exc_info:
        Opv2vSource.split_path(tmp_path / "dair", "--dataset_dir")
    one_line_error(exc_info, f"--dataset_dir {tmp_path / 'dair'}")


def test_error_no_timestamp(tmp_path):
    (tmp_path / "a" / "1").mkdir(parents=True)
    (tmp_path / "a" / "1" / "000000_additional.yaml").write_text("a: 1\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path)
    one_line_error(exc_info, str(tmp_path), "no timestamp", "empty split")


def test_error_cav_missing_ego_timestamp(tmp_path):
    make_cav(tmp_path / "s", "1", ("000000", "000002", "000004"))
    make_cav(tmp_path / "s", "2", ("000000", "000004"))
    with pytest.raises(DataError) as exc_info:
        opv2v.scan_split(tmp_path)
    one_line_error(exc_info, str(tmp_path / "s" / "2" / "000002.yaml"), "CAV 2", "000002", "ego 1")


def test_error_yaml_without_lidar_pose(tmp_path):
    make_cav(tmp_path / "s", "1")
    bad = tmp_path / "s" / "1" / "000070.yaml"
    bad.write_text(yaml.safe_dump({"ego_speed": 1.0, "vehicles": {}}))
    index = opv2v.scan_split(tmp_path)
    opv2v.read_frame(index, 0)  # other frames are fine
    with pytest.raises(DataError) as exc_info:
        opv2v.read_frame(index, 1)
    one_line_error(exc_info, str(bad), "no 'lidar_pose'")


def test_error_lidar_pose_wrong_length(tmp_path):
    make_cav(tmp_path / "s", "1")
    bad = tmp_path / "s" / "1" / "000068.yaml"
    bad.write_text("lidar_pose: [1, 2, 3]\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.read_frame(opv2v.scan_split(tmp_path), 0)
    one_line_error(exc_info, str(bad), "6 numbers")


def test_error_malformed_yaml(tmp_path):
    make_cav(tmp_path / "s", "1")
    make_cav(tmp_path / "s", "2")
    bad = tmp_path / "s" / "2" / "000068.yaml"
    bad.write_text("lidar_pose: [1, 2, 3\nvehicles: {\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.read_frame(opv2v.scan_split(tmp_path), 0)
    one_line_error(exc_info, str(bad), "malformed YAML", "line")


def test_error_yaml_not_a_mapping_and_deleted(tmp_path):
    make_cav(tmp_path / "s", "1")
    index = opv2v.scan_split(tmp_path)
    (tmp_path / "s" / "1" / "000068.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(DataError) as exc_info:
        opv2v.read_frame(index, 0)
    one_line_error(exc_info, "000068.yaml", "expected a mapping")
    (tmp_path / "s" / "1" / "000070.yaml").unlink()
    with pytest.raises(DataError) as exc_info:
        opv2v.read_frame(index, 1)
    one_line_error(exc_info, "000070.yaml", "not found")


def test_a_v2v4real_frame_read_as_opv2v_names_the_layout_not_a_re_export(tmp_path):
    """An OPV2V run evaluated on a V2V4Real split meets its numpy poses (written here by PyYAML's own dump): the
    line told the user to re-export valid frames; it names the layout that reads them. The V2V4Real loader reads
    the same file."""
    from opencood_ddp.data.sources.v2v4real import V2V4RealYamlLoader

    path = tmp_path / "000000.yaml"
    path.write_text(yaml.dump({"lidar_pose": np.eye(4)}))
    with pytest.raises(DataError) as exc_info:
        opv2v.load_opv2v_yaml(path)
    one_line_error(exc_info, str(path), "unsupported YAML tag", "fusion.dataset: v2v4real")
    assert "re-export" not in str(exc_info.value)
    assert np.array_equal(opv2v.load_opv2v_yaml(path, V2V4RealYamlLoader)["lidar_pose"], np.eye(4))
