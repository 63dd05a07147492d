"""The checkpoint tools on bad inputs: compare_checkpoints, convert_checkpoint and export_upstream give one error
line and exit 2, write nothing, and compare_checkpoints never calls two different models equal.

Found by running each tool on what a researcher might pass it; every case here ended in a traceback, or, for
compare_checkpoints, in "max relative difference 0.000e+00" and exit 0 for files with no tensor in common (it
compared only the keys both held, and a fork's wrapped file held none at the top)."""
from __future__ import annotations

import torch

from launch import REPO, explain, in_process
from test_checkpoint_trust import _toy_run
from opencood_ddp import checkpoint_files as ckpt

COMPARE = REPO / "tools" / "analysis" / "compare_checkpoints.py"
CONVERT = REPO / "tools" / "convert_checkpoint.py"
EXPORT = REPO / "tools" / "export_upstream.py"


def one_error_line(result, *fragments: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, explain(result)
    assert "Traceback" not in result.stderr and all(f in lines[0] for f in fragments), (fragments, lines[0])


def test_compare_checkpoints_compares_every_tensor_or_refuses(tmp_path):
    weights = {"conv.weight": torch.ones(2, 3), "conv.bias": torch.full((2,), 2.0)}
    files = {"plain": weights, "wrapped_moved": {"model": {k: v + 1 for k, v in weights.items()}, "epoch": 3},
             "ddp": {f"module.{k}": v for k, v in weights.items()}, "wider": {"conv.weight": torch.ones(4, 3),
                                                                              "conv.bias": torch.ones(4)},
             "other_model": {"head.weight": torch.ones(1)}, "a_list": [1, 2]}
    for name, content in files.items():
        torch.save(content, tmp_path / f"{name}.pth")
    path = {name: tmp_path / f"{name}.pth" for name in files}

    same = in_process(COMPARE, path["ddp"], path["plain"])  # DDP's prefix is not a difference
    assert same.returncode == 0 and "parameters max relative difference 0.000e+00" in same.stdout, explain(same)
    moved = in_process(COMPARE, path["wrapped_moved"], path["plain"])  # a fork's file: its weights are compared
    assert moved.returncode == 1 and "parameters max relative difference 1.000e+00" in moved.stdout, explain(moved)
    one_error_line(in_process(COMPARE, path["wider"], path["plain"]), "are not weights of one model",
                   "2 shape mismatch (conv.weight: checkpoint [4, 3] vs model [2, 3]")
    one_error_line(in_process(COMPARE, path["other_model"], path["plain"]), "2 missing (conv.weight, conv.bias)",
                   "1 unexpected (head.weight)")
    one_error_line(in_process(COMPARE, path["a_list"], path["plain"]), "holds a list, not a state_dict")
    bad_tolerance = in_process(COMPARE, path["plain"], path["plain"], "--tolerance", "-1")
    assert bad_tolerance.returncode == 2 and "-1 is not a relative difference >= 0" in bad_tolerance.stderr


def test_convert_checkpoint_names_a_missing_or_damaged_source_and_a_target_it_cannot_write(tmp_path):
    (tmp_path / "junk.pth").write_text("not a checkpoint\n")
    torch.save({"w": torch.ones(1)}, tmp_path / "good.pth")
    one_error_line(in_process(CONVERT, "--trust", tmp_path / "nope.pth", tmp_path / "new.pth"),
                   f"{tmp_path / 'nope.pth'} is not a file")
    one_error_line(in_process(CONVERT, "--trust", tmp_path, tmp_path / "new.pth"), "is not a file")
    one_error_line(in_process(CONVERT, "--trust", tmp_path / "junk.pth", tmp_path / "new.pth"),
                   f"{tmp_path / 'junk.pth'} is not a torch checkpoint, or is truncated (UnpicklingError")
    one_error_line(in_process(CONVERT, "--trust", tmp_path / "good.pth", tmp_path / "no_folder" / "new.pth"),
                   f"its folder {tmp_path / 'no_folder'} is not there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.pth", "junk.pth"]


def test_export_upstream_refuses_an_out_that_is_or_lies_under_a_file(tmp_path, toy_small):
    run, state = _toy_run(tmp_path / "run", toy_small)
    ckpt.atomic_save(state, run / ckpt.weights_name(1))
    (tmp_path / "a_file").write_text("notes\n")
    one_error_line(in_process(EXPORT, "--model_dir", run, "--out", tmp_path / "a_file"),
                   f"--out {tmp_path / 'a_file'}: {tmp_path / 'a_file'} is a file")
    one_error_line(in_process(EXPORT, "--model_dir", run, "--out", tmp_path / "a_file" / "sub"), "is a file")
    assert (tmp_path / "a_file").read_text() == "notes\n"
