#!/usr/bin/env python
"""Train on 1..N processes: `python tools/train_ddp.py ...`, `torchrun --nproc_per_node=N tools/train_ddp.py ...`
or `srun python tools/train_ddp.py ...`. See README.md for the batch semantics and resume."""
import sys

from opencood_ddp.engine.train import main
from opencood_ddp.tasks import build_eval, build_task

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], build_task, build_eval))
