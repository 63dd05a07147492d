"""Precision-recall curves, one per label (e.g. per IoU threshold), with each curve's AP in the legend.

Headless like ``bev``: a pyplot-free Figure on an Agg canvas, saved atomically as PNG.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from opencood_ddp.vis.bev import new_figure, save_png

PR_FIGURE_SIZE_IN = (6.0, 5.0)
AXIS_LIMIT = 1.02  # a little past 1 so a curve at precision or recall 1 is not hidden by the frame

Curve = tuple[Sequence[float], Sequence[float], Optional[float]]


def _check_curve(label: str, curve: Curve) -> tuple[np.ndarray, np.ndarray, Optional[float]]:
    try:
        recall, precision, ap = curve
    except (TypeError, ValueError):
        raise ValueError(f"curve {label!r} must be a tuple (recall, precision, ap)") from None
    recall = np.asarray(recall, dtype=np.float64)
    precision = np.asarray(precision, dtype=np.float64)
    if recall.ndim != 1 or precision.ndim != 1 or recall.shape != precision.shape:
        raise ValueError(f"curve {label!r}: recall and precision must be 1-D of equal length, "
                         f"got shapes {recall.shape} and {precision.shape}")
    return recall, precision, ap


def legend_label(label: str, ap: Optional[float]) -> str:
    """'IoU 0.5: AP 0.1234', or 'IoU 0.5: AP n/a' when there is no AP (no ground truth gives nan)."""
    if ap is None or math.isnan(float(ap)):
        return f"{label}: AP n/a"
    return f"{label}: AP {float(ap):.4f}"


def plot_pr_curves(path: str | os.PathLike, curves: Mapping[str, Curve], title: Optional[str] = None) -> None:
    """Save a PNG of the precision (y) against recall (x) curves to `path`, atomically.

    `curves` maps a label to (recall, precision, ap). An empty curve draws nothing but keeps its legend
    entry, so a threshold without ground truth is reported rather than silently missing.
    """
    checked = {label: _check_curve(label, curve) for label, curve in curves.items()}
    figure = new_figure(*PR_FIGURE_SIZE_IN)
    axes = figure.add_subplot()
    for label, (recall, precision, ap) in checked.items():
        # A lone point has no segment to draw, so mark the points of very short curves.
        marker = "." if len(recall) < 2 else None
        axes.plot(recall, precision, marker=marker, linewidth=1.5, label=legend_label(label, ap))
    axes.set_xlim(0.0, AXIS_LIMIT)
    axes.set_ylim(0.0, AXIS_LIMIT)
    axes.set_xlabel("recall")
    axes.set_ylabel("precision")
    axes.grid(True, alpha=0.3)
    if checked:  # legend() with no labelled artist only warns
        axes.legend(loc="lower left", fontsize=9)
    if title:
        axes.set_title(title)
    save_png(figure, path)
