"""What the engine promises on the real-world data sets, on real processes: on the DAIR-V2X-C and V2V4Real layout
copies of the toy world, the toy AttFuse trained 2 steps on 2 ranks follows the 1-process run (tools/
parity_check.py), and the 2-step model evaluated with every --eval_preset gives the same result files on 1 process
and on 2 ranks. Late fusion and no fusion are evaluated against the same ground truth. What the readers themselves
guarantee (poses, labels, points, bad inputs) is proven in process: tests/test_source_dairv2x.py and
tests/test_source_v2v4real.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from launch import REPO, WORKERS, dairv2x_overrides, explain, in_process, python, torchrun, train, v2v4real_overrides
from shared_runs import completed_process, made_once, process_record
from opencood_ddp.tasks.eval_presets import PRESETS
from opencood_ddp.tasks.opencood import eval_file_name

pytestmark = pytest.mark.slow

TOY = REPO / "hypes_yaml" / "toy"
INFERENCE = REPO / "tools" / "inference_ddp.py"
PARITY = REPO / "tools" / "parity_check.py"
STEPS = 2
RUN_KEYS = ("world_size", "seconds", "checkpoint")  # what may differ between two evaluations of one model


def overrides(name: str, request) -> list:
    """The --set flags that read the data set's toy copy (session fixtures of conftest.py)."""
    if name == "dairv2x":
        return dairv2x_overrides(request.getfixturevalue("toy_dairv2x"))
    return v2v4real_overrides(request.getfixturevalue("toy_v2v4real"))


def evaluation_split(name: str, request) -> Path:
    if name == "dairv2x":
        return request.getfixturevalue("toy_dairv2x") / "test.json"
    return request.getfixturevalue("toy_v2v4real") / "test"


@pytest.fixture(scope="module", params=["dairv2x", "v2v4real"])
def parity_runs(request, tmp_path_factory):
    """tools/parity_check.py at world sizes 1 and 2, 2 steps of the toy AttFuse on the data set's copy, made once
    in the session (shared_runs.py); the tests read the runs and copy what they evaluate."""
    flags = overrides(request.param, request)

    def make(folder):
        return process_record(python(PARITY, "--hypes_yaml", TOY / "point_pillar_intermediate_fusion.yaml",
                                     "--world_sizes", "1,2", "--steps", str(STEPS), *flags, "--work_dir",
                                     folder / "runs", timeout=600))

    folder, record = made_once(tmp_path_factory, f"parity_{request.param}", make)
    return request.param, completed_process(record), folder / "runs"


def test_two_ranks_follow_one_process(parity_runs):
    name, result, work = parity_runs
    assert result.returncode == 0, explain(result)
    assert "PASS: every world size follows the 1-process run." in result.stdout, name
    log = (work / "world2" / "logs" / "rank0.log").read_text()
    assert "sync batch norm: GlooSyncBatchNorm" in log and "world size 2" in log


def read_results(run: Path, fusion_method: str = "") -> dict:
    return {preset: yaml.safe_load((run / eval_file_name(False, preset, fusion_method)).read_text())
            for preset in PRESETS}


def test_every_preset_gives_the_same_eval_files_on_1_process_and_2_ranks(parity_runs, request, tmp_path):
    name, result, work = parity_runs
    assert result.returncode == 0, explain(result)
    run = tmp_path / "run"
    shutil.copytree(work / "world2", run)
    # The 2-step model as the epoch checkpoint inference picks (upstream's net_epoch{N}.pth choice).
    shutil.copy(run / f"net_step{STEPS}.pth", run / "net_epoch1.pth")
    common = ("--model_dir", run, "--fusion_method", "intermediate", "--dataset_dir", evaluation_split(name, request),
              "--num_workers", "0")
    for preset in PRESETS:
        evaluated = in_process(INFERENCE, *common, "--eval_preset", preset)
        assert evaluated.returncode == 0, explain(evaluated)
    one = read_results(run)
    evaluated = torchrun(2, WORKERS / "eval_presets_worker.py", *common)
    assert evaluated.returncode == 0, explain(evaluated)
    two = read_results(run)
    for preset in PRESETS:
        assert (one[preset]["world_size"], two[preset]["world_size"]) == (1, 2)
        assert {k: v for k, v in one[preset].items() if k not in RUN_KEYS} == \
            {k: v for k, v in two[preset].items() if k not in RUN_KEYS}, (name, preset)
        assert one[preset]["eval_preset"] == preset and one[preset]["frames"] == 4


def test_no_fusion_is_the_egos_detections_against_late_fusions_ground_truth(toy_dairv2x, tmp_path):
    """DAIR-V2X-C's late fusion: each side trains on its own labels; late and no fusion evaluate the same model
    against the same sample ground truth (the vehicle's cooperative labels), no fusion with the vehicle's boxes
    alone, into files of their own."""
    run = tmp_path / "late"
    trained = train(0, "--hypes_yaml", TOY / "point_pillar_late_fusion.yaml", "--model_dir", run,
                    "--num_workers", "0", *dairv2x_overrides(toy_dairv2x), "--set", "train_params.epoches=1")
    assert trained.returncode == 0, explain(trained)
    gt = {}
    for method in ("late", "nofusion"):
        evaluated = in_process(INFERENCE, "--model_dir", run, "--fusion_method", method, "--num_workers", "0",
                               "--eval_preset", "heal", "--save_npy")
        assert evaluated.returncode == 0, explain(evaluated)
        gt[method] = [np.load(path) for path in sorted((run / "npy").glob("*_gt.npy"))]
    late, alone = (yaml.safe_load((run / eval_file_name(False, "heal", method)).read_text())
                   for method in ("late", "nofusion"))
    assert late["frames"] == alone["frames"] == len(gt["late"]) == len(gt["nofusion"]) == 4
    assert sum(len(frame) for frame in gt["late"]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(gt["late"], gt["nofusion"]))
    # What was sent: late fusion's road-side unit sends its boxes; with no fusion nothing is sent.
    assert "bytes_per_cav_frame" in late and "bytes_per_cav_frame" not in alone
