"""tools/gpu_check.py on the CPU (`--device cpu`), as `make test` runs it, so that the GPU check cannot rot.

On the CPU the same path runs with gloo, GlooSyncBatchNorm and bf16; one model runs at its toy size (the full-size
opv2v baselines take minutes per step on 2 cores; on a GPU `make gpu-check` runs them)."""
import json

import pytest
import torch

from launch import REPO, explain, python

pytestmark = pytest.mark.slow

# One config: every line of the tool's baseline check runs for each config alike, so a second one adds time and no
# line. Training and evaluation of each fusion kind on several ranks are tests/test_opencood_training.py's.
TOY_MODELS = ["toy/point_pillar_intermediate_fusion"]


def test_gpu_check_on_the_cpu_passes_and_reports(toy_small, tmp_path):
    out = tmp_path / "report"
    result = python(REPO / "tools" / "gpu_check.py", "--device", "cpu", "--out", out, "--data", toy_small,
                    "--configs", *TOY_MODELS, timeout=1200)
    assert result.returncode == 0, explain(result)
    report = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert {"process_group", "sync_batchnorm", "half", "voxelizer"} <= set(checks)
    assert all(c["status"] == "ok" for c in checks.values()), checks
    for model in TOY_MODELS:
        assert checks[f"train+eval {model}"]["figures"]["eval"]["frames"] == 4
        rows = checks[f"memory {model}"]["figures"]["per_gpu_batch"]
        assert set(rows) == {"1", "2"} and all(r["peak_mib"] > 0 and r["samples_per_s"] > 0 for r in rows.values())
    assert report["environment"]["device"] == "cpu"
    table = (out / "gpu_check.md").read_text()
    assert "| sync_batchnorm | ok |" in table and "GlooSyncBatchNorm" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: make gpu-check runs there")
def test_gpu_check_on_cuda_without_a_gpu_says_so(tmp_path):
    result = python(REPO / "tools" / "gpu_check.py", "--device", "cuda", "--out", tmp_path, timeout=300)
    assert result.returncode != 0
    assert "torch sees no CUDA device" in result.stderr and "--device cpu" in result.stderr, explain(result)
