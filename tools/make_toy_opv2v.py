#!/usr/bin/env python
"""Write the synthetic toy world in OPV2V's on-disk format: `python tools/make_toy_opv2v.py --out DIR --seed 0`.

A complete set with the same seed, scale and format already in DIR is reused, not regenerated (the demo calls
this every time). A non-empty DIR that is not a toy set is refused. See docs/toy_world.md.
"""
import argparse
import sys
from typing import List, Optional

from opencood_ddp.toy.writer import format_summary, generate_toy_opv2v
from opencood_ddp.errors import run_tool


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier toy set)")
    parser.add_argument("--seed", type=int, default=0, help="world seed; the same seed gives identical files")
    parser.add_argument("--scale", choices=("small", "demo"), default="demo",
                        help="'small' for tests (a few seconds), 'demo' to train a small detector")
    parser.add_argument("--binary", action="store_true", help="write binary .pcd instead of OPV2V's ascii")
    parser.add_argument("--rsu", action="store_true",
                        help="add a road-side unit to every scenario (V2XSet style: a LiDAR on a 5 m pole at the "
                             "junction, folder -1); without it the set is the vehicles-only one")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: format_summary(generate_toy_opv2v(args.out, seed=args.seed, scale=args.scale,
                                                              binary=args.binary, rsu=args.rsu)))


if __name__ == "__main__":
    sys.exit(main())
