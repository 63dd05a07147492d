"""The training recipe behind tools/train_ddp.py, top to bottom.

detect launcher -> process group -> hypes (rank 0, broadcast) -> batch plan -> task -> run folder (rank 0;
after an elastic restart, the first attempt's) -> trainer (SyncBN, DDP, optimizer) -> resume from the newest
checkpoint that loads -> config.yaml, log file, TensorBoard (nothing of an existing run is written before its
checkpoint loaded) -> fit, stopping cleanly on SIGTERM/SIGINT -> [evaluation of the last checkpoint on the test
split, all ranks].
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import socket
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from opencood_ddp import hypes as hypes_lib
from opencood_ddp.distributed import checkpoint as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import LR_SCALINGS, SEMANTICS, BatchPlan, make_batch_plan
from opencood_ddp.distributed.elastic import elastic_attempt, find_run_of, record_run_id
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.entry import run_distributed
from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.inference import EvalBuilder, evaluate_checkpoint
from opencood_ddp.engine.logging import NullWriter, attach_log_file, get_logger, summary_writer
from opencood_ddp.engine.preemption import StopSignal
from opencood_ddp.engine.run_dir import CONFIG_NAME, RunFolder, create_run_folder, resolve_run_folder
from opencood_ddp.engine.task import Task, TaskBuilder
from opencood_ddp.engine.step_guard import NONFINITE_POLICIES
from opencood_ddp.engine.trainer import Trainer, TrainSettings
from opencood_ddp.errors import ConfigError

# Keys this script adds to config.yaml; they describe the run, not the baseline.
RUN_KEYS = ("batch_plan",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train an OpenCOOD-schema model on 1..N processes (DDP).")
    parser.add_argument("--hypes_yaml", help="hypes YAML of a new run (ignored when --model_dir is a run)")
    parser.add_argument("--model_dir", help="existing run folder to resume, or a new folder for this run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.SUB=VALUE",
                        help="override a hypes value (YAML-typed); repeatable")
    parser.add_argument("--per_gpu_batch", type=int, help="cap the per-process batch; the rest becomes "
                                                          "gradient accumulation")
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
    elif args.hypes_yaml:
        source = args.hypes_yaml
    else:
        raise ConfigError("pass --hypes_yaml for a new run, or --model_dir of an existing run (with config.yaml)")
    hypes = hypes_lib.apply_overrides(hypes_lib.load_hypes(source), args.overrides)
    for key in RUN_KEYS:
        hypes.pop(key, None)
    hypes = hypes_lib.run_yaml_parser(hypes, source)
    hypes_lib.validate(hypes, hypes_lib.ENGINE_KEYS, source, hypes_lib.ENGINE_OPTIONAL_KEYS)
    seed = args.seed if args.seed is not None else hypes["train_params"].get("seed", 0)
    hypes["train_params"]["seed"] = seed
    return hypes, source


def plan_batches(hypes: dict, args: argparse.Namespace, world_size: int) -> BatchPlan:
    return make_batch_plan(hypes["train_params"]["batch_size"], world_size, float(hypes["optimizer"]["lr"]),
                           per_gpu_batch=args.per_gpu_batch, semantics=args.batch_semantics,
                           lr_scaling=args.scale_lr)


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
            return folder
        folder = create_run_folder(folder)
        write_config(folder, hypes, plan)
        if not args.model_dir:  # a timestamped folder: how a restart of this torchrun job finds it again
            record_run_id(folder.path, attempt)
        return folder

    return comm.on_main_then_broadcast(make)


def write_config(folder: RunFolder, hypes: dict, plan: BatchPlan) -> None:
    hypes_lib.save_hypes(dict(hypes, batch_plan=plan.as_dict()), folder.config_path)


def resume_run(trainer: Trainer, folder: RunFolder, hypes: dict, plan: BatchPlan) -> list[tuple[int, str]]:
    """Load the newest checkpoint that loads (every rank); only then does rank 0 touch the run's files.
    Returns the (logging level, message) pairs to log once the run's log file is attached."""
    saved, rejected = trainer.resume()
    notes = [(logging.WARNING, f"{reason}: fell back to the checkpoint before it") for reason in rejected]
    if trainer.env.is_main:
        removed = ckpt.remove_unfinished_saves(folder.path)
        if removed:
            notes.append((logging.INFO, f"removed {len(removed)} unfinished save(s) of a killed run: "
                                        f"{', '.join(removed)}"))
        write_config(folder, hypes, plan)
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
    request = EvalRequest(fusion_method=None, test_split=True)
    return request, build_eval(hypes, request)


def run_final_evaluation(final: tuple[EvalRequest, EvalSpec], folder: Path, weights: Path, env: DistEnv,
                         num_workers: int) -> None:
    request, spec = final
    request.out_dir = str(folder)
    # The trainer's last save ends with a barrier: the checkpoint is on disk for every rank.
    evaluate_checkpoint(spec, request, weights, env, num_workers)


def train(args: argparse.Namespace, env: DistEnv, build_task: TaskBuilder,
          build_eval: Optional[EvalBuilder] = None) -> Path:
    log = get_logger()
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max_steps {args.max_steps}: give a positive number of optimizer steps")
    hypes, source = comm.on_main_then_broadcast(lambda: load_run_hypes(args))
    plan = plan_batches(hypes, args, env.world_size)
    seed_everything(hypes["train_params"]["seed"])
    task = build_task(hypes, for_training=True)
    final = plan_final_evaluation(args, hypes, build_eval)
    folder = open_run_folder(args, hypes, plan)
    settings = TrainSettings.from_hypes(hypes, hypes["train_params"]["seed"], args.num_workers, args.half,
                                        sync_bn=not args.no_sync_bn, max_steps=args.max_steps,
                                        reverse_batch_order=args.reverse_batch_order,
                                        on_nonfinite=args.on_nonfinite)
    trainer = Trainer(task, plan, env, settings, hypes, folder.path, NullWriter())
    notes = resume_run(trainer, folder, hypes, plan) if folder.resume else []
    attach_log_file(folder.path, env.rank)
    log.info(f"hypes: {source}")
    for level, note in notes:
        log.log(level, note)
    devices = comm.gather_objects((socket.gethostname(), env.device))
    if env.is_main:
        log.info(describe_start(env, plan, task, folder, trainer, devices))
    trainer.writer = summary_writer(folder.path, env.is_main)
    try:
        with StopSignal() as trainer.stop_signal:
            trainer.fit()
    finally:
        trainer.writer.close()
    if final is not None:
        weights = trainer.last_weights or folder.path / ckpt.weights_name(settings.epochs)
        run_final_evaluation(final, folder.path, weights, env, args.num_workers)
    return folder.path


def main(argv: Optional[Sequence[str]], build_task: TaskBuilder, build_eval: Optional[EvalBuilder] = None) -> int:
    return run_distributed(build_parser().parse_args(argv),
                           lambda args, env: train(args, env, build_task, build_eval))
