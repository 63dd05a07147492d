"""The fit loop: epochs of accumulated, DDP-synchronised steps and all-reduced validation.

What the loop writes goes elsewhere: checkpoints, best-val weights and resume to RunCheckpointer
(engine/checkpointer.py), the progress bar, epoch line, TensorBoard and train_steps.csv to hooks
(engine/hooks.py). The loop keeps what decides the training: accumulation, the step agreement and the
non-finite policy.

Invariants that make an N-rank run follow the 1-rank run:
- every rank takes the same number of optimizer steps per epoch (drop_last samplers; trailing micro-batches
  that do not fill a step are dropped everywhere), so no rank waits in a collective the others skipped;
- the loss is a mean over the local batch and DDP averages gradients over equal-sized rank batches, so the
  gradient is the global-batch mean; with accumulation the loss is divided by the number of micro-steps and
  DDP synchronises only on the last one (`no_sync`);
- the optimizer, scheduler, checkpoints and validation use `model_without_ddp`; the scheduler moves after each
  epoch or each optimizer step, as its registry entry declares (upstream's lr at every step);
- whatever can happen on one rank alone (a frame that fails to load, a stop signal, a non-finite loss) is
  agreed on by all ranks at a step boundary, so they stop, skip or go on together (docs/reliability.md).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import BatchPlan
from opencood_ddp.distributed.ddp import wrap_ddp
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
from opencood_ddp.distributed.samplers import EvalShardSampler, make_train_batch_sampler, steps_per_epoch
from opencood_ddp.engine.capture import CapturedStep, CaptureModule, check_capture
from opencood_ddp.engine.checkpointer import ResumeRules, RunCheckpointer
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.hooks import EpochSummary, Hooks, StepRecord
from opencood_ddp.engine.loaders import training_loader, worker_options, workers_per_rank
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.loss_sums import LossSums
from opencood_ddp.engine.optim import build_optimizer, build_scheduler, load_optimizer_state
from opencood_ddp.engine.options import TrainOptions
from opencood_ddp.engine.preemption import StopSignal
from opencood_ddp.engine.run_dir import CONFIG_NAME, RunSetup
from opencood_ddp.engine.step import Precision, forward_backward
from opencood_ddp.engine.step_guard import StepGuard, describe_nonfinite, rank_report
from opencood_ddp.engine.task import Task
from opencood_ddp.errors import NonFiniteError, OpencoodDdpError, StopRequested, unwrap_worker_error
from opencood_ddp.hypes import get_key, section_digests


@dataclass(frozen=True)
class TrainSettings:
    """What the fit loop takes from the hypes (train_params; the seed already resolved by the recipe). The flags
    come as they were parsed: TrainOptions.loop."""

    epochs: int
    seed: int = 0
    eval_freq: int = 1
    save_freq: int = 1
    find_unused_parameters: bool = False

    @classmethod
    def from_hypes(cls, hypes: dict) -> "TrainSettings":
        return cls(epochs=hypes["train_params"]["epoches"], seed=get_key(hypes, "train_params.seed", 0),
                   eval_freq=get_key(hypes, "train_params.eval_freq", 1),
                   save_freq=get_key(hypes, "train_params.save_freq", 1),
                   find_unused_parameters=bool(get_key(hypes, "train_params.find_unused_parameters", False)))


@dataclass
class Progress:
    """Counters saved in the training state."""

    epoch: int = 0  # epochs completed
    global_step: int = 0
    step_in_epoch: int = 0  # steps of epoch `epoch` (the unfinished one) already taken: where a resume goes on
    best_val: float = math.inf
    best_epoch: Optional[int] = None
    history: list = field(default_factory=list)  # per epoch: {'epoch', 'train', 'val'}
    skipped_steps: list = field(default_factory=list)  # global steps skipped under --on_nonfinite skip


class Trainer:
    def __init__(self, task: Task, plan: BatchPlan, env: DistEnv, options: TrainOptions, setup: RunSetup,
                 hooks: Optional[Hooks] = None, stop_signal: Optional[StopSignal] = None):
        """The one way a trainer is built, for training and the benchmarks: the run's flags as parsed
        (`options`) and its set-up (`setup`: folder, resume, hypes). Complete once built: `hooks` (what the loop
        reports to; they write nothing before the first step or a resume) and `stop_signal` (checked at every
        step boundary; the caller enters it around `fit`)."""
        hypes = setup.hypes
        self.task, self.plan, self.env, self.options, self.setup = task, plan, env, options, setup
        self.loop, self.settings, self.hypes = options.loop, TrainSettings.from_hypes(hypes), hypes
        self.run_dir, self.hooks, self.log = Path(setup.run_dir), hooks or Hooks(), get_logger()
        self.stop_signal = stop_signal
        self.checkpointer = RunCheckpointer(self.run_dir, env.is_main, rules=ResumeRules(
            section_digests(hypes), plan.global_batch, options.run.allow_config_change, options.run.restart,
            setup.restarted_job))
        self.device = torch.device(env.device)
        self.model_without_ddp, self.sync_bn_kind = convert_sync_batchnorm(
            task.model.to(self.device), env.world_size, env.device, enabled=self.loop.sync_bn)
        check_capture(self.loop.capture, self.model_without_ddp)
        # --capture: DDP (on N ranks) wraps the model with the step (engine/capture.py), whose dense part runs
        # compiled.
        self.capture = None if self.loop.capture is None else CaptureModule(self.model_without_ddp, task.step,
                                                                             self.loop.capture, self.device)
        self.model = self._wrap(self.capture if self.capture is not None else self.model_without_ddp)
        self.train_step = CapturedStep() if self.capture is not None else task.step
        # Every parameter, where upstream passes the trainable ones only: a frozen one (backbone_fix) never has a
        # gradient, so torch's optimizers skip it alike, and the saved optimizer state keeps one layout whatever
        # is frozen (a resume that freezes the backbone loads it).
        self.optimizer = build_optimizer(hypes, self.model_without_ddp.parameters(), plan.effective_lr,
                                         kernels_for=self.device)
        self.precision = Precision(self.loop.half, self.device)
        self.scaler = self.precision.new_scaler()
        self.guard = StepGuard(self.model_without_ddp)
        self.batch_sampler = make_train_batch_sampler(task.train_set, plan.per_rank, env.world_size, env.rank,
                                                      self.settings.seed, plan.accumulation,
                                                      order=self.loop.batch_order)
        self.steps_per_epoch = steps_per_epoch(self.batch_sampler, plan.accumulation)
        self._new_schedule = lambda: build_scheduler(hypes, self.optimizer, self.steps_per_epoch)
        self.schedule = self._new_schedule()  # None: constant lr
        self._lr_of_last_step = self.optimizer.param_groups[0]["lr"]  # the lr the latest optimizer step ran with
        self.progress = Progress()
        self.phase = "start"  # where this rank is, published for peers that must explain a failed collective
        self._epoch_carry: Optional[dict] = None  # loss sums of the epoch a mid-epoch checkpoint interrupted
        self._epoch_sums = LossSums()  # this rank's loss sums of the epoch in progress
        # The fp16 GradScaler's skips of the epoch in progress (the same on every rank: it reads the all-reduced
        # gradients), carried over a mid-epoch checkpoint as its loss sums are; None where a resumed epoch's first
        # part is not known (a checkpoint written before the count was saved).
        self._epoch_scaler_skips: Optional[int] = 0
        self._scaler_skips_carry: Optional[int] = 0
        # Made on first use and kept: their workers are forked once and persist over the epochs (engine/loaders.py)
        self._train_loader: Optional[DataLoader] = None
        self._val_loader: Optional[DataLoader] = None
        # each loader's, per rank
        self.workers = workers_per_rank(options.process.num_workers, env, task_workers=task.gpu_workers)

    @property
    def last_weights(self) -> Optional[Path]:
        """The run's newest weights (the same on every rank): the checkpoint it resumed from, then each it writes."""
        return self.checkpointer.last_weights

    # ------------------------------------------------------------------------------------------------ set-up
    def _wrap(self, model: nn.Module) -> nn.Module:
        """``model`` in DDP where there are ranks to reduce over. One rank (a plain `python` run, or torchrun on one
        GPU) trains it unwrapped: DDP there copies every gradient into its bucket, all-reduces the rank with itself
        and hooks every forward, for the same numbers (the captured AttFuse step at batch 1 on the H200: 10.94 ms
        alone, 14.14 ms in DDP at world size 1; docs/ddp_semantics.md, "One rank runs no DDP")."""
        if not self.ddp:
            return model
        return wrap_ddp(model, self.settings.find_unused_parameters)  # its settings and why: distributed/ddp.py

    @property
    def ddp(self) -> bool:
        """Whether the step runs in DDP: more than one rank."""
        return self.env.world_size > 1

    def open_run(self) -> list[tuple[int, str]]:
        """Make the run folder this run's: for an existing run, continue from its newest checkpoint that loads and
        remove what a killed save left; then write config.yaml (its one write: nothing of an existing run is
        written before its checkpoint loaded; a resume with nothing left to train keeps it). Returns (logging
        level, message) pairs to log once the log file is attached."""
        notes: list[tuple[int, str]] = []
        if self.setup.resume:
            saved, rejected = self.resume()
            notes += [(logging.WARNING, f"{reason}: fell back to the checkpoint before it") for reason in rejected]
            removed = self.checkpointer.remove_unfinished_saves()
            if removed:
                notes.append((logging.INFO, f"removed {len(removed)} unfinished save(s) of a killed run: "
                                            f"{', '.join(removed)}"))
            if saved is not None:
                p = self.progress
                notes.append((logging.INFO, f"resumed from {saved.describe()}: {p.epoch} epoch(s) and "
                                            f"{p.step_in_epoch} step(s) of the next done, global step "
                                            f"{p.global_step}"))
        if self.setup.resume and self.nothing_left():
            # config.yaml says how the saved checkpoints were trained; a --set of this call trains nothing
            notes.append((logging.INFO, f"{CONFIG_NAME} kept as it was: this call has nothing left to train"))
        else:
            self.checkpointer.write_config(self.hypes, self.plan)
        return notes

    def resume(self) -> tuple[Optional[ckpt.SavedCheckpoint], list[str]]:
        """Continue from the newest checkpoint that loads (RunCheckpointer.resume): (that checkpoint or None,
        why newer ones were passed over). The hooks then drop what they recorded past it, which is trained
        again (with no checkpoint, everything)."""
        found = self.checkpointer.resume(self.model_without_ddp, self.steps_per_epoch)
        if found.saved is not None and found.fine_tune:
            self._restore_position(found.state, fine_tune=True)
            self._restore_schedule(None, found.saved)
        elif found.saved is not None:
            self._restore_training(found.saved, found.state)
        self.hooks.on_resume(self.progress.global_step)
        return found.saved, found.passed_over

    def _restore_training(self, saved: ckpt.SavedCheckpoint, state: Optional[dict]) -> None:
        if state is None:  # an upstream run: weights only
            epoch = saved.number
            self.log.warning(f"no {ckpt.state_name(epoch)} in {self.run_dir}: resuming from the weights alone "
                             f"(optimizer restarts, lr schedule advanced to the start of epoch {epoch + 1})")
            self.progress = Progress(epoch=epoch, global_step=epoch * self.steps_per_epoch)
            self._restore_schedule(None, saved)
            return
        load_optimizer_state(self.optimizer, state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._restore_position(state)
        self._restore_schedule(state.get("lr_scheduler"), saved)
        self._say_changed_step_flags(state)

    def step_flags(self) -> dict:
        """How this run's steps are computed, as the flags that chose it (--half, --capture: flags, not hypes, so
        config.yaml does not hold them; the training state does)."""
        dtype = self.precision.autocast_dtype
        return {"half": {torch.float16: "--half fp16", torch.bfloat16: "--half bf16"}.get(dtype, "no --half"),
                "capture": f"--capture {self.loop.capture}" if self.loop.capture else "no --capture"}

    def _say_changed_step_flags(self, state: dict) -> None:
        """A resume takes the flags it is given, and README's resume command gives none: a run trained under
        --half or --capture would go on in float32 or eagerly (its GradScaler state dropped) without a word."""
        for flag, now in self.step_flags().items():
            was = state.get("step_flags", {}).get(flag)  # None: a state saved before they were recorded
            if was is not None and was != now:
                fix = f"drop --{flag}" if was.startswith("no ") else f"pass {was}"
                self.log.warning(f"this run was trained with {was}; the resumed part runs with {now}: not the same "
                                 f"training ({fix} to go on as it was trained)")

    def _restore_position(self, state: dict, fine_tune: bool = False) -> None:
        """Where the run stands (epoch, step, history) and every rank's RNG. A fine-tune (another model section:
        a compressor added, the backbone frozen) keeps the count and the history but not the best validation
        loss, which was another model's; its optimizer restarts, as upstream's stages do."""
        rng = state["rng"]
        ckpt.set_rng_state(rng[self.env.rank] if len(rng) == self.env.world_size else rng[0], self.device)
        self.progress = Progress(epoch=state["epoch"], global_step=state["global_step"],
                                 step_in_epoch=state.get("step_in_epoch", 0),
                                 best_val=math.inf if fine_tune else state["best_val"],
                                 best_epoch=None if fine_tune else state["best_epoch"],
                                 history=list(state.get("history", [])),
                                 skipped_steps=list(state.get("skipped_steps", [])))
        self._epoch_carry = None if fine_tune else state.get("epoch_sums")
        mid_epoch = not fine_tune and state.get("step_in_epoch", 0) > 0
        self._scaler_skips_carry = state.get("epoch_scaler_skips") if mid_epoch else 0

    def _restore_schedule(self, saved_state: Optional[dict], saved: ckpt.SavedCheckpoint) -> None:
        """The lr schedule where an uninterrupted run is at the restored progress: the checkpoint's scheduler
        state when it is there (the exact step), else a fresh schedule advanced to that place, as upstream's
        loop is when it resumes from weights alone (cosineannealwarm: t = epoch x steps per epoch)."""
        if self.schedule is None:
            return
        place = self.schedule.steps_at(self.progress.epoch, self.progress.step_in_epoch)
        if saved_state is not None:
            self.schedule.load_state_dict(saved_state)
            if self.schedule.steps_taken() == place:
                return
            # A checkpoint whose scheduler moved at another interval (cosineannealwarm moved once per epoch before
            # it moved per optimizer step) or another number of steps per epoch (another global batch).
            self.log.warning(f"the lr schedule saved with {saved.weights.name} was stepped "
                             f"{self.schedule.steps_taken()} times where this run's position needs {place}: "
                             f"rebuilt at that position")
        self.schedule = self._new_schedule()
        self.schedule.advance(place)

    # ----------------------------------------------------------------------------------------------- loop
    def fit(self) -> Progress:
        """Every epoch from the progress on: its steps (each reported to the hooks), then its end (validation,
        checkpoint). --max_steps may end an epoch early; a mid-epoch checkpoint then holds the place."""
        if self.progress.epoch >= self.settings.epochs:
            self.log.info(f"nothing to do: {self.progress.epoch} of {self.settings.epochs} epochs already trained")
        elif self._max_steps_reached():  # a resume of a run that --max_steps stopped, with the same or a lower one
            self.log.info(f"nothing to do: the run is at step {self.progress.global_step}, --max_steps "
                          f"{self.loop.max_steps}; pass a higher --max_steps (or none) to train on")
            self.hooks.on_fit_end()  # no loader started, no epoch opened
            return self.progress
        first_step = self.progress.global_step
        try:
            with comm.collective_guard(lambda: self.phase):
                for epoch in range(self.progress.epoch, self.settings.epochs):
                    sums, records = self._start_epoch(epoch), []
                    try:
                        for record in self.steps(epoch, into=sums):
                            self.hooks.on_step(record, self.plan.global_batch)
                            records.append(record)
                    finally:
                        self.hooks.on_epoch_exit()
                    if self.progress.step_in_epoch < self.steps_per_epoch:  # --max_steps ended the epoch early
                        break
                    self._finish_epoch(epoch, sums, records)
                if self._max_steps_reached() and self.progress.global_step > first_step:
                    path = self._save_mid_epoch()
                    self.log.info(f"stopped after {self.progress.global_step} optimizer steps (--max_steps): "
                                  f"saved {path}")
        finally:
            self.close_loaders()
        self.hooks.on_fit_end()
        return self.progress

    def _start_epoch(self, epoch: int) -> LossSums:
        """The epoch's loss sums (a resumed epoch's carried over on rank 0), and the hooks told."""
        sums = LossSums.carried(self._epoch_carry, holder=self.env.is_main)
        self._epoch_carry = None
        self._epoch_scaler_skips, self._scaler_skips_carry = self._scaler_skips_carry, 0
        self._epoch_sums = sums
        self.hooks.on_epoch_start(epoch, self.settings.epochs, self.progress.step_in_epoch, self.steps_per_epoch)
        return sums

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of `epoch` (sample indices), the same list at every call."""
        self.batch_sampler.sampler.set_epoch(epoch)
        return list(self.batch_sampler)

    def train_loader(self, epoch: int, batches: Optional[list[list[int]]] = None) -> DataLoader:
        """The run's one training loader, set to `batches` (default: the whole epoch) of `epoch`: each index
        travels with its epoch, so that the persistent workers draw the epoch's augmentation."""
        if self._train_loader is None:
            self._train_loader = training_loader(self.task.train_set, self.task.collate_train,
                                                 self.workers, self.device.type == "cuda", self.settings.seed)
        self._train_loader.batch_sampler.use(epoch, batches if batches is not None else self.epoch_batches(epoch))
        return self._train_loader

    # ------------------------------------------------------------------------------------- one step, agreed
    def steps(self, epoch: int, into: Optional[LossSums] = None) -> Iterator[StepRecord]:
        """The optimizer steps of one epoch from progress.step_in_epoch on, one record each; stops early at
        --max_steps. Every rank runs the same steps, so the collectives of each step always match."""
        self.model.train()
        # A resumed epoch goes on where its checkpoint left it; any other epoch starts at its first step.
        first = self.progress.step_in_epoch if epoch == self.progress.epoch else 0
        accumulation = self.plan.accumulation
        batches = self.epoch_batches(epoch)[first * accumulation:self.steps_per_epoch * accumulation]
        loaded: Iterator = iter(self.train_loader(epoch, batches))
        for step in range(first, self.steps_per_epoch):
            if self._max_steps_reached():
                return
            where = f"epoch {epoch + 1} step {step + 1}"
            started = time.perf_counter()
            self._mark(f"{where}: loading data")
            micro_batches, error = self._fetch(loaded)
            waited = time.perf_counter() - started
            self._mark(f"{where}: step agreement")
            self._agree_to_go_on(error, epoch)
            self._mark(f"{where}: forward/backward (SyncBN, DDP gradient all-reduce)")
            offset = (step - first) * accumulation
            # The lr this step runs with, read before the scheduler moves past it.
            self._lr_of_last_step = self.optimizer.param_groups[0]["lr"]
            outcome = self._train_step(micro_batches, batches[offset:offset + accumulation], where)
            self.progress.global_step += 1
            self.progress.step_in_epoch = step + 1
            if self.schedule is not None:
                # Also after a skipped step: the lr is a function of the step's place in the run, as upstream's.
                self.schedule.after_optimizer_step()
            if outcome.scaler_skipped and self._epoch_scaler_skips is not None:
                self._epoch_scaler_skips += 1
            if into is not None and not outcome.skipped:
                # A step the GradScaler skipped still counts: its loss is finite, and upstream's loop counts it.
                into.merge(outcome.sums)
            yield StepRecord(self.progress.global_step, epoch, outcome.means, self._lr_of_last_step,
                             time.perf_counter() - started, waited, outcome.skipped, outcome.scaler_skipped)

    def _fetch(self, batches: Iterator) -> tuple[list, Optional[OpencoodDdpError]]:
        """The step's micro-batches, or the error that reading one of them raised on this rank."""
        fetched = []
        try:
            for _ in range(self.plan.accumulation):
                fetched.append(next(batches))
        except OpencoodDdpError as exc:
            return fetched, unwrap_worker_error(exc)
        except RuntimeError:
            if self._stop_requested() is None:
                raise
            # The signal that asks this rank to stop (SLURM signals every process of the step) also ended the
            # loader's workers; the step agreement that follows stops every rank here.
        return fetched, None

    def _stop_requested(self) -> Optional[str]:
        return self.stop_signal.received if self.stop_signal is not None else None

    def _agree_to_go_on(self, error: Optional[OpencoodDdpError], epoch: int) -> None:
        """All ranks meet before the forward pass: a rank that could not read its batch, or got a stop signal,
        makes every rank stop here, before any of them enters the step's gradient all-reduce."""
        stop = self._stop_requested()
        error, (stopping,) = comm.agree(error, flags=[stop is not None])
        if error is not None:
            raise error
        if stopping:
            signals = sorted({s for s in comm.all_gather_objects(stop) if s})
            path = self._save_mid_epoch()
            raise StopRequested(f"{'/'.join(signals)} received: stopped after global step "
                                f"{self.progress.global_step} (epoch {epoch + 1}, {self.progress.step_in_epoch} of "
                                f"{self.steps_per_epoch} steps); saved {path}; resume with --model_dir {self.run_dir}")

    def _train_step(self, micro_batches: list, indices: list[list[int]], where: str) -> StepOutcome:
        """Forward/backward of every micro-batch, then the step's one all-reduce of the losses and of the
        non-finite flag; the optimizer steps only when every rank's loss and gradients are finite."""
        self.guard.before_step()
        self._take_parameter_use()  # what forwards outside a step (validation) recorded is not this step's
        step_sums = LossSums()
        for micro, batch in enumerate(micro_batches):
            self._micro_step(batch, sync=micro == self.plan.accumulation - 1, sums=step_sums)
        rows, norms = self.guard.settle(step_sums, self.scaler)  # the step's one device wait
        losses = [row[0] for row in rows]
        groups = self._take_parameter_use()
        grads_ok = all(map(math.isfinite, norms))
        finite = grads_ok and all(math.isfinite(loss) for loss in losses)
        self._mark(f"{where}: loss all-reduce")
        # One all-reduce: the losses, the non-finite flag and, per parameter group, how many ranks used it.
        means, (bad_ranks, *ranks_using) = step_sums.reduced_means_and_flags(
            flags=[0.0 if finite else 1.0] + [1.0 if used else 0.0 for _, used in groups])
        if not bad_ranks:
            _drop_gradients_no_rank_used(groups, ranks_using)
            taken = optimizer_step(self.optimizer, self.scaler)
            return StepOutcome(means, step_sums, False, None if self.scaler is None else not taken)
        reports = comm.all_gather_objects(rank_report(self.env.rank, indices, losses, grads_ok))
        message = describe_nonfinite(where, self.progress.global_step + 1, reports)
        self.guard.undo_buffers()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loop.on_nonfinite == "stop":
            path = self._save_mid_epoch()
            raise NonFiniteError(f"{message}; saved the state before this step: {path}; fix the data or the lr, "
                                 f"or resume with --model_dir {self.run_dir} --on_nonfinite skip")
        self.progress.skipped_steps.append(self.progress.global_step + 1)
        too_many = self._skips_past_the_bound()
        if too_many:
            self.progress.skipped_steps.pop()  # this step is not taken: the checkpoint is the state before it
            path = self._save_mid_epoch()
            raise NonFiniteError(f"{message}; {too_many}, so the run stops as --on_nonfinite stop would; saved the "
                                 f"last good state: {path}; fix the data or the lr")
        self.log.warning(f"{message}; every rank skipped this step (--on_nonfinite skip)")
        return StepOutcome(means, step_sums, True, None)

    def _micro_step(self, batch: Any, sync: bool, sums: LossSums) -> None:
        """Forward and backward of one micro-batch; its loss and parts go into `sums`, still on the device."""
        batch = self.task.move_to(batch, self.device)
        no_sync = self.model.no_sync if isinstance(self.model, DistributedDataParallel) and not sync else None
        kernels = self.capture.kernels() if self.capture is not None else contextlib.nullcontext()
        with no_sync() if no_sync else contextlib.nullcontext(), kernels:
            out = forward_backward(self.train_step, self.model, batch, self.precision, self.scaler,
                                   self.plan.accumulation)
        if self.capture is not None and not sync:  # another micro-batch's replay follows: engine/capture.py
            self.capture.gradients_out_of_graphs()
        sums.add(out.total, dict(out.parts), self.task.batch_size_of(batch))

    def _take_parameter_use(self) -> list:
        take = self.task.parameter_use
        return list(take(self.model_without_ddp)) if take is not None else []

    def _skips_past_the_bound(self) -> str:
        """Why skipping has gone too far ('' while it has not): a run that skips most of its steps would exit 0
        with the weights of the few steps it took (lr 1e30: 7 of 8 steps skipped, weights of size 1e30)."""
        skipped, step = self.progress.skipped_steps, self.progress.global_step + 1
        in_a_row = next((n for n in range(len(skipped)) if skipped[-1 - n] != step - n), len(skipped))
        if in_a_row > self.loop.max_skips_in_a_row:
            return f"{in_a_row} steps in a row were skipped (--max_skips_in_a_row {self.loop.max_skips_in_a_row})"
        epoch_start = self.progress.global_step - self.progress.step_in_epoch
        in_epoch = sum(1 for s in skipped if s > epoch_start)
        allowed = max(1, math.floor(self.loop.max_skip_share * self.steps_per_epoch))
        if in_epoch > allowed:
            return (f"{in_epoch} of this epoch's {self.steps_per_epoch} steps were skipped, more than "
                    f"--max_skip_share {self.loop.max_skip_share:g} allows ({allowed})")
        return ""

    # ------------------------------------------------------------------------------------ epoch end
    def _finish_epoch(self, epoch: int, sums: LossSums, records: list) -> None:
        self._mark(f"epoch {epoch + 1}: train loss all-reduce")
        train_means = sums.reduced_means()
        timing = _timing(records, self.plan.global_batch) + self._skips_line(records)
        if self.schedule is not None:
            self.schedule.after_epoch()
        val_means = self.validate() if self._due(epoch, self.settings.eval_freq) else None
        self.progress.epoch, self.progress.step_in_epoch = epoch + 1, 0
        self.progress.history.append({"epoch": epoch + 1, "train": train_means, "val": val_means})
        self.hooks.on_epoch_end(EpochSummary(epoch + 1, self.settings.epochs, train_means, val_means,
                                             self._lr_of_last_step, timing))
        self._save(epoch + 1, val_means)

    def _skips_line(self, records: list[StepRecord]) -> str:
        """The epoch line's account of the steps not taken over the whole epoch, a resumed one's first part included:
        non-finite ones (the run's list of them survives a resume) and the fp16 GradScaler's (its count is carried
        by the mid-epoch checkpoint), with the scale it ends the epoch at (one device read an epoch)."""
        epoch_start = self.progress.global_step - self.steps_per_epoch
        skipped = sum(1 for step in self.progress.skipped_steps if step > epoch_start)
        line = f", {skipped} step(s) skipped (non-finite)" if skipped else ""
        if self.scaler is not None:
            by_scaler, of = self._epoch_scaler_skips, f"{self.steps_per_epoch} step(s)"
            if by_scaler is None:  # resumed from a checkpoint without the count: the steps this process ran
                by_scaler = sum(1 for record in records if record.scaler_skipped)
                of = f"{len(records)} step(s) since the resume"
            line += (f", {by_scaler} of {of} skipped by the fp16 GradScaler (overflow), "
                     f"scale now {self.scaler.get_scale():g}")
        return line

    @torch.no_grad()
    def validate(self) -> Optional[dict]:
        """Sample-weighted mean loss over the whole validation split, identical at every world size."""
        if self.task.val_set is None:
            return None
        self._mark(f"epoch {self.progress.epoch + 1}: validation")
        if self._val_loader is None:  # the same shard every epoch: one loader, its workers kept
            sampler = EvalShardSampler(len(self.task.val_set), self.env.world_size, self.env.rank)
            self._val_loader = DataLoader(self.task.val_set, batch_size=self.plan.per_rank, sampler=sampler,
                                          collate_fn=InBandSmallTensors(self.task.collate_val),
                                          **worker_options(self.workers, self.settings.seed))
        loader = self._val_loader
        model = self.model_without_ddp  # DDP's forward would issue collectives that uneven shards cannot match
        model.eval()
        sums, error = LossSums(), None
        try:
            for batch in loader:
                batch = self.task.move_to(batch, self.device)
                with self.precision.autocast():
                    out = self.task.step(model, batch)
                sums.add(out.total, dict(out.parts), self.task.batch_size_of(batch))
        except OpencoodDdpError as exc:  # a frame one rank cannot read: every rank stops with its message
            error = unwrap_worker_error(exc)
        model.train()
        self._mark(f"epoch {self.progress.epoch + 1}: validation loss all-reduce")
        error = comm.first_error(error)
        if error is not None:
            raise error
        return sums.reduced_means(names=self._loss_names(sums))

    def _loss_names(self, sums: LossSums) -> list[str]:
        # A rank with an empty shard has no names yet: take rank 0's so every rank reduces the same vector.
        return comm.broadcast_object(sums.names or None) or ["loss"]

    def nothing_left(self) -> bool:
        """Every epoch trained, or the run at or past --max_steps: fit trains no step."""
        return self.progress.epoch >= self.settings.epochs or self._max_steps_reached()

    def _max_steps_reached(self) -> bool:
        return self.loop.max_steps is not None and self.progress.global_step >= self.loop.max_steps

    def _due(self, epoch: int, freq: int) -> bool:
        # Upstream checks `epoch % freq == 0` on the 0-based epoch; the last epoch is always covered here.
        return epoch % freq == 0 or epoch + 1 == self.settings.epochs

    def _mark(self, phase: str) -> None:
        self.phase = phase
        comm.mark_phase(phase)

    def close_loaders(self) -> None:
        """Let the persistent workers go (their loaders' last reference): the run is over or failing."""
        self._train_loader = self._val_loader = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc_info) -> None:
        """A program that drives `steps` itself (benchmark_ddp) holds the trainer in `with`, so that the persistent
        workers stop when it is done, as `fit` stops them. A trainer is in reference cycles, so without it its
        loaders wait for the cycle collector (the process group's teardown runs one), and torch's shutdown of a
        loader collected there waits out its 5 s join timeout for every worker: the collector has already run the
        finalizers of the loader's index queues, which close them before the workers' stop signal goes out."""
        self.close_loaders()

    # ----------------------------------------------------------------------------------------------- output
    def training_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.schedule.state_dict() if self.schedule is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "global_step": self.progress.global_step, "best_val": self.progress.best_val,
                "best_epoch": self.progress.best_epoch, "history": self.progress.history,
                "skipped_steps": self.progress.skipped_steps,
                "batch_plan": self.plan.as_dict(), "world_size": self.env.world_size, "seed": self.settings.seed,
                "config_digests": self.checkpointer.rules.config_digests, "step_flags": self.step_flags()}

    def _save(self, epoch: int, val: Optional[dict]) -> None:
        self._mark(f"epoch {epoch}: checkpoint")
        improved = val is not None and val["loss"] < self.progress.best_val
        if improved:
            self.progress.best_val, self.progress.best_epoch = val["loss"], epoch
        self.checkpointer.save_epoch(epoch, self.model_without_ddp, self.training_state,
                                     due=self._due(epoch - 1, self.settings.save_freq),  # the same on every rank
                                     new_best=val["loss"] if improved else None)

    def _save_mid_epoch(self) -> Path:
        """Collective: a resumable checkpoint at this step boundary (stop signal, --max_steps, non-finite stop):
        weights, training state, every rank's RNG and the loss sums of the unfinished epoch."""
        self._mark(f"global step {self.progress.global_step}: mid-epoch checkpoint")
        epoch_sums = self._epoch_sums.reduced_totals() if self.progress.step_in_epoch else None
        skips = self._epoch_scaler_skips if self.progress.step_in_epoch else None
        return self.checkpointer.save_mid_epoch(self.model_without_ddp,
                                                lambda: dict(self.training_state(), epoch_sums=epoch_sums,
                                                             epoch_scaler_skips=skips),
                                                self.progress.global_step, self.progress.epoch,
                                                self.progress.step_in_epoch)


class StepOutcome(NamedTuple):
    """What `_train_step` did: the all-reduced means, this rank's sums, whether every rank skipped the step for
    a non-finite loss or gradient, and (None without a GradScaler) whether the fp16 GradScaler skipped it."""

    means: dict
    sums: LossSums
    skipped: bool
    scaler_skipped: Optional[bool]


def _drop_gradients_no_rank_used(groups: list, ranks_using: list) -> None:
    """grad None for the parameter groups that no rank's forward used (Task.parameter_use): torch's optimizers then
    skip them, no momentum and no weight decay, as in a step whose graph leaves them out (upstream's). A group used
    on some ranks keeps DDP's average, the other ranks' zeros included, as with find_unused_parameters."""
    for (parameters, _), ranks in zip(groups, ranks_using):
        if ranks == 0:
            for parameter in parameters:
                parameter.grad = None


def _timing(records: list[StepRecord], global_batch: int) -> str:
    """Throughput of an epoch over all ranks, and how much of rank 0's step time went into waiting for data."""
    seconds = sum(r.seconds for r in records)
    waited = sum(r.data_seconds for r in records)
    return (f"{global_batch * len(records) / seconds:.1f} samples/s, {seconds:.1f} s, "
            f"data wait {100 * waited / seconds:.0f}%")


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler]) -> bool:
    """Step with the accumulated gradients (the scaler skips a step whose float16 gradients overflowed and lowers
    its scale), then drop them: set to None, so that a parameter the next step does not use stays untouched. The
    fit loop's, and the batch-fit probes' (engine/batch_fit.py), so that a probe measures the step the run takes.
    Returns whether the optimizer stepped (False: the scaler skipped the step)."""
    taken = True
    if scaler is not None:
        # The overflow flags are read here to report a skipped step. With a foreach optimizer scaler.step would
        # read them itself before stepping; a fused one (CUDA's Adam) reads nothing and skips inside its kernel,
        # so there this read is a device wait of its own, for the unscale alone: the fit loop has just waited
        # for the step's losses (LossSums.settle). step sees the gradients already unscaled, as after a user's
        # unscale_ for clipping (the same arithmetic).
        scaler.unscale_(optimizer)
        taken = not any(found.item() for found in scaler._found_inf_per_device(optimizer).values())
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return taken

