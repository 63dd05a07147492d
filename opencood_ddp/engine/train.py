"""The training recipe behind tools/train_ddp.py, top to bottom (`main`).

flags (engine/options.py: TrainOptions) -> detect launcher -> process group -> the run's set-up, decided once on
rank 0 and broadcast (engine/run_dir.py `decide_run`: folder, resume, hypes; after a torchrun restart the first
attempt's folder) -> seed -> batch plan -> task -> trainer (SyncBN, DDP, optimizer, schedule: a refused value
fails before anything is on disk); these are `prepare_trainer`, the benchmarks' set-up too -> [the evaluation of
--eval_after_training, built now] -> claim the folder (create, lock) -> resume from the newest checkpoint
that loads, then config.yaml (Trainer.open_run: nothing of an existing run is written before its checkpoint
loaded) -> log file, TensorBoard -> Trainer.fit, stopping cleanly on SIGTERM/SIGINT -> [evaluation of the last
checkpoint on the test split, all ranks]. From tools/train_ddp.py to optimizer.step() the stack is six frames in
three files: the tool, `main`, `Trainer.fit`, `Trainer.steps`, `Trainer._train_step`, `optimizer_step`.
"""
from __future__ import annotations

import contextlib
import os
import random
import socket
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp import hypes as hypes_lib
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import BatchPlan, make_batch_plan
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.entry import DistributedRun, report_error
from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.inference import EvalBuilder, evaluate_checkpoint
from opencood_ddp.engine import batch_fit
from opencood_ddp.engine.hooks import default_hooks
from opencood_ddp.engine.logs import attach_log_file, get_logger
from opencood_ddp.engine.options import BatchOptions, LoopOptions, TrainOptions, parse_train_options
from opencood_ddp.engine.preemption import StopSignal
from opencood_ddp.engine.run_dir import claim_run, decide_run, release_run_dir, remove_if_nothing_saved
from opencood_ddp.engine.step import Precision
from opencood_ddp.engine.task import TaskBuilder
from opencood_ddp.engine.trainer import Trainer
from opencood_ddp.errors import ConfigError, OpencoodDdpError


# ------------------------------------------------------------------------------------------------ plan + seed
def resolve_seed(hypes: dict, seed: Optional[int]) -> int:
    """--seed, else train_params.seed of the hypes, else 0; written into the hypes (config.yaml records it)."""
    hypes["train_params"]["seed"] = seed if seed is not None else hypes["train_params"].get("seed", 0)
    return hypes["train_params"]["seed"]


def plan_batches(hypes: dict, options: BatchOptions, world_size: int, per_gpu_batch: Optional[int]) -> BatchPlan:
    return make_batch_plan(hypes["train_params"]["batch_size"], world_size, float(hypes["optimizer"]["lr"]),
                           per_gpu_batch=per_gpu_batch, semantics=options.batch_semantics,
                           lr_scaling=options.scale_lr)


def choose_per_gpu_batch(options: TrainOptions, hypes: dict, env: DistEnv, build_task: TaskBuilder
                         ) -> Optional[int]:
    """--per_gpu_batch as given, or for 'auto' what rank 0 measured on its device (every rank gets the same).
    The measurement builds models and draws random numbers: seed_everything comes after it, so the run is the
    one an explicit --per_gpu_batch of the same value gives."""
    batch = options.batch
    if batch.per_gpu_batch != "auto":
        return batch.per_gpu_batch
    if batch.batch_semantics != "global":
        raise ConfigError("--per_gpu_batch auto splits the effective batch_size (--batch_semantics global); give a "
                          "number with --batch_semantics per_gpu")
    device = torch.device(env.device)

    def measure() -> int:
        capacity = (batch.per_gpu_mem_gib * batch_fit.GIB if batch.per_gpu_mem_gib else
                    batch_fit.device_capacity(device, processes_on_device=env.processes_on_device))
        chosen, lines = batch_fit.auto_plan(hypes, build_task, env.world_size, device, options.loop.half, capacity,
                                            capture=options.loop.capture)
        for line in lines:
            get_logger().info(line)
        return chosen.per_rank

    return comm.on_main_then_broadcast(measure)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model initialisation (DDP would broadcast rank 0's anyway)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def kernel_settings(loop: LoopOptions) -> Iterator[None]:
    """--deterministic and --no_tf32, for the run and restored after it (gpu_check runs several trainings in one
    process). cuBLAS reads its workspace setting when it makes its first handle: set before the model is built."""
    deterministic, tf32 = torch.are_deterministic_algorithms_enabled(), tf32_flags()
    if loop.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if not loop.tf32:
        set_tf32_flags(IEEE_FLAGS)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        set_tf32_flags(tf32)


# torch 2.9 and later set TF32 per operator ('tf32' / 'ieee') and refuse to mix that with the old global flags
# (allow_tf32), so the old flags serve only where the new ones do not exist. torch's default lets cuDNN's float32
# convolutions round to TF32 and keeps matrix products in IEEE float32.
_PER_OPERATOR_TF32 = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")
IEEE_FLAGS = ("ieee", "ieee") if _PER_OPERATOR_TF32 else (False, False)  # tf32_flags()'s value under --no_tf32


def tf32_flags() -> tuple:
    """(cuDNN convolutions, matrix products): their fp32_precision, or on older torch their allow_tf32."""
    if _PER_OPERATOR_TF32:
        return torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def set_tf32_flags(flags: tuple) -> None:
    if _PER_OPERATOR_TF32:
        torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = flags
    else:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def describe_devices(entries: Sequence[tuple[str, str]]) -> str:
    """Every rank's (host, device), grouped by host: 'node1 [cuda:0 cuda:1], node2 [cuda:0 cuda:1]'."""
    hosts: dict[str, list[str]] = {}
    for host, device in entries:
        hosts.setdefault(host, []).append(device)
    shown = [f"{host} [{' '.join(devices)}]" for host, devices in list(hosts.items())[:4]]
    more = f", ... ({len(hosts)} hosts)" if len(hosts) > 4 else ""
    return ", ".join(shown) + more


def describe_workers(workers: int, requested: Optional[int]) -> str:
    chosen = "--num_workers" if requested is not None else "the default for this device and its cores per rank"
    return f"{workers} loader worker(s) per rank ({chosen})"


def describe_start(env: DistEnv, trainer: Trainer, devices: Sequence[tuple[str, str]]) -> str:
    """The plan rank 0 prints before the first step: who trains, on what, with which batch and data."""
    task, setup = trainer.task, trainer.setup
    sizes = f"train {len(task.train_set)} samples, validate {len(task.val_set) if task.val_set is not None else 0}"
    steps = f"{trainer.steps_per_epoch} optimizer steps per epoch"
    if trainer.loop.max_steps is not None:
        steps += f", stopping after {trainer.loop.max_steps} steps (--max_steps)"
    return "\n".join([
        f"launcher {env.launcher}: world size {env.world_size}, backend {env.backend}, device {env.device}",
        f"devices: {describe_devices(devices)}",
        trainer.plan.describe(),
        f"datasets: {sizes}; {steps}; {describe_workers(trainer.workers, trainer.options.process.num_workers)}",
        f"sync batch norm: {trainer.sync_bn_kind or 'off'}; gradients: "
        f"{'DDP all-reduce' if trainer.ddp else 'one rank, no DDP'}",
        f"step: {describe_capture(trainer.loop.capture, env.device)}; {describe_precision(trainer.precision)}",
        f"run folder: {setup.run_dir}{' (resuming)' if setup.resume else ''}",
    ])


def describe_precision(precision: Precision) -> str:
    """--half's part of the plan's step line. float16 on the CPU is said: torch's CPU float16 kernels run the toy
    AttFuse step about 50x slower than float32 (docs/benchmarks.md, "Half precision on the CPU"), where bfloat16
    is faster, so a run that meant the GPU's half precision learns it before its first epoch, not after."""
    dtype = precision.autocast_dtype
    if dtype is None:
        return "float32"
    if dtype == torch.bfloat16:
        return "bfloat16 autocast"
    line = "float16 autocast with a GradScaler"
    if precision.device.type == "cpu":
        line += (" (on the CPU, whose float16 kernels are far slower than float32's: --half bf16 is the CPU's "
                 "half precision)")
    return line


def describe_capture(mode: Optional[str], device: str) -> str:
    """--capture's line of the plan (engine/capture.py)."""
    if mode is None:
        return "eager"
    on_cuda = device.startswith("cuda")
    kind = {"compile": "inductor, CUDA graphs (reduce-overhead)" if on_cuda else "inductor",
            "cudagraphs": "eager kernels replayed as CUDA graphs" if on_cuda else
            "eager kernels (CUDA graphs need a CUDA device)"}.get(mode, "eager kernels")
    kernels = "; on the CPU with the kernels CUDA takes" if not on_cuda else ""
    return f"--capture {mode}: backbone, fusion, heads and loss compiled, {kind}{kernels}"


# ------------------------------------------------------------------------------------------------ main
def prepare_trainer(options: TrainOptions, env: DistEnv, build_task: TaskBuilder, with_hooks: bool = True
                    ) -> Trainer:
    """The one set-up of a training, for train_ddp.py and the benchmarks: the run decided once on rank 0 and
    broadcast (nothing is created; claiming the folder is the caller's, which a benchmark never does), seed,
    batch plan, task, and the Trainer complete (SyncBN, DDP, optimizer, a StopSignal the caller may enter).
    `with_hooks`: train_ddp.py's default_hooks; False for a program that drives Trainer.steps itself and
    records nothing into the run folder (it holds the trainer in `with`, which stops the loaders' workers)."""
    setup = comm.on_main_then_broadcast(lambda: decide_run(options.run, os.environ))
    with hypes_lib.naming_file(setup.hypes, hypes_lib.hypes_origin(setup.hypes_source, options.run.overrides)):
        seed = resolve_seed(setup.hypes, options.loop.seed)
        plan = plan_batches(setup.hypes, options.batch, env.world_size,
                            choose_per_gpu_batch(options, setup.hypes, env, build_task))
        seed_everything(seed)  # after the 'auto' measurement, whose models draw random numbers
        task = build_task(setup.hypes, for_training=True)
        hooks = default_hooks(setup.run_dir, env.is_main) if with_hooks else None
        return Trainer(task, plan, env, options, setup, hooks, StopSignal())  # the optimizer's, the scheduler's


def plan_final_evaluation(options: TrainOptions, hypes: dict,
                          build_eval: Optional[EvalBuilder]) -> Optional[tuple[EvalRequest, EvalSpec]]:
    """--eval_after_training: build the test-split evaluation now, so that a missing split or a task without
    evaluation fails before hours of training, not after."""
    if not options.loop.eval_after_training:
        return None
    if build_eval is None:
        raise ConfigError("--eval_after_training: this entry point has no evaluation; drop the flag")
    request = EvalRequest(test_split=True)  # no task options: the task's defaults
    return request, build_eval(hypes, request)


def main(argv: Optional[Sequence[str]], build_task: TaskBuilder, build_eval: Optional[EvalBuilder] = None) -> int:
    """tools/train_ddp.py: the recipe, top to bottom (module docstring); the exit code."""
    options = parse_train_options(argv)
    with DistributedRun(options.process) as run, kernel_settings(options.loop):
        env = run.env
        if options.loop.max_steps is not None and options.loop.max_steps < 1:
            raise ConfigError(f"--max_steps {options.loop.max_steps}: give a positive number of optimizer steps")
        # Both built before the folder exists: a value torch refuses (optimizer.lr -0.1) or a missing test split
        # fails here and leaves nothing. The Trainer draws no random number, so building the evaluation after it
        # leaves the training's draws as they were.
        trainer = prepare_trainer(options, env, build_task)
        setup = trainer.setup
        with hypes_lib.naming_file(setup.hypes, hypes_lib.hypes_origin(setup.hypes_source, options.run.overrides)):
            final = plan_final_evaluation(options, setup.hypes, build_eval)
        comm.on_main_then_broadcast(lambda: claim_run(setup))
        try:
            open_and_log(trainer)
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
            evaluate_last_checkpoint(trainer, final)
        except BaseException:
            if env.is_main and not setup.resume:
                remove_if_nothing_saved(setup.run_dir)  # a failed new run that saved nothing leaves no folder
            raise
        finally:
            release_run_dir(setup.run_dir)  # rank 0's lock; the end of the process would release it too
    return run.exit_code


def open_and_log(trainer: Trainer) -> None:
    """In the run folder this job holds: resume (Trainer.open_run), then the log file and the start's lines."""
    log, env, setup = get_logger(), trainer.env, trainer.setup
    notes = trainer.open_run()
    attach_log_file(setup.run_dir, env.rank)
    log.info(f"hypes: {setup.hypes_source}")
    for note in setup.notes:
        log.info(note)
    for level, note in notes:
        log.log(level, note)
    devices = comm.gather_objects((socket.gethostname(), env.device))
    if env.is_main:
        log.info(describe_start(env, trainer, devices))


def evaluate_last_checkpoint(trainer: Trainer, final: Optional[tuple[EvalRequest, EvalSpec]]) -> None:
    """--eval_after_training: the last checkpoint on the test split, on every rank."""
    if final is None:
        return
    request, spec = final
    request.run_dir = str(trainer.setup.run_dir)
    weights = trainer.last_weights or trainer.setup.run_dir / ckpt.weights_name(trainer.settings.epochs)
    # The trainer's last save ends with an agreement: the checkpoint is on disk for every rank.
    evaluate_checkpoint(spec, request, weights, trainer.env, trainer.workers)
