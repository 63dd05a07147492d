"""What a training run shows and records, as hooks the fit loop calls: the progress bar, the epoch line, the
TensorBoard scalars and rank 0's `train_steps.csv`.

The loop calls every hook on every rank, in the same order, with values that are already the same on every rank
(losses all-reduced, lr and step counters agreed). A hook issues no collective of its own, so adding, removing or
reordering hooks cannot make one rank's collectives differ from another's; what a hook writes, it writes on rank 0
only. A user's own hook subclasses `TrainHook` and overrides what it needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from opencood_ddp.engine.logs import StepLog, get_logger, progress, summary_writer


@dataclass
class StepRecord:
    """One optimizer step: the loss parts all-reduced over ranks (the same on every rank) and this rank's
    timing; data_seconds is the part of `seconds` spent waiting for the loader."""

    step: int
    epoch: int
    losses: dict
    lr: float
    seconds: float
    data_seconds: float
    skipped: bool = False  # a non-finite step that every rank skipped (--on_nonfinite skip)
    # fp16 only (None without a GradScaler): the scaler found overflowing gradients and skipped the step. Its
    # loss is finite and counts in the epoch's mean, as in upstream's loop.
    scaler_skipped: Optional[bool] = None

    def row(self, global_batch: int) -> dict:
        row = {"step": self.step, "epoch": self.epoch + 1, **self.losses, "lr": self.lr,
               "seconds": round(self.seconds, 6), "data_seconds": round(self.data_seconds, 6),
               "samples_per_s": round(global_batch / self.seconds, 3), "skipped": int(self.skipped)}
        if self.scaler_skipped is not None:
            row["scaler_skipped"] = int(self.scaler_skipped)
        return row


@dataclass
class EpochSummary:
    """A finished epoch (1-based `epoch`): all-reduced mean losses, validation means when it validated."""

    epoch: int
    epochs: int
    train: dict
    val: Optional[dict]
    lr: float
    timing: str


class TrainHook:
    """Every method is called on every rank; the default does nothing."""

    def on_resume(self, global_step: int) -> None:
        """The run folder existed; training goes on after `global_step` (0: from the start)."""

    def on_epoch_start(self, epoch: int, epochs: int, done_steps: int, steps_per_epoch: int) -> None:
        """Epoch `epoch` (0-based) starts, `done_steps` of its steps already taken by a resumed run."""

    def on_step(self, record: StepRecord, global_batch: int) -> None:
        """An optimizer step ended (also a step every rank skipped)."""

    def on_epoch_exit(self) -> None:
        """The epoch's steps ended: all of them, --max_steps, a stop signal or an error."""

    def on_epoch_end(self, summary: EpochSummary) -> None:
        """The epoch finished, was validated (when due) and is about to be saved."""

    def on_fit_end(self) -> None:
        """fit() returned normally."""

    def close(self) -> None:
        """The run ends, normally or not."""


class Hooks(TrainHook):
    """The run's hooks as one: each call goes to every hook, in their order."""

    def __init__(self, hooks: Sequence[TrainHook] = ()):
        self.hooks = list(hooks)

    def on_resume(self, global_step: int) -> None:
        for hook in self.hooks:
            hook.on_resume(global_step)

    def on_epoch_start(self, epoch: int, epochs: int, done_steps: int, steps_per_epoch: int) -> None:
        for hook in self.hooks:
            hook.on_epoch_start(epoch, epochs, done_steps, steps_per_epoch)

    def on_step(self, record: StepRecord, global_batch: int) -> None:
        for hook in self.hooks:
            hook.on_step(record, global_batch)

    def on_epoch_exit(self) -> None:
        for hook in self.hooks:
            hook.on_epoch_exit()

    def on_epoch_end(self, summary: EpochSummary) -> None:
        for hook in self.hooks:
            hook.on_epoch_end(summary)

    def on_fit_end(self) -> None:
        for hook in self.hooks:
            hook.on_fit_end()

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


class ProgressHook(TrainHook):
    """tqdm's bar of the epoch on rank 0 (a disabled bar elsewhere), with loss, samples/s and data wait."""

    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.bar = None

    def on_epoch_start(self, epoch: int, epochs: int, done_steps: int, steps_per_epoch: int) -> None:
        self.bar = progress(steps_per_epoch, f"epoch {epoch + 1}/{epochs}", self.is_main)
        self.bar.update(done_steps)

    def on_step(self, record: StepRecord, global_batch: int) -> None:
        self.bar.set_postfix(loss=f"{record.losses['loss']:.4f}", samples_per_s=f"{global_batch / record.seconds:.1f}",
                             data=f"{100 * record.data_seconds / record.seconds:.0f}%")
        self.bar.update(1)

    def on_epoch_exit(self) -> None:
        if self.bar is not None:
            self.bar.close()  # also on a stop or an error, whose line must not run on from the bar's
            self.bar = None

    close = on_epoch_exit


class EpochLineHook(TrainHook):
    """The epoch's one line in the log: train and validation means, lr and throughput."""

    def on_epoch_end(self, summary: EpochSummary) -> None:
        line = f"epoch {summary.epoch}/{summary.epochs} train " + _means(summary.train)
        if summary.val is not None:
            line += " | val " + _means(summary.val)
        get_logger().info(line + f" | lr {summary.lr:g} | {summary.timing}")


class TensorBoardHook(TrainHook):
    """Rank 0's one SummaryWriter of the run: train/<loss part> and train/lr per step, val/<part> per epoch.
    The writer opens at the first scalar, so a run that fails before its first step leaves no event file."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.run_dir, self.is_main = Path(run_dir), is_main
        self._writer = None
        self._purge_step: Optional[int] = None

    def on_resume(self, global_step: int) -> None:
        # The steps past the checkpoint are trained again: TensorBoard drops what the earlier file holds of them.
        self._purge_step = global_step + 1

    def _scalar(self, tag: str, value: float, step: int) -> None:
        # A step every rank skipped has non-finite losses: tensorboardX would print a warning per scalar, and
        # the CSV and the epoch line already say it was skipped.
        if not self.is_main or not math.isfinite(value):
            return
        if self._writer is None:
            self._writer = summary_writer(self.run_dir, self._purge_step)
        self._writer.add_scalar(tag, value, step)

    def on_step(self, record: StepRecord, global_batch: int) -> None:
        for name, value in record.losses.items():
            self._scalar(f"train/{name}", value, record.step)
        self._scalar("train/lr", record.lr, record.step)

    def on_epoch_end(self, summary: EpochSummary) -> None:
        for name, value in (summary.val or {}).items():
            self._scalar(f"val/{name}", value, summary.epoch)

    def on_fit_end(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class StepCsvHook(TrainHook):
    """Rank 0's `train_steps.csv` (engine/logs.StepLog): one row per optimizer step; a resume first drops the
    rows of steps past its checkpoint, which are trained again."""

    def __init__(self, run_dir: Path, is_main: bool):
        self.log = StepLog(run_dir, is_main)

    def on_resume(self, global_step: int) -> None:
        self.log.keep_until(global_step)

    def on_step(self, record: StepRecord, global_batch: int) -> None:
        self.log.write(record.row(global_batch))


def default_hooks(run_dir: Path, is_main: bool) -> Hooks:
    """What tools/train_ddp.py shows and records, in this order."""
    return Hooks([ProgressHook(is_main), StepCsvHook(run_dir, is_main), TensorBoardHook(run_dir, is_main),
                  EpochLineHook()])


def _means(values: dict) -> str:
    return " ".join(f"{name}={value:.4f}" for name, value in values.items())
