"""Real multi-process checks (torchrun, gloo on loopback) of comm helpers, SyncBN and all-reduced validation."""
import json

import pytest

from launch import REPO, WORKERS, explain, torchrun

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` does not

SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"


@pytest.mark.parametrize("group", ["default", "separate"])
def test_comm_helpers_on_three_ranks(tmp_path, group):
    """On the default gloo group, and on a gloo group of their own: the control plane's group under NCCL."""
    out = tmp_path / "comm.json"
    flags = ["--separate_control_group"] if group == "separate" else []
    result = torchrun(3, WORKERS / "comm_worker.py", "--out", out, *flags)
    assert result.returncode == 0, explain(result)
    seen = json.loads(out.read_text())
    assert [s["rank"] for s in seen] == [0, 1, 2]
    for s in seen:
        assert s["world_size"] == 3
        assert s["sum"] == [0.5 + 1.5 + 2.5, 3.0]
        assert s["broadcast"] == {"from": 0, "payload": [1, 2, 3]}
        assert s["on_main"] == "made by rank 0"
        # rank 0's failure reaches every rank as the same exception, instead of a hang
        assert s["on_main_error"] == "rank 0 could not create the run folder"
        assert s["agree"] == ["frame of rank 1", [1.0, 3.0]]
        assert s["agree_none"] == [None, [6.0]]


@pytest.mark.parametrize("counts", ["4,4", "1,6,2", "0,5,3"], ids=["even", "uneven", "empty-rank"])
def test_gloo_sync_batchnorm_equals_global_batchnorm(tmp_path, counts):
    out = tmp_path / "syncbn.json"
    result = torchrun(len(counts.split(",")), WORKERS / "sync_bn_worker.py", "--counts", counts, "--out", out)
    assert result.returncode == 0, explain(result)
    worst = json.loads(out.read_text())
    assert set(worst) == {"bn2d", "bn1d_nc", "bn1d_ncl", "bn2d_cumulative", "bn2d_channels_last"}
    for case, diffs in worst.items():
        assert diffs["num_batches_tracked"] == 0, case
        for key in ("output", "input_grad", "param_grad", "running_mean", "running_var"):
            # Against float64: 3 float32 ulps at the running mean's magnitude (10). Native per-rank moments of
            # the channels-last case were 8.2e-6 off in the outputs.
            assert diffs[key] <= 3e-6, (case, key, diffs[key])


@pytest.fixture(scope="module")
def fixed_checkpoint(synthetic_runs):
    return synthetic_runs(1) / "net_epoch2.pth"


def test_validation_loss_is_identical_on_1_2_3_ranks(tmp_path, fixed_checkpoint):
    """37 validation samples: not divisible by 2 or 3, so shards are uneven (13, 12, 12)."""
    results = {}
    for world in (1, 2, 3):
        out = tmp_path / f"val{world}.json"
        result = torchrun(world, WORKERS / "validate_worker.py", "--hypes", SYNTHETIC, "--weights",
                          fixed_checkpoint, "--out", out)
        assert result.returncode == 0, explain(result)
        results[world] = json.loads(out.read_text())
    assert [results[w]["per_rank"] for w in (1, 2, 3)] == [6, 3, 2]  # different batch compositions
    for world in (2, 3):
        for key in ("loss", "l1"):
            assert results[world][key] == pytest.approx(results[1][key], rel=1e-6, abs=0), (world, key)
