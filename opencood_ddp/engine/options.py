"""The run options: the command line, parsed once into frozen dataclasses that the engine takes unchanged (never
argparse's Namespace, never a copy). A field's name is its flag's ``dest`` and its type's choices are the flag's
choices, so that adding a flag is three edits: its ``add_argument`` in the group of its dataclass, its field, and
its use. The flags are declared here only: a tool that takes training flags builds its parser on
``training_flags(...)`` (argparse's ``parents=``; one more word, the dest, per tool that takes the new flag) and
passes them on to the runs it starts with ``train_argv``, so a flag means the same in every tool. Programs that
call the engine (benchmarks, checks) build the dataclasses directly or read them with ``train_options_of``.

- ``ProcessOptions``: what every process needs for its group and its data loaders (``add_process_arguments``).
- ``TrainOptions``: tools/train_ddp.py (``train_parser``), in four groups: ``run`` (which run: folder, hypes,
  what a resume may accept; engine/run_dir.py decides with it), ``batch`` (the batch plan), ``loop`` (how the
  fit loop trains; the Trainer reads it) and ``process`` (the process group and the data loaders).
- ``EvalOptions``: tools/inference_ddp.py (``eval_parser``), with the task's own typed options in ``task``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Protocol, Sequence, Union

from opencood_ddp.distributed.batch_plan import LR_SCALINGS, SEMANTICS, LrScaling, Semantics
from opencood_ddp.distributed.samplers import BATCH_ORDERS, BatchOrder
from opencood_ddp.engine.capture import CAPTURE_MODES, CaptureMode
from opencood_ddp.engine.step import HALF_MODES, HalfMode
from opencood_ddp.engine.step_guard import NONFINITE_POLICIES, NonfinitePolicy
from opencood_ddp.hypes import RANDOM_STATE_SEEDS


@dataclass(frozen=True)
class ProcessOptions:
    """Process group and data loading, shared by training and evaluation."""

    num_workers: Optional[int] = None  # DataLoader workers per process; None: engine/loaders.workers_per_rank's rule
    dist_timeout: float = 30.0  # minutes a collective waits for a stalled or dead peer
    dist_backend: Optional[Literal["nccl", "gloo"]] = None  # None: nccl on CUDA, gloo on CPU
    local_rank: Optional[int] = None  # torch.distributed.launch's flag; torchrun sets LOCAL_RANK instead


@dataclass(frozen=True)
class RunOptions:
    """Which run: where it lives, where its hypes come from, what its resume may accept."""

    hypes_yaml: Optional[str] = None
    model_dir: Optional[str] = None  # upstream's flag for the run folder
    overrides: tuple[str, ...] = ()  # --set KEY.SUB=VALUE, in order
    log_root: str = "logs"
    restart: bool = False
    allow_config_change: bool = False


@dataclass(frozen=True)
class BatchOptions:
    """How the hypes' batch_size is split over the processes (distributed/batch_plan.py)."""

    per_gpu_batch: Union[int, Literal["auto"], None] = None  # None: no cap
    per_gpu_mem_gib: Optional[float] = None
    batch_semantics: Semantics = "global"
    scale_lr: LrScaling = "none"


@dataclass(frozen=True)
class LoopOptions:
    """How the fit loop trains (engine/trainer.py reads these as they are)."""

    half: Optional[HalfMode] = None  # None: float32
    seed: Optional[int] = None  # None: train_params.seed of the hypes, else 0
    sync_bn: bool = True  # --no_sync_bn clears it
    max_steps: Optional[int] = None
    batch_order: BatchOrder = "sampled"
    deterministic: bool = False
    tf32: bool = True  # torch's default: cuDNN's float32 convolutions may use TF32 on Ampere and later; --no_tf32
    on_nonfinite: NonfinitePolicy = "stop"
    max_skips_in_a_row: int = 10
    max_skip_share: float = 0.1
    eval_after_training: bool = False
    capture: Optional[CaptureMode] = None  # None: the eager step (engine/capture.py)


@dataclass(frozen=True)
class TrainOptions:
    """tools/train_ddp.py's flags; the help texts of `train_parser` say what each does."""

    run: RunOptions = field(default_factory=RunOptions)
    batch: BatchOptions = field(default_factory=BatchOptions)
    loop: LoopOptions = field(default_factory=LoopOptions)
    process: ProcessOptions = field(default_factory=ProcessOptions)


@dataclass(frozen=True)
class EvalOptions:
    """tools/inference_ddp.py's engine flags; ``task`` holds the task's own options (its ``TaskOptions`` class)."""

    model_dir: str
    dataset_dir: Optional[str] = None  # None: validate_dir of the run's config.yaml
    epoch: Optional[int] = None  # None: the last net_epoch{N}.pth
    bestval: bool = False
    batch_size: int = 1  # samples per forward pass on each process
    process: ProcessOptions = field(default_factory=ProcessOptions)
    task: Any = None  # None: the task's defaults


class TaskOptions(Protocol):
    """What a task's own evaluation options class offers the parser: its flags (dest = field name)."""

    @classmethod
    def add_arguments(cls, parser: Any) -> None: ...


def from_flags(cls: type, parsed: argparse.Namespace, **given: Any) -> Any:
    """An options dataclass from parsed flags: each field from the flag of its name, a field whose type is an
    options dataclass from its own fields' flags, lists as tuples (the dataclasses are frozen); ``given`` wins."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for item in dataclasses.fields(cls):
        if item.name in values:
            continue
        if dataclasses.is_dataclass(hints.get(item.name)):
            values[item.name] = from_flags(hints[item.name], parsed)
            continue
        value = getattr(parsed, item.name)
        values[item.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


# ------------------------------------------------------------------------------------------------ parsers
def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ProcessOptions``, one help text for both entry points."""
    parser.add_argument("--num_workers", type=worker_count, default=ProcessOptions.num_workers,
                        help="DataLoader workers per process (default: 2 on the CPU; on a GPU, the rank's share of "
                             "the cores less one, at most 8)")
    parser.add_argument("--dist_timeout", type=timeout_minutes, default=ProcessOptions.dist_timeout,
                        help="minutes a collective waits for a stalled or dead peer before every waiting rank "
                             "fails with a message naming the ranks behind")
    parser.add_argument("--dist_backend", choices=("nccl", "gloo"), help="default: nccl on CUDA, gloo on CPU")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int,
                        help="set by torch.distributed.launch; torchrun uses LOCAL_RANK instead")


def _parsed(text: str, convert: Callable[[str], Any], kind: str) -> Any:
    """``convert(text)``, or argparse's one-line error saying the flag wants ``kind``."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None


def worker_count(text: str) -> int:
    """--num_workers: 0 (load in the process itself) or more; DataLoader would fail later with a traceback."""
    value = _parsed(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; 0 loads in the process itself")
    return value


def timeout_minutes(text: str) -> float:
    """--dist_timeout: a positive, finite number of minutes; 0 or less fails the first rendezvous with a socket
    traceback, inf or nan in torch's timedelta."""
    value = _parsed(text, float, "a number of minutes")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of minutes (default "
                                         f"{ProcessOptions.dist_timeout:g})")
    return value


def seed_value(text: str) -> int:
    """--seed: an integer numpy's legacy seed takes (seed_everything sets it), as train_params.seed."""
    value = _parsed(text, int, "a whole number")
    if not 0 <= value < RANDOM_STATE_SEEDS:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**32), the seeds numpy takes")
    return value


def memory_gib(text: str) -> float:
    """--per_gpu_mem_gib: a positive, finite number of GiB; 0 or less measured for seconds, then found no plan."""
    value = _parsed(text, float, "a number of GiB")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of GiB")
    return value


def skip_count(text: str) -> int:
    """--max_skips_in_a_row: 0 (stop at the first skipped step) or more; a negative count was taken as given."""
    value = _parsed(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; 0 stops at the first skipped step")
    return value


def skip_share(text: str) -> float:
    """--max_skip_share: a share of an epoch's steps, in [0, 1]; 1.5 could never be reached."""
    value = _parsed(text, float, "a number")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share of an epoch's steps in [0, 1]")
    return value


def per_gpu_batch_value(text: str) -> Union[int, str]:
    """--per_gpu_batch: a positive integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'auto'") from None


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train an OpenCOOD-schema model on 1..N processes (DDP).")
    add_run_arguments(parser.add_argument_group("run"))
    add_batch_arguments(parser.add_argument_group("batch"))
    add_loop_arguments(parser.add_argument_group("training loop"))
    add_process_arguments(parser.add_argument_group("process"))
    return parser


def add_run_arguments(parser: Any) -> None:
    """The flags of ``RunOptions``."""
    parser.add_argument("--hypes_yaml", help="hypes YAML of a new run (ignored when --model_dir is a run)")
    parser.add_argument("--model_dir", help="existing run folder to resume, or a new folder for this run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.SUB=VALUE",
                        help="override a hypes value (YAML-typed); repeatable")
    parser.add_argument("--log_root", default=RunOptions.log_root,
                        help="parent of new run folders without --model_dir")
    parser.add_argument("--restart", action="store_true",
                        help="train an existing run folder that has a history but no checkpoint that loads from the "
                             "start (its train_steps.csv is replaced); without this flag such a folder is refused. "
                             "A folder with a checkpoint that loads resumes from it either way")
    parser.add_argument("--allow_config_change", action="store_true",
                        help="resume although a model or data section of config.yaml (or a --set) differs from "
                             "what the checkpoint was trained with (refused otherwise)")


def add_batch_arguments(parser: Any) -> None:
    """The flags of ``BatchOptions``."""
    parser.add_argument("--per_gpu_batch", type=per_gpu_batch_value,
                        help="cap the per-process batch; the rest becomes gradient accumulation. 'auto': measure a "
                             "step's memory at per-process batch 1, 2, 4 on this device and take the largest that "
                             "fits (tools/plan_batch.py's plan); nothing else of the run changes")
    parser.add_argument("--per_gpu_mem_gib", type=memory_gib,
                        help="with --per_gpu_batch auto: memory one process may use, GiB (default: the GPU's share, "
                             "or on the CPU the available memory shared by this node's processes; 10%% kept free)")
    parser.add_argument("--batch_semantics", choices=SEMANTICS, default=BatchOptions.batch_semantics,
                        help="global: batch_size is the effective batch (default); per_gpu: upstream behaviour")
    parser.add_argument("--scale_lr", choices=LR_SCALINGS, default=BatchOptions.scale_lr,
                        help="lr scaling with per_gpu semantics")


def add_loop_arguments(parser: Any) -> None:
    """The flags of ``LoopOptions``."""
    parser.add_argument("--half", nargs="?", const="auto", choices=HALF_MODES, metavar="{fp16,bf16}",
                        help="mixed precision: fp16 with a GradScaler, or bf16; a bare --half is fp16 on CUDA and bf16 "
                             "on the CPU")
    parser.add_argument("--seed", type=seed_value, help="default: train_params.seed of the hypes, else 0")
    parser.add_argument("--no_sync_bn", dest="sync_bn", action="store_false",
                        help="keep per-rank BatchNorm statistics")
    parser.add_argument("--max_steps", type=int, help="end the run after this many optimizer steps and save "
                                                       "net_step{K}.pth (a smoke test or a parity check)")
    parser.add_argument("--batch_order", choices=BATCH_ORDERS, default=LoopOptions.batch_order,
                        help="feed each batch's samples reversed, or rotated by one: the same training in exact "
                             "arithmetic, another float summation order (the noise floor of tools/parity_check.py)")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms: CUDA kernels without atomics, so that a GPU run "
                             "repeats bit for bit (slower; an op with no such kernel stops the run and names it). "
                             "with --no_tf32, a GPU run's noise floor is the float32 one (tools/parity_check.py)")
    parser.add_argument("--no_tf32", dest="tf32", action="store_false",
                        help="float32 convolutions and matrix products in IEEE float32 on Ampere and later GPUs: "
                             "torch lets cuDNN's convolutions round to TF32 (10-bit mantissa) by default")
    parser.add_argument("--on_nonfinite", choices=NONFINITE_POLICIES, default=LoopOptions.on_nonfinite,
                        help="a non-finite loss or gradient on any rank: stop (save the state before the step, "
                             "exit 3) or skip the step on every rank")
    parser.add_argument("--max_skips_in_a_row", type=skip_count, default=LoopOptions.max_skips_in_a_row,
                        help="with --on_nonfinite skip: stop (as 'stop' does) after more consecutive skipped steps")
    parser.add_argument("--max_skip_share", type=skip_share, default=LoopOptions.max_skip_share,
                        help="with --on_nonfinite skip: stop when a larger share of an epoch's steps was skipped")
    parser.add_argument("--eval_after_training", action="store_true",
                        help="evaluate the last checkpoint on the test split (test_dir, else validate_dir) on all "
                             "ranks; writes eval.yaml into the run folder")
    parser.add_argument("--capture", choices=CAPTURE_MODES,
                        help="compile the static-shape part of the step (backbone, fusion, heads, loss) with "
                             "torch.compile: 'compile' is inductor (CUDA graphs on CUDA), 'cudagraphs' the eager "
                             "kernels replayed as CUDA graphs (on the CPU, as aot_eager), 'aot_eager' the traced "
                             "graphs with eager kernels (bit for bit the eager step). On the CPU the step takes "
                             "the kernels CUDA takes. Every model of the zoo; with or without --half")


def eval_parser(task_options: Optional[type] = None) -> argparse.ArgumentParser:
    """The engine's evaluation flags; ``task_options`` (a ``TaskOptions`` class) adds the task's own."""
    parser = argparse.ArgumentParser(description="Evaluate a trained run on 1..N processes; the metrics equal a "
                                                 "1-process run's.")
    parser.add_argument("--model_dir", required=True, help="run folder with config.yaml and net_epoch*.pth")
    parser.add_argument("--dataset_dir", help="split to evaluate (default: validate_dir of config.yaml)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--epoch", type=int, help="evaluate net_epoch{N}.pth (default: the last)")
    which.add_argument("--bestval", action="store_true", help="evaluate net_epoch_bestval_at{N}.pth")
    parser.add_argument("--batch_size", type=int, default=EvalOptions.batch_size,
                        help="samples per forward pass on each process")
    add_process_arguments(parser.add_argument_group("process"))
    if task_options is not None:
        task_options.add_arguments(parser.add_argument_group("task options"))
    return parser


def parse_train_options(argv: Optional[Sequence[str]]) -> TrainOptions:
    return from_flags(TrainOptions, train_parser().parse_args(argv))


def parse_eval_options(argv: Optional[Sequence[str]], task_options: Optional[type] = None) -> EvalOptions:
    parsed = eval_parser(task_options).parse_args(argv)
    task = from_flags(task_options, parsed) if task_options is not None else None
    return from_flags(EvalOptions, parsed, task=task)


# ------------------------------------------------------------------------------------------------ tools
def training_flags(*dests: str, required: Sequence[str] = ()) -> argparse.ArgumentParser:
    """A parent parser (``argparse.ArgumentParser(parents=[...])``) holding the training flags of the given dests,
    in their groups: the very actions `train_parser` declares (same option strings, type, choices, default,
    help), so that a tool cannot give a training flag another meaning. ``required``: dests the tool cannot do
    without (a tool's runs need --hypes_yaml; training alone may resume a --model_dir instead)."""
    full = train_parser()
    unknown = ({*dests, *required} - {action.dest for action in full._actions}) | (set(required) - set(dests))
    if unknown:
        raise ValueError(f"not among the training flags asked for: {', '.join(sorted(unknown))}")
    parent = argparse.ArgumentParser(add_help=False)
    # argparse offers no public way to take some of a parser's actions; parents= itself shares the action
    # objects as _add_action does here. `full` is this call's own, so setting `required` changes no other parser.
    for group in full._action_groups:
        chosen = [action for action in group._group_actions if action.dest in dests]
        target = parent.add_argument_group(f"training flags: {group.title}") if chosen else None
        for action in chosen:
            action.required = action.dest in required
            target._add_action(action)
    return parent


def train_options_of(parsed: argparse.Namespace) -> TrainOptions:
    """The TrainOptions of a tool's parsed flags: the training flags it took (`training_flags`), the training
    defaults for the others; the tool's own flags are ignored."""
    defaults = vars(train_parser().parse_args([]))
    return from_flags(TrainOptions, argparse.Namespace(**{**defaults, **vars(parsed)}))


def train_argv(options: TrainOptions) -> list[str]:
    """The tools/train_ddp.py flags that parse back into `options` (parse_train_options(train_argv(o)) == o): each
    flag whose value is not its default, in train_parser's order. How a tool passes training flags on."""
    groups = [getattr(options, group.name) for group in dataclasses.fields(options)]
    values = {item.name: getattr(group, item.name) for group in groups for item in dataclasses.fields(group)}
    argv: list[str] = []
    for action in train_parser()._actions:
        default = tuple(action.default) if isinstance(action.default, list) else action.default
        if action.dest in values and values[action.dest] != default:
            argv += flag_words(action, values[action.dest])
    return argv


def flag_words(action: argparse.Action, value: Any) -> list[str]:
    """The words that give `action`'s dest `value` (not its default)."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch (store_true, store_false): not its default, so set
        return [flag]
    if isinstance(value, tuple):  # an appended flag (--set): once per value, in order
        return [word for item in value for word in (flag, str(item))]
    if action.nargs == "?" and value == action.const:  # a bare --half is "auto"
        return [flag]
    return [flag, str(value)]
