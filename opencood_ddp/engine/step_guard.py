"""Non-finite losses and gradients: found on any rank, agreed by all, reported with the samples behind them.

A NaN on one rank poisons every rank: DDP averages the gradients and SyncBN the batch statistics. So each rank
checks its own losses and the (already averaged) gradients, the flag travels with the step's loss all-reduce,
and every rank takes the same decision: stop (and save the state from before the step) or skip the step
together. The forward pass has already folded the bad batch into the BatchNorm running statistics, so the
buffers are put back as they were before the step in both cases.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, Optional, Sequence, get_args

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: options.py imports this module for its policies
    from opencood_ddp.engine.loss_sums import LossSums

NonfinitePolicy = Literal["stop", "skip"]
NONFINITE_POLICIES: tuple = get_args(NonfinitePolicy)


def gradient_norm(model: nn.Module) -> Optional[torch.Tensor]:
    """The 2-norm of all gradients, left on their device (None without any): torch's get_total_norm, bit for bit
    (a foreach norm per device and dtype, the norms stacked in that order, their norm), and finite exactly when
    every gradient is (torch's norms overflow alike); read with the step's losses in one transfer
    (LossSums.settle). Not get_total_norm itself: it calls ``.to`` on every gradient's norm, a call per parameter
    in every step (73 in the full-size AttFuse) that launches nothing but costs the host, which bounds a GPU step
    at small batches (issue 52)."""
    groups = _by_device_and_dtype([p.grad for p in model.parameters() if p.grad is not None])
    if not groups:
        return None
    norms = [norm for grads in groups for norm in torch._foreach_norm(grads, 2.0)]
    if len({grads[0].device for grads in groups}) > 1:
        norms = [norm.to(groups[0][0].device) for norm in norms]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by (device, dtype), each group in their order, the groups in order of first appearance
    (get_total_norm's): torch's foreach kernels take their fast path only for lists of one device and dtype."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


class BufferSnapshot:
    """Room for a copy of a module's buffers (BatchNorm running statistics), made once and filled before each step
    (`take`), to undo that step's forward passes (`restore`).

    Why not a fresh clone per step: that is a kernel launch per buffer in every step (69 in the full-size AttFuse,
    23 batch norms), which a launch-bound GPU step pays on the host (issue 52). Here a step costs one foreach copy
    per (device, dtype) group: the float statistics and the integer batch counters, two for a model of batch norms."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._buffers: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (buffers, their copies)

    def take(self) -> None:
        """Copy the buffers as they are now. Storage is made again only when the module's buffers are other
        tensors than last time (a buffer re-registered, a module moved to another device or dtype)."""
        buffers = list(self._model.buffers())
        if len(buffers) != len(self._buffers) or any(a is not b for a, b in zip(buffers, self._buffers)):
            self._buffers = buffers
            self._groups = [(live, [torch.empty_like(b) for b in live]) for live in _by_device_and_dtype(buffers)]
        with torch.no_grad():
            for live, saved in self._groups:
                torch._foreach_copy_(saved, live)

    def restore(self) -> None:
        """Put back the buffers `take` copied."""
        with torch.no_grad():
            for live, saved in self._groups:
                torch._foreach_copy_(live, saved)


class StepGuard:
    """The fit loop's device work around a training step, beside the model's own: before the step, the copy of the
    buffers that undoes it; after the backward, the gradients' 2-norm, read with the step's losses in one transfer
    (the step's one device wait). The trainer's, and engine/census.py's trainer_step, so that benchmarks count and
    time it."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._buffers = BufferSnapshot(model)

    def before_step(self) -> None:
        self._buffers.take()

    def settle(self, sums: LossSums, scaler: Optional[torch.amp.GradScaler]) -> tuple[list[list[float]], list[float]]:
        """`sums.settle` with the gradient norm: the step's loss rows, and [norm] or [] (no gradient, or a
        GradScaler: overflowing float16 gradients are the scaler's to skip, and it lowers its scale)."""
        norm = gradient_norm(self._model) if scaler is None else None
        return sums.settle(extra=[norm] if norm is not None else [])

    def undo_buffers(self) -> None:
        """The buffers as before_step found them: the forward passes of a step not taken are undone."""
        self._buffers.restore()


def rank_report(rank: int, samples: Sequence[Sequence[int]], losses: Sequence[float], grads_ok: bool) -> dict:
    """What one rank saw in a step: its micro-batches' sample indices and losses, and its gradient check."""
    return {"rank": rank, "samples": [list(map(int, s)) for s in samples], "losses": list(losses),
            "grads_ok": grads_ok}


def describe_nonfinite(where: str, global_step: int, reports: Sequence[dict]) -> str:
    """One line: where, which ranks and samples gave a non-finite loss, which ranks saw non-finite gradients."""
    bad_losses = []
    for report in reports:
        for samples, loss in zip(report["samples"], report["losses"]):
            if not math.isfinite(loss):
                bad_losses.append(f"rank {report['rank']} samples {samples} (loss {loss})")
    bad_grads = [str(report["rank"]) for report in reports if not report["grads_ok"]]
    parts = [f"non-finite values at {where} (global step {global_step})"]
    if bad_losses:
        parts.append("loss: " + ", ".join(bad_losses))
    if bad_grads:
        step_samples = ", ".join(f"rank {r['rank']} {sum(r['samples'], [])}" for r in reports)
        parts.append(f"gradients on rank(s) {', '.join(bad_grads)} (samples of the step: {step_samples})")
    return "; ".join(parts)
