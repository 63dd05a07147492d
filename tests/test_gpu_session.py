"""tools/ci/gpu_session.py, the prepared call for a lent GPU: its commands must still be what the tools take, or the
GPU's few minutes are lost to a usage error. Each stage's tool command is parsed by that tool's own parser, for
the GPU's stages and the CPU rehearsal's; the budget's arithmetic is checked on stages that sleep."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tools" / "ci"))
sys.path.insert(0, str(REPO / "tools" / "benchmarks"))
import benchmark_models  # noqa: E402
import gpu_check  # noqa: E402
import gpu_session  # noqa: E402
import gpu_venv  # noqa: E402

PARSERS = {"benchmark_models.py": benchmark_models.parse_args, "gpu_check.py": gpu_check.parse_args,
           "gpu_venv.py": lambda argv: gpu_venv.build_parser().parse_args(argv)}


@pytest.mark.parametrize("device,route", [("cuda", "layer"), ("cuda", "target"), ("cpu", "layer")])
def test_every_stage_command_parses_with_its_tools_parser(device, route, tmp_path):
    args = gpu_session.parse_args(["--out", str(tmp_path), "--device", device, "--upstream", "opencood_checkout",
                                   *(["--wheels", "w.wheels.tar.xz"] if device == "cuda" else [])])
    parsed = {}
    run = gpu_session.stages(args, route)
    if route == "target":  # the machine's python, the unpacked wheels and then the checkout on its path
        site = gpu_session.target_site(args)
        assert site.is_absolute() and run[0].command[1:4] == [str(REPO / "tools" / "ci" / "gpu_venv.py"), "target",
                                                              str(site)]
        assert all(s.command[0] == sys.executable and s.env == {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
                   for s in run[1:])
    for stage in run:
        script = next((part for part in stage.command if part.endswith(".py")), None)
        if script is None:  # make, or pytest: checked by their own targets' tests
            continue
        name = script.rsplit("/", 1)[-1]
        argv = stage.command[stage.command.index(script) + 1:]
        parsed[stage.name] = PARSERS[name](argv)
    assert sorted(parsed) == ["acceptance", "capture", "gpu_check", "profile", *(["venv"] if device == "cuda" else [])]
    if device == "cuda":  # the layer without make (the lent machine's notes do not list it), or the target route
        assert parsed["venv"].command == ("target" if route == "target" else "make")
        assert parsed["venv"].wheels == "w.wheels.tar.xz" and run[0].command[0] == sys.executable
    assert parsed["capture"].capture == "cudagraphs" and parsed["capture"].batch_sizes == [1, 2]
    assert parsed["gpu_check"].device == parsed["acceptance"].device == device and parsed["profile"].count
    # upstream's step beside ours where a checkout came with the call (an absolute path: the stages' cwd is theirs)
    assert parsed["capture"].upstream == parsed["profile"].upstream == str(Path.cwd() / "opencood_checkout")
    assert gpu_session.stages(gpu_session.parse_args(["--out", str(tmp_path)]))[2].command.count("--upstream") == 0
    # the benchmarks' rows come back as JSON, written after every row (a cut stage keeps its rows)
    assert parsed["capture"].json.endswith("capture.json") and parsed["profile"].json.endswith("profile.json")
    # issue 52's gpu_check: the parity, repeat, planner, loader and feed checks left to the acceptance stage
    assert parsed["gpu_check"].parity_config == "none" and parsed["gpu_check"].repeat_configs == []
    assert parsed["gpu_check"].precisions == ["fp32"] and parsed["gpu_check"].out != parsed["acceptance"].out
    if device == "cuda":
        assert parsed["capture"].configs == gpu_session.PILLAR_CONFIGS and parsed["profile"].profile
        assert parsed["capture"].profile  # the captured step's GPU busy share beside the eager step's
        assert parsed["profile"].precisions == ["fp32", "bf16", "fp16"]


def test_stages_run_in_order_each_cut_to_the_budget_left(tmp_path, monkeypatch):
    """Three stages that sleep 3 s each under a 5 s budget and a minimum of 1 s: the first ends, the second is cut at
    the 2 s left, the third is left out; session.md says so, stage by stage."""
    sleeper = [sys.executable, "-c", "import time; print('slept', flush=True); time.sleep(3)"]
    run = [gpu_session.Stage(name, list(sleeper), 60) for name in ("a", "b", "c")]
    monkeypatch.setattr(gpu_session, "stages", lambda args, route="layer": run)
    monkeypatch.setattr(gpu_session, "MIN_STAGE_S", 1)
    assert gpu_session.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--budget", "5"]) == 1
    statuses = [stage.result["status"] for stage in run]
    assert statuses[0] == "exit 0" and statuses[1].startswith("cut at its limit (2 s)"), statuses
    assert statuses[2].startswith("left out"), statuses
    report = (tmp_path / "out" / "session.md").read_text()
    assert "| a | exit 0 |" in report and "| b | cut at its limit" in report and "| c | left out" in report
    assert report.count("```\nslept\n```") == 2  # the outputs' tails, the cut stage's included


def test_a_failing_cuda_test_reaches_the_tail_with_its_message(tmp_path):
    """The gpu_tests stage's pytest flags: a failing test whose logger wrote many DEBUG records (torch's trace
    logger on the H200 did) still shows its assertion's message in session.md's tail."""
    test = tmp_path / "test_noisy.py"
    test.write_text("import logging\n\n\ndef test_noisy():\n    log = logging.getLogger('torch.__trace')\n"
                    "    log.setLevel(logging.DEBUG)\n    for i in range(200):\n        log.debug('trace %d', i)\n"
                    "    assert 1.5 == 2.5, 'the first loss is not eager\\'s'\n")
    stage = gpu_session.Stage("gpu_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                            *gpu_session.PYTEST_TAIL, str(test)], 60)
    gpu_session.run_stage(stage, 60)
    assert stage.result["status"] == "exit 1"
    assert "AssertionError: the first loss is not eager's" in stage.result["tail"], stage.result["tail"]
    assert "trace 199" not in stage.result["tail"]


def test_a_failed_layer_gives_way_to_the_target_route_for_the_stages_left(tmp_path, monkeypatch):
    """`make gpu-venv` failing on the lent machine must not cost its minutes: the session runs the target route's
    venv stage, then the stages left, each with that route's environment; the result still says the layer failed."""
    def stage(name, code, env=None):
        return gpu_session.Stage(name, [sys.executable, "-c", code], 60, env=env or {})

    layer = [stage("venv", "raise SystemExit(3)"), stage("capture", "print('layer')")]
    target = [stage("venv", "print('unpacked')"),
              stage("capture", "import os; print('route', os.environ['ROUTE'])", {"ROUTE": "target"})]
    monkeypatch.setattr(gpu_session, "stages", lambda args, route="layer": {"layer": layer, "target": target}[route])
    out = tmp_path / "out"
    assert gpu_session.main(["--out", str(out), "--work", str(tmp_path / "work"), "--wheels", "w.wheels.tar.xz",
                             "--stages", "venv", "capture"]) == 1
    assert layer[0].result["status"] == "exit 3" and "status" not in layer[1].result
    assert [s.result["status"] for s in target] == ["exit 0", "exit 0"]
    assert target[1].result["tail"] == "route target"
    report = (out / "session.md").read_text()
    assert report.count("| venv | exit ") == 2 and "| capture | exit 0 |" in report
    assert "ROUTE=target " in report  # the stage's own variables are in its command line

    # without a wheel archive there is no other route: the session ends at the failed venv
    for s in layer + target:
        s.result = {}
    assert gpu_session.main(["--out", str(out), "--work", str(tmp_path / "work"), "--stages", "venv",
                             "capture"]) == 1
    assert layer[0].result["status"] == "exit 3" and not layer[1].result and not target[0].result


def test_a_stage_whose_program_is_missing_fails_and_the_session_goes_on(tmp_path, monkeypatch):
    """A program the lent machine lacks is that stage's failure, said in session.md, not the session's end: a
    missing layer's program gives way to the target route like a failing one."""
    missing = tmp_path / "no_such_program"
    layer = [gpu_session.Stage("venv", [str(missing)], 60), gpu_session.Stage("capture", [str(missing)], 60)]
    target = [gpu_session.Stage(name, [sys.executable, "-c", f"print('{name}')"], 60) for name in ("venv", "capture")]
    monkeypatch.setattr(gpu_session, "stages", lambda args, route="layer": {"layer": layer, "target": target}[route])
    out = tmp_path / "out"
    assert gpu_session.main(["--out", str(out), "--work", str(tmp_path / "work"), "--wheels", "w.wheels.tar.xz",
                             "--stages", "venv", "capture"]) == 1
    assert layer[0].result["status"] == f"could not start (No such file or directory: {missing})"
    assert [s.result["status"] for s in target] == ["exit 0", "exit 0"]
    assert f"| venv | could not start (No such file or directory: {missing}) |" in (out / "session.md").read_text()


def test_the_target_route_needs_the_wheels(tmp_path, capsys):
    assert gpu_session.main(["--out", str(tmp_path), "--venv", "target"]) == 2
    assert capsys.readouterr().err.startswith("error: --venv target unpacks --wheels")


def test_benchmark_rows_reach_the_json_one_by_one(toy_small, tmp_path):
    """A lent GPU's stage is cut at its limit (the capture and profile stages were, 2026-11-30): benchmark_models.py
    writes --json after every row, so the rows measured before the cut come back. One real row, on the toy world,
    through run_all alone (main writes the file once more at its end)."""
    import json

    out = tmp_path / "rows.json"
    argv = ["--configs", "toy/point_pillar_early_fusion", "--batch-sizes", "1", "--repeats", "1", "--precisions",
            "fp32", "--data", str(toy_small), "--json", str(out)]
    rows = benchmark_models.run_all(benchmark_models.parse_args(argv), argv)
    assert len(rows) == 1 and json.loads(out.read_text()) == rows
    assert benchmark_models.format_row(rows[0], benchmark_models.parse_args(argv)).count(" | ") == 7
