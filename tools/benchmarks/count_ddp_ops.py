#!/usr/bin/env python
"""The aten ops one DDP training step dispatches on each rank: the trainer's DDP build against DDP's defaults.

    torchrun --nproc_per_node=2 tools/benchmarks/count_ddp_ops.py --data data/toy_opv2v \
        --configs toy/point_pillar_intermediate_fusion toy/point_pillar_v2xvit

Each config's model is built on every rank with the same seed, its batch norms converted as the trainer converts
them (distributed/sync_bn.py), and wrapped twice: by `distributed/ddp.wrap_ddp` (the trainer's build) and with DDP's
defaults (rank 0's buffers broadcast before each forward, gradients copied out of the buckets, each fresh gradient
multiplied into its bucket alone). Each rank takes its own sample, rank r the r-th of the training set, and
`engine/census.count_ops` counts the second step (forward and loss, backward with DDP's all-reduce, the optimizer's
update) of each build. A step launch-bound on a GPU pays for every op (issue 52); the difference between the two
builds is what DDP's settings cost.

Counted on the CPU with gloo, whose synchronized batch norm is ours (GlooSyncBatchNorm): the forward's counts are
the CPU path's, not the CUDA path's (engine/census.py's cuda_path_on_cpu is for one process); the builds' gap is
DDP's own work, which is the same on either device.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["toy/point_pillar_intermediate_fusion"],
                        help="paths under hypes_yaml/, no .yaml")
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (tools/make_toy_opv2v.py)")
    return parser.parse_args(argv)


def builds(model: torch.nn.Module) -> dict:
    from opencood_ddp.distributed.ddp import wrap_ddp

    return {"trainer (wrap_ddp)": lambda: wrap_ddp(model),
            "DDP defaults": lambda: DistributedDataParallel(model, device_ids=None)}


def count_config(config: str, data: Path, rank: int, world_size: int) -> list[str]:
    from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
    from opencood_ddp.engine.census import count_ops, trainer_step
    from opencood_ddp.engine.optim import build_optimizer
    from opencood_ddp.engine.step import Precision
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / f"{config}.yaml", split_overrides(data))
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[rank]])
    model, _ = convert_sync_batchnorm(task.model, world_size, "cpu")
    lines = []
    for name, build in builds(model).items():
        ddp = build()
        optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for="cpu")
        count = count_ops(trainer_step(task.step, ddp, batch, optimizer, Precision(None, torch.device("cpu"))))
        phases = count.by_phase
        lines.append(f"rank {rank} {config} {name}: {count.total} ops (forward {phases['forward']}, backward "
                     f"{phases['backward']}, optimizer {phases['optimizer']})")
        del ddp
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from opencood_ddp.distributed import comm
    from opencood_ddp.distributed.env import detect_from_process, distributed_session

    env = detect_from_process()
    with distributed_session(env):
        for config in args.configs:
            lines = count_config(config, Path(args.data), env.rank, env.world_size)
            for rank_lines in comm.gather_objects(lines) or []:
                print("\n".join(rank_lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
