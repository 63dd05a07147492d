#!/usr/bin/env python
"""Evaluate a run on 1..N processes: `torchrun --nproc_per_node=N tools/inference_ddp.py --model_dir DIR
--fusion_method {early,late,intermediate}`; AP@0.3/0.5/0.7 equal to a 1-process run. See README.md.

The engine's flags are engine.options' `eval_parser`; the detection flags (--fusion_method, whose choices are the
registered datasets', --save_vis, ...) are the OpenCOOD task's `DetectionEvalOptions`."""
import sys

from opencood_ddp.engine import inference
from opencood_ddp.engine.options import eval_parser
from opencood_ddp.tasks import build_eval
from opencood_ddp.tasks.opencood import DetectionEvalOptions


def build_parser():
    return eval_parser(DetectionEvalOptions)


if __name__ == "__main__":
    sys.exit(inference.main(sys.argv[1:], build_eval, DetectionEvalOptions))
