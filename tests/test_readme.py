"""Every command in README.md's code blocks is one the tools accept, and every tool it names is run for real.

A README command that drifted from a tool's flags fails here: each `python tools/X.py ...`, `torchrun ...
tools/X.py ...` or `srun ... python tools/X.py ...` line is parsed by that tool's own argparse parser. Each tool
the README names must be run by a test (its file name appears in tests/) or be `make demo`'s script.
"""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from launch import REPO, load_tool

README = REPO / "README.md"
# The engine's parsers behind the two entry points (the tools' files only call them).
ENGINE_PARSERS = {"train_ddp.py": "opencood_ddp.engine.options"}  # tool -> module with its parser


def code_block_commands(text: str) -> list[str]:
    """Commands in ```bash blocks, with backslash continuations joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def tool_invocation(command: str) -> tuple[str, list[str]] | None:
    """(the tool's path under tools/, its arguments) for a command that runs tools/[folder/]X.py, else None."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word.startswith("tools/") and word.endswith(".py"):
            return word[len("tools/"):], words[i + 1:]
    return None


def parse_with_tool(tool: str, args: list[str]) -> None:
    """Parse `args` as the tool would; argparse exits (SystemExit) on an unknown flag or a bad value."""
    if tool in ENGINE_PARSERS:
        module = importlib.import_module(ENGINE_PARSERS[tool])
    else:
        module = load_tool(tool)
    if hasattr(module, "train_parser"):
        module.train_parser().parse_args(args)
    elif hasattr(module, "build_parser"):
        module.build_parser().parse_args(args)
    else:
        module.parse_args(args)


COMMANDS = code_block_commands(README.read_text())
TOOL_COMMANDS = [c for c in COMMANDS if tool_invocation(c)]


def test_readme_starts_with_the_two_set_up_commands():
    assert COMMANDS[:2] == ["make demo", "make test"]
    targets = re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), flags=re.M)
    assert {"demo", "test", "venv"} <= set(targets)


def test_every_make_target_the_readme_runs_is_the_makefiles():
    targets = set(re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), flags=re.M))
    named = {shlex.split(c)[1] for c in COMMANDS if shlex.split(c)[0] == "make"}
    assert {"demo", "test", "gpu-check", "test-gpu-torch"} <= named
    assert named <= targets, f"README.md runs make targets the Makefile lacks: {sorted(named - targets)}"


def test_readme_shows_every_launcher():
    launchers = {shlex.split(c)[0] for c in TOOL_COMMANDS}
    assert {"python", "torchrun", "srun"} <= launchers
    assert any("--nnodes=2" in c and "--rdzv-backend=c10d" in c for c in TOOL_COMMANDS)


@pytest.mark.parametrize("command", TOOL_COMMANDS,
                         ids=[f"{tool_invocation(c)[0]}-{i}" for i, c in enumerate(TOOL_COMMANDS)])
def test_readme_command_parses_with_its_tool(command):
    tool, args = tool_invocation(command)
    try:
        parse_with_tool(tool, args)
    except SystemExit as exc:
        pytest.fail(f"README command rejected by tools/{tool} (exit {exc.code}): {command}")


@pytest.mark.parametrize("tool", sorted({tool_invocation(c)[0] for c in TOOL_COMMANDS}))
def test_every_readme_tool_is_run_by_a_test(tool):
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py") if p.name != "test_readme.py")
    assert Path(tool).name in tests, f"tools/{tool} appears in README.md but no test runs it"
