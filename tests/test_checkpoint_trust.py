"""Checkpoints are data, never code: every load goes through torch's safe unpickler, the files we write need
nothing more, and the files others write (upstream's and HEAL's bare state_dicts, a fork's `{'model': ...}`, our
own sidecars of format 1, torch's pre-1.6 format) still load. Also: RNG state per device, weights on the CPU.

Planted files are made as an attacker makes them: an object whose `__reduce__` returns `os.system` with a command,
pickled by torch.save. The command would create a marker file; every refusal is checked to leave it absent."""
from __future__ import annotations

import io
import os
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.engine.checkpointer import RunCheckpointer
from opencood_ddp.errors import CheckpointError


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(2, 4, 3), bn=nn.BatchNorm2d(4), head=nn.Linear(4, 3)))


class Payload:
    """What a malicious .pth carries: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: Path, content) -> Path:
    torch.save(content, path)
    return path


def test_a_payload_in_weights_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    path = plant(tmp_path / "net_epoch1.pth", dict(_net().state_dict(), extra=Payload(marker)))
    with pytest.raises(ckpt.UnsafeCheckpointError) as info:
        ckpt.load_weights(_net(), path)
    text = str(info.value)
    assert str(path) in text and "posix.system" in text and "refused unread" in text
    assert "tools/convert_checkpoint.py --trust" in text and "\n" not in text
    assert not marker.exists()


def test_a_payload_in_a_sidecar_stops_the_resume_instead_of_falling_back(tmp_path):
    """A planted file is not a damaged one: resume does not pass over it to an older checkpoint as it does for a
    truncated file, it stops with the refusal, and the files on disk are left as they were."""
    marker = tmp_path / "ran"
    ckpt.save_epoch(tmp_path, 1, _net(), {"global_step": 1, "rng": [ckpt.rng_state()]})
    ckpt.save_epoch(tmp_path, 2, _net(), {"global_step": 2, "rng": [ckpt.rng_state()]})
    plant(tmp_path / ckpt.state_name(2), {"format": 2, "rng": Payload(marker)})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ckpt.UnsafeCheckpointError, match="training_state_epoch2.pt holds posix.system"):
        RunCheckpointer(tmp_path, is_main=True).resume(_net(), steps_per_epoch=1)
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_what_we_write_loads_with_the_plain_safe_unpickler(tmp_path):
    """No allowlist: torch.load(weights_only=True) as anyone would call it reads our weights and sidecar."""
    optimizer = torch.optim.Adam(_net().parameters())
    state = {"optimizer": optimizer.state_dict(), "rng": [ckpt.rng_state(), ckpt.rng_state()], "global_step": 3,
             "lr_scheduler": torch.optim.lr_scheduler.MultiStepLR(optimizer, [2, 4]).state_dict()}
    path = ckpt.save_epoch(tmp_path, 1, _net(), state)
    torch.load(path, weights_only=True)
    loaded = torch.load(tmp_path / ckpt.state_name(1), weights_only=True)
    assert loaded["format"] == ckpt.STATE_FORMAT == 2


def _draws():
    return torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)], np.random.normal(size=2)


@pytest.mark.parametrize("gauss_cached", [False, True])
def test_rng_state_round_trips_through_a_file(tmp_path, gauss_cached):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    if gauss_cached:
        np.random.normal()  # numpy's legacy generator keeps the second Box-Muller value: it must be saved too
    state = ckpt.rng_state()
    expected = _draws()
    _draws()
    ckpt.atomic_save({"rng": state}, tmp_path / "s.pt")
    ckpt.set_rng_state(ckpt.load_file(tmp_path / "s.pt")["rng"])
    for got, want in zip(_draws(), expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_format_1_sidecar_of_an_earlier_version_still_resumes(tmp_path):
    """What this project wrote before: numpy's state as numpy gives it (an ndarray inside a tuple) and every
    visible GPU's generator. It loads with numpy's array reconstruction allowed and nothing else."""
    np.random.seed(11)
    old = {"format": 1, "epoch": 1, "global_step": 4,
           "rng": [{"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": [torch.full((16,), 7, dtype=torch.uint8), torch.full((16,), 9, dtype=torch.uint8)]}]}
    expected = np.random.rand(4)
    path = plant(tmp_path / ckpt.state_name(1), old)
    loaded = ckpt.load_training_state(tmp_path, 1)
    ckpt.set_rng_state(loaded["rng"][0])
    np.testing.assert_array_equal(np.random.rand(4), expected)
    assert path.exists()


@pytest.mark.parametrize("saved, device, expected", [
    (torch.full((4,), 5, dtype=torch.uint8), "cuda:0", 5),  # format 2: the rank's own device, whatever index
    (torch.full((4,), 5, dtype=torch.uint8), "cuda:3", 5),
    ([torch.full((4,), 1, dtype=torch.uint8), torch.full((4,), 2, dtype=torch.uint8)], "cuda:1", 2),  # format 1
    ([torch.full((4,), 1, dtype=torch.uint8)], "cuda:1", None),  # format 1 from a node that showed fewer GPUs
    ([torch.full((4,), 1, dtype=torch.uint8)], "cuda", 1),
    (torch.full((4,), 5, dtype=torch.uint8), "cpu", None),  # a GPU run resumed on the CPU
    (None, "cuda:0", None),  # a CPU run resumed on a GPU: the GPU's generator keeps its seed
])
def test_the_cuda_generator_restored_is_the_ranks_own(saved, device, expected):
    state = {} if saved is None else {"cuda": saved}
    got = ckpt.cuda_generator_state(state, torch.device(device))
    assert (None if got is None else int(got[0])) == expected


def test_weights_are_written_as_a_cpu_runs_bytes(tmp_path):
    """cpu_state_dict keeps keys, order, values and torch's version metadata, so the file is byte for byte the
    one torch.save(model.state_dict()) writes on the CPU. (On a GPU, make gpu-check opens a GPU run's weights
    in a process that sees no GPU.)"""
    model = _net()
    ours, plain = io.BytesIO(), io.BytesIO()
    torch.save(ckpt.cpu_state_dict(nn.DataParallel(model)), ours)
    torch.save(model.state_dict(), plain)
    assert ours.getvalue() == plain.getvalue()
    assert ckpt.cpu_state_dict(model)._metadata == model.state_dict()._metadata
    path = ckpt.save_epoch(tmp_path, 1, model, None)
    assert path.read_bytes() == plain.getvalue()


@pytest.mark.parametrize("wrap", [
    lambda sd: sd,  # upstream OpenCOOD, HEAL, CoAlign: the bare state_dict
    lambda sd: OrderedDict(("module." + k, v) for k, v in sd.items()),  # saved from the DDP wrapper
    lambda sd: {"model": sd, "epoch": 7, "lr": 0.002},  # forks that save a dict of their own
    lambda sd: {"state_dict": sd, "optimizer": {"state": {}, "param_groups": []}},
    lambda sd: {"epoch": 3, "model_state_dict": sd},
], ids=["bare", "module-prefix", "model-key", "state_dict-key", "model_state_dict-key"])
def test_published_checkpoint_shapes_load(tmp_path, wrap):
    source = _net(seed=1)
    path = plant(tmp_path / "net_epoch7.pth", wrap(source.state_dict()))
    target = _net(seed=2)
    ckpt.load_weights(target, path)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_a_pre_zip_torch_file_loads(tmp_path):
    """torch before 1.6 wrote the legacy (non-zip) format; old upstream checkpoints may be such files."""
    source = _net(seed=1)
    path = tmp_path / "net_epoch1.pth"
    torch.save(source.state_dict(), path, _use_new_zipfile_serialization=False)
    target = _net(seed=2)
    ckpt.load_weights(target, path)
    assert torch.equal(target.state_dict()["conv.weight"], source.state_dict()["conv.weight"])


def test_a_dict_without_weights_is_one_line(tmp_path):
    path = plant(tmp_path / "net_epoch1.pth", {"epoch": 3, "args": {"lr": 0.1}})
    with pytest.raises(CheckpointError, match=r"holds a dict \(epoch, args\) that is not a state_dict and has none "
                                              r"under model, state_dict, model_state_dict, net"):
        ckpt.load_weights(_net(), path)


# ------------------------------------------------------------------------------------------- entry points
# One per entry point that reads a checkpoint: each refuses the planted file with one error line, exits non-zero
# and leaves the marker absent. The tools run as a plain `python tool.py` start runs them (in_process), the
# evaluation on 2 torchrun ranks, so that no rank is left waiting.
from launch import REPO, explain, in_process, torchrun  # noqa: E402

TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"


def _toy_run(folder: Path, toy_root: Path, config: Path = TOY) -> tuple[Path, dict]:
    """A run folder as train_ddp.py leaves it (config.yaml with the toy world's splits), and the model's weights."""
    from opencood_ddp import hypes as hypes_lib
    from opencood_ddp.models import create_model
    from zoo import hypes_of

    hypes = hypes_of(config, toy_root=toy_root)
    folder.mkdir(parents=True)
    hypes_lib.save_hypes(dict(hypes, batch_plan={"global_batch": hypes["train_params"]["batch_size"]}),
                         folder / "config.yaml")
    torch.manual_seed(0)
    return folder, create_model(hypes).state_dict()


def _refused(result, marker: Path, *fragments: str) -> None:
    assert result.returncode != 0, explain(result)
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() and "refused unread" in line]
    assert errors, explain(result)
    for fragment in ("posix.system", *fragments):
        assert fragment in errors[0], explain(result)
    assert not marker.exists()


def test_evaluation_refuses_planted_weights_on_every_rank(tmp_path, toy_small):
    run, state = _toy_run(tmp_path / "run", toy_small)
    marker = tmp_path / "ran"
    plant(run / "net_epoch1.pth", dict(state, extra=Payload(marker)))
    result = torchrun(2, REPO / "tools" / "inference_ddp.py", "--model_dir", run, "--fusion_method", "intermediate",
                      "--num_workers", "0", timeout=240)
    _refused(result, marker, "net_epoch1.pth")


@pytest.mark.parametrize("planted", ["weights", "sidecar"])
def test_a_resume_refuses_planted_files(tmp_path, toy_small, planted):
    run, state = _toy_run(tmp_path / "run", toy_small)
    marker = tmp_path / "ran"
    if planted == "weights":
        plant(run / "net_epoch1.pth", dict(state, extra=Payload(marker)))
    else:
        torch.save(state, run / "net_epoch1.pth")
        plant(run / ckpt.state_name(1), {"format": 2, "epoch": 1, "rng": Payload(marker)})
    before = sorted(p.name for p in run.iterdir())
    result = in_process(REPO / "tools" / "train_ddp.py", "--model_dir", run, "--num_workers", "0")
    _refused(result, marker, "net_epoch1.pth" if planted == "weights" else ckpt.state_name(1))
    assert sorted(p.name for p in run.iterdir() if p.name != "logs") == [n for n in before if n != "logs"]


def test_the_checkpoint_tools_refuse_planted_files(tmp_path, toy_small):
    # export_upstream takes a config of upstream's widths: the full-size AttFuse (only its model is built)
    run, state = _toy_run(tmp_path / "run", toy_small, REPO / "hypes_yaml/opv2v/point_pillar_intermediate_fusion.yaml")
    marker = tmp_path / "ran"
    plant(run / "net_epoch1.pth", dict(state, extra=Payload(marker)))
    clean = plant(tmp_path / "clean.pth", state)
    export = in_process(REPO / "tools" / "export_upstream.py", "--model_dir", run, "--out", tmp_path / "up")
    _refused(export, marker, "net_epoch1.pth")
    compare = in_process(REPO / "tools" / "analysis" / "compare_checkpoints.py", run / "net_epoch1.pth", clean)
    _refused(compare, marker)
    convert = in_process(REPO / "tools" / "convert_checkpoint.py", run / "net_epoch1.pth", tmp_path / "new.pth")
    assert convert.returncode == 2 and "pass --trust" in convert.stderr and not marker.exists(), explain(convert)


def test_convert_checkpoint_turns_a_trusted_forks_file_into_safe_weights(tmp_path):
    """A fork's file with a Python object beside the weights (here an argparse.Namespace): refused by every
    loader, converted once under --trust, then loaded safely with the same tensors."""
    import argparse

    source = plant(tmp_path / "fork.pth", {"model": _net(seed=1).state_dict(), "args": argparse.Namespace(lr=1)})
    with pytest.raises(ckpt.UnsafeCheckpointError, match="argparse.Namespace"):
        ckpt.load_file(source)
    result = in_process(REPO / "tools" / "convert_checkpoint.py", "--trust", source, tmp_path / "plain.pth")
    assert result.returncode == 0 and "readable with weights_only=True" in result.stdout, explain(result)
    target = _net(seed=2)
    ckpt.load_weights(target, tmp_path / "plain.pth")
    assert torch.equal(target.state_dict()["conv.weight"], _net(seed=1).state_dict()["conv.weight"])
