"""Training flags are declared once (engine/options.py) and mean the same in every tool that takes them: each
training flag a tool accepts is a TrainOptions field and is train_parser's own action (option strings, nargs,
const, choices, type, default), and what a tool passes on to its runs (train_argv) parses back into the options
it read."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from launch import load_tool
from opencood_ddp.engine.options import (TrainOptions, parse_train_options, train_argv, train_options_of,
                                         train_parser, training_flags)

# The tools whose parsers take training flags, and the function that builds each parser.
TOOLS = {"parity_check.py": "build_parser", "plan_batch.py": "build_parser",
         "benchmarks/benchmark_ddp.py": "build_parser", "benchmarks/benchmark_unused_params.py": "build_parser",
         "benchmarks/count_loop_ops.py": "build_parser"}
MEANING = ("option_strings", "nargs", "const", "choices", "type", "default")


def tool_parser(tool: str) -> argparse.ArgumentParser:
    return getattr(load_tool(tool), TOOLS[tool])()


def train_fields() -> set[str]:
    groups = [group.default_factory for group in dataclasses.fields(TrainOptions)]
    return {item.name for group in groups for item in dataclasses.fields(group)}


def meaning(action: argparse.Action) -> tuple:
    return tuple(getattr(action, name) for name in MEANING)


def training_actions() -> dict[str, argparse.Action]:
    return {action.dest: action for action in train_parser()._actions if action.dest != "help"}


@pytest.mark.parametrize("tool", TOOLS)
def test_every_training_flag_of_a_tool_is_a_field_with_the_training_meaning(tool):
    training = training_actions()
    by_option = {option: action.dest for action in training.values() for option in action.option_strings}
    taken = []
    for action in tool_parser(tool)._actions:
        # A training option string is the training flag's own, never another dest of the tool's.
        assert all(by_option.get(option, action.dest) == action.dest for option in action.option_strings), \
            (tool, action.option_strings)
        if action.dest in training:
            assert action.dest in train_fields(), (tool, action.dest)
            assert meaning(action) == meaning(training[action.dest]), (tool, action.dest)
            taken.append(action.dest)
    assert "hypes_yaml" in taken and "overrides" in taken, tool


def test_the_tools_take_half_and_per_gpu_batch_as_training_does():
    """The issue's two: a tool's --half is fp16|bf16 with a bare --half for "auto", its --per_gpu_batch takes
    'auto'; and both reach the runs as given."""
    parser = tool_parser("parity_check.py")
    for flags, half in ((["--half"], "auto"), (["--half", "bf16"], "bf16"), ([], None)):
        args = parser.parse_args(["--hypes_yaml", "h.yaml", "--per_gpu_batch", "auto", *flags])
        options = train_options_of(args)
        assert (options.loop.half, options.batch.per_gpu_batch) == (half, "auto")
        assert parse_train_options(train_argv(options)) == options


@pytest.mark.parametrize("argv", [
    [],
    ["--hypes_yaml", "h.yaml", "--set", "a=1", "--set", "b.c=x y", "--half", "--per_gpu_batch", "auto"],
    ["--model_dir", "run", "--restart", "--allow_config_change", "--log_root", "elsewhere", "--per_gpu_batch", "2",
     "--per_gpu_mem_gib", "1.5", "--batch_semantics", "per_gpu", "--scale_lr", "sqrt", "--half", "fp16",
     "--seed", "7", "--no_sync_bn", "--max_steps", "3", "--batch_order", "rotated", "--deterministic", "--no_tf32",
     "--on_nonfinite", "skip", "--max_skips_in_a_row", "4", "--max_skip_share", "0.25", "--eval_after_training",
     "--num_workers", "0", "--dist_timeout", "2.5", "--dist_backend", "gloo", "--local_rank", "1"],
])
def test_train_argv_parses_back_into_the_same_options(argv):
    options = parse_train_options(argv)
    assert parse_train_options(train_argv(options)) == options


def test_train_argv_gives_only_what_differs_from_the_defaults():
    assert train_argv(TrainOptions()) == []
    assert train_argv(parse_train_options(["--half", "--seed", "3"])) == ["--half", "--seed", "3"]


def test_a_tool_asks_for_training_flags_by_their_dest():
    with pytest.raises(ValueError, match="halfs"):
        training_flags("halfs")
    with pytest.raises(ValueError, match="hypes_yaml"):
        training_flags("overrides", required=("hypes_yaml",))
    parser = argparse.ArgumentParser(parents=[training_flags("hypes_yaml", required=("hypes_yaml",))])
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert train_parser().parse_args([]).hypes_yaml is None  # required in the tool, not in training
