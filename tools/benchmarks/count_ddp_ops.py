#!/usr/bin/env python
"""The aten ops one training step dispatches on each rank: the model alone, in the trainer's DDP, in DDP's defaults.

    torchrun --nproc_per_node=2 tools/benchmarks/count_ddp_ops.py --data data/toy_opv2v \
        --configs toy/point_pillar_intermediate_fusion toy/point_pillar_v2xvit
    torchrun --nproc_per_node=1 tools/benchmarks/count_ddp_ops.py --capture cudagraphs \
        --configs opv2v/point_pillar_intermediate_fusion

Each config's model is built on every rank with the same seed, its batch norms converted as the trainer converts
them (distributed/sync_bn.py), and taken three ways: alone ("no DDP": what the model and its synchronized batch
norms dispatch), in `distributed/ddp.wrap_ddp` (the trainer's build) and in DDP with its defaults (rank 0's buffers
broadcast before each forward, gradients copied out of the buckets, each fresh gradient multiplied into its bucket
alone). Each rank takes its own sample, rank r the r-th of the training set, and `engine/census.count_ops` counts
the second step (forward and loss, backward with DDP's all-reduce, the optimizer's update) of each build. Each DDP
build's line ends with the ops it calls more often than the model alone (+) and less often (-): DDP's own work.
A step launch-bound on a GPU pays for every op (issue 52).

``--capture MODE`` takes each build as the trainer does under ``train_ddp.py --capture MODE`` (DDP wraps
engine/capture.py's CaptureModule) and counts, in the step after the compile and engine/capture.py's
TIMING_WARMUPS, the aten calls made outside the compiled graphs (`engine/census.ops_outside_graphs`): what the host
still launches one by one when the graphs replay, of which DDP's part is the difference from the model alone.

Counted on the CPU with gloo, whose synchronized batch norm is ours (GlooSyncBatchNorm): the forward's counts are
the CPU path's, not the CUDA path's (engine/census.py's cuda_path_on_cpu is for one process); the builds' gap is
DDP's own work, which is the same on either device.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from opencood_ddp.engine.capture import BACKENDS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["toy/point_pillar_intermediate_fusion"],
                        help="paths under hypes_yaml/, no .yaml")
    parser.add_argument("--data", default="data/toy_opv2v", help="toy OPV2V root (tools/make_toy_opv2v.py)")
    parser.add_argument("--capture", choices=sorted(BACKENDS), default=None,
                        help="count each build under train_ddp.py --capture MODE: the calls outside its graphs")
    return parser.parse_args(argv)


ALONE = "no DDP"


def builds() -> dict:
    """Each build's name and how it wraps the model (or its CaptureModule)."""
    from opencood_ddp.distributed.ddp import wrap_ddp

    return {ALONE: lambda module: module,
            "trainer (wrap_ddp)": wrap_ddp,
            "DDP defaults": lambda module: DistributedDataParallel(module, device_ids=None)}


def _counted(task_step, module, batch, optimizer, capture: Optional[str]) -> Tuple[Dict[str, int], str]:
    """(the ops by name, the line's count) of one build's step: every aten call of the second step, or under
    --capture the calls outside the graphs of the step after the compile and the warm-ups."""
    from opencood_ddp.engine.capture import CapturedStep, step_kernels
    from opencood_ddp.engine.census import count_ops, ops_outside_graphs, trainer_step
    from opencood_ddp.engine.step import Precision

    precision = Precision(None, torch.device("cpu"))
    if capture is None:
        count = count_ops(trainer_step(task_step, module, batch, optimizer, precision))
        phases = count.by_phase
        return count.by_op, (f"{count.total:,} ops (forward {phases['forward']:,}, backward {phases['backward']:,}, "
                             f"optimizer {phases['optimizer']:,})")
    step = trainer_step(CapturedStep(), module, batch, optimizer, precision)
    with step_kernels(torch.device("cpu")):
        calls = ops_outside_graphs(step)
    return calls, f"{sum(calls.values()):,} ops outside the compiled graphs ({capture})"


def difference(ops: Dict[str, int], alone: Dict[str, int]) -> str:
    """The ops a build calls more often than the model alone (+), then less often (-), the most first."""
    gaps = {op: ops.get(op, 0) - alone.get(op, 0) for op in set(ops) | set(alone)}
    ranked = sorted(((op, gap) for op, gap in gaps.items() if gap), key=lambda item: (-abs(item[1]), item[0]))
    return ", ".join(f"{gap:+,} {op.replace('aten::', '')}" for op, gap in ranked) or "nothing"


def count_config(config: str, data: Path, rank: int, world_size: int, capture: Optional[str] = None) -> List[str]:
    from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
    from opencood_ddp.engine.capture import CaptureModule
    from opencood_ddp.engine.optim import build_optimizer
    from opencood_ddp.tasks.opencood import build_task
    from opencood_ddp.toy.config import split_overrides
    from opencood_ddp.yaml_parsers import load_parsed_hypes

    hypes = load_parsed_hypes(REPO / "hypes_yaml" / f"{config}.yaml", split_overrides(data))
    torch.manual_seed(0)
    task = build_task(hypes, for_training=True)
    batch = task.collate_train([task.train_set[rank]])
    model, _ = convert_sync_batchnorm(task.model, world_size, "cpu")
    lines, alone = [], {}
    for name, wrap in builds().items():
        # under --capture a CaptureModule of its own per build: dynamo splits a graph under DDP at its buckets
        wrapped = wrap(model if capture is None else CaptureModule(model, task.step, capture, torch.device("cpu")))
        optimizer = build_optimizer(hypes, model.parameters(), float(hypes["optimizer"]["lr"]), kernels_for="cpu")
        ops, counted = _counted(task.step, wrapped, batch, optimizer, capture)
        alone = ops if name == ALONE else alone
        added = "" if name == ALONE else f"; over {ALONE}: {difference(ops, alone)}"
        lines.append(f"rank {rank} {config} {name}: {counted}{added}")
        del wrapped
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from opencood_ddp.distributed import comm
    from opencood_ddp.distributed.env import detect_from_process, distributed_session

    env = detect_from_process()
    with distributed_session(env):
        for config in args.configs:
            lines = count_config(config, Path(args.data), env.rank, env.world_size, args.capture)
            for rank_lines in comm.gather_objects(lines) or []:
                print("\n".join(rank_lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
