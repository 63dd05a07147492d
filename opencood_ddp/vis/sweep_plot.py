"""A metric against the settings of a sweep: one panel per swept quantity, one line per metric.

Headless like ``bev`` and ``pr_plot``: a pyplot-free Figure on an Agg canvas, saved atomically as PNG. The x axis
is categorical (one tick per setting, labelled by the caller, in the caller's order), because a sweep's settings
may pair two quantities (a position and a rotation spread) that no single numeric axis shows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from opencood_ddp.vis.bev import new_figure, save_png

PANEL_SIZE_IN = (5.5, 4.5)  # one panel; the figure is as wide as its panels side by side
Y_LIMIT = 1.02  # a little past 1 so a line at 1 is not hidden by the frame


@dataclass(frozen=True)
class SweepPanel:
    """One swept quantity: ``ticks`` label the settings in order; ``series`` maps a line's label to its values,
    one per tick (NaN leaves a gap: a metric without ground truth)."""

    xlabel: str
    ticks: Sequence[str]
    series: Mapping[str, Sequence[float]]


def _check_panel(panel: SweepPanel) -> None:
    for label, values in panel.series.items():
        if len(values) != len(panel.ticks):
            raise ValueError(f"panel {panel.xlabel!r}: line {label!r} has {len(values)} values for "
                             f"{len(panel.ticks)} settings")


def plot_sweep(path: str | os.PathLike, panels: Sequence[SweepPanel], ylabel: str,
               title: Optional[str] = None) -> None:
    """Save a PNG of every panel side by side to ``path``, atomically."""
    for panel in panels:
        _check_panel(panel)
    width, height = PANEL_SIZE_IN
    figure = new_figure(width * max(len(panels), 1), height)
    for number, panel in enumerate(panels, 1):
        axes = figure.add_subplot(1, len(panels), number)
        x = np.arange(len(panel.ticks))
        for label, values in panel.series.items():
            axes.plot(x, np.asarray(values, dtype=np.float64), marker="o", linewidth=1.5, label=label)
        axes.set_xticks(x, list(panel.ticks), fontsize=8)
        axes.set_xlabel(panel.xlabel)
        axes.set_ylabel(ylabel)
        axes.set_ylim(0.0, Y_LIMIT)
        axes.grid(True, alpha=0.3)
        if panel.series:  # legend() with no labelled artist only warns
            axes.legend(loc="best", fontsize=9)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    save_png(figure, path)


__all__ = ["SweepPanel", "plot_sweep"]
