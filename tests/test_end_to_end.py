"""What users type, run for real: the 1-vs-N parity of tools/train_ddp.py on the toy AttFuse config (through
tools/parity_check.py), two torchrun launchers as two nodes, --max_steps and train_steps.csv (the lr of every step
against upstream's loop, on 2 accumulating ranks, through a resume), the scaling benchmark, and `make demo`'s
script on the small toy world."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from launch import REPO, TRAIN, clean_environ, explain, in_process, python, split_set_flags, train
from shared_runs import completed_process, made_once, process_record
from upstream_loop import upstream_step_lrs

from opencood_ddp.checkpoint_files import load_file
from opencood_ddp.distributed.launch import launcher_prefix
from opencood_ddp.engine.parity import global_relative_difference, relative_differences, step_relative_difference
from opencood_ddp.engine.logs import read_step_log
from opencood_ddp.toy.manifest import read_toy_manifest

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` does not

TOY_ATTFUSE = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"
SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"
PARITY = REPO / "tools" / "parity_check.py"
STEPS = 3


@pytest.fixture(scope="module")
def parity_runs(toy_small, tmp_path_factory):
    """tools/parity_check.py at world sizes 1 and 2 on the toy AttFuse config: its output and kept runs, made once
    in the session (shared_runs.py); every test here reads them and writes elsewhere."""
    flags = split_set_flags(toy_small)

    def make(folder):
        return process_record(python(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "1,2", "--steps",
                                     str(STEPS), *flags, "--work_dir", folder / "runs", timeout=600))

    folder, record = made_once(tmp_path_factory, "parity_toy_attfuse", make)
    return completed_process(record), folder / "runs"


def test_parity_check_passes_for_one_and_two_processes(parity_runs):
    result, work = parity_runs
    assert result.returncode == 0, explain(result)
    assert "PASS: every world size follows the 1-process run." in result.stdout
    rows = {line.split("|")[0].strip(): line for line in result.stdout.splitlines() if "|" in line}
    assert "same training" in rows["world2"]
    assert "noise floor" in rows["world1_reversed"] and "noise floor" in rows["world1_rotated"]
    assert f"step {STEPS} gap" in rows["run"]
    # the step check's folders: world1's state after step K-1, and step K from it for every other run
    kept = {folder.name for folder in work.iterdir() if folder.is_dir()}
    assert {f"world1_step{STEPS - 1}", *(f"{run}_step{STEPS}" for run in ("world2", "world1_reversed",
                                                                        "world1_rotated"))} <= kept


def test_parity_check_runs_every_world_size_at_the_thread_count_torchrun_gives_a_rank():
    """A world-size-1 run on two threads against ranks on one would count the CPU kernels' thread-count rounding as
    the world size's: every run gets OMP_NUM_THREADS=1 unless the user set it, and none of the launcher's
    variables of the shell the tool runs in."""
    import sys

    sys.path.insert(0, str(PARITY.parent))
    from parity_check import run_environ

    assert run_environ({"PATH": "/bin"}) == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    inside = {"OMP_NUM_THREADS": "4", "RANK": "1", "LOCAL_RANK": "1", "SLURM_JOB_ID": "7", "PATH": "/bin"}
    assert run_environ(inside) == {"OMP_NUM_THREADS": "4", "PATH": "/bin"}


def test_train_ddp_on_one_and_two_processes_saves_the_same_weights(parity_runs):
    """The parity promise through the user-facing script, SyncBN included: 2 ranks x 1 sample, 1 rank x 2."""
    _, work = parity_runs
    log = (work / "world2" / "logs" / "rank0.log").read_text()
    assert "sync batch norm: GlooSyncBatchNorm" in log and "world size 2" in log
    one, two, *noises = (load_file(work / run / f"net_step{STEPS}.pth")
                         for run in ("world1", "world2", "world1_reversed", "world1_rotated"))
    assert one.keys() == two.keys()
    # Adam with upstream's eps 1e-10 turns rounding-level gradient differences into full lr steps, so after 3
    # steps the weights of ANY two runs that sum in another order are ~2e-2 apart: the 1-process runs with
    # reversed and rotated batches (the same training in exact arithmetic) measure it. The 2-process run must stay
    # there; per-rank BatchNorm or a wrong batch split are far above it from step 1 (next test).
    assert global_relative_difference(two, one) <= 2 * max(global_relative_difference(noise, one) for noise in noises)
    losses = {w: [row["loss"] for row in read_step_log(work / f"world{w}" / "train_steps.csv")] for w in (1, 2)}
    assert len(losses[1]) == len(losses[2]) == STEPS
    # Step 1 is before any update: same weights, same samples, SyncBN over the global batch -> the same loss.
    assert losses[2][0] == pytest.approx(losses[1][0], rel=1e-4)
    # Step K from world1's own state after step K-1: no drift to blur it, the 2-process step is the 1-process step
    # as closely as a reordered batch's step is.
    start = load_file(work / f"world1_step{STEPS - 1}" / f"net_step{STEPS - 1}.pth")
    two_step, *noise_steps = (load_file(work / f"{run}_step{STEPS}" / f"net_step{STEPS}.pth")
                              for run in ("world2", "world1_reversed", "world1_rotated"))
    assert step_relative_difference(two_step, one, start) <= 5 * max(
        step_relative_difference(noise, one, start) for noise in noise_steps)


def test_a_detector_stopped_and_resumed_on_two_ranks_ends_bit_identical_to_the_straight_run(parity_runs, toy_small,
                                                                                            tmp_path):
    """The engine's exact resume on the detector path (the synthetic path: test_train_engine, test_resilience):
    toy AttFuse on 2 ranks stopped after step 1 (--max_steps) and resumed to step 3 ends where the parity check's
    straight 2-rank run of the same command ends, weights and optimizer state, bit for bit."""
    _, work = parity_runs
    run_dir = tmp_path / "resumed"
    common = ("--hypes_yaml", TOY_ATTFUSE, "--model_dir", run_dir, "--num_workers", "0", *split_set_flags(toy_small))
    for stop in (1, STEPS):
        result = train(2, *common, "--max_steps", str(stop), timeout=600)
        assert result.returncode == 0, explain(result)
    assert "resumed from net_step1.pth (step 1)" in result.stdout, explain(result)
    straight, resumed = (load_file(folder / f"net_step{STEPS}.pth") for folder in (work / "world2", run_dir))
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []
    states = [torch.load(folder / f"training_state_step{STEPS}.pt", weights_only=False)
              for folder in (work / "world2", run_dir)]
    moments = [[s["exp_avg"] for s in state["optimizer"]["state"].values()] for state in states]
    assert all(torch.equal(a, b) for a, b in zip(*moments)) and len(moments[0]) > 0


V2XVIT_DROPOUT = tuple(f"--set=model.args.transformer.encoder.{block}.dropout=0.3"
                       for block in ("feed_forward", "cav_att_config", "pwindow_att_config"))


def test_a_model_with_dropout_resumed_mid_epoch_with_a_loader_worker_ends_bit_identical(toy_small, tmp_path):
    """The same with the model's dropout drawing from torch's global generator: toy V2X-ViT at dropout 0.3, one
    persistent loader worker, stopped at step 3 of 4 and resumed past the epoch's end to step 6. A DataLoader that
    drew its workers' base seed from the global generator, at each iterator it made, moved the dropout's stream
    wherever the resumed process made its iterators (here its training and its validation loader): weights up to
    1.4e-2 apart. Plain python in this process, one rank: the draw is every rank's."""
    common = ("--hypes_yaml", REPO / "hypes_yaml" / "toy" / "point_pillar_v2xvit.yaml", "--num_workers", "1",
              "--set", "preprocess.args.max_voxel_train=2000", *V2XVIT_DROPOUT, *split_set_flags(toy_small))
    for run, stops in (("straight", (6,)), ("resumed", (3, 6))):
        for stop in stops:
            result = in_process(TRAIN, *common, "--model_dir", tmp_path / run, "--max_steps", str(stop))
            assert result.returncode == 0, explain(result)
    assert "resumed from net_step3.pth (step 3)" in result.stdout, explain(result)
    straight, resumed = (load_file(tmp_path / run / "net_step6.pth") for run in ("straight", "resumed"))
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []


def test_parity_check_catches_per_rank_batchnorm(toy_small, tmp_path):
    """--no_sync_bn changes nothing on 1 rank and the statistics on 2: the check must say DIFFERENT."""
    result = python(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "2", "--steps", "2",
                    *split_set_flags(toy_small), "--train_args=--no_sync_bn", timeout=600)
    assert result.returncode == 1, explain(result)
    world2 = next(line for line in result.stdout.splitlines() if line.strip().startswith("world2 |"))
    assert "DIFFERENT" in world2
    # the step check: thousands of times the reordered runs' gap (0.43 against 4e-5 on the demo's world)
    assert "step 2 from world1's state lands" in result.stdout


def test_parity_check_refuses_a_batch_that_does_not_split(toy_small):
    result = python(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "1,4", "--steps", "2",
                    *split_set_flags(toy_small), timeout=120)
    assert result.returncode == 2, explain(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train_params.batch_size" in errors[0] and "--world_sizes" in errors[0]


@pytest.mark.parametrize("flags, fragment", [
    # each was a traceback: shlex's ValueError, FileExistsError, subprocess.TimeoutExpired
    (["--train_args=--no_sync_bn 'x"], "--train_args \"--no_sync_bn 'x\" cannot be split into flags"),
    (["--timeout", "0"], "--timeout 0: give each run's limit in seconds, above 0"),
    (["--work_dir", "A_FILE"], "--work_dir A_FILE is a file; pick an empty folder"),
    (["--timeout", "0.5", "--work_dir", "RUNS"], "the world1 run took longer than --timeout 0.5 s and was stopped; "
                                                 "its output is in RUNS/world1.log"),
    # a run trained outside --work_dir and a traceback reading it back; a negative tolerance passed everything
    (["--train_args=--model_dir RUNS"], "--train_args sets --model_dir, which parity_check sets for every run"),
    (["--tolerance", "-1"], "--tolerance -1: give a number >= 0"),
    # step K is checked from the state after step K-1: one step has no such state
    (["--steps", "1"], "--steps 1: give 2 or more optimizer steps"),
])
def test_parity_check_flags_it_cannot_run_are_one_line(toy_small, tmp_path, flags, fragment):
    (tmp_path / "a_file").write_text("notes\n")
    names = {"A_FILE": str(tmp_path / "a_file"), "RUNS": str(tmp_path / "runs")}
    flags = [names.get(flag, flag) for flag in flags]
    for name, path in names.items():
        fragment = fragment.replace(name, path)
    result = in_process(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "1", "--steps", "2",
                        *split_set_flags(toy_small), *flags)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], explain(result)
    assert (tmp_path / "a_file").read_text() == "notes\n"


def test_parity_check_refuses_steps_past_the_hypes_epochs(toy_small, tmp_path):
    """A reference that the hypes' epochs end before step K leaves no step K to check: the step gap of runs that
    never took it would be 0 and pass. One error line says how many steps there were."""
    result = in_process(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "1", "--steps", "200",
                        *split_set_flags(toy_small), "--set", "train_params.batch_size=8", "--set",
                        "train_params.epoches=1", "--work_dir", str(tmp_path / "runs"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, explain(result)
    assert "the world1 run ended after" in errors[0] and "before --steps 200" in errors[0], errors[0]
    assert "train_params.epoches" in errors[0]


def test_parity_check_keeps_the_log_its_failed_run_names(toy_small):
    """Without --work_dir the runs' temporary folder was removed at exit, also when a run had failed: the error
    line named a log that no longer existed. It now stays until every run has been read; '' as --world_sizes (a
    check of nothing that passed) is refused."""
    result = in_process(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "1", "--steps", "2",
                        *split_set_flags(toy_small), "--train_args=--no_such_flag")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "the world1 run failed" in errors[0], explain(result)
    log = Path(errors[0].rsplit("its output is in ", 1)[1])
    assert "unrecognized arguments: --no_such_flag" in log.read_text()
    shutil.rmtree(log.parent)
    empty = in_process(PARITY, "--hypes_yaml", TOY_ATTFUSE, "--world_sizes", "", *split_set_flags(toy_small))
    assert empty.returncode == 2 and "--world_sizes '': give comma-separated integers" in empty.stderr, explain(empty)


# ------------------------------------------------------------------------------------------------ multi-node
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_nodes_equal_two_processes(parity_runs, toy_small, tmp_path):
    """Two launchers, one process each, meet through c10d rendezvous on loopback as a 2-node job."""
    _, work = parity_runs
    run_dir = tmp_path / "two_nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [*launcher_prefix(1, nodes=2, endpoint=endpoint, run_id="e2e_two_nodes"),
           str(REPO / "tools" / "train_ddp.py"), "--hypes_yaml", str(TOY_ATTFUSE), "--model_dir", str(run_dir),
           "--max_steps", str(STEPS), "--num_workers", "0", *map(str, split_set_flags(toy_small))]
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=clean_environ(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(o[-3000:] for o in outputs)
    assert sum("launcher torchrun: world size 2" in o for o in outputs) == 1  # rank 0's console only
    two_nodes = load_file(run_dir / f"net_step{STEPS}.pth")
    two_processes = load_file(work / "world2" / f"net_step{STEPS}.pth")
    worst = relative_differences(two_nodes, two_processes)
    assert max(diff for diff, _ in worst.values()) <= 1e-6, worst
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]


# ------------------------------------------------------------------------------------------------ max_steps
# synthetic_bn.yaml's lr 0.05 under upstream's cosineannealwarm: warm-up over epoch 1, the cosine over both epochs.
COSINE = {"core_method": "cosineannealwarm", "epoches": 2, "warmup_epoches": 1, "warmup_lr": 0.005, "lr_min": 0.001}


def test_max_steps_then_resume_on_two_accumulating_ranks_logs_upstreams_lr_at_every_step(tmp_path):
    """--max_steps 13 stops in epoch 2 (10 steps per epoch) with net_step13.pth; the resume rewinds
    train_steps.csv to it and goes on. 2 ranks x 2 samples x 2 accumulation steps = the global batch 8, so each
    logged lr is the one of that optimizer step in upstream's loop (tests/upstream_loop.py), through the stop."""
    run_dir = tmp_path / "run"
    common = ("--model_dir", run_dir, "--num_workers", "0", "--per_gpu_batch", "2")
    cut = train(2, "--hypes_yaml", SYNTHETIC, *common, "--max_steps", "13", "--set",
                "lr_scheduler={" + ", ".join(f"{k}: {v}" for k, v in COSINE.items()) + "}")
    assert cut.returncode == 0, explain(cut)
    assert "stopped after 13 optimizer steps (--max_steps)" in cut.stdout
    assert "2 process(es) x 2 per rank x 2 accumulation step(s)" in cut.stdout
    assert (run_dir / "net_step13.pth").is_file() and not (run_dir / "net_epoch2.pth").exists()
    assert [row["step"] for row in read_step_log(run_dir / "train_steps.csv")] == list(range(1, 14))
    resumed = train(2, *common)
    assert resumed.returncode == 0, explain(resumed)
    assert "resumed from net_step13.pth (step 13)" in resumed.stdout
    rows = read_step_log(run_dir / "train_steps.csv")
    assert [row["step"] for row in rows] == list(range(1, 21))  # each step once
    assert {"loss", "lr", "seconds", "data_seconds", "samples_per_s"} <= rows[0].keys()
    assert [row["lr"] for row in rows] == pytest.approx(upstream_step_lrs(COSINE, 0.05, 10, 2), rel=1e-6)


def test_max_steps_must_be_positive(tmp_path):
    result = train(0, "--hypes_yaml", SYNTHETIC, "--model_dir", tmp_path / "run", "--max_steps", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --max_steps 0")
    assert not (tmp_path / "run").exists()


def test_start_plan_names_what_the_issue_lists(synthetic_runs):
    log = (synthetic_runs(2) / "logs" / "rank0.log").read_text()
    for words in ("world size 2", "backend gloo", "devices:", "2 process(es) x 4 per rank",
                  "effective batch 8", "lr 0.05", "train 80 samples, validate 37", "optimizer steps per epoch",
                  "run folder:", "samples/s", "data wait", "step: eager; float32", "gradients: DDP all-reduce"):
        assert words in log, words
    one_rank = (synthetic_runs(1) / "logs" / "rank0.log").read_text()  # torchrun on one rank: nothing to reduce
    assert "world size 1" in one_rank and "gradients: one rank, no DDP" in one_rank


# ------------------------------------------------------------------------------------------------ benchmark
def test_benchmark_ddp_measures_every_world_size(tmp_path):
    out = tmp_path / "bench.json"
    # 13 steps of a 10-step epoch: the timed steps run on into a second epoch.
    result = python(REPO / "tools" / "benchmarks" / "benchmark_ddp.py", "--hypes_yaml", SYNTHETIC, "--world_sizes", "2",
                    "--steps", "12", "--warmup", "1", "--json", out, timeout=300)
    assert result.returncode == 0, explain(result)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["world_size"], r["launcher"], r["ddp"], r["per_rank"]) for r in rows] == [
        (1, "single", False, 8), (1, "torchrun", False, 8), (2, "torchrun", True, 4)]  # one rank: no DDP
    for row in rows:
        assert row["step_s"] > 0 and row["samples_per_s"] > 0 and row["peak_mib"] > 0
        assert 0 <= row["data_wait"] < 1 and row["loader_samples_per_s"] > 0
    assert "torchrun at world size 1" in result.stdout and "world size 2:" in result.stdout


# ------------------------------------------------------------------------------------------------ demo
def test_demo_runs_end_to_end(toy_small, tmp_path):
    """tools/demo.py (what `make demo` runs) on the small world and 1 epoch: every phase and the summary.
    The full demo's time and AP are measured by running `make demo` (README states them)."""
    result = python(REPO / "tools" / "demo.py", "--data", toy_small, "--log_root", tmp_path, "--epochs", "1",
                    "--min_ap", "0", timeout=600)
    assert result.returncode == 0, explain(result)
    assert "reusing the complete toy world already there (scale small)" in result.stdout
    assert read_toy_manifest(toy_small)["scale"] == "small"  # a world already there is never replaced
    runs = list(tmp_path.glob("demo_attfuse_*"))
    assert len(runs) == 1
    run = runs[0]
    assert (run / "eval.yaml").is_file() and (run / "net_epoch1.pth").is_file()
    frames = yaml.safe_load((run / "eval.yaml").read_text())["frames"]
    assert frames > 0 and len(list((run / "vis").glob("bev_*.png"))) == frames
    for words in ("== demo summary", "BEV views:", "AP@0.5", "torchrun --standalone --nproc_per_node=2"):
        assert words in result.stdout, words
    from opencood_ddp.models import create_model
    from zoo import hypes_of

    saved = torch.load(run / "net_epoch1.pth", weights_only=True)  # the run's model's state dict, whole
    expected = create_model(hypes_of(run / "config.yaml")).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in expected.items()}
