"""The PointPillar family: upstream parameter names and shapes, and what each module computes."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from launch import one_line_error
from zoo import (assert_reference_state_dict, assert_upstream_checkpoint_loads,
                 assert_zero_gradients_are_the_unused_groups, fork_point_pillar_shapes, hypes_of, reference_shapes)

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import MAX_REPEATS
from opencood_ddp.models import create_model
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion
from opencood_ddp.models.modules.pillar_vfe import PillarVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {
    "point_pillar_early_fusion": "point_pillar",
    "point_pillar_late_fusion": "point_pillar",
    "point_pillar_intermediate_fusion": "point_pillar_intermediate",
    "point_pillar_fcooper": "point_pillar_fcooper",
}
TOY = ["point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
       "point_pillar_fcooper"]


# Upstream's parameter names and shapes per core_method: tests/reference/opencood_state_dict (a copy of the
# project's shared reference lists, kept in the repository so that a clean clone can run these), checked as the
# zoo's models are.
@pytest.mark.parametrize("config", sorted(BASELINES))
def test_baseline_state_dict_equals_upstream_reference(config):
    assert_reference_state_dict(ROOT / "hypes_yaml" / "opv2v" / f"{config}.yaml", BASELINES[config])


@pytest.mark.parametrize("config", sorted(BASELINES))
def test_upstream_shaped_checkpoint_loads_strictly(config):
    """A state dict with upstream's keys (here: random values of the reference shapes) loads with strict=True."""
    assert_upstream_checkpoint_loads(ROOT / "hypes_yaml" / "opv2v" / f"{config}.yaml", BASELINES[config])


def _voxel_batch(num_images: int, cells_per_image: int = 30, points: int = 5, seed: int = 0,
                 grid=(32, 16)) -> dict:
    """Random pillars (unique cells per image) in upstream's collated layout, coords (image, z, y, x)."""
    g = torch.Generator().manual_seed(seed)
    coords, features, counts = [], [], []
    for image in range(num_images):
        cells = torch.randperm(grid[0] * grid[1], generator=g)[:cells_per_image]
        y, x = cells // grid[0], cells % grid[0]
        coords.append(torch.stack([torch.full_like(x, image), torch.zeros_like(x), y, x], dim=1))
        n = torch.randint(1, points + 1, (cells_per_image,), generator=g)
        f = torch.randn(cells_per_image, points, 4, generator=g)
        f[torch.arange(points).view(1, -1) >= n.view(-1, 1)] = 0  # padded rows are zero, as spconv writes them
        features.append(f)
        counts.append(n)
    return {"voxel_features": torch.cat(features), "voxel_coords": torch.cat(coords).int(),
            "voxel_num_points": torch.cat(counts).int()}


def _toy_model_hypes(config: str, *overrides: str) -> dict:
    return hypes_of(ROOT / "hypes_yaml" / "toy" / f"{config}.yaml", *overrides)


def test_pillar_vfe_ignores_padded_rows_and_point_order():
    cfg = {"use_norm": True, "with_distance": False, "use_absolute_xyz": True, "num_filters": [16]}
    vfe = PillarVFE(cfg, 4, [0.4, 0.4, 4], [-6.4, -3.2, -3, 6.4, 3.2, 1]).eval()
    batch = _voxel_batch(2, grid=(32, 16))
    base = vfe(dict(batch))["pillar_features"]
    assert base.shape == (60, 16)
    garbage = dict(batch)
    features = batch["voxel_features"].clone()
    pad = torch.arange(features.shape[1]).view(1, -1) >= batch["voxel_num_points"].view(-1, 1).long()
    features[pad] = 1e3  # whatever sits in padded rows must not matter
    garbage["voxel_features"] = features
    assert torch.allclose(vfe(garbage)["pillar_features"], base)
    # The max over points does not depend on the order of the real points.
    reordered = dict(batch)
    features = batch["voxel_features"].clone()
    first = batch["voxel_num_points"].long() >= 2
    features[first, 0], features[first, 1] = batch["voxel_features"][first, 1], batch["voxel_features"][first, 0]
    reordered["voxel_features"] = features
    assert torch.allclose(vfe(reordered)["pillar_features"], base, atol=1e-6)


def test_pillar_vfe_decoration_matches_hand_computation():
    cfg = {"use_norm": False, "with_distance": True, "use_absolute_xyz": True, "num_filters": [8]}
    vfe = PillarVFE(cfg, 4, [0.5, 0.5, 4], [-2, -2, -3, 2, 2, 1])
    voxels = torch.zeros(1, 3, 4)
    voxels[0, 0] = torch.tensor([0.1, 0.2, 0.0, 0.5])
    voxels[0, 1] = torch.tensor([0.3, 0.4, -1.0, 0.7])
    coords = torch.tensor([[0, 0, 4, 4]])  # cell (y 4, x 4): centre x = 4 * 0.5 + 0.25 - 2 = 0.25
    decorated = vfe.decorate(voxels, torch.tensor([2]), coords)
    assert decorated.shape == (1, 3, 11)
    mean = torch.tensor([0.2, 0.3, -0.5])
    centre = torch.tensor([0.25, 0.25, -1.0])  # z: 0 * 4 + 2 - 3
    row = decorated[0, 1]
    assert torch.allclose(row[:4], voxels[0, 1])
    assert torch.allclose(row[4:7], voxels[0, 1, :3] - mean)
    assert torch.allclose(row[7:10], voxels[0, 1, :3] - centre)
    assert math.isclose(row[10].item(), float(torch.linalg.vector_norm(voxels[0, 1, :3])), rel_tol=1e-6)
    assert torch.count_nonzero(decorated[0, 2]) == 0  # the padded row


def test_scatter_places_each_pillar_in_its_cell_and_keeps_trailing_empty_images():
    scatter = PointPillarScatter({"num_features": 3, "grid_size": [8, 4, 1]})
    pillars = torch.arange(6, dtype=torch.float32).view(2, 3)
    coords = torch.tensor([[0, 0, 1, 2], [1, 0, 3, 7]])
    out = scatter({"pillar_features": pillars, "voxel_coords": coords}, num_images=3)["spatial_features"]
    assert out.shape == (3, 3, 4, 8)
    assert torch.equal(out[0, :, 1, 2], pillars[0]) and torch.equal(out[1, :, 3, 7], pillars[1])
    assert out.abs().sum() == pillars.abs().sum()  # nothing else written
    assert out[2].abs().sum() == 0  # the third image had no pillar and is still there


def _att_reference(x: torch.Tensor, record_len: torch.Tensor) -> torch.Tensor:
    """Upstream's formulation: full self-attention over every CAV, then the ego's row."""
    out, start = [], 0
    for n in record_len.tolist():
        cavs = x[start:start + n]
        start += n
        c, h, w = cavs.shape[1:]
        tokens = cavs.reshape(n, c, -1).permute(2, 0, 1)
        attn = torch.softmax(tokens @ tokens.transpose(1, 2) / math.sqrt(c), dim=-1) @ tokens
        out.append(attn.permute(1, 2, 0).reshape(n, c, h, w)[:1])
    return torch.cat(out)


def test_att_fusion_equals_full_self_attention_ego_row():
    x = torch.randn(6, 8, 5, 7, generator=torch.Generator().manual_seed(1))
    record_len = torch.tensor([3, 1, 2])
    fused = AttFusion(8)(x, record_len)
    assert fused.shape == (3, 8, 5, 7)
    assert torch.allclose(fused, _att_reference(x, record_len), atol=1e-6)
    assert torch.allclose(fused[1], x[3])  # a lone ego attends only to itself


def test_max_fusion_is_elementwise_max_per_sample():
    x = torch.randn(5, 4, 3, 3, generator=torch.Generator().manual_seed(2))
    fused = MaxFusion()(x, torch.tensor([2, 3]))
    assert torch.equal(fused[0], torch.maximum(x[0], x[1]))
    assert torch.equal(fused[1], x[2:].max(dim=0).values)


@pytest.mark.parametrize("config", TOY)
def test_toy_models_forward_backward_every_parameter(config):
    hypes = _toy_model_hypes(config)
    model = create_model(hypes)
    grid = hypes["model"]["args"]["point_pillar_scatter"]["grid_size"]
    fused = hypes["model"]["core_method"] != "point_pillar"
    record_len = torch.tensor([2, 1]) if fused else None
    images = 3 if fused else 2
    lidar = _voxel_batch(images, cells_per_image=200, grid=(grid[0], grid[1]))
    data = {"processed_lidar": lidar, "object_bbx_center": torch.zeros(2, 100, 7)}
    if fused:
        data["record_len"] = record_len
    out = model(data)
    anchors = hypes["postprocess"]["anchor_args"]["num"]
    size = (grid[1] // 2, grid[0] // 2)
    assert out["psm"].shape == (2, anchors, *size)
    assert out["rm"].shape == (2, 7 * anchors, *size)
    (out["psm"].sum() + out["rm"].sum()).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert_zero_gradients_are_the_unused_groups(model)


def test_fusion_model_sample_depends_only_on_its_own_cavs():
    """Grouping by record_len: changing sample 1's CAVs leaves sample 0's output unchanged (eval mode)."""
    hypes = _toy_model_hypes("point_pillar_intermediate_fusion")
    model = create_model(hypes).eval()
    grid = hypes["model"]["args"]["point_pillar_scatter"]["grid_size"]
    a = _voxel_batch(3, cells_per_image=100, grid=(grid[0], grid[1]), seed=3)
    b = _voxel_batch(3, cells_per_image=100, grid=(grid[0], grid[1]), seed=4)
    b_mixed = {key: torch.cat([a[key][a["voxel_coords"][:, 0] < 2], b[key][b["voxel_coords"][:, 0] == 2]])
               for key in a}
    record_len = torch.tensor([2, 1])
    with torch.no_grad():
        out_a = model({"processed_lidar": a, "record_len": record_len})
        out_b = model({"processed_lidar": b_mixed, "record_len": record_len})
    assert torch.allclose(out_a["psm"][0], out_b["psm"][0], atol=1e-5)
    assert not torch.allclose(out_a["psm"][1], out_b["psm"][1])


def test_create_model_errors_name_the_key():
    hypes = hypes_of(ROOT / "hypes_yaml" / "opv2v" / "point_pillar_early_fusion.yaml")
    wrong = copy.deepcopy(hypes)
    # A realistic slip: the hypes file's name, not its core_method (point_pillar_transformer).
    wrong["model"]["core_method"] = "point_pillar_v2xvit"
    with pytest.raises(ConfigError, match="model.core_method 'point_pillar_v2xvit'"):
        create_model(wrong)
    missing = copy.deepcopy(hypes)
    del missing["model"]["args"]["base_bev_backbone"]["layer_nums"]
    with pytest.raises(ConfigError, match="missing key model.args.base_bev_backbone.layer_nums"):
        create_model(missing)
    unsupported = copy.deepcopy(hypes)
    unsupported["model"]["args"]["base_bev_backbone"]["compression"] = 32
    with pytest.raises(ConfigError, match="compression"):
        create_model(unsupported)
    mismatch = copy.deepcopy(hypes)
    mismatch["model"]["args"]["point_pillar_scatter"]["num_features"] = 32
    with pytest.raises(ConfigError, match="num_features"):
        create_model(mismatch)
    uneven = copy.deepcopy(hypes)
    uneven["model"]["args"]["base_bev_backbone"]["layer_strides"] = [2, 2]
    with pytest.raises(ConfigError, match="one entry per level"):
        create_model(uneven)


def test_toy_extensions_set_bn_momentum_and_class_prior_only_where_asked():
    toy = create_model(_toy_model_hypes("point_pillar_intermediate_fusion"))
    norms = [m for m in toy.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert norms and all(m.momentum == 0.1 for m in norms)
    assert torch.allclose(torch.sigmoid(toy.cls_head.bias), torch.full_like(toy.cls_head.bias, 0.01))
    baseline = create_model(hypes_of(ROOT / "hypes_yaml" / "opv2v" / "point_pillar_intermediate_fusion.yaml"))
    assert all(m.momentum == 0.01 for m in baseline.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert torch.sigmoid(baseline.cls_head.bias).min() > 0.3  # PyTorch's default init: scores near 0.5
    for key, value in (("bn_momentum", 0), ("cls_head_prior", 1.0)):
        with pytest.raises(ConfigError, match=f"model.args.{key} must be in"):
            create_model(_toy_model_hypes("point_pillar_early_fusion", f"model.args.{key}={value}"))


SHRINK_MODELS = ("point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_cobevt", "point_pillar_where2comm",
                 "point_pillar_v2xvit")


def assert_toy_model_refused(config: str, override: str, fragment: str, *more_overrides: str) -> str:
    """create_model of the toy config with `override` (and `more_overrides`) is one ConfigError line holding
    `fragment`; returns that line."""
    hypes = hypes_of(ROOT / "hypes_yaml" / "toy" / f"{config}.yaml", override, *more_overrides)
    with pytest.raises(ConfigError) as caught:
        create_model(hypes)
    message = str(caught.value)
    assert fragment in message and message.endswith("; fix the hypes") and "\n" not in message, message
    return message


@pytest.mark.parametrize("config", SHRINK_MODELS)
@pytest.mark.parametrize("override, fragment", [
    ("model.args.shrink_header.input_dim=100", "model.args.shrink_header.input_dim (100) must equal the backbone's"),
    ("model.args.shrink_header.padding=[1, 1]", "kernal_size, stride, padding and dim must be lists of one integer"),
    ("model.args.shrink_header.stride=[0]", "kernal_size, stride, padding and dim must be lists of one integer"),
])
def test_every_model_with_a_shrink_header_refuses_it_alike(config, override, fragment):
    """models/checks.py: one shrink-header rule and one error line for the five models that take one."""
    assert_toy_model_refused(config, override, fragment)


@pytest.mark.parametrize("fusion", ["early", "late"])
def test_the_forks_point_pillar_is_opencoods_with_a_shrink_header_before_narrower_heads(fusion):
    """V2V4Real's early and late configs (the fork's values: shrink_header, cls_head_dim 256, anchors at stride 4)
    build the fork's state dict, derived from OpenCOOD's list; OpenCOOD's configs keep OpenCOOD's."""
    fork = create_model(hypes_of(ROOT / "hypes_yaml" / "v2v4real" / f"point_pillar_{fusion}_fusion.yaml"))
    assert [(name, list(t.shape)) for name, t in fork.state_dict().items()] == fork_point_pillar_shapes()
    plain = create_model(hypes_of(ROOT / "hypes_yaml" / "opv2v" / f"point_pillar_{fusion}_fusion.yaml"))
    assert [(name, list(t.shape)) for name, t in plain.state_dict().items()] == reference_shapes("point_pillar")
    assert fork.sent_maps({}) is None  # early and late fusion send no feature map, shrunk or not


def test_cls_head_dim_other_than_the_heads_width_is_refused():
    hypes = hypes_of(ROOT / "hypes_yaml" / "v2v4real" / "point_pillar_early_fusion.yaml", "model.args.cls_head_dim=384")
    with pytest.raises(ConfigError) as caught:
        create_model(hypes)
    assert "model.args.cls_head_dim (384) must equal the channels the heads see (256" in str(caught.value)


PILLAR_CONFIGS = ("point_pillar_early_fusion", "point_pillar_late_fusion", "point_pillar_intermediate_fusion",
                 "point_pillar_fcooper", "point_pillar_v2vnet", "point_pillar_v2xvit", "point_pillar_cobevt",
                 "point_pillar_where2comm")


@pytest.mark.parametrize("config", PILLAR_CONFIGS)
@pytest.mark.parametrize("override, fragment", [
    # each of these trained on to a crash in the loss (a heads' map that does not fit the anchors), or trained
    # quietly on pillars whose offsets were computed on another grid than the data's
    ("model.args.anchor_number=3", "(2) differs from model.args.anchor_number (3)"),  # anchor_num's, or the anchors
    ("postprocess.anchor_args.feature_stride=8", "postprocess.anchor_args.feature_stride (8) must equal the stride "
                                                 "of the heads' map"),
    ("model.args.lidar_range=[-100, -40, -3, 100, 40, 1]", "model.args.lidar_range [-100, -40, -3, 100, 40, 1] "
                                                           "differs from preprocess.cav_lidar_range"),
    ("model.args.voxel_size=[0.8, 0.8, 4]", "model.args.voxel_size [0.8, 0.8, 4] differs from "
                                            "preprocess.args.voxel_size"),
    # the anchors laid over another range than the features' cells, silently (found by a fuzz of the keys)
    ("postprocess.anchor_args.cav_lidar_range=[-48, -24, -3, 40, 24, 1]",
     "postprocess.anchor_args.cav_lidar_range [-48, -24, -3, 40, 24, 1] differs from preprocess.cav_lidar_range"),
    ("model.args.pillar_vfe.num_filters=[]", "model.args.pillar_vfe.num_filters must be a non-empty list of "
                                             "positive integers"),
    ("model.args.voxel_size=[a, b, c]", "model.args.voxel_size must be a list of numbers, got ['a', 'b', 'c']"),
])
def test_every_pillar_model_refuses_a_grid_or_anchors_its_heads_do_not_fit(config, override, fragment):
    assert_toy_model_refused(config, override, fragment)


@pytest.mark.parametrize("config", [c for c in PILLAR_CONFIGS if c != "point_pillar_v2xvit"])  # its STTF check
@pytest.mark.parametrize("lidar_range, fragment", [
    # 60.2 m of 0.4 m voxels is 151 columns: the heads' map 76 wide at stride 2, the anchors 151 // 2 = 75 (a crash
    # in the loss); 48.8 m is 122 rows: the levels 61, 31, 16 upsample to 61, 62, 64 (a crash in torch.cat)
    ("[-30.1, -24, -3, 30.1, 24, 1]", "the canvas is 151 x 120 voxels (preprocess.cav_lidar_range over "
                                      "preprocess.args.voxel_size); the heads' map comes out at"),
    ("[-48, -24.4, -3, 48, 24.4, 1]", "the canvas is 240 x 122 voxels (preprocess.cav_lidar_range over "
                                      "preprocess.args.voxel_size); model.args.base_bev_backbone's levels come out"),
])
def test_every_pillar_model_refuses_a_range_its_backbone_or_anchors_do_not_fit(config, lidar_range, fragment):
    keys = ("preprocess.cav_lidar_range", "postprocess.anchor_args.cav_lidar_range", "model.args.lidar_range")
    first, *others = (f"{key}={lidar_range}" for key in keys)
    assert "whole multiples of" in assert_toy_model_refused(config, first, fragment, *others)


@pytest.mark.parametrize("config", PILLAR_CONFIGS + ("second_intermediate_fusion",))
@pytest.mark.parametrize("override, fragment", [
    # each was a traceback: a ZeroDivisionError in the map geometry, a negative dimension or an empty weight inside
    # torch, a TypeError in a deblock; a layer_nums of -1 was taken as 0, one of 10**9 built layers for ever
    ("layer_strides.0=0", "layer_strides must be a list of positive integers, got [0, "),
    ("layer_strides.1=2.5", "layer_strides must be a list of positive integers"),
    ("num_filters.0=-1", "num_filters must be a list of positive integers, got [-1, "),
    ("num_upsample_filter.0=0", "num_upsample_filter must be a list of positive integers"),
    ("upsample_strides.0=0", "upsample_strides must be a list of integers >= 1 or their inverses"),
    ("upsample_strides.0=abc", "upsample_strides must be a list of integers >= 1 or their inverses"),
    ("layer_nums.0=-1", "layer_nums must be a non-empty list of integers from 0 to 1000"),
    ("layer_nums.1=1001", "layer_nums must be a non-empty list of integers from 0 to 1000"),  # 10**9 never built
    ("layer_strides=[2]", "layer_nums, layer_strides and num_filters must have one entry per level"),
])
def test_every_model_refuses_a_backbone_list_it_cannot_build(config, override, fragment):
    assert_toy_model_refused(config, "model.args.base_bev_backbone." + override, fragment)


@pytest.mark.parametrize("config", ("second_early_fusion", "second_intermediate_fusion"))
@pytest.mark.parametrize("override", ("layer_strides=[1, 3]", "upsample_strides=[1, 1000000000]"))
def test_second_refuses_backbone_levels_that_do_not_meet(config, override):
    """SECOND's levels on the sparse backbone's 60 x 30 map: a level of stride 3 comes out at 20 x 10, upsampled
    2x to 40 x 20 (was a traceback in torch.cat); a deblock of stride 10**9 was torch's storage overflow."""
    message = assert_toy_model_refused(config, "model.args.base_bev_backbone." + override,
                                       "which cannot be concatenated")
    assert "the sparse backbone's map is 60 x 30 cells (model.args.grid_size [480, 240, 40] over its stride 8)" \
        in message


@pytest.mark.parametrize("config, key", [
    ("point_pillar_cobevt", "fax_fusion.depth"),
    ("point_pillar_v2xvit", "transformer.encoder.num_blocks"),
    ("point_pillar_v2xvit", "transformer.encoder.depth"),
    ("point_pillar_v2vnet", "v2vfusion.num_iteration"),
    ("point_pillar_v2vnet", "v2vfusion.conv_gru.num_layers"),
])
def test_a_block_repeated_more_than_max_repeats_times_is_refused(config, key):
    """A depth or iteration count of 10**9 built (or ran) its blocks for ever, with no error to end it; the kind
    "count" bounds it at hypes.MAX_REPEATS."""
    assert MAX_REPEATS == 1000
    hypes = hypes_of(ROOT / "hypes_yaml" / "toy" / f"{config}.yaml", f"model.args.{key}=1001")
    with pytest.raises(ConfigError) as caught:
        create_model(hypes)
    assert one_line_error(caught, f"key model.args.{key} must be a positive integer of at most 1000 (a block's "
                                  f"repeats), got 1001", "fix the hypes")


@pytest.mark.parametrize("config", ("point_pillar_cobevt", "point_pillar_where2comm", "point_pillar_v2xvit"))
def test_every_model_with_cav_slots_checks_max_cav_alike(config):
    hypes = hypes_of(ROOT / "hypes_yaml" / "toy" / f"{config}.yaml", "train_params.max_cav=3")
    with pytest.raises(ConfigError, match=r"model.args.max_cav \(\d+\) must equal train_params.max_cav \(3: the "):
        create_model(hypes)
