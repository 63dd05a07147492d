"""Distributed evaluation: unpadded shards, per-frame records gathered to rank 0 in dataset order, metrics once.

The engine knows nothing about detection. A task hands over an ``EvalSpec``: the dataset and its collate
function, the model, ``move_to`` and its ``Evaluator``: per-batch records on every rank, then on rank 0 the
metric, called here directly, the artefacts and the report. Every frame is evaluated by exactly one rank (the
shards of ``EvalShardSampler`` are unpadded and cover the dataset), so nothing is counted twice, and the metric
is computed once from the same ordered list at every world size: the metrics do not depend on it. Where the
dataset says what a frame costs (``sample_cost(index)``: its CAVs, read from the index), the shards are balanced
by that cost rather than contiguous: real test splits hold scenarios of 2 to 7 CAVs, and the evaluation waits
for its slowest rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.distributed.samplers import EvalShardSampler
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.loaders import one_blas_thread
from opencood_ddp.engine.logs import progress
from opencood_ddp.errors import OpencoodDdpError, OutputError, unwrap_worker_error


@dataclass
class EvalRequest:
    """What the user asked for, handed to the task's ``build_eval``. ``task_options`` is opaque to the engine:
    an instance of the task's own options class (``EvalOptions.task``), or None for the task's defaults
    (training's --eval_after_training)."""

    dataset_dir: Optional[str] = None  # None: the run's validate_dir, as upstream's inference
    test_split: bool = False  # with dataset_dir None: the hypes' test_dir where it has one (--eval_after_training)
    batch_size: int = 1
    run_dir: Optional[str] = None  # where the result file and the task's artefacts go
    task_options: Any = None


class Evaluator(Protocol):
    """A task's evaluation, one named object (detectron2's ``DatasetEvaluator``, without state)."""

    result_name: str  # the file rank 0 writes the summary to, in the request's run_dir

    def evaluate_batch(self, model: nn.Module, batch: Any, indices: Sequence[int]) -> List[Any]:
        """Every rank, each batch of its shard: one picklable record per sample (``indices``: their dataset
        indices, so that per-frame files are named by frame whatever rank writes them)."""

    def metric(self, records: List[Any]) -> dict:
        """Rank 0, once: the records in dataset order -> the summary (the opencood task's is
        ``metrics/summary.DetectionMetric``; this module calls it itself, never through the task)."""

    def finish(self, records: List[Any]) -> None:
        """Rank 0, once, after the metric: artefacts drawn from the records in dataset order (plots, the per-frame
        files published), so that an evaluation whose metric fails leaves none."""

    def report(self, result: "EvalResult") -> str:
        """Rank 0: the text logged after evaluation (a metrics table)."""


@dataclass
class EvalSpec:
    dataset: Dataset
    collate: Callable
    model: nn.Module
    move_to: Callable[[Any, torch.device], Any]
    evaluator: Evaluator
    gpu_workers: Optional[int] = None  # as Task.gpu_workers


@dataclass
class EvalResult:
    summary: dict
    frames: int
    seconds: float
    world_size: int


def _shard_records(spec: EvalSpec, env: DistEnv, batch_size: int, num_workers: int) -> List[Tuple[int, Any]]:
    """(dataset index, record) for this rank's frames, in order; a progress bar on rank 0."""
    sampler = EvalShardSampler(len(spec.dataset), env.world_size, env.rank, sample_costs(spec.dataset))
    indices = list(sampler)
    loader = DataLoader(spec.dataset, batch_size=batch_size, sampler=sampler,
                        collate_fn=InBandSmallTensors(spec.collate), num_workers=num_workers,
                        worker_init_fn=one_blas_thread, generator=torch.Generator())  # global RNG untouched
    device = torch.device(env.device)
    bar = progress(len(spec.dataset), "evaluating", env.is_main)
    started, records = time.perf_counter(), []
    try:
        for number, batch in enumerate(loader):
            batch_indices = indices[number * batch_size:(number + 1) * batch_size]
            batch_records = spec.evaluator.evaluate_batch(spec.model, spec.move_to(batch, device), batch_indices)
            if len(batch_records) != len(batch_indices):
                raise RuntimeError(f"rank {env.rank}: evaluate_batch returned {len(batch_records)} records for "
                                   f"{len(batch_indices)} frames; it must return one record per sample")
            records.extend(zip(batch_indices, batch_records))
            # Rank 0 sees only its own shard, and the shards carry equal work: its share of its shard done is the
            # whole job's share done.
            share = len(spec.dataset) / max(len(indices), 1)
            bar.update(min(round(len(records) * share) - bar.n, bar.total - bar.n))
            bar.set_postfix(frames_per_s=f"{len(records) * share / (time.perf_counter() - started):.1f}")
    finally:
        bar.close()  # an error's line must not run on from the bar's
    return records


def sample_costs(dataset: Dataset) -> Optional[List[float]]:
    """Each sample's cost, where the dataset can say (`sample_cost(index)`, read without loading the sample);
    None otherwise (contiguous shards)."""
    cost = getattr(dataset, "sample_cost", None)
    if not callable(cost):
        return None
    return [float(cost(index)) for index in range(len(dataset))]


def in_dataset_order(per_rank: Sequence[Sequence[Tuple[int, Any]]], num_frames: int) -> List[Any]:
    """Merge the ranks' (index, record) lists; every index of [0, num_frames) exactly once."""
    merged = sorted((pair for records in per_rank for pair in records), key=lambda pair: pair[0])
    found = [index for index, _ in merged]
    if found != list(range(num_frames)):
        raise RuntimeError(f"evaluation covered {len(found)} frames of {num_frames}, not each exactly once")
    return [record for _, record in merged]


def evaluate(spec: EvalSpec, env: DistEnv, batch_size: int = 1, num_workers: int = 2) -> Optional[EvalResult]:
    """Evaluate on every rank; rank 0 returns the result, the others None."""
    spec.model.eval()
    started = time.perf_counter()
    records: List[Tuple[int, Any]] = []
    error: Optional[OpencoodDdpError] = None
    try:
        with torch.no_grad():  # not a decorator: the reading path to the metric keeps no frame of torch's
            records = _shard_records(spec, env, batch_size, num_workers)
    except OpencoodDdpError as exc:  # a frame this rank cannot read: every rank stops with its message
        error = unwrap_worker_error(exc)
    error = comm.first_error(error)
    if error is not None:
        raise error
    gathered = comm.gather_objects(records)
    comm.barrier()
    result = None
    if env.is_main:
        try:
            ordered = in_dataset_order(gathered, len(spec.dataset))
            summary = spec.evaluator.metric(ordered)
            spec.evaluator.finish(ordered)
            result = EvalResult(summary=summary, frames=len(ordered), seconds=time.perf_counter() - started,
                                world_size=env.world_size)
        except OSError as exc:  # rank 0's artefacts (the published frames, the plots) could not be written
            error = OutputError.of(exc, "the evaluation's files")
        except OpencoodDdpError as exc:
            error = exc
    error = comm.first_error(error)  # the other ranks wait here for rank 0's word, not in a later collective
    if error is not None:
        raise error
    return result
