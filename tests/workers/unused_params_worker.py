"""Worker: the engine's optimizer steps on toy V2X-ViT when no rank, or only some ranks, have a road-side unit.

Usage: python unused_params_worker.py --toy ROOT --out DIR          (1 process, no process group)
       torchrun --nproc_per_node=2 unused_params_worker.py --toy ROOT --out DIR
       (tests/test_zoo_v2xvit.py calls `run` in its own process for world size 1)

The engine's Trainer takes 3 optimizer steps of one sample per rank on the vehicles-only toy world (a transformer
of depth 1, to be quick). In step 2 rank 0 makes CAV 1 of its sample a road-side unit (the prior's
infrastructure flag), the other ranks do not; steps 1 and 3 have none anywhere. Per-rank BatchNorm (sync_bn
off), so that each rank's gradient of its step-2 batch alone can be computed beside the step, on a copy of the
model: DDP's average is the mean of those over the ranks. Each rank saves to DIR/rank{r}.pt, per step: the
names whose gradient was None when the optimizer stepped, the infrastructure projections' values after the step
(and before step 1), and for step 2 the largest relative gap between the gradients it stepped with and the mean
of the ranks' own gradients.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import torch

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.batch_plan import make_batch_plan
from opencood_ddp.distributed.env import DistEnv, detect_from_process, distributed_session
from opencood_ddp.engine.logs import setup_logging
from opencood_ddp.engine.train import seed_everything
from opencood_ddp.engine.options import ProcessOptions, LoopOptions, TrainOptions
from opencood_ddp.engine.run_dir import RunSetup
from opencood_ddp.engine.trainer import Trainer
from opencood_ddp.models.modules.v2xvit_agents import INFRASTRUCTURE, PRIOR_INFRA
from opencood_ddp.models.modules.v2xvit_hmsa import HeteroCavAttention
from opencood_ddp.tasks import build_task
from opencood_ddp.toy.config import split_overrides
from opencood_ddp.yaml_parsers import load_parsed_hypes

TOY_V2XVIT = Path(__file__).resolve().parents[2] / "hypes_yaml" / "toy" / "point_pillar_v2xvit.yaml"
STEPS, RSU_STEP = 3, 2  # 1-based


class RsuOnRankZero:
    """The task's step, with CAV 1 of sample 0 a road-side unit on rank 0 in call `rsu_step`; in that call, the
    gradients of this rank's batch alone on a copy of the model (no DDP) are kept in `local`."""

    def __init__(self, step, rank: int, rsu_step: int):
        self.step, self.rank, self.rsu_step = step, rank, rsu_step
        self.model = None  # the trainer's model_without_ddp, set once the trainer is built
        self.calls, self.local = 0, {}

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == self.rsu_step:
            ego = batch["ego"]
            assert int(ego["record_len"][0]) >= 2, "the first sample needs a cooperator to make a road-side unit"
            if self.rank == 0:
                ego["prior_encoding"][0, 1, PRIOR_INFRA] = 1.0
            alone = copy.deepcopy(self.model)
            self.step(alone, batch).total.backward()
            self.local = {name: p.grad.clone() for name, p in alone.named_parameters() if p.grad is not None}
        return self.step(model, batch)


def infrastructure_names(model: torch.nn.Module) -> list[str]:
    """The parameters of the infrastructure projections of every agent-attention block."""
    ids = {id(p) for m in model.modules() if isinstance(m, HeteroCavAttention)
           for p in m.parameter_groups()[INFRASTRUCTURE]}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def average_gap(stepped: dict, local: dict, world_size: int) -> float:
    """max over parameters of |gradient stepped with - mean over ranks of the ranks' own| / max|mean|."""
    names = sorted(local)
    mean = comm.all_reduce_sum(torch.cat([local[n].flatten().double() for n in names])) / world_size
    worst, offset = 0.0, 0
    for name in names:
        size = local[name].numel()
        want = mean[offset:offset + size]
        offset += size
        got = stepped[name]
        if got is None or not bool(want.abs().max() > 0):
            continue  # None is checked by name; a parameter no rank moved has nothing to average
        worst = max(worst, float((got.flatten().double() - want).abs().max() / want.abs().max()))
    return worst


def run(toy: Path, out: Path, env: DistEnv) -> dict:
    hypes = load_parsed_hypes(TOY_V2XVIT, [*split_overrides(toy), f"train_params.batch_size={env.world_size}",
                                           "model.args.transformer.encoder.depth=1"])
    seed_everything(0)
    task = build_task(hypes, for_training=True)
    step = RsuOnRankZero(task.step, env.rank, RSU_STEP)
    plan = make_batch_plan(env.world_size, env.world_size, float(hypes["optimizer"]["lr"]))
    options = TrainOptions(loop=LoopOptions(sync_bn=False), process=ProcessOptions(num_workers=0))
    setup = RunSetup(Path(out), False, hypes, str(TOY_V2XVIT))
    trainer = Trainer(dataclasses.replace(task, step=step), plan, env, options, setup)
    step.model = trainer.model_without_ddp
    named = dict(trainer.model_without_ddp.named_parameters())
    infra = infrastructure_names(trainer.model_without_ddp)
    stepped = []
    trainer.optimizer.register_step_pre_hook(lambda *_: stepped.append(
        {name: None if p.grad is None else p.grad.clone() for name, p in named.items()}))
    result = {"infra_initial": {n: named[n].detach().clone() for n in infra}, "steps": []}
    for record in trainer.steps(0):
        grads = stepped[record.step - 1]
        result["steps"].append({"none": sorted(n for n, g in grads.items() if g is None),
                                "infra": {n: named[n].detach().clone() for n in infra}})
        if record.step == RSU_STEP:
            result["average_gap"] = average_gap(grads, step.local, env.world_size)
        if record.step == STEPS:  # every rank stops after the same step
            break
    torch.save(result, out / f"rank{env.rank}.pt")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    env = detect_from_process()
    setup_logging(env.rank)
    with distributed_session(env):
        run(args.toy, args.out, env)  # in a function: the DDP-wrapped trainer is freed before the group goes


if __name__ == "__main__":
    main()
