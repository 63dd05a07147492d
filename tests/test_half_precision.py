"""The full-precision islands under --half (models/modules/precision.py), on the CPU with its autocast: bfloat16,
and float16 where the point is float16's range. The code path is the one CUDA's float16 autocast takes.

Each island is checked to give exactly what the float32 computation gives on the same (16-bit) inputs, so that a
16-bit run differs from a float32 one by its activations' rounding only, never by a grid or logit computed in 16
bits. Without autocast nothing changes: the model tests' float64 and float32 figures are those of before."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from opencood_ddp.models.modules.ego_warp import warp_to_ego
from opencood_ddp.models.modules.fusion import AttFusion
from opencood_ddp.models.modules.pillar_vfe import PFNLayer
from opencood_ddp.models.modules.v2vnet import field_of_view, warp_all_pairs
from opencood_ddp.models.modules.v2xvit_hmsa import attend
from opencood_ddp.models.modules.v2xvit_sttf import sampling_grid, warp


def _autocast(dtype=torch.bfloat16):
    return torch.autocast("cpu", dtype=dtype)


def _maps(n=3, c=4, h=40, w=176, seed=0):
    return torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(seed))


def _shift(n, dx_cells, w=176):
    """(n, 2, 3) affine_grid matrices: a shift of dx_cells cells along x for every map but the first."""
    theta = torch.eye(2, 3, dtype=torch.float64).repeat(n, 1, 1)
    theta[1:, 0, 2] = 2 * dx_cells / w
    return theta


def test_a_16_bit_sampling_grid_would_move_the_map():
    """Why the warps are islands: affine_grid under autocast computes the grid in 16 bits."""
    theta = _shift(2, 0.3)[1:].float()
    exact = F.affine_grid(theta, [1, 1, 40, 176], align_corners=False)
    with _autocast():
        rounded = F.affine_grid(theta, [1, 1, 40, 176], align_corners=False)
    cells = (rounded.float() - exact).abs().max().item() * 176 / 2
    assert rounded.dtype == torch.bfloat16 and cells > 0.1, cells


def test_the_ego_warp_samples_on_a_float32_grid():
    x = _maps().bfloat16()
    theta, is_ego = _shift(3, 0.3), torch.tensor([True, False, False])
    with _autocast():
        warped = warp_to_ego(x, theta, is_ego)
    expected = warp_to_ego(x.float(), theta, is_ego).bfloat16()
    assert warped.dtype == torch.bfloat16 and torch.equal(warped, expected)


def test_v2vnet_warps_and_coverage_on_float32_grids():
    x = _maps(n=2).bfloat16()
    theta = _shift(4, 0.3).view(2, 2, 2, 3)
    with _autocast():
        warped, covered = warp_all_pairs(x, theta), field_of_view(theta.float(), 40, 176)
    assert torch.equal(warped, warp_all_pairs(x.float(), theta).bfloat16())
    assert torch.equal(covered, field_of_view(theta.float(), 40, 176))


def test_v2xvit_sttf_grid_and_warp_in_float32():
    pixel_map = torch.eye(3).repeat(2, 1, 1)
    pixel_map[1, 0, 2] = 0.3  # a third of a cell
    maps = _maps(n=2).bfloat16()
    with _autocast():
        grid = sampling_grid(pixel_map, 40, 176, torch.bfloat16)
        warped = warp(maps, grid, "bilinear")
    exact = sampling_grid(pixel_map, 40, 176, torch.float32)
    assert grid.dtype == torch.float32 and torch.equal(grid, exact)
    assert warped.dtype == torch.float32 and torch.equal(warped, warp(maps.float(), exact, "bilinear"))


def test_float64_inputs_stay_float64():
    x, theta = _maps().double(), _shift(3, 0.3)
    assert warp_to_ego(x, theta, torch.tensor([True, False, False])).dtype == torch.float64
    assert sampling_grid(torch.eye(3, dtype=torch.float64)[None], 8, 8, torch.float64).dtype == torch.float64


def test_attfuse_logits_do_not_overflow_float16():
    """Features of size 40 in 64 channels: their dot product, 102400, is past float16's 65504."""
    tokens = torch.full((5, 3, 64), 40.0).half()
    tokens[:, 1] = 39.0
    fusion = AttFusion(64)
    with _autocast(torch.float16):
        weights = fusion.ego_weights(tokens)
        direct = torch.bmm(tokens[:, :1], tokens.transpose(1, 2))  # what the product alone gives
    assert torch.isinf(direct).any()
    assert torch.isfinite(weights).all() and weights.dtype == torch.float32
    assert torch.equal(weights, fusion.ego_weights(tokens.float()))


def test_v2xvit_attention_logits_in_float32():
    q = torch.full((1, 2, 1, 1, 1, 32), 60.0).half()
    mask = torch.ones(1, 1, 1, 1, 2, 2, dtype=torch.bool)
    with _autocast(torch.float16):
        weights = attend(q, q, mask, scale=1 / math.sqrt(32))
    assert torch.isfinite(weights).all() and weights.dtype == torch.float32
    assert torch.allclose(weights, torch.full_like(weights, 0.5))


@pytest.mark.parametrize("pillars", [5, 0], ids=["pillars", "no-pillar"])
def test_the_vfe_linear_and_batchnorm_run_in_float32(pillars):
    """The BatchNorm, including a batch without a pillar: SyncBatchNorm then sends that rank's statistics in its
    input's dtype, which must be the other ranks' float32. The Linear before it, whose inputs are coordinates in
    metres: the layer gives exactly the float32 layer's result."""
    torch.manual_seed(0)
    layer = PFNLayer(10, 64, use_norm=True, last_layer=True)
    seen = []
    for module in (layer.linear, layer.norm):
        module.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    points = torch.randn(pillars, 32, 10) * 50
    with _autocast():
        out = layer(points)
    assert seen == [torch.float32, torch.float32] and out.dtype == torch.float32 and out.shape == (pillars, 1, 64)
    out.sum().backward()
    assert layer.norm.weight.grad is not None and layer.linear.weight.grad.dtype == torch.float32
    layer.norm.momentum = 0.0  # the same batch statistics again, the running ones left as they are
    assert torch.equal(out, layer(points))


def test_bfloat16_rounds_a_point_coordinate_past_a_pillar():
    """Why the VFE's Linear is an island: bfloat16 keeps 8 significant bits, its values 0.5 m apart at 100 m
    (OPV2V's range reaches 140.8 m), more than a 0.4 m pillar: an x of 100.3 m is 100.5 m."""
    assert torch.tensor(100.3).bfloat16().item() == 100.5


def test_nothing_changes_without_autocast():
    """A float32 run calls the same functions on the same tensors: bit for bit the result of before the islands."""
    x, theta, is_ego = _maps(), _shift(3, 0.3), torch.tensor([True, False, False])
    grid = F.affine_grid(theta[1:].float(), [2, 4, 40, 176], align_corners=False)
    plain = F.grid_sample(x[1:], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    assert torch.equal(warp_to_ego(x, theta, is_ego)[1:], plain)


@pytest.mark.parametrize("voxels", [6, 0], ids=["voxels", "no-voxel"])
def test_the_sparse_backbones_batchnorm_runs_in_float32_without_voxels(voxels):
    """SECOND's sparse stages: the other BatchNorm a rank without a point feeds an empty input, which must send
    SyncBatchNorm float32 statistics. With voxels it follows autocast, as upstream's: given 16-bit features (CUDA's
    float16 convolution's), it keeps them 16-bit, and the step casts nothing for it."""
    from opencood_ddp.models.modules.sparse_backbone import SparseStage
    from opencood_ddp.models.modules.spconv_compat import load_spconv

    spconv = load_spconv()
    norm = torch.nn.BatchNorm1d(4, eps=1e-3, momentum=0.01)
    seen = []
    norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    stage = SparseStage(norm, torch.nn.ReLU())  # as after the convolution: the CPU's spconv has no 16-bit kernels
    coords = torch.tensor([[0, 1, 1, i] for i in range(voxels)], dtype=torch.int32).reshape(-1, 4)
    x = spconv.SparseConvTensor(torch.randn(voxels, 4).bfloat16(), coords, [4, 4, 8], 1)
    with _autocast():
        out = stage(x)
    assert seen == [torch.bfloat16 if voxels else torch.float32]
    assert out.features.shape == (voxels, 4)
