"""tools/benchmarks/benchmark_models.py --count --capture: the captured step's calls outside its graphs on the CUDA
path, beside the eager step's count (engine/census.py's ops_outside_graphs, tests/test_step_census.py), the fit loop's
guard included, as a run takes it."""
import json

import pytest

from launch import REPO, explain, load_tool, python
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
    # the optimizer built for CUDA, as the eager count's: fused Adam's two calls (the update, and the step counts'
    # foreach add), no per-parameter update; the other foreach add is the batch count of the front's batch norm
    # (numerics/batch_counts.py), which runs eagerly
    assert by_name["aten::_fused_adam_"] == 1 and by_name["aten::_foreach_add_"] == 2
    assert "aten::add_" not in by_name
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


def test_a_profiled_rows_cells_fit_the_header_and_name_the_hosts_longest_ops(capsys):
    """--profile runs on a GPU only, whose minutes are few: its table (the GPU's busy share, the host's waits, eager
    and captured) and its two lists (the GPU's longest kernels, the host's longest ops) are formatted here from a
    row of the shape gpu_activity returns, so that a lent GPU's run does not end in a formatting error."""
    import argparse

    tool = load_tool("benchmarks/benchmark_models.py")
    gpu = {"kernels": 686, "busy_s": 9.05e-3, "busy_share": 0.56, "by_name": [["void cudnn_kernel", 19, 4e-3]],
           "host_waits": 2, "host_wait_s": 0.5e-3,
           "host_by_name": [["cudaLaunchKernel", 686, 3e-3], ["aten::cudnn_convolution", 19, 1e-3]]}
    row = {"config": "opv2v/point_pillar_intermediate_fusion", "grid": "704 x 200", "parameters": 6.58e6,
           "batch_size": 1, "step_s": 16.1e-3, "per_sample_s": 16.1e-3, "peak_mib": 2100.0, "precision": "fp16",
           "gpu": gpu, "capture": {"step_s": 10.9e-3, "speedup": 1.48, "compile_s": 4.2, "first_loss_gap": 4.5e-6,
                                   "cudagraph_skips": 0, "gpu": dict(gpu, busy_share=0.83)}}
    args = argparse.Namespace(device="cuda", count=False, upstream=None, profile=True, capture="cudagraphs")
    header = tool.header(args).splitlines()[0]
    line = tool.format_row(row, args)
    assert line.count("|") == header.count("|")
    assert "| 2 (0.50) |" in line and line.endswith("| 0.83 | 2 (0.50) |")  # eager's waits, then the captured's
    failed = dict(row, capture=dict(row["capture"], gpu={"error": "the profiler could not follow the graphs"}))
    assert tool.format_row(failed, args).count("|") == header.count("|")
    tool.print_top_host_ops([row])
    printed = capsys.readouterr().out
    assert "| 1 | fp16 | cudaLaunchKernel (686, 3.00); aten::cudnn_convolution (19, 1.00) |" in printed
