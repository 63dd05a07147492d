"""Training loaders whose workers persist over epochs (engine/loaders.py): each epoch's samples are those a loader
forked for that epoch reads, bit for bit, augmentation included, and the workers are forked once. Every loader's
workers run BLAS on one thread, and a cloud's transform has the same bits on any BLAS thread count. The default
worker count follows the rank's device and share of the cores."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits
from torch.utils.data import DataLoader, Dataset

from opencood_ddp.data.datasets import build_dataset
from opencood_ddp.data.geometry import transform_points
from opencood_ddp.distributed.env import DistEnv
from opencood_ddp.engine.evaluator import EvalSpec, evaluate
from opencood_ddp.engine.handover import InBandSmallTensors
from opencood_ddp.engine.loaders import (MAX_GPU_WORKERS, EpochBatches, EpochKeyed, affinity_cores, cores_per_rank,
                                         default_workers, training_loader, workers_per_rank)
from test_datasets import SEED, assert_identical, flatten, toy_hypes
from test_hooks import _trainer

EPOCH_BATCHES = {0: [[0, 1], [2, 3]], 1: [[5, 2], [7, 0]], 2: [[3, 6]]}


def _record_worker(folder: Path):
    def init(worker_id: int) -> None:
        (folder / f"worker_{os.getpid()}").touch()
    return init


def test_persistent_workers_draw_each_epochs_augmentation(toy_small, tmp_path):
    """Training-mode toy AttFuse samples (flip, rotation, scaling drawn per sample and epoch) through 2
    persistent workers, against a fresh dataset set to each epoch and read in this process."""
    dataset = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    reference = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    sampler = EpochBatches()
    loader = DataLoader(EpochKeyed(dataset), batch_sampler=sampler, num_workers=2, persistent_workers=True,
                        collate_fn=InBandSmallTensors(dataset.collate_batch_train),
                        worker_init_fn=_record_worker(tmp_path))
    for epoch, batches in EPOCH_BATCHES.items():
        sampler.use(epoch, batches)
        reference.set_epoch(epoch)
        got = list(loader)
        assert len(got) == len(batches)
        for batch, indices in zip(got, batches):
            assert_identical(batch, reference.collate_batch_train([reference[i] for i in indices]))
    assert len(list(tmp_path.glob("worker_*"))) == 2  # forked once, for the first epoch


def test_the_epochs_differ_and_an_unfinished_epoch_is_left_cleanly(toy_small):
    """The key changes the draws (a loader stuck at epoch 0 would repeat them), and an epoch left after its first
    batch (--max_steps, a stop) does not leak its prefetched batches into the next."""
    dataset = build_dataset(toy_hypes("intermediate", toy_small), "train", True, SEED)
    sampler = EpochBatches()
    loader = DataLoader(EpochKeyed(dataset), batch_sampler=sampler, num_workers=2, persistent_workers=True,
                        collate_fn=InBandSmallTensors(dataset.collate_batch_train))
    sampler.use(0, [[0, 1], [2, 3], [4, 5]])
    first = next(iter(loader))
    sampler.use(1, [[0, 1]])
    again = list(loader)
    assert len(again) == 1
    left, right = flatten(first), flatten(again[0])
    differs = [k for k in left if isinstance(left[k], torch.Tensor) and left[k].shape == right[k].shape
               and not torch.equal(left[k], right[k])]
    assert differs, "epoch 1 drew epoch 0's augmentation"


def test_a_trainer_left_mid_epoch_stops_its_workers_when_its_with_ends(tmp_path):
    """A program that drives Trainer.steps itself (benchmark_ddp) leaves an epoch after its first step; at the end
    of `with trainer` both loaders' persistent workers (training, and validation's, which `validate` made) have
    exited. Without it they would wait for the cycle collector, and a loader shut down there waits 5 s per worker
    (Trainer.__exit__ says why)."""
    before = set(multiprocessing.active_children())
    with _trainer(tmp_path / "run", workers=2) as trainer:
        next(trainer.steps(0))
        trainer.validate()
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 4 and all(w.is_alive() for w in workers)  # 2 a loader
    assert not any(w.is_alive() for w in workers)


# ------------------------------------------------------------------------------------------ BLAS threads
class BlasThreads(Dataset):
    """Each item is (pid, the most threads a BLAS library of the process that reads it runs)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return os.getpid(), max(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")


def _as_list(items):
    return list(items)


def _worker_reports(loader) -> set:
    reports = {item for batch in loader for item in batch}
    assert os.getpid() not in {pid for pid, _ in reports}, "read in the main process, not in a worker"
    return {threads for _, threads in reports}


@pytest.fixture
def two_blas_threads():
    """This process's BLAS on 2 threads, which a forked worker inherits unless its init changes it."""
    if not any(lib["user_api"] == "blas" for lib in threadpool_info()):
        pytest.skip("numpy has no BLAS library that threadpoolctl can see")
    with threadpool_limits(limits=2, user_api="blas"):
        yield


def test_a_plain_worker_inherits_the_main_process_blas_threads(two_blas_threads):
    """The control: without the init, a worker runs numpy's BLAS on the main process's thread count."""
    loader = DataLoader(BlasThreads(), batch_size=2, num_workers=2, collate_fn=_as_list)
    assert _worker_reports(loader) == {2}


def test_training_loader_workers_run_blas_on_one_thread(two_blas_threads):
    loader = training_loader(BlasThreads(), _as_list, workers=2, pin_memory=False)
    loader.batch_sampler.use(0, [[0, 1], [2, 3]])
    assert _worker_reports(loader) == {1}
    assert max(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas") == 2  # main untouched


class WorkerReports:
    """An Evaluator whose records are the workers' reports and whose metric is the records themselves."""

    result_name = "eval.yaml"

    def evaluate_batch(self, model, batch, indices):
        return list(batch)

    def metric(self, records):
        return records

    def finish(self, records):
        pass

    def report(self, result):
        return str(result.summary)


def test_evaluation_loader_workers_run_blas_on_one_thread(two_blas_threads):
    spec = EvalSpec(dataset=BlasThreads(), collate=_as_list, model=torch.nn.Identity(),
                    move_to=lambda batch, device: batch, evaluator=WorkerReports())
    result = evaluate(spec, DistEnv(), batch_size=2, num_workers=2)
    assert result.frames == 4
    assert {threads for _, threads in result.summary} == {1}
    assert os.getpid() not in {pid for pid, _ in result.summary}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_cloud_transform_has_the_same_bits_on_any_blas_thread_count(dtype):
    """transform_points' (N, 3) @ (3, 3) goes through BLAS; the workers' one thread must not move a point: each
    output is one 3-term sum whatever the threads' split of the rows."""
    rng = np.random.default_rng(3)
    cloud = np.concatenate([rng.normal(0.0, 40.0, (90_701, 3)), rng.uniform(0, 1, (90_701, 1))], 1).astype(dtype)
    angle = 0.7
    pose = np.array([[np.cos(angle), -np.sin(angle), 0.01, 12.5], [np.sin(angle), np.cos(angle), -0.02, -3.25],
                     [-0.01, 0.02, 1.0, 1.9], [0.0, 0.0, 0.0, 1.0]])
    results = {}
    for threads in (1, 2, 3, 8):
        with threadpool_limits(limits=threads, user_api="blas"):
            results[threads] = transform_points(cloud, pose)
    for threads, points in results.items():
        assert np.array_equal(points, results[1]), f"{threads} BLAS threads moved a point"


# ------------------------------------------------------------------------------------------ default worker count
@pytest.mark.parametrize("environ,launcher,world,cores,share", [
    ({}, "single", 1, 16, 16),
    ({"LOCAL_WORLD_SIZE": "4"}, "torchrun", 8, 64, 16),  # 4 ranks on this node of a 2-node job
    ({"LOCAL_WORLD_SIZE": "3"}, "torchrun", 3, 16, 5),
    ({"LOCAL_WORLD_SIZE": "8"}, "torchrun", 8, 4, 1),  # more ranks than cores: still one
    ({}, "torchrun", 2, 16, 16),  # the node's rank count unknown: the whole affinity
    ({"SLURM_CPUS_PER_TASK": "6", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}, "slurm", 4, 6, 6),  # bound
    ({"SLURM_CPUS_PER_TASK": "6", "SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}, "slurm", 4, 32, 6),
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}, "slurm", 8, 32, 8),
])
def test_a_ranks_share_of_the_cores(environ, launcher, world, cores, share):
    assert cores_per_rank(environ, launcher, world, cores) == share


@pytest.mark.parametrize("device,share,workers", [
    ("cpu", 1, 2), ("cpu", 64, 2),  # the CPU step is the slow side, whatever the cores
    ("cuda", 1, 1), ("cuda", 2, 1), ("cuda", 5, 4), ("cuda", 9, MAX_GPU_WORKERS), ("cuda", 64, MAX_GPU_WORKERS),
])
def test_default_workers_per_device_and_share(device, share, workers):
    assert default_workers(device, share) == workers


@pytest.mark.parametrize("device,share,task_workers,workers", [
    ("cuda", 64, 4, 4), ("cuda", 3, 4, 2), ("cuda", 64, None, MAX_GPU_WORKERS), ("cuda", 64, 12, MAX_GPU_WORKERS),
    ("cpu", 64, 4, 2),  # the CPU's step is the slow side whatever the task's loader needs
])
def test_a_tasks_own_need_caps_the_gpu_default(device, share, task_workers, workers):
    """Task.gpu_workers (a data path whose worker costs less a sample) lowers the GPU default, never raises it."""
    assert default_workers(device, share, task_workers) == workers


def test_num_workers_given_wins_and_the_default_reads_this_process_affinity():
    cpu_env, gpu_env = DistEnv(), DistEnv(device="cuda:0")
    assert workers_per_rank(0, gpu_env) == 0 and workers_per_rank(5, cpu_env) == 5
    assert workers_per_rank(None, cpu_env, {}) == 2
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread on one core, however many the machine has
    try:
        assert affinity_cores() == 1, os.cpu_count()
        assert workers_per_rank(None, gpu_env, {}) == 1  # 1 core: the one worker the floor allows
    finally:
        os.sched_setaffinity(0, allowed)
