"""Saves net_epoch1 once, then net_epoch2 over and over until killed: the test kills it in the middle of a save.

Prints 'saved epoch 1' once the first checkpoint is on disk. The model is large (128 MiB of weights) so that
each save of epoch 2 spends a while between creating its temporary file and renaming it.
"""
import sys
from itertools import count
from pathlib import Path

import torch
from torch import nn

from opencood_ddp import checkpoint_files as ckpt


def main(run_dir: Path) -> None:
    model = nn.Linear(4096, 8192, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ckpt.save_epoch(run_dir, 1, model, {"global_step": 1})
    print("saved epoch 1", flush=True)
    for step in count(2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save_epoch(run_dir, 2, model, {"global_step": step})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
