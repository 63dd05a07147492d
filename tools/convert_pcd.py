#!/usr/bin/env python
"""Convert a dataset's ASCII .pcd clouds to binary .pcd once: `python tools/convert_pcd.py DATASET_ROOT`.

Every .pcd below the root (OPV2V/V2XSet, V2V4Real, DAIR-V2X-C) that is ascii becomes binary, read back and
compared bit for bit with the original before it takes the original's place; binary ones are skipped. With
`--out MIRROR` the root is left as it is and a complete copy of the dataset is made in MIRROR (the same relative
paths; the other files hard-linked where possible, else copied). Re-running continues an interrupted run. The
exit status is 1 when any file failed, 2 for a bad root or flag. See opencood_ddp/data/pcd_convert.py.
"""
import argparse
import sys
from typing import List, Optional

from tqdm import tqdm

from opencood_ddp.data.pcd_convert import FAILED, default_workers, format_summary, plan_conversion, run_conversion
from opencood_ddp.errors import OpencoodDdpError


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="the dataset folder; every .pcd below it is looked at")
    parser.add_argument("--out", help="write a converted mirror of the dataset here (outside the root) instead of "
                                      "converting in place")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="processes converting files (default: the CPUs this process may use, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be converted; write nothing")
    return parser.parse_args(argv)


def convert(args: argparse.Namespace) -> int:
    plan = plan_conversion(args.root, args.out)
    with tqdm(total=plan.cloud_bytes, unit="B", unit_scale=True, desc="convert .pcd", disable=args.dry_run) as bar:
        def report(result):
            if result.action == FAILED:
                bar.write(f"failed: {result.error}", file=sys.stderr)
            bar.update(result.bytes_before)

        summary = run_conversion(plan, workers=args.workers, dry_run=args.dry_run, on_result=report)
    print(format_summary(summary))
    return 1 if summary.failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return convert(args)
    except OpencoodDdpError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("interrupted: every .pcd is either as it was or converted and verified; run the same command again "
              "to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
