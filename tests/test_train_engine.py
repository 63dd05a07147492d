"""tools/train_ddp.py for real on the synthetic BN task: parity across world sizes, accumulation, resume,
rank-0-only files and clear errors. Every run is a real torchrun (gloo over loopback) or plain python."""
import shutil

import pytest
import torch

from launch import REPO, explain, train
from opencood_ddp.engine.logs import STEP_LOG_NAME, read_step_log
from opencood_ddp.engine.parity import relative_differences

pytestmark = pytest.mark.slow  # real processes: `make test` runs it, `make test-fast` does not

SYNTHETIC = REPO / "hypes_yaml" / "toy" / "synthetic_bn.yaml"
# A world size follows the 1-process run when its gap stays within this many times the noise floor, as
# tools/parity_check.py judges: the floor is the larger gap of the 1-process runs with each batch reversed and
# rotated by one, the same training in exact arithmetic in other float summation orders (measured, never a fixed
# tolerance; two draws, as parity_check takes them: on the AMD EPYC kind one order flipped a rounding-noise
# gradient's sign where the other did not, docs/benchmarks.md "Two draws of the floor").
FLOOR_FACTOR = 5
NOISE_ORDERS = ("reversed", "rotated")


def load(run_dir, name="net_epoch2.pth"):
    return torch.load(run_dir / name, map_location="cpu")


def noise_floor(synthetic_runs, *flags: str) -> float:
    """The larger of the reordered runs' gaps to the 1-process run (in process, at one thread as every run here)."""
    reference = load(synthetic_runs(1, *flags))
    return max(max_rel_diff(load(synthetic_runs(0, "--batch_order", order, *flags)), reference)
               for order in NOISE_ORDERS)


def max_rel_diff(state, reference, buffers=True):
    """Largest per-tensor max|a-b| / max|b| over floating tensors (BN running stats included by default)."""
    worst = relative_differences(state, reference)
    return max(worst["parameters"][0], worst["buffers"][0] if buffers else 0.0)


def epoch_losses(run_dir, epoch=2):
    state = torch.load(run_dir / f"training_state_epoch{epoch}.pt", map_location="cpu", weights_only=False)
    return state["history"][-1]


# ------------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_follow_the_one_process_run_with_sync_bn(synthetic_runs, world):
    """20 steps (2 epochs x 10) at effective batch 8: 1 x 8, 2 x 4, 4 x 2 end with the same parameters."""
    reference = load(synthetic_runs(1))
    assert max_rel_diff(load(synthetic_runs(world)), reference) <= FLOOR_FACTOR * noise_floor(synthetic_runs)


def test_plain_python_equals_torchrun_at_world_size_one(synthetic_runs):
    """No launcher (no process group) and torchrun --nproc_per_node=1 (a process group, the model not in DDP: one
    rank has nothing to reduce) are one computation, bit for bit."""
    assert max_rel_diff(load(synthetic_runs(0)), load(synthetic_runs(1))) == 0


def test_accumulation_alone_is_exact_without_batchnorm(synthetic_runs):
    """2 ranks x --per_gpu_batch 2 x 2 accumulation steps == 1 x 8 when no BatchNorm is involved."""
    flags = ("--set", "synthetic.norm=none")
    reference = load(synthetic_runs(1, *flags))
    gap = max_rel_diff(load(synthetic_runs(2, "--per_gpu_batch", "2", *flags)), reference)
    assert gap <= FLOOR_FACTOR * noise_floor(synthetic_runs, *flags)


def test_accumulation_without_sync_bn_is_a_documented_bounded_difference(synthetic_runs):
    """docs/ddp_semantics.md: per-rank BatchNorm over 2-sample micro-batches is a different training.

    The parameters move away from the baseline (the parity check is sensitive to it), while the optimisation
    itself stays sound: finite parameters and a final training loss within 25% of the baseline's.
    """
    reference_dir = synthetic_runs(1)
    run_dir = synthetic_runs(2, "--per_gpu_batch", "2", "--no_sync_bn")
    state = load(run_dir)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    assert max_rel_diff(state, load(reference_dir), buffers=False) > 1e-2
    ours, baseline = epoch_losses(run_dir)["train"]["loss"], epoch_losses(reference_dir)["train"]["loss"]
    assert abs(ours - baseline) <= 0.25 * baseline


def test_plan_is_recorded_in_config(synthetic_runs):
    import yaml

    config = yaml.safe_load((synthetic_runs(2, "--per_gpu_batch", "2", "--no_sync_bn") / "config.yaml").read_text())
    assert config["batch_plan"] == {"world_size": 2, "per_rank": 2, "accumulation": 2, "global_batch": 8,
                                    "semantics": "global", "base_lr": 0.05, "lr_scaling": "none",
                                    "effective_lr": 0.05}
    assert config["train_params"]["batch_size"] == 8 and config["train_params"]["seed"] == 0


def test_per_gpu_semantics_scale_batch_and_lr(synthetic_runs):
    import yaml

    run_dir = synthetic_runs(2, "--batch_semantics", "per_gpu", "--scale_lr", "linear",
                             "--set", "train_params.batch_size=4")
    plan = yaml.safe_load((run_dir / "config.yaml").read_text())["batch_plan"]
    assert (plan["per_rank"], plan["global_batch"], plan["effective_lr"]) == (4, 8, pytest.approx(0.1))


# ------------------------------------------------------------------------------------------------ resume
def resume_run(tmp_path, synthetic_runs, first_world, second_world):
    """1 epoch at first_world, then --model_dir resume to 2 epochs at second_world."""
    first = synthetic_runs(first_world, "--set", "train_params.epoches=1")
    run_dir = tmp_path / "resumed"
    shutil.copytree(first, run_dir)
    result = train(second_world, "--model_dir", run_dir, "--num_workers", "0", "--set", "train_params.epoches=2")
    assert result.returncode == 0, explain(result)
    assert "resumed from net_epoch1.pth (epoch 1): 1 epoch(s) and 0 step(s) of the next done" in result.stdout
    return run_dir


def test_resume_equals_uninterrupted_run(tmp_path, synthetic_runs):
    run_dir = resume_run(tmp_path, synthetic_runs, 2, 2)
    straight = synthetic_runs(2)
    assert max_rel_diff(load(run_dir), load(straight)) <= 1e-6
    resumed_state = torch.load(run_dir / "training_state_epoch2.pt", weights_only=False)
    straight_state = torch.load(straight / "training_state_epoch2.pt", weights_only=False)
    assert resumed_state["global_step"] == straight_state["global_step"] == 20
    assert resumed_state["lr_scheduler"]["last_epoch"] == 2
    momentum = [s["momentum_buffer"] for s in resumed_state["optimizer"]["state"].values()]
    assert momentum and all(torch.isfinite(m).all() for m in momentum)


def test_resume_on_a_different_world_size_keeps_the_training(tmp_path, synthetic_runs):
    """Epoch 1 on 2 ranks, epoch 2 on 1: the same effective batch, so the same run as 2 epochs on 1 rank."""
    run_dir = resume_run(tmp_path, synthetic_runs, 2, 1)
    assert max_rel_diff(load(run_dir), load(synthetic_runs(1))) <= FLOOR_FACTOR * noise_floor(synthetic_runs)


# ------------------------------------------------------------------------------------------------ files
def listing(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def test_only_rank_zero_writes_the_run_folder(synthetic_runs):
    files = listing(synthetic_runs(2))
    events = [f for f in files if f.startswith("events.out.tfevents")]
    assert len(events) == 1, files  # one SummaryWriter: each writer makes a file of its own
    rest = sorted(set(files) - set(events))
    assert rest == ["config.yaml", "logs/rank0.log", "logs/rank1.log", "net_epoch1.pth", "net_epoch2.pth",
                    "net_epoch_bestval_at2.pth", "train_steps.csv", "training_state_epoch1.pt",
                    "training_state_epoch2.pt"]
    # the 1-process run writes the same set minus rank 1's log: nothing else depends on the world size
    single = [f for f in listing(synthetic_runs(1)) if not f.startswith("events.")]
    assert single == [f for f in rest if f != "logs/rank1.log"]


def test_checkpoint_is_a_bare_state_dict(synthetic_runs):
    state = load(synthetic_runs(2))
    assert isinstance(state, dict) and not any(k.startswith("module.") for k in state)
    assert "features.1.running_mean" in state  # SyncBN kept BatchNorm's names


def test_console_shows_plan_on_rank_zero_only(synthetic_runs, tmp_path):
    result = train(2, "--hypes_yaml", SYNTHETIC, "--model_dir", tmp_path / "r", "--num_workers", "0",
                   "--set", "train_params.epoches=1")
    assert result.returncode == 0, explain(result)
    out = result.stdout
    assert out.count("batch plan: 2 process(es) x 4 per rank x 1 accumulation step(s) = effective batch 8") == 1
    assert out.count("epoch 1/1 train loss=") == 1 and "val loss=" in out
    assert "sync batch norm: GlooSyncBatchNorm" in out


# ------------------------------------------------------------------------------------------------ errors
def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("problem,args,expected", [
    ("missing file", ["--hypes_yaml", "nope.yaml"], "hypes file nope.yaml does not exist"),
    ("bad override", ["--hypes_yaml", str(SYNTHETIC), "--set", "train_params.batch_size"], "is not of the form"),
    ("missing key", ["--hypes_yaml", str(SYNTHETIC), "--set", "optimizer={}"], "missing key optimizer.core_method"),
    ("ill-typed key", ["--hypes_yaml", str(SYNTHETIC), "--set", "train_params.epoches=two"],
     "key train_params.epoches must be a positive integer"),
    ("scale_lr with global", ["--hypes_yaml", str(SYNTHETIC), "--scale_lr", "linear"], "--scale_lr applies only"),
    ("no hypes", [], "pass --hypes_yaml for a new run"),
])
def test_bad_inputs_are_one_error_line(tmp_path, problem, args, expected):
    """In process: how the ranks agree on a refused config is proven on 2 torchrun ranks by test_bad_inputs."""
    result = train(0, *args, "--model_dir", tmp_path / "r", "--num_workers", "0")
    assert result.returncode != 0, problem
    lines = error_lines(result)
    assert len(lines) == 1 and expected in lines[0], (problem, result.stderr[-3000:])


def test_legacy_launch_with_local_rank_argument(tmp_path):
    """python -m torch.distributed.launch passes --local-rank=N (no LOCAL_RANK use): trains like torchrun."""
    import subprocess
    import sys

    from launch import clean_environ

    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", str(REPO / "tools" / "train_ddp.py"),
           "--hypes_yaml", str(SYNTHETIC), "--model_dir", str(tmp_path / "r"), "--num_workers", "0",
           "--set", "train_params.epoches=1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=clean_environ())
    assert result.returncode == 0, explain(result)
    assert "launcher launch: world size 2" in result.stdout
    assert (tmp_path / "r" / "net_epoch1.pth").is_file()


@pytest.mark.parametrize("world", [0, 2])
def test_the_step_log_records_the_fp16_scalers_skips(synthetic_runs, world):
    """--half fp16 on the CPU runs float16 autocast with a CPU GradScaler, which skips this task's first two
    steps (its gradients overflow at the initial scale 2^16). train_steps.csv's scaler_skipped must be what the
    scaler's own saved state says: it halves its scale at every skip (and grows it only after 2000 steps in a
    row) and counts the steps since the last skip. With 2 ranks each reads the overflow of the all-reduced
    gradients, so both skip together and the run ends."""
    run_dir = synthetic_runs(world, "--half", "fp16")
    rows = read_step_log(run_dir / STEP_LOG_NAME)
    skips = [int(row["scaler_skipped"]) for row in rows]
    assert len(rows) == 20 and 0 < sum(skips) < len(rows), skips
    assert not any(row["skipped"] for row in rows)  # the scaler's business, not --on_nonfinite's
    scaler = torch.load(run_dir / "training_state_epoch2.pt", weights_only=False)["scaler"]
    assert scaler["scale"] == 2.0 ** 16 * 0.5 ** sum(skips)
    last_skip = max(step for step, skipped in enumerate(skips) if skipped)
    assert scaler["_growth_tracker"] == len(rows) - 1 - last_skip
    log = next((run_dir / "logs").iterdir()).read_text()
    assert f"{sum(skips[:10])} of 10 step(s) skipped by the fp16 GradScaler (overflow)" in log, log
    # The plan says float16 on the CPU before the first step: its kernels are far slower there than float32's.
    assert ("float16 autocast with a GradScaler (on the CPU, whose float16 kernels are far slower than float32's: "
            "--half bf16 is the CPU's half precision)") in (run_dir / "logs" / "rank0.log").read_text()


def test_a_step_log_without_a_scaler_has_no_scaler_column(synthetic_runs):
    assert "scaler_skipped" not in read_step_log(synthetic_runs(1) / STEP_LOG_NAME)[0]


def test_half_precision_ranks_follow_the_one_process_run_with_sync_bn(synthetic_runs):
    """--half on the CPU is bf16 autocast (fp16 and a GradScaler on CUDA). 2 ranks with GlooSyncBatchNorm learn
    and end within the bf16 parity floor of the 1-process bf16 run. Measured on this task (max relative gap of
    the weights): the floor 0.17; 2 ranks 0.26, and 1.15 while the synchronized statistics of a bf16 activation
    were rounded to bf16; per-rank batch norm (--no_sync_bn) 2.7."""
    run_dir = synthetic_runs(2, "--half")
    state = torch.load(run_dir / "training_state_epoch2.pt", weights_only=False)
    first, last = state["history"][0]["val"]["loss"], state["history"][1]["val"]["loss"]
    assert last < first
    log = (run_dir / "logs" / "rank0.log").read_text()
    # the plan's lines
    assert "; bfloat16 autocast\n" in log and "sync batch norm: GlooSyncBatchNorm; gradients: DDP all-reduce\n" in log
    gap = max_rel_diff(load(run_dir), load(synthetic_runs(1, "--half")))
    assert gap <= FLOOR_FACTOR * noise_floor(synthetic_runs, "--half")
    assert state["scaler"] is None  # no GradScaler without CUDA


def test_a_resume_without_the_runs_half_or_capture_flags_says_so(tmp_path):
    """--half and --capture are flags, and README's resume command (`--model_dir RUN`) gives none: a run trained in
    bf16 went on in float32 without a word (its fp16 GradScaler state would have been dropped). The training state
    records the flags; a resume with others warns, naming both and the flag that goes on as before."""
    run = tmp_path / "run"
    first = train(0, "--hypes_yaml", SYNTHETIC, "--model_dir", run, "--num_workers", "0", "--half", "bf16",
                  "--max_steps", "2")
    assert first.returncode == 0, explain(first)
    state = torch.load(run / "training_state_step2.pt", weights_only=True)
    assert state["step_flags"] == {"half": "--half bf16", "capture": "no --capture"}
    resume = ("--model_dir", run, "--num_workers", "0")
    quiet = train(0, *resume, "--half", "bf16", "--max_steps", "3")  # the flag given again: nothing to say
    assert quiet.returncode == 0 and "this run was trained with" not in quiet.stdout + quiet.stderr, explain(quiet)
    dropped = train(0, *resume, "--max_steps", "4")
    assert dropped.returncode == 0, explain(dropped)
    assert ("this run was trained with --half bf16; the resumed part runs with no --half: not the same training "
            "(pass --half bf16 to go on as it was trained)") in dropped.stdout, explain(dropped)
    added = train(0, *resume, "--half", "bf16", "--max_steps", "5")
    assert "trained with no --half; the resumed part runs with --half bf16: not the same training (drop --half " \
           "to go on as it was trained)" in added.stdout, explain(added)
