"""The training recipe behind tools/train_ddp.py, top to bottom.

detect launcher -> process group -> hypes (rank 0, broadcast) -> batch plan -> task -> run folder (rank 0;
after an elastic restart, the first attempt's) -> trainer (SyncBN, DDP, optimizer) -> resume from the newest
checkpoint that loads -> config.yaml, log file, TensorBoard (nothing of an existing run is written before its
checkpoint loaded) -> fit, stopping cleanly on SIGTERM/SIGINT -> [evaluation of the last checkpoint on the test
split, all ranks].
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import socket
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp.yaml_parsers import run_yaml_parser
from opencood_ddp.distributed import checkpoint as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import LR_SCALINGS, SEMANTICS, BatchPlan, make_batch_plan
from opencood_ddp.distributed.elastic import elastic_attempt, find_run_of, record_run_id
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.entry import report_error, run_distributed
from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.inference import EvalBuilder, evaluate_checkpoint
from opencood_ddp.engine import batch_fit
from opencood_ddp.engine.checkpointer import RunCheckpointer
from opencood_ddp.engine.hooks import default_hooks
from opencood_ddp.engine.logging import attach_log_file, get_logger
from opencood_ddp.engine.optim import build_optimizer, build_scheduler
from opencood_ddp.engine.preemption import StopSignal
from opencood_ddp.engine.run_dir import (CONFIG_NAME, RunFolder, create_run_folder, lock_run_folder,
                                         release_run_folder, remove_if_nothing_saved, resolve_run_folder)
from opencood_ddp.engine.task import Task, TaskBuilder
from opencood_ddp.engine.step_guard import NONFINITE_POLICIES
from opencood_ddp.engine.trainer import Trainer, TrainSettings
from opencood_ddp.errors import ConfigError, OpencoodDdpError

# Keys this script adds to config.yaml; they describe the run, not the baseline.
RUN_KEYS = ("batch_plan",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train an OpenCOOD-schema model on 1..N processes (DDP).")
    parser.add_argument("--hypes_yaml", help="hypes YAML of a new run (ignored when --model_dir is a run)")
    parser.add_argument("--model_dir", help="existing run folder to resume, or a new folder for this run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.SUB=VALUE",
                        help="override a hypes value (YAML-typed); repeatable")
    parser.add_argument("--per_gpu_batch", type=per_gpu_batch_value,
                        help="cap the per-process batch; the rest becomes gradient accumulation. 'auto': measure a "
                             "step's memory at per-process batch 1, 2, 4 on this device and take the largest that "
                             "fits (tools/plan_batch.py's plan); nothing else of the run changes")
    parser.add_argument("--per_gpu_mem_gib", type=float,
                        help="with --per_gpu_batch auto: memory one process may use, GiB (default: the GPU's, or "
                             "on the CPU the available memory shared by this node's processes; 10%% kept free)")
    parser.add_argument("--batch_semantics", choices=SEMANTICS, default="global",
                        help="global: batch_size is the effective batch (default); per_gpu: upstream behaviour")
    parser.add_argument("--scale_lr", choices=LR_SCALINGS, default="none", help="lr scaling with per_gpu semantics")
    parser.add_argument("--half", action="store_true", help="mixed precision (fp16 + GradScaler on CUDA, bf16 on CPU)")
    parser.add_argument("--seed", type=int, help="default: train_params.seed of the hypes, else 0")
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader workers per process")
    parser.add_argument("--dist_timeout", type=float, default=30.0,
                        help="minutes a collective waits for a stalled or dead peer before every waiting rank "
                             "fails with a message naming the ranks behind")
    parser.add_argument("--dist_backend", choices=("nccl", "gloo"), help="default: nccl on CUDA, gloo on CPU")
    parser.add_argument("--no_sync_bn", action="store_true", help="keep per-rank BatchNorm statistics")
    parser.add_argument("--max_steps", type=int, help="end the run after this many optimizer steps and save "
                                                       "net_step{K}.pth (a smoke test or a parity check)")
    parser.add_argument("--reverse_batch_order", action="store_true",
                        help="feed each batch's samples in reverse order: the same training in exact arithmetic, "
                             "another float summation order (the noise floor of tools/parity_check.py)")
    parser.add_argument("--on_nonfinite", choices=NONFINITE_POLICIES, default="stop",
                        help="a non-finite loss or gradient on any rank: stop (save the state before the step, "
                             "exit 3) or skip the step on every rank")
    parser.add_argument("--max_skips_in_a_row", type=int, default=10,
                        help="with --on_nonfinite skip: stop (as 'stop' does) after more consecutive skipped steps")
    parser.add_argument("--max_skip_share", type=float, default=0.1,
                        help="with --on_nonfinite skip: stop when a larger share of an epoch's steps was skipped")
    parser.add_argument("--restart", action="store_true",
                        help="train an existing run folder that has a history but no checkpoint that loads from the "
                             "start (its train_steps.csv is replaced); refused otherwise")
    parser.add_argument("--allow_config_change", action="store_true",
                        help="resume although a model or data section of config.yaml (or a --set) differs from "
                             "what the checkpoint was trained with (refused otherwise)")
    parser.add_argument("--log_root", default="logs", help="parent of new run folders without --model_dir")
    parser.add_argument("--eval_after_training", action="store_true",
                        help="evaluate the last checkpoint on the test split (test_dir, else validate_dir) on all "
                             "ranks; writes eval.yaml into the run folder")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int,
                        help="set by torch.distributed.launch; torchrun uses LOCAL_RANK instead")
    return parser


# ------------------------------------------------------------------------------------------------ hypes + plan
def load_run_hypes(args: argparse.Namespace) -> tuple[dict, str]:
    """The hypes of this run: config.yaml of an existing run (upstream semantics), else --hypes_yaml."""
    if args.model_dir and (Path(args.model_dir) / CONFIG_NAME).is_file():
        source = str(Path(args.model_dir) / CONFIG_NAME)
        if args.hypes_yaml:
            get_logger().warning(f"--model_dir {args.model_dir} is an existing run: its config.yaml wins over "
                                 f"--hypes_yaml {args.hypes_yaml} (upstream's rule); using {source}")
    elif args.hypes_yaml:
        source = args.hypes_yaml
    else:
        raise ConfigError("pass --hypes_yaml for a new run, or --model_dir of an existing run (with config.yaml)")
    hypes = hypes_lib.apply_overrides(hypes_lib.load_hypes(source), args.overrides)
    for key in RUN_KEYS:
        hypes.pop(key, None)
    hypes = run_yaml_parser(hypes, source)
    hypes_lib.validate(hypes, hypes_lib.ENGINE_KEYS, source, hypes_lib.ENGINE_OPTIONAL_KEYS)
    seed = args.seed if args.seed is not None else hypes["train_params"].get("seed", 0)
    hypes["train_params"]["seed"] = seed
    return hypes, source


def per_gpu_batch_value(text: str):
    """--per_gpu_batch: a positive integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'auto'") from None


def plan_batches(hypes: dict, args: argparse.Namespace, world_size: int,
                 per_gpu_batch: Optional[int]) -> BatchPlan:
    return make_batch_plan(hypes["train_params"]["batch_size"], world_size, float(hypes["optimizer"]["lr"]),
                           per_gpu_batch=per_gpu_batch, semantics=args.batch_semantics,
                           lr_scaling=args.scale_lr)


def choose_per_gpu_batch(args: argparse.Namespace, hypes: dict, env: DistEnv, build_task: TaskBuilder
                         ) -> Optional[int]:
    """--per_gpu_batch as given, or for 'auto' what rank 0 measured on its device (every rank gets the same).
    The measurement builds models and draws random numbers: seed_everything comes after it, so the run is the
    one an explicit --per_gpu_batch of the same value gives."""
    if args.per_gpu_batch != "auto":
        return args.per_gpu_batch
    if args.batch_semantics != "global":
        raise ConfigError("--per_gpu_batch auto splits the effective batch_size (--batch_semantics global); give a "
                          "number with --batch_semantics per_gpu")
    device = torch.device(env.device)

    def measure() -> int:
        capacity = (args.per_gpu_mem_gib * batch_fit.GIB if args.per_gpu_mem_gib else
                    batch_fit.device_capacity(device, processes_on_device=local_processes(env)))
        chosen, lines = batch_fit.auto_plan(hypes, build_task, env.world_size, device, args.half, capacity)
        for line in lines:
            get_logger().info(line)
        return chosen.per_rank

    return comm.on_main_then_broadcast(measure)


def local_processes(env: DistEnv) -> int:
    """Processes of this run on this node (torchrun and SLURM say; else all of them)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return env.world_size


def check_optimization(hypes: dict, task: Task, plan: BatchPlan) -> None:
    """Build the optimizer and scheduler once on a throw-away optimizer, so that a value torch refuses
    (optimizer.lr -0.1) fails before the run folder exists and not after (nothing of the model changes). The
    values checked do not depend on the steps per epoch, which the trainer's sampler gives later: 1 stands in."""
    build_scheduler(hypes, build_optimizer(hypes, task.model.parameters(), plan.effective_lr), steps_per_epoch=1)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model initialisation (DDP would broadcast rank 0's anyway)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ run folder
def open_run_folder(args: argparse.Namespace, hypes: dict, plan: BatchPlan) -> RunFolder:
    """Rank 0 decides; a new run's folder is created with its config.yaml, an existing run is only checked
    (it is written to once its checkpoint has loaded). Every rank gets the same folder, or the same error."""
    log = get_logger()

    def make() -> RunFolder:
        attempt = elastic_attempt(os.environ)
        model_dir = args.model_dir or find_run_of(Path(args.log_root), attempt)
        if attempt is not None and attempt.restart and not args.model_dir:
            log.info(f"torchrun restart {attempt.restart} of {attempt.max_restarts}: "
                     + (f"continuing {model_dir}" if model_dir else "no run folder of an earlier attempt found "
                        "(pass --model_dir, or --rdzv-id to torchrun, so that restarts resume); starting anew"))
        folder = resolve_run_folder(model_dir, hypes["name"], args.log_root)
        if folder.resume:
            lock_run_folder(folder.path)  # before anything of the run is read or written
            return folder
        folder = create_run_folder(folder)
        lock_run_folder(folder.path)
        RunCheckpointer(folder.path, is_main=True).write_config(hypes, plan)
        if not args.model_dir:  # a timestamped folder: how a restart of this torchrun job finds it again
            record_run_id(folder.path, attempt)
        return folder

    return comm.on_main_then_broadcast(make)


def resume_run(trainer: Trainer, hypes: dict, plan: BatchPlan) -> list[tuple[int, str]]:
    """Load the newest checkpoint that loads (every rank); only then does rank 0 touch the run's files.
    Returns the (logging level, message) pairs to log once the run's log file is attached."""
    saved, rejected = trainer.resume()
    notes = [(logging.WARNING, f"{reason}: fell back to the checkpoint before it") for reason in rejected]
    removed = trainer.checkpointer.remove_unfinished_saves()
    if removed:
        notes.append((logging.INFO, f"removed {len(removed)} unfinished save(s) of a killed run: "
                                    f"{', '.join(removed)}"))
    trainer.checkpointer.write_config(hypes, plan)
    if saved is not None:
        p = trainer.progress
        notes.append((logging.INFO, f"resumed from {saved.describe()}: {p.epoch} epoch(s) and {p.step_in_epoch} "
                                    f"step(s) of the next done, global step {p.global_step}"))
    return notes


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
def plan_final_evaluation(args: argparse.Namespace, hypes: dict,
                          build_eval: Optional[EvalBuilder]) -> Optional[tuple[EvalRequest, EvalSpec]]:
    """--eval_after_training: build the test-split evaluation now, so that a missing split or a task without
    evaluation fails before hours of training, not after."""
    if not args.eval_after_training:
        return None
    if build_eval is None:
        raise ConfigError("--eval_after_training: this entry point has no evaluation; drop the flag")
    request = EvalRequest(test_split=True)  # no task options: the task's defaults
    return request, build_eval(hypes, request)


def run_final_evaluation(final: tuple[EvalRequest, EvalSpec], folder: Path, weights: Path, env: DistEnv,
                         num_workers: int) -> None:
    request, spec = final
    request.out_dir = str(folder)
    # The trainer's last save ends with a barrier: the checkpoint is on disk for every rank.
    evaluate_checkpoint(spec, request, weights, env, num_workers)


def train(args: argparse.Namespace, env: DistEnv, build_task: TaskBuilder,
          build_eval: Optional[EvalBuilder] = None) -> Path:
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max_steps {args.max_steps}: give a positive number of optimizer steps")
    hypes, source = comm.on_main_then_broadcast(lambda: load_run_hypes(args))
    plan = plan_batches(hypes, args, env.world_size, choose_per_gpu_batch(args, hypes, env, build_task))
    seed_everything(hypes["train_params"]["seed"])
    task = build_task(hypes, for_training=True)
    final = plan_final_evaluation(args, hypes, build_eval)
    check_optimization(hypes, task, plan)
    folder = open_run_folder(args, hypes, plan)
    try:
        return fit_in_folder(args, env, hypes, source, plan, task, final, folder)
    except BaseException:
        if env.is_main and not folder.resume:
            remove_if_nothing_saved(folder.path)  # a failed new run that saved nothing leaves no folder
        raise
    finally:
        release_run_folder(folder.path)  # rank 0's lock; the end of the process would release it too


def fit_in_folder(args: argparse.Namespace, env: DistEnv, hypes: dict, source: str, plan: BatchPlan, task: Task,
                  final: Optional[tuple[EvalRequest, EvalSpec]], folder: RunFolder) -> Path:
    """Resume, log, fit and evaluate in the run folder this job holds."""
    log = get_logger()
    settings = TrainSettings.from_hypes(hypes, hypes["train_params"]["seed"], args.num_workers, args.half,
                                        sync_bn=not args.no_sync_bn, max_steps=args.max_steps,
                                        reverse_batch_order=args.reverse_batch_order,
                                        on_nonfinite=args.on_nonfinite,
                                        allow_config_change=args.allow_config_change,
                                        max_skips_in_a_row=args.max_skips_in_a_row,
                                        max_skip_share=args.max_skip_share)
    settings = dataclasses.replace(settings, restart=args.restart)
    stop_signal = StopSignal()
    trainer = Trainer(task, plan, env, settings, hypes, folder.path, default_hooks(folder.path, env.is_main),
                      stop_signal)
    notes = resume_run(trainer, hypes, plan) if folder.resume else []
    attach_log_file(folder.path, env.rank)
    log.info(f"hypes: {source}")
    for level, note in notes:
        log.log(level, note)
    devices = comm.gather_objects((socket.gethostname(), env.device))
    if env.is_main:
        log.info(describe_start(env, plan, task, folder, trainer, devices))
    try:
        with stop_signal:
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
        weights = trainer.last_weights or folder.path / ckpt.weights_name(settings.epochs)
        run_final_evaluation(final, folder.path, weights, env, args.num_workers)
    return folder.path


def main(argv: Optional[Sequence[str]], build_task: TaskBuilder, build_eval: Optional[EvalBuilder] = None) -> int:
    return run_distributed(build_parser().parse_args(argv),
                           lambda args, env: train(args, env, build_task, build_eval))
