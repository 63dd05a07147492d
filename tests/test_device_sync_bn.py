"""distributed/device_sync_bn.py: torch's synchronized batch norm on CUDA without its host waits.

Its kernels are CUDA's only, so the logic is proven over CPU stand-ins written from their CUDA formulas
(tests/cuda_bn_kernels.py), which both sides call: on real gloo ranks against torch's own SyncBatchNorm function
(bit for bit) and against one float64 BatchNorm over the global batch; and in process, the partition that
replaces torch's mask. On a GPU, gpu_check's parity run (2 ranks sharing the GPU over gloo) trains with it."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import cuda_bn_kernels
from launch import WORKERS, explain, torchrun
from opencood_ddp.distributed.devices import SHARE_GPUS_VARIABLE
from opencood_ddp.distributed.device_sync_bn import DeviceSyncBatchNorm, convert_device_sync_batchnorm, \
    empty_ranks_last
from tests.test_host_syncs import META, HostReads, ValueShapedOps

C = 3


def _rows(counts, seed=0):
    """Gathered (ranks, 2C + 1) rows as torch's function builds them: (mean, invstd, count), zeros for an empty rank."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for count in counts:
        if count:
            rows.append(torch.cat([torch.randn(C, generator=gen) * 3 + 5, torch.rand(C, generator=gen) + 0.2,
                                   torch.tensor([float(count)])]))
        else:
            rows.append(torch.zeros(2 * C + 1))
    return torch.stack(rows)


def _combine(mean, invstd, count):
    running = torch.zeros(C), torch.ones(C)
    out = torch.batch_norm_gather_stats_with_counts(torch.empty(0, C), mean, invstd, *running, 0.1, 1e-5,
                                                    count.reshape(-1))
    return out + running


def _masked(rows):
    """torch's way: the rows of empty ranks dropped (a host wait on CUDA)."""
    keep = rows[:, -1] >= 1
    return rows[keep].split([C, C, 1], dim=1)


@pytest.fixture(scope="module", autouse=True)
def stand_in_kernels():
    with cuda_bn_kernels.registered():
        yield


def test_empty_ranks_go_last_in_rank_order_with_a_finite_invstd():
    rows = _rows([0, 7, 0, 4, 9])
    mean, invstd, count = empty_ranks_last(rows, C)
    assert count.reshape(-1).tolist() == [7.0, 4.0, 9.0, 0.0, 0.0]
    assert torch.equal(mean[:3], rows[[1, 3, 4], :C]) and torch.equal(invstd[:3], rows[[1, 3, 4], C:2 * C])
    assert torch.equal(invstd[3:], torch.ones(2, C)) and torch.equal(mean[3:], torch.zeros(2, C))
    unchanged = _rows([5, 6, 2])  # no empty rank: the rows as they came
    assert all(torch.equal(a, b) for a, b in zip(empty_ranks_last(unchanged, C), unchanged.split([C, C, 1], 1)))


@pytest.mark.parametrize("counts", [[0, 12, 8], [12, 0, 8], [12, 8, 0], [0, 0, 5], [7, 5, 3]])
def test_the_combine_of_the_partitioned_rows_is_the_masked_ones(counts):
    """The stand-in combine merges rows in order with an integer count, as CUDA's kernel; after the partition the
    merged statistics and running statistics equal torch's masked ones (here bit for bit: 20 * (1 / 20) rounds to
    1 in float32)."""
    rows = _rows(counts)
    ours, masked = _combine(*empty_ranks_last(rows, C)), _combine(*_masked(rows))
    assert all(torch.equal(a, b) for a, b in zip(ours, masked)), (ours, masked)


def test_a_leading_empty_rank_is_why_the_mask_exists():
    """Without the partition, a rank of count 0 merged first makes the statistics NaN (0 x inf), as on the GPU."""
    rows = _rows([0, 12, 8])
    mean, invstd, count = rows.split([C, C, 1], dim=1)
    assert all(torch.isnan(t).all() for t in _combine(mean, invstd, count)[:2])


def test_empty_ranks_after_a_count_whose_reciprocal_rounds_move_the_mean_by_a_rounding_each():
    """41 * (1 / 41) is not 1 in float32: each trailing empty row multiplies the merged mean by it, one rounding
    (at most 2 float32 epsilons relative, with the product's own) per empty rank; the variance is untouched."""
    empties = 2
    rows = _rows([41] + [0] * empties)
    ours, masked = _combine(*empty_ranks_last(rows, C)), _combine(*_masked(rows))
    for a, b in zip(ours, masked):
        assert ((a - b).abs() / b.abs()).max().item() <= 2 * empties * torch.finfo(torch.float32).eps, (a, b)
    assert not torch.equal(ours[0], masked[0])  # this case does move it
    assert torch.equal(ours[1], masked[1])


def test_the_partition_reads_nothing_back_from_the_device_and_torchs_mask_does():
    rows = _rows([0, 7, 4]).to(META)
    reads, ops = HostReads(), ValueShapedOps()
    with reads, ops:
        empty_ranks_last(rows, C)
    assert reads.seen == [] and ops.seen == []
    with pytest.raises(AssertionError, match="shaped by device values|reads a device tensor back"):
        with HostReads(), ValueShapedOps():
            _masked(rows)


def test_conversion_keeps_parameters_buffers_and_state_dict_keys():
    model = nn.Sequential(nn.Conv2d(2, C, 1), nn.BatchNorm2d(C), nn.Sequential(nn.BatchNorm1d(C)))
    before = dict(model.state_dict())
    weights = [m.weight for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    converted = convert_device_sync_batchnorm(model)
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in layers] == [DeviceSyncBatchNorm, DeviceSyncBatchNorm]
    assert all(isinstance(m, nn.SyncBatchNorm) for m in layers)  # what DDP and buffers_kept_equal look for
    assert [m.weight for m in layers] == weights
    assert converted.state_dict().keys() == before.keys()


def test_at_one_rank_and_in_eval_it_is_torchs_forward():
    layer = DeviceSyncBatchNorm(C)
    x = torch.randn(6, C, 2, 2)
    reference = nn.BatchNorm2d(C)
    assert torch.equal(layer(x), reference(x))  # no process group: plain batch norm
    layer.eval(), reference.eval()
    assert torch.equal(layer(x), reference(x))


COUNTS = ["3,5,2", "0,6,4", "6,4,0", "0,0,5"]  # uneven; the first, the last, two ranks without a value


def _three_ranks(tmp_path, device: str) -> dict:
    out = tmp_path / f"device_sync_bn_{device}.json"
    result = torchrun(3, WORKERS / "device_sync_bn_worker.py", "--counts", *COUNTS, "--out", out, "--device", device,
                      extra_env={SHARE_GPUS_VARIABLE: "1"})
    assert result.returncode == 0, explain(result)
    reports = json.loads(out.read_text())
    assert list(reports) == COUNTS
    return reports


def _assert_torchs_numbers_without_host_reads(reports: dict, compiled: bool) -> None:
    for counts, report in reports.items():
        assert report["equal_to_torch"] is True and report["finite"] is True, (counts, report)
        # compiled whole, collectives included (--capture on N GPUs keeps one graph), it is the eager layer, and
        # its running statistics' update is one the compiler sees
        expected = True if compiled else None
        assert report["compiled_equal"] is expected and report["declared_writes"] is expected, (counts, report)
        assert report["gap_to_float64"] < 1e-6, (counts, report)  # float32's rounding of the global batch norm
        for rank in report["host_reads"]:
            assert rank["ours"] == {}, (counts, rank)
            assert rank["torch"] == {"aten::index (boolean mask)": 9}, (counts, rank)  # 3 masks x 3 forwards


@pytest.mark.slow  # real processes
def test_on_three_ranks_it_is_torchs_syncbatchnorm_bit_for_bit_without_host_reads(tmp_path):
    _assert_torchs_numbers_without_host_reads(_three_ranks(tmp_path, "cpu"), compiled=True)


@pytest.mark.slow
@pytest.mark.cuda  # the kernels themselves
def test_on_three_ranks_sharing_a_gpu_with_cudas_kernels(tmp_path):
    """The same with CUDA's own kernels (gloo, the ranks sharing the GPU): what the stand-ins cannot show."""
    _assert_torchs_numbers_without_host_reads(_three_ranks(tmp_path, "cuda"), compiled=False)
