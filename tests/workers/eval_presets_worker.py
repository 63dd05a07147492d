"""torchrun worker: tools/inference_ddp.py's recipe once per --eval_preset in one process group, so that a test
compares every preset's result file on N ranks without starting N launches (the flags are inference_ddp.py's,
without --eval_preset)."""
import sys

from opencood_ddp.engine.entry import run_distributed
from opencood_ddp.engine.inference import run_eval
from opencood_ddp.engine.options import parse_eval_options
from opencood_ddp.tasks import build_eval
from opencood_ddp.tasks.eval_presets import PRESETS
from opencood_ddp.tasks.opencood import DetectionEvalOptions


def main(argv) -> int:
    options = [parse_eval_options([*argv, "--eval_preset", preset], DetectionEvalOptions) for preset in PRESETS]
    return run_distributed(options[0].process, lambda env: [run_eval(option, env, build_eval) for option in options])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
