"""Headless BEV and precision-recall pictures: real PNGs written to disk and read back pixel by pixel."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from opencood_ddp.data.geometry import boxes_to_corners
from opencood_ddp.vis import bev_figure, draw_bev, plot_pr_curves
from opencood_ddp.vis.bev import MAX_POINTS
from opencood_ddp.vis.pr_plot import legend_label

REPO = Path(__file__).resolve().parents[1]
RANGE = [-40.0, -20.0, -3.0, 40.0, 20.0, 1.0]  # 2:1, small enough to draw quickly
GT_BOX = [10.0, 5.0, 0.0, 1.5, 2.0, 4.5, 0.0]  # x, y, z, h, w, l, yaw
PRED_BOX = [-15.0, -8.0, 0.0, 1.5, 2.0, 4.5, 0.5]
CAVS = np.array([[0.0, 0.0, 1.8], [20.0, -10.0, 1.8]])


def _points(count: int = 5000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    xyz = rng.uniform([-40, -20, -3], [40, 20, 1], size=(count, 3))
    return np.c_[xyz, np.ones(count)].astype(np.float32)


def _frame(gt: bool = True, pred: bool = True) -> dict:
    """draw_bev's keyword arguments for a frame with one GT and one (distant) prediction box."""
    no_boxes = np.zeros((0, 8, 3))
    return dict(points=_points(),
                gt_corners=boxes_to_corners(np.array([GT_BOX])) if gt else no_boxes,
                pred_corners=boxes_to_corners(np.array([PRED_BOX])) if pred else no_boxes,
                pred_scores=np.array([0.87]) if pred else np.zeros(0),
                cav_positions=CAVS, lidar_range=RANGE)


def _read_png(path: Path) -> np.ndarray:
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    return image[..., :3]


def _edge_window(frame: dict, box: list[float], image_shape: tuple, half: int = 4) -> tuple[slice, slice]:
    """Pixel window around the midpoint of the box's front edge, located through the figure's own
    data-to-pixel transform (the saved PNG has the figure's size, so pixels line up)."""
    figure = bev_figure(**frame)
    assert image_shape[:2] == (round(figure.bbox.height), round(figure.bbox.width))
    corners = boxes_to_corners(np.array(box))
    x, y = corners[[0, 1], :2].mean(axis=0)
    px, py = figure.axes[0].transData.transform((x, y))
    row, col = int(round(figure.bbox.height - py)), int(round(px))  # PNG rows run top to bottom
    return slice(row - half, row + half + 1), slice(col - half, col + half + 1)


def _green(rgb: np.ndarray) -> np.ndarray:
    return (rgb[..., 1] > 0.5) & (rgb[..., 0] < 0.3) & (rgb[..., 2] < 0.3)


def _red(rgb: np.ndarray) -> np.ndarray:
    return (rgb[..., 0] > 0.6) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)


# ---------------------------------------------------------------------------------------------- BEV


def test_bev_draws_gt_green_and_prediction_red_where_the_boxes_are(tmp_path):
    frame = _frame()
    path = tmp_path / "bev.png"
    draw_bev(path, **frame, title="frame 7")
    image = _read_png(path)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 10  # not a blank single-colour image

    gt_rows, gt_cols = _edge_window(frame, GT_BOX, image.shape)
    pred_rows, pred_cols = _edge_window(frame, PRED_BOX, image.shape)
    assert _green(image[gt_rows, gt_cols]).any()
    assert not _red(image[gt_rows, gt_cols]).any()
    assert _red(image[pred_rows, pred_cols]).any()
    assert not _green(image[pred_rows, pred_cols]).any()


def test_bev_without_boxes_has_no_box_colour_where_a_box_would_be(tmp_path):
    frame = _frame(gt=False, pred=False)
    path = tmp_path / "bev.png"
    draw_bev(path, **frame)
    image = _read_png(path)
    rows, cols = _edge_window(_frame(), GT_BOX, image.shape)
    assert not _green(image[rows, cols]).any()


@pytest.mark.parametrize("empty", [
    dict(points=np.zeros((0, 4)), gt_corners=np.zeros((0, 8, 3)), pred_corners=np.zeros((0, 8, 3)),
         pred_scores=np.zeros(0), cav_positions=np.zeros((0, 2))),
    dict(points=[], gt_corners=[], pred_corners=[], pred_scores=[], cav_positions=[]),
], ids=["shaped", "bare-lists"])
def test_bev_accepts_empty_inputs(tmp_path, empty):
    path = tmp_path / "empty.png"
    draw_bev(path, lidar_range=RANGE, **empty)
    image = _read_png(path)
    assert image.shape[1] > image.shape[0]  # a 2:1 range gives a landscape picture


def test_bev_caps_points_and_drops_those_outside_the_range():
    points = _points(count=3 * MAX_POINTS + 7)
    points[:1000, 0] = 500.0  # far outside the range
    axes = bev_figure(points, [], [], [], [], RANGE).axes[0]
    offsets = np.asarray(axes.collections[0].get_offsets())
    assert 0 < len(offsets) <= MAX_POINTS
    assert offsets[:, 0].max() <= RANGE[3]
    again = np.asarray(bev_figure(points, [], [], [], [], RANGE).axes[0].collections[0].get_offsets())
    np.testing.assert_array_equal(offsets, again)  # the thinning is deterministic


def test_bev_replaces_existing_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "bev.png"
    path.write_bytes(b"old contents, not a PNG")
    draw_bev(path, **_frame())
    _read_png(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["bev.png"]


def test_bev_creates_missing_parent_folders(tmp_path):
    path = tmp_path / "a" / "b" / "bev.png"
    draw_bev(path, **_frame(pred=False))
    _read_png(path)


@pytest.mark.parametrize("argument, value, expected", [
    ("points", np.zeros((5, 2)), r"points must have shape \(N, >=3\)"),
    ("points", np.zeros(5), r"points must have shape \(N, >=3\)"),
    ("gt_corners", np.zeros((2, 4, 3)), r"gt_corners must have shape \(M, 8, 3\)"),
    ("pred_corners", np.zeros((1, 8, 2)), r"pred_corners must have shape \(M, 8, 3\)"),
    ("pred_scores", np.zeros(3), r"pred_scores must have shape \(1,\)"),
    ("pred_scores", np.zeros((1, 1)), r"pred_scores must have shape \(1,\)"),
    ("cav_positions", np.zeros((2, 4)), r"cav_positions must have shape \(K, 2\) or \(K, 3\)"),
    ("lidar_range", [-40, -20, 40, 20], r"lidar_range must have shape \(6,\)"),
    ("lidar_range", [40, -20, -3, -40, 20, 1], r"lidar_range must be finite with xmax > xmin"),
])
def test_bev_rejects_wrong_shapes_without_writing(tmp_path, argument, value, expected):
    frame = _frame()
    frame[argument] = value
    path = tmp_path / "bev.png"
    with pytest.raises(ValueError, match=expected):
        draw_bev(path, **frame)
    assert list(tmp_path.iterdir()) == []


def test_bev_draws_from_threads(tmp_path):
    """No pyplot state is shared, so figures can be drawn concurrently (e.g. by an evaluation pool)."""
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            draw_bev(tmp_path / f"t{index}.png", **_frame(), title=f"thread {index}")
        except BaseException as error:  # surfaced by the assertion below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for index in range(2):
        _read_png(tmp_path / f"t{index}.png")


def test_drawing_never_imports_pyplot_nor_needs_a_display(tmp_path):
    """In a fresh interpreter without DISPLAY or MPLBACKEND: pyplot stays unimported, the backend unset."""
    script = (
        "import sys, numpy as np\n"
        "from opencood_ddp.vis import draw_bev, plot_pr_curves\n"
        f"draw_bev({str(tmp_path / 'bev.png')!r}, np.zeros((0, 4)), [], [], [], [[0, 0]], {RANGE})\n"
        f"plot_pr_curves({str(tmp_path / 'pr.png')!r}, {{'IoU 0.5': ([0, 1], [1, 0.5], 0.7)}})\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    _read_png(tmp_path / "bev.png")
    _read_png(tmp_path / "pr.png")


# ----------------------------------------------------------------------------------------------- PR


def test_pr_plot_with_a_curve_and_an_empty_nan_curve(tmp_path):
    path = tmp_path / "pr" / "pr.png"
    curves = {"IoU 0.5": ([0.0, 0.4, 0.8], [1.0, 0.9, 0.6], 0.61234),
              "IoU 0.7": ([], [], float("nan"))}
    plot_pr_curves(path, curves, title="PR curves")
    image = _read_png(path)
    assert image.shape[:2] == (500, 600)
    assert len(np.unique(image.reshape(-1, 3), axis=0)) > 10
    assert sorted(p.name for p in path.parent.iterdir()) == ["pr.png"]


def test_pr_plot_replaces_existing_file(tmp_path):
    path = tmp_path / "pr.png"
    path.write_bytes(b"stale")
    plot_pr_curves(path, {"IoU 0.5": (np.array([0.5]), np.array([1.0]), 0.5)})
    _read_png(path)
    assert [p.name for p in tmp_path.iterdir()] == ["pr.png"]


def test_pr_plot_without_curves(tmp_path):
    path = tmp_path / "pr.png"
    plot_pr_curves(path, {})
    _read_png(path)


def test_pr_legend_labels():
    assert legend_label("IoU 0.5", 0.123456) == "IoU 0.5: AP 0.1235"
    assert legend_label("IoU 0.7", float("nan")) == "IoU 0.7: AP n/a"
    assert legend_label("IoU 0.3", None) == "IoU 0.3: AP n/a"
    assert legend_label("IoU 0.3", np.float32(1.0)) == "IoU 0.3: AP 1.0000"


@pytest.mark.parametrize("curve, expected", [
    (([0.1, 0.2], [1.0], 0.5), "recall and precision must be 1-D of equal length"),
    (([[0.1]], [[1.0]], 0.5), "recall and precision must be 1-D of equal length"),
    (([0.1], [1.0]), r"must be a tuple \(recall, precision, ap\)"),
])
def test_pr_plot_rejects_bad_curves(tmp_path, curve, expected):
    with pytest.raises(ValueError, match=expected):
        plot_pr_curves(tmp_path / "pr.png", {"IoU 0.5": curve})
    assert list(tmp_path.iterdir()) == []


def test_per_frame_files_are_staged_then_published_whole(tmp_path):
    """The ranks write into npy.eval.partial (named by the result file); the run's npy/ changes only at publish,
    which leaves exactly this evaluation's frames and its manifest: frames of a longer split evaluated before, an
    interrupted run's leftovers past this split and temporary files go, and a failing evaluation (no publish)
    leaves npy/ as it was. A publish stopped between its renames (npy/ moved aside, the new one not in) is undone
    by the next publish, of another evaluation too."""
    from opencood_ddp.vis.export import FrameExporter, read_manifest

    def exporter(split: str) -> FrameExporter:
        return FrameExporter(tmp_path, save_npy=True, save_vis=False, lidar_range=RANGE,
                             about={"split": split, "fusion_method": "late", "eval_preset": "opencood"})

    points, corners = np.zeros((5, 4), np.float32), np.zeros((1, 8, 3), np.float32)
    longer = exporter("train")
    for index in range(6):
        longer(index, points, corners, np.ones(1), corners, None)
    assert not (tmp_path / "npy").exists()  # nothing published before every rank is done
    longer.publish(6)
    before = sorted(p.name for p in (tmp_path / "npy").iterdir())
    assert len(before) == 6 * 3 + 1 and read_manifest(tmp_path / "npy")["frames"] == 6

    shorter = exporter("test")
    (tmp_path / "npy.eval.partial").mkdir()
    (tmp_path / "npy.eval.partial" / "0009_pred.npy").write_bytes(b"stale")  # a stopped run's frame past this split
    (tmp_path / "npy.eval.partial" / ".0000_pcd.npy.x.tmp").write_bytes(b"")  # a write cut by SIGTERM
    for index in range(4):
        shorter(index, points + 1, corners, np.ones(1), corners, None)
    assert sorted(p.name for p in (tmp_path / "npy").iterdir()) == before  # a failure now loses nothing
    shorter.publish(4)
    assert sorted(p.name for p in (tmp_path / "npy").iterdir()) == sorted(
        [f"{i:04d}_{kind}.npy" for i in range(4) for kind in ("pcd", "pred", "gt")] + ["evaluation.yaml"])
    assert read_manifest(tmp_path / "npy") == {"split": "test", "fusion_method": "late", "eval_preset": "opencood",
                                               "frames": 4}
    assert np.load(tmp_path / "npy" / "0000_pcd.npy")[0, 0] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]  # no staging or old folder left

    (tmp_path / "npy").rename(tmp_path / "npy.eval.old")  # as a kill between publish's two renames leaves it
    other = FrameExporter(tmp_path, save_npy=True, save_vis=False, lidar_range=RANGE, tag="eval_nofusion",
                          about={"split": "test", "fusion_method": "nofusion", "eval_preset": "opencood"})
    other(0, points, corners, np.ones(1), corners, None)
    other.publish(1)  # puts the moved-aside folder back first, then replaces it: nothing of it is left over
    assert read_manifest(tmp_path / "npy")["fusion_method"] == "nofusion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["npy"]
