"""Headless pictures for runs: BEV frames of points and boxes, precision-recall curves.

Drawn without pyplot and without touching matplotlib's global backend, so safe in workers and threads.
"""
from opencood_ddp.vis.bev import bev_figure, draw_bev, save_png
from opencood_ddp.vis.pr_plot import plot_pr_curves

__all__ = ["bev_figure", "draw_bev", "plot_pr_curves", "save_png"]
