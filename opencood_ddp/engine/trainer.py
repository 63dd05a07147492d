"""The fit loop: epochs of accumulated, DDP-synchronised steps, all-reduced validation, rank-0 checkpoints.

Invariants that make an N-rank run follow the 1-rank run:
- every rank takes the same number of optimizer steps per epoch (drop_last samplers; trailing micro-batches
  that do not fill a step are dropped everywhere), so no rank waits in a collective the others skipped;
- the loss is a mean over the local batch and DDP averages gradients over equal-sized rank batches, so the
  gradient is the global-batch mean; with accumulation the loss is divided by the number of micro-steps and
  DDP synchronises only on the last one (`no_sync`);
- the optimizer, scheduler, checkpoints and validation use `model_without_ddp`.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opencood_ddp.distributed import checkpoint as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import BatchPlan
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
from opencood_ddp.distributed.samplers import EvalShardSampler, make_train_batch_sampler, steps_per_epoch
from opencood_ddp.engine.logging import StepLog, get_logger, progress
from opencood_ddp.engine.optim import build_optimizer, build_scheduler
from opencood_ddp.engine.task import Task
from opencood_ddp.hypes import get_key


@dataclass
class TrainSettings:
    """What the fit loop needs beyond the task and the plan (from hypes and flags)."""

    epochs: int
    seed: int
    eval_freq: int = 1
    save_freq: int = 1
    num_workers: int = 0
    find_unused_parameters: bool = False
    half: bool = False
    sync_bn: bool = True
    keep_states: int = 2
    max_steps: Optional[int] = None  # end the run after this many optimizer steps (smoke tests, parity checks)
    reverse_batch_order: bool = False  # same batches, samples reversed: a rounding-only change (parity noise floor)

    @classmethod
    def from_hypes(cls, hypes: dict, seed: int, num_workers: int, half: bool, sync_bn: bool,
                   max_steps: Optional[int] = None, reverse_batch_order: bool = False) -> "TrainSettings":
        return cls(epochs=hypes["train_params"]["epoches"], seed=seed,
                   eval_freq=get_key(hypes, "train_params.eval_freq", 1),
                   save_freq=get_key(hypes, "train_params.save_freq", 1), num_workers=num_workers,
                   find_unused_parameters=bool(get_key(hypes, "train_params.find_unused_parameters", False)),
                   half=half, sync_bn=sync_bn, max_steps=max_steps,
                   reverse_batch_order=reverse_batch_order)


@dataclass
class Progress:
    """Counters saved in the training state."""

    epoch: int = 0  # epochs completed
    global_step: int = 0
    best_val: float = math.inf
    best_epoch: Optional[int] = None
    history: list = field(default_factory=list)  # per epoch: {'epoch', 'train', 'val'}


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

    def row(self, global_batch: int) -> dict:
        return {"step": self.step, "epoch": self.epoch + 1, **self.losses, "lr": self.lr,
                "seconds": round(self.seconds, 6), "data_seconds": round(self.data_seconds, 6),
                "samples_per_s": round(global_batch / self.seconds, 3)}


class _Sums:
    """Sample-weighted sums of the loss and its parts on this rank, reduced over ranks on demand."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.values: list[float] = []
        self.count = 0

    def add(self, total: torch.Tensor, parts: dict, n: int) -> None:
        items = {"loss": total, **parts}
        if not self.names:
            self.names = list(items)
            self.values = [0.0] * len(items)
        for i, name in enumerate(self.names):
            self.values[i] += float(items[name].detach()) * n
        self.count += n

    def reduced_means(self, names: Optional[list[str]] = None) -> dict:
        names = names or self.names
        values = self.values or [0.0] * len(names)
        totals = comm.all_reduce_sum(values + [float(self.count)])
        count = totals[-1].item()
        return {name: (totals[i].item() / count if count else math.nan) for i, name in enumerate(names)}


class Trainer:
    def __init__(self, task: Task, plan: BatchPlan, env: DistEnv, settings: TrainSettings, hypes: dict,
                 run_dir: Path, writer: Any):
        self.task, self.plan, self.env, self.settings = task, plan, env, settings
        self.run_dir, self.writer, self.log = Path(run_dir), writer, get_logger()
        self.device = torch.device(env.device)
        self.model_without_ddp, self.sync_bn_kind = convert_sync_batchnorm(
            task.model.to(self.device), env.world_size, env.device, enabled=settings.sync_bn)
        self.model = self._wrap(self.model_without_ddp)
        self.optimizer = build_optimizer(hypes, self.model_without_ddp.parameters(), plan.effective_lr)
        self.scheduler = build_scheduler(hypes, self.optimizer)
        self.scaler = torch.amp.GradScaler("cuda") if settings.half and self.device.type == "cuda" else None
        self.batch_sampler = make_train_batch_sampler(task.train_set, plan.per_rank, env.world_size, env.rank,
                                                      settings.seed, plan.accumulation,
                                                      reverse=settings.reverse_batch_order)
        self.steps_per_epoch = steps_per_epoch(self.batch_sampler, plan.accumulation)
        self.progress = Progress()
        self.step_log = StepLog(self.run_dir, env.is_main)
        self.last_weights: Optional[Path] = None  # the newest weights this run wrote (same value on every rank)

    # ------------------------------------------------------------------------------------------------ set-up
    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.env.distributed:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids,
                                       find_unused_parameters=self.settings.find_unused_parameters)

    def restore(self, epoch: int) -> None:
        """Continue after `epoch`: weights, and the training state when the run left one."""
        ckpt.load_weights(self.model_without_ddp, self.run_dir / ckpt.weights_name(epoch))
        state = ckpt.load_training_state(self.run_dir, epoch)
        if state is None:
            self.log.warning(f"no {ckpt.state_name(epoch)} in {self.run_dir}: resuming from the weights alone "
                             f"(optimizer restarts, lr schedule advanced to epoch {epoch})")
            for _ in range(epoch):
                if self.scheduler is not None:
                    self.scheduler.step()
            self.progress = Progress(epoch=epoch, global_step=epoch * self.steps_per_epoch)
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        rng = state["rng"]
        ckpt.set_rng_state(rng[self.env.rank] if len(rng) == self.env.world_size else rng[0])
        self.progress = Progress(epoch=epoch, global_step=state["global_step"], best_val=state["best_val"],
                                 best_epoch=state["best_epoch"], history=list(state.get("history", [])))
        self._warn_plan_change(state.get("batch_plan", {}))
        if self.env.is_main:
            self.step_log.keep_until(self.progress.global_step)

    def _warn_plan_change(self, saved: dict) -> None:
        if saved and saved.get("global_batch") != self.plan.global_batch:
            self.log.warning(f"this run was trained with effective batch {saved.get('global_batch')}; the resumed "
                             f"part uses {self.plan.global_batch}: not the same training")

    # ----------------------------------------------------------------------------------------------- loop
    def fit(self) -> Progress:
        if self.progress.epoch >= self.settings.epochs:
            self.log.info(f"nothing to do: {self.progress.epoch} of {self.settings.epochs} epochs already trained")
        first_step = self.progress.global_step
        for epoch in range(self.progress.epoch, self.settings.epochs):
            trained = self.train_one_epoch(epoch)
            if trained is None:  # --max_steps ended the epoch early
                break
            train_means, timing = trained
            if self.scheduler is not None:
                self.scheduler.step()
            val_means = self.validate() if self._due(epoch, self.settings.eval_freq) else None
            self.progress.epoch = epoch + 1
            self.progress.history.append({"epoch": epoch + 1, "train": train_means, "val": val_means})
            self._log_epoch(epoch + 1, train_means, val_means, timing)
            self._save(epoch + 1, val_means)
        if self._max_steps_reached() and self.progress.global_step > first_step:
            self._save_step_weights()
        self.writer.flush()
        return self.progress

    def _max_steps_reached(self) -> bool:
        return self.settings.max_steps is not None and self.progress.global_step >= self.settings.max_steps

    def _due(self, epoch: int, freq: int) -> bool:
        # Upstream checks `epoch % freq == 0` on the 0-based epoch; the last epoch is always covered here.
        return epoch % freq == 0 or epoch + 1 == self.settings.epochs

    def train_loader(self, epoch: int) -> DataLoader:
        self.batch_sampler.sampler.set_epoch(epoch)
        set_epoch = getattr(self.task.train_set, "set_epoch", None)
        if callable(set_epoch):  # per-sample augmentation keyed by (seed, epoch, index)
            set_epoch(epoch)
        return DataLoader(self.task.train_set, batch_sampler=self.batch_sampler, collate_fn=self.task.collate_train,
                          num_workers=self.settings.num_workers, pin_memory=self.device.type == "cuda")

    def _autocast(self):
        if not self.settings.half:
            return contextlib.nullcontext()
        dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _micro_step(self, batch: Any, sync: bool, sums: _Sums) -> None:
        batch = self.task.move_to(batch, self.device)
        no_sync = self.model.no_sync if isinstance(self.model, DistributedDataParallel) and not sync else None
        with no_sync() if no_sync else contextlib.nullcontext():
            with self._autocast():
                out = self.task.step(self.model, batch)
            loss = out.total / self.plan.accumulation
            (self.scaler.scale(loss) if self.scaler else loss).backward()
        sums.add(out.total, dict(out.parts), self.task.batch_size_of(batch))

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps(self, epoch: int, into: Optional[_Sums] = None) -> Iterator[StepRecord]:
        """The optimizer steps of one epoch, one record each; stops early at settings.max_steps.

        Every rank runs the same number of steps, so the all-reduce of each step's losses always matches.
        """
        self.model.train()
        batches: Iterator = iter(self.train_loader(epoch))
        for _ in range(self.steps_per_epoch):
            if self._max_steps_reached():
                return
            started, waited = time.perf_counter(), 0.0
            step_sums = _Sums()
            for micro in range(self.plan.accumulation):
                fetch = time.perf_counter()
                batch = next(batches)
                waited += time.perf_counter() - fetch
                self._micro_step(batch, sync=micro == self.plan.accumulation - 1, sums=step_sums)
            self._optimizer_step()
            self.progress.global_step += 1
            lr = self.optimizer.param_groups[0]["lr"]
            means = step_sums.reduced_means()
            if into is not None:
                _merge(into, step_sums)
            yield StepRecord(self.progress.global_step, epoch, means, lr, time.perf_counter() - started, waited)

    def train_one_epoch(self, epoch: int) -> Optional[tuple[dict, str]]:
        """(all-reduced mean losses, throughput text) of the epoch; None when --max_steps stopped it early."""
        epoch_sums = _Sums()
        bar = progress(self.steps_per_epoch, f"epoch {epoch + 1}/{self.settings.epochs}", self.env.is_main)
        records = []
        for record in self.steps(epoch, into=epoch_sums):
            self._log_step(record, bar)
            records.append(record)
        bar.close()
        means = epoch_sums.reduced_means()
        if len(records) < self.steps_per_epoch:
            return None
        return means, _timing(records, self.plan.global_batch)

    def _log_step(self, record: StepRecord, bar) -> None:
        for name, value in record.losses.items():
            self.writer.add_scalar(f"train/{name}", value, record.step)
        self.writer.add_scalar("train/lr", record.lr, record.step)
        self.step_log.write(record.row(self.plan.global_batch))
        bar.set_postfix(loss=f"{record.losses['loss']:.4f}",
                        samples_per_s=f"{self.plan.global_batch / record.seconds:.1f}",
                        data=f"{100 * record.data_seconds / record.seconds:.0f}%")
        bar.update(1)

    @torch.no_grad()
    def validate(self) -> Optional[dict]:
        """Sample-weighted mean loss over the whole validation split, identical at every world size."""
        if self.task.val_set is None:
            return None
        sampler = EvalShardSampler(len(self.task.val_set), self.env.world_size, self.env.rank)
        loader = DataLoader(self.task.val_set, batch_size=self.plan.per_rank, sampler=sampler,
                            collate_fn=self.task.collate_val, num_workers=self.settings.num_workers)
        model = self.model_without_ddp  # DDP's forward would issue collectives that uneven shards cannot match
        model.eval()
        sums = _Sums()
        for batch in loader:
            batch = self.task.move_to(batch, self.device)
            with self._autocast():
                out = self.task.step(model, batch)
            sums.add(out.total, dict(out.parts), self.task.batch_size_of(batch))
        model.train()
        return sums.reduced_means(names=self._loss_names(sums))

    def _loss_names(self, sums: _Sums) -> list[str]:
        # A rank with an empty shard has no names yet: take rank 0's so every rank reduces the same vector.
        return comm.broadcast_object(sums.names or None) or ["loss"]

    # ----------------------------------------------------------------------------------------------- output
    def _log_epoch(self, epoch: int, train: dict, val: Optional[dict], timing: str) -> None:
        text = " ".join(f"{k}={v:.4f}" for k, v in train.items())
        line = f"epoch {epoch}/{self.settings.epochs} train {text}"
        if val is not None:
            line += " | val " + " ".join(f"{k}={v:.4f}" for k, v in val.items())
            for name, value in val.items():
                self.writer.add_scalar(f"val/{name}", value, epoch)
        self.log.info(line + f" | lr {self.optimizer.param_groups[0]['lr']:g} | {timing}")

    def training_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "global_step": self.progress.global_step, "best_val": self.progress.best_val,
                "best_epoch": self.progress.best_epoch, "history": self.progress.history,
                "batch_plan": self.plan.as_dict(), "world_size": self.env.world_size, "seed": self.settings.seed}

    def _save(self, epoch: int, val: Optional[dict]) -> None:
        due = self._due(epoch - 1, self.settings.save_freq)  # the same on every rank
        # Every rank's RNG, so a resume continues each stream; gathered only when a checkpoint is written.
        rng = comm.gather_objects(ckpt.rng_state()) if due else None
        improved = val is not None and val["loss"] < self.progress.best_val
        if improved:
            self.progress.best_val, self.progress.best_epoch = val["loss"], epoch
        if due:
            self.last_weights = self.run_dir / ckpt.weights_name(epoch)
        if self.env.is_main:
            if due:
                path = ckpt.save_epoch(self.run_dir, epoch, self.model_without_ddp,
                                       dict(self.training_state(), rng=rng), self.settings.keep_states)
                self.log.info(f"saved {path}")
            if improved:
                self.log.info(f"new best validation loss {val['loss']:.4f}: saved "
                              f"{ckpt.save_bestval(self.run_dir, epoch, self.model_without_ddp)}")
        comm.barrier()  # no rank may start the next epoch (or exit) while rank 0 still writes

    def _save_step_weights(self) -> None:
        step = self.progress.global_step
        self.last_weights = self.run_dir / ckpt.step_weights_name(step)
        if self.env.is_main:
            path = ckpt.save_step_weights(self.run_dir, step, self.model_without_ddp)
            self.log.info(f"stopped after {step} optimizer steps (--max_steps): saved {path}")
        comm.barrier()


def _timing(records: list[StepRecord], global_batch: int) -> str:
    """Throughput of an epoch over all ranks, and how much of rank 0's step time went into waiting for data."""
    seconds = sum(r.seconds for r in records)
    waited = sum(r.data_seconds for r in records)
    return (f"{global_batch * len(records) / seconds:.1f} samples/s, {seconds:.1f} s, "
            f"data wait {100 * waited / seconds:.0f}%")


def _merge(into: _Sums, other: _Sums) -> None:
    if not into.names:
        into.names, into.values = list(other.names), [0.0] * len(other.names)
    for i, value in enumerate(other.values):
        into.values[i] += value
    into.count += other.count
