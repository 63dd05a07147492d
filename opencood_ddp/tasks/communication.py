"""What the non-ego CAVs of a frame sent, measured from the model's output on the rank that evaluated the frame.

Definitions in ``models/communication.py``; the frame's figures (``metrics.communication.FrameCommunication``)
travel to rank 0 with its detection statistics, where ``metrics.communication.CommunicationSummary`` (the meter's
``summary``) writes them into eval.yaml. A model's rates describe its whole batch: with ``--batch_size`` > 1 every
frame of a batch carries the batch's, and the pooled figures are the same up to float rounding. Early fusion is
not metered (None).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from opencood_ddp.hypes import get_key
from opencood_ddp.metrics.communication import CommunicationSummary, FrameCommunication
from opencood_ddp.models.communication import BOX_BYTES, boxes_above, bytes_per_cav_frame


class CommunicationMeter:
    """Per-frame figures from the model's output and the frame's test batch; ``summary``, their metric."""

    def __init__(self, dense_bytes: Optional[int], late: bool, score_threshold: float):
        self.dense_bytes, self.late, self.score_threshold = dense_bytes, late, float(score_threshold)
        self.summary = CommunicationSummary(dense_bytes, late)

    @classmethod
    def of(cls, hypes: Mapping, fusion_method: str) -> Optional["CommunicationMeter"]:
        """The meter of the evaluated fusion, or None where nothing is metered (early fusion, a model whose class
        does not say what it sends)."""
        late = fusion_method == "late"
        dense = None if late else bytes_per_cav_frame(hypes)
        if not late and (fusion_method != "intermediate" or dense is None):
            return None
        return cls(dense, late, get_key(hypes, "postprocess.target_args.score_threshold", 0.0))

    def frame(self, output: Mapping[str, Any], frame: Mapping[str, Any]) -> FrameCommunication:
        """``output``: the frame's model outputs keyed like its test batch (``ego``; every CAV for late fusion)."""
        if self.late:
            boxes = sum(boxes_above(out["psm"], self.score_threshold) for cav, out in output.items() if cav != "ego")
            return FrameCommunication(len(output) - 1, float(BOX_BYTES * boxes))
        senders = int(frame["ego"]["record_len"].sum().item()) - 1
        ego = output["ego"]
        if "comm_rate" not in ego:
            return FrameCommunication(senders, float(senders * self.dense_bytes))
        rate, com = float(ego["comm_rate"].item()), float(ego["com"].item())
        return FrameCommunication(senders, senders * self.dense_bytes * rate, rate, com)


__all__ = ["CommunicationMeter"]
