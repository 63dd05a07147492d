"""The evaluation recipe behind tools/inference_ddp.py, top to bottom.

detect launcher -> process group -> the run's config.yaml (rank 0, broadcast) -> checkpoint choice (rank 0,
broadcast) -> the task's EvalSpec (dataset, model, per-frame evaluation) -> weights -> evaluate on every rank
-> rank 0 writes the spec's result file (eval.yaml) and logs its report.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch
import yaml

from opencood_ddp.atomic import atomic_write
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.evaluator import EvalRequest, EvalResult, EvalSpec, evaluate
from opencood_ddp.engine.loaders import workers_per_rank
from opencood_ddp.engine.entry import run_distributed
from opencood_ddp.engine.logs import get_logger
from opencood_ddp.engine.options import EvalOptions, parse_eval_options
from opencood_ddp.engine.run_dir import CONFIG_NAME, require_writable
from opencood_ddp.errors import CheckpointError, ConfigError
from opencood_ddp.yaml_parsers import load_parsed_hypes

EvalBuilder = Callable[[dict, EvalRequest], EvalSpec]


def load_run_config(run_dir: Path) -> dict:
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass --model_dir of a training run (it holds config.yaml)")
    # The result file and the task's artefacts go into the run: refuse before evaluating.
    require_writable(run_dir, "write eval.yaml into it (or evaluate a copy of the run)")
    return load_parsed_hypes(path)


def choose_checkpoint(run_dir: Path, epoch: Optional[int], bestval: bool) -> Path:
    """--epoch N, --bestval, or the highest net_epoch{N}.pth (upstream's choice)."""
    if bestval:
        found = ckpt.epochs_on_disk(run_dir, ckpt.BESTVAL_RE)
        if not found:
            raise CheckpointError(f"{run_dir}: no net_epoch_bestval_at*.pth; drop --bestval or pass --epoch")
        return run_dir / ckpt.bestval_name(found[-1])
    found = ckpt.epochs_on_disk(run_dir)
    if epoch is not None:
        if epoch not in found:
            raise CheckpointError(f"{run_dir}: no {ckpt.weights_name(epoch)} (epochs on disk: "
                                  f"{found or 'none'}); pass one of them to --epoch")
        return run_dir / ckpt.weights_name(epoch)
    if not found:
        raise CheckpointError(f"{run_dir}: no net_epoch*.pth checkpoint; train first or pass another --model_dir")
    return run_dir / ckpt.weights_name(found[-1])


def write_eval_yaml(path: Path, result: EvalResult, checkpoint: Path) -> None:
    content = dict(result.summary, frames=result.frames, world_size=result.world_size,
                   seconds=round(result.seconds, 3), checkpoint=checkpoint.name)
    text = yaml.safe_dump(content, sort_keys=False)
    atomic_write(path, lambda handle: handle.write(text.encode()))


def evaluate_checkpoint(spec: EvalSpec, request: EvalRequest, checkpoint: Path, env: DistEnv,
                        num_workers: int) -> Optional[EvalResult]:
    """Load `checkpoint` into the spec's model, evaluate on every rank; rank 0 writes eval.yaml into
    ``request.run_dir`` and logs the table. Shared by inference and training's --eval_after_training."""
    log = get_logger()
    run_dir = Path(request.run_dir)
    ckpt.load_weights(spec.model, checkpoint)
    spec.model.to(torch.device(env.device))
    log.info(f"evaluating {checkpoint} on {len(spec.dataset)} frames with {env.world_size} process(es)")
    result = evaluate(spec, env, batch_size=request.batch_size, num_workers=num_workers)
    if result is not None:
        path = run_dir / spec.result_name
        write_eval_yaml(path, result, checkpoint)
        log.info(f"{spec.report(result)}\n{_pace(result)}\nwrote {path}")
    return result


def _pace(result: EvalResult) -> str:
    rate = result.frames / result.seconds if result.seconds > 0 else float("inf")
    return f"{result.frames} frames on {result.world_size} process(es) in {result.seconds:.1f} s ({rate:.1f} frames/s)"


def load_run(options: EvalOptions) -> Tuple[dict, Path]:
    """The run's parsed config.yaml and the checkpoint to evaluate: read on rank 0, handed to every rank (a
    refusal there is raised on every rank). Shared with the task's recipes that evaluate one run many times."""
    run_dir = Path(options.model_dir)
    return comm.on_main_then_broadcast(
        lambda: (load_run_config(run_dir), choose_checkpoint(run_dir, options.epoch, options.bestval)))


def run_eval(options: EvalOptions, env: DistEnv, build_eval: EvalBuilder) -> Optional[EvalResult]:
    hypes, checkpoint = load_run(options)
    request = EvalRequest(dataset_dir=options.dataset_dir, batch_size=options.batch_size, run_dir=options.model_dir,
                          task_options=options.task)
    spec = build_eval(hypes, request)
    return evaluate_checkpoint(spec, request, checkpoint, env,
                               workers_per_rank(options.process.num_workers, env, task_workers=spec.gpu_workers))


def main(argv: Optional[Sequence[str]], build_eval: EvalBuilder, task_options: Optional[type] = None) -> int:
    """tools/inference_ddp.py: ``task_options`` is the task's options class (its flags and their typed values)."""
    options = parse_eval_options(argv, task_options)
    return run_distributed(options.process, lambda env: run_eval(options, env, build_eval))
