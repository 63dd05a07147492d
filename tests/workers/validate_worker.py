"""torchrun worker: the engine's all-reduced validation of one fixed checkpoint at any world size.

Usage: torchrun --nproc_per_node=W validate_worker.py --hypes H --weights net_epochN.pth --out result.json
"""
import argparse
import json
from pathlib import Path

from opencood_ddp import checkpoint_files as ckpt
from opencood_ddp.distributed.batch_plan import make_batch_plan
from opencood_ddp.distributed.env import detect_from_process, distributed_session
from opencood_ddp.engine.logs import setup_logging
from opencood_ddp.engine.options import ProcessOptions, TrainOptions
from opencood_ddp.engine.run_dir import RunSetup
from opencood_ddp.engine.trainer import Trainer
from opencood_ddp.tasks import build_task
from opencood_ddp.yaml_parsers import load_parsed_hypes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hypes", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=6)
    args = parser.parse_args()
    env = detect_from_process()
    setup_logging(env.rank)
    with distributed_session(env):
        validate(args, env)  # in a function: the DDP-wrapped trainer is freed before the group is destroyed


def validate(args, env):
    hypes = load_parsed_hypes(args.hypes)
    task = build_task(hypes, for_training=True)
    ckpt.load_weights(task.model, args.weights)
    plan = make_batch_plan(args.batch_size, env.world_size, 0.0)
    trainer = Trainer(task, plan, env, TrainOptions(process=ProcessOptions(num_workers=0)),
                      RunSetup(Path("."), False, hypes, args.hypes))
    result = trainer.validate()
    if env.is_main:
        with open(args.out, "w") as handle:
            json.dump({"world_size": env.world_size, "per_rank": plan.per_rank, **result}, handle)


if __name__ == "__main__":
    main()
