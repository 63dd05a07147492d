"""Hypes YAML: loading (1e-3 floats), --set overrides, the point_pillar yaml_parser, validation, saving."""
import copy
import os
import stat

import numpy as np
import pytest

from launch import REPO
from opencood_ddp import hypes as H
from opencood_ddp import yaml_parsers as YP
from opencood_ddp.errors import ConfigError


def _write(path, text):
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------- load
def test_load_reads_exponent_floats_and_keeps_ints(tmp_path):
    path = _write(tmp_path / "h.yaml", "optimizer:\n  lr: 1e-3\n  eps: 2E5\n  wd: 1.0e-4\n  neg: -3e2\n"
                                       "train_params:\n  batch_size: 4\n  epoches: 15\n  big: 1_000\n"
                                       "name: point_pillar\nflag: true\nnothing: null\n")
    hypes = H.load_hypes(path)
    assert hypes["optimizer"]["lr"] == 1e-3 and type(hypes["optimizer"]["lr"]) is float
    assert hypes["optimizer"]["eps"] == 2e5 and type(hypes["optimizer"]["eps"]) is float
    assert hypes["optimizer"]["wd"] == 1e-4 and type(hypes["optimizer"]["wd"]) is float
    assert hypes["optimizer"]["neg"] == -300.0 and type(hypes["optimizer"]["neg"]) is float
    assert hypes["train_params"]["batch_size"] == 4 and type(hypes["train_params"]["batch_size"]) is int
    assert hypes["train_params"]["epoches"] == 15 and type(hypes["train_params"]["epoches"]) is int
    assert hypes["train_params"]["big"] == 1000 and type(hypes["train_params"]["big"]) is int
    assert hypes["name"] == "point_pillar"
    assert hypes["flag"] is True and hypes["nothing"] is None


def test_load_malformed_yaml_names_file_and_line(tmp_path):
    path = _write(tmp_path / "bad.yaml", "name: x\ntrain_params:\n  batch_size: 2\n  epoches: [1, 2\nother: 3\n")
    with pytest.raises(ConfigError) as info:
        H.load_hypes(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "malformed YAML" in msg
    assert "at line 5" in msg


def test_load_malformed_indentation_line(tmp_path):
    path = _write(tmp_path / "bad2.yaml", "a: 1\nb:\n  c: 2\n d: 3\n")
    with pytest.raises(ConfigError) as info:
        H.load_hypes(path)
    assert str(path) in str(info.value) and "at line 4" in str(info.value)


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        H.load_hypes(path)
    assert str(path) in str(info.value) and "does not exist" in str(info.value)


def test_load_directory_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; pass --hypes_yaml a YAML file in it"):
        H.load_hypes(tmp_path)


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "list"), ("42\n", "int"), ("", "NoneType"),
                                       ("just text\n", "str")])
def test_load_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = _write(tmp_path / "top.yaml", text)
    with pytest.raises(ConfigError) as info:
        H.load_hypes(path)
    assert str(path) in str(info.value) and "mapping" in str(info.value) and f"got {kind}" in str(info.value)


# ------------------------------------------------------------------------------------------- overrides
BASE = {"name": "pp", "train_params": {"batch_size": 4, "epoches": 10},
        "optimizer": {"lr": 0.002, "args": {"eps": 1e-10}},
        "head": [{"dim": 8}, {"dim": 16}]}


def test_override_typing_and_nesting():
    original = copy.deepcopy(BASE)
    out = H.apply_overrides(BASE, ["train_params.batch_size=2", "optimizer.lr=1e-3", "new.deep.key=[1, 2]",
                                   "train_params.find_unused_parameters=true", "name=x", "optimizer.args.eps=0.5"])
    assert out["train_params"]["batch_size"] == 2 and type(out["train_params"]["batch_size"]) is int
    assert out["optimizer"]["lr"] == 1e-3 and type(out["optimizer"]["lr"]) is float
    assert out["new"] == {"deep": {"key": [1, 2]}}
    assert out["train_params"]["find_unused_parameters"] is True
    assert out["name"] == "x"
    assert out["optimizer"]["args"] == {"eps": 0.5}
    assert out["train_params"]["epoches"] == 10 and out["head"] == BASE["head"]
    assert BASE == original  # input not mutated


def test_override_does_not_mutate_nested_lists():
    original = copy.deepcopy(BASE)
    out = H.apply_overrides(BASE, ["head.0.dim=32", "head.1=7"])
    assert out["head"] == [{"dim": 32}, 7]
    assert BASE == original


def test_override_list_index_nested():
    out = H.apply_overrides({"a": [{"b": 1}, {"b": 2}]}, ["a.1.b=5", "a.0.c=x"])
    assert out == {"a": [{"b": 1, "c": "x"}, {"b": 5}]}


def test_repeated_overrides_apply_in_order():
    out = H.apply_overrides(BASE, ["train_params.batch_size=2", "train_params.batch_size=8"])
    assert out["train_params"]["batch_size"] == 8
    out = H.apply_overrides(BASE, ["x.y=2", "x.z=3"])
    assert out["x"] == {"y": 2, "z": 3}
    out = H.apply_overrides(BASE, ["optimizer.args={a: 1}", "optimizer.args.b=2"])
    assert out["optimizer"]["args"] == {"a": 1, "b": 2}
    out = H.apply_overrides(BASE, ["optimizer.args.b=2", "optimizer.args={a: 1}"])
    assert out["optimizer"]["args"] == {"a": 1}


def test_a_key_set_below_upstreams_empty_args_list_makes_it_a_mapping():
    """Upstream's files write `fusion: {args: []}` for no arguments: `--set fusion.args.proj_first=false` sets the
    key, as on a mapping. An index below it, or a non-empty list, keeps the list rules."""
    upstream = {"fusion": {"core_method": "IntermediateFusionDataset", "args": []}}
    out = H.apply_overrides(upstream, ["fusion.args.proj_first=false", "fusion.args.gt_transform=as_received"])
    assert out["fusion"]["args"] == {"proj_first": False, "gt_transform": "as_received"}
    assert upstream["fusion"]["args"] == []
    assert H.apply_overrides({"a": {"b": []}}, ["a.b.c.d=1"]) == {"a": {"b": {"c": {"d": 1}}}}
    for bad, fragment in (("fusion.args.0=1", "cannot set '0' inside a list"),
                          ("fusion.args.0.x=1", "cannot descend into '0'")):
        with pytest.raises(ConfigError, match=fragment):
            H.apply_overrides(upstream, [bad])
    with pytest.raises(ConfigError, match="cannot set 'x' inside a list"):
        H.apply_overrides({"fusion": {"args": [1]}}, ["fusion.args.x=1"])


def test_override_value_with_equals_and_spaces():
    out = H.apply_overrides({}, [" name = a=b", "s='2'"])
    assert out == {"name": "a=b", "s": "2"}


@pytest.mark.parametrize("bad", ["novalue", "=3", "  =3"])
def test_override_bad_form(bad):
    with pytest.raises(ConfigError) as info:
        H.apply_overrides(BASE, [bad])
    assert repr(bad) in str(info.value) and "key.sub=value" in str(info.value)


@pytest.mark.parametrize("bad,fragment", [
    ("name.sub=1", "cannot set 'sub' inside a str"),
    ("name.sub.deeper=1", "cannot descend into 'sub'"),
    ("head.5.dim=1", "cannot descend into '5'"),
    ("head.x=1", "cannot set 'x' inside a list"),
])
def test_override_into_non_mapping(bad, fragment):
    with pytest.raises(ConfigError) as info:
        H.apply_overrides(BASE, [bad])
    assert fragment in str(info.value)


def test_override_malformed_value():
    with pytest.raises(ConfigError) as info:
        H.apply_overrides(BASE, ["a=[1, 2"])
    assert "--set 'a=[1, 2'" in str(info.value) and "malformed YAML" in str(info.value)


def test_get_key():
    assert H.get_key(BASE, "optimizer.args.eps") == 1e-10
    assert H.get_key(BASE, "optimizer.nope", 5) == 5
    assert H.get_key(BASE, "name.sub") is None


# ------------------------------------------------------------------------------------------- yaml_parser
def _point_pillar_hypes():
    return {
        "yaml_parser": "load_point_pillar_params",
        "preprocess": {"cav_lidar_range": [-140.8, -40, -3, 140.8, 40, 1],
                       "args": {"voxel_size": [0.4, 0.4, 4], "max_points_per_voxel": 32}},
        "model": {"args": {"point_pillar_scatter": {"num_features": 64}}},
        "postprocess": {"anchor_args": {"l": 3.9, "w": 1.6, "h": 1.56, "num": 2}},
    }


def test_point_pillar_parser_opv2v_values():
    hypes = YP.run_yaml_parser(_point_pillar_hypes())
    assert hypes["model"]["args"]["point_pillar_scatter"] == {"num_features": 64, "grid_size": [704, 200, 1]}
    assert all(type(v) is int for v in hypes["model"]["args"]["point_pillar_scatter"]["grid_size"])
    anchor = hypes["postprocess"]["anchor_args"]
    assert (anchor["W"], anchor["H"], anchor["D"]) == (704, 200, 1)
    assert all(type(anchor[k]) is int for k in "WHD")
    assert (anchor["vw"], anchor["vh"], anchor["vd"]) == (0.4, 0.4, 4)
    assert anchor["l"] == 3.9 and anchor["num"] == 2


def test_the_canvas_has_the_voxelizers_cells_where_the_extent_is_a_half_number_of_voxels():
    """140.2 m of 0.4 m voxels is 350.5: spconv counts 351 cells (C's round, half away from zero), upstream's parser
    350 (np.round, half to even), which put the last column's pillars at the start of the next row. Both parsers
    give the canvas spconv's count (tests/test_device_points.py compares it with spconv's generator)."""
    pillars = _point_pillar_hypes()
    pillars["preprocess"]["cav_lidar_range"] = [-70.1, -40, -3, 70.1, 40, 1]
    assert YP.run_yaml_parser(pillars)["model"]["args"]["point_pillar_scatter"]["grid_size"] == [351, 200, 1]
    second = YP.run_yaml_parser({"yaml_parser": "load_second_params",
                                 "preprocess": {"cav_lidar_range": [-70.1, -40, -3, 70.1, 40, 1],
                                                "args": {"voxel_size": [0.4, 0.4, 4]}},
                                 "model": {"args": {}}, "postprocess": {"anchor_args": {"num": 2}}})
    assert second["model"]["args"]["grid_size"] == [351, 200, 1]


def test_point_pillar_parser_is_idempotent():
    once = YP.run_yaml_parser(_point_pillar_hypes())
    snapshot = copy.deepcopy(once)
    twice = YP.run_yaml_parser(copy.deepcopy(once))
    assert twice == snapshot


def test_point_pillar_parser_from_yaml_file(tmp_path):
    path = _write(tmp_path / "pp.yaml", """
yaml_parser: load_point_pillar_params
preprocess:
  cav_lidar_range: [-140.8, -40, -3, 140.8, 40, 1]
  args:
    voxel_size: [0.4, 0.4, 4]
model:
  args:
    point_pillar_scatter:
      num_features: 64
postprocess:
  anchor_args: {l: 3.9}
""")
    hypes = YP.run_yaml_parser(H.load_hypes(path), str(path))
    assert hypes["model"]["args"]["point_pillar_scatter"]["grid_size"] == [704, 200, 1]
    assert hypes["postprocess"]["anchor_args"]["W"] == 704


def test_no_yaml_parser_is_a_no_op():
    hypes = {"name": "x"}
    assert YP.run_yaml_parser(hypes) == {"name": "x"}


def test_unknown_yaml_parser():
    with pytest.raises(ConfigError) as info:
        YP.run_yaml_parser({"yaml_parser": "load_voxl_params"}, "my.yaml")
    msg = str(info.value)
    assert "my.yaml" in msg and "'load_voxl_params'" in msg and "load_point_pillar_params" in msg
    assert "did you mean load_voxel_params" in msg


def test_point_pillar_parser_missing_section():
    hypes = _point_pillar_hypes()
    del hypes["postprocess"]
    with pytest.raises(ConfigError) as info:
        YP.run_yaml_parser(hypes, "my.yaml")
    assert "my.yaml" in str(info.value) and "postprocess.anchor_args" in str(info.value)


# ------------------------------------------------------------------------------------------- validate
GOOD = {"name": "pp", "train_params": {"batch_size": 4, "epoches": 10},
        "optimizer": {"core_method": "Adam", "lr": 0.002}}


def test_validate_accepts_good_hypes():
    assert H.validate(GOOD, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS) is None


def test_validate_reports_every_problem_in_one_error():
    hypes = copy.deepcopy(GOOD)
    del hypes["train_params"]["epoches"]
    del hypes["optimizer"]["core_method"]
    hypes["optimizer"]["lr"] = "fast"
    hypes["train_params"]["batch_size"] = 0
    hypes["train_params"]["seed"] = 1.5
    with pytest.raises(ConfigError) as info:
        H.validate(hypes, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS)
    msg = str(info.value)
    assert msg.startswith("h.yaml: ")
    assert "missing key train_params.epoches (a positive integer)" in msg
    assert "missing key optimizer.core_method (a non-empty string)" in msg
    assert "key optimizer.lr must be a number, got 'fast'" in msg
    assert "key train_params.batch_size must be a positive integer, got 0" in msg
    assert "key train_params.seed must be an integer in [0, 2**32), got 1.5" in msg


def test_validate_bool_is_not_an_int():
    hypes = copy.deepcopy(GOOD)
    hypes["train_params"]["batch_size"] = True
    hypes["optimizer"]["lr"] = False
    hypes["train_params"]["seed"] = True
    with pytest.raises(ConfigError) as info:
        H.validate(hypes, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS)
    msg = str(info.value)
    assert "train_params.batch_size must be a positive integer, got True" in msg
    assert "optimizer.lr must be a number, got False" in msg
    assert "train_params.seed must be an integer in [0, 2**32), got True" in msg
    for seed in (-1, 2 ** 32):  # numpy's legacy seed takes neither
        hypes["train_params"]["seed"] = seed
        with pytest.raises(ConfigError, match=rf"train_params.seed must be an integer in \[0, 2\*\*32\), got {seed}"):
            H.validate(hypes, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS)
    hypes["train_params"]["seed"] = 2 ** 32 - 1
    with pytest.raises(ConfigError) as info:  # the other keys still wrong, the seed now right
        H.validate(hypes, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS)
    assert "train_params.seed" not in str(info.value)


def test_validate_optional_keys_only_when_present():
    hypes = copy.deepcopy(GOOD)
    hypes["train_params"]["find_unused_parameters"] = "yes"
    with pytest.raises(ConfigError) as info:
        H.validate(hypes, H.ENGINE_KEYS, "h.yaml", H.ENGINE_OPTIONAL_KEYS)
    assert "train_params.find_unused_parameters must be true or false, got 'yes'" in str(info.value)
    assert "missing" not in str(info.value)


def test_validate_empty_name_and_non_mapping_parent():
    hypes = copy.deepcopy(GOOD)
    hypes["name"] = ""
    hypes["optimizer"] = "Adam"
    with pytest.raises(ConfigError) as info:
        H.validate(hypes, H.ENGINE_KEYS, "h.yaml")
    msg = str(info.value)
    assert "key name must be a non-empty string" in msg
    # not "missing key optimizer.core_method": the section is there, and it cannot hold keys; said once
    assert msg.count("key optimizer must be a mapping, got 'Adam'") == 1 and "missing key optimizer" not in msg


@pytest.mark.parametrize("override, fragment", [
    # these were named after the keys the parser derives (anchor_args.W "must be a positive integer, got -240"),
    # or as one of four keys the grid comes from
    ("preprocess.cav_lidar_range=[48, -24, -3, -48, 24, 1]",
     "key preprocess.cav_lidar_range must be [x_min, y_min, z_min, x_max, y_max, z_max] of finite numbers with "
     "min < max on each axis"),
    ("preprocess.cav_lidar_range=[-48, -24, -3, 48, 24]", "key preprocess.cav_lidar_range must be [x_min"),
    # an infinite bound was an OverflowError traceback from the grid's rounding
    ("preprocess.cav_lidar_range=[-.inf, -24, -3, 48, 24, 1]", "key preprocess.cav_lidar_range must be [x_min"),
    ("preprocess.args.voxel_size=[0.4, 0.4]", "key preprocess.args.voxel_size must be 3 positive numbers"),
    ("preprocess.args.voxel_size=[0.4, 0, 4]", "key preprocess.args.voxel_size must be 3 positive numbers"),
    ("preprocess.args.voxel_size=[-0.4, -0.4, 4]", "key preprocess.args.voxel_size must be 3 positive numbers"),
])
def test_the_grids_inputs_are_named_before_the_parser_computes_from_them(override, fragment):
    path = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
    with pytest.raises(ConfigError) as info:
        YP.load_parsed_hypes(path, [override])
    message = str(info.value)
    assert message.startswith(f"{path}: ") and fragment in message and "anchor_args.W" not in message, message


TOY_PILLAR = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
TOY_SECOND = REPO / "hypes_yaml" / "toy" / "second_intermediate_fusion.yaml"


@pytest.mark.parametrize("path, override, key", [
    # each trained with the parser's value, without a word (the last note's "keys the parser recomputes")
    (TOY_PILLAR, "postprocess.anchor_args.W=100", "postprocess.anchor_args.W"),
    (TOY_PILLAR, "postprocess.anchor_args.vd=8", "postprocess.anchor_args.vd"),
    (TOY_PILLAR, "model.args.point_pillar_scatter.grid_size=[100, 50, 1]", "model.args.point_pillar_scatter.grid_size"),
    (TOY_PILLAR, "postprocess.anchor_args={l: 3.9, w: 1.6, h: 1.56, r: [0, 90], num: 2, feature_stride: 2, "
                 "cav_lidar_range: [-48, -24, -3, 48, 24, 1], H: 7}", "postprocess.anchor_args.H"),
    (TOY_SECOND, "model.args.grid_size=[1, 2, 3]", "model.args.grid_size"),
])
def test_a_set_of_a_key_the_parser_derives_is_refused_where_the_parser_changes_it(path, override, key):
    with pytest.raises(ConfigError) as info:
        YP.load_parsed_hypes(path, [override])
    message = str(info.value)
    assert message.startswith(f"{path}: --set {override}: yaml_parser ") and f"derives {key} from " in message
    assert message.endswith("here); set those instead") and "preprocess.args.voxel_size" in message, message


def test_a_set_inside_a_derived_list_of_a_runs_config_is_refused(tmp_path):
    """A run's config.yaml holds the derived keys (the trainer writes the parsed hypes): an entry of its grid set on
    resume is refused, naming the entry."""
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(YP.load_parsed_hypes(TOY_SECOND)))
    with pytest.raises(ConfigError, match=r"--set model.args.grid_size.2=41: yaml_parser load_second_params derives "
                                          r"model.args.grid_size from .* \(model.args.grid_size.2 is \d+ here\)"):
        YP.load_parsed_hypes(config, ["model.args.grid_size.2=41"])


def test_a_set_the_parser_agrees_with_or_recomputes_from_is_kept():
    """The parser's own value (a config.yaml holds it), a section set above the derived keys without them, and the
    keys the grids come from (the derived keys follow them) all load."""
    derived = YP.load_parsed_hypes(TOY_PILLAR)
    anchors = derived["postprocess"]["anchor_args"]
    assert YP.load_parsed_hypes(TOY_PILLAR, [f"postprocess.anchor_args.W={anchors['W']}"]) == derived
    grid = derived["model"]["args"]["point_pillar_scatter"]["grid_size"]
    assert YP.load_parsed_hypes(TOY_PILLAR, [f"model.args.point_pillar_scatter.grid_size={grid}"]) == derived
    above = {k: v for k, v in anchors.items() if k not in ("W", "H", "D", "vw", "vh", "vd")}
    section = "postprocess.anchor_args={" + ", ".join(f"{k}: {v}" for k, v in above.items()) + "}"
    assert YP.load_parsed_hypes(TOY_PILLAR, [section]) == derived
    coarse = YP.load_parsed_hypes(TOY_PILLAR, ["preprocess.args.voxel_size=[0.8, 0.8, 4]"])
    assert coarse["postprocess"]["anchor_args"]["W"] == (anchors["W"] + 1) // 2


def test_validate_int_lr_is_a_number():
    hypes = copy.deepcopy(GOOD)
    hypes["optimizer"]["lr"] = 1
    H.validate(hypes, H.ENGINE_KEYS, "h.yaml")


# ------------------------------------------------------------------------------------------- the one loader
def test_load_parsed_hypes_sets_drops_the_run_keys_parses_and_validates(tmp_path):
    """yaml_parsers.load_parsed_hypes: the path of every tool, and of the tests' hypes (tests/zoo.py's hypes_of)."""
    path = tmp_path / "h.yaml"
    H.save_hypes(dict(copy.deepcopy(GOOD), batch_plan={"global_batch": 8}, **_point_pillar_hypes()), path)
    loaded = YP.load_parsed_hypes(path, ["preprocess.args.voxel_size=[0.8, 0.8, 4]", "train_params.batch_size=8"])
    assert "batch_plan" not in loaded and loaded["train_params"]["batch_size"] == 8
    assert loaded["postprocess"]["anchor_args"]["W"] == 352  # the parser ran on the overridden voxel size
    with pytest.raises(ConfigError) as info:
        YP.load_parsed_hypes(path, ["train_params.batch_size=0"])
    assert str(info.value).startswith(f"{path}: ")
    assert "key train_params.batch_size must be a positive integer, got 0" in str(info.value)


# ------------------------------------------------------------------------------------------- save
def test_save_round_trip(tmp_path):
    hypes = {"name": "pp", "train_params": {"batch_size": 4, "epoches": 10, "seed": 0},
             "optimizer": {"core_method": "Adam", "lr": 1e-3, "args": {"eps": 1e-10, "weight_decay": 1e-4}},
             "preprocess": {"cav_lidar_range": [-140.8, -40, -3, 140.8, 40, 1]},
             "flag": True, "nothing": None, "text": "yes", "number_text": "42", "nested": [[1, 2], {"a": [3]}]}
    path = tmp_path / "config.yaml"
    H.save_hypes(hypes, path)
    assert H.load_hypes(path) == hypes
    loaded = H.load_hypes(path)
    assert loaded["text"] == "yes" and loaded["number_text"] == "42"  # strings stay strings
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temporary file left


def test_save_numpy_and_tuples_become_plain(tmp_path):
    hypes = {"grid": np.array([704, 200, 1]), "vs": np.array([0.4, 0.4, 4.0]), "n": np.int64(7),
             "f": np.float32(0.5), "t": (1, 2), "nested": {"a": [np.int32(3)]}}
    path = tmp_path / "config.yaml"
    H.save_hypes(hypes, path)
    loaded = H.load_hypes(path)
    assert loaded == {"grid": [704, 200, 1], "vs": [0.4, 0.4, 4.0], "n": 7, "f": 0.5, "t": [1, 2],
                      "nested": {"a": [3]}}
    assert type(loaded["n"]) is int and type(loaded["grid"][0]) is int and type(loaded["vs"][0]) is float
    assert "numpy" not in path.read_text() and "!!" not in path.read_text()


def test_save_overwrites_existing(tmp_path):
    path = tmp_path / "config.yaml"
    H.save_hypes({"a": 1}, path)
    H.save_hypes({"b": 2}, path)
    assert H.load_hypes(path) == {"b": 2}


def test_save_keeps_key_order(tmp_path):
    path = tmp_path / "config.yaml"
    H.save_hypes({"z": 1, "a": 2, "m": 3}, path)
    assert list(H.load_hypes(path)) == ["z", "a", "m"]


def test_save_round_trip_string_that_looks_like_exponent_float(tmp_path):
    path = tmp_path / "config.yaml"
    H.save_hypes({"tag": "1e3", "other": "2E5"}, path)
    assert H.load_hypes(path) == {"tag": "1e3", "other": "2E5"}


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_save_permission_follows_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = tmp_path / "config.yaml"
        H.save_hypes({"a": 1}, path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_save_into_missing_folder_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        H.save_hypes({"a": 1}, tmp_path / "missing" / "config.yaml")


def test_naming_file_puts_the_file_before_the_runs_name_and_leaves_other_refusals():
    hypes = {"name": "run_x", "model": {"args": {}}}
    with pytest.raises(ConfigError) as caught:
        with H.naming_file(hypes, "logs/run_x/config.yaml"):
            H.validate(hypes, [("model.args.depth", "positive_int")], H.hypes_source(hypes))
    assert str(caught.value).startswith("logs/run_x/config.yaml (hypes run_x): missing key model.args.depth")
    with pytest.raises(ConfigError, match=r"^--epoch 3: no such checkpoint$"):  # not a refusal of the hypes
        with H.naming_file(hypes, "logs/run_x/config.yaml"):
            raise ConfigError("--epoch 3: no such checkpoint")
