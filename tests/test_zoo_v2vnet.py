"""point_pillar_v2vnet (PointPillar + V2VNet's graph fusion): the message passing's checks (the zoo's shared
contracts run in tests/test_zoo_contracts.py).

What is specific to this model: the fusion runs per sample over its CAVs (a sample's map depends on its own
CAVs only, a lone CAV works), the warp with identity transforms (proj_first) is the identity, and the
ConvGRU's hidden state follows the map's size rather than conv_gru.H/W.
"""
from __future__ import annotations

import math

import pytest
import torch

from zoo import (REPO, assert_forward_backward, assert_key_error, assert_zero_gradients_are_the_unused_groups,
                 hypes_of, lone_cav, reference_shapes, toy_batch)

from opencood_ddp.models import create_model
from opencood_ddp.models.modules.v2vnet import (Geometry, V2VNetFusion, field_of_view, geometry, pairwise_affines,
                                                 warp_all_pairs)

CORE = "point_pillar_v2vnet"
OPV2V = REPO / "hypes_yaml" / "opv2v" / "point_pillar_v2vnet.yaml"
TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_v2vnet.yaml"
UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes" / "point_pillar_v2vnet.yaml"


# ------------------------------------------------------------------------------------------- toy model
def test_toy_forward_backward_gives_one_map_per_sample_on_the_anchor_grid(toy_small):
    out = assert_forward_backward(TOY, toy_small)
    anchor = hypes_of(TOY)["postprocess"]["anchor_args"]
    rows, cols = anchor["H"] // anchor["feature_stride"], anchor["W"] // anchor["feature_stride"]
    assert out["psm"].shape == (2, 2, rows, cols) and out["rm"].shape == (2, 14, rows, cols)


def test_a_sample_depends_only_on_its_own_cavs_and_a_lone_cav_works(toy_small):
    batch, model, task = toy_batch(TOY, toy_small)
    model.eval()
    first, second = task.train_set[0], task.train_set[1]
    assert first["ego"]["cav_num"] >= 2
    with torch.no_grad():
        both = model(task.collate_train([first, second])["ego"])
        alone = model(task.collate_train([first])["ego"])
        lone = model(task.collate_train([lone_cav(first), second])["ego"])
    for key in ("psm", "rm"):
        assert torch.allclose(both[key][:1], alone[key], atol=1e-5), key
        assert torch.allclose(both[key][1:], lone[key][1:], atol=1e-5), key
    assert not torch.allclose(both["rm"][:1], lone["rm"][:1], atol=1e-6)  # the cooperators did count


def test_identity_transforms_warp_to_the_identity():
    x = torch.randn(3, 4, 6, 10)
    eye = torch.eye(4).expand(1, 3, 3, 4, 4)
    theta = pairwise_affines(eye, [-10, -6, -3, 10, 6, 1])[0]
    warped = warp_all_pairs(x, theta)
    for i in range(3):
        assert torch.allclose(warped[i], x, atol=1e-6)


def test_a_translation_of_one_cell_moves_the_map_by_one_cell():
    """Sender j's frame is 1 m (one cell) ahead in x of receiver i's: j's cell c lands at i's cell c + 1."""
    x = torch.randn(2, 1, 4, 8)
    pairwise = torch.eye(4).repeat(1, 2, 2, 1, 1)
    pairwise[0, 0, 1, 0, 3] = -1.0  # i=0's frame to j=1's: x_j = x_i - 1
    theta = pairwise_affines(pairwise, [-4, -2, -3, 4, 2, 1])[0]
    warped = warp_all_pairs(x, theta)
    assert torch.allclose(warped[0, 1, :, :, 1:], x[1, :, :, :-1], atol=1e-5)
    assert torch.all(warped[0, 1, :, :, 0] == 0)


def test_hidden_state_follows_the_map_size_not_conv_gru_hw():
    fusion = V2VNetFusion(8, 2, "max", [[3, 3]], [-10, -6, -3, 10, 6, 1])
    seen = seen_by(fusion, torch.eye(4).repeat(2, 5, 5, 1, 1), [2, 1])
    out = fusion(torch.randn(3, 8, 7, 9), torch.tensor([2, 1]), seen)
    assert out.shape == (2, 8, 7, 9) and torch.isfinite(out).all()


def test_opv2v_parameter_count():
    model = create_model(hypes_of(OPV2V))
    assert sum(p.numel() for p in model.parameters()) == sum(math.prod(s) for n, s in reference_shapes(CORE)
                                                             if not n.endswith(("running_mean", "running_var",
                                                                                "num_batches_tracked")))


# ------------------------------------------------------------------------------------------- key errors
@pytest.mark.parametrize("override,key", [
    ("model.args.v2vfusion.in_channels=128", "model.args.v2vfusion.in_channels"),
    ("model.args.v2vfusion.in_channels=x", "model.args.v2vfusion.in_channels"),
    ("model.args.v2vfusion.num_iteration=0", "model.args.v2vfusion.num_iteration"),
    ("model.args.v2vfusion.agg_operator=sum", "model.args.v2vfusion.agg_operator"),
    ("model.args.v2vfusion.gru_flag=1", "model.args.v2vfusion.gru_flag"),
    ("model.args.v2vfusion.conv_gru.num_layers=0", "model.args.v2vfusion.conv_gru.num_layers"),
    ("model.args.v2vfusion.conv_gru.kernel_size=[[2,2]]", "model.args.v2vfusion.conv_gru.kernel_size"),
    ("model.args.v2vfusion.conv_gru.H=0", "model.args.v2vfusion.conv_gru.H"),
    ("model.args.v2vfusion.conv_gru.W=x", "model.args.v2vfusion.conv_gru.W"),
    ("model.args.v2vfusion.voxel_size=[0.2,0.2,4]", "model.args.v2vfusion.voxel_size"),
    ("model.args.v2vfusion.downsample_rate=2", "model.args.v2vfusion.downsample_rate"),
    ("model.args.shrink_header.input_dim=100", "model.args.shrink_header.input_dim"),
    ("model.args.max_cav=0", "model.args.max_cav"),
    ("postprocess.anchor_args.feature_stride=2", "postprocess.anchor_args.feature_stride"),
])
def test_a_bad_key_gives_one_line_naming_it(override, key):
    assert_key_error(OPV2V, override, key)


# ------------------------------------------------------------------------- the V2V4Real fork's temporal encoding
TEMPORAL = "model.args.v2vfusion.use_temporal_encoding=true"


def test_temporal_encoding_adds_the_forks_cnn_first_and_nothing_else():
    """The fork registers fusion_net.cnn, a 3x3 convolution from C + 1 channels to C, before msg_cnn."""
    plain = [(name, list(t.shape)) for name, t in create_model(hypes_of(OPV2V)).state_dict().items()]
    ours = [(name, list(t.shape)) for name, t in create_model(hypes_of(OPV2V, TEMPORAL)).state_dict().items()]
    at = [name for name, _ in plain].index("fusion_net.msg_cnn.weight")
    assert ours == plain[:at] + [("fusion_net.cnn.weight", [256, 257, 3, 3]), ("fusion_net.cnn.bias", [256])] \
        + plain[at:]


def test_the_delay_is_one_more_input_channel():
    """cnn weights that copy the map's channel c and add 0.5 x the delay channel: each CAV's map + 0.5 x delay."""
    fusion = V2VNetFusion(2, 1, "avg", [[3, 3]], [-4, -2, -3, 4, 2, 1], temporal=True)
    with torch.no_grad():
        fusion.cnn.weight.zero_()
        fusion.cnn.bias.zero_()
        for c in range(2):
            fusion.cnn.weight[c, c, 1, 1] = 1.0
        fusion.cnn.weight[:, 2, 1, 1] = 0.5
    x = torch.randn(3, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    out = fusion.encode_delays(x, torch.tensor([0, 1, 3], dtype=torch.int))
    assert torch.allclose(out, x + 0.5 * torch.tensor([0.0, 1.0, 3.0]).view(3, 1, 1, 1), atol=1e-6)


def test_with_temporal_encoding_a_cavs_delay_changes_the_ego_output_and_every_parameter_trains(toy_small):
    batch, model, task = toy_batch(TOY, toy_small, 2, TEMPORAL)
    ego = batch["ego"]
    assert int(ego["record_len"][0]) > 1
    model.eval()
    delayed = dict(ego, prior_encoding=ego["prior_encoding"].clone())
    delayed["prior_encoding"][0, 1, 1] = 2.0  # sample 0's second CAV two frames late
    with torch.no_grad():
        before, after = model(ego)["psm"], model(delayed)["psm"]
    assert not torch.allclose(before[0], after[0]) and torch.equal(before[1], after[1])
    model.train()
    out = task.step(model, batch)
    out.total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert_zero_gradients_are_the_unused_groups(model)
    assert model.fusion_net.cnn.weight.grad.any()  # the delay's own layer learns


def seen_by(fusion: V2VNetFusion, pairwise: torch.Tensor, cav_counts) -> Geometry:
    """The batch's geometry as the model's layout makes it."""
    return geometry(pairwise, list(cav_counts), fusion.lidar_range)


# ------------------------------------------------------------------- the rearranged arithmetic, in float64
def plain_fusion(fusion: V2VNetFusion, x: torch.Tensor, record_len: torch.Tensor,
                 pairwise: torch.Tensor) -> torch.Tensor:
    """The message passing as the docstring states it: every pair's [warped j, own i] through msg_cnn, masked by
    j's coverage (a warped map of ones), averaged or max-ed over j, and the full ConvGRU cell from a zero state;
    without the ConvGRU (gru_flag false) i's map plus the aggregate."""
    h, w = x.shape[-2:]
    thetas = pairwise_affines(pairwise, fusion.lidar_range)
    egos = []
    for b, nodes in enumerate(torch.split(x, record_len.tolist())):
        n, c = nodes.shape[:2]
        theta = thetas[b, :n, :n]
        mask = field_of_view(theta, h, w)
        for _ in range(fusion.num_iteration):
            warped = warp_all_pairs(nodes, theta)
            pairs = torch.cat([warped, nodes.unsqueeze(1).expand(n, n, c, h, w)], dim=2)
            messages = fusion.msg_cnn(pairs.reshape(n * n, 2 * c, h, w)).view(n, n, c, h, w) * mask
            aggregate = messages.mean(dim=1) if fusion.aggregation == "avg" else messages.max(dim=1).values
            if not fusion.gru:
                nodes = nodes + aggregate
                continue
            state = torch.cat([nodes, aggregate], dim=1)
            for cell in fusion.conv_gru.cell_list:
                state = cell(state, state.new_zeros(n, cell.hidden_dim, h, w))
            nodes = state
        egos.append(nodes[0])
    fused = torch.stack(egos)
    return fusion.mlp(fused.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def turned(count: int, angles, shifts) -> torch.Tensor:
    """(1, count, count, 4, 4): CAV k at yaw angles[k] and x offset shifts[k]; [i, j] takes i's frame to j's."""
    poses = []
    for angle, shift in zip(angles, shifts):
        pose = torch.eye(4, dtype=torch.float64)
        pose[0, 0] = pose[1, 1] = math.cos(angle)
        pose[0, 1], pose[1, 0] = -math.sin(angle), math.sin(angle)
        pose[0, 3] = shift
        poses.append(pose)
    return torch.stack([torch.stack([torch.linalg.inv(poses[j]) @ poses[i] for j in range(count)])
                        for i in range(count)]).unsqueeze(0)


@pytest.mark.parametrize("gru", [True, False], ids=["gru", "residual"])
@pytest.mark.parametrize("aggregation", ["avg", "max"])
@pytest.mark.parametrize("transforms", ["identity", "turned", "mixed"])
def test_fusion_equals_the_plain_message_passing_in_float64(aggregation, transforms, gru):
    """Outputs, the input's gradient and every parameter's gradient equal the plain form's to float64 rounding,
    on the identity path (proj_first), the warped path, and a batch holding one of each; with the ConvGRU and with
    upstream's residual update (gru_flag false), where the ConvGRU is frozen and gets no gradient."""
    torch.manual_seed(0)
    fusion = V2VNetFusion(4, 2, aggregation, [[3, 3], [1, 3]], [-8, -4, -3, 8, 4, 1], gru=gru).double()
    eye = torch.eye(4, dtype=torch.float64).repeat(1, 3, 3, 1, 1)
    rotated = turned(3, [0.0, 0.3, -0.5], [0.0, 2.5, -1.0])
    pairwise = {"identity": torch.cat([eye, eye]), "turned": torch.cat([rotated, rotated]),
                "mixed": torch.cat([eye, rotated])}[transforms]
    record_len = torch.tensor([3, 2])
    x = torch.randn(5, 4, 6, 10, dtype=torch.float64)
    results = []
    def ours(inputs, record_len, pairwise):
        return fusion(inputs, record_len, seen_by(fusion, pairwise, record_len.tolist()))

    for forward in (ours, lambda *a: plain_fusion(fusion, *a)):
        fusion.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        out = forward(inputs, record_len, pairwise)
        out.pow(2).sum().backward()
        assert all(p.grad is None for p in fusion.conv_gru.parameters()) is not gru
        results.append((out.detach(), inputs.grad, {k: p.grad.clone() for k, p in fusion.named_parameters()
                                                    if p.requires_grad}))
    (out, grad, params), (plain_out, plain_grad, plain_params) = results
    assert all(p.requires_grad for p in fusion.conv_gru.parameters()) is gru and len(params) == len(plain_params)
    assert torch.allclose(out, plain_out, rtol=0, atol=1e-12)
    assert torch.allclose(grad, plain_grad, rtol=0, atol=1e-12)
    for name, value in plain_params.items():
        assert torch.allclose(params[name], value, rtol=0, atol=1e-12), name
    if transforms != "identity":
        assert not torch.allclose(out[1], plain_fusion(fusion, x, record_len, torch.cat([eye, eye]))[1])


def test_gru_flag_false_keeps_upstreams_state_dict_and_trains_every_other_parameter(toy_small):
    """Upstream's gru_flag false still builds the ConvGRU (so its checkpoints hold it): the same names and shapes as
    with true, the ConvGRU frozen, a training step giving every other parameter a gradient, and another output."""
    on = create_model(hypes_of(TOY))
    off = create_model(hypes_of(TOY, "model.args.v2vfusion.gru_flag=false"))
    assert [(k, v.shape) for k, v in off.state_dict().items()] == [(k, v.shape) for k, v in on.state_dict().items()]
    frozen = {name for name, p in off.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in off.named_parameters() if name.startswith("fusion_net.conv_gru.")}
    batch, _, task = toy_batch(TOY, toy_small)
    off.load_state_dict(on.state_dict())
    on.train(), off.train()
    task.step(off, batch).total.backward()
    assert all((p.grad is None) is (name in frozen) for name, p in off.named_parameters())
    on.eval(), off.eval()
    with torch.no_grad():
        assert not torch.equal(on(batch["ego"])["psm"], off(batch["ego"])["psm"])


def test_the_gru_weights_that_meet_the_zero_state_get_an_exact_zero_gradient():
    """As upstream's: Adam's weight decay moves a parameter with a zero gradient, and not one without."""
    fusion = V2VNetFusion(4, 1, "avg", [[3, 3]], [-8, -4, -3, 8, 4, 1])
    seen = seen_by(fusion, torch.eye(4).repeat(1, 3, 3, 1, 1), [3])
    fusion(torch.randn(3, 4, 6, 10), torch.tensor([3]), seen).sum().backward()
    cell = fusion.conv_gru.cell_list[0]
    assert torch.count_nonzero(cell.conv_gates.weight.grad[:4]) == 0  # the reset gate's rows
    assert torch.count_nonzero(cell.conv_gates.bias.grad[:4]) == 0
    assert torch.count_nonzero(cell.conv_gates.weight.grad[:, 8:]) == 0  # the hidden state's columns
    assert torch.count_nonzero(cell.conv_can.weight.grad[:, 8:]) == 0
    assert torch.count_nonzero(cell.conv_gates.weight.grad[4:, :8]) > 0
