"""V2XSet on the data side: road-side units (negative folder ids) are read last and never the ego, the
intermediate-fusion dataset carries V2X-ViT's prior_encoding and spatial_correction_matrix, the toy world writes
an RSU with --rsu (deterministically, leaving the vehicles-only sets alone), upstream's wild_setting without delay
or noise changes nothing and its ill-typed values are refused (delay and noise themselves: test_wild_setting.py),
and the V2X-ViT hypes keep upstream's values."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Dict

import numpy as np
import pytest

from launch import load_tool, one_line_error
from zoo import hypes_of
import torch
import yaml

from opencood_ddp.data import opv2v
from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.pcd import read_pcd
from opencood_ddp.errors import ConfigError, DataError
from opencood_ddp.toy.config import LidarConfig, RsuConfig, ToyWorldConfig
from opencood_ddp.toy.manifest import MANIFEST_NAME, read_toy_manifest
from opencood_ddp.toy.writer import generate_toy_opv2v

REPO = Path(__file__).resolve().parents[1]
V2XVIT = REPO / "hypes_yaml" / "v2xset" / "point_pillar_v2xvit.yaml"
UPSTREAM_V2XVIT = REPO / "tests" / "reference" / "upstream_hypes" / "point_pillar_v2xvit.yaml"
SEED = 3
RSU_ID = "-1"
# Upstream's wild_setting block of point_pillar_v2xvit.yaml: no delay, no noise.
UPSTREAM_WILD = {"async": False, "async_mode": "sim", "async_overhead": 100, "seed": 25, "loc_err": False,
                 "xyz_std": 0.2, "ryp_std": 0.2, "data_size": 1.06, "transmission_speed": 27,
                 "backbone_delay": 10}
TINY = dataclasses.replace(ToyWorldConfig.preset("small"), train_scenarios=1, validate_scenarios=0,
                           test_scenarios=1, frames_per_scenario=2, lidar=LidarConfig(beams=8, azimuth_steps=128))


@pytest.fixture(scope="module")
def toy_rsu(tmp_path_factory) -> Path:
    """The small toy world (seed 0) with one road-side unit per scenario."""
    root = tmp_path_factory.mktemp("toy_rsu")
    summary = generate_toy_opv2v(root, seed=0, scale="small", rsu=True)
    assert summary["rsus_per_scenario"] == 1 and not summary["skipped"]
    return root


def toy_hypes(kind: str, root: Path, *overrides: str) -> dict:
    return hypes_of(f"toy/point_pillar_{kind}_fusion", *overrides, toy_root=root)


def write_cav(scenario: Path, cav_id: str, timestamps=("000068", "000070"), speed=18.0) -> None:
    for stamp in timestamps:
        (scenario / cav_id).mkdir(parents=True, exist_ok=True)
        params = {"lidar_pose": [0, 0, 1.9, 0, 0, 0], "ego_speed": speed, "vehicles": {}}
        (scenario / cav_id / f"{stamp}.yaml").write_text(yaml.safe_dump(params))
        (scenario / cav_id / f"{stamp}.pcd").write_bytes(b"")


# ------------------------------------------------------------------------------------- scanning


def test_rsus_are_read_last_flagged_and_never_the_ego(tmp_path):
    scenario = tmp_path / "2021_08_22_21_41_24"
    for cav in ("-1", "650", "-2", "1045"):
        write_cav(scenario, cav)
    index = opv2v.scan_split(tmp_path)
    cavs = index.scenarios[0].cavs
    assert [c.cav_id for c in cavs] == ["1045", "650", "-1", "-2"]
    assert [c.infra for c in cavs] == [False, False, True, True]
    frame = opv2v.read_frame(index, 0)
    assert [(c.cav_id, c.ego, c.infra) for c in frame.values()] == [
        ("1045", True, False), ("650", False, False), ("-1", False, True), ("-2", False, True)]
    # max_cav keeps vehicles first: RSUs are the first dropped, as upstream.
    assert opv2v.scan_split(tmp_path, max_cav=2).scenarios[0].cav_ids == ("1045", "650")
    assert opv2v.scan_split(tmp_path, max_cav=3).scenarios[0].cav_ids == ("1045", "650", "-1")
    assert not opv2v.is_rsu_id("rsu") and not opv2v.is_rsu_id("0") and opv2v.is_rsu_id("-12")


def test_a_scenario_of_road_side_units_only_is_refused(tmp_path):
    write_cav(tmp_path / "a", "7")
    for cav in ("-1", "-2"):
        write_cav(tmp_path / "b", cav)
    with pytest.raises(DataError) as info:
        opv2v.scan_split(tmp_path)
    one_line_error(info, str(tmp_path / "b"), "road-side unit", "-1, -2", "never the ego")


def test_ego_speed_is_read_in_km_h_and_checked():
    assert opv2v.ego_speed_of({"ego_speed": 36}, "f.yaml") == 36.0
    for params, fragment in (({}, "no 'ego_speed'"), ({"ego_speed": "fast"}, "must be a number"),
                             ({"ego_speed": True}, "must be a number")):
        with pytest.raises(DataError) as info:
            opv2v.ego_speed_of(params, "s/1/000068.yaml")
        one_line_error(info, "s/1/000068.yaml", fragment)


# ------------------------------------------------------------------------------------- toy RSU


def test_toy_rsu_is_a_static_tall_sensor_written_like_a_cav(toy_rsu):
    scenarios = sorted(p for split in ("train", "validate", "test") for p in (toy_rsu / split).iterdir())
    assert len(scenarios) == 4
    mount = RsuConfig().mount_height_m
    for scenario in scenarios:
        folders = sorted(p.name for p in scenario.iterdir())
        assert [f for f in folders if f.startswith("-")] == [RSU_ID]
        cav = next(f for f in folders if f != RSU_ID)
        assert sorted(p.name for p in (scenario / RSU_ID).iterdir()) == sorted(p.name for p in (scenario / cav).iterdir())
        metas = [yaml.safe_load(p.read_text()) for p in sorted((scenario / RSU_ID).glob("*.yaml"))]
        for meta in metas:
            assert meta["ego_speed"] == 0.0
            assert meta["lidar_pose"] == metas[0]["lidar_pose"], "an RSU does not move"
            assert meta["lidar_pose"][2] == mount and meta["lidar_pose"][3] == meta["lidar_pose"][5] == 0.0
            assert meta["true_ego_pos"] == meta["predicted_ego_pos"] == meta["lidar_pose"][:2] + [0.0] + \
                meta["lidar_pose"][3:]
            assert {int(c) for c in folders if c != RSU_ID} <= set(meta["vehicles"]), "the CAVs are vehicles too"
        for folder in folders:
            if folder != RSU_ID:
                listed = yaml.safe_load(next((scenario / folder).glob("*.yaml")).read_text())["vehicles"]
                assert all(v > 0 for v in listed), "a CAV does not list the RSU as a vehicle"
        points = read_pcd(next((scenario / RSU_ID).glob("*.pcd")))
        assert 3000 < len(points) < 40000
        assert (np.abs(points[:, 2] + mount) < 0.1).mean() > 0.3, "much ground, a mount's height below the sensor"


def _files(root: Path) -> Dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def test_rsu_generation_is_deterministic_and_leaves_the_vehicles_alone(tmp_path):
    first = generate_toy_opv2v(tmp_path / "a", seed=SEED, config=TINY, rsu=True)
    generate_toy_opv2v(tmp_path / "b", seed=SEED, config=dataclasses.replace(TINY, rsu=RsuConfig()))
    generate_toy_opv2v(tmp_path / "c", seed=SEED, config=TINY)
    generate_toy_opv2v(tmp_path / "d", seed=SEED + 1, config=TINY, rsu=True)
    a, b, c, d = (_files(tmp_path / name) for name in "abcd")
    assert a == b, "the same seed gives the same files"
    assert a != d
    rsu_files = {name for name in a if f"/{RSU_ID}/" in name}
    assert len(rsu_files) == 2 * TINY.frames_per_scenario * 2 and first["clouds"] == len(a) // 2
    assert set(a) - set(c) == rsu_files, "the RSU adds its own folder and nothing else"
    # Here the CAVs' yaml does not depend on the RSU (their clouds do: they see its pole). Not always: where the pole
    # turns a ray into a return, the frame Generator's later draws (predicted_ego_pos) move (docs/toy_world.md).
    assert {n: h for n, h in a.items() if n.endswith(".yaml") and n not in rsu_files} == \
        {n: h for n, h in c.items() if n.endswith(".yaml")}
    # A set without RSU keeps the manifest identity it had before RSUs existed; one with RSU differs.
    assert "rsu" not in read_toy_manifest(tmp_path / "c")["config"]
    assert read_toy_manifest(tmp_path / "a")["config"]["rsu"] == {"mount_height_m": 5.0, "rsu_id": -1}
    assert generate_toy_opv2v(tmp_path / "a", seed=SEED, config=TINY, rsu=True)["skipped"]
    assert not generate_toy_opv2v(tmp_path / "c", seed=SEED, config=TINY, rsu=True)["skipped"], "RSU: a new set"


def test_command_line_rsu_flag(tmp_path, capsys):
    module = load_tool("make_toy_opv2v.py")
    assert module.parse_args(["--out", "x"]).rsu is False
    assert module.main(["--out", str(tmp_path / "t"), "--seed", "1", "--scale", "small", "--rsu"]) == 0
    assert "plus 1 road-side unit" in capsys.readouterr().out
    assert all((scenario / RSU_ID).is_dir() for scenario in (tmp_path / "t" / "train").iterdir())


# ------------------------------------------------------------------------------------- V2X-ViT inputs


def _expected_prior(frame, max_cav: int) -> np.ndarray:
    rows = [[np.float64(c.params["ego_speed"]) / 30.0, 0.0, 1.0 if c.cav_id.startswith("-") else 0.0]
            for c in frame.values()]
    prior = np.zeros((max_cav, 3), dtype=np.float32)
    prior[:len(rows)] = np.array(rows, dtype=np.float64)  # float64 division, then one float32 rounding
    return prior


@pytest.mark.parametrize("split,train", [("train", True), ("test", False)])
def test_prior_encoding_and_spatial_correction_per_sample(toy_rsu, split, train):
    dataset = build_dataset(toy_hypes("intermediate", toy_rsu), split, train, SEED)
    max_cav = dataset.max_cav
    assert max_cav == 5
    seen_rsu = seen_moving = 0
    for i in range(len(dataset)):
        ego = dataset[i]["ego"]
        frame = opv2v.read_frame(dataset.source.index, i)
        prior, correction = ego["prior_encoding"], ego["spatial_correction_matrix"]
        assert prior.shape == (max_cav, 3) and prior.dtype == np.float32
        assert correction.shape == (max_cav, 4, 4) and correction.dtype == np.float64
        np.testing.assert_array_equal(prior, _expected_prior(frame, max_cav))
        assert list(frame)[-1] == RSU_ID and prior[ego["cav_num"] - 1, 2] == 1.0, "the RSU comes last"
        assert not prior[ego["cav_num"]:].any(), "zero rows past the sample's CAVs"
        assert (prior[:, 1] == 0).all(), "no delay model: time delay 0"
        np.testing.assert_array_equal(correction, np.broadcast_to(np.identity(4), (max_cav, 4, 4)))
        seen_rsu += prior[:, 2].sum()
        seen_moving += (prior[:, 0] > 0).sum()
    assert seen_rsu == len(dataset) and seen_moving > 0


def test_batches_stack_the_prior_and_correction_in_sample_order(toy_rsu):
    dataset = build_dataset(toy_hypes("intermediate", toy_rsu), "train", True, SEED)
    samples = [dataset[0], dataset[len(dataset) - 1], dataset[1]]
    counts = [s["ego"]["cav_num"] for s in samples]
    assert len(set(counts)) == 2, "the two training scenarios have different CAV counts"
    batch = dataset.collate_batch_train(samples)["ego"]
    prior, correction = batch["prior_encoding"], batch["spatial_correction_matrix"]
    assert prior.shape == (3, 5, 3) and prior.dtype == torch.float32
    assert correction.shape == (3, 5, 4, 4) and correction.dtype == torch.float64
    for k, sample in enumerate(samples):
        assert torch.equal(prior[k], torch.from_numpy(sample["ego"]["prior_encoding"]))
        assert torch.equal(correction[k], torch.from_numpy(sample["ego"]["spatial_correction_matrix"]))
    assert batch["record_len"].tolist() == counts
    assert batch["pairwise_t_matrix"].shape == (3, 5, 5, 4, 4), "kept as it was"
    test_batch = dataset.collate_batch_test(samples[:1])["ego"]
    assert test_batch["prior_encoding"].shape == (1, 5, 3) and test_batch["spatial_correction_matrix"].shape == \
        (1, 5, 4, 4)


def test_max_cav_pads_and_drops_rsus_first(toy_rsu):
    wide = build_dataset(toy_hypes("intermediate", toy_rsu, "train_params.max_cav=7"), "train", True, SEED)
    assert wide[0]["ego"]["prior_encoding"].shape == (7, 3)
    assert wide[0]["ego"]["spatial_correction_matrix"].shape == (7, 4, 4)
    narrow = build_dataset(toy_hypes("intermediate", toy_rsu, "train_params.max_cav=2"), "train", True, SEED)
    for i in range(len(narrow)):
        ego = narrow[i]["ego"]
        assert ego["prior_encoding"].shape == (2, 3) and ego["cav_num"] == 2
        assert not ego["prior_encoding"][:, 2].any(), "with room for two, both are vehicles"


# ------------------------------------------------------------------------------------- wild_setting


def _one_sample(dataset) -> dict:
    return dataset.collate_batch_train([dataset[2]])["ego"]


def test_upstream_wild_setting_without_delay_or_noise_changes_nothing(toy_rsu):
    plain = build_dataset(toy_hypes("intermediate", toy_rsu), "validate", False, SEED)
    wild = toy_hypes("intermediate", toy_rsu, "fusion.args.cur_ego_pose_flag=false")
    wild["wild_setting"] = dict(UPSTREAM_WILD)
    a, b = _one_sample(plain), _one_sample(build_dataset(wild, "validate", False, SEED))
    assert a.keys() == b.keys()
    for key in ("object_bbx_center", "prior_encoding", "spatial_correction_matrix", "pairwise_t_matrix"):
        assert torch.equal(a[key], b[key]), key
    for key in a["processed_lidar"]:
        assert torch.equal(a["processed_lidar"][key], b["processed_lidar"][key]), key


@pytest.mark.parametrize("kind", ["early", "intermediate", "late"])
@pytest.mark.parametrize("key,value,fragment", [
    ("async_mode", "fast", "key wild_setting.async_mode must be 'sim' or 'real'"),
    ("async", "no", "key wild_setting.async must be true or false"),
    ("xyz_std", "0.2m", "key wild_setting.xyz_std must be a number"),
    ("async_overhead", -100, "key wild_setting.async_overhead must be a finite number >= 0 (ms)"),
])
def test_bad_wild_settings_are_refused(toy_rsu, kind, key, value, fragment):
    hypes = toy_hypes(kind, toy_rsu)
    hypes["wild_setting"] = dict(UPSTREAM_WILD, **{key: value})
    with pytest.raises(ConfigError) as info:
        build_dataset(hypes, "train", True, SEED)
    one_line_error(info, fragment)


def test_cur_ego_pose_flag_must_be_a_bool(toy_rsu):
    with pytest.raises(ConfigError) as info:
        build_dataset(toy_hypes("intermediate", toy_rsu, "fusion.args.cur_ego_pose_flag=maybe"), "train", True, SEED)
    one_line_error(info, "fusion.args.cur_ego_pose_flag must be true or false")


# ------------------------------------------------------------------------------------- hypes


def test_v2xvit_hypes_keep_upstream_values_and_point_at_v2xset(toy_rsu):
    hypes = hypes_of(V2XVIT)
    assert (hypes["root_dir"], hypes["validate_dir"], hypes["test_dir"]) == \
        ("v2xset/train", "v2xset/validate", "v2xset/test")
    assert hypes["model"]["core_method"] == "point_pillar_transformer"
    assert hypes["fusion"] == {"core_method": "IntermediateFusionDataset", "args": {"cur_ego_pose_flag": False}}
    assert hypes["wild_setting"] == UPSTREAM_WILD
    # After the yaml parser, everything but our test_dir equals upstream's resolved file.
    ours = {key: value for key, value in hypes.items() if key != "test_dir"}
    assert ours == hypes_of(UPSTREAM_V2XVIT)
    # The data side of the file builds on a V2XSet-like split (the model is not built here).
    dataset = build_dataset(hypes_of(V2XVIT, toy_root=toy_rsu), "train", True, SEED)
    ego = dataset.collate_batch_train([dataset[0]])["ego"]
    assert ego["prior_encoding"].shape == (1, 5, 3) and ego["spatial_correction_matrix"].shape == (1, 5, 4, 4)
