"""The training recipe behind tools/train_ddp.py, top to bottom.

flags (engine/options.py: TrainOptions) -> detect launcher -> process group -> hypes (rank 0, broadcast) ->
batch plan -> task -> choose the run folder (rank 0; after an elastic restart, the first attempt's) -> trainer
(SyncBN, DDP, optimizer, schedule: a refused value fails before anything is on disk) -> claim the folder (create,
lock) -> resume from the newest checkpoint that loads, then config.yaml (Trainer.open_run: nothing of an existing
run is written before its checkpoint loaded) -> log file, TensorBoard -> fit, stopping cleanly on SIGTERM/SIGINT
-> [evaluation of the last checkpoint on the test split, all ranks].
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from opencood_ddp.distributed import checkpoint_files as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import BatchPlan, make_batch_plan
from opencood_ddp.distributed.elastic import elastic_attempt, find_run_of, record_run_id
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.entry import report_error, run_distributed
from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.inference import EvalBuilder, evaluate_checkpoint
from opencood_ddp.engine import batch_fit
from opencood_ddp.engine.hooks import default_hooks
from opencood_ddp.engine.logging import attach_log_file, get_logger
from opencood_ddp.engine.options import TrainOptions, parse_train_options
from opencood_ddp.engine.preemption import StopSignal
from opencood_ddp.engine.run_dir import (CONFIG_NAME, RunFolder, create_run_folder, lock_run_folder,
                                         release_run_folder, remove_if_nothing_saved, resolve_run_folder)
from opencood_ddp.engine.task import Task, TaskBuilder
from opencood_ddp.engine.trainer import Trainer, TrainSettings
from opencood_ddp.errors import ConfigError, OpencoodDdpError
from opencood_ddp.yaml_parsers import load_parsed_hypes


# ------------------------------------------------------------------------------------------------ hypes + plan
def load_run_hypes(options: TrainOptions) -> tuple[dict, str]:
    """The hypes of this run: config.yaml of an existing run (upstream semantics), else --hypes_yaml."""
    if options.model_dir and (Path(options.model_dir) / CONFIG_NAME).is_file():
        source = str(Path(options.model_dir) / CONFIG_NAME)
        if options.hypes_yaml:
            get_logger().warning(f"--model_dir {options.model_dir} is an existing run: its config.yaml wins over "
                                 f"--hypes_yaml {options.hypes_yaml} (upstream's rule); using {source}")
    elif options.hypes_yaml:
        source = options.hypes_yaml
    else:
        raise ConfigError("pass --hypes_yaml for a new run, or --model_dir of an existing run (with config.yaml)")
    hypes = load_parsed_hypes(source, options.overrides)
    seed = options.seed if options.seed is not None else hypes["train_params"].get("seed", 0)
    hypes["train_params"]["seed"] = seed
    return hypes, source


def plan_batches(hypes: dict, options: TrainOptions, world_size: int,
                 per_gpu_batch: Optional[int]) -> BatchPlan:
    return make_batch_plan(hypes["train_params"]["batch_size"], world_size, float(hypes["optimizer"]["lr"]),
                           per_gpu_batch=per_gpu_batch, semantics=options.batch_semantics,
                           lr_scaling=options.scale_lr)


def choose_per_gpu_batch(options: TrainOptions, hypes: dict, env: DistEnv, build_task: TaskBuilder
                         ) -> Optional[int]:
    """--per_gpu_batch as given, or for 'auto' what rank 0 measured on its device (every rank gets the same).
    The measurement builds models and draws random numbers: seed_everything comes after it, so the run is the
    one an explicit --per_gpu_batch of the same value gives."""
    if options.per_gpu_batch != "auto":
        return options.per_gpu_batch
    if options.batch_semantics != "global":
        raise ConfigError("--per_gpu_batch auto splits the effective batch_size (--batch_semantics global); give a "
                          "number with --batch_semantics per_gpu")
    device = torch.device(env.device)

    def measure() -> int:
        capacity = (options.per_gpu_mem_gib * batch_fit.GIB if options.per_gpu_mem_gib else
                    batch_fit.device_capacity(device, processes_on_device=env.processes_on_device))
        chosen, lines = batch_fit.auto_plan(hypes, build_task, env.world_size, device, options.half, capacity)
        for line in lines:
            get_logger().info(line)
        return chosen.per_rank

    return comm.on_main_then_broadcast(measure)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model initialisation (DDP would broadcast rank 0's anyway)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ run folder
def choose_run_folder(options: TrainOptions, hypes: dict) -> RunFolder:
    """Where the run lives (rank 0 decides, every rank gets the same): --model_dir, after an elastic restart the
    first attempt's folder, else a new timestamped one. Nothing is created yet."""
    log = get_logger()

    def choose() -> RunFolder:
        attempt = elastic_attempt(os.environ)
        model_dir = options.model_dir or find_run_of(Path(options.log_root), attempt)
        if attempt is not None and attempt.restart and not options.model_dir:
            log.info(f"torchrun restart {attempt.restart} of {attempt.max_restarts}: "
                     + (f"continuing {model_dir}" if model_dir else "no run folder of an earlier attempt found "
                        "(pass --model_dir, or --rdzv-id to torchrun, so that restarts resume); starting anew"))
        return resolve_run_folder(model_dir, hypes["name"], options.log_root)

    return comm.on_main_then_broadcast(choose)


def claim_run_folder(folder: RunFolder, options: TrainOptions) -> None:
    """Rank 0 creates a new run's folder and holds the run's lock; every rank gets the same error. The folder is
    looked at again under the lock: another job may have made it a run since it was chosen."""

    def claim() -> None:
        if not folder.resume:
            create_run_folder(folder)
        lock_run_folder(folder.path)  # before anything of the run is read or written
        if resolve_run_folder(str(folder.path), "", options.log_root).resume != folder.resume:
            release_run_folder(folder.path)
            raise ConfigError(f"run folder {folder.path} changed while this job started (another job wrote it); "
                              f"start again, or pass another --model_dir")
        if not folder.resume and not options.model_dir:  # timestamped: how a torchrun restart finds it again
            record_run_id(folder.path, elastic_attempt(os.environ))

    comm.on_main_then_broadcast(claim)


def describe_devices(entries: Sequence[tuple[str, str]]) -> str:
    """Every rank's (host, device), grouped by host: 'node1 [cuda:0 cuda:1], node2 [cuda:0 cuda:1]'."""
    hosts: dict[str, list[str]] = {}
    for host, device in entries:
        hosts.setdefault(host, []).append(device)
    shown = [f"{host} [{' '.join(devices)}]" for host, devices in list(hosts.items())[:4]]
    more = f", ... ({len(hosts)} hosts)" if len(hosts) > 4 else ""
    return ", ".join(shown) + more


def describe_start(env: DistEnv, plan: BatchPlan, task: Task, folder: RunFolder, trainer: Trainer,
                   devices: Sequence[tuple[str, str]]) -> str:
    """The plan rank 0 prints before the first step: who trains, on what, with which batch and data."""
    sizes = f"train {len(task.train_set)} samples, validate {len(task.val_set) if task.val_set is not None else 0}"
    steps = f"{trainer.steps_per_epoch} optimizer steps per epoch"
    if trainer.settings.max_steps is not None:
        steps += f", stopping after {trainer.settings.max_steps} steps (--max_steps)"
    return "\n".join([
        f"launcher {env.launcher}: world size {env.world_size}, backend {env.backend}, device {env.device}",
        f"devices: {describe_devices(devices)}",
        plan.describe(),
        f"datasets: {sizes}; {steps}",
        f"sync batch norm: {trainer.sync_bn_kind or 'off'}",
        f"run folder: {folder.path}{' (resuming)' if folder.resume else ''}",
    ])


# ------------------------------------------------------------------------------------------------ main
def plan_final_evaluation(options: TrainOptions, hypes: dict,
                          build_eval: Optional[EvalBuilder]) -> Optional[tuple[EvalRequest, EvalSpec]]:
    """--eval_after_training: build the test-split evaluation now, so that a missing split or a task without
    evaluation fails before hours of training, not after."""
    if not options.eval_after_training:
        return None
    if build_eval is None:
        raise ConfigError("--eval_after_training: this entry point has no evaluation; drop the flag")
    request = EvalRequest(test_split=True)  # no task options: the task's defaults
    return request, build_eval(hypes, request)


def run_final_evaluation(final: tuple[EvalRequest, EvalSpec], folder: Path, weights: Path, env: DistEnv,
                         num_workers: int) -> None:
    request, spec = final
    request.run_dir = str(folder)
    # The trainer's last save ends with a barrier: the checkpoint is on disk for every rank.
    evaluate_checkpoint(spec, request, weights, env, num_workers)


def train(options: TrainOptions, env: DistEnv, build_task: TaskBuilder,
          build_eval: Optional[EvalBuilder] = None) -> Path:
    if options.max_steps is not None and options.max_steps < 1:
        raise ConfigError(f"--max_steps {options.max_steps}: give a positive number of optimizer steps")
    hypes, source = comm.on_main_then_broadcast(lambda: load_run_hypes(options))
    plan = plan_batches(hypes, options, env.world_size, choose_per_gpu_batch(options, hypes, env, build_task))
    seed_everything(hypes["train_params"]["seed"])
    task = build_task(hypes, for_training=True)
    final = plan_final_evaluation(options, hypes, build_eval)
    folder = choose_run_folder(options, hypes)
    stop_signal = StopSignal()
    # Built before the folder exists: a value torch refuses (optimizer.lr -0.1) fails here and leaves nothing.
    trainer = Trainer(task, plan, env, TrainSettings.from_hypes(hypes, options), hypes, folder.path,
                      default_hooks(folder.path, env.is_main), stop_signal)
    claim_run_folder(folder, options)
    try:
        return fit_in_folder(trainer, folder, source, final, options.launch.num_workers)
    except BaseException:
        if env.is_main and not folder.resume:
            remove_if_nothing_saved(folder.path)  # a failed new run that saved nothing leaves no folder
        raise
    finally:
        release_run_folder(folder.path)  # rank 0's lock; the end of the process would release it too


def fit_in_folder(trainer: Trainer, folder: RunFolder, source: str, final: Optional[tuple[EvalRequest, EvalSpec]],
                  num_workers: int) -> Path:
    """Resume, log, fit and evaluate in the run folder this job holds."""
    log, env = get_logger(), trainer.env
    notes = trainer.open_run(folder.resume)
    attach_log_file(folder.path, env.rank)
    log.info(f"hypes: {source}")
    for level, note in notes:
        log.log(level, note)
    devices = comm.gather_objects((socket.gethostname(), env.device))
    if env.is_main:
        log.info(describe_start(env, trainer.plan, trainer.task, folder, trainer, devices))
    try:
        with trainer.stop_signal:
            try:
                trainer.fit()
            except OpencoodDdpError as exc:
                # Told while SIGTERM is still only recorded: when a peer dies, torchrun's agent SIGTERMs this
                # process at once, and once StopSignal restored the default handler the reason would be lost.
                report_error(exc, env)
                raise
    finally:
        trainer.hooks.close()
    if final is not None:
        weights = trainer.last_weights or folder.path / ckpt.weights_name(trainer.settings.epochs)
        run_final_evaluation(final, folder.path, weights, env, num_workers)
    return folder.path


def main(argv: Optional[Sequence[str]], build_task: TaskBuilder, build_eval: Optional[EvalBuilder] = None) -> int:
    options = parse_train_options(argv)
    return run_distributed(options.launch, lambda env: train(options, env, build_task, build_eval))
