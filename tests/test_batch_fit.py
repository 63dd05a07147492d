"""Fitting the baseline's batch on the user's GPUs: engine/batch_fit.py, tools/plan_batch.py and
`tools/train_ddp.py --per_gpu_batch auto` (real measurements on the toy world; the memory figures themselves are a
benchmark's business, docs/benchmarks.md)."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from launch import REPO, explain, in_process, python, split_set_flags, train
from opencood_ddp.engine import batch_fit
from opencood_ddp.engine.batch_fit import GIB, PlanOption, Probe

PLAN = REPO / "tools" / "plan_batch.py"
TOY = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"


@pytest.mark.parametrize("batch, world, largest, sizes", [
    (8, 1, 4, [1, 2, 4]), (8, 2, 4, [1, 2, 4]), (8, 4, 4, [1, 2]), (4, 4, 4, [1]), (3, 1, 4, [1, 2]),
    (64, 1, 8, [1, 2, 4, 8]),
])
def test_probe_sizes_stop_at_what_one_rank_can_get(batch, world, largest, sizes):
    assert batch_fit.probe_sizes(batch, world, largest) == sizes


def test_fit_is_the_least_squares_line_and_never_below_a_measurement():
    probes = [Probe(1, 3 * GIB, 0.1), Probe(2, 5 * GIB, 0.2), Probe(4, 9 * GIB, 0.4)]
    model = batch_fit.fit(probes)
    assert model.fixed == pytest.approx(1 * GIB) and model.per_sample == pytest.approx(2 * GIB)
    assert model.worst_residual() == pytest.approx(0, abs=1)
    noisy = batch_fit.fit([Probe(1, 3 * GIB, 0.1), Probe(2, 6 * GIB, 0.2), Probe(4, 9 * GIB, 0.4)])
    assert noisy.predict(2) == 6 * GIB  # the line passes below the measured point: the measurement wins
    flat = batch_fit.fit([Probe(1, 2 * GIB, 0.1), Probe(2, 1.9 * GIB, 0.2)])
    assert flat.per_sample == 0 and flat.predict(8) == pytest.approx(1.95 * GIB)
    one = batch_fit.fit([Probe(2, 4 * GIB, 0.1)])
    assert one.predict(1) == pytest.approx(2 * GIB) and one.predict(4) == pytest.approx(8 * GIB)


def test_options_split_the_batch_exactly_and_the_fewest_accumulation_steps_win():
    model = batch_fit.fit([Probe(1, 3 * GIB, 0.1), Probe(2, 5 * GIB, 0.2)])  # 1 GiB + 2 GiB per sample
    found = batch_fit.options(16, 2, model, capacity_bytes=10 * GIB)
    assert [(o.per_rank, o.accumulation) for o in found] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert all(o.world * o.per_rank * o.accumulation == 16 for o in found)
    assert [o.fits for o in found] == [False, True, True, True]  # 17, 9, 5, 3 GiB
    assert batch_fit.choose(found) == PlanOption(2, 4, 2, 9 * GIB, True)
    assert [o.per_rank for o in batch_fit.options(12, 2, model, 100 * GIB)] == [6, 3, 2, 1]


def test_a_plan_with_accumulation_says_what_batchnorm_then_sees():
    assert batch_fit.accumulation_note(PlanOption(2, 4, 1, GIB, True), 8) is None  # the baseline's training
    note = batch_fit.accumulation_note(PlanOption(2, 2, 2, GIB, True), 8)
    assert "normalises over 4 sample(s) per micro-step, not batch_size 8" in note and "ddp_semantics" in note


def test_no_plan_says_why_and_what_would_fit():
    model = batch_fit.fit([Probe(1, 3 * GIB, 0.1), Probe(2, 5 * GIB, 0.2)])
    assert batch_fit.choose(batch_fit.options(8, 2, model, 2 * GIB)) is None
    message = batch_fit.no_plan_message(8, 2, model, 2 * GIB)
    assert "per-GPU batch 1 needs 3.00 GiB" in message and "at least 3.0 GiB" in message and "--half" in message
    assert "use a GPU count in [1, 2, 3, 6]" in batch_fit.no_plan_message(6, 4, None, 2 * GIB)


def test_measure_on_the_synthetic_task_grows_with_the_batch():
    """A real measurement on the CPU: a larger batch needs at least as much memory, up to the allocator's noise."""
    from opencood_ddp.tasks import build_task
    from zoo import hypes_of

    hypes = hypes_of("toy/synthetic_bn", "synthetic.num_train=64", "synthetic.image_size=64", "synthetic.width=32")
    probes = batch_fit.measure(hypes, build_task, [2, 32], torch.device("cpu"))  # BatchNorm1d: 2 or more
    assert [p.per_rank for p in probes] == [2, 32]
    assert probes[1].peak_bytes > probes[0].peak_bytes > 0


def test_a_probe_under_capture_steps_the_captured_module_and_leaves_no_graph_behind(toy_small):
    """--capture's graphs hold memory of their own (CUDA graphs' pools, static inputs): the probe takes the step
    the run will take. Afterwards dynamo holds no graph of the dense step, so the run's own shapes start from the
    whole recompile limit (engine/capture.py's MAX_SHAPES) and its compile log says what it does."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from opencood_ddp.engine.capture import dense_step
    from opencood_ddp.tasks import build_task
    from zoo import hypes_of

    hypes = hypes_of(TOY, toy_root=toy_small)
    graphs = counters["stats"]["unique_graphs"]
    probes = batch_fit.measure(hypes, build_task, [1], torch.device("cpu"), capture="aot_eager")
    # The discarded probe and the measured one compiled each: the first's graphs were gone before the second
    # (on CUDA its graph pool would have held the second's memory before it measured).
    assert counters["stats"]["unique_graphs"] == graphs + 2
    assert probes[0].per_rank == 1 and probes[0].peak_bytes > 0
    assert _debug_get_cache_entry_list(dense_step.__code__) == []


def test_plan_batch_passes_capture_on_to_the_plans_command():
    sys.path.insert(0, str(REPO / "tools"))
    import plan_batch

    args = plan_batch.build_parser().parse_args(["--hypes_yaml", str(TOY), "--gpus", "2", "--gpu_mem_gib", "8",
                                                 "--capture", "cudagraphs"])
    flags = plan_batch.plan_flags(args, PlanOption(world=2, per_rank=1, accumulation=2, predicted_bytes=GIB, fits=True))
    assert flags[flags.index("--capture") + 1] == "cudagraphs" and "--per_gpu_batch" in flags


def _plan(toy_small, *args: str):
    return in_process(PLAN, "--hypes_yaml", TOY, *split_set_flags(toy_small), "--set", "train_params.batch_size=4",
                      *args)


def test_plan_batch_prints_a_plan_that_reproduces_the_batch(toy_small):
    result = _plan(toy_small, "--gpus", "2", "--gpu_mem_gib", "64")
    assert result.returncode == 0, explain(result)
    assert "per-GPU batch 1:" in result.stdout and "per-GPU batch 2:" in result.stdout
    chosen = re.search(r"plan: (\d+) GPU\(s\) x per-GPU batch (\d+) x (\d+) accumulation", result.stdout)
    assert chosen and int(chosen[1]) * int(chosen[2]) * int(chosen[3]) == 4, result.stdout
    assert "--per_gpu_batch 2" in result.stdout  # 64 GiB: the whole per-GPU share in one step


def test_plan_batch_says_when_nothing_fits(toy_small):
    result = _plan(toy_small, "--gpus", "2", "--gpu_mem_gib", "0.001")
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(errors) == 1, explain(result)
    assert errors[0].startswith("error: no plan fits: even per-GPU batch 1 needs"), explain(result)
    result = _plan(toy_small, "--gpus", "3", "--gpu_mem_gib", "64")
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(errors) == 1, explain(result)
    assert errors[0].startswith("error: no plan fits: ") and "cannot be split evenly over 3 GPUs" in errors[0]
    result = _plan(toy_small, "--gpus", "0", "--gpu_mem_gib", "64")
    assert result.returncode == 2 and result.stderr.strip() == "error: --gpus 0: give at least 1", explain(result)


@pytest.mark.parametrize("args, line", [
    # each was measured first and then planned against nan GiB, or ended in a traceback from torch
    (("--gpu_mem_gib", "nan"), "error: --gpu_mem_gib nan: give the memory of one GPU in GiB"),
    (("--gpu_mem_gib", "64", "--largest_probe", "0"), "error: --largest_probe 0: give the largest per-GPU batch"),
    (("--gpu_mem_gib", "64", "--device", "cuda"), "error: --device cuda: torch sees no such GPU here"),
    (("--gpu_mem_gib", "64", "--device", "cuda:3"), "error: --device cuda:3: torch sees no such GPU here"),
])
def test_plan_batch_refuses_what_it_cannot_measure_or_plan_before_measuring(toy_small, args, line):
    if any(arg.startswith("cuda") for arg in args) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    result = _plan(toy_small, "--gpus", "2", *args)
    assert result.returncode == 2 and result.stderr.strip().startswith(line), explain(result)
    assert "per-GPU batch 1:" not in result.stdout  # refused before any measurement


@pytest.mark.slow
def test_train_per_gpu_batch_auto_changes_nothing_else_of_the_run(toy_small, tmp_path):
    common = ("--hypes_yaml", TOY, "--num_workers", "0", "--max_steps", "2", "--set", "train_params.batch_size=4",
              *split_set_flags(toy_small))
    # In process: whether the measurement leaves a trace in the run does not depend on the world size (the plan on
    # 2 processes is judged by the parity check below).
    auto = train(0, *common, "--model_dir", tmp_path / "auto", "--per_gpu_batch", "auto")
    assert auto.returncode == 0, explain(auto)
    chosen = re.search(r"--per_gpu_batch auto chose per-GPU batch (\d+) x (\d+) accumulation", auto.stdout)
    assert chosen, auto.stdout
    given = train(0, *common, "--model_dir", tmp_path / "given", "--per_gpu_batch", chosen[1])
    assert given.returncode == 0, explain(given)
    a = torch.load(tmp_path / "auto" / "net_step2.pth", weights_only=True)
    b = torch.load(tmp_path / "given" / "net_step2.pth", weights_only=True)
    assert all(torch.equal(a[key], b[key]) for key in a)  # the measurement left no trace in the training
    assert (tmp_path / "auto" / "train_steps.csv").read_text().splitlines()[1].split(",")[:5] == \
        (tmp_path / "given" / "train_steps.csv").read_text().splitlines()[1].split(",")[:5]


@pytest.mark.slow
def test_train_per_gpu_batch_auto_refuses_when_nothing_fits(toy_small, tmp_path):
    result = train(0, "--hypes_yaml", TOY, "--num_workers", "0", "--set", "train_params.batch_size=4",
                   *split_set_flags(toy_small), "--model_dir", tmp_path / "run", "--per_gpu_batch", "auto",
                   "--per_gpu_mem_gib", "0.0001")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, explain(result)
    assert "--per_gpu_batch auto: no plan fits: even per-GPU batch 1 needs" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_per_gpu_batch_auto_on_two_processes_follows_the_one_process_run(toy_small, tmp_path):
    """The issue's promise, judged as tools/parity_check.py judges any run: the auto plan on 2 processes (batch 4 ->
    per-GPU 2 or 1 x accumulation) against the 1-process run, with the reversed-batch run as the noise floor."""
    work = tmp_path / "runs"
    result = python(REPO / "tools" / "parity_check.py", "--hypes_yaml", TOY, "--world_sizes", "1,2", "--steps", "3",
                    "--set", "train_params.batch_size=4", *split_set_flags(toy_small), "--work_dir", work,
                    "--train_args=--per_gpu_batch auto", timeout=900)
    assert result.returncode == 0, explain(result)
    assert "PASS: every world size follows the 1-process run." in result.stdout
    world2 = next(line for line in result.stdout.splitlines() if line.strip().startswith("world2 |"))
    assert "same training" in world2
    chosen = re.search(r"--per_gpu_batch auto chose per-GPU batch (\d+) x (\d+) accumulation",
                       (work / "world2.log").read_text())  # the run's own output
    assert chosen and 2 * int(chosen[1]) * int(chosen[2]) == 4  # the plan ran, and it kept the batch


def test_ddp_buckets_are_added_on_several_ranks_only():
    model = batch_fit.fit([Probe(1, 3 * GIB, 0.1, parameter_bytes=GIB // 2), Probe(2, 5 * GIB, 0.2)])
    assert batch_fit.ddp_bytes(model, 1) == 0 and batch_fit.ddp_bytes(model, 2) == GIB // 2
    assert [o.predicted_bytes for o in batch_fit.options(4, 1, model, 100 * GIB)] == [9 * GIB, 5 * GIB, 3 * GIB]
    assert [o.predicted_bytes for o in batch_fit.options(4, 2, model, 100 * GIB)] == [5.5 * GIB, 3.5 * GIB]
    assert "per-GPU batch 1 needs 3.50 GiB" in batch_fit.no_plan_message(4, 2, model, GIB)


@pytest.mark.parametrize("free, total, processes, share", [
    (80, 80, 1, 72), (78, 80, 1, 70.2),  # one rank: what is free now (the CUDA context is not)
    (78, 80, 2, 36), (78, 80, 4, 18),  # ranks sharing the GPU on purpose: an equal share of the whole each
    (20, 80, 2, 18),  # another job holds most of it: no more than is free
])
def test_a_rank_plans_for_its_share_of_the_device(free, total, processes, share):
    assert batch_fit.usable_share(free * GIB, total * GIB, processes, headroom=0.1) == pytest.approx(share * GIB)


class _Split:
    """A split whose samples hold these many CAVs (sample_cost), as an OPV2V test split's scenarios of 2 to 7."""

    def __init__(self, cavs):
        self.cavs = cavs

    def __len__(self):
        return len(self.cavs)

    def sample_cost(self, index):
        return self.cavs[index]


def test_the_memory_probe_takes_the_heaviest_samples():
    split = _Split([2, 2, 3, 7, 5, 7, 2])
    assert batch_fit.heaviest_samples(split, 1) == [3]  # the first of the ties
    assert batch_fit.heaviest_samples(split, 2) == [3, 5]
    assert batch_fit.heaviest_samples(split, 3) == [3, 4, 5]
    assert batch_fit.heaviest_samples(list(range(5)), 2) == [0, 1]  # no cost: the first ones
    assert batch_fit.heaviest_samples(_Split([4, 5]), 4) == [0, 1]
