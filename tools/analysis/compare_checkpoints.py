#!/usr/bin/env python
"""Compare two net_epoch{N}.pth files: max relative difference of learnable parameters and of BN buffers.

    python tools/analysis/compare_checkpoints.py RUN_A/net_epoch2.pth RUN_B/net_epoch2.pth [--tolerance 1e-4]

Relative difference of one tensor: max|a - b| / max|b|; the largest over tensors is reported.
Exit status 1 when a figure exceeds the tolerance (for scripts).
"""
import argparse
import sys

from opencood_ddp.checkpoint_files import load_file
from opencood_ddp.engine.parity import relative_differences
from opencood_ddp.errors import OpencoodDdpError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("reference")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    try:
        state, reference = load_file(args.checkpoint), load_file(args.reference)
    except OpencoodDdpError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    worst = relative_differences(state, reference)
    for kind, (diff, key) in worst.items():
        print(f"{kind:10s} max relative difference {diff:.3e}" + (f"  ({key})" if key else ""))
    return 0 if max(d for d, _ in worst.values()) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
