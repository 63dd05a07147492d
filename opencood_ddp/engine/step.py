"""The mechanics of one training step, shared by the fit loop (`engine/trainer.py`) and the batch-fit probes
(`engine/batch_fit.py`), so that a probe measures the step the run will take.

- `Precision` is the ``--half`` policy: autocast to float16 on CUDA (with a GradScaler, since float16 gradients
  underflow) and to bfloat16 on the CPU (no scaler: bfloat16 has float32's exponent range); ``--half bf16`` or
  ``--half fp16`` picks the type on either. Without ``--half`` everything stays float32. The models keep a few
  computations in float32 under autocast (models/modules/precision.py).
- `forward_backward` runs the task's step on a micro-batch under that policy and back-propagates its loss
  divided by the number of micro-batches of the step.
- The optimizer's step (through the scaler when there is one) is engine/trainer.py's `optimizer_step`, on the
  fit loop's reading path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Literal, Optional, Union, get_args

import torch
from torch import nn

from opencood_ddp.engine.task import LossOutput, StepFn
from opencood_ddp.numerics.batch_counts import counts_added_together


HalfMode = Literal["auto", "fp16", "bf16"]  # --half [fp16|bf16]; a bare --half is "auto"
HALF_MODES: tuple = get_args(HalfMode)
DTYPE_OF_HALF_MODE = {"fp16": torch.float16, "bf16": torch.bfloat16}  # numerics.autocast.HALF_DTYPES: the dtypes


@dataclass(frozen=True)
class Precision:
    """half: None or False for float32; "auto" (or True) for float16 on CUDA and bfloat16 on the CPU; "fp16" or
    "bf16" for that type on either."""

    half: Union[bool, str, None]
    device: torch.device

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        if not self.half:
            return None
        if self.half is True or self.half == "auto":
            return torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return DTYPE_OF_HALF_MODE[self.half]

    def autocast(self) -> ContextManager:
        dtype = self.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def new_scaler(self) -> Optional[torch.amp.GradScaler]:
        """float16 needs a GradScaler (its gradients underflow); bfloat16 has float32's exponent range."""
        return torch.amp.GradScaler(self.device.type) if self.autocast_dtype == torch.float16 else None


def forward_backward(step: StepFn, model: nn.Module, batch: Any, precision: Precision,
                     scaler: Optional[torch.amp.GradScaler], micro_batches: int = 1) -> LossOutput:
    """The task's step output for `batch`, its total loss / `micro_batches` back-propagated (scaled if a scaler
    is given), so that the gradients summed over a step's micro-batches are the mean over its batch."""
    # the batch norms' counts in one foreach add at the forward's end, not a launch per layer (numerics/batch_counts)
    with precision.autocast(), counts_added_together():
        out = step(model, batch)
    # x / 1 is x, bit for bit, and so is its gradient: no division, forward or backward, in a step of one micro-batch
    loss = out.total if micro_batches == 1 else out.total / micro_batches
    (scaler.scale(loss) if scaler is not None else loss).backward()
    return out


__all__ = ["Precision", "forward_backward", "HalfMode", "HALF_MODES"]
