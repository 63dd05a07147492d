#!/usr/bin/env python
"""Write the synthetic toy world in OPV2V's on-disk format: `python tools/make_toy_opv2v.py --out DIR --seed 0`.

A complete set with the same seed, scale and format already in DIR is reused, not regenerated (the demo reuses any
complete toy world, through `writer.toy_world_in`). A non-empty DIR that is not a toy set is refused. See
docs/toy_world.md.

`--layout dairv2x` or `--layout v2v4real` writes a copy of the toy world in DAIR-V2X-C's or V2V4Real's layout
into DIR instead: the OPV2V set it copies is `--source` (made there first when it is not complete; DAIR-V2X-C's
needs the road-side unit, which is then added).
"""
import argparse
import sys
from pathlib import Path
from typing import List, Optional

from opencood_ddp.errors import run_tool
from opencood_ddp.toy.config import SCALES
from opencood_ddp.toy.dairv2x_layout import format_dairv2x_summary, write_dairv2x_copy
from opencood_ddp.toy.v2v4real_layout import format_v2v4real_summary, write_v2v4real_copy
from opencood_ddp.toy.writer import format_summary, generate_toy_opv2v

# layout -> (writer of the copy, its summary text, whether its source needs a road-side unit)
LAYOUTS = {"dairv2x": (write_dairv2x_copy, format_dairv2x_summary, True),
           "v2v4real": (write_v2v4real_copy, format_v2v4real_summary, False)}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier toy set)")
    parser.add_argument("--seed", type=int, default=0, help="world seed; the same seed gives identical files")
    parser.add_argument("--scale", choices=SCALES, default="demo",
                        help="'small' for tests (a few seconds), 'demo' to train a small detector, 'dense' small's "
                             "scenes with OPV2V-size clouds (about 90k points) for loading costs")
    parser.add_argument("--binary", action="store_true", help="write binary .pcd instead of OPV2V's ascii")
    parser.add_argument("--rsu", action="store_true",
                        help="add a road-side unit to every scenario (V2XSet style: a LiDAR on a 5 m pole at the "
                             "junction, folder -1); without it the set is the vehicles-only one")
    parser.add_argument("--layout", choices=("opv2v", *LAYOUTS), default="opv2v",
                        help="opv2v (the toy world itself), or a copy of it in DAIR-V2X-C's (dairv2x) or "
                             "V2V4Real's (v2v4real) on-disk layout")
    parser.add_argument("--source", help="--layout dairv2x/v2v4real: the toy OPV2V set to copy, written there "
                                         "first when not complete (default: OUT_opv2v beside OUT)")
    args = parser.parse_args(argv)
    if args.source is not None and args.layout == "opv2v":  # it was ignored: --out was written instead
        parser.error("argument --source: only with --layout dairv2x or v2v4real (the set their copy is made from)")
    return args


def write_layout(args: argparse.Namespace) -> str:
    """The toy set, or its copy in another layout, and the paragraph that says what was written."""
    if args.layout == "opv2v":
        return format_summary(generate_toy_opv2v(args.out, seed=args.seed, scale=args.scale, binary=args.binary,
                                                 rsu=args.rsu))
    write, describe, needs_rsu = LAYOUTS[args.layout]
    out = Path(args.out)
    source = Path(args.source) if args.source else out.with_name(out.name + "_opv2v")
    world = generate_toy_opv2v(source, seed=args.seed, scale=args.scale, binary=args.binary,
                               rsu=args.rsu or needs_rsu)
    return format_summary(world) + "\n" + describe(write(source, out, seed=args.seed))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: write_layout(args))


if __name__ == "__main__":
    sys.exit(main())
