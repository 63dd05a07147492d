"""Task builders: hypes -> Task (datasets, model, step). The engine receives one through `build_task`.

`task:` at the top of the hypes picks the builder: a built-in name, or `package.module:function` for a
task defined elsewhere (an installed upstream opencood, say). Absent, it is the OpenCOOD perception task.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from opencood_ddp.engine.task import Task
from opencood_ddp.errors import ConfigError

BUILTIN_TASKS = {
    "opencood": "opencood_ddp.tasks.opencood:build_task",
    "synthetic": "opencood_ddp.tasks.synthetic:build_task",
}


def build_task(hypes: dict, for_training: bool) -> Task:
    return _builder(hypes)(hypes, for_training)


def build_eval(hypes: dict, options: Any) -> Any:
    """The task's evaluation spec: the function ``build_eval`` beside its ``build_task``."""
    builder = _builder(hypes)
    module = importlib.import_module(builder.__module__)
    if not hasattr(module, "build_eval"):
        raise ConfigError(f"task {hypes.get('task', 'opencood')!r} has no build_eval in {module.__name__}; "
                          f"it cannot be evaluated: add one there, or drop --eval_after_training")
    return module.build_eval(hypes, options)


def _builder(hypes: dict) -> Callable[[dict, bool], Task]:
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
