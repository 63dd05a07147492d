"""What every loss returns: the scalar to backpropagate and the detached parts to log."""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch


class LossTerms(NamedTuple):
    """``total``: a mean over the samples of the local batch (so DDP's gradient average is the global mean).
    ``parts``: detached, already weighted scalars for the logs (they sum to ``total``)."""

    total: torch.Tensor
    parts: Dict[str, torch.Tensor]
