"""Where2comm (point_pillar_where2comm): both hypes spellings, the communication mask and its rate, per-sample
fusion, the warp into the ego's frame and its hypes keys (the zoo's shared contracts run in
tests/test_zoo_contracts.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

import zoo
from launch import REPO
from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import load_hypes
from opencood_ddp.models import create_model
from opencood_ddp.models.modules.ego_warp import ego_frame_affines, ego_rows, warp_to_ego
from opencood_ddp.models.modules.where2comm import Communication, communication_rate, gaussian_kernel

CORE = "point_pillar_where2comm"
OPV2V = REPO / "hypes_yaml" / "opv2v" / f"{CORE}.yaml"
TOY = REPO / "hypes_yaml" / "toy" / f"{CORE}.yaml"
UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes" / f"{CORE}.yaml"
BLOCK = "model.args.where2comm_fusion"


# ------------------------------------------------------------------------------------------ helpers
def where2comm_spelling(hypes: dict) -> dict:
    """The hypes with OpenCOOD's where2comm_fusion block rewritten as the Where2comm repository's fusion_args."""
    args = hypes["model"]["args"]
    block = args.pop("where2comm_fusion")
    communication = block["communication"]
    args["fusion_args"] = {
        "voxel_size": block["voxel_size"], "downsample_rate": block["downsample_rate"],
        "in_channels": block["in_channels"], "n_head": 8, "dropout_rate": 0, "only_attention": True,
        "communication": {"round": 1, "thre": communication["threshold"],
                          "gaussian_smooth": communication["gaussian_smooth"]},
        "agg_operator": {"mode": "ATTEN", "feature_dim": block["in_channels"]},
        "multi_scale": block["multi_scale"], "layer_nums": block["layer_nums"], "num_filters": block["num_filters"]}
    return hypes


@pytest.fixture(scope="module")
def fusion_args_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("where2comm_spelling") / f"{CORE}.yaml"
    path.write_text(yaml.safe_dump(where2comm_spelling(load_hypes(TOY)), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def toy(toy_small):
    """(task, samples): the toy config's task and the first four training samples, read once."""
    return zoo.toy_samples(TOY, toy_small)


batch_of = zoo.ego_batch


def toy_model(*overrides: str, config: Path = TOY) -> torch.nn.Module:
    """The toy model with the same initial weights whatever the overrides (none of them adds a parameter)."""
    torch.manual_seed(0)
    return create_model(zoo.hypes_of(config, *overrides))


def spread_confidence(model: torch.nn.Module) -> torch.nn.Module:
    """Class-head weights that spread the confidences over (0, 1), so a threshold of 0.5 sends some cells."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.cls_head.weight.copy_(torch.randn(model.cls_head.weight.shape, generator=generator))
        model.cls_head.bias.zero_()
    return model


def drop_cav(ego: dict, cav: int) -> dict:
    """The batch without CAV `cav` (a global index, not a sample's ego), its samples' record_len adjusted."""
    lidar = ego["processed_lidar"]
    keep = lidar["voxel_coords"][:, 0] != cav
    coords = lidar["voxel_coords"][keep].clone()
    coords[:, 0] -= (coords[:, 0] > cav).to(coords.dtype)
    record_len = ego["record_len"].clone()
    record_len[int(torch.searchsorted(torch.cumsum(record_len, 0), cav, right=True))] -= 1
    return dict(ego, record_len=record_len, processed_lidar={
        "voxel_features": lidar["voxel_features"][keep], "voxel_coords": coords,
        "voxel_num_points": lidar["voxel_num_points"][keep]})


def with_cavs_scaled(ego: dict, cavs: list[int], factor: float) -> dict:
    """The batch with the points of the given CAVs (global indices) scaled: other data, same layout."""
    lidar = ego["processed_lidar"]
    chosen = torch.isin(lidar["voxel_coords"][:, 0], torch.tensor(cavs, dtype=lidar["voxel_coords"].dtype))
    features = lidar["voxel_features"].clone()
    features[chosen] = features[chosen] * factor
    return dict(ego, processed_lidar=dict(lidar, voxel_features=features))


# ------------------------------------------------------------------------------------------ upstream's model
def test_where2comm_repository_spelling_builds_the_same_model(fusion_args_config, toy):
    ours, theirs = toy_model().eval(), toy_model(config=fusion_args_config).eval()
    assert [(n, t.shape) for n, t in ours.state_dict().items()] == \
        [(n, t.shape) for n, t in theirs.state_dict().items()]
    theirs.load_state_dict(ours.state_dict())
    ego = batch_of(toy, 0, 1)
    with torch.no_grad():
        a, b = ours(ego), theirs(ego)
    assert all(torch.equal(a[key], b[key]) for key in ("psm", "rm", "comm_rate"))


def test_gaussian_filter_is_upstreams_fixed_kernel():
    model = toy_model()
    smoothing = model.fusion_net.naive_communication.gaussian_filter
    assert not any(p.requires_grad for p in smoothing.parameters())  # fixed: never an unused DDP parameter
    kernel = gaussian_kernel(5, 1.0)
    assert torch.equal(smoothing.weight[0, 0], kernel) and smoothing.bias.item() == 0
    assert math.isclose(kernel[2, 2].item(), 1 / (2 * math.pi), rel_tol=1e-6)  # upstream's 1 / (2 pi sigma)
    assert 0.97 < kernel.sum().item() < 0.99


# ------------------------------------------------------------------------------------------ forward, rate
def test_forward_backward_gives_one_map_per_sample_and_a_detached_rate(toy_small):
    out = zoo.assert_forward_backward(TOY, toy_small)
    assert out["psm"].shape == (2, 2, 30, 60) and out["rm"].shape == (2, 14, 30, 60)  # stride 4 on 240 x 120
    rate = out["comm_rate"]
    assert rate.dim() == 0 and not rate.requires_grad and 0 <= rate.item() <= 1


@pytest.mark.parametrize("multi_scale", [True, False])
def test_threshold_zero_sends_every_cell_in_training_and_evaluation(toy, multi_scale):
    model = toy_model(f"{BLOCK}.communication.threshold=0", f"{BLOCK}.multi_scale={str(multi_scale).lower()}")
    ego = batch_of(toy, 0, 1)
    assert model.train()(ego)["comm_rate"].item() == 1.0
    with torch.no_grad():
        assert model.eval()(ego)["comm_rate"].item() == 1.0


def test_fully_connected_sends_every_cell_and_keeps_upstreams_keys(toy):
    model = toy_model(f"{BLOCK}.fully=true")
    assert "fusion_net.naive_communication.gaussian_filter.weight" in model.state_dict()  # built, as upstream
    assert model.train()(batch_of(toy, 0, 1))["comm_rate"].item() == 1.0


@pytest.mark.parametrize("multi_scale", [True, False])
def test_threshold_above_one_sends_nothing_and_the_ego_alone_detects(toy, multi_scale):
    """Nothing is sent: the output is finite and the same whatever the other CAVs saw; the ego's data counts."""
    model = toy_model(f"{BLOCK}.communication.threshold=1.5", f"{BLOCK}.multi_scale={str(multi_scale).lower()}")
    ego = batch_of(toy, 0, 1)
    assert model.train()(ego)["comm_rate"].item() == 0.0
    others = [i for i in range(int(ego["record_len"].sum())) if not ego_rows(ego["record_len"], "cpu")[i]]
    with torch.no_grad():
        model.eval()
        out = model(ego)
        changed_others = model(with_cavs_scaled(ego, others, 0.5))
        changed_ego = model(with_cavs_scaled(ego, [0], 0.5))
    assert out["comm_rate"].item() == 0.0
    assert torch.isfinite(out["psm"]).all() and torch.isfinite(out["rm"]).all()
    assert torch.equal(out["psm"], changed_others["psm"]) and torch.equal(out["rm"], changed_others["rm"])
    assert not torch.allclose(out["psm"][0], changed_ego["psm"][0])


@pytest.mark.parametrize("multi_scale", [True, False])
def test_each_sample_is_masked_and_fused_from_its_own_cavs(toy, multi_scale):
    """Upstream's single-scale path masks sample b with row b of the batch's masks; here a sample's output is
    the same alone or next to any other sample (evaluation: BatchNorm's running statistics)."""
    model = spread_confidence(toy_model(f"{BLOCK}.communication.threshold=0.5",
                                        f"{BLOCK}.multi_scale={str(multi_scale).lower()}")).eval()
    with torch.no_grad():
        pair, other_pair = model(batch_of(toy, 0, 1)), model(batch_of(toy, 0, 2))
        alone = model(batch_of(toy, 1))
    assert 0 < pair["comm_rate"].item() < 1  # some cells sent, some not: the masks matter
    assert torch.allclose(pair["psm"][0], other_pair["psm"][0], atol=1e-5)
    assert torch.allclose(pair["rm"][0], other_pair["rm"][0], atol=1e-5)
    assert torch.allclose(pair["psm"][1], alone["psm"][0], atol=1e-5)
    assert torch.allclose(pair["rm"][1], alone["rm"][0], atol=1e-5)
    assert not torch.allclose(pair["psm"][1], other_pair["psm"][1])


def test_a_single_cav_sample_trains_and_fuses_alone(toy):
    model = spread_confidence(toy_model(f"{BLOCK}.communication.threshold=0.5"))
    ego = drop_cav(batch_of(toy, 0, 1), cav=1)  # sample 0 keeps its ego only
    assert ego["record_len"].tolist()[0] == 1
    out = model.train()(ego)
    (out["psm"].sum() + out["rm"].sum()).backward()
    assert not [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    with torch.no_grad():
        model.eval()
        mixed, lone = model(ego), model(drop_cav(batch_of(toy, 0), cav=1))
    assert lone["comm_rate"].item() == 0.0  # no CAV but the ego: nothing sent
    assert torch.allclose(mixed["psm"][0], lone["psm"][0], atol=1e-5)


def test_what_is_sent_and_how_the_rate_counts():
    psm = torch.full((3, 2, 2, 2), -10.0)
    psm[:, 1] = torch.tensor([[0.0, 3.0], [-3.0, 0.1]])  # max over anchors: sigmoid 0.5, 0.95, 0.05, 0.52
    is_ego = ego_rows(torch.tensor([2, 1]), "cpu")
    assert is_ego.tolist() == [True, False, True]
    mask = Communication(0.5)(psm, is_ego)
    assert mask[1, 0].tolist() == [[0.0, 1.0], [0.0, 1.0]]  # strictly above the threshold
    assert bool((mask[is_ego] == 1).all())  # the egos keep their whole map
    assert communication_rate(mask, is_ego).item() == 0.5  # the non-ego CAV's cells only
    assert bool((Communication(0.0)(psm, is_ego) == 1).all())
    assert bool((Communication(1.0)(psm, is_ego)[1] == 0).all())
    assert communication_rate(None, is_ego).item() == 1.0
    assert communication_rate(mask[:1], is_ego[:1]).item() == 0.0  # a lone ego sends nothing


# ------------------------------------------------------------------------------------------ the warp
def test_identity_transforms_warp_nothing():
    x = torch.randn(5, 3, 10, 20, generator=torch.Generator().manual_seed(0))
    record_len = torch.tensor([3, 2])
    pairwise = torch.cat([zoo.pairwise_moves({}, 3), zoo.pairwise_moves({}, 3)])
    theta = ego_frame_affines(pairwise, record_len, [-4, -2, -3, 4, 2, 1])
    assert torch.equal(warp_to_ego(x, theta, ego_rows(record_len, "cpu")), x)  # not resampled: exact


def test_warp_moves_maps_by_metres_in_the_ego_frame():
    """A 20 x 10 map of 0.4 m cells: a CAV 0.8 m ahead of the ego sees the ego's x at its x - 0.8 m."""
    x = torch.randn(2, 3, 10, 20, generator=torch.Generator().manual_seed(0))
    record_len, lidar_range = torch.tensor([2]), [-4, -2, -3, 4, 2, 1]
    is_ego = ego_rows(record_len, "cpu")
    shift = torch.eye(4, dtype=torch.float64)
    shift[0, 3] = 0.8  # ego frame -> CAV frame: x + 0.8 m, two cells
    warped = warp_to_ego(x, ego_frame_affines(zoo.pairwise_moves({1: shift}), record_len, lidar_range), is_ego)
    assert torch.allclose(warped[1, :, :, :18], x[1, :, :, 2:], atol=1e-5)
    assert torch.count_nonzero(warped[1, :, :, 18:]) == 0  # outside the CAV's map
    turn = torch.diag(torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64))  # half a turn
    warped = warp_to_ego(x, ego_frame_affines(zoo.pairwise_moves({1: turn}), record_len, lidar_range), is_ego)
    assert torch.allclose(warped[1], x[1].flip(-1, -2), atol=1e-5)


# ------------------------------------------------------------------------------------------ hypes keys
OPENCOOD_KEY_ERRORS = [
    (f"{BLOCK}=null", BLOCK),
    ("model.args.fusion_args={multi_scale: true}", "fusion_args"),
    (f"{BLOCK}.fully=1", f"{BLOCK}.fully"),
    (f"{BLOCK}.voxel_size=[0.2, 0.2, 4]", f"{BLOCK}.voxel_size"),
    (f"{BLOCK}.downsample_rate=0", f"{BLOCK}.downsample_rate"),
    (f"{BLOCK}.in_channels=32", f"{BLOCK}.in_channels"),
    (f"{BLOCK}.multi_scale=1", f"{BLOCK}.multi_scale"),
    (f"{BLOCK}.layer_nums=[1, 1, 2]", f"{BLOCK}.layer_nums"),
    (f"{BLOCK}.num_filters=[32, 64, 64]", f"{BLOCK}.num_filters"),
    (f"{BLOCK}.communication=[]", f"{BLOCK}.communication"),
    (f"{BLOCK}.communication.round=2", f"{BLOCK}.communication.round"),
    (f"{BLOCK}.communication.threshold=high", f"{BLOCK}.communication.threshold"),
    (f"{BLOCK}.communication.gaussian_smooth=5", f"{BLOCK}.communication.gaussian_smooth"),
    (f"{BLOCK}.communication.gaussian_smooth.k_size=4", f"{BLOCK}.communication.gaussian_smooth.k_size"),
    (f"{BLOCK}.communication.gaussian_smooth.c_sigma=0", f"{BLOCK}.communication.gaussian_smooth.c_sigma"),
    ("model.args.head_dim=128", "model.args.head_dim"),
    ("model.args.max_cav=3", "model.args.max_cav"),
    ("model.args.shrink_header=5", "model.args.shrink_header"),
    ("model.args.shrink_header.input_dim=128", "model.args.shrink_header.input_dim"),
    ("model.args.shrink_header.stride=[1, 1]", "model.args.shrink_header"),
    ("model.args.compression=3", "model.args.compression"),  # 3 does not divide the 64 channels
    ("postprocess.anchor_args.feature_stride=2", "postprocess.anchor_args.feature_stride"),
    ("model.args.base_bev_backbone.resnet=true", "model.args.base_bev_backbone.resnet"),
]


@pytest.mark.parametrize("override,key", OPENCOOD_KEY_ERRORS, ids=[k for _, k in OPENCOOD_KEY_ERRORS])
def test_opencood_spelling_key_errors(override, key):
    zoo.assert_key_error(TOY, override, key)


ARGS = "model.args.fusion_args"
WHERE2COMM_KEY_ERRORS = [
    (f"{ARGS}.communication.thre=high", f"{ARGS}.communication.thre"),
    (f"{ARGS}.agg_operator=ATTEN", f"{ARGS}.agg_operator"),
    (f"{ARGS}.agg_operator.mode=Transformer", f"{ARGS}.agg_operator.mode"),
    (f"{ARGS}.n_head=0", f"{ARGS}.n_head"),
    (f"{ARGS}.dropout_rate=none", f"{ARGS}.dropout_rate"),
    (f"{ARGS}.only_attention=1", f"{ARGS}.only_attention"),
    (f"{ARGS}.downsample_rate=null", f"{ARGS}.downsample_rate"),
]


@pytest.mark.parametrize("override,key", WHERE2COMM_KEY_ERRORS, ids=[k for _, k in WHERE2COMM_KEY_ERRORS])
def test_where2comm_spelling_key_errors(fusion_args_config, override, key):
    zoo.assert_key_error(fusion_args_config, override, key)


def test_single_scale_fusion_width_and_stride_must_match_the_heads(fusion_args_config):
    """Without multi_scale the shrunk map is fused: agg_operator.feature_dim and downsample_rate describe it."""
    single = f"{ARGS}.multi_scale=false"
    model = create_model(zoo.hypes_of(fusion_args_config, single))
    assert len(model.fusion_net.fuse_modules) == 1 and not model.multi_scale
    for override, key in ((f"{ARGS}.agg_operator.feature_dim=32", f"{ARGS}.agg_operator.feature_dim"),
                          (f"{ARGS}.downsample_rate=2", f"{ARGS}.downsample_rate")):
        with pytest.raises(ConfigError) as caught:
            create_model(zoo.hypes_of(fusion_args_config, single, override))
        assert key in str(caught.value) and "\n" not in str(caught.value)


def test_max_aggregation_and_no_communication_block_build_and_run(fusion_args_config, toy):
    hypes = zoo.hypes_of(fusion_args_config, f"{ARGS}.agg_operator.mode=MAX")
    del hypes["model"]["args"]["fusion_args"]["communication"]
    model = create_model(hypes)
    assert "fusion_net.naive_communication.gaussian_filter.weight" not in model.state_dict()
    out = model.train()(batch_of(toy, 0, 1))
    assert out["comm_rate"].item() == 1.0  # no communication block: everything is sent
