"""V2X-ViT's three-stage recipe at toy size, each stage a --model_dir and --set away from the one before (README):
train in the perfect setting; fine-tune with compression 32 from the perfect checkpoint; fine-tune in the noisy
setting (100 ms delay, pose error) with backbone_fix. A stage that changes the model section is a fine-tune: the
checkpoint's weights load (the compressor's new entries keep their initial values), the optimizer restarts, the
epoch count goes on, and the log says what changed and why that is allowed (--allow_config_change). The noisy
config (hypes_yaml/v2xset/point_pillar_v2xvit_noisy.yaml) is stage 3's."""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from launch import REPO, explain, in_process, split_set_flags, train
from opencood_ddp.models.communication import bytes_per_cav_frame
from zoo import hypes_of

pytestmark = pytest.mark.slow  # three trainings

TOY_V2XVIT = REPO / "hypes_yaml" / "toy" / "point_pillar_v2xvit.yaml"
NOISY = REPO / "hypes_yaml" / "v2xset" / "point_pillar_v2xvit_noisy.yaml"
INFERENCE = REPO / "tools" / "inference_ddp.py"
# What backbone_fix leaves trainable in V2X-ViT: the fusion transformer (upstream's backbone_fix()).
TRAINABLE_PREFIX = "fusion_net."


def next_stage(run, into, *sets: str):
    """Copy the run folder (keeping the stage before) and train it on with `sets` and --allow_config_change."""
    shutil.copytree(run, into)
    return train(0, "--model_dir", into, "--num_workers", "0", "--allow_config_change",
                 *[word for value in sets for word in ("--set", value)])


def weights(run, epoch: int) -> dict:
    return torch.load(run / f"net_epoch{epoch}.pth", weights_only=True)


def test_perfect_then_compression_32_then_noisy_with_backbone_fix(toy_small, tmp_path):
    perfect, compressed, noisy = tmp_path / "perfect", tmp_path / "c32", tmp_path / "noisy"
    first = train(0, "--hypes_yaml", TOY_V2XVIT, "--model_dir", perfect, "--num_workers", "0",
                  *split_set_flags(toy_small), "--set", "train_params.epoches=1",
                  "--set", "train_params.batch_size=4")
    assert first.returncode == 0, explain(first)

    second = next_stage(perfect, compressed, "model.args.compression=32", "train_params.epoches=2")
    assert second.returncode == 0, explain(second)
    assert "other hypes sections model than this run has now; resuming anyway (--allow_config_change)" \
        in second.stdout, explain(second)
    assert "fine-tuning from the weights of net_epoch1.pth" in second.stdout
    before, after = weights(perfect, 1), weights(compressed, 2)
    new = sorted(set(after) - set(before))
    assert new and all(".compressor." in name or "naive_compressor" in name for name in new), new
    assert f"({len(new)} new entries start from their initial values" in second.stdout
    assert yaml.safe_load((compressed / "config.yaml").read_text())["model"]["args"]["compression"] == 32

    stage3 = [f"wild_setting.{key}={value}" for key, value in
              yaml.safe_load(NOISY.read_text())["wild_setting"].items()]
    third = next_stage(compressed, noisy, *stage3, "model.args.backbone_fix=true", "train_params.epoches=3")
    assert third.returncode == 0, explain(third)
    assert "other hypes sections model, wild_setting than this run has now" in third.stdout, explain(third)
    start, end = weights(compressed, 2), weights(noisy, 3)
    params = {name for name, _ in _named_parameters(noisy)}
    frozen = [n for n in params if not n.startswith(TRAINABLE_PREFIX)]
    trained = [n for n in params if n.startswith(TRAINABLE_PREFIX)]
    assert frozen and all(torch.equal(start[n], end[n]) for n in frozen)
    assert any(not torch.equal(start[n], end[n]) for n in trained)
    # The noisy run's config.yaml (delay, pose error, compression 32, backbone_fix) evaluates, and its rates are
    # the compressed model's. That inference applies a run's noise is test_noise_sweep's (detections differ).
    evaluated = in_process(INFERENCE, "--model_dir", noisy, "--fusion_method", "intermediate",
                           "--dataset_dir", toy_small / "test", "--num_workers", "0")
    assert evaluated.returncode == 0, explain(evaluated)
    sent = yaml.safe_load((noisy / "eval.yaml").read_text())["bytes_per_cav_frame"]
    assert sent * 32 == bytes_per_cav_frame(hypes_of(perfect / "config.yaml"))  # the maps 32x compressed


def _named_parameters(run):
    """The parameter names (not buffers) of the run's model, built from its config.yaml."""
    from opencood_ddp.models import create_model

    return create_model(hypes_of(run / "config.yaml")).named_parameters()
