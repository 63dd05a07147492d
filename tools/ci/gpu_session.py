"""The prepared call for a lent GPU: issue 52's figures in priority order, each stage cut to the time left.

Usage (on the GPU machine, from the repository root, after carrying the wheel archive; docs/benchmarks.md,
"The next GPU run"):

    python3 tools/ci/gpu_session.py --out $OUT --wheels .gpu/w.wheels.tar.xz [--budget 540] [--stages ...]
    python3 tools/ci/gpu_session.py --out /tmp/rehearsal --device cpu        # the rehearsal here

A lent GPU has 15 minutes in all, its start included, and one command at most 10: the figures must come from
one command that ends in time, whatever a stage costs there. The stages run in STAGES' order, each under a time
limit: its own cap or what is left of ``--budget``, whichever is less (its process group is killed at the limit,
and what it wrote stays); a stage that would have under MIN_STAGE_S is left out. ``session.md`` in ``--out``
says what each stage did, how long it took and its output's tail, and is rewritten after every stage, so a call
cut short returns what it measured. A lent machine returns at most 8 files from ``--out``: the stages write 7
(session.md, capture.json and profile.json, which benchmark_models.py rewrites after every row, so that a stage cut
at its limit returns its rows with their operators by name; gc/ and acceptance/ gpu_check.md and .json). The
benchmarks' printed tables are in session.md's tail.

The stages (``--device cpu`` rehearses them on one toy config, without what needs CUDA):

- venv: ``make gpu-venv WHEELS=...``'s command, ``gpu_venv.py make .venv-gpu`` (the project's run-time
  requirements layered over the machine's CUDA torch, whose pytest the tests use; without ``--wheels``, ``make
  venv``). Where that fails, the session does not end:
  it takes the target route (``gpu_venv.py target``: the wheels unpacked into a folder, no venv) and runs the
  stages after it with the machine's python and that folder and the checkout on PYTHONPATH. ``--venv target``
  takes that route from the start;
- gpu_tests: the suite's tests marked cuda (``make gpu-tests``: the CUDA graphs of --capture cudagraphs against
  the eager step, the synchronized batch norm's CUDA kernels, the device data path), each failure on one line;
  first after the venv: a minute, and what failed there on the first lent H200 (2026-11-30) is the next question;
- capture: ``benchmark_models.py --capture cudagraphs`` for the eight PointPillar configs at per-GPU batch 1
  and 2: the eager step and the step replayed as CUDA graphs, and batch 1 over batch 2 (the issue's first figure);
  with ``--upstream DIR`` (a checkout of upstream OpenCOOD carried with the call) also upstream's step, timed in
  turns with both (the issue's second figure), here and in the profile stage; on CUDA with ``--profile``: the
  eager and the captured step's GPU busy share (is the captured step at batch 1 bound by the GPU or the host?);
- gpu_check: ``tools/gpu_check.py``'s checks of issue 52 (NOT_ISSUE_52 left out, fp32): the nine toy models'
  training with the model table's step at batch 1 and 2, rates and DDP step, host syncs, the captured
  accumulation, the capture checks in both modes and in DDP;
- profile: ``benchmark_models.py --count --profile`` in fp32, bf16 and fp16 for the models whose half precision
  was slower than fp32 on the H200 and for SECOND (issue 52 items 4 and 5);
- acceptance: the whole of ``tools/gpu_check.py`` (``make gpu-check``), where time is left.

Standard library and gpu_venv.py beside it (standard library, pip and packaging): it runs before the venv exists.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_venv  # noqa: E402  (beside this file; found however the tool is started, in-process runs included)

REPO = Path(__file__).resolve().parents[2]
# A stage cut at its limit keeps the rows before: the rows the first lent H200 did not reach (2026-11-30: the
# capture stage's 300 s took 11 of the 16 rows, about 27 s a row) first, then AttFuse, the issue's reference row
PILLAR_CONFIGS = [f"opv2v/point_pillar_{name}" for name in (
    "v2xvit", "late_fusion", "cobevt", "intermediate_fusion", "early_fusion", "where2comm", "fcooper", "v2vnet")]
# issue 52 item 5 (SECOND, not reached on 2026-11-30: 15 of the 24 rows in 287 s) first, then item 4 (fp16 slower
# than fp32 on the H200: Where2comm, AttFuse, early fusion)
PROFILE_CONFIGS = ["opv2v/second_intermediate_fusion", "opv2v/point_pillar_where2comm",
                   "opv2v/point_pillar_intermediate_fusion", "opv2v/point_pillar_early_fusion"]
TOY_CONFIG = "toy/point_pillar_intermediate_fusion"  # the rehearsal's (--device cpu) one config
STAGE_NAMES = ("venv", "gpu_tests", "capture", "gpu_check", "profile", "acceptance")  # their order (`stages`)
# the tests' failures one line each, without the captured logs: on the H200 torch's DEBUG trace records filled
# the 40 lines of session.md's tail, and the two failures' messages were lost (2026-11-30)
PYTEST_TAIL = ["--tb=line", "--show-capture=no"]
# gpu_check's checks that measure nothing of issue 52 (the acceptance stage runs them): the parity and repeat
# runs, the planner, the loader's worker sweep and the feed run
NOT_ISSUE_52 = ["--parity_config", "none", "--repeat_configs", "--planner_config", "none", "--loader_config", "none",
                "--feed_config", "none"]
MIN_STAGE_S = 30  # a stage is not started with less time left than this
ROUTES = ("layer", "target")  # how the venv stage gives the others the project's requirements (the docstring)
TAIL_LINES = 60  # of each stage's output, in session.md: the capture stage's table of 16 rows and its ratios


@dataclass
class Stage:
    name: str
    command: List[str]
    cap_s: int
    env: Dict[str, str] = field(default_factory=dict)  # set over the session's environment
    result: dict = field(default_factory=dict)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the lent machine returns ($OUT)")
    parser.add_argument("--wheels", help="the wheel archive or folder `make gpu-venv` installs from; none: .venv")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all stages together")
    parser.add_argument("--stages", nargs="+", choices=STAGE_NAMES, help="these stages only, in their order")
    parser.add_argument("--venv", default="layer", choices=ROUTES,
                        help="layer: make gpu-venv, and the target route where it fails; target: that route at once "
                             "(gpu_venv.py target, needs --wheels)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: rehearse the stages on the toy config")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_session"),
                        help="runs' folders and toy worlds, outside --out")
    parser.add_argument("--upstream", type=Path, help="a checkout of upstream OpenCOOD (its opencood/ folder): the "
                        "capture and profile stages time its step in turns with ours (benchmark_models.py --upstream)")
    parser.add_argument("--dry-run", action="store_true", help="print the stages' commands and run nothing")
    return parser.parse_args(argv)


def target_site(args: argparse.Namespace) -> Path:
    """The target route's folder of unpacked wheels, outside the checkout."""
    return (args.work / "site").resolve()  # absolute: every stage's processes read PYTHONPATH from their own cwd


def stages(args: argparse.Namespace, route: str = "layer") -> List[Stage]:
    """The stages, in the order they run (the module docstring), on the venv's `route` (ROUTES)."""
    cuda = args.device == "cuda"
    models = str(REPO / "tools" / "benchmarks" / "benchmark_models.py")
    pillars = PILLAR_CONFIGS if cuda else [TOY_CONFIG]
    if route == "target":
        python, env = sys.executable, {"PYTHONPATH": gpu_venv.target_pythonpath(target_site(args))}
        venv = [python, str(REPO / "tools" / "ci" / "gpu_venv.py"), "target", str(target_site(args)), "--wheels",
                str(args.wheels)]
    else:
        python, env = str(REPO / (".venv-gpu" if args.wheels else ".venv") / "bin" / "python"), {}
        # `make gpu-venv`'s command itself (the lent machine's notes do not list make), on the python that runs this
        # tool: start it with the machine's python3, whose torch is the CUDA one the layer goes over
        venv = ([sys.executable, str(REPO / "tools" / "ci" / "gpu_venv.py"), "make", ".venv-gpu", "--wheels",
                 str(args.wheels)] if args.wheels else ["make", "venv"])
    def gpu_check(out: str) -> List[str]:
        command = [python, str(REPO / "tools" / "gpu_check.py"), "--device", args.device, "--out",
                   str(args.out / out), "--work", str(args.work / out)]
        if not cuda:  # the rehearsal: one toy model, no full-size one, the cheapest parity
            command += ["--configs", TOY_CONFIG, "--full_size", "--precisions", "fp32", "--parity_kernels",
                        "strict", "--capture_configs", TOY_CONFIG]
        return command

    # issue 52's second figure, ours over upstream's step, where a checkout came with the call
    upstream = ["--upstream", str(args.upstream.resolve())] if args.upstream else []
    profile = [python, models, "--device", args.device, "--count", *upstream, "--batch-sizes", "1", "2",
               "--repeats", "5",
               "--precisions", "fp32", "bf16", *(["fp16", "--profile"] if cuda else []),
               "--configs", *(PROFILE_CONFIGS if cuda else [TOY_CONFIG]), "--data", str(args.work / "toy_opv2v"),
               "--json", str(args.out / "profile.json")]
    run = [
        Stage("venv", venv, 180),
        Stage("gpu_tests", [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *PYTEST_TAIL,
                            "tests"], 150),
        Stage("capture", [python, models, "--device", args.device, "--capture", "cudagraphs", *upstream,
                          *(["--profile"] if cuda else []), "--batch-sizes", "1", "2", "--repeats",
                          "10" if cuda else "2", "--configs", *pillars, "--data", str(args.work / "toy_opv2v"),
                          "--json", str(args.out / "capture.json")],
              300),
        Stage("gpu_check", [*gpu_check("gc"), *NOT_ISSUE_52, *(["--precisions", "fp32"] if cuda else [])], 300),
        Stage("profile", profile, 300),
        Stage("acceptance", gpu_check("acceptance"), 600),
    ]
    assert tuple(stage.name for stage in run) == STAGE_NAMES
    for stage in run[1:]:
        stage.env = dict(env)
    return run


def run_stage(stage: Stage, limit_s: float) -> None:
    """`stage` under `limit_s` seconds, in a process group of its own (the tools start processes: torchrun's, one
    per benchmark row), killed whole at the limit."""
    started = time.monotonic()
    try:  # unbuffered: a stage killed at its limit keeps every line it printed
        process = subprocess.Popen(stage.command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **stage.env})
    except OSError as exc:  # a program the machine lacks: the stage failed, and the session goes on
        stage.result = {"status": f"could not start ({exc.strerror}: {stage.command[0]})", "seconds": 0.0}
        return
    try:
        output, _ = process.communicate(timeout=limit_s)
        status = f"exit {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = f"cut at its limit ({limit_s:.0f} s)"
    stage.result = {"status": status, "seconds": time.monotonic() - started,
                    "tail": "\n".join(output.splitlines()[-TAIL_LINES:])}


def report(run: Sequence[Stage], args: argparse.Namespace, started: float) -> str:
    lines = [f"# gpu_session: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
             f"device {args.device}, budget {args.budget:.0f} s, {time.monotonic() - started:.0f} s used", "",
             "| stage | result | seconds |", "|---|---|---:|"]
    lines += [f"| {s.name} | {s.result.get('status', 'not run')} | {s.result.get('seconds', 0):.0f} |" for s in run]
    for stage in run:
        if "tail" in stage.result:
            lines += ["", f"## {stage.name}: `{command_line(stage)}`", "", "```", stage.result["tail"], "```"]
    return "\n".join(lines) + "\n"


def command_line(stage: Stage) -> str:
    """The stage's command as a shell would take it, its own variables first."""
    return "".join(f"{k}={shlex.quote(v)} " for k, v in stage.env.items()) + shlex.join(stage.command)


def chosen_stages(args: argparse.Namespace, route: str, names: Optional[Sequence[str]] = None) -> List[Stage]:
    """The stages of `route` that --stages (or `names`) keeps, in their order."""
    keep = names if names is not None else args.stages
    return [s for s in stages(args, route) if not keep or s.name in keep]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.venv == "target" and not args.wheels:
        print("error: --venv target unpacks --wheels; pass the wheel archive or folder", file=sys.stderr)
        return 2
    todo = chosen_stages(args, args.venv)
    if args.dry_run:
        for stage in todo:
            print(f"{stage.name} (at most {stage.cap_s} s): {command_line(stage)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    started, done, route = time.monotonic(), [], args.venv
    while todo:
        stage = todo.pop(0)
        left = args.budget - (time.monotonic() - started)
        if left < MIN_STAGE_S:
            stage.result = {"status": f"left out: {left:.0f} s left"}
        else:
            run_stage(stage, min(stage.cap_s, left))
        done.append(stage)
        (args.out / "session.md").write_text(report(done + todo, args, started))
        print(f"{stage.name}: {stage.result['status']}", flush=True)
        if stage.name == "venv" and stage.result["status"] != "exit 0":
            if route == "target" or not args.wheels:
                break  # nothing runs without an environment, and no other route is left
            # the layer failed: the same stages on the target route, its venv stage first
            route, todo = "target", chosen_stages(args, "target", ["venv", *(s.name for s in todo)])
    return 0 if all(s.result.get("status") == "exit 0" for s in done + todo) else 1


if __name__ == "__main__":
    sys.exit(main())
