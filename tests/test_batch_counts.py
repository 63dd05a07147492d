"""numerics/batch_counts.py: inside the fit loop's forward the batch norms' counts are added in one foreach add, and
every count, statistic and output is what torch's own modules give, bit for bit."""
import contextlib

import pytest
import torch
from torch import nn

from op_calls import OpCalls
from opencood_ddp.distributed.device_sync_bn import convert_device_sync_batchnorm
from opencood_ddp.numerics.batch_counts import add_counts, counts_added_together
from opencood_ddp.numerics.batch_norm import use_accurate_batch_norm
from opencood_ddp.numerics.kernel_path import cuda_kernels_on_cpu


class _Layers(nn.Module):
    """Batch norms as the zoo and users' models hold them: three with a momentum, one of them called twice a
    forward; one cumulative (momentum None), which reads its count; one the forward does not call."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.first = nn.BatchNorm2d(4, eps=1e-3, momentum=0.01)
        self.twice = nn.BatchNorm2d(4)
        self.cumulative = nn.BatchNorm2d(4, momentum=None)
        self.unused = nn.BatchNorm2d(4)
        self.rows = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.twice(self.twice(self.first(self.conv(x)).relu()))
        y = self.cumulative(y)
        return self.rows(y.flatten(2).transpose(1, 2).reshape(-1, 4)).sum() + y.square().mean()


def _twins(convert, reference_converted: bool = False):
    """torch's modules (or the same converted ones, `reference_converted`) and converted ones, the same weights."""
    torch.manual_seed(0)
    plain = _Layers().train()
    ours = convert(_Layers().train())
    ours.load_state_dict(plain.state_dict())
    return (convert(plain) if reference_converted else plain), ours


@pytest.mark.parametrize("convert", [use_accurate_batch_norm, convert_device_sync_batchnorm],
                         ids=["zoo", "gpus_batch_norm"])
@pytest.mark.parametrize("path", ["cuda", "cpu"])
def test_three_steps_in_the_block_are_torchs_modules_bit_for_bit(convert, path):
    """Outputs, gradients, running statistics and counts after three forward and backward passes, each forward in
    the block, against the same layers outside it: on the kernels CUDA takes, where those are torch's own modules
    (the native forward), and on the CPU's (the accurate statistics, float64 sums: the converted layers there)."""
    plain, ours = _twins(convert, reference_converted=path == "cpu")
    for step in range(3):
        x = torch.randn(2, 3, 5, 6, generator=torch.Generator().manual_seed(step)).contiguous(
            memory_format=torch.channels_last)
        with cuda_kernels_on_cpu() if path == "cuda" else contextlib.nullcontext():
            expected = plain(x)
            expected.backward()
            with counts_added_together():
                got = ours(x)
            got.backward()
        assert torch.equal(got, expected)
    for (name, a), b in zip(plain.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert (a.grad is None and b.grad is None) if name.startswith("unused") else torch.equal(a.grad, b.grad), name
    counts = {name: int(b.num_batches_tracked) for name, b in ours.named_children() if name != "conv"}
    assert counts == {"first": 3, "twice": 6, "cumulative": 3, "unused": 0, "rows": 3}


def test_a_forward_in_the_block_adds_the_counts_in_one_foreach_add_per_number_of_calls():
    """On the kernels CUDA takes, torch's modules launch an add a layer. In the block: none for the layers with a
    momentum, whose counts go in one foreach add (the layer called twice in another, of 2); the cumulative layer,
    which reads its count in the forward, adds its own."""
    plain, ours = _twins(use_accurate_batch_norm)
    x = torch.randn(2, 3, 5, 6)
    with cuda_kernels_on_cpu():
        with OpCalls() as alone:
            plain(x)
        with OpCalls() as together, counts_added_together():
            ours(x)
    assert alone.calls["add_"] == 5 and "_foreach_add_" not in alone.calls  # first, twice (2), cumulative, rows
    assert together.calls["add_"] == 1 and together.calls["_foreach_add_"] == 2


def test_the_counts_of_the_layers_that_ran_are_added_when_the_forward_raises():
    """A layer counts its batch when it runs, as torch's does, whatever happens after it in the forward."""
    layer = use_accurate_batch_norm(nn.Sequential(nn.BatchNorm1d(2))).train()
    with pytest.raises(RuntimeError, match="after the batch norm"):
        with counts_added_together():
            layer(torch.randn(4, 2))
            raise RuntimeError("after the batch norm")
    assert int(layer[0].num_batches_tracked) == 1


def test_a_block_inside_another_leaves_the_counts_to_the_outer_one():
    layer = use_accurate_batch_norm(nn.Sequential(nn.BatchNorm1d(2))).train()
    with counts_added_together():
        with counts_added_together():
            layer(torch.randn(4, 2))
        assert int(layer[0].num_batches_tracked) == 0
        layer(torch.randn(4, 2))
    assert int(layer[0].num_batches_tracked) == 2


def test_a_traced_forward_adds_its_counts_in_its_graph():
    """Under torch.compile the count's add is the graph's (no launch of its own); nothing is left to the block."""
    torch.manual_seed(0)
    layer = use_accurate_batch_norm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))).train()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with cuda_kernels_on_cpu():
        for _ in range(2):
            with counts_added_together():
                compiled(torch.randn(5, 3))
    assert [int(bn.num_batches_tracked) for bn in layer] == [2, 2]


def test_counts_listed_twice_get_one_add_of_two():
    a, b = torch.zeros((), dtype=torch.long), torch.tensor(7)
    add_counts([a, b, a])
    assert (int(a), int(b)) == (2, 8)
