"""V2X-ViT (point_pillar_transformer): the toy model's step, what its fusion computes and its keys (the zoo's shared
contracts run in tests/test_zoo_contracts.py)."""
from __future__ import annotations

import math

import pytest
import torch

from launch import REPO, WORKERS, explain, torchrun
from zoo import assert_forward_backward, assert_key_error, hypes_of, toy_batch

from opencood_ddp.errors import DataError
from opencood_ddp.models.modules.v2xvit_agents import INFRASTRUCTURE, VEHICLE, Agents
from opencood_ddp.models.modules.v2xvit_hmsa import HeteroCavAttention
from opencood_ddp.models.modules.v2xvit_mswin import WindowAttention
from opencood_ddp.models.modules.v2xvit_sttf import SpatialAligner
from opencood_ddp.models.parameter_use import take_parameter_use

CORE = "point_pillar_transformer"
OPV2V = REPO / "hypes_yaml" / "opv2v" / "point_pillar_v2xvit.yaml"
TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_v2xvit.yaml"
UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes" / "point_pillar_v2xvit.yaml"
ENC = "model.args.transformer.encoder."


# ------------------------------------------------------------------------------------------ the toy model
@pytest.fixture(scope="module")
def toy(toy_small):
    """(collated batch of 2 training samples, model in eval mode)."""
    batch, model, _ = toy_batch(TOY, toy_small)
    return batch["ego"], model.eval()


def sub_batch(ego: dict, samples: list, keep: list = None) -> dict:
    """The model input of some samples of a collated batch (optionally only the first keep[i] CAVs of each)."""
    record_len = ego["record_len"].tolist()
    starts = [sum(record_len[:b]) for b in range(len(record_len))]
    coords = ego["processed_lidar"]["voxel_coords"]
    new_len, renumber = [], {}
    for i, b in enumerate(samples):
        n = min(record_len[b], keep[i]) if keep else record_len[b]
        for cav in range(starts[b], starts[b] + n):
            renumber[cav] = len(renumber)
        new_len.append(n)
    keep = torch.tensor([int(c) in renumber for c in coords[:, 0].tolist()], dtype=torch.bool)
    lidar = {key: value[keep] for key, value in ego["processed_lidar"].items()}
    lidar["voxel_coords"] = lidar["voxel_coords"].clone()
    lidar["voxel_coords"][:, 0] = torch.tensor([renumber[int(c)] for c in lidar["voxel_coords"][:, 0].tolist()],
                                               dtype=lidar["voxel_coords"].dtype)
    out = {"processed_lidar": lidar, "record_len": torch.tensor(new_len)}
    for key in ("pairwise_t_matrix", "prior_encoding", "spatial_correction_matrix"):
        if key in ego:
            out[key] = ego[key][samples]
    return out


def test_toy_forward_backward_gives_anchor_maps(toy_small):
    out = assert_forward_backward(TOY, toy_small)
    # 240 x 120 grid, fused at stride 4 (anchor_args.feature_stride 4): one map per sample.
    assert out["psm"].shape == (2, 2, 30, 60) and out["rm"].shape == (2, 14, 30, 60)


def test_a_sample_depends_only_on_its_own_cavs(toy):
    ego, model = toy
    assert ego["record_len"].tolist() == [2, 2]
    with torch.no_grad():
        both = model(sub_batch(ego, [0, 1]))
        alone = [model(sub_batch(ego, [b])) for b in (0, 1)]
    for b in (0, 1):
        assert torch.allclose(both["psm"][b], alone[b]["psm"][0], atol=1e-5)
        assert torch.allclose(both["rm"][b], alone[b]["rm"][0], atol=1e-5)


def test_single_cav_samples_and_a_mixed_batch(toy):
    ego, model = toy
    with torch.no_grad():
        single = model(sub_batch(ego, [0], keep=[1]))
        mixed = model(sub_batch(ego, [0, 1], keep=[1, 2]))
        full = model(sub_batch(ego, [0]))
        second = model(sub_batch(ego, [1]))
    assert single["psm"].shape == (1, 2, 30, 60) and torch.isfinite(single["psm"]).all()
    assert torch.allclose(mixed["psm"][0], single["psm"][0], atol=1e-5)
    assert torch.allclose(mixed["rm"][1], second["rm"][0], atol=1e-5)
    # The partner changes the ego's fused map: the fusion is not a no-op.
    assert not torch.allclose(single["psm"][0], full["psm"][0], atol=1e-4)


def test_absent_priors_are_vehicles_without_delay_or_correction(toy):
    ego, model = toy
    batch = sub_batch(ego, [0, 1])
    explicit = dict(batch, prior_encoding=torch.zeros(2, 5, 3),
                    spatial_correction_matrix=torch.eye(4, dtype=torch.float64).repeat(2, 5, 1, 1))
    with torch.no_grad():
        assert torch.equal(model(batch)["psm"], model(explicit)["psm"])


def test_delay_and_infrastructure_flag_reach_the_output(toy):
    ego, model = toy
    batch = sub_batch(ego, [0, 1])
    prior = torch.zeros(2, 5, 3)
    with torch.no_grad():
        base = model(dict(batch, prior_encoding=prior))["psm"]
        delayed = prior.clone()
        delayed[0, 1, 1] = 3  # CAV 1 of sample 0 is 3 frames late
        late = model(dict(batch, prior_encoding=delayed))["psm"]
        infra = prior.clone()
        infra[0, 1, 2] = 1  # CAV 1 of sample 0 is a road-side unit
        rsu = model(dict(batch, prior_encoding=infra))["psm"]
    assert not torch.allclose(late[0], base[0]) and torch.allclose(late[1], base[1])
    assert not torch.allclose(rsu[0], base[0]) and torch.allclose(rsu[1], base[1])
    too_late = prior.clone()
    too_late[0, 1, 1] = 50  # x RTE_ratio 2 = row 100 of a 100-row table
    with pytest.raises(DataError, match="RTE_ratio"):
        model(dict(batch, prior_encoding=too_late))


def test_mixed_precision_step(toy):
    """Under autocast, grid_sample and the typed projections answer in other dtypes than their inputs."""
    ego, model = toy
    prior = torch.zeros(2, 5, 3)
    prior[0, 1] = torch.tensor([0.5, 1.0, 1.0])  # a late road-side unit: every path of the fusion
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(dict(sub_batch(ego, [0, 1]), prior_encoding=prior))
    assert torch.isfinite(out["psm"].float()).all() and torch.isfinite(out["rm"].float()).all()


# ------------------------------------------------------------------------------------------ heterogeneous attention
def _agents(record_len, kinds) -> Agents:
    sample = torch.repeat_interleave(torch.arange(len(record_len)), torch.tensor(record_len))
    slot = torch.cat([torch.arange(n) for n in record_len])
    n = int(sum(record_len))
    return Agents(tuple(record_len), sample, slot, torch.zeros(n, dtype=torch.long), torch.tensor(kinds),
                  torch.eye(4, dtype=torch.float64).repeat(n, 1, 1))


def _pairwise_hmsa(att: HeteroCavAttention, x, agents: Agents, visible):
    """Upstream's formula, one query CAV and one key CAV at a time."""
    out = torch.zeros_like(x)
    m = att.heads
    for r in range(x.shape[0]):
        b, kind_i = int(agents.sample[r]), int(agents.kind[r])
        q = att.q_linears[kind_i](x[r]).unflatten(-1, (m, -1))  # (H, W, M, d)
        keys = (agents.sample == b).nonzero().squeeze(1)
        logits, messages = [], []
        for j in keys.tolist():
            kind_j = int(agents.kind[j])
            edge = kind_i * 2 + kind_j
            k = att.k_linears[kind_j](x[j]).unflatten(-1, (m, -1))
            v = att.v_linears[kind_j](x[j]).unflatten(-1, (m, -1))
            logit = torch.einsum("hwmp,mpq,hwmq->hwm", q, att.relation_att[edge], k) * att.scale
            logits.append(logit.masked_fill(~visible[j].unsqueeze(-1), float("-inf")))
            messages.append(torch.einsum("hwmp,mpc->hwmc", v, att.relation_msg[edge]))
        weights = torch.stack(logits, dim=-1).softmax(dim=-1)  # (H, W, M, keys)
        fused = torch.einsum("hwmj,jhwmc->hwmc", weights, torch.stack(messages))
        out[r] = att.a_linears[kind_i](fused.flatten(-2))
    return out


def test_hetero_attention_equals_upstream_pairwise_formula():
    torch.manual_seed(0)
    att = HeteroCavAttention(dim=12, heads=3, dim_head=4, dropout=0.0)
    # Three samples of 3, 1 and 2 CAVs (padded to 3), vehicles and road-side units mixed.
    agents = _agents([3, 1, 2], [VEHICLE, INFRASTRUCTURE, VEHICLE, INFRASTRUCTURE, VEHICLE, INFRASTRUCTURE])
    x = torch.randn(6, 4, 5, 12)
    visible = torch.rand(6, 4, 5) > 0.4
    visible[agents.ego_rows] = True  # the ego sees its whole map
    ours = att(x, agents, visible)
    assert torch.allclose(ours, _pairwise_hmsa(att, x, agents, visible), atol=1e-5)


def test_an_absent_agent_kind_runs_on_no_cav_and_is_recorded_unused():
    """DDP needs every parameter in the graph: a batch of vehicles only still reaches the infrastructure weights
    (zero gradients). The record says which kinds upstream's graph held, so the engine can drop the others."""
    att = HeteroCavAttention(dim=8, heads=2, dim_head=4, dropout=0.0)
    agents = _agents([2, 1], [VEHICLE] * 3)
    att(torch.randn(3, 2, 2, 8), agents, torch.ones(3, 2, 2, dtype=torch.bool)).sum().backward()
    assert all(p.grad is not None for p in att.parameters())
    assert att.q_linears[INFRASTRUCTURE].weight.grad.abs().sum() == 0
    groups = take_parameter_use(att)
    assert [used for _, used in groups] == [True, False]  # vehicle, infrastructure
    infra = {id(p) for linears in (att.q_linears, att.k_linears, att.v_linears, att.a_linears)
             for p in linears[INFRASTRUCTURE].parameters()}
    assert {id(p) for p in groups[INFRASTRUCTURE][0]} == infra
    assert [used for _, used in take_parameter_use(att)] == [False, False]  # taking the record clears it
    att(torch.randn(2, 2, 2, 8), _agents([2], [VEHICLE, INFRASTRUCTURE]), torch.ones(2, 2, 2, dtype=torch.bool))
    assert [used for _, used in take_parameter_use(att)] == [True, True]
    assert "_kinds_met" not in str(att.state_dict().keys())  # the record is not state: upstream's keys only


# ------------------------------------------------------------------------------------------ window attention
def _window_loop(att: WindowAttention, x):
    """One window and one head at a time; the bias of cells i, j read at their (row, column) offset."""
    n, height, width, _ = x.shape
    s, m = att.window, att.heads
    q, k, v = (t.unflatten(-1, (m, -1)) for t in att.to_qkv(x).chunk(3, dim=-1))
    cells = [(r, c) for r in range(s) for c in range(s)]
    bias = torch.stack([torch.stack([att.pos_embedding[rj - ri + s - 1, cj - ci + s - 1] for rj, cj in cells])
                        for ri, ci in cells])
    out = torch.zeros_like(q)
    for top in range(0, height, s):
        for left in range(0, width, s):
            rows, cols = slice(top, top + s), slice(left, left + s)
            for head in range(m):
                qw, kw, vw = (t[:, rows, cols, head].reshape(n, s * s, -1) for t in (q, k, v))
                weights = (qw @ kw.transpose(1, 2) * att.scale + bias).softmax(dim=-1)
                out[:, rows, cols, head] = (weights @ vw).view(n, s, s, -1)
    return att.to_out(out.flatten(-2))


def test_window_attention_equals_a_loop_over_windows():
    torch.manual_seed(0)
    att = WindowAttention(dim=8, heads=2, dim_head=3, dropout=0.0, window=3, relative=True)
    x = torch.randn(2, 6, 9, 8)
    assert torch.allclose(att(x), _window_loop(att, x), atol=1e-5)


# ------------------------------------------------------------------------------------------ warp into the ego frame
def _translation(dx: float, dy: float, yaw_deg: float = 0.0) -> torch.Tensor:
    c, s = math.cos(math.radians(yaw_deg)), math.sin(math.radians(yaw_deg))
    m = torch.eye(4, dtype=torch.float64)
    m[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    m[0, 3], m[1, 3] = dx, dy
    return m


def test_warp_identity_translation_and_rotation():
    aligner = SpatialAligner(voxel_size=0.4, downsample_rate=4)  # 1.6 m cells
    x = torch.randn(2, 6, 8, 3, dtype=torch.float64)
    moved = torch.tensor([1])
    same, visible = aligner(x, torch.stack([torch.eye(4, dtype=torch.float64)] * 2), moved)
    assert torch.allclose(same, x, atol=1e-9) and visible.all()
    # +3.2 m in x moves CAV 1's map two columns right; the two columns it left hold no data.
    shifted, visible = aligner(x, torch.stack([torch.eye(4, dtype=torch.float64), _translation(3.2, 0)]), moved)
    assert torch.equal(shifted[0], x[0])  # the ego is never resampled
    assert torch.allclose(shifted[1, :, 2:], x[1, :, :-2], atol=1e-9)
    assert not visible[1, :, :2].any() and visible[1, :, 2:].all()
    assert torch.allclose(shifted[1, :, :2], torch.zeros(6, 2, 3, dtype=torch.float64), atol=1e-9)
    # +90 degrees about pixel (W / 2, H / 2) = (4, 3), as upstream: (column 6, row 3) -> (column 4, row 5).
    hot = torch.zeros(2, 6, 8, 1, dtype=torch.float64)
    hot[1, 3, 6] = 1.0
    turned, _ = aligner(hot, torch.stack([torch.eye(4, dtype=torch.float64), _translation(0, 0, 90)]), moved)
    assert torch.allclose(turned[1, 5, 4], torch.ones(1, dtype=torch.float64), atol=1e-9)
    assert math.isclose(turned[1].sum().item(), 1.0, abs_tol=1e-9)


def test_maps_move_by_correction_times_pairwise_and_the_ego_stays():
    pairwise = torch.zeros(1, 5, 5, 4, 4, dtype=torch.float64)  # a zero diagonal: the ego stays whatever it holds
    pairwise[0, 1, 0] = _translation(1.6, 0)
    correction = torch.eye(4, dtype=torch.float64).repeat(1, 5, 1, 1)
    correction[0, 1] = _translation(0, 3.2)
    agents = Agents.from_batch({"record_len": torch.tensor([2]), "pairwise_t_matrix": pairwise,
                                "spatial_correction_matrix": correction}, max_cav=5, device=torch.device("cpu"))
    assert torch.equal(agents.to_ego[0], torch.eye(4, dtype=torch.float64))
    assert torch.allclose(agents.to_ego[1], _translation(1.6, 3.2))
    with pytest.raises(ValueError, match="max_cav"):
        Agents.from_batch({"record_len": torch.tensor([6])}, max_cav=5, device=torch.device("cpu"))


# ------------------------------------------------------------------------------------------ keys
@pytest.mark.parametrize("override, key", [
    ("model.args.max_cav=4", "model.args.max_cav"),
    ("model.args.compression=3", "model.args.compression"),  # 3 does not divide the 64 channels
    ("model.args.shrink_header.input_dim=100", "model.args.shrink_header.input_dim"),
    ("model.args.shrink_header.dim=[32]", "model.args.shrink_header.dim"),
    ("model.args.shrink_header.stride=[1]", ENC + "sttf.downsample_rate"),
    (ENC + "num_blocks=0", ENC + "num_blocks"),
    (ENC + "depth=0", ENC + "depth"),
    (ENC + "use_roi_mask=1", ENC + "use_roi_mask"),
    (ENC + "use_RTE=false", ENC + "use_RTE"),
    (ENC + "RTE_ratio=1", ENC + "RTE_ratio"),
    (ENC + "sttf.voxel_size=[0.8, 0.8, 4]", ENC + "sttf.voxel_size"),
    (ENC + "sttf.voxel_size=[a, b]", ENC + "sttf.voxel_size"),
    (ENC + "sttf.downsample_rate=2", ENC + "sttf.downsample_rate"),
    (ENC + "cav_att_config.dim=48", ENC + "cav_att_config.dim"),
    (ENC + "cav_att_config.use_hetero=1", ENC + "cav_att_config.use_hetero"),
    (ENC + "cav_att_config.use_RTE=false", ENC + "cav_att_config.use_RTE"),
    (ENC + "cav_att_config.RTE_ratio=0", ENC + "cav_att_config.RTE_ratio"),
    (ENC + "cav_att_config.heads=0", ENC + "cav_att_config.heads"),
    (ENC + "cav_att_config.dim_head=-1", ENC + "cav_att_config.dim_head"),
    (ENC + "cav_att_config.dropout=1.5", ENC + "cav_att_config.dropout"),
    (ENC + "pwindow_att_config.dim=32", ENC + "pwindow_att_config.dim"),
    (ENC + "pwindow_att_config.heads=[4, 2]", ENC + "pwindow_att_config.heads"),
    (ENC + "pwindow_att_config.dim_head=[16, 32, 0]", ENC + "pwindow_att_config.heads, dim_head"),
    (ENC + "pwindow_att_config.dropout=-0.1", ENC + "pwindow_att_config.dropout"),
    (ENC + "pwindow_att_config.window_size=[2, 4, 10]", ENC + "pwindow_att_config.window_size"),
    (ENC + "pwindow_att_config.window_size=[2, 5]", ENC + "pwindow_att_config.heads, dim_head and window_size"),
    (ENC + "pwindow_att_config.relative_pos_embedding=1", ENC + "pwindow_att_config.relative_pos_embedding"),
    (ENC + "pwindow_att_config.fusion_method=max", ENC + "pwindow_att_config.fusion_method"),
    (ENC + "feed_forward.mlp_dim=0", ENC + "feed_forward.mlp_dim"),
    (ENC + "feed_forward.dropout=2", ENC + "feed_forward.dropout"),
])
def test_a_wrong_key_is_one_error_line_naming_it(override, key):
    assert_key_error(TOY, override, key)


def test_split_attention_needs_three_windows_naive_takes_any():
    from zoo import hypes_of
    from opencood_ddp.errors import ConfigError
    from opencood_ddp.models import create_model

    two = (ENC + "pwindow_att_config.window_size=[2, 5]", ENC + "pwindow_att_config.heads=[4, 2]",
           ENC + "pwindow_att_config.dim_head=[16, 32]")
    with pytest.raises(ConfigError, match="split_attn"):
        create_model(hypes_of(TOY, *two))
    model = create_model(hypes_of(TOY, *two, ENC + "pwindow_att_config.fusion_method=naive"))
    assert len(model.fusion_net.encoder.layers[0][0].layers[0][1].fn.pwmsa) == 2


# ------------------------------------------------------------------------------------------ steps without an RSU
UNUSED_WORKER = WORKERS / "unused_params_worker.py"


def _check_steps_without_and_with_a_road_side_unit(result: dict) -> None:
    """tests/workers/unused_params_worker.py's steps 1 and 3 (no rank has a road-side unit) and 2 (rank 0 has)."""
    infra = sorted(result["infra_initial"])
    assert len(infra) == 4 * 2  # depth 1 x q/k/v/a x weight and bias
    first, second, third = result["steps"]
    frozen = second["none"]
    assert frozen and all("prior_feed" in n for n in frozen)  # upstream's never-called projection
    for step in (first, third):  # the infrastructure projections were not called: grad None, Adam skips them
        assert step["none"] == sorted(infra + frozen)
    # bit-equal: no weight decay, and after step 2 no momentum either
    assert all(torch.equal(first["infra"][n], result["infra_initial"][n]) for n in infra)
    assert all(torch.equal(third["infra"][n], second["infra"][n]) for n in infra)
    assert not any(torch.equal(second["infra"][n], first["infra"][n]) for n in infra)
    # step 2: the gradient stepped with is DDP's average of the ranks' own gradients (rank 1's infra zeros included)
    assert result["average_gap"] <= 1e-5, result["average_gap"]


def _unused_params_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("unused_params_worker", UNUSED_WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adam_leaves_the_infrastructure_projections_alone_without_a_road_side_unit(toy_small, tmp_path):
    """1 process: the engine's steps on vehicles-only batches leave them bit-equal, then a road-side unit moves
    them (the gradient the step used is the batch's own)."""
    from opencood_ddp.distributed.env import detect_dist_env

    _check_steps_without_and_with_a_road_side_unit(_unused_params_worker().run(toy_small, tmp_path,
                                                                               detect_dist_env({})))


@pytest.mark.slow
def test_on_two_ranks_unused_everywhere_is_skipped_and_used_on_one_is_ddps_average(toy_small, tmp_path):
    """2 ranks (gloo): no rank has a road-side unit in steps 1 and 3; in step 2 rank 0 has one and rank 1 not,
    and both step with DDP's average, rank 1's zeros included, so the replicas stay equal."""
    result = torchrun(2, UNUSED_WORKER, "--toy", toy_small, "--out", tmp_path, timeout=600)
    assert result.returncode == 0, explain(result)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for rank in ranks:
        _check_steps_without_and_with_a_road_side_unit(rank)
    last = [rank["steps"][-1]["infra"] for rank in ranks]
    assert all(torch.equal(last[0][n], last[1][n]) for n in last[0])


@pytest.mark.parametrize("ratio,longest_ms", [(2, 4900), (40, 200)])
def test_a_delay_past_the_table_is_one_line_saying_how_short_it_must_be(ratio, longest_ms):
    """delay x RTE_ratio indexes the 100-row table: the longest delay that fits is 49 frames at upstream's ratio 2
    and 2 frames at 40. One past it was a ValueError with a traceback mid-evaluation; it is now a DataError whose
    bound is the first delay refused."""
    from opencood_ddp.models.modules.v2xvit_encoder import DelayEmbedding

    table = DelayEmbedding(8, ratio)
    fits = longest_ms // 100
    assert table(torch.tensor([0, fits]), [0, fits]).shape == (2, 8)
    with pytest.raises(DataError) as info:
        table(torch.tensor([0, fits + 1]), [0, fits + 1])
    assert "\n" not in str(info.value)
    assert f"shorten the delay (wild_setting.async_overhead, or noise_sweep's --delays_ms) to under " \
           f"{longest_ms + 100} ms" in str(info.value)


def test_a_wild_setting_delay_past_the_table_is_refused_when_the_run_is_built():
    """The forward's refusal came on the ranks whose samples met the delay, while the others waited: the longest
    delay the setting can draw is checked at build, on every rank (training, evaluation, each sweep level)."""
    from opencood_ddp.errors import ConfigError
    from opencood_ddp.tasks.opencood import check_delay_table

    ratio = [f"model.args.transformer.encoder.{where}RTE_ratio=40" for where in ("", "cav_att_config.")]

    def hypes(overhead_ms: float, mode: str = "sim") -> dict:
        return hypes_of("toy/point_pillar_v2xvit", *ratio, wild_setting={
            "async": True, "async_mode": mode, "async_overhead": overhead_ms, "seed": 25, "loc_err": False,
            "data_size": 1.06, "transmission_speed": 27, "backbone_delay": 10})

    check_delay_table(hypes(299))  # 2 frames x 40 = row 80
    check_delay_table(hypes_of("toy/point_pillar_v2xvit", *ratio))  # no delay
    with pytest.raises(ConfigError) as info:
        check_delay_table(hypes(300))
    assert "delay reaches 3 frames, past V2X-ViT's delay table (100 rows at RTE_ratio 40)" in str(info.value)
    assert "to under 300 ms" in str(info.value)
    with pytest.raises(ConfigError):  # real mode: up to the overhead, plus transmission (39 ms) and backbone (10)
        check_delay_table(hypes(260, "real"))
    check_delay_table(hypes(240, "real"))
