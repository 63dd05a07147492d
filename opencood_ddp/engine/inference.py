"""The evaluation recipe behind tools/inference_ddp.py, top to bottom (`main`, then `run_eval`).

the flags (the engine's, and those of the task the run's config.yaml names: its registry's `eval_options`) ->
detect launcher -> process group -> the run (`load_run`: config.yaml and the chosen checkpoint; rank 0,
broadcast) -> the task's EvalSpec (dataset, model, its Evaluator) -> weights -> engine/evaluator.py's `evaluate`
on every rank, which calls the task's metric itself on rank 0 -> rank 0 writes the result file (eval.yaml) and
logs the evaluator's report. From tools/inference_ddp.py to the metric the stack is six frames: the tool, `main`,
`run_eval`, `evaluate_checkpoint`, `evaluate` and the metric's call (the opencood task's
`metrics/summary.DetectionMetric`), three files of the library. `load_run` is also how tools/export_upstream.py
and tools/analysis/ read a run.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import yaml

from opencood_ddp.atomic import atomic_write
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp import hypes as hypes_lib
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.evaluator import EvalRequest, EvalResult, EvalSpec, evaluate
from opencood_ddp.engine.loaders import workers_per_rank
from opencood_ddp.engine.entry import DistributedRun
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.options import EvalOptions, parse_eval_options
from opencood_ddp.engine.run_dir import CONFIG_NAME, require_writable
from opencood_ddp.errors import CheckpointError, ConfigError, OpencoodDdpError, OutputError
from opencood_ddp.yaml_parsers import load_parsed_hypes

EvalBuilder = Callable[[dict, EvalRequest], EvalSpec]
# The task registry's class of evaluation flags for a config (tasks.eval_options); None: no flags of its own.
EvalOptionsOf = Callable[[dict], Optional[type]]


@dataclass(frozen=True)
class LoadedRun:
    """A run's parsed config.yaml and the checkpoint chosen among its files."""

    hypes: dict
    checkpoint: Path
    config: Path  # the file the hypes came from: what a refusal of them names (hypes.naming_file)


def load_run(run_dir: Path, epoch: Optional[int] = None, bestval: bool = False,
             step: Optional[int] = None, step_flag: Optional[str] = None) -> LoadedRun:
    """The one reading of a run folder, for evaluation and every tool: its config.yaml through the one hypes
    loader, and the checkpoint `choose_checkpoint` picks."""
    config = run_dir / CONFIG_NAME
    if not config.is_file():
        raise ConfigError(f"{config} does not exist; pass --model_dir of a training run (it holds config.yaml)")
    return LoadedRun(load_parsed_hypes(config), choose_checkpoint(run_dir, epoch, bestval, step, step_flag), config)


def choose_checkpoint(run_dir: Path, epoch: Optional[int] = None, bestval: bool = False,
                      step: Optional[int] = None, step_flag: Optional[str] = None) -> Path:
    """--bestval (the newest), --epoch N, --step K (a tool that offers it: ``step_flag`` names the flag), or the
    highest net_epoch{N}.pth (upstream's choice)."""
    if bestval:
        found = ckpt.epochs_on_disk(run_dir, ckpt.BESTVAL_RE)
        if not found:
            raise CheckpointError(f"{run_dir}: no net_epoch_bestval_at*.pth; drop --bestval or pass --epoch")
        return run_dir / ckpt.bestval_name(found[-1])
    if step is not None:
        return _named_checkpoint(run_dir, step, ckpt.STEP_WEIGHTS_RE, ckpt.step_weights_name, "step")
    if epoch is not None:
        return _named_checkpoint(run_dir, epoch, ckpt.WEIGHTS_RE, ckpt.weights_name, "epoch")
    found = ckpt.epochs_on_disk(run_dir)
    if not found:
        steps = ckpt.epochs_on_disk(run_dir, ckpt.STEP_WEIGHTS_RE)
        go_on = (f"train on to the epoch's end (tools/train_ddp.py --model_dir {run_dir} goes on from "
                 f"{ckpt.step_weights_name(steps[-1])}){f', pass {step_flag} K for a step' if step_flag else ''}, "
                 if steps else "train first, ")
        raise CheckpointError(f"{run_dir}: no net_epoch*.pth checkpoint (steps on disk: {steps or 'none'}); {go_on}"
                              f"or pass another --model_dir")
    return run_dir / ckpt.weights_name(found[-1])


def _named_checkpoint(run_dir: Path, number: int, pattern: re.Pattern, name: Callable[[int], str], kind: str) -> Path:
    """The checkpoint of --epoch N or --step K, refused with the numbers on disk when it is not there."""
    found = ckpt.epochs_on_disk(run_dir, pattern)
    if number not in found:
        raise CheckpointError(f"{run_dir}: no {name(number)} ({kind}s on disk: {found or 'none'}); pass one of "
                              f"them to --{kind}")
    return run_dir / name(number)


def write_eval_yaml(path: Path, result: EvalResult, checkpoint: Path) -> None:
    content = dict(result.summary, frames=result.frames, world_size=result.world_size,
                   seconds=round(result.seconds, 3), checkpoint=checkpoint.name)
    text = yaml.safe_dump(content, sort_keys=False)
    atomic_write(path, lambda handle: handle.write(text.encode()))


def evaluate_checkpoint(spec: EvalSpec, request: EvalRequest, checkpoint: Path, env: DistEnv,
                        num_workers: int) -> Optional[EvalResult]:
    """Load `checkpoint` into the spec's model, evaluate on every rank; rank 0 writes the evaluator's result file
    into ``request.run_dir`` and logs its report. Shared by inference and training's --eval_after_training."""
    log = get_logger()
    ckpt.load_weights(spec.model, checkpoint)
    spec.model.to(torch.device(env.device))
    log.info(f"evaluating {checkpoint} on {len(spec.dataset)} frames with {env.world_size} process(es)")
    result = evaluate(spec, env, batch_size=request.batch_size, num_workers=num_workers)
    error = None
    if result is not None:
        path = Path(request.run_dir) / spec.evaluator.result_name
        try:
            write_eval_yaml(path, result, checkpoint)
        except OSError as exc:
            error = OutputError.of(exc, spec.evaluator.result_name)
        else:
            log.info(f"{spec.evaluator.report(result)}\n{_pace(result)}\nwrote {path}")
    error = comm.first_error(error)  # every rank leaves with rank 0's word
    if error is not None:
        raise error
    return result


def _pace(result: EvalResult) -> str:
    rate = result.frames / result.seconds if result.seconds > 0 else float("inf")
    return f"{result.frames} frames on {result.world_size} process(es) in {result.seconds:.1f} s ({rate:.1f} frames/s)"


def run_to_evaluate(options: EvalOptions) -> LoadedRun:
    """`load_run` of --model_dir on rank 0, handed to every rank (a refusal there is raised on every rank); the
    run must take the result file. Shared with the task's recipes that evaluate one run many times."""
    run_dir = Path(options.model_dir)

    def read() -> LoadedRun:
        run = load_run(run_dir, options.epoch, options.bestval)
        # The result file and the task's artefacts go into the run: refuse before evaluating.
        require_writable(run_dir, "write eval.yaml into it (or evaluate a copy of the run)")
        return run

    return comm.on_main_then_broadcast(read)


def run_eval(options: EvalOptions, env: DistEnv, build_eval: EvalBuilder) -> Optional[EvalResult]:
    run = run_to_evaluate(options)
    request = EvalRequest(dataset_dir=options.dataset_dir, batch_size=options.batch_size, run_dir=options.model_dir,
                          task_options=options.task)
    with hypes_lib.naming_file(run.hypes, run.config):
        spec = build_eval(run.hypes, request)
    workers = workers_per_rank(options.process.num_workers, env, task_workers=spec.gpu_workers)
    return evaluate_checkpoint(spec, request, run.checkpoint, env, workers)


def task_options_of_run(argv: Optional[Sequence[str]], eval_options: EvalOptionsOf) -> Optional[type]:
    """The evaluation flags of the task that --model_dir's config.yaml names, known before the flags are parsed:
    the file as written (no parser run). Where it cannot be read, or names no usable task, the default task's:
    the run is read again once the process group is up, and rank 0 tells what is wrong in one line."""
    known, _ = _model_dir_flag().parse_known_args(argv)
    try:
        return eval_options(hypes_lib.load_hypes(Path(known.model_dir) / CONFIG_NAME) if known.model_dir else {})
    except (OpencoodDdpError, OSError):
        return eval_options({})


def _model_dir_flag() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model_dir")
    return parser


def main(argv: Optional[Sequence[str]], build_eval: EvalBuilder, eval_options: EvalOptionsOf) -> int:
    """tools/inference_ddp.py: the recipe, top to bottom (module docstring); the exit code."""
    options = parse_eval_options(argv, task_options_of_run(argv, eval_options))
    with DistributedRun(options.process) as run:
        run_eval(options, run.env, build_eval)
    return run.exit_code
