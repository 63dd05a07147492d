"""tools/train_ddp.py under a real `srun` on a private one-node SLURM cluster (tests/slurm_cluster.py).

The launcher detection reads only what srun exports (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_NODELIST,
SLURM_JOB_ID): no MASTER_PORT is given, the rendezvous is derived from the node list and the job id (the cluster
starts its job ids where that port is free). Skips, saying why, where SLURM is not installed or its daemons
cannot run (`make slurm` installs them).
"""
import socket
import subprocess
import sys

import pytest

from launch import REPO, TRAIN, clean_environ, explain
from opencood_ddp.checkpoint_files import load_file
from opencood_ddp.engine.parity import relative_differences
from slurm_cluster import ClusterUnavailable, start_cluster

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` does not

SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"


@pytest.fixture(scope="module")
def cluster():
    try:
        running = start_cluster()
    except ClusterUnavailable as exc:
        print(exc)  # the whole reason, log tails included, in the captured output
        pytest.skip(str(exc))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def slurm_run(cluster, tmp_path_factory):
    """(result, run folder) of `srun -n 2 python tools/train_ddp.py` on the synthetic BN task."""
    run_dir = tmp_path_factory.mktemp("slurm") / "slurm_run"
    extra = ["--overcommit"] if cluster.cpus < 2 else []  # two tasks even on a one-CPU machine
    cmd = ["srun", "-n", "2", "--cpus-per-task=1", *extra, sys.executable, str(TRAIN), "--hypes_yaml", str(SYNTHETIC),
           "--model_dir", str(run_dir), "--num_workers", "0"]
    env = cluster.env(clean_environ())
    try:
        socket.gethostbyname(cluster.node)
    except OSError:
        # the derived MASTER_ADDR is the node's name; where it does not resolve, rendezvous on loopback instead
        env["MASTER_ADDR"] = "127.0.0.1"
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 0, explain(result)
    return result, run_dir


def test_srun_trains_on_two_ranks(slurm_run):
    result, _ = slurm_run
    assert "launcher slurm: world size 2, backend gloo, device cpu" in result.stdout, explain(result)
    assert result.stdout.count("epoch 2/2 train loss=") == 1  # rank 0 alone reports


def test_srun_equals_torchrun(slurm_run, synthetic_runs):
    """The same 2-process training as `torchrun --nproc_per_node=2`: the launcher changes nothing."""
    _, run_dir = slurm_run
    worst = relative_differences(load_file(run_dir / "net_epoch2.pth"),
                                 load_file(synthetic_runs(2) / "net_epoch2.pth"))
    assert worst["parameters"][0] <= 1e-6 and worst["buffers"][0] <= 1e-6, worst


def listing(run_dir):
    """Files of a run folder; the event file's name (host, time, pid) reduced to its kind."""
    names = (str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    return sorted("events.out.tfevents*" if name.startswith("events.out.tfevents") else name for name in names)


def test_srun_rank_zero_writes_one_run_folder(slurm_run, synthetic_runs):
    """Only rank 0 creates and fills the folder (one event file), every rank has its log: as under torchrun."""
    _, run_dir = slurm_run
    assert [p.name for p in run_dir.parent.iterdir()] == ["slurm_run"]
    files = listing(run_dir)
    assert files.count("events.out.tfevents*") == 1, files
    assert {"logs/rank0.log", "logs/rank1.log", "config.yaml", "net_epoch2.pth"} <= set(files), files
    assert files == listing(synthetic_runs(2))
