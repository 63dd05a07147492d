"""The evaluation's communication figures over the split: what the non-ego CAVs sent, summed from the frames.

Each frame's figures (``FrameCommunication``) are measured on the rank that evaluated it, from the model's output
(``tasks/communication.py``'s ``CommunicationMeter``; the definitions are ``models/communication.py``'s), and
travel to rank 0 with the frame's detection statistics (``MeteredFrameStats``). ``CommunicationSummary`` turns
them, in dataset order, into eval.yaml's keys:

- ``bytes_per_cav_frame``: bytes sent per non-ego CAV and frame, over the split (total bytes / total non-ego CAVs
  of all frames). Dense intermediate fusion: ``models.communication.bytes_per_cav_frame`` exactly. Where2comm: that
  dense figure x the frames' ``comm_rate``. Late fusion: ``BOX_BYTES`` x the boxes above the score threshold.
- Where2comm only: ``bytes_per_cav_frame_dense`` (every cell sent), ``comm_rate`` (ours: the share of the non-ego
  CAVs' cells sent, pooled over all frames, 0 without a non-ego CAV) and ``com`` (OpenCOOD's: the mean over frames
  of the share of thresholded cells of every CAV, the ego's included, on the heads' grid).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from opencood_ddp.metrics.detection import FrameStats


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


@dataclass(frozen=True)
class CommunicationSummary:
    """The frames' communication -> eval.yaml's figures. ``dense_bytes``: what one CAV sends when it sends every
    cell (None for late fusion, which sends boxes)."""

    dense_bytes: Optional[int]
    late: bool

    def __call__(self, frames: Sequence[FrameCommunication]) -> dict:
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


__all__ = ["CommunicationSummary", "FrameCommunication", "MeteredFrameStats"]
