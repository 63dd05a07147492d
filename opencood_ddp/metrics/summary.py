"""The metric of a detection evaluation: every frame's record, in dataset order -> eval.yaml's content.

The engine's evaluator (``engine/evaluator.py``) calls it itself, once, on rank 0, with the records gathered from
every rank; a task only builds it (``tasks/eval_presets.EvalConvention.metric``). The content, in this order: what
was evaluated (``dataset_dir``, the split resolved, and ``fusion_method``: the evaluations of two splits of one
length would otherwise differ only in their numbers), the convention that made the numbers (``eval_preset``,
``ap_convention``, ``eval_range``, ...: a number is never written without its rules), upstream's AP keys
(``ap.eval_summary``), the convention's distance-band APs (``conventions.band_summary``) and, where the fusion is
metered, the communication figures (``communication.CommunicationSummary``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

from opencood_ddp.metrics.ap import eval_summary
from opencood_ddp.metrics.communication import CommunicationSummary
from opencood_ddp.metrics.conventions import DistanceBand, band_summary
from opencood_ddp.metrics.detection import FrameStats


@dataclass(frozen=True)
class DetectionMetric:
    convention_record: Mapping[str, Any]  # eval.yaml's description of the AP convention, before the numbers
    global_sort: bool = False
    bands: Tuple[DistanceBand, ...] = ()
    communication: Optional[CommunicationSummary] = None  # None: the fusion is not metered
    evaluated: Mapping[str, Any] = field(default_factory=dict)  # the split and fusion method, written first

    def __call__(self, frames: Sequence[FrameStats]) -> dict:
        summary = dict(self.evaluated)
        summary.update(self.convention_record)
        summary.update(eval_summary(frames, global_sort=self.global_sort))
        if self.bands:
            summary.update(band_summary(frames, self.bands, self.global_sort))
        if self.communication is not None:  # every record is a MeteredFrameStats then
            summary.update(self.communication([frame.communication for frame in frames]))
        return summary


__all__ = ["DetectionMetric"]
