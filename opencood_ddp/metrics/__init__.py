"""Detection metrics with OpenCOOD's conventions: per-frame TP/FP by rotated BEV IoU, VOC all-points AP.

Pure numpy on the host: nothing here knows about processes. The evaluator gathers each frame's
``FrameStats`` to one process, orders them by dataset index, and calls ``eval_summary`` once.
"""
from opencood_ddp.metrics.ap import (AP_KEYS, PrCurve, average_precision, eval_summary, ordered_flags,
                                     pr_curve, precision_recall, voc_ap)
from opencood_ddp.metrics.detection import IOU_THRESHOLDS, DetectionStats, FrameStats, accumulate, frame_stats

__all__ = ["AP_KEYS", "IOU_THRESHOLDS", "DetectionStats", "FrameStats", "PrCurve", "accumulate",
           "average_precision", "eval_summary", "frame_stats", "ordered_flags", "pr_curve",
           "precision_recall", "voc_ap"]
