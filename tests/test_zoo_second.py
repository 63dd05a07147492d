"""second_intermediate (SECOND + AttFuse): the sparse backbone's geometry and the spconv fix (the zoo's shared
contracts run in tests/test_zoo_contracts.py).

What is specific to this model: spconv's sparse convolutions (imported only when the model is built, their CPU
backward made to work by ``modules/spconv_compat.py``, a batch without voxels still a full graph), the height
that must survive the backbone's strided layers, and attention fusion per sample after a shared 3-D backbone.
`second` (early and late fusion, models/second.py) is this detector without the fusion: the sparse backbone, the
spconv fixes and the hypes rules tested here are its too; its own tests are tests/test_zoo_second_single.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from launch import torch_threads
from zoo import (REPO, assert_forward_backward, assert_key_error, hypes_of, lone_cav, reference_shapes,
                 toy_batch)

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import load_hypes
from opencood_ddp.models import create_model
from opencood_ddp.models.modules.mean_vfe import MeanVFE
from opencood_ddp.models.modules.sparse_backbone import VoxelBackBone8x, dense_of, output_shape, sparse_shape
from opencood_ddp.models.modules.spconv_compat import NO_STREAM, cpu_safe_stream, load_spconv
from opencood_ddp.models.second import min_grid_z

CORE = "second_intermediate"
OPV2V = REPO / "hypes_yaml" / "opv2v" / "second_intermediate_fusion.yaml"
TOY = REPO / "hypes_yaml" / "toy" / "second_intermediate_fusion.yaml"
UPSTREAM = REPO / "tests" / "reference" / "upstream_hypes" / "second_intermediate_fusion.yaml"


# ------------------------------------------------------------------------------------------- upstream's names
def test_upstreams_hypes_file_builds_unchanged_but_for_the_data(toy_small):
    """Upstream's own file (fusion args [], batch_size, anchor_num, W/H/D written by its parser) trains here."""
    from opencood_ddp.tasks import build_task

    hypes = hypes_of(UPSTREAM, toy_root=toy_small)
    task = build_task(hypes, for_training=True)
    ours = [(name, list(t.shape)) for name, t in task.model.state_dict().items()]
    assert ours == reference_shapes(CORE)
    assert hypes["model"]["args"]["grid_size"] == [2816, 800, 40]


# ------------------------------------------------------------------------------------------- toy model
def test_toy_forward_backward_gives_one_map_per_sample_on_the_anchor_grid(toy_small):
    out = assert_forward_backward(TOY, toy_small)
    hypes = hypes_of(TOY)
    anchor = hypes["postprocess"]["anchor_args"]
    rows, cols = anchor["H"] // anchor["feature_stride"], anchor["W"] // anchor["feature_stride"]
    assert out["psm"].shape == (2, 2, rows, cols) and out["rm"].shape == (2, 14, rows, cols)


def _collate(task, samples):
    return task.collate_train(samples)["ego"]



def _calibrate_batchnorm(model: torch.nn.Module, batch: dict) -> None:
    """Running statistics of one training pass: a fresh model's (0, 1) shrink spconv's small initial
    activations to nothing by the heads, so eval-mode outputs would be the heads' bias everywhere."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.momentum = 1.0
    with torch.no_grad():
        model.train()(batch)
    model.eval()


def test_a_sample_depends_only_on_its_own_cavs_and_a_lone_cav_works(toy_small):
    """Eval mode: a sample's maps are the same alone or batched with another; one CAV alone gives its own map."""
    batch, model, task = toy_batch(TOY, toy_small)
    _calibrate_batchnorm(model, batch["ego"])
    first, second = task.train_set[0], task.train_set[1]
    assert first["ego"]["cav_num"] >= 2
    with torch.no_grad():
        both = model(_collate(task, [first, second]))
        alone = model(_collate(task, [first]))
        lone = model(_collate(task, [lone_cav(first), second]))
    for key in ("psm", "rm"):
        assert torch.allclose(both[key][:1], alone[key], atol=1e-5), key
        assert torch.allclose(both[key][1:], lone[key][1:], atol=1e-5), key
    assert not torch.allclose(both["psm"][:1], lone["psm"][:1], atol=1e-3)  # the cooperators did count
    assert lone["psm"].shape == both["psm"].shape


def _without_voxels(batch: dict, keep) -> dict:
    out = dict(batch)
    lidar = batch["processed_lidar"]
    kept = keep(lidar["voxel_coords"][:, 0])
    out["processed_lidar"] = {key: value[kept] for key, value in lidar.items()}
    return out


@pytest.mark.parametrize("case", ["no voxel at all", "last CAV empty"])
def test_batches_without_voxels_train_every_parameter(toy_small, case):
    """spconv refuses empty tensors and its SparseSequential skips BatchNorm for them; SparseStage runs every
    layer, so a batch without a point still gives finite outputs and a (zero) gradient on every parameter, and
    a trailing CAV without voxels still gets its map: what DDP without find_unused_parameters needs."""
    batch, model, task = toy_batch(TOY, toy_small)
    ego = batch["ego"]
    last = int(ego["record_len"].sum()) - 1
    keep = (lambda cav: cav < 0) if case == "no voxel at all" else (lambda cav: cav != last)
    empty = {"ego": _without_voxels(ego, keep)}
    model.train()
    out = task.step(model, empty)
    assert torch.isfinite(out.total)
    out.total.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        maps = model.eval()(empty["ego"])
    assert maps["psm"].shape[0] == len(ego["record_len"])


def test_mean_vfe_averages_the_real_points_only():
    voxels = torch.tensor([[[1.0, 2, 3, 4], [3, 4, 5, 6], [9, 9, 9, 9]],
                           [[2.0, 2, 2, 2], [7, 7, 7, 7], [7, 7, 7, 7]]])
    out = MeanVFE(4)({"voxel_features": voxels, "voxel_num_points": torch.tensor([2, 1])})["voxel_features"]
    assert torch.equal(out, torch.tensor([[2.0, 3, 4, 5], [2, 2, 2, 2]]))


# ------------------------------------------------------------------------------------------- sparse geometry
def _random_voxels(grid_zyx, batch: int, count: int, channels: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cells = torch.randperm(batch * grid_zyx[0] * grid_zyx[1] * grid_zyx[2], generator=g)[:count]
    coords = []
    for size in reversed(grid_zyx):
        coords.append(cells % size)
        cells = cells // size
    coords = torch.stack([cells] + coords[::-1], dim=1).int()  # (batch, z, y, x)
    return torch.randn(count, channels, generator=g), coords


def test_output_shape_is_what_the_backbone_gives_and_24_z_cells_are_the_least():
    assert sparse_shape([2816, 800, 40]) == [41, 800, 2816]
    assert output_shape([2816, 800, 40]) == [2, 100, 352]  # upstream: 256 = 128 x 2 BEV channels
    assert min_grid_z() == 24 and output_shape([8, 8, 23])[0] == 0 and output_shape([8, 8, 24])[0] == 1
    grid = [24, 16, 30]
    backbone = VoxelBackBone8x({"num_features_out": 8}, 4, grid).eval()
    features, coords = _random_voxels(sparse_shape(grid), batch=2, count=300, channels=4)
    with torch.no_grad():
        dense = dense_of(backbone({"voxel_features": features, "voxel_coords": coords,
                                   "num_images": 3})["encoded_spconv_tensor"])
    assert list(dense.shape) == [3, 8] + output_shape(grid)  # the trailing image without voxels included
    assert dense[2].abs().sum() == 0


def test_grid_without_height_left_or_a_wrong_feature_num_is_one_error_line():
    assert_key_error(TOY, "preprocess.args.voxel_size=[0.2, 0.2, 0.2]", "model.args.grid_size")
    assert_key_error(TOY, "model.args.height_compression.feature_num=64", "model.args.height_compression.feature_num")


def test_grid_size_missing_tells_which_parser_computes_it():
    hypes = load_hypes(TOY)
    del hypes["yaml_parser"]
    with pytest.raises(ConfigError, match="model.args.grid_size is missing; add 'yaml_parser: load_second_params'"):
        create_model(hypes)


@pytest.mark.parametrize("override, key", [
    ("model.args.batch_size=0", "model.args.batch_size"),
    ("model.args.mean_vfe.feature_points=3", "model.args.mean_vfe.feature_points"),
    ("model.args.backbone_3d=5", "model.args.backbone_3d"),
    ("model.args.backbone_3d.num_features_out=0", "model.args.backbone_3d.num_features_out"),
    ("model.args.backbone_3d.num_features=64", "model.args.backbone_3d"),
    ("model.args.height_compression.feature_num=0", "model.args.height_compression.feature_num"),
    ("model.args.base_bev_backbone.layer_nums=[1]", "model.args.base_bev_backbone.layer_nums"),
    ("model.args.base_bev_backbone.num_filters=64", "model.args.base_bev_backbone.num_filters"),
    ("model.args.base_bev_backbone.upsample_strides=[1]", "model.args.base_bev_backbone.upsample_strides"),
    ("model.args.base_bev_backbone.layer_strides=[2, 2]", "model.args.base_bev_backbone"),
    ("model.args.base_bev_backbone.compression=8", "model.args.base_bev_backbone.compression"),
    ("postprocess.anchor_args.feature_stride=4", "feature_stride"),
    ("model.args.anchor_number=3", "model.args.anchor_number"),
    ("model.args.anchor_num=1", "model.args.anchor_num"),
    ("postprocess.anchor_args.num=1", "postprocess.anchor_args.num"),
    ("model.args.voxel_size=[0.4, 0.4, 0.1]", "model.args.voxel_size"),
    ("model.args.lidar_range=[-40, -24, -3, 40, 24, 1]", "model.args.lidar_range"),
])
def test_a_wrong_model_key_is_one_error_line(override, key):
    assert_key_error(TOY, override, key)


# ------------------------------------------------------------------------------------------- spconv
def test_spconv_is_imported_only_when_the_model_is_built():
    code = ("import sys; import opencood_ddp.models.second_intermediate; from opencood_ddp.registry import MODELS; "
            "MODELS.names(); print('spconv' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_a_missing_spconv_is_one_error_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "spconv", None)
    monkeypatch.setitem(sys.modules, "spconv.pytorch", None)
    with pytest.raises(ConfigError) as caught:
        create_model(hypes_of(TOY))
    assert "needs spconv 2.x" in str(caught.value) and "\n" not in str(caught.value)


def test_the_stream_fix_answers_cuda_where_there_is_cuda(monkeypatch):
    query = cpu_safe_stream(lambda: 1234)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert query() == 1234
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert query() == NO_STREAM


def _strided_conv(spconv):
    return spconv.SparseConv3d(3, 5, 3, stride=2, padding=1, bias=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the problem exists only where torch has no CUDA")
def test_spconv_cpu_backward_fails_without_the_stream_fix(monkeypatch):
    """The problem the fix solves: spconv's backward asks for a CUDA stream before looking at the device."""
    spconv = load_spconv()
    from spconv.pytorch import cppcore, ops

    monkeypatch.setattr(ops, "get_current_stream", cppcore.get_current_stream)  # spconv as installed
    features, coords = _random_voxels([5, 6, 7], batch=1, count=40, channels=3)
    features.requires_grad_(True)
    out = _strided_conv(spconv)(spconv.SparseConvTensor(features, coords, [5, 6, 7], 1))
    # torch's CPU build says "Torch not compiled with CUDA enabled"; a CUDA build on a machine without a GPU (torch
    # 2.11+cu130 from the package index) "Found no NVIDIA driver on your system"
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA driver"):
        out.features.sum().backward()


@pytest.fixture
def two_threads():
    """Two OpenMP threads, which spconv's CPU kernels share with torch's pool, for a test whose point is their race
    (under `make test`'s two pytest processes each process runs with one: tests/conftest.py)."""
    with torch_threads(max(2, torch.get_num_threads())):
        yield


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or os.environ.get("OMP_NUM_THREADS") == "1",
                    reason="the race needs two OpenMP threads")
def test_spconv_cpu_scatter_add_races_and_the_fix_does_not(two_threads):
    """The second problem: spconv's scatter_add_cpu shares its row pointers between OpenMP threads, so rows
    land in the wrong voxel now and then (most calls of this size, here); the replacement is exact every time."""
    load_spconv()
    from spconv.pytorch import ops
    from spconv.pytorch.cppcore import torch_tensor_to_tv as tv

    raced = False
    # 20,000 rows race in about 9 calls of 10 on 2 idle cores (2,000 rows: 1 in 4); a busy core makes it rarer,
    # so the loop goes on until it has seen one race and checked 20 calls of ours, up to 300 calls.
    for trial in range(300):
        g = torch.Generator().manual_seed(trial)
        rows = torch.randperm(40000, generator=g)[:20000].int()
        source = torch.randn(20000, 3, generator=g)
        expected = torch.zeros(40000, 3)
        expected[rows.long()] += source  # distinct rows: exact
        theirs, ours = torch.zeros(40000, 3), torch.zeros(40000, 3)
        ops.SpconvOps.original.scatter_add_cpu(tv(theirs), tv(source), tv(rows))
        ops.SpconvOps.scatter_add_cpu(tv(ours), tv(source), tv(rows))
        assert torch.equal(ours, expected)
        raced = raced or not torch.equal(theirs, expected)
        if raced and trial >= 19:
            break
    assert raced, "spconv's scatter_add_cpu gave exact sums in 300 calls: the race may be fixed upstream"


@pytest.mark.parametrize("kind", ["submanifold", "strided", "conv_out"])
@pytest.mark.parametrize("count", [60, 3000])
def test_sparse_conv_outputs_and_gradients_equal_dense_conv3d(kind, count, two_threads):
    """With the fixes, every convolution of the backbone trains on CPU with a dense conv3d's outputs and
    gradients (3000 voxels: enough rows for spconv's threads to have raced)."""
    spconv = load_spconv()
    torch.manual_seed(0)
    layer, stride, padding = {
        "submanifold": (spconv.SubMConv3d(3, 5, 3, padding=1, bias=False), 1, 1),
        "strided": (_strided_conv(spconv), 2, 1),
        "conv_out": (spconv.SparseConv3d(3, 5, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False), (2, 1, 1), 0),
    }[kind]
    shape = [7, 6, 5] if count < 100 else [11, 24, 20]
    features, coords = _random_voxels(shape, batch=2, count=count, channels=3, seed=1)
    sparse_in = features.clone().requires_grad_(True)
    dense_in = features.clone().requires_grad_(True)
    sparse_out = dense_of(layer(spconv.SparseConvTensor(sparse_in, coords, shape, 2)))
    dense_x = dense_of(spconv.SparseConvTensor(dense_in, coords, shape, 2))
    weight = layer.weight.detach().clone().requires_grad_(True)  # (out, kz, ky, kx, in)
    dense_out = F.conv3d(dense_x, weight.permute(0, 4, 1, 2, 3), stride=stride, padding=padding)
    if kind == "submanifold":  # outputs only at the input's sites
        occupied = torch.zeros_like(dense_out[:, :1])
        occupied[coords[:, 0].long(), 0, coords[:, 1].long(), coords[:, 2].long(), coords[:, 3].long()] = 1
        dense_out = dense_out * occupied
    assert torch.allclose(sparse_out, dense_out, atol=1e-5)
    probe = torch.randn_like(dense_out)
    (sparse_out * probe).sum().backward()
    (dense_out * probe).sum().backward()
    assert torch.allclose(sparse_in.grad, dense_in.grad, atol=1e-4)
    assert torch.allclose(layer.weight.grad, weight.grad, atol=1e-4)
