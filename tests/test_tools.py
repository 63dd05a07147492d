"""tools/ by purpose: every command the README, the docs and the Makefile name exists and answers --help, and every
script is listed in tools/README.md. The --help runs go through the tools' own entry (`python tool.py`, in this
process: `in_process`)."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from launch import REPO, explain, in_process

sys.path.insert(0, str(REPO / "tools" / "benchmarks"))
from benchmark_vs_upstream import op_times, profiled_step, shared_work_ms  # noqa: E402

DOCUMENTS = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").glob("*.md"))]
# A path that starts at the repository's tools/ (not upstream's opencood/tools/...).
TOOL_PATH = re.compile(r"(?<![\w/.])tools/[\w/]+\.py")
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tools").rglob("*.py"))


def _documented() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for document in DOCUMENTS:
        for path in TOOL_PATH.findall(document.read_text()):
            found.setdefault(path, []).append(document.name)
    return found


def test_every_documented_command_exists():
    missing = {path: where for path, where in _documented().items() if not (REPO / path).is_file()}
    assert not missing, f"commands named in the docs that are not in tools/: {missing}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tool_answers_help(script):
    result = in_process(REPO / script, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage:"), explain(result)


def test_tools_readme_lists_every_script_once_in_its_folder():
    readme = (REPO / "tools" / "README.md").read_text()
    sections = dict(re.findall(r"^## (\S+)[^\n]*\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S))
    listed = {f"tools/{'' if folder == 'Entry' else folder}{name}"
              for folder, body in sections.items() for name in re.findall(r"^\| `([\w.]+\.py)` \|", body, re.M)}
    assert listed == set(SCRIPTS)


def test_the_documented_commands_cover_the_entry_points():
    """The README's and docs' commands name every entry point at the top of tools/."""
    top = {s for s in SCRIPTS if s.count("/") == 1}
    assert top <= set(_documented()), top - set(_documented())


def test_the_shared_work_ceiling_counts_only_what_upstream_also_runs():
    """benchmark_vs_upstream's second ceiling: our ms in the groups of the same op on inputs of the same sizes that
    upstream's step also has, for at most upstream's number of calls; our BatchNorm function is torch's batch norm
    on as many elements."""
    ours = [("aten::mkldnn_convolution", [[2, 64, 8, 8], [64, 64, 3, 3]], 10.0, 2),
            ("BatchNormFunction", [[256, 64], [64], [64], [], []], 4.0, 2),  # (pillars x points, C) rows
            ("aten::copy_", [[5], [5], []], 3.0, 3),
            ("aten::fill_", [[7], []], 6.0, 1),  # upstream fills nothing of this size
            ("aten::add_", [[2, 3], [2, 3], []], 1.0, 1)]  # upstream adds a (3, 2)
    theirs = [("aten::mkldnn_convolution", [[2, 64, 8, 8], [64, 64, 3, 3]], 12.0, 2),
              ("aten::native_batch_norm", [[8, 64, 32], [64], [64], [], [], []], 5.0, 1),  # (pillars, C, points)
              ("aten::copy_", [[5], [5], []], 1.0, 1),
              ("aten::add_", [[3, 2], [3, 2], []], 1.0, 1)]
    # 10 (both convolutions) + 4 * 1/2 (one of our two norms) + 3 * 1/3 (one of our three copies) + 1; no fill.
    assert shared_work_ms(ours, theirs) == (14.0, {"BatchNormFunction": 2.0, "aten::copy_": 1.0, "aten::add_": 1.0})


def test_the_profile_reader_agrees_with_torchs_key_averages():
    """benchmark_vs_upstream reads the profiler's raw events itself (key_averages' Python objects outgrew the
    machine on SECOND): on a training step with nested ops of one name (sum in sum), the optimizer's own ranges
    and a backward, every (op, shapes) group, its calls, self time and total time are torch's own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(2, 3, 8, 8)
    prof = profiled_step(model, optimizer, lambda: model(x).sum() + sum(p.sum() for p in model.parameters()))
    theirs = {(event.key, tuple(tuple(shape) for shape in event.input_shapes)):
              (event.self_cpu_time_total, event.cpu_time_total, event.count)
              for event in prof.key_averages(group_by_input_shape=True)}
    ours = op_times(prof)
    assert set(ours) == set(theirs)
    assert any(name == "aten::sum" for name, _shapes in ours) and any(n.startswith("step::") for n, _s in ours)
    for key, (self_ns, total_ns, calls) in ours.items():
        self_us, total_us, count = theirs[key]
        # torch keeps microseconds as floats of the same nanoseconds
        assert calls == count and abs(self_ns / 1e3 - self_us) < 1e-3 and abs(total_ns / 1e3 - total_us) < 1e-3, key
