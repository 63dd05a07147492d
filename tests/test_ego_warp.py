"""AttFuse, F-Cooper and SECOND without proj_first: every CAV's map is warped into its ego's frame before a
cell of it is fused (modules/ego_warp.py), as CoAlign's fusions with warp; with proj_first nothing is resampled
and the fusion is OpenCOOD's. Expected maps are derived by hand from the poses: the range [-4, 4] x [-2, 2] m
is a 20 x 10 map of 0.4 m cells."""
from __future__ import annotations

import pytest
import torch

from zoo import REPO, pairwise_moves, toy_batch
from opencood_ddp.models.modules.ego_warp import (EgoWarp, batch_ego_warp, ego_frame_affines, ego_rows, plan_ego_warp,
                                                  warp_to_ego)
from opencood_ddp.models.modules.fusion import AttFusion, MaxFusion

RANGE = [-4, -2, -3, 4, 2, 1]
ONE_SAMPLE = torch.tensor([2])
TOY = REPO / "hypes_yaml" / "toy"
WARPING_MODELS = ["point_pillar_intermediate_fusion.yaml", "point_pillar_fcooper.yaml",
                  "second_intermediate_fusion.yaml"]


def _warp(move: torch.Tensor) -> EgoWarp:
    """The warp of one sample whose CAV 1 is reached from the ego's frame by `move` (4x4)."""
    warp = plan_ego_warp(ego_frame_affines(pairwise_moves({1: move}), ONE_SAMPLE, RANGE), ego_rows(ONE_SAMPLE, "cpu"),
                         torch.device("cpu"))
    assert warp is not None and warp.moving.tolist() == [1]
    return warp


def _ahead(metres: float) -> torch.Tensor:
    move = torch.eye(4, dtype=torch.float64)
    move[0, 3] = metres  # ego frame -> CAV frame: x + metres
    return move


HALF_TURN = torch.diag(torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64))


def test_max_fusion_puts_a_cav_cell_where_the_pose_says():
    """A point at the ego's x is at the CAV's x + 0.8 m, two cells on: the CAV's column 7 is the ego's 5."""
    x = torch.zeros(2, 3, 10, 20)
    x[1, :, 4, 7] = 5.0
    fused = MaxFusion()(x, ONE_SAMPLE, _warp(_ahead(0.8)))
    expected = torch.zeros(1, 3, 10, 20)
    expected[0, :, 4, 5] = 5.0
    assert torch.allclose(fused, expected, atol=1e-5)
    unwarped = MaxFusion()(x, ONE_SAMPLE)  # OpenCOOD's: the cell stays where the CAV's frame has it
    assert torch.allclose(unwarped[0, :, 4, 7], torch.full((3,), 5.0))


def test_attention_fusion_averages_the_ego_and_the_warped_cav_where_the_ego_sees_nothing():
    """The ego's map is zero, so its query scores every CAV 0: equal weights, the warped CAV's vector / 2.
    Half a turn about the centre sends the CAV's cell (row 2, column 3) to the ego's (7, 16)."""
    x = torch.zeros(2, 4, 10, 20)
    vector = torch.tensor([1.0, -2.0, 3.0, 0.5])
    x[1, :, 2, 3] = vector
    fused = AttFusion(4)(x, ONE_SAMPLE, _warp(HALF_TURN))
    expected = torch.zeros(1, 4, 10, 20)
    expected[0, :, 7, 16] = vector / 2
    assert torch.allclose(fused, expected, atol=1e-5)


def test_a_cav_map_beyond_the_range_adds_nothing():
    """Moved a whole range (8 m) ahead, the CAV's map covers none of the ego's cells: the fusion is the ego's."""
    x = torch.randn(2, 3, 10, 20, generator=torch.Generator().manual_seed(0)).abs()
    fused = MaxFusion()(x, ONE_SAMPLE, _warp(_ahead(8.0)))
    assert torch.equal(fused[0], x[0])  # max(ego, 0) of a non-negative map


@pytest.mark.parametrize("config", WARPING_MODELS)
def test_with_proj_first_no_map_is_resampled_and_the_output_is_opencoods(toy_small, config):
    batch, model, _ = toy_batch(TOY / config, toy_small)
    ego = batch["ego"]
    assert batch_ego_warp(ego, model.lidar_range) is None  # the dataset's identity transforms
    model.eval()
    without = {key: value for key, value in ego.items() if key != "pairwise_t_matrix"}  # nothing to warp from
    with torch.no_grad():
        ours, theirs = model(ego), model(without)
    assert torch.equal(ours["psm"], theirs["psm"]) and torch.equal(ours["rm"], theirs["rm"])


@pytest.mark.parametrize("config", WARPING_MODELS)
def test_without_proj_first_the_maps_are_warped_and_every_parameter_trains(toy_small, config):
    batch, model, task = toy_batch(TOY / config, toy_small, 2, "fusion.args.proj_first=false")
    ego = batch["ego"]
    warp = batch_ego_warp(ego, model.lidar_range)
    assert warp is not None and not bool(warp.is_ego.all())  # the toy CAVs stand apart: their maps move
    model.train()
    out = task.step(model, batch)
    assert torch.isfinite(out.total)
    out.total.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    without = {key: value for key, value in ego.items() if key != "pairwise_t_matrix"}
    with torch.no_grad():
        assert not torch.equal(model(ego)["psm"], model(without)["psm"])  # the warp changes what is fused


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
    return float(a @ b / (a.norm() * b.norm()))


def test_a_map_made_in_the_cavs_frame_and_warped_lines_up_with_the_map_made_after_projection(toy_small):
    """The same weights encode each CAV twice: from its cloud projected into the ego's frame (proj_first) and
    from its cloud in its own frame. Warped, the second lines up with the first; unwarped or warped the wrong
    way it does not. (Not equal: the pillars' absolute coordinates and the range crop differ between frames.)"""
    config = TOY / "point_pillar_fcooper.yaml"
    projected, model, _ = toy_batch(config, toy_small)
    own_frames, _, _ = toy_batch(config, toy_small, 2, "fusion.args.proj_first=false")
    model.eval()
    with torch.no_grad():
        reference, own = (model.backbone_map(model.front(batch["ego"]), model.layout(batch["ego"]))
                          for batch in (projected, own_frames))
    warp = batch_ego_warp(own_frames["ego"], model.lidar_range)
    square = torch.cat([warp.theta, warp.theta.new_tensor([0.0, 0.0, 1.0]).expand(len(warp.theta), 1, 3)], dim=1)
    warped = warp_to_ego(own, warp.theta, warp.is_ego)
    backwards = warp_to_ego(own, torch.linalg.inv(square)[:, :2], warp.is_ego)
    for cav in torch.nonzero(~warp.is_ego).squeeze(1).tolist():
        lined_up = _correlation(reference[cav], warped[cav])
        assert lined_up > 0.3, lined_up
        assert lined_up > _correlation(reference[cav], own[cav]) + 0.2
        assert abs(_correlation(reference[cav], backwards[cav])) < 0.1
