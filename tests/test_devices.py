"""A rank's device as a function of the launcher's environment and the GPUs the process sees (distributed/devices.py).

Each row is what a launcher exports to one process, trimmed to the variables that decide: torchrun, SLURM with every
GPU of the node visible, SLURM binding one GPU per task (asked for, or only seen in the step's GPU list), GPUs
shared on purpose, and more ranks than GPUs by mistake. The refusals are checked for every local rank of the node,
local rank 0 included: a rank that passed would wait in the rendezvous for the others until the timeout.
"""
import pytest

from opencood_ddp.distributed.devices import expand_tasks_per_node
from opencood_ddp.distributed.env import detect_dist_env
from opencood_ddp.errors import ConfigError

TORCHRUN_4 = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
              "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
# `srun -N 2 --ntasks-per-node=4` task 5 (local id 1 on the second node), every GPU of the node visible
SRUN_4 = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
          "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77"}
# The same task under `srun --gpus-per-task=1`: SLURM shows it only its own GPU (the node's third one)
SRUN_GPUS_PER_TASK = dict(SRUN_4, SLURM_LOCALID="2", SLURM_PROCID="6", SLURM_GPUS_PER_TASK="1",
                          CUDA_VISIBLE_DEVICES="2", SLURM_STEP_GPUS="0,1,2,3")
SRUN_GPU_BIND = dict(SRUN_4, SLURM_LOCALID="3", SLURM_PROCID="7", SLURM_GPU_BIND="single:1", CUDA_VISIBLE_DEVICES="3")
# A site whose cgroups bind the GPUs without a flag in the environment: only the step's GPU list tells
SRUN_BOUND_SEEN = dict(SRUN_4, SLURM_LOCALID="3", SLURM_PROCID="7", SLURM_STEP_GPUS="4,5,6,7", CUDA_VISIBLE_DEVICES="0")
SHARE = {"OPENCOOD_DDP_SHARE_GPUS": "1"}

# (id, environ, local_rank_arg, visible GPUs, backend, expected device, expected processes_on_device)
CHOICES = [
    ("single-process", {}, None, 1, None, "cuda:0", 1),
    ("torchrun-one-gpu-each", TORCHRUN_4, None, 4, None, "cuda:1", 1),
    ("torchrun-more-gpus-than-ranks", TORCHRUN_4, None, 8, None, "cuda:1", 1),
    ("slurm-all-gpus-visible", SRUN_4, None, 4, None, "cuda:1", 1),
    ("slurm-gpus-per-task", SRUN_GPUS_PER_TASK, None, 1, None, "cuda:0", 1),
    ("slurm-gpu-bind-single", SRUN_GPU_BIND, None, 1, None, "cuda:0", 1),
    ("slurm-binding-seen-in-step-gpus", SRUN_BOUND_SEEN, None, 1, None, "cuda:0", 1),
    ("slurm-gpu-bind-none-all-visible", dict(SRUN_4, SLURM_GPU_BIND="none"), None, 4, None, "cuda:1", 1),
    # --gpus-per-task on an old SLURM that does not bind: every task sees all four, local rank picks
    ("slurm-gpus-per-task-unbound", dict(SRUN_4, SLURM_GPUS_PER_TASK="1", SLURM_STEP_GPUS="0,1,2,3"), None, 4,
     None, "cuda:1", 1),
    ("shared-on-purpose", dict(TORCHRUN_4, LOCAL_RANK="3", **SHARE), None, 2, "gloo", "cuda:1", 2),
    ("shared-one-gpu", dict(TORCHRUN_4, LOCAL_RANK="2", **SHARE), None, 1, "gloo", "cuda:0", 4),
    ("shared-uneven", dict(TORCHRUN_4, LOCAL_WORLD_SIZE="3", LOCAL_RANK="0", **SHARE), None, 2, "gloo", "cuda:0", 2),
    ("slurm-bound-and-shared", dict(SRUN_4, SLURM_GPU_BIND="single:2", SLURM_STEP_GPUS="0,1",
                                    CUDA_VISIBLE_DEVICES="0", **SHARE), None, 1, "gloo", "cuda:0", 2),
    ("legacy-launch-arg", {"RANK": "3", "WORLD_SIZE": "4"}, 3, 4, None, "cuda:3", 1),
]


@pytest.mark.parametrize("environ,local_rank_arg,visible,backend,device,sharing", [c[1:] for c in CHOICES],
                         ids=[c[0] for c in CHOICES])
def test_device_choice_table(environ, local_rank_arg, visible, backend, device, sharing):
    env = detect_dist_env(dict(environ), local_rank_arg, cuda_available=True, backend=backend, cuda_count=visible)
    assert (env.device, env.processes_on_device) == (device, sharing)


def _every_local_rank(environ: dict, key: str, count: int) -> list:
    return [dict(environ, **{key: str(r)}) for r in range(count)]


@pytest.mark.parametrize("environ,key,count,visible,names", [
    # torchrun --nproc_per_node=4 on a 2-GPU node
    (TORCHRUN_4, "LOCAL_RANK", 4, 2, ("runs 4 processes", "sees the same 2 GPU(s)", "--nproc_per_node",
                                      "--gpus-per-task=1", "OPENCOOD_DDP_SHARE_GPUS=1 with --dist_backend gloo")),
    # srun --ntasks-per-node=4 on a node whose 2 GPUs every task sees
    (dict(SRUN_4, CUDA_VISIBLE_DEVICES="0,1"), "SLURM_LOCALID", 4, 2,
     ("runs 4 processes", "(CUDA_VISIBLE_DEVICES=0,1)", "--ntasks-per-node", "--gpus-per-task=1")),
    # SLURM binds 4 tasks to 2 GPUs (two on each)
    (dict(SRUN_4, SLURM_GPU_BIND="single:2", SLURM_STEP_GPUS="0,1"), "SLURM_LOCALID", 4, 1,
     ("binds the 4 tasks of this node to 2 GPU(s)", "OPENCOOD_DDP_SHARE_GPUS=1")),
])
def test_more_ranks_than_gpus_is_refused_on_every_local_rank(environ, key, count, visible, names):
    for each in _every_local_rank(environ, key, count):
        with pytest.raises(ConfigError) as info:
            detect_dist_env(each, cuda_available=True, cuda_count=visible)
        for name in names:
            assert name in str(info.value)


def test_an_unknown_node_size_still_refuses_a_local_rank_past_the_gpus():
    environ = {"RANK": "2", "WORLD_SIZE": "4"}  # torch.distributed.launch --local_rank, no LOCAL_WORLD_SIZE
    with pytest.raises(ConfigError, match="runs at least 4 processes of the job but each sees the same 2 GPU"):
        detect_dist_env(environ, 3, cuda_available=True, cuda_count=2)


def test_sharing_needs_gloo():
    with pytest.raises(ConfigError, match="NCCL refuses; add --dist_backend gloo"):
        detect_dist_env(dict(TORCHRUN_4, **SHARE), cuda_available=True, cuda_count=1)


def test_no_visible_gpu_is_one_error():
    with pytest.raises(ConfigError, match="sees no GPU \\(CUDA_VISIBLE_DEVICES=''\\)"):
        detect_dist_env(dict(TORCHRUN_4, CUDA_VISIBLE_DEVICES=""), cuda_available=True, cuda_count=0)


@pytest.mark.parametrize("environ,expected", [
    ({}, 1), (TORCHRUN_4, 4), (SRUN_4, 4), (dict(SRUN_4, SLURM_STEP_TASKS_PER_NODE="4,3", SLURM_NODEID="1"), 3),
    ({"RANK": "1", "WORLD_SIZE": "3"}, 3),  # the launcher does not say: every rank may be here
])
def test_cpu_ranks_share_the_node(environ, expected):
    env = detect_dist_env(dict(environ), cuda_available=False)
    assert (env.device, env.processes_on_device) == ("cpu", expected)


@pytest.mark.parametrize("text,counts", [("4", [4]), ("4(x2)", [4, 4]), ("4(x2),3", [4, 4, 3]),
                                         ("2,1(x3)", [2, 1, 1, 1]),
                                         ("", []), ("4(x)", []), ("a", [])])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_gpu_check_hands_torch_distributed_a_device_with_its_index():
    """`make gpu-check` passes --device cuda; torch 2.13's init_process_group refuses device_id=cuda (no index)."""
    import sys

    from launch import REPO

    sys.path.insert(0, str(REPO / "tools"))
    import torch

    import gpu_check

    assert gpu_check.with_index(torch.device("cuda"), 0) == torch.device("cuda", 0)
    assert gpu_check.with_index(torch.device("cuda"), 2) == torch.device("cuda", 2)
    assert gpu_check.with_index(torch.device("cuda", 1), 0) == torch.device("cuda", 1)
    assert gpu_check.with_index(torch.device("cpu"), 0) == torch.device("cpu")
