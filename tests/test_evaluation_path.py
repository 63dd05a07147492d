"""The evaluation a newcomer reads: from tools/inference_ddp.py to the metric in three files of the library, the
task's flags from its registry, and the one reading of a run folder (config.yaml and the checkpoint) that
inference, tools/export_upstream.py and tools/analysis/ share."""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import yaml

from launch import REPO, in_process
from zoo import hypes_of
from opencood_ddp import hypes as hypes_lib
from opencood_ddp.engine.inference import choose_checkpoint, load_run, task_options_of_run
from opencood_ddp.errors import CheckpointError
from opencood_ddp.metrics import summary as summary_module
from opencood_ddp.models import create_model
from opencood_ddp.tasks import eval_options
from opencood_ddp.tasks.opencood import DetectionEvalOptions

INFERENCE = REPO / "tools" / "inference_ddp.py"
INTERMEDIATE = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"


def make_run(folder: Path, toy_root: Path) -> Path:
    """A run folder as training leaves it, without the training: config.yaml and net_epoch1.pth."""
    hypes = hypes_of(INTERMEDIATE, f"root_dir={toy_root / 'train'}", f"validate_dir={toy_root / 'validate'}")
    folder.mkdir(parents=True)
    hypes_lib.save_hypes(hypes, folder / "config.yaml")
    torch.manual_seed(0)
    torch.save(create_model(hypes).state_dict(), folder / "net_epoch1.pth")
    return folder


def test_the_reading_path_to_the_metric_is_six_frames_in_three_files(toy_small, tmp_path, monkeypatch):
    """From tools/inference_ddp.py to the AP: the tool, engine/inference.py's main, run_eval and
    evaluate_checkpoint, engine/evaluator.py's evaluate, and the metric's own call (metrics/summary.py), seen from
    a real evaluation through the tool's own entry. The evaluator calls the metric itself: no frame of tasks/."""
    run = make_run(tmp_path / "run", toy_small)
    seen = []
    compute_ap = summary_module.eval_summary

    def record(*args, **kwargs):
        seen.append(traceback.extract_stack()[:-1])  # the stack as the metric's call to eval_summary sees it
        return compute_ap(*args, **kwargs)

    monkeypatch.setattr(summary_module, "eval_summary", record)
    result = in_process(INFERENCE, "--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir",
                        toy_small / "test", "--num_workers", "0")
    assert result.returncode == 0, result.stderr
    assert "ap_50" in yaml.safe_load((run / "eval.yaml").read_text())
    stack = seen[0]
    start = next(i for i, frame in enumerate(stack) if frame.filename.endswith("tools/inference_ddp.py"))
    end = max(i for i, frame in enumerate(stack) if "/opencood_ddp/" in frame.filename)
    path = stack[start:end + 1]
    assert [(Path(frame.filename).name, frame.name) for frame in path] == [
        ("inference_ddp.py", "<module>"), ("inference.py", "main"), ("inference.py", "run_eval"),
        ("inference.py", "evaluate_checkpoint"), ("evaluator.py", "evaluate"), ("summary.py", "__call__")]
    library = {frame.filename.split("/opencood_ddp/", 1)[1] for frame in path if "/opencood_ddp/" in frame.filename}
    assert library == {"engine/inference.py", "engine/evaluator.py", "metrics/summary.py"}


def test_the_task_registry_gives_the_evaluation_flags_of_the_runs_task(tmp_path):
    assert eval_options({}) is DetectionEvalOptions and eval_options({"task": "opencood"}) is DetectionEvalOptions
    assert eval_options({"task": "synthetic"}) is None  # a task without evaluation flags of its own
    synthetic = tmp_path / "synthetic_run"
    synthetic.mkdir()
    hypes_lib.save_hypes({"task": "synthetic"}, synthetic / "config.yaml")
    assert task_options_of_run(["--model_dir", str(synthetic)], eval_options) is None
    # No config.yaml to read: the default task's flags, so that the user's error is told once the run is read.
    assert task_options_of_run(["--model_dir", str(tmp_path / "missing")], eval_options) is DetectionEvalOptions
    assert task_options_of_run([], eval_options) is DetectionEvalOptions


def test_one_reading_of_a_run_picks_epoch_bestval_and_step_checkpoints(toy_small, tmp_path):
    run = make_run(tmp_path / "run", toy_small)
    for name in ("net_epoch3.pth", "net_epoch_bestval_at2.pth", "net_step5.pth"):
        (run / name).write_bytes(b"")
    read = load_run(run)
    assert read.checkpoint == run / "net_epoch3.pth"
    assert read.hypes["model"]["core_method"] == "point_pillar_intermediate"
    assert load_run(run, bestval=True).checkpoint.name == "net_epoch_bestval_at2.pth"
    assert load_run(run, epoch=1).checkpoint.name == "net_epoch1.pth"
    assert load_run(run, step=5).checkpoint.name == "net_step5.pth"
    with pytest.raises(CheckpointError, match=r"no net_step4.pth \(steps on disk: \[5\]\); pass one of them to --step"):
        choose_checkpoint(run, step=4)


def test_a_run_of_step_checkpoints_only_is_sent_where_it_can_go_on(toy_small, tmp_path):
    """Evaluation has no --step: the line names training, which goes on from the step; a tool with --step (export)
    also names its flag. It named export_upstream before, which refuses every toy and several zoo configs."""
    run = make_run(tmp_path / "run", toy_small)
    (run / "net_epoch1.pth").rename(run / "net_step5.pth")
    with pytest.raises(CheckpointError) as info:
        choose_checkpoint(run)
    assert str(info.value) == (f"{run}: no net_epoch*.pth checkpoint (steps on disk: [5]); train on to the epoch's "
                               f"end (tools/train_ddp.py --model_dir {run} goes on from net_step5.pth), or pass "
                               f"another --model_dir")
    with pytest.raises(CheckpointError, match=r"net_step5.pth\), pass --step K for a step, or pass another"):
        choose_checkpoint(run, step_flag="--step")


def test_a_key_nobody_reads_in_the_runs_config_is_said_once_and_the_run_is_evaluated(toy_small, tmp_path, caplog):
    """A hand edit of config.yaml (`gt_range` misspelt) moved AP without a word: evaluation reads the run's own
    config and does not refuse it (a fork's run or an older version may carry keys we do not read), but it says
    which keys nothing reads, with the nearest known one, once a process however many evaluations it builds."""
    import logging

    from opencood_ddp.engine.evaluator import EvalRequest
    from opencood_ddp.tasks.opencood import build_eval

    run = make_run(tmp_path / "run", toy_small)
    hypes = load_run(run).hypes
    hypes["postprocess"]["gt_rnge"] = hypes["postprocess"].pop("gt_range", [-140, -40, -3, 140, 40, 1])
    request = EvalRequest(run_dir=str(run), task_options=DetectionEvalOptions(fusion_method="intermediate"))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            build_eval(hypes, request)
    said = [record.getMessage() for record in caplog.records if "nothing reads" in record.getMessage()]
    assert len(said) == 1 and "postprocess.gt_rnge (did you mean postprocess.gt_range?)" in said[0], said
