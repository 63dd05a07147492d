#!/usr/bin/env python
"""Is an N-process run the same training as the 1-process baseline? Train K steps at each world size and compare.

    python tools/parity_check.py --hypes_yaml hypes_yaml/x.yaml --world_sizes 1,2,4 --steps 20

Each world size runs the user-facing `tools/train_ddp.py --max_steps K` (plain `python` for 1, torchrun for
more; on CUDA one GPU per process, else gloo on CPU) in its own folder under --work_dir, with this tool's
training flags (--set, --per_gpu_batch, --seed, --half, --num_workers: train_ddp.py's own) and --train_args.
Against world size 1 it compares the loss curve (`train_steps.csv`: the loss all-reduced over ranks, per step)
and the weights after K steps (`net_step{K}.pth`, ||a - b|| / ||b|| over all parameters).

Training is chaotic: a change of float summation order alone makes two runs drift apart, and an N-rank run
sums in another order. So two more world-size-1 runs feed each batch in another order, reversed and rotated by
one (the same training in exact arithmetic), and measure that drift: the noise floor, the larger of the two at
each step. Two draws, since one can be lucky: a gradient near 0 whose sign the rounding flips makes Adam step by
a whole lr, and the step it first happens at sets the drift. That step is a draw, not a property of the world
size: on an AVX2 CPU 2 ranks on the demo's world drifted one step before any reordered run, though each of
their steps was as close to the 1-process step as a reordered step is.
So the verdict rests on the step check, which chaos cannot reach: the 1-process run also saves its state after
step K-1, and every other run trains step K once more from a copy of that state. Its weights after that one step,
against the 1-process run's, over the size of that step (||w - w1|| / ||w1 - w1(K-1)||), is the step gap. A world
size passes when its step gap stays within --noise_factor times the reordered runs' (or under --tolerance), its
loss curve stays within --noise_factor times the largest gap the reordered runs reach in the whole run (or under
--loss_tolerance) and its final weight gap within --noise_factor times theirs (or under --tolerance). Per-rank
BatchNorm statistics (--train_args=--no_sync_bn) make a step gap thousands of times the reordered runs' (the toy
AttFuse on the demo's world: 0.15 and 0.43 against 2e-5 and 4e-5).
Every run's processes compute at the thread count torchrun gives a rank (OMP_NUM_THREADS=1 unless it is set):
a CPU kernel's float sums can follow its thread count, and a world-size-1 run on two threads against ranks on one
would count that difference as the world size's (on a toy AttFuse run, the loss at step 5 moves in the third
digit between one and two threads).
It needs --steps 2 or more (step K starts from a state after step K-1). Run it on a small subset before a long
job. Exit status: 0 when every world size passes, 1 when one does
not, 2 on a bad input or a failed run.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from opencood_ddp import hypes as hypes_lib
from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed.batch_plan import make_batch_plan
from opencood_ddp.distributed.env import environ_without_launcher
from opencood_ddp.distributed.launch import launcher_prefix, parse_world_sizes
from opencood_ddp.engine.inference import choose_checkpoint
from opencood_ddp.engine.logs import STEP_LOG_NAME, read_step_log
from opencood_ddp.engine.options import train_argv, train_options_of, training_flags
from opencood_ddp.engine.parity import global_relative_difference, relative_differences, step_relative_difference
from opencood_ddp.errors import CheckpointError, ConfigError, OpencoodDdpError
from opencood_ddp.yaml_parsers import load_parsed_hypes

TRAIN = Path(__file__).resolve().parent / "train_ddp.py"
NOISE_RUNS = {"world1_reversed": "reversed", "world1_rotated": "rotated"}  # run name: its --batch_order
# train_ddp.py flags this tool gives each run itself (`command`)
OWN_RUN_FLAGS = ("--model_dir", "--hypes_yaml", "--max_steps", "--batch_order")


# The training flags every run gets, as tools/train_ddp.py reads them (--half: expect larger gaps).
TRAINING_FLAGS = ("hypes_yaml", "overrides", "per_gpu_batch", "seed", "half", "num_workers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     parents=[training_flags(*TRAINING_FLAGS, required=("hypes_yaml",))])
    parser.add_argument("--world_sizes", default="1,2", help="comma-separated; world size 1 is added as reference")
    parser.add_argument("--steps", type=int, default=10,
                        help="optimizer steps per run, 2 or more; the last is the checked step (default 10)")
    parser.add_argument("--train_args", default="", metavar="'FLAGS'",
                        help="more tools/train_ddp.py flags for every run, e.g. --train_args='--no_sync_bn' to "
                             "see the gap that per-rank BatchNorm makes")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="a weight gap or step gap below this passes whatever the noise (default 1e-4)")
    parser.add_argument("--loss_tolerance", type=float, default=1e-4,
                        help="a per-step relative loss gap below this passes whatever the noise (default 1e-4)")
    parser.add_argument("--noise_factor", type=float, default=5.0,
                        help="how many times the measured noise floor a gap may reach (default 5)")
    parser.add_argument("--work_dir", help="keep the runs here (default: a temporary folder, removed at the end)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    return parser


def check_batch_splits(args: argparse.Namespace, world_sizes: list[int]) -> int:
    """Fail before any training when the hypes' batch cannot be split over one of the world sizes."""
    hypes = load_parsed_hypes(args.hypes_yaml, args.overrides)
    batch = hypes_lib.get_key(hypes, "train_params.batch_size", None)
    lr = float(hypes_lib.get_key(hypes, "optimizer.lr", 0.0))
    # 'auto' measures in each run and picks a per-process batch that splits the batch: only the split is checked.
    per_gpu_batch = None if args.per_gpu_batch == "auto" else args.per_gpu_batch
    for world in world_sizes:
        try:
            make_batch_plan(batch, world, lr, per_gpu_batch=per_gpu_batch)
        except ConfigError as exc:
            raise ConfigError(f"{args.hypes_yaml}: {exc} (or pick --world_sizes that divide it, or pass "
                              f"--set train_params.batch_size=B)") from None
    return batch


def command(world: int, args: argparse.Namespace, run_dir: Path, order: str, steps: int) -> list[str]:
    options = train_options_of(args)
    options = dataclasses.replace(
        options, run=dataclasses.replace(options.run, model_dir=str(run_dir)),
        loop=dataclasses.replace(options.loop, max_steps=steps, batch_order=order))
    return launcher_prefix(world, torchrun=world > 1) + [str(TRAIN), *train_argv(options),
                                                         *shlex.split(args.train_args)]


def run_environ(environ: Mapping[str, str]) -> dict:
    """A run's environment: without the launcher variables of the shell running this tool (say, inside an
    salloc), and with the thread count torchrun gives each rank, for the world-size-1 runs too."""
    return {"OMP_NUM_THREADS": "1", **environ_without_launcher(environ)}


def stop(process: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM first: torchrun passes it on to its workers, which run in sessions of their own and would outlive
    a SIGKILL of torchrun; SIGKILL only after ``grace_s``."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_world(name: str, world: int, args: argparse.Namespace, work_dir: Path, order: str = "sampled",
              steps: Optional[int] = None) -> Path:
    """Train (or, where work_dir/name holds a run, resume) the run `name` up to `steps` (default --steps)."""
    run_dir, log_path = work_dir / name, work_dir / f"{name}.log"
    cmd = command(world, args, run_dir, order, args.steps if steps is None else steps)
    shown = " ".join(cmd[1:] if world > 1 else ["python"] + cmd[1:])
    print(f"{name}: {shown}", flush=True)
    started = time.perf_counter()
    with open(log_path, "a") as log:  # a resumed run's output follows its first part's
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=run_environ(os.environ))
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            raise ConfigError(f"the {name} run took longer than --timeout {args.timeout:g} s and was stopped; its "
                              f"output is in {log_path}: raise --timeout, or give fewer --steps") from None
    if returncode != 0:
        raise ConfigError(f"the {name} run failed (exit {returncode}): "
                          f"{last_error_line(log_path)}; its output is in {log_path}")
    print(f"{name}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def last_error_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (errors or lines or ["no output"])[-1]


@dataclass
class RunResult:
    name: str
    losses: list[float]  # all-reduced loss per optimizer step
    samples_per_s: float  # median over the steps after the first
    weights: dict
    step_gap: Optional[float] = None  # the step check's gap (step_relative_difference); None for the reference


def run_weights(name: str, run_dir: Path, steps: int) -> Path:
    """The run's weights after `steps` optimizer steps, picked as evaluation picks a checkpoint
    (engine/inference.choose_checkpoint), or its last epoch's when the hypes' epochs ended the run first."""
    try:
        return choose_checkpoint(run_dir, step=steps)
    except CheckpointError:
        try:
            return choose_checkpoint(run_dir)
        except CheckpointError as error:
            raise ConfigError(f"the {name} run saved no weights: {error}") from None


def read_run(name: str, run_dir: Path, steps: int) -> RunResult:
    rows = read_step_log(run_dir / STEP_LOG_NAME)
    path = run_weights(name, run_dir, steps)
    rates = sorted(row["samples_per_s"] for row in rows[1:]) or [rows[0]["samples_per_s"]]
    return RunResult(name, [row["loss"] for row in rows], rates[len(rates) // 2], ckpt.load_file(path))


def loss_gaps(losses: list[float], reference: list[float]) -> list[float]:
    """|loss - reference| / |reference| per step (inf where a loss is not finite)."""
    gaps = []
    for value, ref in zip(losses, reference):
        gap = abs(value - ref) / max(abs(ref), 1e-12)
        gaps.append(gap if math.isfinite(gap) else math.inf)
    return gaps


@dataclass
class Verdict:
    loss_gap: float  # the largest per-step loss gap
    loss_step: int  # where it occurs (1-based)
    weight_gap: float
    step_gap: float
    worst_tensor: tuple  # (per-tensor max relative difference, its name), to find what diverged
    passed: bool
    reason: str


@dataclass
class NoiseFloor:
    """What reordering each batch changes, the largest over the noise runs: the loss gap over the whole run (the
    drift's envelope), the final weight gap and the step gap."""

    loss_gap: float
    weight_gap: float
    step_gap: float


def noise_floor(noises: list[RunResult], reference: RunResult) -> NoiseFloor:
    return NoiseFloor(max(max(loss_gaps(noise.losses, reference.losses), default=0.0) for noise in noises),
                      max(global_relative_difference(noise.weights, reference.weights) for noise in noises),
                      max(noise.step_gap for noise in noises))


def verdict_reason(result: RunResult, reference: RunResult, floor: NoiseFloor, weight_gap: float,
                   args: argparse.Namespace) -> str:
    """Why `result` is not the reference's training, or '' when it is. The step check comes first: it is the
    one chaos cannot blur."""
    factor = args.noise_factor
    if len(result.losses) != len(reference.losses):
        return f"ran {len(result.losses)} steps, the reference {len(reference.losses)}"
    if result.step_gap > max(args.tolerance, factor * floor.step_gap):
        return (f"step {len(reference.losses)} from world1's state lands {result.step_gap:.2e} of the step away, "
                f"above {factor:g} x the reordered runs' {floor.step_gap:.2e}")
    for step, gap in enumerate(loss_gaps(result.losses, reference.losses), start=1):
        if gap > max(args.loss_tolerance, factor * floor.loss_gap):
            return (f"loss gap {gap:.2e} at step {step} is above {factor:g} x the largest gap of the reordered "
                    f"runs {floor.loss_gap:.2e}")
    if weight_gap > max(args.tolerance, factor * floor.weight_gap):
        return f"weight gap {weight_gap:.2e} is above {factor:g} x the reordered runs' {floor.weight_gap:.2e}"
    return ""


def judge(result: RunResult, reference: RunResult, noises: list[RunResult], args: argparse.Namespace) -> Verdict:
    gaps = loss_gaps(result.losses, reference.losses)
    weight_gap = global_relative_difference(result.weights, reference.weights)
    worst = relative_differences(result.weights, reference.weights)["parameters"]
    loss_gap = max(gaps, default=0.0)
    at = gaps.index(loss_gap) + 1 if gaps else 0
    reason = verdict_reason(result, reference, noise_floor(noises, reference), weight_gap, args)
    return Verdict(loss_gap, at, weight_gap, result.step_gap, worst, not reason, reason)


def report(results: list[RunResult], noises: list[RunResult], args: argparse.Namespace, batch: int) -> bool:
    reference = results[0]
    steps = len(reference.losses)
    print(f"\nparity against world size 1: {args.hypes_yaml}, effective batch {batch}, {steps} steps")
    print(f"{'run':>16} | {'samples/s':>9} | {'max loss gap':>20} | {'weight gap':>10} | {f'step {steps} gap':>11} | "
          f"verdict")
    passed = True
    for result in noises + results[1:]:
        verdict = judge(result, reference, noises, args)
        is_noise = any(result is noise for noise in noises)
        passed &= verdict.passed or is_noise
        label = "noise floor" if is_noise else ("same training" if verdict.passed else "DIFFERENT")
        where = f"{verdict.loss_gap:.2e} @ step {verdict.loss_step}" if verdict.loss_step else "-"
        print(f"{result.name:>16} | {result.samples_per_s:>9.1f} | {where:>20} | {verdict.weight_gap:>10.2e} | "
              f"{verdict.step_gap:>11.2e} | {label}")
        if not verdict.passed and not is_noise:
            print(f"{'':>16}   {verdict.reason}; largest per-tensor gap {verdict.worst_tensor[0]:.2e} in "
                  f"{verdict.worst_tensor[1]}")
    print(f"gaps are relative to world size 1; the noise floor is the larger gap of world size 1 with reversed and "
          f"with rotated batches (the same training in exact arithmetic). The step gap: step {steps} trained from "
          f"world1's state after step {steps - 1}, ||w - w1|| / ||w1 - w1({steps - 1})||.\n"
          f"pass: step gap <= max({args.noise_factor:g} x the noise runs', tolerance {args.tolerance:g}); every "
          f"loss gap <= max({args.noise_factor:g} x their largest, {args.loss_tolerance:g}); weight gap <= "
          f"max({args.noise_factor:g} x theirs, {args.tolerance:g}). "
          + ("PASS: every world size follows the 1-process run." if passed else
             "FAIL: see docs/ddp_semantics.md for what must be identical."))
    return passed


def check_flags(args: argparse.Namespace) -> None:
    """What the runs would fail on, said before any folder is made."""
    if args.steps < 2:
        raise ConfigError(f"--steps {args.steps}: give 2 or more optimizer steps (the last one is checked from "
                          f"the 1-process run's state after the one before)")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g}: give each run's limit in seconds, above 0")
    for name in ("tolerance", "loss_tolerance", "noise_factor"):
        if not getattr(args, name) >= 0:
            raise ConfigError(f"--{name} {getattr(args, name):g}: give a number >= 0")
    try:
        extra = shlex.split(args.train_args)
    except ValueError as exc:
        raise ConfigError(f"--train_args {args.train_args!r} cannot be split into flags ({exc}); check its "
                          f"quotes") from None
    # The runs' own flags: another --model_dir trained outside --work_dir (a traceback when it was read back)
    owned = sorted({flag.split("=")[0] for flag in extra} & set(OWN_RUN_FLAGS))
    if owned:
        raise ConfigError(f"--train_args sets {', '.join(owned)}, which parity_check sets for every run; drop it "
                          f"(--steps and --work_dir say how long and where)")
    if args.work_dir and Path(args.work_dir).exists() and not Path(args.work_dir).is_dir():
        raise ConfigError(f"--work_dir {args.work_dir} is a file; pick an empty folder")


def start_name(steps: int) -> str:
    """The folder of the 1-process run's state after step K-1, where every step check starts."""
    return f"world1_step{steps - 1}"


def stepped_name(name: str, steps: int) -> str:
    """The folder of run `name`'s step K from the 1-process run's state after step K-1."""
    return f"{name}_step{steps}"


def run_reference(args: argparse.Namespace, work_dir: Path) -> RunResult:
    """World size 1 up to step K-1, a copy of that state for the step checks, then on to step K: a resume, which
    continues as the run without a stop does, to the bit (tests/test_end_to_end.py)."""
    run_world("world1", 1, args, work_dir, steps=args.steps - 1)
    shutil.copytree(work_dir / "world1", work_dir / start_name(args.steps))
    reference = read_run("world1", run_world("world1", 1, args, work_dir), args.steps)
    done = len(reference.losses)
    if done < args.steps:  # the hypes' epochs ended it: step K did not run, and its check would check nothing
        raise ConfigError(f"the world1 run ended after {done} steps, at the hypes' train_params.epoches, before "
                          f"--steps {args.steps}: give --steps {done} or fewer (2 at least), or more epochs "
                          f"(--set train_params.epoches=N)")
    return reference


def run_checked(name: str, world: int, order: str, args: argparse.Namespace, work_dir: Path,
                reference: RunResult, start: dict) -> RunResult:
    """Run `name` of its own up to step K, then step K once more from a copy of the reference's state after
    step K-1: its step gap."""
    result = read_run(name, run_world(name, world, args, work_dir, order), args.steps)
    stepped = stepped_name(name, args.steps)
    shutil.copytree(work_dir / start_name(args.steps), work_dir / stepped)
    weights = ckpt.load_file(run_weights(stepped, run_world(stepped, world, args, work_dir, order), args.steps))
    result.step_gap = step_relative_difference(weights, reference.weights, start)
    return result


def parity_check(args: argparse.Namespace) -> int:
    world_sizes = parse_world_sizes(args.world_sizes)
    check_flags(args)
    batch = check_batch_splits(args, world_sizes)
    # Without --work_dir the runs go to a temporary folder, removed once every run has been read: a run that fails
    # leaves it, so that the log its error line names is there to read.
    scratch = None if args.work_dir else Path(tempfile.mkdtemp(prefix="parity_"))
    work_dir = Path(args.work_dir) if args.work_dir else scratch
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, or a folder it may not write in
        raise ConfigError(f"--work_dir {work_dir}: cannot make it ({exc.strerror}); pick an empty folder") from None
    names = [f"world{world}" for world in world_sizes] + list(NOISE_RUNS)
    folders = [start_name(args.steps)] + names + [stepped_name(name, args.steps) for name in names[1:]]
    taken = [name for name in folders if (work_dir / name).exists()]
    if taken:
        raise ConfigError(f"--work_dir {work_dir} already holds {', '.join(taken)}; pick an empty folder")
    reference = run_reference(args, work_dir)
    start = ckpt.load_file(run_weights(start_name(args.steps), work_dir / start_name(args.steps), args.steps - 1))
    results = [reference] + [run_checked(f"world{world}", world, "sampled", args, work_dir, reference, start)
                             for world in world_sizes[1:]]
    noises = [run_checked(name, 1, order, args, work_dir, reference, start) for name, order in NOISE_RUNS.items()]
    passed = report(results, noises, args, batch)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"runs kept in {work_dir}")
    return 0 if passed else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return parity_check(args)
    except OpencoodDdpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
