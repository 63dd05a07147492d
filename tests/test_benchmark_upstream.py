"""tools/benchmarks/benchmark_models.py --upstream: upstream's step timed in turns with ours, on the row's device.

Upstream's code is not a test's reference (its figures come from a checkout on a machine that has one, docs/
benchmarks.md). What is tested here is the tool's own work: a checkout is read the way upstream's train_utils reads
its classes, our weights go into its model, and its train.py's step runs in turns with our eager and captured steps,
whose medians make the ratios (engine/census.seconds_in_turns, tests/test_step_census.py). The checkout is a
stand-in written here, in upstream's layout, whose classes are ours under upstream's names: so the two sides are one
computation, and what differs is only the tool's handling."""
import json
import textwrap

import pytest

from launch import REPO, explain, python

CONFIG = "toy/point_pillar_intermediate_fusion"  # model point_pillar_intermediate, loss point_pillar_loss
MODEL = """\
    from opencood_ddp.models.point_pillar import PointPillarIntermediate as _Ours


    class PointPillarIntermediate(_Ours):
        \"\"\"Ours under upstream's name: upstream's create_model picks the class named like the core_method.\"\"\"
"""
LOSS = """\
    import torch

    from opencood_ddp.loss.point_pillar_loss import build_point_pillar_loss


    class PointPillarLoss(torch.nn.Module):
        \"\"\"Upstream's interface (args; output and label dicts -> the total loss) over ours.\"\"\"

        def __init__(self, args):
            super().__init__()
            self.ours = build_point_pillar_loss(args)

        def forward(self, output_dict, label_dict):
            return self.ours(output_dict, label_dict).total
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream_stand_in")
    for package, module, text in (("models", "point_pillar_intermediate", MODEL), ("loss", "point_pillar_loss", LOSS)):
        folder = root / "opencood" / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / f"{module}.py").write_text(textwrap.dedent(text))
    (root / "opencood" / "__init__.py").write_text("")
    return root


@pytest.mark.slow
def test_upstream_step_is_timed_in_turns_with_the_eager_and_captured_steps(stand_in, toy_small, tmp_path):
    out = tmp_path / "rows.json"
    result = python(REPO / "tools" / "benchmarks" / "benchmark_models.py", "--configs", CONFIG, "--batch-sizes", "1",
                    "--repeats", "3", "--device", "cpu", "--data", toy_small, "--upstream", stand_in,
                    "--capture", "aot_eager", "--json", out, timeout=600)
    assert result.returncode == 0, explain(result)
    (row,) = json.loads(out.read_text())
    upstream = row["upstream"]
    assert upstream["weights"] == "same", upstream  # every name and shape: our weights went in strictly
    seconds = upstream["seconds_in_turns"]
    assert set(seconds) == {"ours", "captured", "upstream"} and all(s > 0 for s in seconds.values())
    assert upstream["step_s"] == seconds["upstream"]
    assert upstream["over_ours"] == seconds["upstream"] / seconds["ours"]
    assert upstream["over_captured"] == seconds["upstream"] / seconds["captured"]
    capture = row["capture"]  # the same rounds gave the capture's speed-up: no second set of steps
    assert (capture["eager_in_turns_s"], capture["step_s"]) == (seconds["ours"], seconds["captured"])
    assert capture["speedup"] == seconds["ours"] / seconds["captured"] and capture["cudagraph_skips"] == 0
    assert "ops" not in upstream  # counted only with --count
    header, _, line = result.stdout.split("| config |", 1)[1].splitlines()[:3]
    assert "upstream ÷ ours" in header and "upstream ÷ captured" in header
    assert f"{upstream['over_ours']:.2f} | {upstream['over_captured']:.2f} |" in line


@pytest.mark.slow
def test_an_upstream_class_that_does_not_take_our_weights_is_reported_in_its_cell(tmp_path, toy_small):
    """A checkout whose model lacks a weight of ours: the row stands, the cell names what broke."""
    folder = tmp_path / "opencood" / "models"
    folder.mkdir(parents=True)
    (tmp_path / "opencood" / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    (folder / "point_pillar_intermediate.py").write_text(
        "import torch\n\n\nclass PointPillarIntermediate(torch.nn.Linear):\n"
        "    def __init__(self, args):\n        super().__init__(2, 2)\n")
    out = tmp_path / "rows.json"
    result = python(REPO / "tools" / "benchmarks" / "benchmark_models.py", "--configs", CONFIG, "--batch-sizes", "1",
                    "--repeats", "1", "--device", "cpu", "--data", toy_small, "--upstream", tmp_path,
                    "--json", out, timeout=600)
    assert result.returncode == 0, explain(result)
    (row,) = json.loads(out.read_text())
    assert row["step_s"] > 0 and set(row["upstream"]) == {"error"}
    assert "has no opencood/loss/point_pillar_loss.py" in row["upstream"]["error"]
