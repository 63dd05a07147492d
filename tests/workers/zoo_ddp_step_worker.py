"""Worker: one real DDP training step of every zoo model in one torchrun launch, against the 1-process step.

Usage: torchrun --nproc_per_node=2 zoo_ddp_step_worker.py --toy ROOT --out DIR [--variant NAME CONFIG KEY=VALUE]
                 CONFIG [CONFIG ...]

A ``--variant`` is a config with one ``--set`` more (a model's option no toy config takes, such as V2VNet's
``gru_flag: false``, whose frozen ConvGRU DDP must leave alone); its result is DIR/<NAME>.json.

For each toy config, every rank builds the same model (same seed), converts its BatchNorm as the trainer does (gloo
SyncBatchNorm), wraps it in DistributedDataParallel as the trainer does (distributed/ddp.wrap_ddp: no
find_unused_parameters unless the hypes ask for it: a parameter outside the step's graph would fail the backward
here, which no in-process check can show; fresh gradients copied into a bucket together where torch can) and takes
the training step of one sample per rank, rank r reading sample r. Rank 0 also steps copies of the unconverted model
on the union batch (the ranks' samples in rank order, as the 1-process run collates them), once in float32 and once
in float64. It writes DIR/<config stem>.json with:

- ``ddp_error``: ||DDP gradient - float64 1-process gradient|| / ||float64 1-process gradient||, over all
  parameters at once;
- ``floor``: the same for the float32 1-process gradient: float32's own error on this step, which the DDP
  error is judged against (another summation order of the same float32 arithmetic);
- ``replicas_equal``: whether every rank holds the same gradient (DDP's all-reduce reached every parameter);
- ``buffers_equal``: whether every rank holds the same buffers after the step, bit for bit, with DDP's broadcast of
  rank 0's buffers off as the trainer turns it off (distributed/ddp.buffer_sync): SyncBatchNorm's running
  statistics are the global batch's on every rank;
- ``none_grads``: the parameters left without a gradient on rank 0;
- ``frozen``: the parameters that take no gradient (``requires_grad`` false).
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
from pathlib import Path

import torch

from opencood_ddp.distributed import comm
from opencood_ddp.distributed.env import DistEnv, detect_from_process, distributed_session
from opencood_ddp.distributed.ddp import buffer_sync, buffer_sync_argument, wrap_ddp
from opencood_ddp.distributed.sync_bn import convert_sync_batchnorm
from opencood_ddp.engine.logs import setup_logging
from opencood_ddp.engine.train import seed_everything
from opencood_ddp.hypes import get_key
from opencood_ddp.tasks import build_task
from opencood_ddp.toy.config import split_overrides
from opencood_ddp.yaml_parsers import load_parsed_hypes


def gradients(model: torch.nn.Module) -> dict:
    return {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.grad is not None}


def as_float64(batch):
    """The batch with every floating tensor in float64 (indices and masks as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {key: as_float64(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_float64(value) for value in batch)
    return batch


def one_process_step(model: torch.nn.Module, task, batch) -> dict:
    """The gradient of the 1-process run's step on `batch`: accurate BatchNorm, as the trainer's world size 1."""
    model, _ = convert_sync_batchnorm(model, 1, "cpu")
    model.train()
    task.step(model, batch).total.backward()
    return gradients(model)


def relative_error(got: dict, exact: dict) -> float:
    """||got - exact|| / ||exact|| over every parameter's gradient at once."""
    names = sorted(exact)
    want = torch.cat([exact[n].flatten() for n in names])
    return float(torch.cat([got[n].flatten() for n in names]).sub(want).norm() / want.norm())


def step_config(config: Path, toy: Path, env: DistEnv, extra: tuple[str, ...] = ()) -> dict:
    hypes = load_parsed_hypes(config, [*split_overrides(toy), *extra])
    seed_everything(0)
    task = build_task(hypes, for_training=True)
    samples = [task.train_set[i] for i in range(env.world_size)]
    reference = copy.deepcopy(task.model)
    model, _ = convert_sync_batchnorm(task.model, env.world_size, env.device)
    # every buffer kept equal without a broadcast
    assert buffer_sync(model, env.world_size) == {buffer_sync_argument(): False}
    ddp = wrap_ddp(model, bool(get_key(hypes, "train_params.find_unused_parameters", False)))
    # Where torch's DDP can copy the fresh gradients into a bucket together (2.13), the trainer's build does, and
    # the DDP error below covers that path.
    assert getattr(ddp, "batched_grad_copy", False) == ("batched_grad_copy" in inspect.signature(
        torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    ddp.train()
    task.step(ddp, task.collate_train([samples[env.rank]])).total.backward()
    stepped = gradients(model)
    flat = torch.cat([stepped[name].flatten() for name in sorted(stepped)])
    gathered = comm.gather_objects(flat)
    buffers = comm.gather_objects({name: b.detach().clone() for name, b in model.named_buffers()})
    result = {"none_grads": sorted(name for name, p in model.named_parameters()
                                   if p.requires_grad and p.grad is None),
              "frozen": sorted(name for name, p in model.named_parameters() if not p.requires_grad)}
    if env.is_main:
        result["replicas_equal"] = all(torch.equal(other, gathered[0]) for other in gathered)
        result["buffers_equal"] = all(other.keys() == buffers[0].keys() and
                                      all(torch.equal(other[n], buffers[0][n]) for n in other) for other in buffers)
        union = task.collate_train(samples)
        exact = one_process_step(copy.deepcopy(reference).double(), task, as_float64(union))
        result["floor"] = relative_error(one_process_step(reference, task, union), exact)
        result["ddp_error"] = relative_error(stepped, exact)
    del ddp  # freed before the process group goes
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--toy", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", nargs=3, action="append", default=[], metavar=("NAME", "CONFIG", "KEY=VALUE"))
    parser.add_argument("configs", type=Path, nargs="+")
    args = parser.parse_args()
    runs = [(config.stem, config, ()) for config in args.configs]
    runs += [(name, Path(config), (override,)) for name, config, override in args.variant]
    env = detect_from_process()
    setup_logging(env.rank)
    with distributed_session(env):
        for name, config, extra in runs:
            result = step_config(config, args.toy, env, extra)
            if env.is_main:
                (args.out / f"{name}.json").write_text(json.dumps(result))
        comm.barrier()


if __name__ == "__main__":
    main()
