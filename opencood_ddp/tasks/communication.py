"""The evaluation's communication figures: what the non-ego CAVs sent, per frame and over the split.

Definitions in ``models/communication.py``. Per frame (``FrameCommunication``, gathered with the detection
statistics): the frame's non-ego CAVs and the bytes they sent together; for Where2comm also the two rates of the
model's output. The summary (``CommunicationMeter.summary``, written into eval.yaml):

- ``bytes_per_cav_frame``: bytes sent per non-ego CAV and frame, over the split (total bytes / total non-ego CAVs
  of all frames). Dense intermediate fusion: ``models.communication.bytes_per_cav_frame`` exactly. Where2comm: that
  dense figure x the frames' ``comm_rate``. Late fusion: ``BOX_BYTES`` x the boxes above the score threshold.
- Where2comm only: ``bytes_per_cav_frame_dense`` (every cell sent), ``comm_rate`` (ours: the share of the non-ego
  CAVs' cells sent, pooled over all frames, 0 without a non-ego CAV) and ``com`` (OpenCOOD's: the mean over frames
  of the share of thresholded cells of every CAV, the ego's included, on the heads' grid).

A model's rates describe its whole batch: with ``--batch_size`` > 1 every frame of a batch carries the batch's,
and the pooled figures are the same up to float rounding. Early fusion is not metered (None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from opencood_ddp.hypes import get_key
from opencood_ddp.metrics import FrameStats
from opencood_ddp.models.communication import BOX_BYTES, boxes_above, bytes_per_cav_frame


@dataclass(frozen=True)
class FrameCommunication:
    """One frame's communication, plain Python numbers (picklable, gathered to rank 0)."""

    senders: int  # the frame's non-ego CAVs
    bytes_sent: float  # what they sent together
    comm_rate: Optional[float] = None  # Where2comm's rates of the batch the frame was evaluated in
    com: Optional[float] = None


@dataclass(frozen=True)
class MeteredFrameStats(FrameStats):
    """A frame's detection statistics (what AP and the curves read) with its communication."""

    communication: Optional[FrameCommunication] = None

    @classmethod
    def of(cls, stats: FrameStats, communication: FrameCommunication) -> "MeteredFrameStats":
        return cls(stats.by_threshold, communication)


class CommunicationMeter:
    """Per-frame figures from the model's output and the frame's test batch, and their summary."""

    def __init__(self, dense_bytes: Optional[int], late: bool, score_threshold: float):
        self.dense_bytes, self.late, self.score_threshold = dense_bytes, late, float(score_threshold)

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

    def summary(self, frames: Sequence[FrameCommunication]) -> dict:
        senders = sum(f.senders for f in frames)
        sent = sum(f.bytes_sent for f in frames)
        rated = [f for f in frames if f.comm_rate is not None]
        # Without a single non-ego CAV only a dense model still has a figure: what one would send.
        idle = None if self.late or rated else self.dense_bytes
        summary: dict = {"bytes_per_cav_frame": sent / senders if senders else idle}
        if rated:
            summary["bytes_per_cav_frame_dense"] = self.dense_bytes
            pooled = sum(f.senders * f.comm_rate for f in rated)
            summary["comm_rate"] = pooled / senders if senders else 0.0
            summary["com"] = sum(f.com for f in rated) / len(rated)
        return summary


__all__ = ["CommunicationMeter", "FrameCommunication", "MeteredFrameStats"]
