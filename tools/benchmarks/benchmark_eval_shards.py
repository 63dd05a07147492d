#!/usr/bin/env python
"""Evaluation shards, contiguous against balanced by CAVs: each rank's work and the wall time the slowest rank sets.

    python tools/benchmarks/benchmark_eval_shards.py [--data DIR] [--worlds 2 3 4 8] [--passes 2]

A toy world whose test scenarios hold 2 to 7 CAVs (as OPV2V's and V2XSet's do) is written once. Every test frame
is read through the toy AttFuse config's dataset (the evaluation's reading: yaml, clouds, projection, voxels) in
this process, and its time kept (the best of --passes reads). A rank's time is the sum of its frames' times: what
one loader worker spends on its shard. For each world size both shardings are shown: the ranks' CAV-frames and
seconds, and the slowest rank's seconds, which the evaluation waits for.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[2]
HYPES = REPO / "hypes_yaml" / "toy" / "point_pillar_intermediate_fusion.yaml"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/toy_eval_shards", help="toy world folder (written when absent)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--passes", type=int, default=2, help="reads of every frame; the fastest counts")
    return parser.parse_args(argv)


def write_world(folder: Path) -> None:
    from opencood_ddp.toy.config import LidarConfig, ToyWorldConfig
    from opencood_ddp.toy.writer import generate_toy_opv2v

    config = ToyWorldConfig(train_scenarios=1, validate_scenarios=1, test_scenarios=10, frames_per_scenario=12,
                            min_cavs=2, max_cavs=7, min_vehicles=18, max_vehicles=30,
                            lidar=LidarConfig(beams=32, azimuth_steps=768))
    generate_toy_opv2v(folder, seed=0, config=config)


def frame_seconds(dataset, passes: int) -> list[float]:
    """The fastest of `passes` reads of every frame."""
    best = [float("inf")] * len(dataset)
    for _ in range(passes):
        for index in range(len(dataset)):
            start = time.perf_counter()
            dataset[index]
            best[index] = min(best[index], time.perf_counter() - start)
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    from opencood_ddp.data.datasets import build_dataset
    from opencood_ddp.distributed.samplers import EvalShardSampler
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    args = parse_args(argv)
    data = Path(args.data)
    write_world(data)
    overrides = [*split_overrides(data), "train_params.max_cav=7"]
    dataset = build_dataset(load_parsed_hypes(HYPES, overrides), "test", False, seed=0)
    costs = [dataset.sample_cost(index) for index in range(len(dataset))]
    seconds = frame_seconds(dataset, args.passes)
    print(f"{len(dataset)} test frames of {sorted(set(costs))} CAVs, {sum(costs)} CAV-frames, "
          f"{sum(seconds):.2f} s to read them all once (best of {args.passes})")
    print("world | shards     | CAV-frames per rank          | seconds per rank                 | slowest rank s | "
          "spread")
    for world in args.worlds:
        for name, weights in (("contiguous", None), ("balanced", costs)):
            shards = [EvalShardSampler(len(dataset), world, rank, weights).indices for rank in range(world)]
            work = [sum(costs[i] for i in shard) for shard in shards]
            times = [sum(seconds[i] for i in shard) for shard in shards]
            print(f"{world:5d} | {name:10s} | {' '.join(map(str, work)):28s} | "
                  f"{' '.join(f'{t:.2f}' for t in times):32s} | {max(times):14.2f} | {max(work) / min(work):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
