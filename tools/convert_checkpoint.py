#!/usr/bin/env python
"""Turn a checkpoint you trust, which our loaders refuse because its pickle holds Python objects, into plain
weights that load safely everywhere.

    python tools/convert_checkpoint.py --trust IN.pth OUT.pth

Every loader of this project reads checkpoints with torch's safe unpickler (`weights_only=True`): tensors and
containers only, because unpickling anything else can run code, and checkpoints arrive from shared drives and other
people's runs. Some forks save more than weights (an `argparse.Namespace`, a config object) beside the state_dict.
This tool is the one place that unpickles such a file in full, so it asks for `--trust`: do it only for a file whose
source you trust. It writes the model's state_dict alone (the file itself, or its `model` / `state_dict` /
`model_state_dict` / `net` entry), on the CPU, and checks that the result loads with the safe unpickler.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.errors import CheckpointError, ConfigError, first_line, run_tool


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the checkpoint to convert")
    parser.add_argument("target", help="where to write its weights (a new file)")
    parser.add_argument("--trust", action="store_true",
                        help="unpickle the source in full, which runs whatever code it holds: only for a file "
                             "whose source you trust")
    return parser.parse_args(argv)


def convert(args: argparse.Namespace) -> str:
    source, target = Path(args.source), Path(args.target)
    # The paths first: a mistyped one must not be answered with "pass --trust", which would then be asked of a
    # file nobody has looked at.
    if not source.is_file():
        raise CheckpointError(f"{source} is not a file; pass the checkpoint to convert")
    if target.exists():
        raise ConfigError(f"{target} exists; give a new file name")
    if not target.parent.is_dir():
        raise ConfigError(f"{target}: its folder {target.parent} is not there; create it, or give a file in an "
                          f"existing folder")
    if not args.trust:
        raise ConfigError(f"converting {source} unpickles it in full, which runs any code it holds; pass --trust "
                          f"if you trust its source")
    print(f"warning: unpickling {source} with torch.load(weights_only=False), as --trust asked", file=sys.stderr)
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=False)  # the one full unpickling: --trust
    except Exception as exc:  # noqa: BLE001 - whatever a damaged or foreign file makes the unpickler raise
        raise CheckpointError(f"{source} is not a torch checkpoint, or is truncated ({type(exc).__name__}: "
                              f"{first_line(exc)}); pass a net_epoch<N>.pth file") from None
    state = ckpt.strip_module_prefix(ckpt.as_state_dict(loaded, str(source)))
    ckpt.atomic_save({key: value.detach().cpu() for key, value in state.items()}, target)
    reread = ckpt.load_file(target)  # the safe unpickler: what every loader of this project will do
    if set(reread) != set(state):
        raise CheckpointError(f"{target} does not read back as written; delete it and convert again")
    return f"wrote {target}: {len(reread)} tensors, readable with weights_only=True"


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(lambda: convert(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
