"""A run folder is held by the job that trains in it (engine/run_dir.lock_run_dir): a second job refuses with
one line naming the holder, a lock left by a killed job is taken over, and a job that ends removes its lock."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from launch import REPO, Background, explain, train, wait_until
from opencood_ddp.engine.run_dir import LOCK_NAME, lock_run_dir, release_run_dir
from opencood_ddp.errors import ConfigError

SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"
LONG = ("--hypes_yaml", SYNTHETIC, "--num_workers", "0", "--set", "synthetic.num_train=1200")


def steps_logged(run_dir) -> int:
    try:
        return max(0, len((run_dir / "train_steps.csv").read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def test_a_lock_held_by_another_process_is_refused_naming_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from opencood_ddp.engine.run_dir import lock_run_dir; "
        f"lock_run_dir({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as caught:
            lock_run_dir(tmp_path)
        assert f"is in use by host {socket.gethostname()}, pid {holder.pid}, since" in str(caught.value)
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(tmp_path)  # the killed holder's lock is the kernel's to release: taken over
    assert f"pid {os.getpid()}" in (tmp_path / LOCK_NAME).read_text()
    release_run_dir(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.parametrize("second_world", [0, 2])
def test_a_second_job_in_a_held_run_folder_refuses_and_the_first_goes_on(tmp_path, second_world):
    run_dir = tmp_path / "run"
    first = Background(tmp_path / "first", 0, *LONG, "--model_dir", run_dir, "--set", "train_params.epoches=100")
    try:
        wait_until(lambda: steps_logged(run_dir) >= 5, 180, "5 logged steps")
        second = train(second_world, *LONG, "--model_dir", run_dir, timeout=120)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode != 0 and len(errors) == 1, explain(second)
        assert f"is in use by host {socket.gethostname()}, pid {first.proc.pid}" in errors[0]
        assert first.proc.poll() is None, "the first job must go on"
        first.proc.send_signal(signal.SIGINT)  # stops at the next step boundary with a resumable checkpoint
        result = first.wait(timeout=300)
    finally:
        first.kill()
    assert result.returncode == 75, explain(result)
    steps = [int(line.split(",")[0]) for line in (run_dir / "train_steps.csv").read_text().splitlines()[1:]]
    assert steps == list(range(1, len(steps) + 1))  # every step once: the second job wrote nothing
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    assert not (run_dir / LOCK_NAME).exists()


@pytest.mark.slow
def test_the_lock_of_a_killed_job_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = Background(tmp_path / "first", 2, *LONG, "--model_dir", run_dir, "--set", "train_params.epoches=100")
    wait_until(lambda: steps_logged(run_dir) >= 5, 180, "5 logged steps")
    for pid in first.worker_pids().values():
        os.kill(pid, signal.SIGKILL)
    first.wait(timeout=120)
    assert (run_dir / LOCK_NAME).exists()  # left behind, and released by the kernel
    # killed before its first checkpoint: a history and nothing to resume from (refused without --restart)
    # The lock is rank 0's alone: the next job takes it over in this process as it would on any world size.
    refused = train(0, *LONG, "--model_dir", run_dir, "--max_steps", "3")
    assert refused.returncode != 0 and "but no checkpoint" in refused.stderr, explain(refused)
    again = train(0, *LONG, "--model_dir", run_dir, "--max_steps", "3", "--restart")
    assert again.returncode == 0, explain(again)
    assert (run_dir / "net_step3.pth").is_file() and not (run_dir / LOCK_NAME).exists()
