"""The perception task end to end on the small toy world: real training runs and distributed evaluation.

Each fusion method trains with tools/train_ddp.py (the same processes users start) and its loss falls; the
intermediate (AttFuse) run uses 2 ranks and bf16 autocast (--half on CPU); the F-Cooper run evaluates itself
(--eval_after_training). Evaluation with tools/inference_ddp.py gives the same eval.yaml and --save_npy files
on 1, 2 and 3 ranks (4 test frames: 3 does not divide them), the same AP with
--batch_size 1 and more, and one picture per frame with --save_vis.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

import pytest
import torch
import yaml

from launch import REPO, explain, in_process, split_set_flags, torchrun, train
from opencood_ddp.vis.export import read_manifest

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` does not

INFERENCE = REPO / "tools" / "inference_ddp.py"
EPOCHS = 4


@pytest.fixture(scope="module")
def toy_runs(toy_small, tmp_path_factory):
    """toy_runs(config, world, *flags) -> run folder, trained once per distinct call."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("toy_runs")

    def get(config: str, world: int, *flags: str) -> Path:
        key = (config, world, flags)
        if key not in cache:
            run_dir = root / f"{config}_w{world}_{len(cache)}"
            # One sample per step on one process: 8 steps per epoch on the 8 training frames.
            batch = "1" if world == 0 else str(world)
            result = train(world, "--hypes_yaml", REPO / "hypes_yaml" / "toy" / f"{config}.yaml",
                           "--model_dir", run_dir, "--num_workers", "0", "--set", f"train_params.batch_size={batch}",
                           "--set", f"train_params.epoches={EPOCHS}", *split_set_flags(toy_small), *flags,
                           timeout=600)
            assert result.returncode == 0, explain(result)
            cache[key] = run_dir
        return cache[key]

    return get


def history(run_dir: Path) -> list[dict]:
    state = torch.load(run_dir / f"training_state_epoch{EPOCHS}.pt", map_location="cpu", weights_only=False)
    return state["history"]


@pytest.mark.parametrize("config, world, flags", [
    ("point_pillar_early_fusion", 0, ()),
    ("point_pillar_late_fusion", 0, ()),
    ("point_pillar_intermediate_fusion", 2, ("--half",)),
    ("point_pillar_fcooper", 0, ("--eval_after_training",)),
])
def test_toy_training_loss_falls(toy_runs, config, world, flags):
    epochs = history(toy_runs(config, world, *flags))
    assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
    train_losses = [e["train"]["loss"] for e in epochs]
    assert all(math.isfinite(v) for v in train_losses)
    # With 8 frames an epoch is a handful of steps, so single epochs are noisy: compare the last epoch with the
    # first, with a margin that a model which does not learn (or learns the wrong thing) does not reach.
    assert train_losses[-1] < 0.8 * train_losses[0], train_losses
    assert epochs[-1]["train"]["cls"] < epochs[0]["train"]["cls"]
    assert all(math.isfinite(e["val"]["loss"]) for e in epochs)


def evaluate(run_dir: Path, world: int, fusion: str, toy_root: Path, *flags: str) -> dict:
    args = ("--model_dir", run_dir, "--fusion_method", fusion, "--dataset_dir", toy_root / "test",
            "--num_workers", "0", *flags)
    result = in_process(INFERENCE, *args) if world == 0 else torchrun(world, INFERENCE, *args)
    assert result.returncode == 0, explain(result)
    name = "eval_global_sort.yaml" if "--global_sort_detections" in flags else "eval.yaml"
    return yaml.safe_load((run_dir / name).read_text())


@pytest.mark.parametrize("config, fusion", [("point_pillar_intermediate_fusion", "intermediate"),
                                            ("point_pillar_late_fusion", "late")])
def test_eval_yaml_and_npy_files_identical_on_1_2_3_ranks(toy_runs, toy_small, tmp_path, config, fusion):
    """The metrics and every per-frame --save_npy file, whichever rank evaluated the frame."""
    run_dir = toy_runs(config, 2, "--half") if fusion == "intermediate" else toy_runs(config, 0)
    results, written = {}, {}
    for world in (0, 2, 3):
        copy = copy_run(run_dir, tmp_path / f"w{world}")
        results[world] = evaluate(copy, world, fusion, toy_small, "--save_npy")
        written[world] = {path.name: np.load(path) for path in sorted((copy / "npy").glob("*.npy"))}
        test = toy_small / "test"
        assert read_manifest(copy / "npy") == {
            "split": str(test.resolve()), "scenarios": sorted(p.name for p in test.iterdir() if p.is_dir()),
            "fusion_method": fusion, "eval_preset": "opencood", "frames": 4}
        assert not list(copy.glob("npy.*"))  # published whole: no staging or replaced folder left
    run_keys = ("world_size", "seconds")
    metrics = {world: {k: v for k, v in r.items() if k not in run_keys} for world, r in results.items()}
    assert metrics[0] == metrics[2] == metrics[3]
    assert metrics[0]["frames"] == 4
    # What was evaluated comes first: the split resolved (--dataset_dir here) and the fusion method.
    assert list(metrics[0])[:2] == ["dataset_dir", "fusion_method"]
    assert (metrics[0]["dataset_dir"], metrics[0]["fusion_method"]) == (str((toy_small / "test").resolve()), fusion)
    assert [results[w]["world_size"] for w in (0, 2, 3)] == [1, 2, 3]
    for key in ("ap30", "ap_50", "ap_70", "mpre_50", "mrec_50", "mpre_70", "mrec_70"):
        assert key in metrics[0]
    names = [f"{index:04d}_{kind}.npy" for index in range(4) for kind in ("gt", "pcd", "pred")]
    assert sorted(written[0]) == sorted(written[2]) == sorted(written[3]) == names
    for name in names:
        assert np.array_equal(written[0][name], written[2][name]), name
        assert np.array_equal(written[0][name], written[3][name]), name
    assert all(written[0][f"{i:04d}_pcd.npy"].shape[1] == 4 for i in range(4))
    assert all(written[0][f"{i:04d}_gt.npy"].shape[1:] == (8, 3) for i in range(4))


def test_inference_refuses_a_fusion_method_the_run_was_not_trained_for(toy_runs, toy_small):
    run_dir = toy_runs("point_pillar_late_fusion", 0)
    result = in_process(INFERENCE, "--model_dir", run_dir, "--fusion_method", "intermediate",
                    "--dataset_dir", toy_small / "test", "--num_workers", "0")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--fusion_method intermediate needs fusion.core_method" in lines[0]


def test_inference_missing_epoch_names_the_epochs_on_disk(toy_runs, toy_small):
    run_dir = toy_runs("point_pillar_late_fusion", 0)
    result = in_process(INFERENCE, "--model_dir", run_dir, "--fusion_method", "late", "--epoch", "99",
                    "--num_workers", "0")
    assert result.returncode == 2
    assert f"no net_epoch99.pth (epochs on disk: {list(range(1, EPOCHS + 1))})" in result.stderr


def test_eval_after_training_evaluates_the_last_checkpoint_on_the_test_split(toy_runs):
    run_dir = toy_runs("point_pillar_fcooper", 0, "--eval_after_training")
    result = yaml.safe_load((run_dir / "eval.yaml").read_text())
    assert result["checkpoint"] == f"net_epoch{EPOCHS}.pth"
    assert result["frames"] == 4 and result["world_size"] == 1  # the 4 frames of test_dir, not validate_dir
    hypes = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert result["dataset_dir"] == str(Path(hypes["test_dir"]).resolve())
    assert all(key in result for key in ("ap30", "ap_50", "ap_70"))


def test_eval_after_training_fails_before_training_without_a_test_split(toy_small, tmp_path):
    run_dir = tmp_path / "run"
    result = train(0, "--hypes_yaml", REPO / "hypes_yaml" / "toy" / "point_pillar_late_fusion.yaml",
                   "--model_dir", run_dir, "--num_workers", "0", *split_set_flags(toy_small),
                   "--set", f"test_dir={tmp_path / 'missing'}", "--eval_after_training")
    assert result.returncode == 2, explain(result)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(tmp_path / "missing") in lines[0]
    assert not list(run_dir.glob("net_epoch*.pth"))  # nothing trained


def test_eval_after_training_of_a_resume_with_nothing_left_evaluates_the_checkpoint_it_resumed_from(toy_small,
                                                                                                  tmp_path):
    """A run stopped at --max_steps 2, started again with the same --max_steps and --eval_after_training: no step
    is left, nothing is saved, and the evaluation named net_epoch16.pth, a file no run wrote ("check --model_dir /
    --epoch", flags train_ddp does not have). It evaluates the run's newest weights, the step it resumed from, and
    keeps config.yaml as those weights were trained, though a --set came with it."""
    run_dir = tmp_path / "run"
    common = ("--hypes_yaml", REPO / "hypes_yaml" / "toy" / "point_pillar_late_fusion.yaml", "--model_dir", run_dir,
              "--num_workers", "0", "--max_steps", "2", *split_set_flags(toy_small))
    assert train(0, *common).returncode == 0
    trained_config = (run_dir / "config.yaml").read_bytes()
    # a --set that trains nothing leaves config.yaml as the saved steps were trained
    result = train(0, *common, "--eval_after_training", "--set", "train_params.save_freq=7")
    assert result.returncode == 0, explain(result)
    assert "nothing to do: the run is at step 2, --max_steps 2; pass a higher --max_steps" in result.stdout
    assert "config.yaml kept as it was: this call has nothing left to train" in result.stdout
    assert (run_dir / "config.yaml").read_bytes() == trained_config
    assert yaml.safe_load((run_dir / "eval.yaml").read_text())["checkpoint"] == "net_step2.pth"


def copy_run(run_dir: Path, into: Path) -> Path:
    """The run's config and last checkpoint in a fresh folder, so that two evaluations write apart."""
    into.mkdir()
    shutil.copy(run_dir / "config.yaml", into)
    shutil.copy(run_dir / f"net_epoch{EPOCHS}.pth", into)
    return into


def test_save_vis_and_pr_plot_write_pictures(toy_runs, toy_small, tmp_path):
    import matplotlib.image

    copy = copy_run(toy_runs("point_pillar_late_fusion", 0), tmp_path / "run")
    evaluate(copy, 2, "late", toy_small, "--save_vis", "--pr_plot")
    pictures = sorted((copy / "vis").glob("*.png"))
    assert [p.name for p in pictures] == [f"bev_{index:05d}.png" for index in range(4)]
    assert sorted(p.name for p in (copy / "vis").iterdir()) == [p.name for p in pictures] + ["evaluation.yaml"]
    for path in pictures + [copy / "pr_curve.png"]:
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300
        assert image[..., :3].std() > 0.01  # not a blank canvas


@pytest.mark.parametrize("config, fusion, world, batch", [
    ("point_pillar_intermediate_fusion", "intermediate", 2, "2"),  # one batch of 2 per rank
    ("point_pillar_early_fusion", "early", 0, "3"),  # batches of 3 and 1
])
def test_batch_size_gives_the_same_ap(toy_runs, toy_small, tmp_path, config, fusion, world, batch):
    run_dir = toy_runs(config, 2, "--half") if fusion == "intermediate" else toy_runs(config, 0)
    single = evaluate(copy_run(run_dir, tmp_path / "single"), 0, fusion, toy_small)
    batched = evaluate(copy_run(run_dir, tmp_path / "batched"), world, fusion, toy_small, "--batch_size", batch)
    for key in ("ap30", "ap_50", "ap_70"):
        assert batched[key] == pytest.approx(single[key], abs=1e-6), key
    assert batched["frames"] == single["frames"] == 4


def test_late_fusion_refuses_batches_of_several_frames(toy_runs, toy_small):
    result = in_process(INFERENCE, "--model_dir", toy_runs("point_pillar_late_fusion", 0), "--fusion_method", "late",
                    "--dataset_dir", toy_small / "test", "--num_workers", "0", "--batch_size", "2")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "late fusion evaluates one frame per batch" in lines[0]


def test_recall_by_visibility_counts_every_gt_object_once(toy_runs, toy_small, tmp_path):
    copy = copy_run(toy_runs("point_pillar_late_fusion", 0), tmp_path / "late")
    evaluate(copy, 0, "late", toy_small, "--save_npy")
    result = in_process(REPO / "tools" / "analysis" / "recall_by_visibility.py", "--dataset_dir", toy_small / "test",
                    "--runs", copy)
    assert result.returncode == 0, explain(result)
    row = next(line for line in result.stdout.splitlines() if line.startswith("| late |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
    objects = sum(int(cell.split("/")[1].rstrip(")")) for cell in cells if cell != "-")
    assert objects == sum(len(np.load(copy / "npy" / f"{i:04d}_gt.npy")) for i in range(4))

    missing = in_process(REPO / "tools" / "analysis" / "recall_by_visibility.py", "--dataset_dir", toy_small / "test",
                         "--runs", tmp_path)
    assert missing.returncode == 2 and "--save_npy" in missing.stderr


def test_attention_by_visibility_reads_an_attfuse_run(toy_runs, toy_small):
    script = REPO / "tools" / "analysis" / "attention_by_visibility.py"
    result = in_process(script, "--model_dir", toy_runs("point_pillar_intermediate_fusion", 2, "--half"),
                        "--dataset_dir", toy_small / "test")
    assert result.returncode == 0, explain(result)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in result.stdout.splitlines()
            if line.startswith("| ") and "objects" not in line]
    assert [name for name, _, _ in rows] == ["ego sees it", "only others see it", "barely seen"], result.stdout
    assert sum(int(count) for _, count, _ in rows) > 0 and "4 frames of" in result.stdout, result.stdout
    for _, count, share in rows:  # a share where a category has objects, "-" where it has none
        assert (share == "-") == (int(count) == 0) and (share == "-" or 0.0 <= float(share) <= 1.0), rows
    late = in_process(script, "--model_dir", toy_runs("point_pillar_late_fusion", 0),
                      "--dataset_dir", toy_small / "test")
    assert late.returncode == 2 and "reads AttFuse" in late.stderr
