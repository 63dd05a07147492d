"""Launcher detection from an environ mapping: a table of environments, SLURM host lists, --local_rank parsing."""
import dataclasses

import pytest

from opencood_ddp.distributed.env import DistEnv, detect_dist_env, expand_slurm_nodelist
from opencood_ddp.engine.options import parse_train_options
from opencood_ddp.errors import ConfigError

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "abc",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
LAUNCH = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# srun job steps: only a step has SLURM_STEP_NUM_TASKS (a batch script has SLURM_PROCID and SLURM_NTASKS too).
SLURM_MULTI = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
               "SLURM_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "123456"}
SLURM_SINGLE = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "2",
                "SLURM_NODELIST": "node7", "SLURM_JOB_ID": "987"}
# What `sbatch -n 2` gives the batch script itself: one process, not rank 0 of 2.
SBATCH_SCRIPT = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_LOCALID": "0",
                 "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "55", "SLURM_NNODES": "1"}
# What `srun -N 2 -n 8` exports to task 5 (the second on node gpu02), trimmed to the identity variables.
SRUN_TWO_NODES = {"SLURM_JOB_ID": "123456", "SLURM_JOBID": "123456", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
                  "SLURM_NODELIST": "gpu[01-02]", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "8",
                  "SLURM_NPROCS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_ID": "0",
                  "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "8",
                  "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu02",
                  "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_GTIDS": "4,5,6,7"}
SRUN_TWO_NODES_EXPECTED = dict(rank=5, local_rank=1, world_size=8, launcher="slurm", master_addr="gpu01",
                               master_port=23456)
# `srun -N 1 -n 4 --relative=1` inside that allocation: a step of 4 tasks on gpu02 only, ranks counted per step
SRUN_SECOND_NODE_STEP = dict(SRUN_TWO_NODES, SLURM_STEP_ID="1", SLURM_STEP_NODELIST="gpu02", SLURM_STEP_NUM_NODES="1",
                             SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_NODEID="0",
                             SLURM_PROCID="1", SLURM_GTIDS="0,1,2,3")

# (id, environ, local_rank_arg, cuda_available, expected fields)
CASES = [
    ("single-cpu", {}, None, False,
     dict(rank=0, local_rank=0, world_size=1, launcher="single", backend="gloo", device="cpu",
          master_addr=None, master_port=None)),
    ("single-cuda", {}, None, True,
     dict(rank=0, local_rank=0, world_size=1, launcher="single", backend="nccl", device="cuda:0")),
    ("torchrun-cuda", TORCHRUN, None, True,
     dict(rank=3, local_rank=1, world_size=4, launcher="torchrun", backend="nccl", device="cuda:1",
          master_addr=None, master_port=None)),
    ("torchrun-cpu", TORCHRUN, None, False,
     dict(rank=3, local_rank=1, world_size=4, launcher="torchrun", backend="gloo", device="cpu")),
    # torch.distributed.launch also runs on torchelastic: the --local_rank argument marks it, LOCAL_RANK still wins
    ("env-local-rank-beats-arg", TORCHRUN, 0, True,
     dict(rank=3, local_rank=1, world_size=4, launcher="launch", device="cuda:1")),
    ("launch-local-rank-arg", LAUNCH, 3, True,
     dict(rank=2, local_rank=3, world_size=4, launcher="launch", backend="nccl", device="cuda:3")),
    ("launch-no-arg", LAUNCH, None, False,
     dict(rank=2, local_rank=0, world_size=4, launcher="launch", backend="gloo", device="cpu")),
    ("slurm-multi-node", SLURM_MULTI, None, True,
     dict(rank=5, local_rank=1, world_size=8, launcher="slurm", backend="nccl", device="cuda:1",
          master_addr="gpu01", master_port=20000 + 3456)),
    ("slurm-single-node", SLURM_SINGLE, None, False,
     dict(rank=2, local_rank=2, world_size=4, launcher="slurm", backend="gloo", device="cpu",
          master_addr="node7", master_port=20000 + 987)),
    ("slurm-overrides", dict(SLURM_MULTI, MASTER_ADDR="head", MASTER_PORT="31234"), None, True,
     dict(rank=5, local_rank=1, world_size=8, launcher="slurm", master_addr="head", master_port=31234)),
    ("slurm-step-num-tasks", dict(SLURM_MULTI, SLURM_STEP_NUM_TASKS="6", SLURM_NTASKS="16"), None, False,
     dict(rank=5, world_size=6, launcher="slurm")),
    ("slurm-step-num-tasks-only", {k: v for k, v in dict(SLURM_MULTI, SLURM_STEP_NUM_TASKS="6").items()
                                   if k != "SLURM_NTASKS"}, None, False,
     dict(rank=5, world_size=6, launcher="slurm")),
    ("slurm-step-nodelist", dict(SLURM_MULTI, SLURM_STEP_NODELIST="gpu[07-08]"), None, False,
     dict(master_addr="gpu07")),
    ("slurm-no-localid", {k: v for k, v in SLURM_MULTI.items() if k != "SLURM_LOCALID"}, None, True,
     dict(rank=5, local_rank=0, device="cuda:0")),
    ("slurm-no-job-id", {k: v for k, v in SLURM_MULTI.items() if k != "SLURM_JOB_ID"}, None, False,
     dict(master_port=20000)),
    ("srun-two-nodes", SRUN_TWO_NODES, None, True,
     dict(SRUN_TWO_NODES_EXPECTED, backend="nccl", device="cuda:1")),
    ("srun-two-nodes-cpu", SRUN_TWO_NODES, None, False,
     dict(SRUN_TWO_NODES_EXPECTED, backend="gloo", device="cpu")),
    ("srun-two-nodes-master-addr-port", dict(SRUN_TWO_NODES, MASTER_ADDR="10.1.2.3", MASTER_PORT="29400"), None, True,
     dict(SRUN_TWO_NODES_EXPECTED, master_addr="10.1.2.3", master_port=29400)),
    ("srun-two-nodes-master-addr-only", dict(SRUN_TWO_NODES, MASTER_ADDR="head"), None, True,
     dict(SRUN_TWO_NODES_EXPECTED, master_addr="head")),
    ("srun-two-nodes-master-port-only", dict(SRUN_TWO_NODES, MASTER_PORT="29400"), None, True,
     dict(SRUN_TWO_NODES_EXPECTED, master_port=29400)),
    ("srun-two-nodes-empty-master-addr", dict(SRUN_TWO_NODES, MASTER_ADDR=""), None, True,
     dict(SRUN_TWO_NODES_EXPECTED)),
    ("srun-step-on-second-node", SRUN_SECOND_NODE_STEP, None, True,
     dict(rank=1, local_rank=1, world_size=4, launcher="slurm", master_addr="gpu02", master_port=23457)),
    ("torchrun-beats-slurm", dict(SLURM_MULTI, **TORCHRUN), None, True,
     dict(rank=3, local_rank=1, world_size=4, launcher="torchrun", device="cuda:1", master_addr=None)),
    ("slurm-procid-without-ntasks", {"SLURM_PROCID": "3"}, None, False,
     dict(rank=0, world_size=1, launcher="single")),
    ("sbatch-script-without-srun", SBATCH_SCRIPT, None, False,
     dict(rank=0, world_size=1, launcher="single")),
]


@pytest.mark.parametrize("environ,local_rank_arg,cuda,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_detect_dist_env_table(environ, local_rank_arg, cuda, expected):
    env = detect_dist_env(dict(environ), local_rank_arg, cuda_available=cuda)
    actual = {key: getattr(env, key) for key in expected}
    assert actual == expected


def test_distributed_and_is_main_flags():
    single = detect_dist_env({}, cuda_available=False)
    assert single.distributed is False and single.is_main is True
    torchrun = detect_dist_env(TORCHRUN, cuda_available=False)
    assert torchrun.distributed is True and torchrun.is_main is False
    rank0 = detect_dist_env(dict(TORCHRUN, RANK="0"), cuda_available=False)
    assert rank0.is_main is True


@pytest.mark.parametrize("cuda,backend,expected", [(True, "gloo", "gloo"), (False, "nccl", "nccl"),
                                                   (True, None, "nccl"), (False, None, "gloo")])
def test_backend_override(cuda, backend, expected):
    env = detect_dist_env(TORCHRUN, cuda_available=cuda, backend=backend)
    assert env.backend == expected
    assert env.device == ("cuda:1" if cuda else "cpu")


def test_describe_has_the_numbers():
    text = detect_dist_env(TORCHRUN, cuda_available=True).describe()
    assert text == "world_size=4 rank=3 local_rank=1 backend=nccl launcher=torchrun device=cuda:1"


def test_dist_env_is_frozen():
    env = detect_dist_env(TORCHRUN, cuda_available=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.world_size = 1
    assert env.rank == 3 and env.world_size == 4
    assert DistEnv() == DistEnv(rank=0, local_rank=0, world_size=1, backend="gloo", launcher="single", device="cpu")


@pytest.mark.parametrize("environ,variable", [
    (dict(TORCHRUN, RANK="one"), "RANK"),
    (dict(TORCHRUN, WORLD_SIZE="4x"), "WORLD_SIZE"),
    (dict(TORCHRUN, LOCAL_RANK=""), "LOCAL_RANK"),
    (dict(SLURM_MULTI, SLURM_PROCID="p5"), "SLURM_PROCID"),
    (dict(SLURM_MULTI, SLURM_STEP_NUM_TASKS="eight"), "SLURM_STEP_NUM_TASKS"),
    (dict(SLURM_MULTI, SLURM_LOCALID="x"), "SLURM_LOCALID"),
    (dict(SLURM_MULTI, MASTER_PORT="http"), "MASTER_PORT"),
])
def test_non_integer_variable_is_named(environ, variable):
    with pytest.raises(ConfigError) as info:
        detect_dist_env(environ, cuda_available=False)
    assert f"{variable}=" in str(info.value)


@pytest.mark.parametrize("environ,names", [
    (dict(TORCHRUN, RANK="4"), ("RANK", "WORLD_SIZE", "rank 4", "world size 4")),
    (dict(TORCHRUN, RANK="-1"), ("RANK", "rank -1")),
    (dict(TORCHRUN, RANK="0", WORLD_SIZE="0"), ("WORLD_SIZE", "world size 0")),
    (dict(SLURM_MULTI, SLURM_PROCID="8"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "rank 8", "world size 8")),
])
def test_rank_outside_world_is_an_error(environ, names):
    with pytest.raises(ConfigError) as info:
        detect_dist_env(environ, cuda_available=False)
    for name in names:
        assert name in str(info.value)


def test_slurm_without_nodelist_or_master_addr():
    environ = {k: v for k, v in SLURM_MULTI.items() if k != "SLURM_NODELIST"}
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect_dist_env(environ, cuda_available=False)
    env = detect_dist_env(dict(environ, MASTER_ADDR="h0"), cuda_available=False)
    assert env.master_addr == "h0"


def test_slurm_port_is_the_same_for_every_task_and_in_range():
    ports = {detect_dist_env(dict(SLURM_MULTI, SLURM_PROCID=str(r)), cuda_available=False).master_port
             for r in range(8)}
    assert ports == {23456}
    for job in ("1", "9999", "10000", "4294967295", "77_3"):
        port = detect_dist_env(dict(SLURM_MULTI, SLURM_JOB_ID=job), cuda_available=False).master_port
        assert 20000 <= port < 30000
    assert detect_dist_env(dict(SLURM_MULTI, SLURM_JOB_ID="10000"), cuda_available=False).master_port == 20000
    assert detect_dist_env(dict(SLURM_MULTI, SLURM_JOB_ID="77_3"), cuda_available=False).master_port == 20773


def test_concurrent_srun_steps_of_one_job_get_different_ports():
    ports = {detect_dist_env(dict(SLURM_MULTI, SLURM_STEP_ID=str(step)), cuda_available=False).master_port
             for step in range(3)}
    assert ports == {23456, 23457, 23458}


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[1],m[003-004],c", ["n1", "m003", "m004", "c"]),
    ("h1,h2,h3", ["h1", "h2", "h3"]),
    ("", []),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("argv", [["--local_rank", "3"], ["--local-rank=3"], ["--local_rank=3"],
                                  ["--local-rank", "3"]])
def test_parser_accepts_both_local_rank_spellings(argv):
    process = parse_train_options(argv).process
    assert process.local_rank == 3
    assert isinstance(process.local_rank, int)


def test_parser_local_rank_default_is_none():
    assert parse_train_options([]).process.local_rank is None
