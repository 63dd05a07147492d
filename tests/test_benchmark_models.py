"""tools/benchmarks/benchmark_models.py --count --capture: the captured step's calls outside its graphs on the CUDA
path, beside the eager step's count (engine/census.py's ops_outside_graphs, tests/test_step_census.py), the fit loop's
guard included, as a run takes it."""
import json

import pytest

from launch import REPO, explain, python
from opencood_ddp.tasks import build_task
from zoo import hypes_of

CONFIG = "toy/point_pillar_early_fusion"


@pytest.mark.slow
def test_the_captured_steps_calls_outside_its_graphs_are_counted_on_the_cuda_path(toy_small, tmp_path):
    out = tmp_path / "rows.json"
    result = python(REPO / "tools" / "benchmarks" / "benchmark_models.py", "--configs", CONFIG, "--batch-sizes", "1",
                    "--repeats", "1", "--device", "cpu", "--data", toy_small, "--count", "--capture", "cudagraphs",
                    "--json", out, timeout=600)
    assert result.returncode == 0, explain(result)
    (row,) = json.loads(out.read_text())
    capture = row["capture"]
    by_name = capture["ops_outside_graphs_by_name"]
    assert capture["ops_outside_graphs"] == sum(by_name.values())
    # the optimizer built for CUDA, as the eager count's: fused Adam's two calls, no per-parameter update
    assert by_name["aten::_fused_adam_"] == 1 and by_name["aten::_foreach_add_"] == 1
    # the fit loop's guard (engine/step_guard.py): the buffers' undo copy, float statistics and int64 counters in
    # one foreach copy each, and the gradients' norm
    assert by_name["aten::_foreach_copy_"] == 2 and by_name["aten::_foreach_norm"] == 1
    # detach: AccumulateGrad's of each parameter's fresh gradient, and the guard's of each loss value and of the norm
    # it reads to the host
    task = build_task(hypes_of(CONFIG, toy_root=toy_small), for_training=True)
    loss_values = 1 + len(task.step(task.model.train(), task.collate_train([task.train_set[0]])).parts)
    assert by_name["aten::detach"] == len(list(task.model.parameters())) + loss_values + 1
    assert capture["ops_outside_graphs"] < row["ops"] / 2  # the dense part's calls ran inside the graphs
    assert f"| {capture['ops_outside_graphs']:,} |" in result.stdout
    assert "the captured step's calls outside its graphs" in result.stdout
