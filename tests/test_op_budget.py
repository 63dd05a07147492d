"""Issue 52's per-step operator budget on the CUDA path: the layers whose op count depends on a choice of ours
dispatch what CUDA needs, inside ``cuda_kernels_on_cpu`` (the census's path) as on a GPU. In process, CPU only."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from opencood_ddp.models.modules.scatter import PointPillarScatter
from opencood_ddp.numerics.dropout import Dropout
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu


class _Ops(TorchDispatchMode):
    """The aten ops called inside, by name."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


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
        with _Ops() as ops:
            out.square().sum().backward()
    assert conv.weight.grad.is_contiguous() and "new_empty_strided" not in ops.calls, ops.calls


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_on_the_cuda_path_is_one_native_dropout(inplace):
    layer = Dropout(0.3, inplace=inplace).train()
    x = torch.randn(64, 16, requires_grad=True)
    with cuda_kernels_on_cpu(), _Ops() as ops:
        out = layer(x * 1.0)
    assert ops.calls["native_dropout"] == 1 and "bernoulli_" not in ops.calls, ops.calls
    kept = out != 0
    assert torch.allclose(out[kept], (x * (1 / 0.7))[kept]) and 0 < int(kept.sum()) < x.numel()


def test_dropout_outside_the_cuda_path_stays_the_hashed_kernel_and_eval_is_identity():
    layer = Dropout(0.3).train()
    x = torch.randn(64, 16)
    with _Ops() as ops:
        layer(x)
    assert "native_dropout" not in ops.calls and "bernoulli_" not in ops.calls, ops.calls
    with cuda_kernels_on_cpu():
        assert layer.eval()(x) is x
