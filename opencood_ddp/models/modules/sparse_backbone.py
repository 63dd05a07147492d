"""SECOND's sparse 3-D backbone, VoxelBackBone8x (upstream ``sub_modules/sparse_backbone_3d.py``, from OpenPCDet).

Voxel features (V, C_in) at (CAV, z, y, x) -> a sparse tensor 8x coarser in y and x and a few cells high, which
``HeightCompression`` folds into BEV channels. Stages and names as upstream, so that its checkpoints load strictly
(each layer is [conv, BatchNorm1d(eps 1e-3, momentum 0.01), ReLU]; no convolution has a bias):

    conv_input  submanifold 16                     conv3  strided 64, submanifold 64 x 2
    conv1       submanifold 16                     conv4  strided 64 (no z padding), submanifold 64 x 2
    conv2       strided 32, submanifold 32 x 2     conv_out  strided num_features_out (128), kernel (3, 1, 1)

spconv stores a weight as (out, kz, ky, kx, in). Submanifold layers keep the active sites; strided ones
activate every output cell that sees an input. Layers of one stage share their rule book (``indice_key``), as
upstream.

The sparse grid is upstream's ``[z + 1, y, x]`` for ``grid_size`` [x, y, z]: OpenPCDet adds one cell of height so
that 40 cells (4 m at 0.1 m) shrink 41 -> 21 -> 11 -> 5 -> 2 through the strided layers. ``output_shape``
computes that chain for the configuration check; the layers are built from the same ``STRIDED`` table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from opencood_ddp.models.modules.precision import in_full_precision
from opencood_ddp.models.modules.spconv_compat import load_spconv
from opencood_ddp.numerics.autocast import autocast_enabled, autocast_off

Triple = Tuple[int, int, int]
DEFAULT_NUM_FEATURES_OUT = 128  # upstream's conv_out width unless backbone_3d.num_features_out says otherwise


@dataclass(frozen=True)
class Strided:
    """The geometry of one strided sparse convolution along (z, y, x)."""

    kernel: Triple
    stride: Triple
    padding: Triple

    def out_shape(self, shape: Sequence[int]) -> List[int]:
        """Output cells per axis (a dense convolution's formula; 0 or less: nothing is left)."""
        return [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(shape, self.kernel, self.stride, self.padding)]


# conv2, conv3, conv4 and conv_out, in order. conv4 does not pad z, and conv_out strides z only.
STRIDED: Tuple[Strided, ...] = (
    Strided((3, 3, 3), (2, 2, 2), (1, 1, 1)),
    Strided((3, 3, 3), (2, 2, 2), (1, 1, 1)),
    Strided((3, 3, 3), (2, 2, 2), (0, 1, 1)),
    Strided((3, 1, 1), (2, 1, 1), (0, 0, 0)),
)
STAGE_WIDTHS = (16, 32, 64, 64)  # conv1..conv4; fixed upstream (only conv_out's width is configurable)


def sparse_shape(grid_size: Sequence[int]) -> List[int]:
    """[z + 1, y, x] of ``grid_size`` [x, y, z]: the sparse tensor's spatial shape (see the module docstring)."""
    x, y, z = (int(v) for v in grid_size)
    return [z + 1, y, x]


def output_shape(grid_size: Sequence[int]) -> List[int]:
    """[depth, height, width] of the backbone's output for ``grid_size`` [x, y, z]; a value < 1: no output."""
    shape = sparse_shape(grid_size)
    for layer in STRIDED:
        shape = layer.out_shape(shape)
    return shape


def num_features_out(cfg: Union[Mapping, Sequence]) -> int:
    """conv_out's width: ``backbone_3d.num_features_out``, or upstream's 128 (its hypes give ``backbone_3d: []``)."""
    if isinstance(cfg, Mapping) and "num_features_out" in cfg:
        return int(cfg["num_features_out"])
    return DEFAULT_NUM_FEATURES_OUT


def _norm(channels: int) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)


class SparseStage(nn.Sequential):
    """A sequence of sparse convolutions and per-voxel layers over a ``SparseConvTensor``.

    Convolutions take the sparse tensor; every other layer (BatchNorm1d, ReLU, or what SyncBN conversion made of
    them) takes its (V, C) features. Unlike spconv's ``SparseSequential``, a tensor without voxels still goes
    through every layer: spconv's kernels refuse an empty tensor, and ``SparseSequential`` skips the per-voxel
    layers of one, which would leave BatchNorm out of the graph of a batch without a point (DDP then waits for
    gradients that never come). Here a convolution of an empty tensor is an empty matmul with its weight's
    centre tap, so every parameter gets a (zero) gradient, as the pillar encoder does for such a batch.
    """

    def forward(self, x: Any) -> Any:
        for layer in self:
            if isinstance(layer, SparseStage):
                x = layer(x)
            elif _is_sparse_conv(layer):
                x = _sparse_conv(layer, x) if x.indices.shape[0] else _empty_conv(layer, x)
            elif isinstance(layer, _BatchNorm):
                x = x.replace_feature(_batch_norm(layer, x.features))
            else:
                x = x.replace_feature(layer(x.features))
        return x


def _batch_norm(layer: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """A rank without a voxel runs its BatchNorm in float32 under --half: SyncBatchNorm sends an empty input's
    statistics in the input's dtype, and the other ranks' are float32 (models/modules/precision.py). Voxels run it
    as autocast does, as upstream's: in float16 on CUDA after spconv's float16 convolution, so that the step casts
    neither the features up for it nor back down for the next convolution (float32 on the CPU, and under bfloat16,
    where the convolutions run in float32)."""
    return layer(features) if features.shape[0] else in_full_precision(layer, features)


def _sparse_conv(layer: nn.Module, x: Any) -> Any:
    """The convolution under --half: spconv's kernels take float16 on CUDA, but neither bfloat16 nor any 16-bit
    type on the CPU (a KeyError deep in spconv), so there the convolution runs in float32."""
    device_type = x.features.device.type
    if not autocast_enabled(device_type) or (
            device_type == "cuda" and torch.get_autocast_dtype(device_type) == torch.float16):
        return layer(x)
    with autocast_off(device_type):
        return layer(x.replace_feature(x.features.float()))


def _is_sparse_conv(layer: nn.Module) -> bool:
    return isinstance(layer, load_spconv().conv.SparseConvolution)


def _empty_conv(layer: nn.Module, x: Any) -> Any:
    """What ``layer`` gives for a tensor without voxels: no voxels, the layer's width and output grid."""
    centre = tuple(k // 2 for k in layer.kernel_size)
    tap = layer.weight[(slice(None),) + centre]  # (out, in): the weight layout is checked in VoxelBackBone8x
    shape = list(x.spatial_shape) if layer.subm else Strided(
        tuple(layer.kernel_size), tuple(layer.stride), tuple(layer.padding)).out_shape(x.spatial_shape)
    return load_spconv().SparseConvTensor(x.features @ tap.t(), x.indices, shape, x.batch_size)


class VoxelBackBone8x(nn.Module):
    """(V, C_in) voxel features with (CAV, z, y, x) coords -> sparse tensor at stride 8 (see the module docstring)."""

    def __init__(self, cfg: Union[Mapping, Sequence], input_channels: int, grid_size: Sequence[int]):
        super().__init__()
        spconv = load_spconv("SECOND (model second, second_intermediate)")
        self.sparse_shape = sparse_shape(grid_size)
        c1, c2, c3, c4 = STAGE_WIDTHS

        def subm(c_in: int, c_out: int, key: str) -> SparseStage:
            return SparseStage(spconv.SubMConv3d(c_in, c_out, 3, padding=1, bias=False, indice_key=key),
                               _norm(c_out), nn.ReLU())

        def strided(c_in: int, c_out: int, geometry: Strided, key: str) -> SparseStage:
            return SparseStage(spconv.SparseConv3d(c_in, c_out, geometry.kernel, stride=geometry.stride,
                                                   padding=geometry.padding, bias=False, indice_key=key),
                               _norm(c_out), nn.ReLU())

        self.conv_input = subm(input_channels, c1, "subm1")
        self.conv1 = SparseStage(subm(c1, c1, "subm1"))
        self.conv2 = SparseStage(strided(c1, c2, STRIDED[0], "spconv2"), subm(c2, c2, "subm2"), subm(c2, c2, "subm2"))
        self.conv3 = SparseStage(strided(c2, c3, STRIDED[1], "spconv3"), subm(c3, c3, "subm3"), subm(c3, c3, "subm3"))
        self.conv4 = SparseStage(strided(c3, c4, STRIDED[2], "spconv4"), subm(c4, c4, "subm4"), subm(c4, c4, "subm4"))
        self.num_point_features = num_features_out(cfg)
        # conv_out is [conv, BN, ReLU] directly, not a stage of one block (upstream's names: conv_out.0, conv_out.1).
        self.conv_out = strided(c4, self.num_point_features, STRIDED[3], "spconv_down2")
        first = self.conv_input[0].weight
        if tuple(first.shape) != (c1, 3, 3, 3, input_channels):
            raise ValueError(f"spconv lays its weights out as {tuple(first.shape)}, not upstream's (out, kz, ky, kx, "
                             f"in) = {(c1, 3, 3, 3, input_channels)}; use spconv 2.x with its default layout")

    def forward(self, batch_dict: dict) -> dict:
        """Reads voxel_features (V, C_in), voxel_coords (V, 4) and num_images; adds encoded_spconv_tensor."""
        x = load_spconv().SparseConvTensor(features=batch_dict["voxel_features"],
                                           indices=batch_dict["voxel_coords"].int(),
                                           spatial_shape=self.sparse_shape, batch_size=batch_dict["num_images"])
        for stage in (self.conv_input, self.conv1, self.conv2, self.conv3, self.conv4, self.conv_out):
            x = stage(x)
        batch_dict["encoded_spconv_tensor"] = x
        batch_dict["encoded_spconv_tensor_stride"] = 8
        return batch_dict


def dense_of(x: Any) -> torch.Tensor:
    """A SparseConvTensor as a dense (N, C, D, H, W) tensor, zeros where no voxel is.

    One index_put instead of spconv's ``dense()``, whose indexing with a list of index tensors torch has
    deprecated (a warning on every step, and a different meaning in a later torch).
    """
    depth, height, width = (int(v) for v in x.spatial_shape)
    canvas = x.features.new_zeros(x.batch_size, depth, height, width, x.features.shape[1])
    # One unbind for the four index columns (one op where four selects were: issue 52's op budget).
    canvas = canvas.index_put(x.indices.long().unbind(1), x.features)
    return canvas.permute(0, 4, 1, 2, 3)


class HeightCompression(nn.Module):
    """Sparse (N, C, D, H, W) -> dense BEV (N, C x D, H, W) (upstream ``sub_modules/height_compression.py``)."""

    def __init__(self, cfg: Mapping):
        super().__init__()
        self.num_bev_features = int(cfg["feature_num"])

    def forward(self, batch_dict: dict) -> dict:
        dense = dense_of(batch_dict["encoded_spconv_tensor"])
        n, c, d, h, w = dense.shape
        if c * d != self.num_bev_features:  # the hypes check rules this out; a direct caller gets a clear error
            raise ValueError(f"height_compression.feature_num is {self.num_bev_features}, but the sparse backbone "
                             f"gives {c} channels x {d} heights = {c * d}")
        batch_dict["spatial_features"] = dense.reshape(n, c * d, h, w)
        batch_dict["spatial_features_stride"] = batch_dict["encoded_spconv_tensor_stride"]
        return batch_dict


__all__ = ["VoxelBackBone8x", "HeightCompression", "SparseStage", "dense_of", "Strided", "STRIDED", "sparse_shape",
           "output_shape", "num_features_out", "DEFAULT_NUM_FEATURES_OUT"]
