"""The options are declared once (engine/options.py): every flag is a field of its group's dataclass and every
field a flag, a fixed choice's flag offers exactly its type's values, and the parsed value reaches the engine
unchanged (no copy into another settings class)."""
from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from opencood_ddp.engine.options import (BatchOptions, EvalOptions, ProcessOptions, LoopOptions, RunOptions,
                                         TrainOptions, eval_parser, parse_eval_options, parse_train_options,
                                         train_parser)

GROUPS = {"run": RunOptions, "batch": BatchOptions, "training loop": LoopOptions, "process": ProcessOptions}


def _dests(parser, title=None):
    groups = [g for g in parser._action_groups if title is None or g.title == title]
    return {a.dest for g in groups for a in g._group_actions if a.dest != "help"}


@pytest.mark.parametrize("title, cls", GROUPS.items())
def test_every_flag_is_a_field_of_its_group_and_every_field_a_flag(title, cls):
    assert _dests(train_parser(), title) == {f.name for f in dataclasses.fields(cls)}


def test_train_options_hold_the_groups_and_nothing_else():
    assert {f.name: f.default_factory for f in dataclasses.fields(TrainOptions)} == {
        "run": RunOptions, "batch": BatchOptions, "loop": LoopOptions, "process": ProcessOptions}


def test_eval_flags_are_eval_options_fields():
    fields = {f.name for f in dataclasses.fields(EvalOptions)} - {"process", "task"}
    assert _dests(eval_parser()) == fields | {f.name for f in dataclasses.fields(ProcessOptions)}


def _literal_values(cls, name):
    hint = typing.get_type_hints(cls)[name]
    values = set()
    for arg in (hint,) if typing.get_origin(hint) is typing.Literal else typing.get_args(hint):
        if typing.get_origin(arg) is typing.Literal:
            values |= set(typing.get_args(arg))
    return values


@pytest.mark.parametrize("cls, name", [(BatchOptions, "batch_semantics"), (BatchOptions, "scale_lr"),
                                       (LoopOptions, "half"), (LoopOptions, "on_nonfinite"),
                                       (ProcessOptions, "dist_backend")])
def test_a_fixed_choice_is_typed_and_the_flag_offers_its_values(cls, name):
    action = next(a for a in train_parser()._actions if a.dest == name)
    assert set(action.choices) == _literal_values(cls, name)


def test_flags_reach_their_groups_as_parsed():
    options = parse_train_options([
        "--hypes_yaml", "h.yaml", "--set", "a=1", "--set", "b.c=2", "--per_gpu_batch", "auto", "--scale_lr", "sqrt",
        "--half", "bf16", "--no_sync_bn", "--on_nonfinite", "skip", "--num_workers", "0", "--restart"])
    assert options.run == RunOptions(hypes_yaml="h.yaml", overrides=("a=1", "b.c=2"), restart=True)
    assert options.batch == BatchOptions(per_gpu_batch="auto", scale_lr="sqrt")
    assert options.loop == LoopOptions(half="bf16", sync_bn=False, on_nonfinite="skip")
    assert options.process == ProcessOptions(num_workers=0)
    assert parse_train_options(["--half"]).loop.half == "auto"
    assert parse_train_options([]) == TrainOptions()


def test_kernel_flags_hold_for_the_run_and_are_restored_after_it(monkeypatch):
    """--deterministic and --no_tf32 change torch's process-wide settings for one run only: gpu_check trains many
    runs in one process, and a later run with neither flag must get torch's defaults back, also after a failure."""
    import torch

    from opencood_ddp.engine.train import IEEE_FLAGS, kernel_settings, tf32_flags

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), tf32_flags())
    loop = parse_train_options(["--hypes_yaml", "x.yaml", "--deterministic", "--no_tf32"]).loop
    assert loop.deterministic and not loop.tf32
    with pytest.raises(RuntimeError, match="inside"):
        with kernel_settings(loop):
            assert torch.are_deterministic_algorithms_enabled()
            assert tf32_flags() == IEEE_FLAGS  # ('ieee', 'ieee') on torch >= 2.9, else both allow_tf32 False
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before cuBLAS's first handle
            raise RuntimeError("inside")
    assert (torch.are_deterministic_algorithms_enabled(), tf32_flags()) == before
    with kernel_settings(LoopOptions()):
        assert (torch.are_deterministic_algorithms_enabled(), tf32_flags()) == before


@pytest.mark.parametrize("value,fragment", [("-1", "-1 is outside [0, 2**32), the seeds numpy takes"),
                                            ("4294967296", "4294967296 is outside [0, 2**32)"),
                                            ("x", "'x' is not a whole number")])
def test_a_seed_numpy_refuses_is_one_argparse_line(value, fragment, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_train_options(["--model_dir", "run", "--seed", value])
    assert stopped.value.code == 2 and f"argument --seed: {fragment}" in capsys.readouterr().err
    assert parse_train_options(["--model_dir", "run", "--seed", str(2 ** 32 - 1)]).loop.seed == 2 ** 32 - 1


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_a_dist_timeout_that_cannot_wait_is_one_argparse_line(value, capsys):
    """0 or less failed the first rendezvous with socket tracebacks on every rank (a 0 ms client timeout)."""
    for parse in (parse_train_options, parse_eval_options):
        with pytest.raises(SystemExit) as stopped:
            parse(["--model_dir", "run", "--dist_timeout", value])
        assert stopped.value.code == 2
        assert "argument --dist_timeout: " in capsys.readouterr().err
    assert parse_train_options(["--model_dir", "run", "--dist_timeout", "0.5"]).process.dist_timeout == 0.5


@pytest.mark.parametrize("value,fragment", [("-1", "-1 is negative; 0 loads in the process itself"),
                                            ("two", "'two' is not a whole number")])
def test_a_bad_worker_count_is_one_argparse_line(value, fragment, capsys):
    for parse in (parse_train_options, parse_eval_options):
        with pytest.raises(SystemExit) as stopped:
            parse(["--model_dir", "run", "--num_workers", value])
        assert stopped.value.code == 2
        assert f"argument --num_workers: {fragment}" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, fragment", [
    # each was taken as given: a negative count and an unreachable share never stopped a run; 0 or -1 GiB
    # measured for seconds and then found no plan
    ("--max_skips_in_a_row", "-1", "-1 is negative; 0 stops at the first skipped step"),
    ("--max_skip_share", "1.5", "1.5 is not a share of an epoch's steps in [0, 1]"),
    ("--per_gpu_mem_gib", "0", "0 must be a positive, finite number of GiB"),
    ("--per_gpu_mem_gib", "-1", "-1 must be a positive, finite number of GiB"),
])
def test_a_bound_the_loop_or_the_planner_cannot_use_is_one_argparse_line(flag, value, fragment, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_train_options(["--model_dir", "run", flag, value])
    assert stopped.value.code == 2 and f"argument {flag}: {fragment}" in capsys.readouterr().err
    options = parse_train_options(["--model_dir", "run", "--max_skips_in_a_row", "0", "--max_skip_share", "1",
                                   "--per_gpu_mem_gib", "0.5"])
    assert (options.loop.max_skips_in_a_row, options.loop.max_skip_share, options.batch.per_gpu_mem_gib) == (0, 1, 0.5)
