#!/usr/bin/env python
"""Compare two net_epoch{N}.pth files: max relative difference of learnable parameters and of BN buffers.

    python tools/analysis/compare_checkpoints.py RUN_A/net_epoch2.pth RUN_B/net_epoch2.pth [--tolerance 1e-4]

Relative difference of one tensor: max|a - b| / max|b|; the largest over tensors is reported.
Exit status 1 when a figure exceeds the tolerance (for scripts).
"""
import argparse
import math
import sys
from pathlib import Path

from opencood_ddp.checkpoint_files import (CorruptCheckpointError, as_state_dict, describe_mismatch, load_file,
                                          strip_module_prefix)
from opencood_ddp.engine.parity import relative_differences
from opencood_ddp.errors import CheckpointError, OpencoodDdpError


def tolerance(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a relative difference >= 0")
    return value


def weights(path: str) -> dict:
    """The file's state_dict (ours, upstream's, a fork's wrapped one; DDP's `module.` prefix taken off)."""
    if not Path(path).is_file():  # load_file's own line asks for --model_dir / --epoch, which this tool has not
        raise CheckpointError(f"{path} is not a file; pass two checkpoint files")
    try:
        loaded = load_file(path)
    except CorruptCheckpointError as exc:  # its own fix is resume's
        raise CorruptCheckpointError(exc.problem, "restore it, or compare another file") from None
    return strip_module_prefix(as_state_dict(loaded, path))


def check_comparable(state: dict, reference: dict, labels: tuple) -> None:
    """Both hold the same tensors: the differences are taken over every key, so a key only one holds, or a
    tensor of another shape, would leave out what differs (two different models compared 'equal')."""
    mismatch = describe_mismatch(reference, state)
    if mismatch:
        raise CheckpointError(f"{labels[0]} and {labels[1]} are not weights of one model ({mismatch}: 'checkpoint' is "
                              f"the first, 'model' the second); compare two checkpoints of one configuration")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("reference")
    parser.add_argument("--tolerance", type=tolerance, default=1e-4)
    args = parser.parse_args()
    try:
        state, reference = weights(args.checkpoint), weights(args.reference)
        check_comparable(state, reference, (args.checkpoint, args.reference))
    except OpencoodDdpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    worst = relative_differences(state, reference)
    for kind, (diff, key) in worst.items():
        print(f"{kind:10s} max relative difference {diff:.3e}" + (f"  ({key})" if key else ""))
    return 0 if max(d for d, _ in worst.values()) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
