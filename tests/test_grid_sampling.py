"""modules/grid_sampling.py: the gather-based sampler that stands in for F.grid_sample under --deterministic on a
GPU, checked on the CPU against F.grid_sample itself (forward, both gradients, gradcheck), and the dispatch, which
must leave the CPU path F.grid_sample's bit for bit.

The map shapes are chosen so that the unnormalisation scale ((W - 1) / 2 with align_corners, W / 2 without) is a
power of two and the grid values of the borders, pixel centres and pixel edges are dyadic: those coordinates are
then exact in both implementations, which must therefore agree on which pixels they pick (nearest mode's ties at
the edges included) and on which side of a pixel centre a gradient is taken.
"""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn.functional as F

from opencood_ddp.models.modules.grid_sampling import gathered_grid_sample, grid_sample, needs_gathered_sampling

MODES = ["bilinear", "nearest"]
ALIGN = [True, False]
CHANNELS = 3


def _shape(align_corners: bool) -> tuple:
    """(H, W) whose unnormalisation scales are powers of two."""
    return (5, 9) if align_corners else (4, 8)


def _special(size: int, align_corners: bool) -> List[float]:
    """Normalised coordinates along one axis: the borders, every pixel centre and edge, and points outside."""
    span = size - 1 if align_corners else size
    centre_offset = 0.0 if align_corners else 1.0
    centres = [-1 + (2 * k + centre_offset) / span for k in range(size)]
    edges = [c + 1 / span for c in centres[:-1]] + ([] if align_corners else [-1.0])
    return sorted(set([-1.0, 1.0, -1.25, 1.25, -3.0, 2.0] + centres + edges))


def _grid(align_corners: bool, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(2, Ho, Wo, 2): sample 0 every pair of special coordinates, sample 1 uniform in [-1.3, 1.3]."""
    h, w = _shape(align_corners)
    xs = torch.tensor(_special(w, align_corners), dtype=torch.float64)
    ys = torch.tensor(_special(h, align_corners), dtype=torch.float64)
    special = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(special.shape, generator=generator, dtype=torch.float64) * 2.6 - 1.3
    return torch.stack([special, uniform]).to(dtype)


def _maps(align_corners: bool, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, CHANNELS, *_shape(align_corners), generator=generator, dtype=torch.float64).to(dtype)


def _torch(maps: torch.Tensor, grid: torch.Tensor, mode: str, align_corners: bool) -> torch.Tensor:
    return F.grid_sample(maps, grid, mode=mode, padding_mode="zeros", align_corners=align_corners)


def _float32_bound(maps: torch.Tensor) -> float:
    """How far a float32 bilinear sample may be from the float64 one of the same float32 inputs.

    A sample that reaches the map has pixel coordinates within [-1, S], S = max(H, W). Computed in float32 each
    carries up to 2 ulps of S, and the sample moves by at most 2 * max|maps| per pixel along each axis:
    2 axes * 2 * max|maps| * 2 ulps of S. The weights (adding up to 1) and the sum of four weighted values add up
    to about 4 ulps of max|maps|. So: float32 eps * max|maps| * (8 * S + 4).
    """
    return torch.finfo(torch.float32).eps * float(maps.abs().max()) * (8 * max(maps.shape[-2:]) + 4)


@pytest.mark.parametrize("align_corners", ALIGN)
def test_bilinear_float32_is_as_close_to_float64_as_torch(align_corners):
    """Both float32 samplers against F.grid_sample in float64 on the same inputs: both within float32 rounding
    (``_float32_bound``), and ours no further from it than torch's float32 answer is, up to 4 ulps of max|maps|.
    The two are not bit-equal: this CPU build's kernel fuses its multiply-adds (one rounding each) and ours
    cannot."""
    maps, grid = _maps(align_corners, torch.float32), _grid(align_corners, torch.float32)
    exact = _torch(maps.double(), grid.double(), "bilinear", align_corners)
    ours = gathered_grid_sample(maps, grid, "bilinear", align_corners)
    theirs = _torch(maps, grid, "bilinear", align_corners)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    our_error = float((ours.double() - exact).abs().max())
    their_error = float((theirs.double() - exact).abs().max())
    bound = _float32_bound(maps)
    assert their_error <= bound and our_error <= bound
    assert our_error <= their_error + 4 * torch.finfo(torch.float32).eps * float(maps.abs().max())


@pytest.mark.parametrize("align_corners", ALIGN)
@pytest.mark.parametrize("mode", MODES)
def test_float64_agrees_with_torch(mode, align_corners):
    maps, grid = _maps(align_corners, torch.float64), _grid(align_corners, torch.float64)
    ours = gathered_grid_sample(maps, grid, mode, align_corners)
    torch.testing.assert_close(ours, _torch(maps, grid, mode, align_corners), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("align_corners", ALIGN)
def test_nearest_picks_torchs_pixels(align_corners, dtype):
    """A nearest sample is a copied value, so on coordinates both compute exactly (the special ones, ties
    between two pixels among them: half to even) and on random ones it is F.grid_sample's, bit for bit."""
    maps, grid = _maps(align_corners, dtype), _grid(align_corners, dtype)
    assert torch.equal(gathered_grid_sample(maps, grid, "nearest", align_corners),
                       _torch(maps, grid, "nearest", align_corners))


def _gradients(sampler, maps: torch.Tensor, grid: torch.Tensor, mode: str, align_corners: bool, upstream):
    maps, grid = maps.clone().requires_grad_(), grid.clone().requires_grad_()
    sampler(maps, grid, mode, align_corners).backward(upstream)
    return maps.grad, grid.grad


@pytest.mark.parametrize("align_corners", ALIGN)
@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_torchs_backward(mode, align_corners):
    """Float64: the maps' gradient, and for bilinear the grid's (the interpolation weights' slopes), are those of
    F.grid_sample's backward, one-sided at pixel centres as torch's. Nearest sampling has no path from the grid
    to the answer (grid.grad None) where torch's backward writes zeros."""
    maps, grid = _maps(align_corners, torch.float64), _grid(align_corners, torch.float64)
    generator = torch.Generator().manual_seed(2)
    upstream = torch.randn(2, CHANNELS, *grid.shape[1:3], generator=generator, dtype=torch.float64)
    ours = _gradients(gathered_grid_sample, maps, grid, mode, align_corners, upstream)
    theirs = _gradients(_torch, maps, grid, mode, align_corners, upstream)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12)
    if mode == "nearest":
        assert ours[1] is None and not theirs[1].any()
    else:
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("align_corners", ALIGN)
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode, align_corners):
    """Finite differences on random points (away from the pixel centres and edges, where the sample has kinks or
    jumps); nearest sampling is differentiated in the maps only, its grid gradient being zero by definition."""
    generator = torch.Generator().manual_seed(3)
    maps = torch.randn(1, 2, 3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    grid = torch.rand(1, 2, 3, 2, generator=generator, dtype=torch.float64) * 2.4 - 1.2
    grid.requires_grad_(mode == "bilinear")
    assert torch.autograd.gradcheck(lambda m, g: gathered_grid_sample(m, g, mode, align_corners), (maps, grid))


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="bicubic"):
        gathered_grid_sample(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 1, 2), "bicubic", False)


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for one test, the previous setting restored after it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("mode", MODES)
def test_the_cpu_path_is_torchs_under_the_deterministic_flag(deterministic_algorithms, mode):
    """The CPU kernels are deterministic: with the flag on and a gradient to come, grid_sample is still
    F.grid_sample's, bit for bit (where the gathered sampler's float32 forward is not)."""
    maps = _maps(False, torch.float32).requires_grad_()
    grid = _grid(False, torch.float32).requires_grad_()
    assert not needs_gathered_sampling(maps, grid)
    assert torch.equal(grid_sample(maps, grid, mode, False), _torch(maps, grid, mode, False))
