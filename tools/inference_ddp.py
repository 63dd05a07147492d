#!/usr/bin/env python
"""Evaluate a run on 1..N processes: `torchrun --nproc_per_node=N tools/inference_ddp.py --model_dir DIR
--fusion_method {early,late,intermediate}`; AP@0.3/0.5/0.7 equal to a 1-process run. See README.md."""
import sys

from opencood_ddp.engine.inference import main
from opencood_ddp.tasks import build_eval

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], build_eval))
