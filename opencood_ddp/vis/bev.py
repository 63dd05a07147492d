"""Bird's-eye-view picture of one cooperative frame: points, ground truth, predictions and the CAVs.

Everything is drawn with ``matplotlib.figure.Figure`` and ``FigureCanvasAgg`` directly. pyplot is never
imported and the global backend is never touched, so this works in data-loader workers, evaluation
threads and on machines without a display, and figures are freed by the garbage collector as soon as
they are dropped (pyplot would keep them alive in its figure manager).

Frame convention: the ego LiDAR frame, x forward and y left, metres. Box corners follow OpenCOOD's
order, whose first four corners are the bottom face in order around the box, so ``corners[:, :4, :2]``
is each box's footprint polygon.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from opencood_ddp.atomic import atomic_write

# Colours are saturated and far apart so that a reader (and the tests) can tell GT from predictions.
GT_COLOR = "#00b400"
PRED_COLOR = "#e00000"
POINT_COLOR = "#808080"
EGO_COLOR = "#1f3fff"
CAV_COLOR = "#ff9900"

MAX_POINTS = 60_000  # more points add no visible detail at this size, only drawing time
DPI = 100
MAX_AXES_WIDTH_IN = 11.2  # with the margins below a wide range gives a figure about 12 in wide
MAX_AXES_HEIGHT_IN = 11.0
MIN_FIGURE_WIDTH_IN = 5.0  # narrow ranges still need room for the legend
MARGIN_LEFT_IN, MARGIN_RIGHT_IN = 0.6, 0.2
MARGIN_BOTTOM_IN, MARGIN_TOP_IN = 0.5, 0.45


# ------------------------------------------------------------------------------------- shared helpers


def new_figure(width_in: float, height_in: float, dpi: int = DPI) -> Figure:
    """A Figure bound to an Agg canvas, independent of pyplot and of the global backend."""
    figure = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(figure)  # binds itself to figure.canvas
    return figure


def save_png(figure: Figure, path: str | os.PathLike) -> None:
    """Write `figure` as PNG to `path` atomically, creating the parent folders.

    Readers (a web page, an image viewer polling the run folder) never see a half-written image: the
    PNG goes to a temporary file beside `path`, which is then renamed over it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name ends in .tmp, so the format must be given rather than guessed from the name.
    atomic_write(path, lambda handle: figure.savefig(handle, format="png", dpi=figure.dpi))


# ------------------------------------------------------------------------------------------ validation


def _as_array(value: object) -> np.ndarray:
    return np.asarray(value, dtype=np.float64)


def _check_points(points: object) -> np.ndarray:
    """(N, >=3) points -> (N, 2) float64 xy; only xy is converted, as clouds can hold millions of points."""
    array = np.asarray(points)
    if array.shape == (0,):
        return np.zeros((0, 2))  # a bare empty list: no points
    if array.ndim != 2 or array.shape[1] < 3:
        raise ValueError(f"points must have shape (N, >=3), got {array.shape}")
    return array[:, :2].astype(np.float64)


def _check_corners(corners: object, name: str) -> np.ndarray:
    array = _as_array(corners)
    if array.shape == (0,):
        return np.zeros((0, 8, 3))  # a bare empty list: no boxes
    if array.ndim != 3 or array.shape[1:] != (8, 3):
        raise ValueError(f"{name} must have shape (M, 8, 3), got {array.shape}")
    return array


def _check_scores(scores: object, count: int) -> np.ndarray:
    array = _as_array(scores)
    if array.shape != (count,):
        raise ValueError(f"pred_scores must have shape ({count},) to match pred_corners, got {array.shape}")
    return array


def _check_cav_positions(positions: object) -> np.ndarray:
    array = _as_array(positions)
    if array.shape == (0,):
        return np.zeros((0, 2))  # a bare empty list: no CAVs
    if array.ndim != 2 or array.shape[1] not in (2, 3):
        raise ValueError(f"cav_positions must have shape (K, 2) or (K, 3), got {array.shape}")
    return array[:, :2]


def _check_range(lidar_range: object) -> np.ndarray:
    array = _as_array(lidar_range)
    if array.shape != (6,):
        raise ValueError(f"lidar_range must have shape (6,) [xmin, ymin, zmin, xmax, ymax, zmax], "
                         f"got {array.shape}")
    if not (np.all(np.isfinite(array)) and array[3] > array[0] and array[4] > array[1]):
        raise ValueError(f"lidar_range must be finite with xmax > xmin and ymax > ymin, got {array.tolist()}")
    return array


# ---------------------------------------------------------------------------------------------- layout


def _figure_for_range(lidar_range: np.ndarray) -> tuple[Figure, Axes]:
    """A figure whose axes have exactly the range's aspect ratio, so equal aspect wastes no space."""
    x_span = lidar_range[3] - lidar_range[0]
    y_span = lidar_range[4] - lidar_range[1]
    scale = min(MAX_AXES_WIDTH_IN / x_span, MAX_AXES_HEIGHT_IN / y_span)  # inches per metre
    axes_w, axes_h = x_span * scale, y_span * scale
    fig_w = max(axes_w + MARGIN_LEFT_IN + MARGIN_RIGHT_IN, MIN_FIGURE_WIDTH_IN)
    fig_h = axes_h + MARGIN_BOTTOM_IN + MARGIN_TOP_IN
    figure = new_figure(fig_w, fig_h)
    # Fixed margins instead of tight/constrained layout: those re-measure every text and cost time.
    left = (fig_w - axes_w - MARGIN_RIGHT_IN + MARGIN_LEFT_IN) / 2 / fig_w  # centred when MIN width applies
    axes = figure.add_axes((left, MARGIN_BOTTOM_IN / fig_h, axes_w / fig_w, axes_h / fig_h))
    axes.set_xlim(lidar_range[0], lidar_range[3])
    axes.set_ylim(lidar_range[1], lidar_range[4])
    axes.set_aspect("equal", adjustable="box")
    axes.set_xlabel("x [m]")
    axes.set_ylabel("y [m]")
    axes.tick_params(labelsize=8)
    return figure, axes


# --------------------------------------------------------------------------------------------- drawing


def _subsample_points(xy: np.ndarray, lidar_range: np.ndarray) -> np.ndarray:
    """The (N, 2) points inside the range, thinned by a fixed stride to at most MAX_POINTS.

    Cropping first spends the point budget on what is visible; a fixed stride keeps the picture
    identical from run to run (a random subset would not).
    """
    inside = ((xy[:, 0] >= lidar_range[0]) & (xy[:, 0] <= lidar_range[3])
              & (xy[:, 1] >= lidar_range[1]) & (xy[:, 1] <= lidar_range[4]))
    xy = xy[inside]
    stride = max(1, -(-len(xy) // MAX_POINTS))  # ceil division
    return xy[::stride]


def _draw_points(axes: Axes, xy: np.ndarray) -> None:
    if len(xy) == 0:
        return
    axes.scatter(xy[:, 0], xy[:, 1], s=0.5, c=POINT_COLOR, marker=".", linewidths=0, zorder=1)


def _draw_boxes(axes: Axes, corners: np.ndarray, color: str, zorder: int) -> None:
    """All footprints in one PolyCollection: one artist instead of one patch per box."""
    if len(corners) == 0:
        return
    footprints = corners[:, :4, :2]
    axes.add_collection(PolyCollection(footprints, facecolors="none", edgecolors=color,
                                       linewidths=1.5, zorder=zorder), autolim=False)


def _draw_scores(axes: Axes, corners: np.ndarray, scores: np.ndarray, lidar_range: np.ndarray) -> None:
    """Each prediction's score just above its footprint; boxes centred outside the view get no label."""
    footprints = corners[:, :4, :2]
    centres = footprints.mean(axis=1)
    tops = footprints[:, :, 1].max(axis=1)
    for (cx, cy), top, score in zip(centres, tops, scores):
        if not (lidar_range[0] <= cx <= lidar_range[3] and lidar_range[1] <= cy <= lidar_range[4]):
            continue
        axes.text(cx, top + 0.3, f"{score:.2f}", fontsize=6, color=PRED_COLOR, ha="center", va="bottom",
                  clip_on=True, zorder=4)


def _draw_cavs(axes: Axes, positions: np.ndarray) -> None:
    if len(positions) > 1:
        axes.scatter(positions[1:, 0], positions[1:, 1], s=60, marker="^", c=CAV_COLOR,
                     edgecolors="black", linewidths=0.5, zorder=5)
    if len(positions) > 0:
        axes.scatter(positions[:1, 0], positions[:1, 1], s=140, marker="*", c=EGO_COLOR,
                     edgecolors="black", linewidths=0.5, zorder=6)


def _draw_legend(axes: Axes) -> None:
    """Proxy handles, so the legend reads the same whatever the frame holds (even nothing)."""
    handles = [
        Line2D([], [], color=GT_COLOR, linewidth=1.5, label="GT"),
        Line2D([], [], color=PRED_COLOR, linewidth=1.5, label="prediction"),
        Line2D([], [], linestyle="none", marker="*", markersize=11, markerfacecolor=EGO_COLOR,
               markeredgecolor="black", markeredgewidth=0.5, label="ego"),
        Line2D([], [], linestyle="none", marker="^", markersize=8, markerfacecolor=CAV_COLOR,
               markeredgecolor="black", markeredgewidth=0.5, label="other CAVs"),
    ]
    # One row: a wide, flat range has little height to spare for a stacked legend.
    axes.legend(handles=handles, loc="upper right", ncols=len(handles), fontsize=8, framealpha=0.85)


def bev_figure(points: np.ndarray, gt_corners: np.ndarray, pred_corners: np.ndarray,
               pred_scores: np.ndarray, cav_positions: np.ndarray, lidar_range: Sequence[float],
               title: Optional[str] = None) -> Figure:
    """The BEV figure that ``draw_bev`` saves, for callers that want to embed or post-process it.

    Same arguments and validation as ``draw_bev`` without the path.
    """
    xy = _check_points(points)
    gt = _check_corners(gt_corners, "gt_corners")
    pred = _check_corners(pred_corners, "pred_corners")
    scores = _check_scores(pred_scores, len(pred))
    cavs = _check_cav_positions(cav_positions)
    rng = _check_range(lidar_range)

    figure, axes = _figure_for_range(rng)
    _draw_points(axes, _subsample_points(xy, rng))
    _draw_boxes(axes, gt, GT_COLOR, zorder=2)
    _draw_boxes(axes, pred, PRED_COLOR, zorder=3)  # above GT: a perfect prediction hides its GT box
    _draw_scores(axes, pred, scores, rng)
    _draw_cavs(axes, cavs)
    _draw_legend(axes)
    if title:
        axes.set_title(title, fontsize=10)
    return figure


def draw_bev(path: str | os.PathLike, points: np.ndarray, gt_corners: np.ndarray, pred_corners: np.ndarray,
             pred_scores: np.ndarray, cav_positions: np.ndarray, lidar_range: Sequence[float],
             title: Optional[str] = None) -> None:
    """Save a BEV PNG of one frame to `path` (atomically, parent folders created).

    points: (N, >=3) all CAVs' points in the ego frame, may be empty. gt_corners, pred_corners:
    (M, 8, 3) OpenCOOD-ordered corners, M may be 0. pred_scores: (M,) for pred_corners.
    cav_positions: (K, 2 or 3) LiDAR xy of each CAV, the ego first. lidar_range: [xmin, ymin, zmin,
    xmax, ymax, zmax]; the view is its xy part. A wrong shape raises ValueError naming the argument.
    """
    figure = bev_figure(points, gt_corners, pred_corners, pred_scores, cav_positions, lidar_range, title)
    save_png(figure, path)
