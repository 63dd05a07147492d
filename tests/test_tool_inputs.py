"""The tools besides training and evaluation on bad inputs: compare_checkpoints, convert_checkpoint,
export_upstream and recall_by_visibility give one error line and exit 2 and write nothing, and compare_checkpoints
never calls two different models equal (parity_check's and plan_batch's flags: test_end_to_end.py and
test_batch_fit.py; make_toy_opv2v's --out: test_toy.py).

Found by running each tool on what a researcher might pass it; every case here ended in a traceback, or, for
compare_checkpoints, in "max relative difference 0.000e+00" and exit 0 for files with no tensor in common (it
compared only the keys both held, and a fork's wrapped file held none at the top)."""
from __future__ import annotations

import numpy as np
import torch

from launch import REPO, explain, in_process, load_tool
from test_checkpoint_trust import _toy_run
from opencood_ddp import checkpoint_files as ckpt

COMPARE = REPO / "tools" / "analysis" / "compare_checkpoints.py"
CONVERT = REPO / "tools" / "convert_checkpoint.py"
EXPORT = REPO / "tools" / "export_upstream.py"
RECALL = REPO / "tools" / "analysis" / "recall_by_visibility.py"


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
    one_error_line(in_process(COMPARE, tmp_path, path["plain"]), f"{tmp_path} is not a file; pass two checkpoint")
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
    # Without --trust the paths are checked first: a mistyped one was answered with "pass --trust"
    one_error_line(in_process(CONVERT, tmp_path / "nope.pth", tmp_path / "new.pth"),
                   f"{tmp_path / 'nope.pth'} is not a file")
    one_error_line(in_process(CONVERT, tmp_path / "good.pth", tmp_path / "new.pth"), "pass --trust")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.pth", "junk.pth"]


def test_export_upstream_refuses_an_out_that_is_or_lies_under_a_file(tmp_path, toy_small):
    run, state = _toy_run(tmp_path / "run", toy_small)
    ckpt.atomic_save(state, run / ckpt.weights_name(1))
    (tmp_path / "a_file").write_text("notes\n")
    one_error_line(in_process(EXPORT, "--model_dir", run, "--out", tmp_path / "a_file"),
                   f"--out {tmp_path / 'a_file'}: {tmp_path / 'a_file'} is a file")
    one_error_line(in_process(EXPORT, "--model_dir", run, "--out", tmp_path / "a_file" / "sub"), "is a file")
    assert (tmp_path / "a_file").read_text() == "notes\n"


def test_recall_by_visibility_names_a_damaged_npy_file_and_a_run_of_another_split(tmp_path, toy_small):
    run = tmp_path / "run"
    (run / "npy").mkdir(parents=True)
    for frame in range(4):  # the small world's test split: 4 frames, no box found, none labelled
        for kind in ("pred", "gt"):
            np.save(run / "npy" / f"{frame:04d}_{kind}.npy", np.zeros((0, 8, 3), dtype=np.float32))
    result = in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run)
    assert result.returncode == 0 and "4 frames of" in result.stdout, explain(result)

    (run / "npy" / "0001_pred.npy").write_text("junk\n")
    one_error_line(in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run),
                   f"{run / 'npy' / '0001_pred.npy'} is not a readable .npy file")
    np.save(run / "npy" / "0001_pred.npy", np.zeros((3, 5), dtype=np.float32))
    one_error_line(in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run),
                   "holds an array of shape (3, 5), not box corners (K, 8, 3)")
    np.save(run / "npy" / "0001_pred.npy", np.zeros((0, 8, 3), dtype=np.float32))
    for frame in range(4, 6):  # as a run evaluated on a longer split leaves them
        for kind in ("pred", "gt"):
            np.save(run / "npy" / f"{frame:04d}_{kind}.npy", np.zeros((0, 8, 3), dtype=np.float32))
    one_error_line(in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run),
                   "holds npy files of more than the 4 frames", "it was evaluated on another split")
    one_error_line(in_process(RECALL, "--dataset_dir", tmp_path / "nowhere", "--runs", run), "--dataset_dir")
    bad_iou = in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run, "--iou", "1.5")
    assert bad_iou.returncode == 2 and "argument --iou: 1.5 is not an IoU in (0, 1]" in bad_iou.stderr


def test_recall_by_visibility_refuses_npy_files_another_split_of_the_same_length_wrote(tmp_path, toy_small):
    """The split's frame count alone let a validate split's boxes be scored against the test split's clouds (the
    small world has 4 frames in each): exit 0 and a table of the wrong frames. The evaluation's manifest names
    its split; the same split at another path (a run evaluated on a cluster, read on a workstation) is known by
    its scenarios and frames."""
    import shutil

    from opencood_ddp.vis.export import FrameExporter, split_scenarios

    run = tmp_path / "run"
    corners = np.zeros((0, 8, 3), dtype=np.float32)
    for split in ("validate", "test"):
        exporter = FrameExporter(run, save_npy=True, save_vis=False, lidar_range=[-1, -1, -1, 1, 1, 1],
                                 about={"split": str(toy_small / split), "fusion_method": "late",
                                        "scenarios": split_scenarios(toy_small / split), "eval_preset": "opencood"})
        for frame in range(4):
            exporter(frame, np.zeros((1, 4), dtype=np.float32), corners, np.zeros(0), corners, None)
        exporter.publish(4)
        result = in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run)
        if split == "validate":
            one_error_line(result, f"holds the evaluation of {toy_small / 'validate'}, not of {toy_small / 'test'}",
                           "--save_npy --dataset_dir")
        else:
            assert result.returncode == 0 and "4 frames of" in result.stdout, explain(result)
    moved = tmp_path / "elsewhere" / "test"
    shutil.copytree(toy_small / "test", moved)
    result = in_process(RECALL, "--dataset_dir", moved, "--runs", run)
    assert result.returncode == 0 and "4 frames of" in result.stdout, explain(result)


def test_the_visibility_tools_refuse_a_run_on_another_layout_by_name(tmp_path, toy_small):
    """Both read the split's clouds as OPV2V's: a DAIR-V2X-C run was an AttributeError traceback in
    attention_by_visibility, and a V2V4Real split 'unsupported YAML tag ... re-export the file' in
    recall_by_visibility, wrong advice for valid frames."""
    from zoo import hypes_of
    from opencood_ddp.hypes import save_hypes

    run = tmp_path / "dair_run"
    run.mkdir()
    save_hypes(hypes_of("dairv2x/point_pillar_intermediate_fusion"), run / "config.yaml")
    (run / "net_epoch1.pth").write_bytes(b"")  # never read: the refusal comes first
    needle = ("fusion.dataset is 'dairv2x'; this tool reads runs on OPV2V-layout data (fusion.dataset opv2v or "
              "v2xset)")
    one_error_line(in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run), needle)
    one_error_line(in_process(REPO / "tools" / "analysis" / "attention_by_visibility.py", "--model_dir", run,
                              "--dataset_dir", toy_small / "test"), needle)
    # V2XSet is read by the OPV2V source under its own name: taken (and then told its npy files are missing)
    save_hypes(hypes_of("toy/point_pillar_intermediate_fusion", "fusion.dataset=v2xset"), run / "config.yaml")
    one_error_line(in_process(RECALL, "--dataset_dir", toy_small / "test", "--runs", run), "does not exist",
                   "--save_npy")


def test_a_box_centre_outside_the_attention_grid_has_no_cell():
    """attention_by_visibility.cell_of: a centre within one cell left of or below the grid read as column (row) 0,
    because int() rounds toward zero. A 4 x 8 grid over x -8..8, y -4..4 (2 m cells), by hand."""
    tool = load_tool("analysis/attention_by_visibility.py")

    def centre(x: float, y: float) -> np.ndarray:
        return np.array([[x - 1, y - 1, 0.0], [x + 1, y + 1, 0.0]])  # corners whose mean is (x, y)

    lidar_range, shape = (-8.0, -4.0, -3.0, 8.0, 4.0, 1.0), (4, 8)
    assert tool.cell_of(centre(-7.0, -3.0), lidar_range, shape) == (0, 0)
    assert tool.cell_of(centre(7.9, 3.9), lidar_range, shape) == (3, 7)
    assert tool.cell_of(centre(-9.0, 0.0), lidar_range, shape) is None  # half a cell left of the grid
    assert tool.cell_of(centre(0.0, -5.0), lidar_range, shape) is None  # half a cell below it
    assert tool.cell_of(centre(8.0, 0.0), lidar_range, shape) is None
