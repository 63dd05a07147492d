#!/usr/bin/env python
"""Evaluate a run on 1..N processes: `torchrun --nproc_per_node=N tools/inference_ddp.py --model_dir DIR
--fusion_method {early,late,intermediate}`; AP@0.3/0.5/0.7 equal to a 1-process run. See README.md.

The engine's flags are engine.options' `eval_parser`; the task of the run's config.yaml adds its own through the
task registry (`tasks.eval_options`): the OpenCOOD task's `DetectionEvalOptions` (--fusion_method, whose choices
are the registered datasets', --save_vis, ...)."""
import sys
from typing import Optional, Sequence

from opencood_ddp.engine import inference
from opencood_ddp.engine.options import eval_parser
from opencood_ddp.tasks import build_eval, eval_options


def build_parser(argv: Optional[Sequence[str]] = None):
    """The flags `argv` is parsed with: without a readable --model_dir, the default task's."""
    return eval_parser(inference.task_options_of_run(argv, eval_options))


if __name__ == "__main__":
    sys.exit(inference.main(sys.argv[1:], build_eval, eval_options))
