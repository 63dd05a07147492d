"""Issue 52's per-step operator budget on the CUDA path: the layers whose op count depends on a choice of ours
dispatch what CUDA needs, inside ``cuda_kernels_on_cpu`` (the census's path) as on a GPU. In process, CPU only."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from op_calls import OpCalls
from opencood_ddp.engine.step import Precision, forward_backward
from opencood_ddp.engine.task import LossOutput
from opencood_ddp.models.modules.ego_warp import batch_ego_warp, ego_frame_affines, ego_rows, moving_rows
from opencood_ddp.models.modules.mean_vfe import MeanVFE
from opencood_ddp.models.modules.scatter import PointPillarScatter
from opencood_ddp.models.modules.sparse_backbone import dense_of
from opencood_ddp.numerics.dropout import Dropout
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu


def _scattered(channels: int = 8, nx: int = 6, ny: int = 5) -> dict:
    """Two BEV images' worth of pillars, each cell at most once, with a gradient."""
    torch.manual_seed(0)
    cells = torch.randperm(2 * ny * nx)[:20]
    image, rest = cells // (ny * nx), cells % (ny * nx)
    coords = torch.stack([image, torch.zeros_like(image), rest // nx, rest % nx], dim=1).int()
    pillars = torch.randn(len(cells), channels, requires_grad=True)
    return {"pillar_features": pillars, "voxel_coords": coords,
            "scatter": PointPillarScatter({"num_features": channels, "grid_size": [nx, ny, 1]})}


def _image(data: dict) -> torch.Tensor:
    batch = {"pillar_features": data["pillar_features"], "voxel_coords": data["voxel_coords"]}
    return data["scatter"](batch, 2)["spatial_features"]


def test_the_scatter_gives_the_cuda_kernels_a_contiguous_map_with_the_same_values():
    data = _scattered()
    cpu_layout = _image(data)
    with cuda_kernels_on_cpu():
        cuda_layout = _image(data)
    assert cpu_layout.is_contiguous(memory_format=torch.channels_last) and not cpu_layout.is_contiguous()
    assert cuda_layout.is_contiguous() and torch.equal(cuda_layout, cpu_layout)
    grads = [torch.autograd.grad((image * torch.arange(image.numel()).view_as(image)).sum(),
                                 data["pillar_features"])[0] for image in (cpu_layout, cuda_layout)]
    assert torch.equal(grads[0], grads[1])


def test_a_convolution_over_the_cuda_layout_gets_its_weight_gradient_without_a_copy():
    """A channels-last input gives the convolution's weight gradient channels-last strides, which AccumulateGrad
    copies into the contiguous weight's layout (new_empty_strided + copy_); the contiguous map does not."""
    data = _scattered()
    conv = nn.Conv2d(8, 4, 3, padding=1, bias=False)
    with cuda_kernels_on_cpu():
        out = conv(_image(data))
        with OpCalls() as ops:
            out.square().sum().backward()
    assert conv.weight.grad.is_contiguous() and "new_empty_strided" not in ops.calls, ops.calls


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_on_the_cuda_path_is_one_native_dropout(inplace):
    layer = Dropout(0.3, inplace=inplace).train()
    x = torch.randn(64, 16, requires_grad=True)
    with cuda_kernels_on_cpu(), OpCalls() as ops:
        out = layer(x * 1.0)
    assert ops.calls["native_dropout"] == 1 and "bernoulli_" not in ops.calls, ops.calls
    kept = out != 0
    assert torch.allclose(out[kept], (x * (1 / 0.7))[kept]) and 0 < int(kept.sum()) < x.numel()


def test_dropout_outside_the_cuda_path_stays_the_hashed_kernel_and_eval_is_identity():
    layer = Dropout(0.3).train()
    x = torch.randn(64, 16)
    with OpCalls() as ops:
        layer(x)
    assert "native_dropout" not in ops.calls and "bernoulli_" not in ops.calls, ops.calls
    with cuda_kernels_on_cpu():
        assert layer.eval()(x) is x


# ------------------------------------------------------------------------------------------- SECOND (issue 52)
# SECOND's step dispatched more ops than upstream's (8,454 against 8,395 at batch 1), most in the forward: the
# proj_first check of the ego warp derived every CAV's affine matrix to find that none moves (about sixty ops on
# the host), MeanVFE cast what type promotion casts, dense_of selected its four index columns one by one, and the
# step divided its loss by one micro-batch. Each test counts the changed part and checks it against the old way.
def _identity_pairwise(samples: int = 2, max_cav: int = 5) -> torch.Tensor:
    """The dataset's pairwise_t_matrix with proj_first: the identity everywhere, float64."""
    return torch.eye(4, dtype=torch.float64).expand(samples, max_cav, max_cav, 4, 4).clone()


def test_the_proj_first_check_of_the_ego_warp_is_three_ops_and_agrees_with_the_full_derivation():
    record_len, lidar_range = torch.tensor([2, 3]), [-140.8, -40, -3, 140.8, 40, 1]
    pairwise = _identity_pairwise()
    with OpCalls() as ops:
        assert batch_ego_warp({"record_len": record_len, "pairwise_t_matrix": pairwise}, lidar_range) is None
    assert sum(ops.calls.values()) <= 3 and "_local_scalar_dense" not in ops.calls, ops.calls
    # the derivation the check skips finds the same: every matrix exactly the identity, no map moves
    theta = ego_frame_affines(pairwise, record_len, lidar_range)
    assert not bool(moving_rows(theta, ego_rows(record_len, "cpu")).any())
    moved = pairwise.clone()
    moved[1, 0, 2, 0, 3] = 0.8  # sample 1's CAV 2 stands 0.8 m ahead: its map moves, the full path is taken
    warp = batch_ego_warp({"record_len": record_len, "pairwise_t_matrix": moved}, lidar_range)
    assert warp is not None and torch.equal(warp.theta, ego_frame_affines(moved, record_len, lidar_range))
    assert moving_rows(warp.theta, warp.is_ego).tolist() == [False, False, False, False, True]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers: comparing them tells -0.0 from 0.0, which torch.equal does not."""
    return x.reshape(-1).view({torch.float32: torch.int32, torch.float64: torch.int64}[x.dtype])


def _old_mean_vfe(voxels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """MeanVFE before issue 52's op budget: the mask and the counts cast to the voxels' type explicitly."""
    real = torch.arange(voxels.shape[1]).view(1, -1) < counts.view(-1, 1)
    total = (voxels * real.unsqueeze(-1).to(voxels.dtype)).sum(dim=1)
    return total / counts.clamp(min=1).view(-1, 1).to(voxels.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_mean_vfe_casts_nothing_and_gives_the_old_means_bit_for_bit(dtype, count_dtype):
    g = torch.Generator().manual_seed(0)
    voxels = torch.randn(300, 5, 4, generator=g, dtype=dtype) * 30
    counts = torch.randint(1, 6, (300,), generator=g).to(count_dtype)
    counts[:3] = torch.tensor([0, 1, 5])  # a malformed empty voxel (the clamp), one point, a full one
    with OpCalls() as ops:
        out = MeanVFE(4)({"voxel_features": voxels, "voxel_num_points": counts})["voxel_features"]
    assert sum(ops.calls.values()) <= 9 and "_to_copy" not in ops.calls, ops.calls
    old = _old_mean_vfe(voxels, counts)
    assert out.dtype == dtype and torch.equal(_bits(out), _bits(old))


def test_dense_of_indexes_with_one_unbind_and_gives_the_old_canvas_and_gradient():
    g = torch.Generator().manual_seed(0)
    cells = torch.randperm(2 * 3 * 6 * 7, generator=g)[:40]
    indices = torch.stack([cells // 126, cells // 42 % 3, cells // 7 % 6, cells % 7], dim=1).int()
    features = torch.randn(40, 8, generator=g, requires_grad=True)
    sparse = SimpleNamespace(indices=indices, features=features, spatial_shape=[3, 6, 7], batch_size=2)
    with OpCalls() as ops:
        dense = dense_of(sparse)
    assert "select" not in ops.calls and sum(ops.calls.values()) <= 5, ops.calls
    cols = indices.long()
    old = features.new_zeros(2, 3, 6, 7, 8).index_put((cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]), features)
    old = old.permute(0, 4, 1, 2, 3)
    assert torch.equal(dense, old)
    weight = torch.randn(dense.shape, generator=g)
    grads = [torch.autograd.grad((d * weight).sum(), features)[0] for d in (dense, old)]
    assert torch.equal(grads[0], grads[1])


def test_a_step_of_one_micro_batch_does_not_divide_its_loss():
    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(5, 4)

    def step(module, batch):
        return LossOutput(total=module(batch).square().sum())

    grads = {}
    for micro_batches in (1, 2):
        model.zero_grad(set_to_none=True)
        with OpCalls() as ops:
            forward_backward(step, model, x, Precision(None, torch.device("cpu")), None, micro_batches)
        assert ("div" in ops.calls) == (micro_batches > 1), ops.calls
        grads[micro_batches] = model.weight.grad.clone()
    expected = torch.autograd.grad(model(x).square().sum(), model.weight)[0]
    assert torch.equal(grads[1], expected) and torch.equal(grads[2], expected / 2)
