"""tools/benchmarks/count_loop_ops.py: the step the benchmarks count and time (engine/census.trainer_step) is the fit
loop's step, but for the control plane's few host calls. Until 2026-12-01 the loop also cloned every buffer of the
model each step (its undo copy), which no benchmark counted: 60 more calls in toy AttFuse, a kernel launch per buffer
on a GPU. A call per parameter or buffer in the difference fails here."""
import json

import pytest

from launch import REPO, explain, python, toy_overrides
from opencood_ddp.tasks import build_task
from zoo import hypes_of

TOOL = REPO / "tools" / "benchmarks" / "count_loop_ops.py"
CONFIG = "toy/point_pillar_intermediate_fusion"


@pytest.mark.slow
def test_the_benchmarks_step_is_the_fit_loops_but_for_the_control_plane(toy_small, tmp_path):
    out = tmp_path / "counts.json"
    sets = [word for override in toy_overrides(toy_small) for word in ("--set", override)]
    result = python(TOOL, "--hypes_yaml", REPO / "hypes_yaml" / f"{CONFIG}.yaml", "--num_workers", "0",
                    "--per_gpu_batch", "2", *sets, "--json", out, timeout=300)
    assert result.returncode == 0, explain(result)
    counts = json.loads(out.read_text())
    assert counts["micro_batches"] == 1 and counts["benchmarked"] > 1000
    difference = counts["loop_only_by_op"]
    assert counts["loop"] - counts["benchmarked"] == sum(difference.values())
    model = build_task(hypes_of(CONFIG, toy_root=toy_small), for_training=True).model
    per_model = min(len(list(model.parameters())), len(list(model.buffers())))
    # the loss all-reduce's host tensor and its reads (.item()), a copy for the collective, the batch's move
    assert 0 <= sum(difference.values()) < per_model and all(abs(n) < per_model for n in difference.values())
    assert not {"aten::_foreach_copy_", "aten::_foreach_norm"} & set(difference), difference  # the guard: both
    assert f"| {counts['loop']:,} |" in result.stdout
