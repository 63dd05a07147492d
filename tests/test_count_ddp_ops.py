"""tools/benchmarks/count_ddp_ops.py as torchrun starts it: the model alone, in the trainer's DDP build and in DDP's
defaults, eager on 2 gloo ranks and under --capture (the calls left outside the compiled graphs) on one.

What DDP adds is torch's own work, and its figures are in docs/benchmarks.md; what is tested here is the tool's:
every build is counted on every rank, the ranks agree (each takes its own sample through the same graph), each DDP
build's line names exactly the ops by which it differs from the model alone, and under --capture the graphs took
most of the step's calls. engine/census.ops_outside_graphs itself is checked in tests/test_step_census.py."""
import re

import pytest

from launch import REPO, explain, torchrun

TOOL = REPO / "tools" / "benchmarks" / "count_ddp_ops.py"
CONFIG = "toy/point_pillar_intermediate_fusion"
BUILDS = ("no DDP", "trainer (wrap_ddp)", "DDP defaults")
LINE = re.compile(r"^rank (\d) (\S+) (.+?): ([\d,]+) ops[^;]*(?:; over no DDP: (.*))?$")


def counted(stdout: str) -> dict:
    """{(rank, build): (ops, {op: calls more than the model alone})} from the tool's lines."""
    rows = {}
    for match in filter(None, map(LINE.match, stdout.splitlines())):
        rank, config, build, ops, difference = match.groups()
        assert config == CONFIG
        gaps = {}
        for item in (difference or "nothing").split(", "):
            if item != "nothing":
                calls, op = item.split(" ", 1)
                gaps[op] = int(calls.replace(",", ""))
        rows[int(rank), build] = (int(ops.replace(",", "")), gaps)
    return rows


@pytest.mark.slow
def test_every_build_is_counted_on_every_rank_eager_and_outside_the_captured_graphs(toy_small):
    totals = {}
    for capture, ranks in ((None, 2), ("cudagraphs", 1)):  # one rank compiles once: the CPU the suite spends
        result = torchrun(ranks, TOOL, "--data", toy_small, "--configs", CONFIG,
                          *(["--capture", capture] if capture else []), timeout=600)
        assert result.returncode == 0, explain(result)
        rows = counted(result.stdout)
        assert set(rows) == {(rank, build) for rank in range(ranks) for build in BUILDS}, result.stdout
        assert all(rows[rank, build] == rows[0, build] for rank, build in rows), result.stdout
        alone = rows[0, "no DDP"][0]
        for build in BUILDS[1:]:
            ops, gaps = rows[0, build]
            assert gaps and ops - alone == sum(gaps.values()), (build, rows[0, build])  # the line's ops are DDP's
        # the trainer's settings leave DDP less to do than its defaults (docs/benchmarks.md, "What DDP adds")
        assert rows[0, "trainer (wrap_ddp)"][0] < rows[0, "DDP defaults"][0]
        totals[capture] = alone
    assert totals["cudagraphs"] < totals[None] / 1.5, totals  # the model's dense part ran inside the graphs
