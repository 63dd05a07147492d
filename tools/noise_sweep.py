#!/usr/bin/env python
"""Evaluate one checkpoint under pose noise and communication delay on 1..N processes:
`torchrun --nproc_per_node=N tools/noise_sweep.py --model_dir RUN --fusion_method intermediate
--pos_std 0 0.2 0.4 0.6 --delays_ms 0 100 200 300`; rank 0 writes RUN/noise_sweep.{yaml,md,png} and prints the
table. The AP of every level equals a 1-process run's. See docs/robustness.md, "Noise and delay sweeps".

The flags are inference_ddp.py's (engine.options' `eval_parser` with the OpenCOOD task's `DetectionEvalOptions`)
plus the levels' (`tasks/sweep.py`'s `SweepOptions`); the recipe is `tasks/sweep.py`'s `run_sweep`."""
import sys

from opencood_ddp.tasks import sweep


def build_parser():
    return sweep.sweep_parser()


if __name__ == "__main__":
    sys.exit(sweep.main(sys.argv[1:]))
