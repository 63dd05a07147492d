"""Task builders: hypes -> Task (datasets, model, step). The engine receives one through `build_task`.

`task:` at the top of the hypes picks the builder: a built-in name, or `package.module:function` for a
task defined elsewhere (an installed upstream opencood, say). Absent, it is the OpenCOOD perception task.
Beside its builder, a task module may hold `build_eval(hypes, EvalRequest) -> EvalSpec` (its evaluation) and
`EVAL_OPTIONS` (the class of its evaluation flags, for tools/inference_ddp.py); these are found there.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Mapping, Optional

from opencood_ddp.engine.evaluator import EvalRequest, EvalSpec
from opencood_ddp.engine.task import Task
from opencood_ddp.errors import ConfigError

BUILTIN_TASKS = {
    "opencood": "opencood_ddp.tasks.opencood:build_task",
    "synthetic": "opencood_ddp.tasks.synthetic:build_task",
}


def build_task(hypes: dict, for_training: bool) -> Task:
    return _builder(hypes)(hypes, for_training)


def build_eval(hypes: dict, request: EvalRequest) -> EvalSpec:
    """The task's evaluation: the function ``build_eval`` beside its ``build_task``."""
    module = _task_module(hypes)
    if not hasattr(module, "build_eval"):
        raise ConfigError(f"task {hypes.get('task', 'opencood')!r} has no build_eval in {module.__name__}; "
                          f"it cannot be evaluated: add one there (training: or drop --eval_after_training)")
    return module.build_eval(hypes, request)


def eval_options(hypes: Mapping) -> Optional[type]:
    """The class of the task's evaluation flags (``add_arguments``, dest = field): ``EVAL_OPTIONS`` beside its
    ``build_task``; None for a task without flags of its own."""
    return getattr(_task_module(hypes), "EVAL_OPTIONS", None)


def _task_module(hypes: Mapping) -> ModuleType:
    return importlib.import_module(_builder(hypes).__module__)


def _builder(hypes: Mapping) -> Callable[[dict, bool], Task]:
    name = hypes.get("task", "opencood")
    target = BUILTIN_TASKS.get(name, name)
    module_name, _, function_name = target.partition(":")
    if not function_name:
        raise ConfigError(f"task {name!r} is neither built in ({sorted(BUILTIN_TASKS)}) nor of the form "
                          f"package.module:function; fix the `task` key of the hypes")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ConfigError(f"task {name!r}: module {module_name} is not available; "
                          f"install it or fix the `task` key of the hypes") from None
    return getattr(module, function_name)
